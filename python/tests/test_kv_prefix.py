"""Prefix caching of a small torch model through a cluster-wide KV block pool (the CPU
twin of test_kv_prefix_gpu.py; docs/kv.md, "Across the cluster"): process A, on daemon
a of a three-node cluster, prefills a long shared prefix and puts its blocks (keys:
chained content hashes of the blocks' tokens); process B, on daemon b, looks a prompt
of that prefix and a suffix up, gets the cached blocks into its own paged cache, prefills
only the suffix and generates: its tokens and logits equal a whole prefill's. The times
to first token with and without the cache are printed (pytest -s shows them). The roles
are in kv_prefix.py. Needs Debian's etcd-server and libucx0; skipped without them unless
CUDAIPC_REQUIRE_CLUSTER=1."""

from __future__ import annotations

import cudaipc
import pytest

from clusterutil import cluster_daemons, start_etcd
from cudaipc import kv

torch = pytest.importorskip("torch")

from kv_model import BLOCK_SIZE, ModelConfig  # noqa: E402
from kv_prefix import POOL, block_keys, check_cached, prefix_cached  # noqa: E402

CFG = ModelConfig(kind="tiny", layers=3)
PREFIX, SUFFIX, STEPS = 1024, 37, 8


def test_block_keys_chain() -> None:
    # A key names its block's tokens and every block before: equal prefixes, equal
    # keys; a token changed changes its block's key and every later one; a partial
    # last block has none.
    ids = list(range(100))
    keys = block_keys(ids)
    assert len(keys) == 100 // BLOCK_SIZE and all(len(k) == 32 for k in keys)
    assert block_keys(ids[:64]) == keys[:4]
    other = list(ids)
    other[40] += 1
    changed = block_keys(other)
    assert changed[:2] == keys[:2] and all(a != b for a, b in zip(changed[2:], keys[2:]))


@pytest.mark.parametrize("stage", [False, True], ids=["host-cache", "staged"])
def test_prefix_put_by_one_process_serves_another_on_another_node(cudaipc_bin, tmp_path, record_property, stage) -> None:
    # staged: the model's paged caches are not the pool's source and destination but
    # copied to and from host copies of them, as on a GPU (test_kv_prefix_gpu.py).
    with start_etcd() as url, cluster_daemons(cudaipc_bin, url, ["--backend", "host", "--capacity", "256MiB"],
                                              names=["a", "b", "c"]) as (a, b, c):
        put, serve, res = prefix_cached(CFG, PREFIX, SUFFIX, STEPS, a.socket, b.socket, str(tmp_path / "out.pt"),
                                        stage=stage)
        check_cached(put, serve, res, PREFIX, rtol=1e-4, atol=1e-4)
        assert serve["staging"] == ("host" if stage else None), serve
        # A's blocks lie on the three nodes; B's daemon holds them all now (copies
        # of the other nodes' it fetched).
        held = {}
        for d in (a, b, c):
            with cudaipc.connect(d.socket) as s:
                held[d.socket] = kv.stat_pool(s, POOL).blocks
        full = PREFIX // BLOCK_SIZE
        assert held[b.socket] == full and held[a.socket] > 0 and held[c.socket] > 0, held
    msg = ("prefix %d + suffix %d tokens, %d cached blocks: time to first token %.1f ms whole, %.1f ms from the pool"
           " (blocks of other nodes), %.1f ms (blocks this daemon kept)"
           % (PREFIX, SUFFIX, serve["cached_blocks"], 1e3 * serve["ttft_full"], 1e3 * serve["ttft_cached_remote"],
              1e3 * serve["ttft_cached_local"]))
    print(msg)
    record_property("ttft", msg)
