"""The lease fast path (docs/protocol.md 6.7) against a real daemon, host memory:
releases and take-backs by compare-and-swap in the connection's lease table, the
daemon's lease count, deleted objects, kill -9, threads, and the socket fallback."""

from __future__ import annotations

import array
import gc
import logging
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import cudaipc
from cudaipc import _fastpath
from cudaipc import _store_pb2 as pb
from conftest import PYROOT, Daemon

HELD, IDLE, DOOMED = 1, 2, 4


def state(word: int) -> int:
    return word & 3


@pytest.fixture
def small_daemon(cudaipc_bin):
    d = Daemon(cudaipc_bin, ["--backend", "host", "--capacity", "8MiB"])
    yield d
    d.stop()


def need_fast(store: cudaipc.Store) -> None:
    if _fastpath.atomics() is None:
        pytest.fail("libatomic.so.1 is missing: the lease fast path cannot be tested (apt-get install libatomic1)")
    assert store.fast_path, "the daemon gave no lease table"


def slot_of(lease: cudaipc.Lease) -> int:
    g = lease._rec
    assert g is not None, "the lease has no lease-table slot"
    return g.slot


def test_cycles_release_through_the_table(store, daemon):
    need_fast(store)
    data = os.urandom(8192)
    store.put("cyc", data)
    watcher = cudaipc.connect(daemon.socket, fast_path=False)
    lease = store.get("cyc")
    slot, lid, ptr = slot_of(lease), lease.lease_id, lease.data_ptr
    t = store._table
    assert state(t.word(slot)) == HELD
    assert watcher.stat("cyc").leases == 1
    lease.release()
    # Released by one swap: the word is idle and the daemon counts no lease, at once
    # (no polling: nothing was sent).
    assert state(t.word(slot)) == IDLE
    assert watcher.stat("cyc").leases == 0
    assert store.stat("cyc").leases == 0
    for i in range(300):
        lease = store.get("cyc")
        # Taken back: the same lease, slot and mapping, no round trip.
        assert (lease.lease_id, slot_of(lease), lease.data_ptr) == (lid, slot, ptr)
        assert state(t.word(slot)) == HELD
        mv = lease.memoryview()
        if i % 50 == 0:
            assert bytes(mv) == data
            assert watcher.stat("cyc").leases == 1
        lease.release()
        del mv
    assert state(t.word(slot)) == IDLE
    assert watcher.stat("cyc").leases == 0
    watcher.close()


def test_take_back_sends_nothing(store, monkeypatch):
    need_fast(store)
    store.put("quiet", os.urandom(100))
    store.get("quiet").release()

    def no_socket(*a, **k):
        raise AssertionError("a take-back went through the socket")
    monkeypatch.setattr(store._conn, "call_raw", no_socket)
    monkeypatch.setattr(store._conn, "send_detached", no_socket)
    for _ in range(100):
        with store.get("quiet") as lease:
            assert len(lease.read()) == 100


def test_taken_back_lease_answers_like_the_first(store, daemon):
    """A lease taken back through the table (made without a round trip) reports and
    views exactly what the lease granted through the socket did."""
    np = pytest.importorskip("numpy")
    need_fast(store)
    data = os.urandom(4096)
    obj = store.create("same", 4096, dtype="int32", shape=(32, 32))
    obj.write(data)
    obj.seal()

    def describe(lease):
        return (lease.name, lease.size, lease.device, lease.lease_id, lease.tensor_desc, lease.version,
                lease.gpu_share, lease.data_ptr, lease.ordinal, lease.info.name, lease.info.size,
                lease.info.tensor, lease.read(), bytes(lease.memoryview()), lease.numpy().tobytes(),
                lease.numpy().shape, str(lease.numpy().dtype), lease.numpy("uint8").tobytes())

    first = store.get("same")
    want = describe(first)
    assert want[-1] == data and want[13] == data and want[15] == (32, 32)
    first.release()
    again = store.get("same")
    assert store._table.idle_count() == 0, "the second get was not a take-back"
    assert describe(again) == want
    with pytest.raises(cudaipc.InvalidArgument):
        again.manifest_bytes()
    assert "'same'" in repr(again)
    again.release()
    assert again.released and "released" in repr(again)
    with pytest.raises(cudaipc.InvalidArgument):
        again.numpy()


def test_views_keep_a_fast_lease(store, daemon):
    """The lifetime rule holds on the fast path: release() leaves the lease held while
    a view lives; the swap runs when the last view is collected."""
    need_fast(store)
    data = os.urandom(4096)
    store.put("life", data)
    watcher = cudaipc.connect(daemon.socket, fast_path=False)
    lease = store.get("life")
    slot = slot_of(lease)
    mv = lease.memoryview()
    lease.release()
    assert state(store._table.word(slot)) == HELD
    assert watcher.stat("life").leases == 1
    assert bytes(mv) == data
    del mv
    assert state(store._table.word(slot)) == IDLE
    assert watcher.stat("life").leases == 0
    watcher.close()


def test_torch_views_on_the_fast_path(store, daemon):
    torch = pytest.importorskip("torch")
    need_fast(store)
    src = torch.randn(33, 7)
    store.put("tt", src)
    watcher = cudaipc.connect(daemon.socket, fast_path=False)
    for _ in range(50):
        lease = store.get("tt")
        x = lease.tensor()
        assert x.data_ptr() == lease.data_ptr and torch.equal(x, src)
        row = x[3]          # a view of the view: holds the lease too
        lease.release()
        del x
        assert watcher.stat("tt").leases == 1
        assert torch.equal(row, src[3])
        del row
        assert watcher.stat("tt").leases == 0
    # A non-default view is built the slow way and holds the lease the same way.
    with store.get("tt") as lease:
        b = lease.tensor(torch.uint8)
    assert watcher.stat("tt").leases == 1 and b.numel() == src.numel() * 4
    del b
    assert watcher.stat("tt").leases == 0
    watcher.close()


def test_pooled_dlpack_structs_keep_every_tensor(store, daemon):
    """Default tensors are built from DLPack structs pooled per placement: many
    tensors of several leases of one object alive at once, collected in random
    order, each keep their lease (the daemon counts it until that lease's last tensor
    goes) and their bytes; later rounds reuse the same structs."""
    torch = pytest.importorskip("torch")
    import random
    from cudaipc import _views
    need_fast(store)
    src = torch.randint(-2**31, 2**31 - 1, (64, 16), dtype=torch.int32)
    store.put("pool", src)
    watcher = cudaipc.connect(daemon.socket, fast_path=False)
    rng = random.Random(11)
    structs = None
    for rnd in range(4):
        leases = [store.get("pool") for _ in range(4)]   # concurrent: distinct leases
        assert len({l.lease_id for l in leases}) == 4
        makers, tensors = [], []
        for l in leases:
            for _ in range(3):
                tensors.append((l.lease_id, l.tensor()))
            makers.append(l._mem.views["tensor"])
            l.release()
        assert all(mk.__name__ == "make_dl" for mk in makers)
        assert watcher.stat("pool").leases == 4
        rng.shuffle(tensors)
        while tensors:
            lid, x = tensors.pop()
            assert torch.equal(x, src)
            del x
            assert watcher.stat("pool").leases == len({i for i, _ in tensors})
            assert all(torch.equal(y, src) for _, y in tensors[:2])
        pooled = sorted(id(e[3]) for mk in makers for e in mk.free)
        assert len(pooled) == 12   # every struct back in its pool
        if structs is not None:
            # The four leases are take-backs of the same grants as the round before:
            # their tensors reused its structs.
            assert pooled == structs
        structs = pooled
    assert not _views._dlpack.live
    watcher.close()


def test_deleted_object_releases_through_the_socket(store, daemon):
    """A held lease of a deleted object is doomed: its release swap fails and it goes
    through the socket; an idle one is reclaimed at once and never taken back."""
    need_fast(store)
    other = cudaipc.connect(daemon.socket, fast_path=False)
    store.put("doom", os.urandom(4096))
    held = store.get("doom")
    slot = slot_of(held)
    assert held.read()
    other.rm("doom")
    w = store._table.word(slot)
    assert state(w) == HELD and w & DOOMED, "the daemon did not doom the held slot"
    sent = []
    orig = store._conn.send_detached
    store._conn.send_detached = lambda req: (sent.append(req), orig(req))[1]
    held.release()
    assert len(sent) == 1 and type(sent[0]).__name__ == "Release", "the doomed lease was not released through the socket"
    assert store._table.idle_count() == 0
    deadline = time.monotonic() + 5
    while state(store._table.word(slot)) != 0 and time.monotonic() < deadline:
        store.ls()   # reads the pipelined reply; the daemon frees the slot
    assert state(store._table.word(slot)) == 0

    # Idle, then deleted: reclaimed; a new object under the name is what get finds.
    store.put("doom2", os.urandom(4096))
    store.get("doom2").release()
    assert store._table.idle_count() == 1
    other.rm("doom2")
    with pytest.raises((cudaipc.NotFound, cudaipc.Timeout)):   # asked through the socket
        store.get("doom2", timeout=0)
    assert store._table.idle_count() == 0
    fresh = os.urandom(4096)
    other.put("doom2", fresh)
    with store.get("doom2") as lease:
        assert lease.read() == fresh
    other.close()


def test_idle_leases_do_not_hold_memory(small_daemon):
    """The daemon reclaims idle leases when a create needs their memory."""
    s = cudaipc.connect(small_daemon.socket)
    need_fast(s)
    other = cudaipc.connect(small_daemon.socket, fast_path=False)
    s.put("big", os.urandom(5 << 20))
    s.get("big").release()           # idle, kept for a take-back
    other.rm("big")                  # reclaimed at once: deleted
    other.put("big2", os.urandom(6 << 20))
    s.get("big2").release()
    assert other.stat("big2").leases == 0
    assert other.ls()[0].name == "big2"
    s.close()
    other.close()


HOLDER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
import cudaipc
s = cudaipc.connect(sys.argv[1])
assert s.fast_path
held = s.get("held", timeout=5)
mv = held.memoryview()
held.release()                 # still held: the view lives
s.get("idle", timeout=5).release()   # idle in the table
print("holding", s._table.idle_count(), flush=True)
time.sleep(60)
"""


def test_kill_9_frees_fast_path_leases(small_daemon):
    s = cudaipc.connect(small_daemon.socket, fast_path=False)
    if _fastpath.atomics() is None:
        pytest.fail("libatomic.so.1 is missing")
    s.put("held", os.urandom(3 << 20))
    s.put("idle", os.urandom(3 << 20))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, small_daemon.socket, PYROOT], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().split() == [b"holding", b"1"]
        assert s.stat("held").leases == 1
        assert s.stat("idle").leases == 0
        s.rm("held")
        s.rm("idle")
        with pytest.raises(cudaipc.StoreFull):
            s.put("after", os.urandom(6 << 20))   # "held" still occupies its 3 MiB
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 5
        while True:
            try:
                s.put("after", os.urandom(6 << 20))
                break
            except cudaipc.StoreFull:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        assert s.stat("after").leases == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        s.close()


def test_threads_hammer_one_client(store, daemon):
    need_fast(store)
    names = ["h%d" % i for i in range(3)]
    datas = {n: os.urandom(4096) for n in names}
    for n in names:
        store.put(n, datas[n])
    errors = []
    stop = time.monotonic() + 3

    def work(k):
        try:
            i = 0
            while time.monotonic() < stop or i < 200:
                n = names[(k + i) % len(names)]
                lease = store.get(n)
                mv = lease.memoryview()
                if bytes(mv[:64]) != datas[n][:64]:
                    errors.append("thread %d: wrong bytes for %s" % (k, n))
                lease.release()
                del mv                       # the release swap runs here
                if i % 3 == 0:
                    keep = store.get(n)      # two leases of one name at once
                    store.get(n).release()
                    keep.release()
                i += 1
        except Exception as e:  # noqa: BLE001
            errors.append("thread %d: %r" % (k, e))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:5]
    gc.collect()
    for n in names:
        assert store.stat(n).leases == 0
    # Every idle lease is idle in the table and distinct.
    t = store._table
    with t.lock:
        entries = list(t.by_slot.values())
    assert len({e.slot for e in entries}) == len(entries)
    for e in entries:
        assert t.word(e.slot) == (e.gen << 3) | IDLE


def test_no_atomics_falls_back_to_the_socket(daemon, monkeypatch, caplog):
    monkeypatch.setenv("CUDAIPC_NO_ATOMICS", "1")
    _fastpath._reset_for_tests()
    try:
        with caplog.at_level(logging.DEBUG, logger="cudaipc"):
            s = cudaipc.connect(daemon.socket)
            s2 = cudaipc.connect(daemon.socket)
        assert not s.fast_path and not s2.fast_path
        msgs = [r.getMessage() for r in caplog.records if "fast path off" in r.getMessage()]
        assert len(msgs) == 1, msgs   # logged once per process
        data = os.urandom(5000)
        s.put("nf", data)
        for _ in range(20):
            with s.get("nf") as lease:
                assert lease.read() == data
                assert lease._rec.table is None
        deadline = time.monotonic() + 5
        while s2.stat("nf").leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s2.stat("nf").leases == 0
        s.close()
        s2.close()
    finally:
        monkeypatch.delenv("CUDAIPC_NO_ATOMICS")
        _fastpath._reset_for_tests()


def test_fast_path_off(daemon):
    with cudaipc.connect(daemon.socket, fast_path=False) as s:
        assert not s.fast_path
        s.put("off", b"x" * 10)
        with s.get("off") as lease:
            assert lease.read() == b"x" * 10 and lease._rec.table is None


class TableDaemon:
    """hello, then a lease_table answer of the test's making, then stat answers."""

    def __init__(self, slots, table_bytes, nfds=1):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "s.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.slots, self.table_bytes, self.nfds = slots, table_bytes, nfds
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        c, _ = self.srv.accept()
        with c:
            self.serve(c)

    def serve(self, c):
        while True:
            data = c.recv(65536)
            if not data:
                return
            req = pb.Request.FromString(data)
            kind = req.WhichOneof("body")
            if kind == "hello":
                c.send(pb.Response(id=req.id, hello=pb.HelloResponse(version=2, backend="host")).SerializeToString())
            elif kind == "lease_table":
                fd = os.memfd_create("t")
                os.ftruncate(fd, self.table_bytes)
                resp = pb.Response(id=req.id, lease_table=pb.LeaseTableResponse(slots=self.slots)).SerializeToString()
                if self.nfds:
                    c.sendmsg([resp], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * self.nfds))])
                else:
                    c.send(resp)
                os.close(fd)
            else:
                c.send(pb.Response(id=req.id, stat=pb.StatResponse(info=pb.ObjectInfo(name="x", size=1, device="host"))).SerializeToString())


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("slots,nbytes,nfds", [
    (0, 4096, 1),              # no slots
    (1 << 20, 8 << 20, 1),     # more than protocol.MaxLeaseSlots
    (4096, 100, 1),            # a memfd smaller than its slots
    (4096, 4096 * 8, 0),       # no descriptor
])
def test_bad_lease_table_is_not_used(slots, nbytes, nfds):
    if _fastpath.atomics() is None:
        pytest.skip("no libatomic: the lease table is never asked for")
    before = open_fds()
    d = TableDaemon(slots, nbytes, nfds)
    s = cudaipc.connect(d.path)
    assert not s.fast_path
    assert s.stat("x").name == "x"
    s.close()
    d.th.join(5)
    d.srv.close()
    assert open_fds() <= before, "descriptors leaked"


def test_slot_words_match_go():
    """The word layout is protocol.SlotWord's: generation << 3 | doomed << 2 | state."""
    assert _fastpath.held_word(5) == (5 << 3) | 1
    assert _fastpath.idle_word(5) == (5 << 3) | 2
    assert struct.calcsize("Q") == 8 and mmap.PAGESIZE % 8 == 0


def test_default_tensor_of_every_dtype(store, daemon):
    """lease.tensor() (the cached construction: DLPack where PyTorch takes the type)
    equals the source for every dtype, is zero-copy, and lets the lease go when
    collected."""
    torch = pytest.importorskip("torch")
    from cudaipc import _views
    watcher = cudaipc.connect(daemon.socket, fast_path=False)
    g = torch.Generator().manual_seed(7)
    for name in _views.DTYPES:
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        raw = torch.randint(0, 2 if name == "bool" else 256, (6 * 5 * 16,), dtype=torch.uint8, generator=g)
        try:
            src = raw.view(dt).reshape(6, 5, -1)   # random bytes; compared as bytes
        except (RuntimeError, TypeError):
            continue
        key = "dt-" + name
        try:
            store.put(key, src)
        except cudaipc.InvalidArgument:
            continue
        for _ in range(3):
            lease = store.get(key)
            x = lease.tensor()
            assert x.dtype == dt and tuple(x.shape) == tuple(src.shape), name
            assert x.data_ptr() == lease.data_ptr, name
            assert x.view(torch.uint8).reshape(-1).tolist() == src.view(torch.uint8).reshape(-1).tolist(), name
            lease.release()
            assert watcher.stat(key).leases == 1
            del x
            assert watcher.stat(key).leases == 0, name
    # A recorded strided layout (a transposed view) comes back with its strides.
    base = torch.randn(4, 6)
    obj = store.create("strided", base.numel() * 4, dtype="float32", shape=(6, 4), strides=(1, 6))
    obj.write(base.numpy().tobytes())
    obj.seal()
    with store.get("strided") as lease:
        x = lease.tensor()
        assert x.stride() == (1, 6) and torch.equal(x, base.t())
    del x
    if _views._dlpack is not None:
        assert not _views._dlpack.live, "DLPack owners kept after their tensors went"
    watcher.close()


def test_no_take_back_once_the_daemon_is_gone(cudaipc_bin):
    """A connection known to be dead takes nothing back from its table."""
    d = Daemon(cudaipc_bin, ["--backend", "host", "--capacity", "64MiB"])
    try:
        s = cudaipc.connect(d.socket)
        need_fast(s)
        s.put("gone", os.urandom(1000))
        s.get("gone").release()
        assert s._table.idle_count() == 1
        d.proc.kill()
        d.proc.wait(10)
        with pytest.raises(cudaipc.StoreGone):
            s.stat("gone")
        with pytest.raises(cudaipc.StoreGone):
            s.get("gone")
        s.close()
        assert s._table.closed and s._table.idle_count() == 0
    finally:
        d.stop()
