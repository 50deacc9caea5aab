"""Bundles and versions of GPU objects (skip without a GPU; CUDAIPC_REQUIRE_GPU=N fails
instead), against daemons sharing GPU arenas by legacy IPC and by descriptor."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import cudaipc
from cudaipc import bundle as B
from conftest import HERE, need_gpus, need_module
from test_gpu import gpu_daemon, gstore, torch_cuda  # noqa: F401 - fixtures

HELPER = os.path.join(HERE, "helper.py")


def digest(t) -> str:
    import torch
    return hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def state_dict(torch, dev, n=40):
    g = torch.Generator(device=dev).manual_seed(7)
    sd = {"embed": torch.randn(1000, 64, device=dev, generator=g).to(torch.bfloat16)}
    for i in range(n):
        sd["l%d.w" % i] = torch.randn(33, 17, device=dev, generator=g).to(torch.bfloat16)
        sd["l%d.b" % i] = torch.randn(17, device=dev, generator=g)
        sd["l%d.i" % i] = torch.randint(0, 1000, (5,), device=dev, generator=g)
    return sd


def test_gpu_bundle_versions_load_into(gstore, gpu_daemon):
    from cudaipc import _gather
    torch = torch_cuda()
    assert _gather.wait_ready(0) is not None, _gather.unavailable
    sd = state_dict(torch, "cuda:0")
    params = {k: torch.zeros_like(v) for k, v in sd.items()}
    seen = 0
    for v in (1, 2, 3):
        for t in sd.values():
            t.add_(1)
        info = gstore.put_bundle("policy", sd, publish=True)
        assert info.version == v and info.device.startswith("GPU-")
        with gstore.get_bundle("policy", timeout=10, newer_than=seen) as b:
            assert b.version == v
            assert all(t.is_cuda for t in b.values())
            rep = cudaipc.load_into(b, params)
            seen = b.version
        assert rep.tensors == len(sd) and rep.nbytes == sum(t.numel() * t.element_size() for t in sd.values())
        assert rep.method == "kernel", (rep, _cuda_batch_unavailable())
        for k in sd:
            assert torch.equal(params[k], sd[k]), k
    # Another process reads the latest version: the manifest comes beside the lease.
    out = subprocess.run([sys.executable, HELPER, "bundle-digests", gpu_daemon.socket, "policy"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    assert got == {k: digest(v) for k, v in sd.items()}
    # In place: the producer writes the version's own memory.
    w = B.create_bundle(gstore, "policy", {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}, 0, publish=True)
    for k, v in sd.items():
        w.tensors[k].copy_(v * 2 if v.is_floating_point() else v)
    torch.cuda.synchronize()
    w.seal()
    with gstore.get_bundle("policy", timeout=10) as b:
        assert b.version == 4
        assert torch.equal(b["embed"], sd["embed"] * 2)


def test_gpu_bundle_across_gpus(gstore):
    torch = torch_cuda()
    need_gpus(2)
    sd = state_dict(torch, "cuda:1", n=5)
    gstore.put_bundle("x", sd, publish=True)
    params = {k: torch.zeros_like(v, device="cuda:0") for k, v in sd.items()}
    with gstore.get_bundle("x", timeout=10) as b:
        rep = cudaipc.load_into(b, params)
    assert rep.tensors == len(sd)
    for k in sd:
        assert torch.equal(params[k].cpu(), sd[k].cpu()), k


def _cuda_batch_unavailable() -> str:
    from cudaipc import _cuda_ctypes, _gather
    return "batch: %r, kernel: %r" % (_cuda_ctypes.batch_unavailable, _gather.unavailable)


def random_bits(torch, dt, shape, g, dev):
    n = 1
    for d in shape:
        n *= d
    item = torch.empty((), dtype=dt).element_size()
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g, device=dev)
    return raw.view(dt).view(shape).clone()


@pytest.mark.parametrize("kernel", [True, False])
def test_gpu_load_into_many_tensors_bit_exact(gstore, kernel, monkeypatch):
    # 2,000 tensors of random bits (bf16/fp16 NaN payloads included), three versions:
    # one plan, one launch of the gather kernel (or one cuMemcpyBatchAsync) per
    # version, every bit checked; on PyTorch's default stream and on a side stream.
    from cudaipc import _gather, _plan
    monkeypatch.setattr(_gather, "ENABLED", kernel)
    torch = torch_cuda()
    _plan._PLANS.clear()   # (an earlier run's plan fits parameters the allocator put at the same addresses)
    if kernel:
        assert _gather.wait_ready(0) is not None, _gather.unavailable
    dev = "cuda:0"
    g = torch.Generator(device=dev).manual_seed(5)
    dts = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int64]
    shapes = [(37, 129), (5,), (), (0, 4), (256, 512)]
    spec = {"t%d" % i: (dts[i % len(dts)], shapes[i % len(shapes)]) for i in range(2000)}
    params = {k: torch.empty(s, dtype=dt, device=dev) for k, (dt, s) in spec.items()}
    built = 0   # by load_into
    side = torch.cuda.Stream(device=dev)
    seen = 0
    for v, stream in enumerate([None, None, side]):
        sd = {k: random_bits(torch, dt, s, g, dev) for k, (dt, s) in spec.items()}
        gstore.put_bundle("many", sd, publish=True)
        with gstore.get_bundle("many", timeout=10, newer_than=seen) as b:
            seen = b.version
            b0 = B.plan_stats["built"]
            rep = cudaipc.load_into(b, params, stream=stream)
            built += B.plan_stats["built"] - b0
            assert dict.__len__(b) == 0   # no view was made
        assert rep.method == ("kernel" if kernel else "batch"), (rep, _cuda_batch_unavailable())
        assert rep.copy_calls == 1 and rep.tensors == len(spec)
        for k in spec:
            a, e = params[k].reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8)
            assert torch.equal(a, e), (v, k)
    assert built == 1


def test_gpu_gather_kernel_copies_random_ranges_exactly(gstore, monkeypatch):
    """copy_batch with the gather kernel (cudaipc._gather) on random ranges of random
    bytes: any alignment on either side, 1 byte to several chunks, a few beyond
    MAX_BYTES (the batch's): the destination equals what the copies give, byte for
    byte, bytes between the ranges untouched; the kernel was used, not refused."""
    import random
    import numpy as np
    from cudaipc import _cuda_ctypes, _gather
    torch = torch_cuda()
    monkeypatch.setattr(_gather, "MAX_BYTES", 16 << 20)
    assert _gather.wait_ready(0) is not None, _gather.unavailable
    rng = random.Random(23)
    big = _gather.MAX_BYTES + 4097
    src = torch.randint(0, 256, (big + (4 << 20),), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(big + (16 << 20), dtype=torch.uint8, device="cuda:0")
    dsts, srcs, sizes, at = [], [], [], 0
    for k in range(300):
        n = big if k % 150 == 7 else rng.choice([1, 15, 16, 17, 4096, _gather.CHUNK, 3 * _gather.CHUNK + 5,
                                                 rng.randint(1, 200000)])
        at += rng.randint(0, 33)
        if at + n > dst.numel():
            break
        s_ = rng.randrange(0, src.numel() - n + 1)
        dsts.append(dst.data_ptr() + at)
        srcs.append(src.data_ptr() + s_)
        sizes.append(n)
        at += n
    u = np.uint64
    calls, method = _cuda_ctypes.copy_batch(0, 0, np.array(dsts, dtype=u), np.array(srcs, dtype=u),
                                            np.array(sizes, dtype=u), kernel=True)
    assert method == "kernel+batch", (method, _gather.unavailable)
    want = np.zeros(dst.numel(), dtype=np.uint8)
    host = src.cpu().numpy()
    for d, s_, n in zip(dsts, srcs, sizes):
        a, b = d - dst.data_ptr(), s_ - src.data_ptr()
        want[a:a + n] = host[b:b + n]
    assert np.array_equal(dst.cpu().numpy(), want)
    # Copies to and from a bundle in the daemon's arena have their own limit
    # (ARENA_MAX_BYTES, 16 MiB unless CUDAIPC_GATHER_MAX_BYTES is set): with other
    # copies sent wholly to the kernel, the same copies as an arena's still send the
    # big ones to the batch.
    monkeypatch.setattr(_gather, "MAX_BYTES", 1 << 62)
    monkeypatch.setattr(_gather, "ARENA_MAX_BYTES", 16 << 20)
    dst.zero_()
    args = (np.array(dsts, dtype=u), np.array(srcs, dtype=u), np.array(sizes, dtype=u))
    assert _cuda_ctypes.copy_batch(0, 0, *args, kernel=True, arena=True)[1] == "kernel+batch"
    assert np.array_equal(dst.cpu().numpy(), want)
    dst.zero_()
    assert _cuda_ctypes.copy_batch(0, 0, *args, kernel=True)[1] == "kernel"
    assert np.array_equal(dst.cpu().numpy(), want)


def test_gpu_load_into_mismatch_and_fallbacks(gstore):
    torch = torch_cuda()
    sd = {"w": torch.randn(64, 32, device="cuda:0"), "h": torch.arange(10, device="cuda:0")}
    gstore.put_bundle("fb", sd)
    with gstore.get_bundle("fb", timeout=10) as b:
        bad = {"w": torch.zeros(32, 64, device="cuda:0"), "h": torch.zeros(10, dtype=torch.int32, device="cuda:0"),
               "x": torch.zeros(1, device="cuda:0")}
        with pytest.raises(cudaipc.LoadMismatch) as e:
            cudaipc.load_into(b, bad)
        assert len(e.value.problems) == 3 and not bad["w"].any() and not bad["h"].any()
        # Not contiguous on the GPU, and host parameters: PyTorch copies them.
        params = {"w": torch.zeros(32, 64, device="cuda:0").t(), "h": torch.zeros(10, dtype=torch.int64)}
        rep = cudaipc.load_into(b, params)
        assert rep.method == "torch" and rep.tensors == 2
        assert torch.equal(params["w"], sd["w"]) and torch.equal(params["h"], sd["h"].cpu())


def test_gpu_bundle_of_cupy_arrays(gstore, gpu_daemon):
    """A GPU bundle without PyTorch's types: put_bundle of CuPy arrays, get_bundle
    (views="numpy") handing out CuPy arrays, load_into CuPy destinations (contiguous
    ones by the driver's batch, a strided one by a CuPy copy), bytes equal."""
    need_module("cupy")
    import cupy
    import numpy as np
    rng = np.random.default_rng()
    host = {"a": rng.standard_normal((64, 33)).astype(np.float32),
            "b": rng.integers(-100, 100, (1000,), dtype=np.int64),
            "h": rng.integers(0, 2**16, (5, 7), dtype=np.uint16),
            "s": np.array(1.5, dtype=np.float16)}
    with cupy.cuda.Device(0):
        sd = {k: cupy.asarray(v) for k, v in host.items()}
        cupy.cuda.Device(0).synchronize()
    info = gstore.put_bundle("cp", sd, publish=True)
    assert info.device.startswith("GPU-") and info.tensors == len(host)
    with gstore.get_bundle("cp", timeout=10, views="numpy") as b:
        assert b.views == "numpy"
        for k, v in host.items():
            got = b[k]
            assert isinstance(got, cupy.ndarray) and got.dtype == v.dtype and got.shape == v.shape, k
            assert cupy.asnumpy(got).tobytes() == v.tobytes(), k
        with cupy.cuda.Device(0):
            params = {k: cupy.zeros_like(v) for k, v in sd.items()}
            params["b"] = cupy.zeros((2000,), dtype=np.int64)[::2]   # not contiguous
        rep = cudaipc.load_into(b, params)
        assert rep.tensors == len(host) and rep.method.split("+")[-1] == "numpy", rep
        for k, v in host.items():
            assert cupy.asnumpy(params[k]).tobytes() == v.tobytes(), k


def test_gpu_bundle_without_torch(gpu_daemon):
    """A process where torch cannot be imported: a GPU bundle of CuPy arrays
    round-trips, get_bundle hands out CuPy arrays by default, load_into fills CuPy
    arrays."""
    need_gpus(1)
    need_module("cupy")
    script = """
import sys
sys.modules["torch"] = None
import numpy as np, cupy, cudaipc
rng = np.random.default_rng()
host = {"w": rng.standard_normal((129, 31)).astype(np.float32), "i": rng.integers(-5, 5, (77,), dtype=np.int32)}
sd = {k: cupy.asarray(v) for k, v in host.items()}
cupy.cuda.Device(0).synchronize()
with cudaipc.connect(sys.argv[1]) as store:
    store.put_bundle("nt-gpu", sd, 0, publish=True)
    with store.get_bundle("nt-gpu", timeout=10) as b:
        assert b.views == "numpy"
        for k, v in host.items():
            assert isinstance(b[k], cupy.ndarray) and cupy.asnumpy(b[k]).tobytes() == v.tobytes(), k
        out = {k: cupy.zeros_like(v) for k, v in sd.items()}
        rep = cudaipc.load_into(b, out)
        assert rep.tensors == 2 and all(cupy.asnumpy(out[k]).tobytes() == v.tobytes() for k, v in host.items()), rep
print("OK")
"""
    from conftest import PYROOT
    p = subprocess.run([sys.executable, "-c", script, gpu_daemon.socket], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=PYROOT), timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr
