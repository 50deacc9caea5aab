"""KV block pools (cudaipc.kv.create_pool; docs/kv.md, "Block pools") against a real
daemon: puts from a registered host space, lookups of the present prefix and of each
key alone, gets into a local space of another layout layer by layer with every byte
checked, keys present already, absent keys named, ten thousand keys in one call
(their arrays in a bulk file), least recently used eviction and pins, refused
requests, the pools ``cudaipc ls --pools`` lists and the metrics /metrics serves."""

import json

import numpy as np
import pytest

import cudaipc
from cudaipc import kv

import kvutil

LAYERS, BLOCKS, BYTES = 4, 32, 96


def keys(seed, n, size=32):
    """n random keys of size bytes."""
    raw = np.random.default_rng(seed).bytes(n * size)
    return [raw[i * size:(i + 1) * size] for i in range(n)]


def space(store, name, kind, seed, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES):
    """A registered host space of kind, filled with kvutil.region_bytes(seed, ...)."""
    local = kvutil.make_local(kind, layers, blocks, nbytes, lambda shape: kv.alloc_host(shape))
    kvutil.fill(local, seed)
    return kv.register(store, name, local)


def local(kind, seed, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES):
    """An unregistered host space of kind holding random bytes (seed)."""
    loc = kvutil.make_local(kind, layers, blocks, nbytes, lambda shape: np.zeros(shape, dtype=np.uint8))
    kvutil.fill(loc, seed)
    return loc


def snapshot(loc):
    return [kvutil.host_region(m).copy() for m in loc.memory]


@pytest.mark.parametrize("src_kind,dst_kind", [("vllm", "sglang"), ("sglang", "offload"), ("offload", "vllm-blocks-first")])
def test_put_lookup_get(store, src_kind, dst_kind):
    sp = space(store, "pool/%s/kv" % src_kind, src_kind, 5)
    bb = kv.block_bytes(sp.desc)
    assert bb == LAYERS * 2 * BYTES
    pool = kv.create_pool(store, "pool-" + src_kind, bb, 48 * 768)
    assert (pool.info.capacity_blocks, pool.info.slot_bytes, pool.info.key_bytes) == (48, 768, 32)
    ks = keys(1, 40)
    src_ids = list(np.random.default_rng(2).permutation(BLOCKS)[:30]) + [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    r = pool.put(ks[:30], sp, src_ids[:30])
    assert (r.stored, r.existed, r.full, r.status) == (30, 0, 0, bytes(30))
    # Keys present are left as they are; the rest are stored.
    r = pool.put(ks[20:], sp, src_ids[:10] + src_ids[30:])
    assert (r.stored, r.existed) == (10, 10)
    assert r.status == bytes([kv.BLOCK_EXISTED] * 10 + [kv.BLOCK_STORED] * 10)
    held = src_ids   # keys 20..29 kept their blocks; 30..39 hold src_ids[30..39]

    assert pool.lookup(ks) == (40, 0)
    assert pool.lookup(ks[:7] + keys(9, 1) + ks[8:])[0] == 7
    assert pool.lookup(keys(10, 1) + ks)[0] == 0
    n, pin = pool.lookup(ks, pin=True)
    assert n == 40 and pin != 0

    dst = local(dst_kind, 7, blocks=BLOCKS + 8)
    before = snapshot(dst)
    dst_ids = list(np.random.default_rng(3).permutation(BLOCKS + 8)[:40])
    t = pool.get(ks, dst, dst_ids, pin=pin)
    for li in range(LAYERS):
        t.wait_layer(li, timeout=30)
    t.wait(timeout=30)
    kvutil.check_bytes(dst, kvutil.expected(sp.desc, 5, dst, held, dst_ids, range(LAYERS), before))

    # Two absent keys: the others arrive, the error names their blocks.
    before = snapshot(dst)
    mixed = list(ks[:6])
    mixed[1], mixed[4] = keys(11, 1)[0], keys(12, 1)[0]
    t = pool.get(mixed, dst, [1, 2, 3, 4, 5, 6])
    with pytest.raises(kv.BlockError) as ei:
        t.wait(timeout=30)
    assert ei.value.blocks == [2, 5] and isinstance(ei.value.cause, kv.MissingBlocks)
    kvutil.check_bytes(dst, kvutil.expected(sp.desc, 5, dst, [held[0], held[2], held[3], held[5]], [1, 3, 4, 6],
                                            range(LAYERS), before))
    info = pool.stat()
    assert (info.blocks, info.stored) == (40, 40)
    pool.close()


def test_layer_range(store):
    sp = space(store, "range/kv", "vllm", 8)
    pool = kv.create_pool(store, "range", kv.block_bytes(sp.desc, range(1, 3)), 1 << 20, key_bytes=16)
    ks = keys(13, 5, 16)
    with pytest.raises(kv.LayoutMismatch):
        pool.put(ks, sp, [0, 1, 2, 3, 4])
    assert pool.put(ks, sp, [9, 3, 4, 15, 0], layers=range(1, 3)).stored == 5
    dst = local("sglang", 14)
    before = snapshot(dst)
    t = pool.get(ks, dst, [7, 6, 5, 4, 3], layers=range(1, 3))
    t.wait_layer(1, timeout=30)
    t.wait_layer(2, timeout=30)
    t.wait(timeout=30)
    kvutil.check_bytes(dst, kvutil.expected(sp.desc, 8, dst, [9, 3, 4, 15, 0], [7, 6, 5, 4, 3], range(1, 3), before))
    with pytest.raises(kv.LayoutMismatch):
        t.wait_layer(0)


def test_bulk(store):
    n = 10000
    sp = space(store, "bulk/kv", "offload", 15, layers=1, blocks=n, nbytes=24)
    pool = kv.create_pool(store, "bulk", 48, 12000 * 256)
    ks = keys(16, 2 * n)
    ids = list(range(n - 1, -1, -1))
    r = pool.put(np.frombuffer(b"".join(ks[:n]), dtype=np.uint8).reshape(n, 32), sp, ids)   # keys as an array
    assert r.stored == n and len(r.status) == n
    assert pool.lookup(ks[:n])[0] == n
    assert pool.lookup(ks[n:])[0] == 0
    assert pool.lookup(ks[n // 2:n // 2 + n])[0] == n // 2
    dst = local("offload", 17, layers=1, blocks=n, nbytes=24)
    before = snapshot(dst)
    t = pool.get(ks[n // 2:n // 2 + n], dst, list(range(n)))
    with pytest.raises(kv.BlockError) as ei:
        t.wait(timeout=60)
    assert ei.value.blocks == list(range(n // 2, n))
    kvutil.check_bytes(dst, kvutil.expected(sp.desc, 15, dst, ids[n // 2:], list(range(n // 2)), range(1), before))


def test_present(store):
    """Per-key lookups (pool.present) of keys that are not a chain, inline and through
    a bulk file: every key's answer, the prefix and the count; with a pin, every key
    present is held until a get takes the pin over."""
    n = 10000
    sp = space(store, "present/kv", "offload", 26, layers=1, blocks=n, nbytes=24)
    pool = kv.create_pool(store, "present", 48, n * 256, key_bytes=24)
    ks = keys(27, 2 * n, 24)
    rng = np.random.default_rng(28)
    held = sorted(rng.choice(2 * n, size=n, replace=False).tolist())
    assert pool.put([ks[i] for i in held], sp, list(range(n))).stored == n
    hs = set(held)
    order = rng.permutation(2 * n).tolist()

    def check(idx, **kw):
        p = pool.present(np.frombuffer(b"".join(ks[i] for i in idx), dtype=np.uint8).reshape(len(idx), 24), **kw)
        want = [i in hs for i in idx]
        assert list(p) == want and len(p) == len(idx)
        assert p.count == sum(want)
        assert p.found == (want.index(False) if False in want else len(idx))
        assert p[0] == want[0] and p[-1] == want[-1]
        return p

    for idx in (order[:20], order[:n], order[:3], held):   # inline, bulk, under 8 keys, all present
        assert check(idx).pin == 0
    every = np.frombuffer(b"".join(ks), dtype=np.uint8).reshape(2 * n, 24)
    assert list(pool.present(every[::2])) == [i in hs for i in range(0, 2 * n, 2)]   # keys not contiguous
    assert list(pool.present([ks[i] for i in order[:n]])) == [i in hs for i in order[:n]]   # a list of bytes
    assert pool.stat().pinned == 0
    p = check(order[n:n + 500], pin=True)
    assert p.pin and pool.stat().pinned == p.count
    got = [order[n + i] for i in range(500) if p[i]][:40]
    dst = local("offload", 29, layers=1, blocks=40, nbytes=24)
    before = snapshot(dst)
    pool.get([ks[i] for i in got], dst, list(range(len(got))), pin=p.pin).wait(timeout=30)
    kvutil.check_bytes(dst, kvutil.expected(sp.desc, 26, dst, [held.index(i) for i in got], list(range(len(got))), range(1), before))
    import time
    deadline = time.monotonic() + 10
    while pool.stat().pinned:
        assert time.monotonic() < deadline, "pins left after the get took the pin over"
        time.sleep(0.01)
    with pytest.raises(IndexError):
        p[500]


def test_get_threads_and_runs(store):
    """A get of 40 MB (copied on several threads where there are several CPUs) of
    keys whose slots are partly runs and partly scattered (a pool with holes
    refilled), into a destination of another layout: every byte, layers complete in
    order."""
    layers, blocks, nbytes = 4, 640, 8192
    sp = space(store, "threads/kv", "vllm", 33, layers=layers, blocks=blocks, nbytes=nbytes)
    bb = kv.block_bytes(sp.desc)
    pool = kv.create_pool(store, "threads", bb, blocks * bb)
    ks = keys(34, blocks)
    assert pool.put(ks[:480], sp, list(range(480))).stored == 480
    holes = list(range(0, 480, 3)) + list(range(100, 140))          # single slots and a run freed
    assert pool.delete([ks[i] for i in sorted(set(holes))]) == len(set(holes))
    rest = sorted(set(holes)) + list(range(480, blocks))
    assert pool.put([ks[i] for i in rest], sp, rest).stored == len(rest)
    rng = np.random.default_rng(35)
    src_ids = rng.permutation(blocks)[:400].tolist()                 # slots with gaps: runs and single ones
    dst_ids = rng.permutation(blocks)[:400].tolist()
    dst = local("sglang", 36, layers=layers, blocks=blocks, nbytes=nbytes)
    before = snapshot(dst)
    t = pool.get([ks[i] for i in src_ids], dst, dst_ids)
    for li in range(layers):
        t.wait_layer(li, timeout=60)
        assert t.reached() >= li + 1
    t.wait(timeout=60)
    kvutil.check_bytes(dst, kvutil.expected(sp.desc, 33, dst, src_ids, dst_ids, range(layers), before))


def test_runs():
    """A get's plan: keys in slot order, runs of at least four consecutive slots (a
    key given twice breaks a run), the rest one by one."""
    from cudaipc._kvpool import _runs
    slots = [7, 3, 4, 5, 6, 20, 9, 10, 11, 30, 31, 32, 33, 33, 40]
    db = list(range(100, 100 + len(slots)))
    runs, singles = _runs(sorted(range(len(slots)), key=lambda i: slots[i]), slots, db, np)
    assert [(s0, to.tolist()) for s0, to in runs] == [(3, [101, 102, 103, 104, 100]), (30, [109, 110, 111, 112])]
    assert sorted(singles) == [(9, 106), (10, 107), (11, 108), (20, 105), (33, 113), (40, 114)]


def test_eviction_and_pins(store):
    sp = space(store, "evict/kv", "vllm", 18, layers=2)
    pool = kv.create_pool(store, "evict", 2 * 2 * BYTES, 8 * 512, key_bytes=20)
    ks = keys(19, 16, 20)
    pool.put(ks[:8], sp, list(range(8)))
    t = pool.get(ks[:1], local("vllm", 1, layers=2), [0])
    t.wait(timeout=30)

    def no_pins():
        import time
        deadline = time.monotonic() + 10
        while pool.stat().pinned:
            assert time.monotonic() < deadline, "pins left"
            time.sleep(0.01)

    def present():
        return [i for i, k in enumerate(ks) if pool.lookup([k])[0] == 1]

    no_pins()
    n, pin = pool.lookup(ks[1:2], pin=True)
    assert n == 1 and pin
    assert pool.put(ks[8:11], sp, [8, 9, 10]).stored == 3
    assert present() == [0, 1, 5, 6, 7, 8, 9, 10]      # 2, 3, 4 went, least recently used first
    _, every = pool.lookup([ks[i] for i in present()], pin=True, pin_timeout=0.3)
    r = pool.put(ks[11:13], sp, [11, 12])
    assert (r.stored, r.full, r.status) == (0, 2, bytes([kv.BLOCK_FULL] * 2))
    assert pool.evict(8) == 0
    pool.unpin(pin)
    with pytest.raises(cudaipc.NotFound):
        pool.unpin(pin)
    no_pins()   # the second pin timed out
    assert pool.evict(2) == 2
    assert present() == [5, 6, 7, 8, 9, 10]
    assert pool.delete(ks[5:7]) == 2
    assert pool.delete(ks[5:7]) == 0
    assert pool.stat().evictions == 5


def test_refused(store, daemon):
    sp = space(store, "refused/kv", "vllm", 20)
    pool = kv.create_pool(store, "refused", kv.block_bytes(sp.desc), 1 << 20)
    with pytest.raises(cudaipc.Exists):
        kv.create_pool(store, "refused", 64, 1 << 20)
    with pytest.raises(cudaipc.InvalidArgument):
        kv.create_pool(store, "p", 64, 1 << 20, key_bytes=8)
    with pytest.raises(cudaipc.StoreFull):
        kv.create_pool(store, "huge", 4096, 1 << 30)
    with pytest.raises(cudaipc.InvalidArgument):
        pool.lookup(keys(1, 2, 16))                  # the pool's keys are 32 bytes
    with pytest.raises(cudaipc.InvalidArgument):
        pool.lookup([b"x" * 32, b"y" * 20])
    with pytest.raises(cudaipc.InvalidArgument):
        pool.lookup([b"x" * 31, b"y" * 33])          # 64 bytes, but not two keys of 32
    assert pool.lookup([bytearray(b"x" * 32), memoryview(b"y" * 32)]) == (0, 0)   # any bytes-like keys
    with pytest.raises(cudaipc.NotFound):
        kv.open_pool(store, "nope")
    with pytest.raises(kv.BlockRangeError):
        pool.put(keys(2, 1), sp, [BLOCKS])
    with pytest.raises(kv.LayoutMismatch):
        pool.get(keys(2, 1), local("vllm", 1, layers=2), [0])
    desc = sp.desc
    sp.close()
    with pytest.raises(cudaipc.NotFound):   # the space's regions are gone
        pool.put(keys(3, 1), desc, [0])
    # ls lists the pool with its counts.
    out = json.loads(daemon.cli("ls", "--pools", "--json").stdout)
    assert [p["name"] for p in out] == ["refused"] and out[0]["capacity_blocks"] == pool.info.capacity_blocks
    assert [p.name for p in kv.list_pools(store)] == ["refused"]
    kv.delete_pool(store, "refused")
    assert kv.list_pools(store) == []


def _metrics(port):
    """The daemon's /metrics as {name{labels}: value}."""
    import urllib.request
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics(cudaipc_bin):
    """The pool metrics as /metrics serves them, by tier: pools, blocks, bytes and
    capacity; hits and misses of lookups (prefix and per key) and gets; blocks
    stored, their bytes, bytes got, evictions; the lookup latency histogram."""
    from clusterutil import free_port
    from conftest import Daemon
    port = free_port()
    d = Daemon(cudaipc_bin, ["--backend", "host", "--capacity", "64MiB"], config='metrics = "%d"\n' % port)
    try:
        with cudaipc.connect(d.socket) as st:
            sp = space(st, "metrics/kv", "vllm", 30)
            bb = kv.block_bytes(sp.desc)
            pool = kv.create_pool(st, "metrics", bb, 8 * bb)
            slot = pool.info.slot_bytes
            ks = keys(31, 12)
            assert pool.put(ks[:8], sp, list(range(8))).stored == 8
            assert pool.put(ks[8:10], sp, [8, 9]).stored == 2                # 0 and 1 evicted: 8 slots
            assert pool.lookup(ks[2:12])[0] == 8                           # 8 hits, 2 misses
            assert pool.present(ks[:4]).count == 2                          # 2 hits, 2 misses
            pool.get(ks[6:10], local("vllm", 32), [0, 1, 2, 3]).wait(timeout=30)   # 4 hits
            assert pool.evict(1) == 1
            m = _metrics(port)
            host = '{device="host"}'
            want = {
                "cudaipc_store_kv_pools" + host: 1,
                'cudaipc_store_kv_pool_blocks{device="host",state="ready"}': 7,
                "cudaipc_store_kv_pool_bytes" + host: 7 * bb,
                "cudaipc_store_kv_pool_capacity_bytes" + host: pool.info.memory_size,
                'cudaipc_store_kv_pool_hits_total{device="host",op="lookup"}': 10,
                'cudaipc_store_kv_pool_misses_total{device="host",op="lookup"}': 4,
                'cudaipc_store_kv_pool_hits_total{device="host",op="get"}': 4,
                "cudaipc_store_kv_pool_stored_total" + host: 10,
                "cudaipc_store_kv_pool_put_bytes_total" + host: 10 * bb,
                "cudaipc_store_kv_pool_get_bytes_total" + host: 4 * bb,
                "cudaipc_store_kv_pool_evictions_total" + host: 3,
                "cudaipc_store_kv_pool_lookup_seconds_count": 2,
            }
            got = {k: m.get(k) for k in want}
            assert got == want
            assert pool.info.memory_size >= 8 * slot
            assert m['cudaipc_store_kv_pool_lookup_seconds_bucket{le="+Inf"}'] == 2
            assert 0 < m["cudaipc_store_kv_pool_lookup_seconds_sum"] < 1
    finally:
        d.stop()
