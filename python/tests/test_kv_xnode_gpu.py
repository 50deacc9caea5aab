"""KV spaces in GPU memory read across nodes from Python (docs/kv.md, "Across
nodes"): an engine process registers PyTorch CUDA tensors of random bytes
(cudaMalloc memory, or expandable segments: VMM memory), or host memory, with daemon
a of a cluster; this process registers CUDA tensors (or host memory) of its own with
daemon b and reads scattered blocks through b, which stages them through pinned
host memory (each side's GPU gathers or scatters); every byte checked, layer by
layer, for a read small enough to come in the daemons' control answer and a larger
one fetched in pieces. Skips without a GPU (CUDAIPC_REQUIRE_GPU=N fails instead)
or without etcd and libucx0 (CUDAIPC_REQUIRE_CLUSTER=1 fails instead)."""

import signal

import numpy as np
import pytest

import cudaipc
from clusterutil import cluster_daemons, need_cluster, start_etcd
from conftest import need_gpus, need_module
from cudaipc import kv
from test_kv_host import Engine

import kvutil

DAEMON_ARGS = ["--backend", "cuda", "--capacity", "256MiB"]
SHAPES = [(2, 16, 1024, 3), (8, 96, 32 << 10, 40)]   # layers, blocks, bytes a block, blocks read


@pytest.fixture(scope="module")
def gpu_cluster(cudaipc_bin):
    """Daemons a and b of one cluster, with the cuda backend."""
    need_gpus(1)
    need_module("torch")
    need_cluster()
    with start_etcd() as url, cluster_daemons(cudaipc_bin, url, DAEMON_ARGS) as (a, b):
        yield a, b


def destination(store, name, where, layers, blocks, nbytes):
    """A zeroed sglang-layout space registered through store: CUDA tensors of GPU 0
    (this process's cudaMalloc memory) or alloc_host memory."""
    if where == "gpu":
        import torch
        local = kvutil.make_local("sglang", layers, blocks, nbytes,
                                  lambda shape: torch.zeros(shape, dtype=torch.uint8, device="cuda:0"))
        torch.cuda.synchronize()
    else:
        local = kvutil.make_local("sglang", layers, blocks, nbytes, lambda shape: kv.alloc_host(shape))
    return kv.register(store, name, local)


@pytest.mark.parametrize("src,dst", [("gpu-vmm", "gpu"), ("gpu", "gpu"), ("gpu-vmm", "host"), ("", "gpu")])
def test_gpu_spaces_across_nodes(gpu_cluster, src, dst):
    a, b = gpu_cluster
    rng = np.random.default_rng(7)
    with cudaipc.connect(b.socket) as reader:
        for layers, blocks, nbytes, n in SHAPES:
            name = "xgpu/%s-%s/%d" % (src or "host", dst, nbytes)
            e = Engine(a.socket, name, "vllm", seed=n, layers=layers, blocks=blocks, nbytes=nbytes, gpu=src)
            try:
                assert e.desc.node == "a"
                assert all(r.device.startswith("GPU-") == bool(src) for r in e.desc.regions)
                with destination(reader, "decode/" + name, dst, layers, blocks, nbytes) as sp:
                    src_ids = [int(x) for x in rng.permutation(blocks)[:n]]
                    dst_ids = [int(x) for x in rng.permutation(blocks)[:n]]
                    before = [kvutil.host_region(m).copy() for m in sp.local.memory]
                    t = kv.read_blocks(reader, e.desc, src_ids, sp, dst_ids)
                    for layer in range(layers):
                        t.wait_layer(layer, 60)
                        want = kvutil.expected(e.desc, e.seed, sp.local, src_ids, dst_ids, range(layer + 1), before)
                        for i in (2 * layer, 2 * layer + 1):   # the layer's K and V regions
                            assert np.array_equal(kvutil.host_region(sp.local.memory[i]), want[i]), (layer, i)
                    t.wait(60)
                    kvutil.check_bytes(sp.local, kvutil.expected(e.desc, e.seed, sp.local, src_ids, dst_ids,
                                                                 range(layers), before))
            finally:
                e.stop()


def test_gpu_engine_killed_before_the_read(gpu_cluster):
    """A GPU engine killed (SIGKILL) before the read: a BlockError naming the
    destination blocks, from layer 0, caused by NotFound; this process's GPU and
    both daemons stay usable."""
    import torch
    a, b = gpu_cluster
    e = Engine(a.socket, "xgpu/killed", "vllm", seed=9, layers=2, blocks=16, nbytes=1024, gpu="gpu-vmm")
    try:
        with cudaipc.connect(b.socket) as reader, destination(reader, "decode/xgpu/killed", "gpu", 2, 16, 1024) as sp:
            kv.read_blocks(reader, e.desc, [1], sp, [1]).wait(60)
            e.proc.send_signal(signal.SIGKILL)
            e.proc.wait(10)
            with cudaipc.connect(a.socket) as sa:
                kvutil.wait_gone(sa, e.desc.region_name(0))
            with pytest.raises(kv.BlockError) as x:
                kv.read_blocks(reader, e.desc, [4, 5], sp, [6, 7]).wait(60)
            assert x.value.blocks == [6, 7] and x.value.layer == 0 and isinstance(x.value.cause, cudaipc.NotFound)
            assert torch.ones(4, device="cuda:0").sum().item() == 4
            fresh = Engine(a.socket, "xgpu/fresh", "vllm", seed=10, layers=2, blocks=16, nbytes=1024, gpu="gpu")
            try:
                before = [kvutil.host_region(m).copy() for m in sp.local.memory]
                kv.read_blocks(reader, fresh.desc, [3, 2], sp, [0, 1]).wait(60)
                kvutil.check_bytes(sp.local, kvutil.expected(fresh.desc, fresh.seed, sp.local, [3, 2], [0, 1], range(2), before))
            finally:
                fresh.stop()
    finally:
        e.stop()
