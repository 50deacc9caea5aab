"""KV spaces on a GPU (cudaipc.kv): an engine process registers vLLM-layout PyTorch
CUDA tensors of random bytes (cudaMalloc memory, shared by legacy IPC, or expandable
segments, VMM memory shared by descriptor); this process reads scattered blocks into
CUDA tensors of its own with one gather kernel launch a layer, waits layer by layer,
and checks every byte. Skips without a GPU (CUDAIPC_REQUIRE_GPU=N fails instead).

The first test needs no GPU: the GPU path's copy list, applied to host memory, gives
what the host path gives."""

import ctypes
import signal
import time

import numpy as np
import pytest

import cudaipc
from conftest import Daemon, need_gpus, need_module
from cudaipc import kv
from cudaipc import _kvgpu, _kvread

import kvutil
from test_kv_host import BLOCKS, BYTES, LAYERS, Engine, dst_local, snapshot

SRC = [2, 3, 4, 5, 9, 0, 17, 16, 23, 11, 12]
DST = [7, 8, 9, 10, 1, 23, 3, 2, 0, 14, 15]


class _FakeLease:
    def __init__(self, m):
        self.data_ptr = m.addr


@pytest.mark.parametrize("kinds", [("vllm", "vllm"), ("vllm-blocks-first", "sglang"), ("offload", "vllm-one-buffer")])
def test_gpu_copy_list_on_host_memory(kinds):
    """_kvgpu.copies (the gather kernel's copies, layer by layer) over host memory
    standing in for device memory: applied with memmove they give every byte the
    read must."""
    src_kind, dst_kind = kinds
    src = kvutil.make_local(src_kind, LAYERS, BLOCKS, BYTES, lambda shape: np.zeros(shape, dtype=np.uint8))
    kvutil.fill(src, 21)
    desc = kv.Desc("0:kv/fake", kv.new_id(), [kv.Region("host", m.size) for m in src.memory], src.layout)
    dst = dst_local(dst_kind)
    before = snapshot(dst)
    p = _kvread.plan(desc, SRC, dst, DST, range(1, LAYERS))
    groups = _kvgpu.copies(p, [_FakeLease(m) for m in src.memory])
    assert len(groups) == LAYERS - 1
    for d, s, n in groups:
        assert d.dtype == s.dtype == n.dtype == np.uint64
        for dd, ss, nn in zip(d.tolist(), s.tolist(), n.tolist()):
            ctypes.memmove(dd, ss, nn)
    kvutil.check_bytes(dst, kvutil.expected(desc, 21, dst, SRC, DST, range(1, LAYERS), before))


def _mixed_local(nbytes):
    """A vLLM-like space whose K parts are contiguous and V parts interleaved with
    padding (stride twice the bytes): parts of both kinds in one read."""
    ks = [np.zeros((BLOCKS, nbytes), dtype=np.uint8) for _ in range(LAYERS)]
    vs = [np.zeros((BLOCKS, 2 * nbytes), dtype=np.uint8) for _ in range(LAYERS)]
    layers = [[kv.Part(2 * i, 0, nbytes, nbytes), kv.Part(2 * i + 1, 0, 2 * nbytes, nbytes)] for i in range(LAYERS)]
    return kv.Local(kv.Layout(BLOCKS, layers), [a for pair in zip(ks, vs) for a in pair])


@pytest.mark.parametrize("kinds,nbytes", [(("vllm", "vllm"), BYTES), (("vllm", "vllm"), 48 << 10),
                                          (("vllm-blocks-first", "sglang"), BYTES), (("offload", "vllm-one-buffer"), 40 << 10),
                                          (("vllm", "mixed"), BYTES), (("sglang", "mixed"), 48 << 10)])
def test_gpu_table_on_host_memory(kinds, nbytes):
    """_kvgpu.table (the whole read's chunk table, computed for all layers at once)
    is the rows of _gather.chunk_table of each layer's copies, layer after layer,
    with each layer's row count; runs past a chunk (48 KiB blocks, runs of three)
    cut; parts of both kinds in one read (mixed) too. Applied with memmove over
    host memory standing in for device memory, it gives every byte the read must."""
    from cudaipc import _gather
    src_kind, dst_kind = kinds
    src = kvutil.make_local(src_kind, LAYERS, BLOCKS, nbytes, lambda shape: np.zeros(shape, dtype=np.uint8))
    kvutil.fill(src, 22)
    desc = kv.Desc("0:kv/fake", kv.new_id(), [kv.Region("host", m.size) for m in src.memory], src.layout)
    dst = _mixed_local(nbytes) if dst_kind == "mixed" else \
        kvutil.make_local(dst_kind, LAYERS, BLOCKS, nbytes, lambda shape: np.zeros(shape, dtype=np.uint8))
    before = snapshot(dst)
    src_ids = [2, 3, 4, 9, 0, 17, 16, 23, 11, 12, 13]
    dst_ids = [7, 8, 9, 1, 23, 3, 2, 0, 14, 15, 16]
    for layers in (None, range(1, LAYERS), 2):
        p = _kvread.plan(desc, src_ids, dst, dst_ids, layers)
        leases = [_FakeLease(m) for m in src.memory]
        tab, rows = _kvgpu.table(p, leases)
        want = [_gather.chunk_table(d, s, n) for d, s, n in _kvgpu.copies(p, leases)]
        assert tab.dtype == np.uint64 and tab.shape[1] == 3
        assert rows == [len(w) for w in want] and np.array_equal(tab, np.concatenate(want))
        if nbytes > _gather.CHUNK // 3:
            assert len(tab) > len(p.runs) * 2 * p.count   # some runs cut into chunks
        for dd, ss, nn in tab.tolist():
            ctypes.memmove(dd, ss, nn)
    kvutil.check_bytes(dst, kvutil.expected(desc, 22, dst, src_ids, dst_ids, range(LAYERS), before))


@pytest.fixture
def cuda_daemon(cudaipc_bin):
    need_gpus(1)
    need_module("torch")
    d = Daemon(cudaipc_bin, ["--backend", "cuda", "--capacity", "256MiB"])
    yield d
    d.stop()


def cuda_local(kind, blocks=BLOCKS, nbytes=BYTES):
    import torch
    local = kvutil.make_local(kind, LAYERS, blocks, nbytes, lambda shape: torch.zeros(shape, dtype=torch.uint8, device="cuda:0"))
    torch.cuda.synchronize()
    return local


@pytest.mark.parametrize("memory", ["gpu", "gpu-vmm"])
@pytest.mark.parametrize("kind", ["vllm", "vllm-blocks-first"])
def test_gpu_read_scattered_blocks(cuda_daemon, memory, kind):
    """Scattered blocks of a vLLM space on GPU 0 into this process's CUDA tensors,
    layer by layer: each layer's bytes are there when its wait returns."""
    e = Engine(cuda_daemon.socket, "kv/gpu-%s-%s" % (memory, kind), kind, seed=31, gpu=memory)
    try:
        assert all(r.device.startswith("GPU-") for r in e.desc.regions)
        with cudaipc.connect(cuda_daemon.socket) as store:
            info = store.stat(e.desc.region_name(0))
            assert info.space == e.desc.to_bytes() and info.exporter_bound == (memory == "gpu")
            dst = cuda_local(kind)
            before = snapshot(dst)
            t = kv.read_blocks(store, e.desc, SRC, dst, DST)
            for layer in range(LAYERS):
                t.wait_layer(layer, 60)
                want = kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(layer + 1), before)
                assert np.array_equal(kvutil.host_region(dst.memory[layer]), want[layer]), "layer %d" % layer
            t.wait(60)
            kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(LAYERS), before))
            # Many blocks, a layer range, again (the leases' mappings cached).
            ids = list(range(BLOCKS))
            kv.read_blocks(store, e.desc, ids, dst, ids[::-1], layers=range(2, 4)).wait(60)
            want = kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(LAYERS), before)
            want = kvutil.expected(e.desc, e.seed, dst, ids, ids[::-1], range(2, 4), want)
            kvutil.check_bytes(dst, want)
            # GPU memory into host memory: not in this version.
            with pytest.raises(kv.KVNotSupported):
                kv.read_blocks(store, e.desc, [0], dst_local(kind), [0])
    finally:
        e.stop()


@pytest.mark.parametrize("memory", ["gpu", "gpu-vmm"])
def test_gpu_killed_engine(cuda_daemon, memory):
    """A killed engine's GPU space: a later read fails with a BlockError naming the
    destination blocks (NotFound), and this process's GPU stays usable."""
    import torch
    e = Engine(cuda_daemon.socket, "kv/gpu-killed-%s" % memory, "vllm", seed=32, gpu=memory)
    try:
        with cudaipc.connect(cuda_daemon.socket) as store:
            dst = cuda_local("vllm")
            kv.read_blocks(store, e.desc, [1], dst, [1]).wait(60)
            e.proc.send_signal(signal.SIGKILL)
            e.proc.wait(10)
            deadline = time.monotonic() + 20
            while True:
                try:
                    store.stat(e.desc.region_name(0))
                except cudaipc.NotFound:
                    break
                assert time.monotonic() < deadline, "the killed engine's region is still there"
                time.sleep(0.02)
            with pytest.raises(kv.BlockError) as x:
                kv.read_blocks(store, e.desc, [4, 5], dst, [6, 7]).wait(60)
            assert x.value.blocks == [6, 7] and isinstance(x.value.cause, cudaipc.NotFound)
            assert torch.ones(4, device="cuda:0").sum().item() == 4
    finally:
        e.stop()


def test_gpu_reads_waited_every_way(cuda_daemon):
    """GPU reads one after another on the streams and table buffers the reads keep:
    one waited for at once (it runs on this thread: its layers complete at its last
    event), one waited for layer by layer (on a worker, a layer marked complete as
    its event is reached), a large one that grows the table buffer, then small ones
    in it again, and several at once from threads; every byte checked each time."""
    import threading
    e = Engine(cuda_daemon.socket, "kv/gpu-waits", "vllm", seed=33, gpu="gpu-vmm", blocks=BLOCKS)
    try:
        with cudaipc.connect(cuda_daemon.socket) as store:
            dst = cuda_local("vllm")
            want = snapshot(dst)
            rng = np.random.default_rng(8)

            def read(kind, src, dsts):
                nonlocal want
                t = kv.read_blocks(store, e.desc, src, dst, dsts)
                if kind == "layers":
                    for layer in range(LAYERS):
                        t.wait_layer(layer, 60)
                        w = kvutil.expected(e.desc, e.seed, dst, src, dsts, range(layer + 1), want)
                        assert np.array_equal(kvutil.host_region(dst.memory[layer]), w[layer]), "layer %d" % layer
                t.wait(60)
                want = kvutil.expected(e.desc, e.seed, dst, src, dsts, range(LAYERS), want)
                kvutil.check_bytes(dst, want)

            read("wait", SRC, DST)
            read("layers", DST, SRC)
            every = list(range(BLOCKS))
            read("wait", every, rng.permutation(BLOCKS).tolist())
            tables = [s.table for s in _kvgpu._free.get(0, [])]
            assert tables and all(tables)
            for _ in range(3):
                read("wait", SRC, DST)
                read("layers", rng.permutation(BLOCKS)[:5].tolist(), rng.permutation(BLOCKS)[:5].tolist())
            assert set(s.table for s in _kvgpu._free.get(0, [])) >= set(tables)   # kept, not made again
            # Several reads at once into disjoint blocks, from threads.
            perm = rng.permutation(BLOCKS).tolist()
            jobs = [(perm[k::4], perm[k::4][::-1]) for k in range(4)]
            errs = []

            def run(src):
                try:
                    kv.read_blocks(store, e.desc, src, dst, src[::-1]).wait(60)
                except BaseException as x:  # noqa: BLE001
                    errs.append(x)
            ths = [threading.Thread(target=run, args=(s,)) for s, _ in jobs]
            for th in ths:
                th.start()
            for th in ths:
                th.join(120)
            assert not errs
            for s, d in jobs:
                want = kvutil.expected(e.desc, e.seed, dst, s, d, range(LAYERS), want)
            kvutil.check_bytes(dst, want)
    finally:
        e.stop()
