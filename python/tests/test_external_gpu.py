"""Python reads registered memory (issue 20 item 2): a PyTorch tensor of expandable
segments (VMM memory, one descriptor per 20 MiB piece, more pieces than one packet
carries) registered by another process is leased here read-only, through the fd path,
and stays readable after its exporter is killed. Skips without a GPU
(CUDAIPC_REQUIRE_GPU=N fails instead)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest

import cudaipc
from conftest import Daemon, need_gpus, need_module

EXPORTER = r"""
import hashlib, os, sys
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch, cudaipc
g = torch.Generator(device="cuda").manual_seed(int(sys.argv[3]))
t = torch.randint(0, 256, (int(sys.argv[2]),), dtype=torch.uint8, device="cuda", generator=g)
torch.cuda.synchronize()
s = cudaipc.connect(sys.argv[1])
info = s.register("torch/emb", t, shared=True)
print(hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest(), info.size, flush=True)
sys.stdin.readline()   # hold the tensor until told; then exit without freeing
os._exit(0)
"""


@pytest.fixture
def cuda_daemon(cudaipc_bin):
    need_gpus(1)
    d = Daemon(cudaipc_bin, ["--backend", "cuda", "--capacity", "1GiB"])
    yield d
    d.stop()


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_get_of_registered_expandable_segments_is_read_only(cuda_daemon):
    need_module("torch")
    import torch
    from cudaipc import _cuda
    from cudaipc._wire import MAX_FILES
    from cudaipc.mapping import vmm_mapped_count
    size = (MAX_FILES + 17) * (20 << 20) + 12345   # more pieces than one packet's descriptors
    exp = subprocess.Popen([sys.executable, "-c", EXPORTER, cuda_daemon.socket, str(size), "7"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = exp.stdout.readline().decode().split()
        assert len(line) == 2, exp.stderr.read().decode()[-3000:]
        want, n = line[0], int(line[1])
        assert n == size
        with cudaipc.connect(cuda_daemon.socket) as s:
            lease = s.get("torch/emb", timeout=10)
            assert lease.share == "vmm-fd" and lease.size == size and lease.info.external
            r = lease.info.region   # the placement's: a version 2 region over every piece
            assert r is not None and r.size == size and r.version == 2 and len(r.pieces) > MAX_FILES
            assert sha(lease.read()) == want
            assert sha(lease.numpy().tobytes()) == want               # a copy
            t = lease.tensor()
            assert t.is_cuda and t.numel() == size
            assert sha(t.cpu().numpy().tobytes()) == want             # zero-copy on the GPU
            # A second lease maps nothing new: the process-wide mapping cache.
            before = vmm_mapped_count()
            l2 = s.get("torch/emb", timeout=10)
            assert vmm_mapped_count() == before and l2.data_ptr == lease.data_ptr
            l2.release()
            # Read-only: a copy into it fails in the driver and changes nothing (a
            # kernel's store would fault this process's context: not tried here).
            with pytest.raises(cudaipc.CudaError):
                src = bytes(4096)
                import ctypes
                buf = ctypes.create_string_buffer(src)
                with _cuda.on(lease.ordinal):
                    _cuda.memcpy_htod(lease.data_ptr, ctypes.addressof(buf), 4096)
            assert sha(lease.read()) == want
            # The exporter is killed: the mapping keeps the memory.
            exp.kill()
            exp.wait(30)
            assert sha(t.cpu().numpy().tobytes()) == want
            deadline = time.monotonic() + 10   # the daemon notices the exit asynchronously
            while not s.stat("torch/emb").orphaned:
                assert time.monotonic() < deadline, "not orphaned 10 s after its exporter was killed"
                time.sleep(0.02)
            need_module("cupy")
            import cupy
            c = lease.cupy()
            assert sha(cupy.asnumpy(c).tobytes()) == want
            del t, c
            lease.release()
    finally:
        if exp.poll() is None:
            exp.kill()
            exp.wait(30)
