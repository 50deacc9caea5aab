"""The GPU arena cache's rules, on a CPU: a fake daemon sends legacy-IPC placements
and the driver calls are counted instead of made (the GPU tests run the real thing).

One open per arena however many get/release cycles; the mapping outlives the lease
while the arena holds objects; arenas_freed unmaps it (once no view uses it) and is
answered with forget_arenas."""

from __future__ import annotations

import array
import mmap
import os
import socket
import struct
import tempfile
import threading

import pytest

import cudaipc
from cudaipc import _cuda
from cudaipc import _store_pb2 as pb
from cudaipc.region import Region, local_identity


def arena_region(size: int) -> bytes:
    ns, boot = local_identity()
    return Region(handle=bytes(range(64)), offset=0, size=size, alloc_size=size, device=bytes(range(1, 17)),
                  exporter_pid=1, pid_namespace=ns, boot_id=boot, buffer_id=7, exporter_base=0x7F0000000000).to_bytes()


class FakeGPUDaemon:
    """hello; every get: a CUDA_IPC placement in arena 5; 'free' sends arenas_freed."""

    def __init__(self, table: bool = False):
        self.table = table      # serve a lease table and grant slots (docs/protocol.md 6.7)
        self.words = None
        self.granted = []       # (slot, gen) of each get
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "s.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.requests = []
        self.conn = None
        self.ready = threading.Event()
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        try:
            c, _ = self.srv.accept()
        except OSError:
            return
        self.conn = c
        self.ready.set()
        try:
            self.serve(c)
        except OSError:
            pass   # the client went (a pipelined request's answer finds no reader): the end
        finally:
            c.close()

    def serve(self, c):
        region = arena_region(1 << 20)
        lease = 0
        while True:
            data = c.recv(65536)
            if not data:
                return
            req = pb.Request.FromString(data)
            kind = req.WhichOneof("body")
            self.requests.append(kind)
            if kind == "hello":
                resp = pb.Response(id=req.id, hello=pb.HelloResponse(version=req.hello.version, backend="cuda"))
            elif kind == "lease_table" and self.table:
                fd = os.memfd_create("leases")
                os.ftruncate(fd, 64 * 8)
                self.words = mmap.mmap(fd, 64 * 8)
                c.sendmsg([pb.Response(id=req.id, lease_table=pb.LeaseTableResponse(slots=64)).SerializeToString()],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                os.close(fd)
                continue
            elif kind == "get":
                lease += 1
                slot = gen = 0
                if self.words is not None:
                    slot, gen = lease % 64 + 1, lease
                    struct.pack_into("<Q", self.words, (slot - 1) * 8, gen << 3 | 1)
                    self.granted.append((slot, gen))
                resp = pb.Response(id=req.id, get=pb.GetResponse(lease_id=lease, placement=pb.Placement(
                    arena_id=5, device="GPU-01020304-0506-0708-090a-0b0c0d0e0f10", offset=4096 * lease,
                    size=4096, arena_size=1 << 20, kind=pb.Placement.CUDA_IPC, region=region),
                    lease_slot=slot, lease_gen=gen))
            elif kind == "release":
                resp = pb.Response(id=req.id, release=pb.ReleaseResponse())
            elif kind == "forget_arenas":
                self.forgotten = list(req.forget_arenas.arena_ids)
                resp = pb.Response(id=req.id, forget_arenas=pb.ForgetArenasResponse())
            else:
                resp = pb.Response(id=req.id, stat=pb.StatResponse(info=pb.ObjectInfo(name="x", size=1, device="host")))
            c.send(resp.SerializeToString())

    def stop(self):
        """Close the listener and the connection and wait for the thread."""
        self.srv.close()
        if self.conn is not None:
            try:
                self.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.th.join(10)
        assert not self.th.is_alive(), "the fake daemon did not stop"
        os.unlink(self.path)
        os.rmdir(self.dir)

    def free(self):
        # The daemon reclaims idle leases before it finds the arena empty.
        for slot, gen in self.granted:
            if struct.unpack_from("<Q", self.words, (slot - 1) * 8)[0] == gen << 3 | 2:
                struct.pack_into("<Q", self.words, (slot - 1) * 8, gen << 3)
        self.conn.send(pb.Response(arenas_freed=pb.ArenasFreed(arena_ids=[5])).SerializeToString())


@pytest.fixture
def fake_daemon():
    made = []

    def make(**kw):
        made.append(FakeGPUDaemon(**kw))
        return made[-1]
    yield make
    for d in made:
        d.stop()


@pytest.fixture
def fake_driver(monkeypatch):
    calls = {"open": 0, "close": 0}

    def ipc_open(handle, bid, ordinal):
        calls["open"] += 1
        return 0x10000000

    def ipc_close(handle, bid, ordinal):
        calls["close"] += 1

    monkeypatch.setattr(_cuda, "pick_ordinal", lambda uuid: 0)
    monkeypatch.setattr(_cuda, "ipc_open", ipc_open)
    monkeypatch.setattr(_cuda, "ipc_close", ipc_close)
    return calls


def test_one_open_for_many_cycles_and_forget_on_free(fake_driver, fake_daemon):
    d = fake_daemon()
    s = cudaipc.connect(d.path)
    for i in range(1, 101):
        with s.get("x") as lease:
            assert lease.data_ptr == 0x10000000 + 4096 * i
            assert lease.gpu_share == "ipc"
    assert fake_driver == {"open": 1, "close": 0}
    held = s.get("x")
    keep = held._mem      # what a view holds
    held.release()
    d.free()
    s.stat("x")           # reads the unasked arenas_freed
    assert fake_driver["close"] == 0, "unmapped while a view still uses the arena"
    assert "forget_arenas" not in d.requests
    del keep, held
    s.stat("x")
    assert fake_driver["close"] == 1
    assert d.requests.count("forget_arenas") == 1 and d.forgotten == [5]
    s.close()


def test_idle_arenas_are_unmapped_on_close(fake_driver, fake_daemon):
    d = fake_daemon()
    s = cudaipc.connect(d.path)
    with s.get("x"):
        pass
    assert fake_driver == {"open": 1, "close": 0}
    s.close()
    assert fake_driver["close"] == 1


def test_idle_fast_leases_keep_the_arena_until_freed(fake_driver, fake_daemon):
    """A lease released through the lease table keeps its arena mapped (the next get
    takes it back with no request and no driver call); when the daemon reclaims it and
    frees the arena, the idle lease is forgotten and the arena unmapped."""
    from cudaipc import _fastpath
    if _fastpath.atomics() is None:
        pytest.skip("no libatomic: no lease table")
    d = fake_daemon(table=True)
    s = cudaipc.connect(d.path)
    assert s.fast_path
    first = s.get("x")
    ptr = first.data_ptr
    first.release()
    del first
    for _ in range(50):
        with s.get("x") as lease:
            assert lease.data_ptr == ptr and lease.gpu_share == "ipc"
    assert d.requests.count("get") == 1, "a take-back asked the daemon"
    assert fake_driver == {"open": 1, "close": 0}
    assert s._table.idle_count() == 1
    d.free()
    s.stat("x")           # reads the unasked arenas_freed
    assert s._table.idle_count() == 0
    assert fake_driver["close"] == 1
    s.stat("x")           # a round trip after the (pipelined) forget_arenas
    assert d.requests.count("forget_arenas") == 1 and d.forgotten == [5]
    with s.get("x") as lease:   # reclaimed: through the socket again
        pass
    assert d.requests.count("get") == 2 and fake_driver["open"] == 2
    s.close()
