"""Disaggregated prefill and decode of a small torch model through host-memory KV
spaces (the CPU twin of test_kv_model_gpu.py): a prefill process pages each prompt's
KV cache into a paged space of its own (vLLM's layout, 16-token blocks at scattered
ids) and registers it; a decode process reads each request's blocks into its own
paged space with one read, rebuilds the cache layer by layer and generates; its
tokens and logits equal one process doing both. The decode process's daemon is the
prefill's, or another node of a cluster (NODES in kv_model.py: etcd and libucx0
needed, else skipped unless CUDAIPC_REQUIRE_CLUSTER=1). The roles and the model are in
kv_model.py."""

from __future__ import annotations

import os
from typing import Iterator, Tuple

import pytest

import cudaipc
from cudaipc import kv
from conftest import Daemon
from test_cluster_partial import etcd  # noqa: F401 (the fixture, for NODES' "two-nodes")

torch = pytest.importorskip("torch")

from kv_model import (BLOCK_SIZE, NODES, ModelConfig, TinyModel, check_decoded, disaggregate,  # noqa: E402
                      killed_prefill, page_in, page_in_layer, page_out, paged_cache, prompt, scattered, slot_mapping)
from kv_model import daemons as kv_daemons  # noqa: E402

CFG = ModelConfig(kind="tiny", layers=3)
LENGTHS = [16, 37, 100, 256]
STEPS = 8


def test_cache_then_step_equals_one_forward() -> None:
    # The model's cache is what later tokens attend to: a prompt run in two pieces, the
    # second after the first's cache, gives one forward's logits.
    torch.manual_seed(0)
    m = TinyModel(CFG)
    ids = prompt(CFG, 37)
    full, _ = m.forward(ids, None)
    a, cache = m.forward(ids[:, :21], None)
    b, cache = m.forward(ids[:, 21:], cache)
    torch.testing.assert_close(torch.cat((a, b), dim=1), full, rtol=1e-4, atol=1e-4)
    assert all(k.shape == (1, CFG.kv_heads, 37, CFG.head_dim) for k, _ in cache)
    # And the cache matters: without it the second piece's logits differ.
    c, _ = m.forward(ids[:, 21:], None)
    assert not torch.allclose(c, full[:, 21:], atol=1e-2)


def test_slot_mapping_is_vllms() -> None:
    assert slot_mapping([5, 2], 20).tolist() == [80 + i for i in range(16)] + [32, 33, 34, 35]
    try:
        slot_mapping([5, 2, 9], 20)
    except ValueError as e:
        assert "20 tokens take 2 blocks" in str(e)
    else:
        raise AssertionError("three blocks for 20 tokens accepted")


def test_page_in_lays_tokens_in_vllm_blocks() -> None:
    # Token i of K (and V) is row i % 16 of block blocks[i // 16], in part 0 (1) of the
    # layer's [2, num_blocks, block_size, kv_heads, head_dim] tensor.
    g = torch.Generator().manual_seed(1)
    seq, nb = 37, 10
    k = torch.randn(1, CFG.kv_heads, seq, CFG.head_dim, generator=g)
    v = torch.randn(1, CFG.kv_heads, seq, CFG.head_dim, generator=g)
    paged = torch.randn(2, nb, BLOCK_SIZE, CFG.kv_heads, CFG.head_dim, generator=g)
    before = paged.clone()
    blocks = [7, 2, 5]
    page_in_layer(k, v, paged, blocks)
    for i in range(seq):
        b, r = blocks[i // BLOCK_SIZE], i % BLOCK_SIZE
        assert torch.equal(paged[0, b, r], k[0, :, i])
        assert torch.equal(paged[1, b, r], v[0, :, i])
    # Nothing else moved: other blocks, and the last block's rows past the sequence.
    touched = torch.zeros(nb, BLOCK_SIZE, dtype=torch.bool)
    for i in range(seq):
        touched[blocks[i // BLOCK_SIZE], i % BLOCK_SIZE] = True
    assert torch.equal(paged[:, ~touched], before[:, ~touched])


def test_page_in_then_out_round_trips() -> None:
    # A real cache, every prompt length, scattered blocks (one request's blocks beside
    # another's in the same paged cache), in float32 and bfloat16.
    for dtype in ("float32", "bfloat16"):
        cfg = ModelConfig(kind="tiny", layers=2, dtype=dtype)
        m = TinyModel(cfg)
        nb = sum(-(-n // BLOCK_SIZE) for n in LENGTHS)
        paged = paged_cache(cfg, nb)
        assert paged[0].shape == (2, nb, BLOCK_SIZE, cfg.kv_heads, cfg.head_dim)
        free = scattered(nb, 3)
        assert sorted(free) == list(range(nb)) and free != list(range(nb))
        caches = {}
        for n in LENGTHS:
            _, cache = m.prefill(prompt(cfg, n))
            blocks, free = free[:-(-n // BLOCK_SIZE)], free[-(-n // BLOCK_SIZE):]
            page_in(cache, paged, blocks)
            caches[n] = (cache, blocks)
        for n, (cache, blocks) in caches.items():
            back = page_out(paged, blocks, n)
            for (k, v), (k2, v2) in zip(cache, back):
                assert k2.is_contiguous() and k2.dtype == k.dtype
                assert torch.equal(k, k2) and torch.equal(v, v2)


def test_decode_from_a_paged_copy_equals_one_process() -> None:
    # In one process: decoding from a cache rebuilt from pages (through a second paged
    # cache at other blocks, as the decode side holds it) equals decoding from the
    # prefill's own cache, bit for bit.
    from kv_model import decode, reference
    ref = reference(CFG, LENGTHS, STEPS)
    m = TinyModel(CFG)
    src, dst = paged_cache(CFG, 40), paged_cache(CFG, 64)
    for n in LENGTHS:
        last, cache = m.prefill(prompt(CFG, n))
        nb = -(-n // BLOCK_SIZE)
        sb, db = scattered(40, n)[:nb], scattered(64, n + 1)[:nb]
        page_in(cache, src, sb)
        for s, d in zip(src, dst):
            d[:, db] = s[:, sb]
        tokens, logits = decode(m, page_out(dst, db, n), int(torch.argmax(last)), STEPS)
        assert tokens == ref[n]["tokens"]
        assert torch.equal(logits, ref[n]["logits"])


@pytest.fixture(params=NODES)
def daemons(request, cudaipc_bin: str) -> Iterator[Tuple[Daemon, Daemon]]:
    """(the prefill's daemon, the decode's daemon), host memory."""
    etcd_url = request.getfixturevalue("etcd") if request.param == "two-nodes" else None
    with kv_daemons(request.param, cudaipc_bin, ["--backend", "host", "--capacity", "256MiB"], etcd_url) as pair:
        yield pair


def test_prefill_and_decode_processes_equal_one_process(daemons, tmp_path) -> None:
    # The flow of disaggregated serving (on one daemon, or across two nodes of a
    # cluster: NODES): a prefill process pages the prompts' caches into its host-memory
    # space at scattered blocks; a decode process reads each request's blocks with one
    # read into its own space at other blocks, waits layer by layer, rebuilds the cache
    # and decodes. Every token and logit equals one process doing both (the same
    # float32 computation: equal to 1e-6).
    pre, dec = daemons
    requests, lines, res = disaggregate(CFG, LENGTHS, STEPS, pre.socket, dec.socket, str(tmp_path / "out.pt"))
    assert kv.Desc.from_text(requests[0]["desc"]).node == ("" if pre is dec else "a")
    check_decoded(requests, lines, res, rtol=1e-6, atol=1e-6)


def test_killed_prefill_names_the_blocks_and_nothing_else_is_disturbed(daemons, tmp_path) -> None:
    # A prefill engine killed with kill -9 after handing over its request, before the
    # decode side reads it (a read holds leases of the regions it copies from, on one
    # node its own, across nodes the source daemon's for the read, so an engine killed
    # during a read leaves it its bytes: only a read that starts after the space went
    # can fail): the read fails with a BlockError naming the destination blocks, from
    # layer 0, caused by NotFound. The decode process then reads another
    # engine's request and decodes it as one process does, and the daemons still serve
    # puts and gets.
    pre, dec = daemons
    requests, lines, res = killed_prefill(CFG, pre.socket, dec.socket, str(tmp_path / "out.pt"))
    dead, ok = lines
    assert dead["length"] == 100 and dead["error"] == "BlockError", dead
    assert sorted(dead["error_blocks"]) == sorted(dead["blocks"]) and len(dead["blocks"]) == 7, dead
    assert dead["layer"] == 0 and dead["cause"] == "NotFound", dead
    assert "kvmodel/doomed/kv" in dead["message"], dead
    check_decoded(requests[1:], [ok], res, rtol=1e-6, atol=1e-6)
    for d in {pre.socket, dec.socket}:
        data = os.urandom(1 << 16)
        with cudaipc.connect(d) as st:
            st.put("kvmodel/after", data)
            with st.get("kvmodel/after", timeout=5) as lease:
                assert lease.read() == data
