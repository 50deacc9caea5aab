"""KV reads across nodes from Python (cudaipc.kv.read_blocks of a space registered
with another daemon of a cluster; docs/kv.md, "Across nodes"), against two real
``cudaipc serve --cluster`` daemons and a real etcd (UCX over tcp on loopback): an
engine process (kv_engine.py) registers a space of random bytes with daemon a; this
process registers its destination with daemon b and reads scattered blocks through
b, every byte checked; layer ranges and per-layer waits, a read split over several
requests, requests refused at once, an engine killed before and during a read, the
source's daemon killed mid-read, and kv_reads a client may forge. Needs Debian's
etcd-server and libucx0; skipped without them unless CUDAIPC_REQUIRE_CLUSTER=1."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import cudaipc
from clusterutil import cluster_daemons, start_etcd
from conftest import Daemon
from cudaipc import kv
from cudaipc.errors import InvalidArgument, UnavailableError
from test_kv_host import Engine, engines  # noqa: F401 (the fixture)

import kvutil

LAYERS, BLOCKS, BYTES = 6, 40, 512
DAEMON_ARGS = ["--backend", "host", "--capacity", "512MiB"]


@pytest.fixture(scope="module")
def cluster(cudaipc_bin):
    """Daemons a and b of one cluster, for the module's tests."""
    with start_etcd() as url, cluster_daemons(cudaipc_bin, url, DAEMON_ARGS) as (a, b):
        yield a, b


@pytest.fixture
def reader(cluster):
    """A connection to daemon b (the reader's), closed after the test."""
    s = cudaipc.connect(cluster[1].socket)
    yield s
    s.close()


def registered(store, name, kind, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES, seed=0):
    """A space of kind over alloc_host memory, filled with random bytes of seed (zeros
    with 0), registered through store."""
    local = kvutil.make_local(kind, layers, blocks, nbytes, lambda shape: kv.alloc_host(shape))
    if seed:
        kvutil.fill(local, seed)
    return kv.register(store, name, local)


def snapshot(local):
    return [kvutil.host_region(m).copy() for m in local.memory]


def scattered(rng, n, blocks):
    """n distinct ids of blocks in random order, with runs of adjacent ids (runs of
    1 to 3) here and there, as a busy engine's blocks are."""
    runs, at = [], 0
    while at < blocks:
        k = min(int(rng.integers(1, 4)), blocks - at)
        runs.append(list(range(at, at + k)))
        at += k
    return [b for i in rng.permutation(len(runs)) for b in runs[i]][:n]


@pytest.mark.parametrize("kind,dkind", list(zip(kvutil.KINDS, ["sglang", "vllm", "offload", "vllm-one-buffer",
                                                               "vllm-blocks-first"])))
def test_read_scattered_blocks_from_another_node(cluster, reader, engines, kind, dkind):
    a, b = cluster
    assert reader.server.node == "b"
    e = engines(a.socket, "xnode/src/" + kind, kind, seed=21, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES)
    assert e.desc.node == "a" and e.desc.name == "%d:xnode/src/%s" % (os.getuid(), kind)
    rng = np.random.default_rng(kvutil.KINDS.index(kind))
    with registered(reader, "xnode/dst/" + kind, dkind, seed=22) as dst:
        assert dst.desc.node == "b" and dst.local.space is dst
        for layers, rng_layers in ((None, range(LAYERS)), (range(2, 5), range(2, 5)), (LAYERS - 1, range(LAYERS - 1, LAYERS))):
            n = 1 + int(rng.integers(BLOCKS // 2))
            src_ids, dst_ids = scattered(rng, n, BLOCKS), scattered(rng, n, BLOCKS)
            before = snapshot(dst.local)
            # The description as text (the engine's metadata), into the Space or its Local.
            t = kv.read_blocks(reader, e.desc.to_text(), src_ids, dst if layers is None else dst.local, dst_ids,
                               layers=layers)
            assert t.layers == rng_layers
            for layer in rng_layers:
                t.wait_layer(layer, 30)
            t.wait(30)
            assert t.done() and t.error is None
            kvutil.check_bytes(dst.local, kvutil.expected(e.desc, e.seed, dst.local, src_ids, dst_ids, rng_layers, before))
    # Nothing went through the store: daemon b holds registered memory only (no replica).
    assert all(o.external for o in reader.list()), [o.name for o in reader.list() if not o.external]


def test_layers_complete_in_order(cluster, reader, engines):
    """A read of layers of 1 MiB each: as wait_layer(l) returns, layer l's blocks
    are in the destination (its own K and V regions), and the daemon's progress
    answers come in order, each short of the end."""
    a, _ = cluster
    layers, blocks, nbytes = 8, 64, 8 << 10
    e = engines(a.socket, "xnode/progress", "sglang", seed=31, layers=layers, blocks=blocks, nbytes=nbytes)
    with registered(reader, "xnode/progress-dst", "sglang", layers=layers, blocks=blocks, nbytes=nbytes) as dst:
        ids = list(range(blocks))
        rev = ids[::-1]
        before = snapshot(dst.local)
        t = kv.read_blocks(reader, e.desc, ids, dst, rev)
        for layer in range(layers):
            t.wait_layer(layer, 30)
            want = kvutil.expected(e.desc, e.seed, dst.local, ids, rev, range(layer + 1), before)
            for i in (2 * layer, 2 * layer + 1):   # the layer's K and V regions
                assert np.array_equal(kvutil.host_region(dst.local.memory[i]), want[i]), (layer, i)
        t.wait(30)
        # The wire underneath: progress answers increasing, below the layer count.
        seen = []
        reader.read_space(e.desc.to_bytes(), dst.desc.to_bytes(), ids, rev, 0, 0, progress=seen.append, timeout=30)
        assert seen == sorted(set(seen)) and all(0 < n < layers for n in seen), seen


def test_read_split_over_requests(cluster, reader, engines):
    """20,000 scattered blocks: more ids than one kv_read's packet holds, so the read
    goes as several requests, and its layers complete once every request has them."""
    a, _ = cluster
    layers, blocks, nbytes = 3, 20000, 64
    e = engines(a.socket, "xnode/split", "vllm", seed=41, layers=layers, blocks=blocks, nbytes=nbytes)
    rng = np.random.default_rng(4)
    src_ids, dst_ids = rng.permutation(blocks).tolist(), rng.permutation(blocks).tolist()
    from cudaipc import _kvremote
    assert len(_kvremote.split_pairs(src_ids, dst_ids, 65536 - 2 * len(e.desc.to_bytes()) - 256)) > 1
    with registered(reader, "xnode/split-dst", "sglang", layers=layers, blocks=blocks, nbytes=nbytes) as dst:
        before = snapshot(dst.local)
        t = kv.read_blocks(reader, e.desc, src_ids, dst, dst_ids, layers=range(1, layers))
        for layer in range(1, layers):
            t.wait_layer(layer, 60)
        t.wait(60)
        kvutil.check_bytes(dst.local, kvutil.expected(e.desc, e.seed, dst.local, src_ids, dst_ids, range(1, layers), before))


def test_many_small_reads_in_flight(cluster, reader, engines):
    """600 one-block reads started at once from one connection cost a request each,
    no thread each (their answers are read by whoever waits); each lands its own
    block, and reads of a space gone fail alone, among reads that succeed."""
    a, _ = cluster
    blocks = 600
    e = engines(a.socket, "xnode/many", "sglang", seed=71, layers=1, blocks=blocks, nbytes=BYTES)
    gone = engines(a.socket, "xnode/many-gone", "sglang", seed=72, layers=1, blocks=blocks, nbytes=BYTES)
    gone.cmd("close")
    rng = np.random.default_rng(71)
    src = rng.permutation(blocks).tolist()
    with registered(reader, "xnode/many-dst", "sglang", layers=1, blocks=blocks) as dst:
        before = snapshot(dst.local)
        threads = threading.active_count()
        ts = [kv.read_blocks(reader, gone.desc if i % 7 == 3 else e.desc, [src[i]], dst, [i]) for i in range(blocks)]
        assert threading.active_count() <= threads + 1, "a thread a read"
        failed = []
        for i, t in enumerate(ts):
            if i % 7 == 3:
                with pytest.raises(kv.BlockError) as x:
                    t.wait(60)
                assert x.value.blocks == [i] and isinstance(x.value.cause, cudaipc.NotFound)
                failed.append(i)
            else:
                t.wait(60)
        ok = [i for i in range(blocks) if i % 7 != 3]
        want = kvutil.expected(e.desc, e.seed, dst.local, [src[i] for i in ok], ok, range(1), before)
        kvutil.check_bytes(dst.local, want)
        assert len(failed) == len(range(3, blocks, 7))


def test_reads_complete_without_a_wait(cluster, reader, engines):
    """A read nobody waits for completes as its caller polls done() (which reads
    what the connection holds), and as another call on the connection reads."""
    a, _ = cluster
    e = engines(a.socket, "xnode/poll", "vllm", seed=73, layers=2, blocks=16, nbytes=BYTES)
    with registered(reader, "xnode/poll-dst", "vllm", layers=2, blocks=16) as dst:
        before = snapshot(dst.local)
        t = kv.read_blocks(reader, e.desc, [1, 2, 3], dst, [4, 5, 6])
        start = time.monotonic()
        try:
            t.wait(0)    # only checks: TimeoutError while the answer is two daemons away
        except TimeoutError:
            pass
        assert time.monotonic() - start < 5, "wait(0) blocked"
        deadline = time.monotonic() + 30
        while not t.done():
            assert time.monotonic() < deadline, "done() never became true"
            time.sleep(0.001)
        assert t.error is None
        t2 = kv.read_blocks(reader, e.desc, [7], dst, [8])
        reader.put("xnode/poll-obj", b"x" * 10)    # a call: it reads the connection too
        reader.delete("xnode/poll-obj")
        t2.wait(30)
        kvutil.check_bytes(dst.local, kvutil.expected(e.desc, e.seed, dst.local, [1, 2, 3, 7], [4, 5, 6, 8], range(2), before))


def test_reads_from_many_threads(cluster, reader, engines):
    """Threads each reading one block after another on one connection: whichever
    waits reads everyone's answers; every block lands, none is lost."""
    a, _ = cluster
    n, each = 8, 40
    blocks = n * each
    e = engines(a.socket, "xnode/threads", "sglang", seed=74, layers=1, blocks=blocks, nbytes=BYTES)
    with registered(reader, "xnode/threads-dst", "sglang", layers=1, blocks=blocks) as dst:
        before = snapshot(dst.local)
        errors = []

        def work(k):
            try:
                for j in range(each):
                    i = k * each + j
                    kv.read_blocks(reader, e.desc, [blocks - 1 - i], dst, [i]).wait(60)
            except BaseException as x:  # noqa: BLE001
                errors.append(x)

        ths = [threading.Thread(target=work, args=(k,)) for k in range(n)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        assert not errors, errors
        ids = list(range(blocks))
        kvutil.check_bytes(dst.local, kvutil.expected(e.desc, e.seed, dst.local, [blocks - 1 - i for i in ids], ids,
                                                      range(1), before))


def test_connection_closed_mid_flight(cluster, engines):
    """Reads in flight when their connection closes end, each with a BlockError or
    complete, none left running; a wait with a timeout returns within it."""
    a, b = cluster
    e = engines(a.socket, "xnode/closed", "sglang", seed=75, layers=1, blocks=200, nbytes=BYTES)
    s = cudaipc.connect(b.socket)
    dst = registered(s, "xnode/closed-dst", "sglang", layers=1, blocks=200)
    ts = [kv.read_blocks(s, e.desc, [i], dst, [i]) for i in range(200)]
    start = time.monotonic()
    s.close()
    for t in ts:
        try:
            t.wait(10)
        except kv.BlockError as x:
            assert len(x.blocks) == 1
        assert t.done()
    assert time.monotonic() - start < 10


def test_split_pairs_stays_within_the_budget():
    rng = np.random.default_rng(5)
    from cudaipc import _kvremote
    for budget in (1, 7, 100, 4096):
        src, dst = rng.integers(0, 1 << 30, 3000).tolist(), rng.integers(0, 200, 3000).tolist()
        parts = _kvremote.split_pairs(src, dst, budget)
        assert parts[0][0] == 0 and parts[-1][1] == len(src)
        assert all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
        for lo, hi in parts:
            size = sum(len(_varint(x)) + len(_varint(y)) for x, y in zip(src[lo:hi], dst[lo:hi]))
            assert hi > lo and (size <= budget or hi - lo == 1)
    assert _kvremote.split_pairs([5], [6], 10) == [(0, 1)]


def _varint(v):
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v >= 0x80 else 0))
        v >>= 7
        if not v:
            return bytes(out)


def test_refused_at_once(cluster, reader, engines, cudaipc_bin):
    """What the reader's side refuses before sending anything, as Go's readRemote:
    a notice past its bound, a destination not registered with the reader's daemon (a
    plain Local, or one whose space is closed), ids out of range, layouts that do not
    fit, a reader's daemon without a cluster."""
    a, _ = cluster
    e = engines(a.socket, "xnode/refused", "vllm", seed=51, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES)
    with registered(reader, "xnode/refused-dst", "vllm") as dst:
        with pytest.raises(kv.InvalidKVRequest):
            kv.read_blocks(reader, e.desc, [0], dst, [0], notify=b"x" * 4096)
        plain = kvutil.make_local("vllm", LAYERS, BLOCKS, BYTES, lambda shape: np.zeros(shape, dtype=np.uint8))
        with pytest.raises(kv.KVNotSupported, match="register"):
            kv.read_blocks(reader, e.desc, [0], plain, [0])
        with pytest.raises(kv.BlockRangeError) as x:
            kv.read_blocks(reader, e.desc, [0, BLOCKS, -1], dst, [0, 1, 2])
        assert x.value.blocks == [BLOCKS, -1] and isinstance(x.value, kv.BlockError)
        with pytest.raises(kv.BlockRangeError):
            kv.read_blocks(reader, e.desc, [0], dst, [BLOCKS])
        with pytest.raises(kv.LayoutMismatch):
            kv.read_blocks(reader, e.desc, [0, 1], dst, [0])
        with pytest.raises(kv.LayoutMismatch):
            kv.read_blocks(reader, e.desc, [0], dst, [0], layers=range(2, LAYERS + 1))
        with registered(reader, "xnode/refused-other", "vllm", nbytes=2 * BYTES) as other:
            with pytest.raises(kv.LayoutMismatch):
                kv.read_blocks(reader, e.desc, [0], other, [0])
        # A description that says GPU memory where the engine registered host memory
        # is the daemons' to refuse (either side may be GPU memory across nodes).
        gpu = kv.Desc.from_bytes(e.desc.to_bytes())
        for r in gpu.regions:
            r.device = "GPU-00000000-0000-0000-0000-000000000001"
        with pytest.raises(kv.BlockError) as x:
            kv.read_blocks(reader, gpu, [0], dst, [7]).wait(30)
        assert x.value.blocks == [7] and isinstance(x.value.cause, cudaipc.NotFound), repr(x.value.cause)
        with pytest.raises(kv.InvalidDescError):
            kv.read_blocks(reader, "bm90IGEgZGVzY3JpcHRpb24=", [0], dst, [0])
        local = dst.local
    assert local.space is None   # closed: no longer bound
    with pytest.raises(kv.KVNotSupported, match="register"):
        kv.read_blocks(reader, e.desc, [0], local, [0])
    with pytest.raises(kv.KVNotSupported, match="register"):
        kv.read_blocks(reader, e.desc, [0], dst, [0])
    lone = Daemon(cudaipc_bin, DAEMON_ARGS)
    try:
        with cudaipc.connect(lone.socket) as s:
            assert s.server.node == ""
            with registered(s, "xnode/lone", "vllm") as d:
                assert d.desc.node == ""
                with pytest.raises(kv.KVNotSupported, match="not part of a cluster"):
                    kv.read_blocks(s, e.desc, [0], d, [0])
    finally:
        lone.stop()


def test_notices_across_nodes(cluster, reader):
    """A read with notify= of a space on another node tells the space's engine, through
    both daemons, when it ends: the payload, completed or failed, the reader's uid and
    pid 0 (the pid means nothing on another host); a space gone is NotFound."""
    a, _ = cluster
    eng = cudaipc.connect(a.socket)
    try:
        src = registered(eng, "xnode/notice-src", "vllm", seed=61)
        with registered(reader, "xnode/notice-dst", "vllm") as dst:
            kv.read_blocks(reader, src.desc, [3, 1], dst, [0, 2], notify=b"req-1").wait(30)
            got = src.wait_notices(timeout=30)
            assert [(n.payload, n.failed, n.pid, n.uid) for n in got] == [(b"req-1", False, 0, os.getuid())]
            eng.delete(src.desc.name.split(":", 1)[1] + "/2")   # a region gone: the next read fails
            t = kv.read_blocks(reader, src.desc, [3, 1], dst, [0, 2], notify=b"req-2")
            with pytest.raises(kv.BlockError):
                t.wait(30)
            got = src.wait_notices(timeout=30)
            assert [(n.payload, n.failed) for n in got] == [(b"req-2", True)]
            src.close()
            with pytest.raises(cudaipc.NotFound):
                reader.notify_space(src.desc.to_bytes(), b"\x00")
    finally:
        eng.close()


def test_engine_gone(cluster, reader, engines):
    """A source space closed, registered again, or its engine killed (SIGKILL)
    before the read: a BlockError naming the blocks, from layer 0, caused by
    NotFound. An engine killed in the middle of a large read: the read ends complete,
    every byte right (the source's daemon holds the regions until the read's last
    byte), or with a BlockError naming all its blocks. Both daemons serve on."""
    a, b = cluster
    with registered(reader, "xnode/gone-dst", "vllm") as dst:
        closed = engines(a.socket, "xnode/gone/closed", "vllm", seed=61, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES)
        closed.cmd("close")
        t = kv.read_blocks(reader, closed.desc, [0, 1], dst, [5, 6])
        with pytest.raises(kv.BlockError) as x:
            t.wait(30)
        assert x.value.blocks == [5, 6] and x.value.layer == 0 and isinstance(x.value.cause, cudaipc.NotFound)
        assert "xnode/gone/closed" in str(x.value) and t.error is x.value
        with pytest.raises(kv.BlockError):
            t.wait_layer(0, 5)

        again = engines(a.socket, "xnode/gone/again", "vllm", seed=62, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES)
        old = again.desc
        again.cmd("reregister")
        with pytest.raises(kv.BlockError) as x:
            kv.read_blocks(reader, old, [1, 2], dst, [1, 2]).wait(30)
        assert isinstance(x.value.cause, cudaipc.NotFound) and x.value.blocks == [1, 2]
        before = snapshot(dst.local)
        kv.read_blocks(reader, again.desc, [1, 2], dst, [1, 2]).wait(30)
        kvutil.check_bytes(dst.local, kvutil.expected(again.desc, again.seed, dst.local, [1, 2], [1, 2], range(LAYERS), before))

        killed = engines(a.socket, "xnode/gone/killed", "vllm", seed=63, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES)
        kv.read_blocks(reader, killed.desc, [3], dst, [3]).wait(30)
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait(10)
        with cudaipc.connect(a.socket) as sa:
            kvutil.wait_gone(sa, killed.desc.region_name(0))
        ids = [9, 4, 17, 16, 30]
        with pytest.raises(kv.BlockError) as x:
            kv.read_blocks(reader, killed.desc, [0, 1, 2, 3, 4], dst, ids).wait(30)
        assert x.value.blocks == ids and x.value.layer == 0 and isinstance(x.value.cause, cudaipc.NotFound)

    # Killed mid-read: 16 layers of 128 blocks of 32 KiB, K and V (128 MiB).
    big = engines(a.socket, "xnode/gone/big", "vllm", seed=64, layers=16, blocks=128, nbytes=32 << 10)
    with registered(reader, "xnode/gone/big-dst", "vllm", layers=16, blocks=128, nbytes=32 << 10) as bdst:
        all_ids = list(range(128))
        before = snapshot(bdst.local)
        t = kv.read_blocks(reader, big.desc, all_ids, bdst, all_ids[::-1])
        t.wait_layer(0, 60)
        big.proc.send_signal(signal.SIGKILL)
        big.proc.wait(10)
        try:
            t.wait(60)
        except kv.BlockError as e:
            assert e.blocks == all_ids[::-1] and e.layer >= 1, e
        else:
            kvutil.check_bytes(bdst.local, kvutil.expected(big.desc, big.seed, bdst.local, all_ids, all_ids[::-1],
                                                           range(16), before))
    # Both daemons serve on: a new engine's space is read, and puts and gets work.
    fresh = engines(a.socket, "xnode/gone/fresh", "sglang", seed=65, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES)
    with registered(reader, "xnode/gone/fresh-dst", "sglang") as fdst:
        before = snapshot(fdst.local)
        kv.read_blocks(reader, fresh.desc, [7, 0], fdst, [1, 2]).wait(30)
        kvutil.check_bytes(fdst.local, kvutil.expected(fresh.desc, fresh.seed, fdst.local, [7, 0], [1, 2], range(LAYERS), before))
    for d in (a, b):
        data = os.urandom(1 << 16)
        with cudaipc.connect(d.socket) as s:
            s.put("xnode/after", data)
            with s.get("xnode/after", timeout=5) as lease:
                assert lease.read() == data
            s.delete("xnode/after")


def test_hostile_kv_reads(cluster, reader, engines):
    """kv_reads a client may forge (Store.read_space, the wire call): each fails with
    its typed error and the daemons serve on; a description naming a node not in
    the cluster fails the Transfer with NotFound; a progress callback that raises
    cancels its read and leaves the connection usable."""
    a, _ = cluster
    e = engines(a.socket, "xnode/hostile", "vllm", seed=71, layers=2, blocks=8, nbytes=64)
    with registered(reader, "xnode/hostile-dst", "vllm", layers=2, blocks=8, nbytes=64) as dst:
        src, dd = e.desc, dst.desc

        def mod(d, **kw):
            c = kv.Desc.from_bytes(d.to_bytes())
            for k, v in kw.items():
                setattr(c, k, v)
            return c.to_bytes()

        ok = dict(src=src.to_bytes(), dst=dd.to_bytes(), src_blocks=[1, 2], dst_blocks=[3, 4])
        reader.read_space(**ok)
        bigger = kv.Desc.from_bytes(src.to_bytes())
        bigger.regions[0].size *= 2
        cases = [
            ("garbage source", dict(src=b"CKVS garbage"), InvalidArgument),
            ("garbage destination", dict(dst=b"\xff" * 100), InvalidArgument),
            ("source on this node", dict(src=mod(src, node="b")), InvalidArgument),
            ("source of no node", dict(src=mod(src, node="")), InvalidArgument),
            ("source node unknown", dict(src=mod(src, node="nosuch")), cudaipc.NotFound),
            ("stale source", dict(src=mod(src, id=bytes(16))), cudaipc.NotFound),
            ("source name of no space", dict(src=mod(src, name="0:xnode/none")), cudaipc.NotFound),
            ("source bigger than registered", dict(src=bigger.to_bytes()), cudaipc.NotFound),
            ("destination unregistered", dict(dst=mod(dd, name="0:xnode/none")), cudaipc.NotFound),
            ("destination stale", dict(dst=mod(dd, id=bytes(16))), cudaipc.NotFound),
            ("destination on another node", dict(dst=mod(dd, node="a")), InvalidArgument),
            ("source id out of range", dict(src_blocks=[1, 8]), InvalidArgument),
            ("destination id out of range", dict(dst_blocks=[1 << 31, 0]), InvalidArgument),
            ("lists differ", dict(dst_blocks=[1]), InvalidArgument),
            ("no blocks", dict(src_blocks=[], dst_blocks=[]), InvalidArgument),
            ("layers past the end", dict(first=1, count=2), InvalidArgument),
            ("layers far past the end", dict(first=5000), InvalidArgument),
        ]
        for name, change, want in cases:
            with pytest.raises(want) as x:
                reader.read_space(**dict(ok, **change))
            assert x.value.op == "kv_read", name
        # Through read_blocks: a description of a node not in the cluster.
        nowhere = kv.Desc.from_bytes(mod(src, node="nosuch"))
        with pytest.raises(kv.BlockError) as bx:
            kv.read_blocks(reader, nowhere, [0, 1], dst, [2, 3]).wait(30)
        assert bx.value.blocks == [2, 3] and isinstance(bx.value.cause, cudaipc.NotFound)

        # A progress callback that raises: the read is canceled at the daemon, its
        # later answers dropped, and the connection serves the next calls.
        class Stop(Exception):
            pass

        def stop(_):
            raise Stop()
        layers, blocks, nbytes = 8, 64, 8 << 10
        big = engines(a.socket, "xnode/hostile-big", "sglang", seed=72, layers=layers, blocks=blocks, nbytes=nbytes)
        with registered(reader, "xnode/hostile-big-dst", "sglang", layers=layers, blocks=blocks, nbytes=nbytes) as bd:
            for _ in range(3):
                try:
                    reader.read_space(big.desc.to_bytes(), bd.desc.to_bytes(), list(range(blocks)), list(range(blocks)),
                                      progress=stop)
                except Stop:
                    pass
            before = snapshot(dst.local)
            reader.read_space(**ok)
            kvutil.check_bytes(dst.local, kvutil.expected(src, e.seed, dst.local, [1, 2], [3, 4], range(2), before))
            assert reader.stat(dd.region_name(0)).external
        # Both serve on.
        with cudaipc.connect(a.socket) as sa:
            assert sa.server.node == "a" and sa.list() is not None


def test_source_daemon_killed_mid_read(cudaipc_bin, engines):
    """The source's daemon killed (SIGKILL) in the middle of a read ends it, within
    seconds, with a BlockError naming the blocks (UnavailableError, or NotFound once
    the node's record went); a read after it fails as clearly; the reader's daemon
    serves on."""
    with start_etcd() as url, cluster_daemons(cudaipc_bin, url, DAEMON_ARGS) as (a, b):
        with cudaipc.connect(b.socket) as reader:
            layers, blocks, nbytes = 16, 128, 32 << 10
            e = engines(a.socket, "xnode/killed", "vllm", seed=81, layers=layers, blocks=blocks, nbytes=nbytes)
            with registered(reader, "xnode/killed-dst", "vllm", layers=layers, blocks=blocks, nbytes=nbytes) as dst:
                ids = list(range(blocks))
                t = kv.read_blocks(reader, e.desc, ids, dst, ids)
                t.wait_layer(0, 60)
                start = time.monotonic()
                a.proc.kill()
                a.proc.wait(10)
                try:
                    t.wait(60)
                except kv.BlockError as x:
                    assert x.blocks == ids and x.layer >= 1, x
                    assert isinstance(x.cause, (UnavailableError, cudaipc.NotFound)), repr(x.cause)
                assert time.monotonic() - start < 15
                start = time.monotonic()
                with pytest.raises(kv.BlockError) as bx:
                    kv.read_blocks(reader, e.desc, ids[:4], dst, ids[:4]).wait(60)
                assert bx.value.blocks == ids[:4]
                assert isinstance(bx.value.cause, (UnavailableError, cudaipc.NotFound)), repr(bx.value.cause)
                assert time.monotonic() - start < 15
            data = os.urandom(4096)
            reader.put("xnode/after-kill", data)
            with reader.get("xnode/after-kill", timeout=5) as lease:
                assert lease.read() == data
