"""Prefix caching of a transformers Llama (random weights from a ``LlamaConfig``:
nothing is downloaded) on a GPU through a cluster-wide KV block pool: process A, on
daemon a of a three-node cluster, prefills a long shared prefix on the GPU and puts its
blocks (chained content-hash keys); process B, on daemon b, looks a prompt of that
prefix and a suffix up, gets the cached blocks, prefills only the suffix on the GPU and
generates greedily: tokens equal a whole prefill's, logits to 2e-3 (float32, the
suffix's attention over the same keys and values shaped differently). Pools hold host
memory: A's blocks go to the pool from a host copy of its GPU cache, and B's come into a
host copy that it copies to the GPU layer by layer (kv_prefix.STAGING). The times to
first token with and without the cache are printed (pytest -s). test_kv_prefix.py is
the CPU twin. Skips without a GPU, torch or transformers unless CUDAIPC_REQUIRE_GPU is
set, and without etcd and libucx0 unless CUDAIPC_REQUIRE_CLUSTER=1."""

from __future__ import annotations

import importlib.util
import os

import pytest

import cudaipc
from clusterutil import cluster_daemons, start_etcd
from conftest import need_gpus, need_module
from cudaipc import kv

try:
    import torch  # noqa: F401 (kv_prefix's)
except ImportError:
    if os.environ.get("CUDAIPC_REQUIRE_GPU"):
        raise
    pytest.skip("torch is not installed", allow_module_level=True)

from kv_model import BLOCK_SIZE, ModelConfig  # noqa: E402
from kv_prefix import POOL, check_cached, prefix_cached  # noqa: E402

PREFIX, SUFFIX, STEPS = 2048, 100, 8


def _need_stack() -> None:
    need_gpus(1)
    need_module("torch")
    if not torch.cuda.is_available():
        need_gpus(10**6)   # fails under CUDAIPC_REQUIRE_GPU, skips otherwise
    if importlib.util.find_spec("transformers") is None:
        if os.environ.get("CUDAIPC_REQUIRE_GPU"):
            pytest.fail("CUDAIPC_REQUIRE_GPU is set but transformers is not importable")
        pytest.skip("transformers is not installed")


def test_llama_prefix_put_by_one_process_serves_another_on_another_node(cudaipc_bin, tmp_path, record_property) -> None:
    _need_stack()
    cfg = ModelConfig(kind="llama", vocab=1000, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, mlp=512,
                      seed=1234, dtype="float32", device="cuda:0")
    with start_etcd() as url, cluster_daemons(cudaipc_bin, url, ["--backend", "cuda", "--capacity", "256MiB"],
                                              names=["a", "b", "c"]) as (a, b, c):
        put, serve, res = prefix_cached(cfg, PREFIX, SUFFIX, STEPS, a.socket, b.socket, str(tmp_path / "out.pt"))
        check_cached(put, serve, res, PREFIX, rtol=2e-3, atol=2e-3)
        assert serve["staging"] == "host", serve
        with cudaipc.connect(b.socket) as s:
            assert kv.stat_pool(s, POOL).blocks == PREFIX // BLOCK_SIZE
    msg = ("Llama on %s: prefix %d + suffix %d tokens, %d cached blocks: time to first token %.1f ms whole, %.1f ms"
           " from the pool (blocks of other nodes), %.1f ms (blocks this daemon kept); GPU blocks staged through host"
           % (torch.cuda.get_device_name(0), PREFIX, SUFFIX, serve["cached_blocks"], 1e3 * serve["ttft_full"],
              1e3 * serve["ttft_cached_remote"], 1e3 * serve["ttft_cached_local"]))
    print(msg)
    record_property("ttft", msg)
