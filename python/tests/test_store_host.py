"""The store client against a real daemon, host memory (runs on any machine)."""

from __future__ import annotations

import gc
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import cudaipc
from conftest import PYROOT, Daemon, need_module

np = pytest.importorskip("numpy", reason="NumPy is needed for the array tests (python3-numpy)")


def rand_bytes(n: int) -> bytes:
    return os.urandom(n)


def wait_leases(store: cudaipc.Store, name: str, want: int, timeout: float = 5.0) -> int:
    """Leases the daemon reports for name, polled until want (releases are pipelined)."""
    deadline = time.monotonic() + timeout
    while True:
        n = store.stat(name).leases
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def test_connect_reports_server(store):
    assert store.server.version == 2
    assert store.server.backend == "host"
    assert store.server.pid > 0


def test_default_socket_path(monkeypatch):
    monkeypatch.setenv("CUDAIPC_SOCKET", "/x/y.sock")
    assert cudaipc.default_socket_path() == "/x/y.sock"
    monkeypatch.delenv("CUDAIPC_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/5")
    assert cudaipc.default_socket_path() == "/run/user/5/cudaipc/store.sock"


def test_connect_uses_env(daemon, monkeypatch):
    monkeypatch.setenv("CUDAIPC_SOCKET", daemon.socket)
    with cudaipc.connect() as s:
        assert s.socket == daemon.socket


@pytest.mark.parametrize("size", [1, 4095, 4096, 1 << 20, (8 << 20) + 3])
def test_put_get_bytes(store, size):
    data = rand_bytes(size)
    info = store.put("b%d" % size, data)
    assert info.size == size and info.sealed and info.device == "host" and info.tensor is None
    with store.get("b%d" % size, timeout=1) as lease:
        mv = lease.memoryview()
        assert mv.readonly and mv.nbytes == size
        assert bytes(mv) == data
        assert lease.read() == data
        del mv


def test_numpy_roundtrip_zero_copy(store):
    a = np.random.default_rng().standard_normal((64, 33)).astype(np.float32)
    store.put("a", a)
    lease = store.get("a")
    assert lease.tensor_desc == cudaipc.TensorDesc("float32", (64, 33))
    x = lease.numpy()
    assert x.dtype == np.float32 and x.shape == (64, 33)
    assert np.array_equal(x, a)
    assert not x.flags.writeable
    # Zero copy: the array is the lease's memory, not a copy of it.
    assert x.__array_interface__["data"][0] == lease.data_ptr
    y = lease.numpy()
    assert y.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    # Reinterpreting: another dtype and shape of the same bytes.
    raw = lease.numpy("uint8")
    assert raw.nbytes == a.nbytes and raw.tobytes() == a.tobytes()
    v = lease.numpy(np.float32, (-1,))
    assert v.shape == (64 * 33,)


def test_torch_cpu_roundtrip_zero_copy(store):
    need_module("torch")
    import torch
    t = torch.randn(17, 5, dtype=torch.float64)
    store.put("t", t)
    lease = store.get("t")
    u = lease.tensor()
    assert u.device.type == "cpu" and u.dtype == torch.float64 and tuple(u.shape) == (17, 5)
    assert torch.equal(u, t)
    assert u.data_ptr() == lease.data_ptr
    b = torch.randn(4, 8).to(torch.bfloat16)
    store.put("bf", b)
    with store.get("bf") as l2:
        got = l2.tensor()
        assert got.dtype == torch.bfloat16 and torch.equal(got, b)
        if importlib.util.find_spec("ml_dtypes") is None:
            with pytest.raises(TypeError, match="ml_dtypes"):
                l2.numpy()  # NumPy has no bfloat16
        else:
            import ml_dtypes
            v = l2.numpy()
            assert v.dtype == np.dtype(ml_dtypes.bfloat16) and v.shape == (4, 8) and not v.flags.writeable
            assert v.tobytes() == b.view(torch.int16).numpy().tobytes()
        assert l2.numpy("uint16").tobytes() == b.view(torch.int16).numpy().tobytes()


def test_views_hold_the_lease_after_release(store, daemon):
    """A view stays valid after release() and after the with block; the daemon sees the
    lease end only when the last view is collected."""
    a = np.frombuffer(rand_bytes(1 << 16), dtype=np.uint8).copy()
    store.put("held", a)
    other = cudaipc.connect(daemon.socket)
    with store.get("held") as lease:
        x = lease.numpy()
        mv = lease.memoryview()
    assert lease.released
    with pytest.raises(cudaipc.InvalidArgument):
        lease.numpy()
    assert other.stat("held").leases == 1
    other.rm("held")  # deleted: the memory stays while leased
    with pytest.raises(cudaipc.NotFound):
        other.stat("held")
    # Put enough to reuse freed memory if the lease had ended.
    for i in range(4):
        other.put("filler%d" % i, rand_bytes(1 << 16))
    assert np.array_equal(x, a) and bytes(mv) == a.tobytes()
    del x
    gc.collect()
    assert bytes(mv[:16]) == a[:16].tobytes()
    other.close()


def test_lease_ends_when_last_view_collected(store, daemon):
    store.put("v", rand_bytes(1000))
    watcher = cudaipc.connect(daemon.socket)
    lease = store.get("v")
    views = [lease.numpy(), lease.memoryview()]
    try:
        import torch  # noqa: F401
        views.append(lease.tensor())
    except ImportError:
        pass
    lease.release()
    del lease
    gc.collect()
    assert watcher.stat("v").leases == 1
    while views:
        views.pop()
        gc.collect()
        assert wait_leases(watcher, "v", 1 if views else 0) == (1 if views else 0)
    watcher.close()


def test_create_fill_in_place_and_seal(store, daemon):
    o = store.create("c", 4 * 100, dtype="int32", shape=(10, 10))
    want = np.random.default_rng().integers(-2**31, 2**31 - 1, size=(10, 10), dtype=np.int32)
    w = o.numpy()
    assert w.flags.writeable and w.shape == (10, 10)
    w[:] = want
    del w
    o.seal()
    with pytest.raises(cudaipc.InvalidArgument):
        o.numpy()
    with cudaipc.connect(daemon.socket) as r:
        with r.get("c") as lease:
            assert np.array_equal(lease.numpy(), want)


def test_object_write_and_abort(store):
    o = store.create("w", 10)
    o.write(b"abc", 7)
    with pytest.raises(cudaipc.InvalidArgument):
        o.write(b"abcd", 7)
    o.abort()
    with pytest.raises(cudaipc.NotFound):
        store.stat("w")
    with store.create("w2", 4) as o2:
        o2.write(b"wxyz")
    assert store.get("w2").read() == b"wxyz"


def test_unsealed_object_collected_is_aborted(store):
    events = store.subscribe(timeout=5)
    o = store.create("gone", 100)
    del o
    gc.collect()
    assert next(events) == cudaipc.Event("aborted", "gone")


def test_ls_stat_rm_subscribe(store, daemon):
    events = store.subscribe(timeout=5)
    names = ["m/layer.%d" % i for i in range(5)]
    with cudaipc.connect(daemon.socket) as w:
        for n in names:
            w.put(n, rand_bytes(100))
        got = [next(events) for _ in names]
        assert got == [cudaipc.Event("sealed", n) for n in names]
        assert [o.name for o in store.ls()] == sorted(names)
        st = store.stat(names[0])
        assert st.size == 100 and st.sealed and st.owner_uid == os.getuid() and st.region is None
        w.rm(names[0])
        assert next(events) == cudaipc.Event("deleted", names[0])
    assert list(store.subscribe(timeout=0.05)) == []


def test_get_waits_while_other_calls_proceed(store, daemon):
    out = {}

    def waiter():
        try:
            with store.get("later", timeout=10) as l:
                out["data"] = l.read()
        except Exception as e:  # noqa: BLE001
            out["err"] = e

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    store.put("meanwhile", b"1")          # the same connection is not blocked
    assert store.stat("meanwhile").size == 1
    data = rand_bytes(777)
    with cudaipc.connect(daemon.socket) as w:
        w.put("later", data)
    th.join(10)
    assert out.get("data") == data, out


def test_bad_input(store):
    with pytest.raises(cudaipc.NotFound):
        store.stat("no-such-object")
    with pytest.raises(cudaipc.NotFound):
        store.rm("no-such-object")
    with pytest.raises(cudaipc.Timeout) as e:
        store.get("no-such-object", timeout=0.05)
    assert isinstance(e.value, TimeoutError)
    with pytest.raises(cudaipc.InvalidArgument):
        store.get("bad\x00name", timeout=0)
    with pytest.raises(cudaipc.InvalidArgument):
        store.create("", 10)
    with pytest.raises(cudaipc.InvalidArgument):
        store.create("zero", 0)
    with pytest.raises(cudaipc.InvalidArgument):
        store.create("typed", 10, dtype="float32", shape=(3,))      # 12 bytes in 10
    with pytest.raises(cudaipc.InvalidArgument):
        store.create("typed", 10, dtype="float33")
    with pytest.raises(cudaipc.InvalidArgument):
        store.create("typed", 10, device="cuda-ish")
    store.put("x", b"12345678")
    with pytest.raises(cudaipc.Exists):
        store.put("x", b"1")
    with store.get("x") as l:
        with pytest.raises(ValueError):
            l.numpy("float64", (2,))        # 16 bytes from an 8-byte object
        with pytest.raises(ValueError):
            l.numpy("float32", (3, -1))     # does not divide
        with pytest.raises(TypeError):
            l.numpy("float128")
        with pytest.raises(TypeError):
            l.cupy()                        # a host object


def test_daemon_rejects_bad_descriptor_itself(store):
    """The daemon checks descriptors too (a client that skips the checks)."""
    from cudaipc import _store_pb2 as pb
    req = pb.Request(create=pb.CreateRequest(name="raw", size=8, tensor=pb.TensorDesc(dtype="float64", shape=[2])))
    with pytest.raises(cudaipc.InvalidArgument) as e:
        store._conn.call(req, "create", "raw")
    assert "spans more than" in str(e.value)


def test_dead_daemon(cudaipc_bin, tmp_path):
    with pytest.raises(cudaipc.StoreGone) as e:
        cudaipc.connect(str(tmp_path / "none.sock"))
    assert "cudaipc serve" in str(e.value) and isinstance(e.value, ConnectionError)
    d = Daemon(cudaipc_bin, ["--backend", "host"])
    s = cudaipc.connect(d.socket)
    s.put("x", b"abc")
    lease = s.get("x")
    view = lease.memoryview()
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(cudaipc.StoreGone):
        s.stat("x")
    with pytest.raises(cudaipc.StoreGone):
        s.put("y", b"1")
    assert bytes(view) == b"abc"  # the mapping outlives the daemon
    del view
    lease.release()
    s.close()
    with pytest.raises(cudaipc.Closed):
        s.stat("x")
    d.stop()


HOLDER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
import cudaipc
s = cudaipc.connect(sys.argv[1])
lease = s.get("victim", timeout=5)
views = [lease.memoryview()]
lease.release()
print("holding", flush=True)
time.sleep(60)
"""


def test_kill_9_of_a_lease_holder(store, daemon):
    store.put("victim", rand_bytes(4096))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.socket, PYROOT], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"holding"
        assert store.stat("victim").leases == 1
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert wait_leases(store, "victim", 0) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_python_producer_go_consumer(store, daemon, tmp_path):
    data = rand_bytes(3 << 20)
    store.put("py2go", data)
    out = tmp_path / "out.bin"
    daemon.cli("get", "py2go", "-o", str(out))
    assert out.read_bytes() == data
    a = np.random.default_rng().standard_normal((8, 16)).astype(np.float16)
    store.put("typed", a)
    js = daemon.cli("stat", "typed", "--json").stdout
    import json
    t = json.loads(js)["tensor"]
    assert t == {"dtype": "float16", "shape": [8, 16]}


def test_go_producer_python_consumer(store, daemon, tmp_path):
    data = rand_bytes(12 * 1024)
    f = tmp_path / "in.bin"
    f.write_bytes(data)
    daemon.cli("put", str(f), "--name", "go2py", "--dtype", "float32", "--shape", "3,1024")
    with store.get("go2py", timeout=5) as lease:
        assert lease.tensor_desc == cudaipc.TensorDesc("float32", (3, 1024))
        x = lease.numpy()
        assert x.shape == (3, 1024) and x.tobytes() == data
    daemon.cli("put", str(f), "--name", "go2py-strided", "--dtype", "uint8", "--shape", "2,3",
               "--strides", "100,7")
    with store.get("go2py-strided") as lease:
        x = lease.numpy()
        assert x.strides == (100, 7)
        assert x[1, 2] == data[114]
    r = daemon.cli("put", str(f), "--name", "bad", "--dtype", "float64", "--shape", "2000", check=False)
    assert r.returncode != 0 and b"spans more than" in r.stderr


def test_many_leases_and_arena_growth(store, daemon):
    """Objects in several arenas and an arena that grows; each lease reads its own bytes."""
    blobs = {("g%d" % i): rand_bytes(1 << (10 + i % 12)) for i in range(40)}
    with cudaipc.connect(daemon.socket) as w:
        for n, b in blobs.items():
            w.put(n, b)
    leases = {n: store.get(n) for n in blobs}
    for n, l in leases.items():
        assert l.read() == blobs[n], n
    for l in leases.values():
        l.release()
    assert all(wait_leases(store, n, 0) == 0 for n in list(blobs)[:3])


def test_emptied_arena_is_dropped_and_forgotten(store):
    """protocol 6.4: the daemon says an arena is empty (arenas_freed); the client
    drops its mapping, tells the daemon (forget_arenas) and later objects still work."""
    data = rand_bytes(5000)
    store.put("only", data)
    with store.get("only") as l:
        assert l.read() == data
    held = {k[0] for k in store._conn._arenas}
    assert held
    store.rm("only")
    store.ls()  # reads the unasked arenas_freed packet
    deadline = time.monotonic() + 5
    while {k[0] for k in store._conn._arenas} & held and time.monotonic() < deadline:
        store.ls()
        time.sleep(0.01)
    assert not ({k[0] for k in store._conn._arenas} & held)
    data2 = rand_bytes(7000)
    store.put("next", data2)
    with store.get("next") as l:
        assert l.read() == data2


def test_put_reserve_next(store, daemon):
    """put(reserve_next=True) creates the next object ahead; the next put of the same
    size writes into it and seals it under its own name in one round trip; a put that
    does not match, a taken name and close give it back."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    datas = [rng.integers(0, 256, 10000, dtype=np.uint8) for _ in range(3)]
    for i, d in enumerate(datas):
        store.put("ra%d" % i, d.view(np.float32) if i == 2 else d, reserve_next=True)
    drafts = [o for o in store.ls() if o.name.startswith(".put-ahead.")]
    assert len(drafts) == 1 and not drafts[0].sealed and drafts[0].size == 10000, drafts
    for i, d in enumerate(datas):
        with store.get("ra%d" % i) as lease:
            assert lease.read() == d.tobytes()
            want = cudaipc.TensorDesc("float32", (2500,)) if i == 2 else cudaipc.TensorDesc("uint8", (10000,))
            assert lease.tensor_desc == want, (i, lease.tensor_desc)
    # A taken name: Exists, and the object made ahead goes back.
    with pytest.raises(cudaipc.Exists):
        store.put("ra0", datas[1])
    assert not [o for o in store.ls() if o.name.startswith(".put-ahead.")]
    with store.get("ra0") as lease:
        assert lease.read() == datas[0].tobytes()
    # A put of another size gives it back, and keeps none unless asked.
    store.put("rb0", datas[0], reserve_next=True)
    store.put("rb1", b"x" * 100)
    store.put("rb2", b"y" * 100)
    assert not [o for o in store.ls() if o.name.startswith(".put-ahead.")]
    store.put("rb3", datas[0], reserve_next=True)
    ahead = [o.name for o in store.ls() if o.name.startswith(".put-ahead.")]
    assert len(ahead) == 1
    store.close()   # the daemon aborts it: its name is free again
    other = cudaipc.connect(daemon.socket)
    try:
        for _ in range(100):
            try:
                other.put(ahead[0], b"z")
                break
            except cudaipc.Exists:
                time.sleep(0.01)
        assert other.stat(ahead[0]).sealed
    finally:
        other.close()


def test_list_delete_and_share_kind(store):
    """list/delete are the Go client's names (ls/rm the command line's); a host
    lease's share kind is the protocol's "host"."""
    store.put("ld/a", b"a")
    store.put("ld/b", b"b")
    assert [o.name for o in store.list()] == ["ld/a", "ld/b"] == [o.name for o in store.ls()]
    with store.get("ld/a") as lease:
        assert lease.share == cudaipc.SHARE_HOST == "host" and lease.gpu_share == ""
    store.delete("ld/a")
    store.rm("ld/b")
    assert store.list() == []


def test_put_refuses_object_arrays(store):
    """An object-dtype array holds pointers to Python objects: refused in one line,
    nothing stored."""
    for a in (np.array([{"k": 1}, None, "s"], dtype=object),
              np.zeros(3, dtype=[("x", "i4"), ("o", "O")]),
              memoryview(np.array([1, "x"], dtype=object))):
        with pytest.raises(cudaipc.InvalidArgument) as e:
            store.put("objs", a)
        assert "objs" in str(e.value) and "object" in str(e.value) and "\n" not in str(e.value)
    assert store.list() == []


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool"])
def test_zero_d_array_keeps_its_shape(store, dtype):
    rng = np.random.default_rng()
    a = np.asarray(rng.integers(0, 100), dtype=dtype).reshape(())
    store.put("scalar-" + dtype, a)
    with store.get("scalar-" + dtype) as lease:
        assert lease.tensor_desc == cudaipc.TensorDesc(dtype, ())
        x = lease.numpy()
        assert x.shape == () and x.dtype == a.dtype and x == a
    assert store.stat("scalar-" + dtype).tensor.shape == ()


def test_zero_d_tensor_keeps_its_shape(store):
    need_module("torch")
    import torch
    t = torch.tensor(3.25, dtype=torch.float64)
    store.put("scalar-t", t)
    with store.get("scalar-t") as lease:
        u = lease.tensor()
        assert tuple(u.shape) == () and u.item() == 3.25


def test_connection_limit_is_named(cudaipc_bin):
    """A connection beyond the daemon's limit per uid is told so (LIMIT, naming the
    limit), not taken for a uid the daemon does not admit."""
    d = Daemon(cudaipc_bin, ["--backend", "host"], config="max-conns-per-uid = 2\n")
    try:
        held = [cudaipc.connect(d.socket) for _ in range(2)]
        for _ in range(5):   # however the refusal races the handshake
            with pytest.raises(cudaipc.LimitReached) as e:
                cudaipc.connect(d.socket)
            msg = str(e.value)
            assert "limit per uid" in msg and "max-conns-per-uid" in msg and "admitted" not in msg, msg
        for s in held:
            s.close()
    finally:
        d.stop()


def test_get_of_a_name_not_sealed(store, daemon):
    """docs/protocol.md: get does not wait unless asked (timeout= or wait=True); an
    unsealed object is as invisible as none."""
    t0 = time.monotonic()
    with pytest.raises(cudaipc.NotFound, match="wait=True"):
        store.get("nobody")
    assert time.monotonic() - t0 < 5
    o = store.create("being-written", 8)
    with cudaipc.connect(daemon.socket) as other:
        with pytest.raises(cudaipc.NotFound):
            other.get("being-written")
        with pytest.raises(cudaipc.Timeout):
            other.get("being-written", timeout=0.05)
        out = {}

        def waiter():
            with other.get("being-written", wait=True) as lease:
                out["data"] = lease.read()
        th = threading.Thread(target=waiter)
        th.start()
        th.join(0.2)
        assert th.is_alive() and not out, "get(wait=True) did not wait for the seal"
        o.write(b"87654321")
        o.seal()
        th.join(10)
        assert out.get("data") == b"87654321"


SEALED_WRITER = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
import cudaipc
s = cudaipc.connect(sys.argv[1])
data = os.urandom(4096)
obj = s.create("sealed-then-written", 4096, shared=True)
mv = obj.memoryview()
mv[:] = data
obj.seal()
print(data.hex(), flush=True)
mv[0] = mv[0] ^ 0xFF
print("wrote after the seal", flush=True)
"""


def test_sealed_shared_host_object_is_read_only_for_its_creator(store, daemon):
    """After the seal of a shared host object its creator holds no writable mapping
    (as the Go client): the daemon seals the memory against writes (stat says
    creator_can_write false), the creator's old views read the sealed bytes, and a
    write through them faults."""
    data = rand_bytes(1 << 16)
    obj = store.create("sealed-ro", len(data), shared=True)
    mv = obj.memoryview()
    mv[:] = data
    obj.seal()
    assert store.stat("sealed-ro").creator_can_write is False
    assert bytes(mv) == data
    with cudaipc.connect(daemon.socket) as other, other.get("sealed-ro") as lease:
        assert lease.read() == data

    put = rand_bytes(8192)
    store.put("put-ro", put, shared=True)
    assert store.stat("put-ro").creator_can_write is False
    store.put("put-private", put)
    assert store.stat("put-private").creator_can_write is True   # its arena holds the owner's drafts too

    p = subprocess.run([sys.executable, "-c", SEALED_WRITER, daemon.socket, PYROOT], capture_output=True, timeout=60)
    lines = p.stdout.split()
    assert len(lines) == 1, (p.stdout, p.stderr)
    assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stderr)
    with store.get("sealed-then-written") as lease:
        assert lease.read() == bytes.fromhex(lines[0].decode())
        assert store.stat("sealed-then-written").creator_can_write is False


def test_put_over_the_quota_names_the_quota(cudaipc_bin):
    """A put over the uid's quota fails LimitReached (the LIMIT code) naming the quota
    and the flag that sets it, not the capacity: the store itself has room."""
    d = Daemon(cudaipc_bin, ["--backend", "host", "--capacity", "64MiB"], config='quota = "1MiB"\n')
    try:
        with cudaipc.connect(d.socket) as s:
            with pytest.raises(cudaipc.LimitReached) as e:
                s.put("over", rand_bytes(2 << 20))
            msg = str(e.value)
            assert "quota" in msg and "quota setting" in msg and "--capacity" not in msg, msg
            s.put("within", rand_bytes(512 << 10))
    finally:
        d.stop()


def test_gpu_device_on_a_host_daemon_names_the_daemon(store):
    """A GPU device asked of a daemon without a GPU backend says so first (not that
    this process lacks cuda-bindings), with the command that starts one that has."""
    for call in (lambda: store.put("g", rand_bytes(64), device=0),
                 lambda: store.create("g", 64, device="cuda:0"),
                 lambda: store.put_bundle("gb", {"a": np.arange(8)}, device=0)):
        with pytest.raises(cudaipc.InvalidArgument) as e:
            call()
        msg = str(e.value)
        assert "has no GPU backend" in msg and "cudaipc serve --backend auto" in msg, msg
        assert msg.index("no GPU backend") < msg.find("cuda-bindings") or "cuda-bindings" not in msg, msg
    assert store.list() == []


def test_names_with_a_non_canonical_uid_prefix_are_refused(store):
    """A name that would be shown as another (" 65534:x" listed as "0: 65534:x") is
    refused by the daemon, INVALID in one line; a canonical qualified name works."""
    for name in (" 65534:x", "065534:x", "65534 :x", "x ", "0:065534:x"):
        with pytest.raises(cudaipc.InvalidArgument) as e:
            store.put(name, rand_bytes(16))
        assert "\n" not in str(e.value) and "object name" in str(e.value), str(e.value)
        with pytest.raises(cudaipc.InvalidArgument):
            store.get(name)
    data = rand_bytes(64)
    store.put("x", data)
    with store.get("%d:x" % os.getuid()) as lease:
        assert lease.read() == data
    assert [o.name for o in store.list()] == ["x"]
