"""Cluster-wide KV block pools from Python (cudaipc.kv.create_pool(..., cluster=True);
docs/kv.md, "Across the cluster") against three real ``cudaipc serve --cluster``
daemons and a real etcd (UCX over tcp on loopback): a put through one daemon places
each key on its node (the one rendezvous hashing gives it, checked here against a port
of cluster.Placement), lookups, per-key lookups, pinned lookups and gets through the
others reach them all with every byte checked, and a daemon killed with SIGKILL leaves
gets through the others failing with a BlockError that names its blocks (MissingBlocks,
UnavailableError), lookups bounded by their timeout, and the other daemons serving.
Needs Debian's etcd-server and libucx0; skipped without them unless
CUDAIPC_REQUIRE_CLUSTER=1."""

import struct
import time

import numpy as np
import pytest

import cudaipc
from clusterutil import cluster_daemons, start_etcd
from cudaipc import kv
from cudaipc.errors import UnavailableError

import kvutil

LAYERS, BLOCKS, BYTES = 4, 96, 512          # blocks of 4 KiB: a node's share of a request is staged
DAEMON_ARGS = ["--backend", "host", "--capacity", "256MiB"]
NODES = ["a", "b", "c"]
_M = (1 << 64) - 1


def _fnv64a(s: bytes) -> int:
    h = 0xcbf29ce484222325
    for b in s:
        h = ((h ^ b) * 0x100000001b3) & _M
    return h


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & _M
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & _M
    return z ^ (z >> 31)


def _rotl(x: int, k: int) -> int:
    return ((x << k) | (x >> (64 - k))) & _M


def owner(key: bytes, nodes) -> str:
    """The node of key among nodes: Go's cluster.Placement, ported."""
    w = struct.unpack("<4Q", key[:32].ljust(32, b"\0"))
    x = w[0] ^ _rotl(w[1], 17) ^ _rotl(w[2], 31) ^ _rotl(w[3], 47) ^ len(key)
    best, score = None, -1
    for n in nodes:
        s = _mix(x ^ _fnv64a(n.encode()))
        if s > score or s == score and n < best:
            best, score = n, s
    return best


def test_placement_port():
    """The port places as Go's cluster.Placement does (its TestPlacementVectors)."""
    def key(fill, n):
        return bytes((fill + i) & 0xff for i in range(n))
    assert [owner(key(f, n), ["a", "b", "c"]) for f, n in ((0, 16), (1, 32), (7, 20), (100, 32))] == ["b", "c", "c", "a"]


def keys(seed, n):
    raw = np.random.default_rng(seed).bytes(n * 32)
    return [raw[i * 32:(i + 1) * 32] for i in range(n)]


def engine_space(store, name, seed):
    """A registered host space of vLLM's layout, filled with kvutil.region_bytes(seed)."""
    local = kvutil.make_local("vllm", LAYERS, BLOCKS, BYTES, lambda shape: kv.alloc_host(shape))
    kvutil.fill(local, seed)
    return kv.register(store, name, local)


def local(kind="sglang"):
    """A zeroed unregistered host space."""
    return kvutil.make_local(kind, LAYERS, BLOCKS, BYTES, lambda shape: np.zeros(shape, dtype=np.uint8))


def snapshot(loc):
    return [kvutil.host_region(m).copy() for m in loc.memory]


@pytest.fixture(scope="module")
def cluster(cudaipc_bin):
    with start_etcd() as url, cluster_daemons(cudaipc_bin, url, DAEMON_ARGS, names=NODES) as ds:
        yield ds


def connect_all(ds):
    return [cudaipc.connect(d.socket) for d in ds]


def _blocks(store):
    """The blocks of this node's share of the pool (0 before a put made it here)."""
    try:
        return kv.stat_pool(store, "prefix").blocks
    except cudaipc.NotFound:
        return 0


def put_placed(pool, ks, sp, src, stores, timeout=30.0):
    """Put ks until each node holds its share (a daemon learns the live nodes from
    the directory a moment after it starts: a put before then places keys on fewer
    nodes, and is deleted and done again). Returns the put's result."""
    share = {x: sum(1 for k in ks if owner(k, NODES) == x) for x in NODES}
    deadline = time.monotonic() + timeout
    while True:
        r = pool.put(ks, sp, src, timeout=10)
        held = {x: _blocks(s) for x, s in zip(NODES, stores)}
        if held == share:
            return r
        assert time.monotonic() < deadline, "the put never placed the keys on the three nodes: %s, want %s" % (held, share)
        pool.delete(ks)
        time.sleep(0.2)


def test_across_nodes(cluster):
    sa, sb, sc = connect_all(cluster)
    try:
        sp = engine_space(sa, "engine/a", 7)
        bb = kv.block_bytes(sp.desc)
        pa = kv.create_pool(sa, "prefix", bb, 512 * bb, cluster=True)
        assert pa.info.cluster
        pc = kv.create_pool(sc, "prefix", bb, 512 * bb, cluster=True)
        assert kv.create_pool(sa, "prefix", bb, 512 * bb, cluster=True).info.id == pa.info.id  # as made
        with pytest.raises(cudaipc.Exists):
            kv.create_pool(sa, "prefix", 2 * bb, 512 * bb, cluster=True)
        n = 90
        ks = keys(1, n)
        rng = np.random.default_rng(2)
        src = [int(x) for x in rng.permutation(BLOCKS)[:n]]
        # b makes the pool when the put sends it its share.
        r = put_placed(pa, ks, sp, src, (sa, sb, sc))
        assert (r.stored, r.existed, r.unavailable, r.status) == (n, 0, 0, bytes(n))
        assert all(kv.stat_pool(s, "prefix").cluster for s in (sa, sb, sc))
        assert pa.put(ks, sp, src).existed == n

        pb = kv.open_pool(sb, "prefix")
        for p in (pa, pb, pc):
            assert p.lookup(ks, timeout=5) == (n, 0)
        gap = list(ks)
        gap[50] = keys(3, 1)[0]
        assert pb.lookup(gap)[0] == 50
        pr = pb.present(gap)
        assert (pr.found, pr.count) == (50, n - 1) and not pr[50] and pr[49] and pr[51]

        # A get through c: a's and b's keys staged to c, every byte.
        dst = local()
        before = snapshot(dst)
        dst_ids = [int(x) for x in rng.permutation(BLOCKS)[:n]]
        t = pc.get(ks, dst, dst_ids, timeout=10)
        for li in range(LAYERS):
            t.wait_layer(li, timeout=30)
        t.wait(timeout=30)
        kvutil.check_bytes(dst, kvutil.expected(sp.desc, 7, dst, src, dst_ids, range(LAYERS), before))
        assert kv.stat_pool(sc, "prefix").blocks == n   # c keeps copies

        # A pinned lookup through b brings the prefix there; the get takes the pin over.
        found, pin = pb.lookup(ks[:30], pin=True)
        assert found == 30 and pin != 0 and kv.stat_pool(sb, "prefix").pinned == 30
        dst2 = local("vllm-blocks-first")
        before = snapshot(dst2)
        pb.get(ks[:30], dst2, dst_ids[:30], pin=pin).wait(timeout=30)
        kvutil.check_bytes(dst2, kvutil.expected(sp.desc, 7, dst2, src[:30], dst_ids[:30], range(LAYERS), before))
        assert kv.stat_pool(sb, "prefix").pinned == 0

        # A delete through c goes everywhere.
        assert pc.delete(ks[:10]) >= 10
        for p in (pa, pb, pc):
            assert p.lookup(ks)[0] == 0
            assert p.lookup(ks[10:])[0] == n - 10
        for p in (pa, pb, pc):
            p.close()
        sp.close()
    finally:
        for s in (sa, sb, sc):
            s.close()


def test_owner_killed(cudaipc_bin):
    """Daemon a killed with SIGKILL: a get through c fails with a BlockError naming
    a's blocks (MissingBlocks whose cause is an UnavailableError), the other blocks
    right; a lookup through c answers within its timeout with the prefix up to a's
    first key; b and c serve on (puts of their keys stored, a's unavailable)."""
    with start_etcd() as url, cluster_daemons(cudaipc_bin, url, DAEMON_ARGS, names=NODES) as (a, b, c):
        sa, sb, sc = connect_all((a, b, c))
        try:
            sp = engine_space(sb, "engine/b", 9)
            bb = kv.block_bytes(sp.desc)
            pb = kv.create_pool(sb, "prefix", bb, 512 * bb, cluster=True)
            pc = kv.create_pool(sc, "prefix", bb, 512 * bb, cluster=True)
            n = 80
            ks = keys(4, n)
            src = list(range(n))
            own = [owner(k, NODES) for k in ks]
            assert put_placed(pb, ks, sp, src, (sa, sb, sc)).stored == n
            a.proc.kill()
            a.proc.wait(10)
            dst = local()
            before = snapshot(dst)
            dst_ids = list(range(n))[::-1]
            start = time.monotonic()
            t = pc.get(ks, dst, dst_ids, timeout=5)
            with pytest.raises(kv.BlockError) as ei:
                t.wait(timeout=30)
            took = time.monotonic() - start
            a_blocks = sorted(dst_ids[i] for i in range(n) if own[i] == "a")
            cause = ei.value.cause
            assert sorted(ei.value.blocks) == a_blocks, (ei.value, took)
            assert isinstance(cause, kv.MissingBlocks) and cause.unavailable == len(a_blocks), cause
            assert isinstance(cause.__cause__, UnavailableError) and "node a" in cause.reason, cause.reason
            assert took < 15, took
            others = [i for i in range(n) if own[i] != "a"]
            want = kvutil.expected(sp.desc, 9, dst, [src[i] for i in others], [dst_ids[i] for i in others],
                                   range(LAYERS), before)
            kvutil.check_bytes(dst, want)

            start = time.monotonic()
            found = pc.lookup(ks, timeout=0.3)[0]
            assert found <= own.index("a") and time.monotonic() - start < 3
            # b and c serve on: new keys of theirs are stored, a's are not (its record
            # lives until its lease expires).
            ks2 = keys(5, 40)
            r = pb.put(ks2, sp, list(range(40)), timeout=2)
            own2 = [owner(k, NODES) for k in ks2]
            assert (r.stored, r.unavailable) == (40 - own2.count("a"), own2.count("a")), r
            assert r.status == bytes(kv.BLOCK_UNAVAILABLE if o == "a" else kv.BLOCK_STORED for o in own2)
            mine = [k for k, o in zip(ks2, own2) if o != "a"]
            assert pc.present(mine).count == len(mine)
            pb.close()
            pc.close()
            sp.close()
        finally:
            for s in (sa, sb, sc):
                try:
                    s.close()
                except Exception:   # noqa: BLE001 - a's connection died with it
                    pass
