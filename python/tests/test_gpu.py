"""GPU objects and regions (skip without a GPU; CUDAIPC_REQUIRE_GPU=N fails instead).

Runs against daemons sharing GPU arenas both ways: legacy CUDA IPC ("ipc") and VMM
memory passed as file descriptors ("fd")."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import cudaipc
from conftest import HERE, Daemon, need_gpus, need_module

HELPER = os.path.join(HERE, "helper.py")


@pytest.fixture(params=["ipc", "fd"])
def gpu_daemon(request, cudaipc_bin):
    need_gpus(1)
    d = Daemon(cudaipc_bin, ["--backend", "cuda", "--gpu-share", request.param, "--capacity", "4GiB"])
    d.share = request.param
    yield d
    d.stop()


@pytest.fixture
def gstore(gpu_daemon):
    s = cudaipc.connect(gpu_daemon.socket)
    yield s
    s.close()


def torch_cuda():
    need_module("torch")
    import torch
    if not torch.cuda.is_available():
        need_gpus(10**6)  # fails under CUDAIPC_REQUIRE_GPU, skips otherwise
    return torch


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def helper(*args: str, env=None) -> str:
    r = subprocess.run([sys.executable, HELPER] + list(args), capture_output=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return r.stdout.decode().strip()


def wait_leases(store, name, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        n = store.stat(name).leases
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def test_torch_put_get_zero_copy(gstore, gpu_daemon):
    torch = torch_cuda()
    src = torch.randn(256, 1024, device="cuda:0")
    info = gstore.put("w", src)
    assert info.device.startswith("GPU-") and info.tensor == cudaipc.TensorDesc("float32", (256, 1024))
    lease = gstore.get("w", timeout=5)
    assert lease.gpu_share == gpu_daemon.share
    t = lease.tensor()
    assert t.is_cuda and t.device.index == 0 and t.dtype == torch.float32 and tuple(t.shape) == (256, 1024)
    assert torch.equal(t, src)
    # Zero bytes copied: the tensor is the lease's mapping of the daemon's memory.
    assert t.data_ptr() == lease.data_ptr
    if gpu_daemon.share == "ipc":
        st = gstore.stat("w")
        with cudaipc.import_region(st.region) as m:
            assert m.data_ptr == t.data_ptr()
    # Later gets of the arena cost no driver open: the connection keeps it mapped.
    from cudaipc import _cuda
    opened = _cuda.ipc_open_count()
    for _ in range(50):
        with gstore.get("w") as l:
            assert l.data_ptr == t.data_ptr()
    assert _cuda.ipc_open_count() == opened
    # Another process reads the same bytes.
    assert helper("consume", gpu_daemon.socket, "w") == sha(src.cpu().numpy().tobytes())
    # bfloat16, reinterpreted views
    b = torch.randn(64, 64, device="cuda:0").to(torch.bfloat16)
    gstore.put("bf", b)
    with gstore.get("bf") as l2:
        assert torch.equal(l2.tensor(), b)
        assert torch.equal(l2.tensor(torch.int16, (64, 64)), b.view(torch.int16))


def test_tensor_outlives_release_until_collected(gstore, gpu_daemon):
    torch = torch_cuda()
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    gstore.put("life", src)
    with gstore.get("life") as lease:
        t = lease.tensor()
    assert lease.released
    assert gstore.stat("life").leases == 1
    for i in range(3):  # other objects come and go meanwhile
        gstore.put("churn%d" % i, torch.randn(1 << 18, device="cuda:0"))
        gstore.rm("churn%d" % i)
    assert torch.equal(t, src)
    t2 = t[10:20]
    del t
    gc.collect()
    assert gstore.stat("life").leases == 1
    assert torch.equal(t2, src[10:20])
    del t2
    gc.collect()
    assert wait_leases(gstore, "life", 0) == 0


def test_create_in_place_with_cupy(gstore, gpu_daemon):
    need_module("cupy")
    import cupy
    o = gstore.create("c", 4 * 1000 * 33, device=0, dtype="float32", shape=(1000, 33))
    w = o.cupy()
    assert w.shape == (1000, 33) and w.dtype == cupy.float32
    want = cupy.random.standard_normal((1000, 33), dtype=cupy.float32)
    w[...] = want
    cupy.cuda.get_current_stream().synchronize()
    del w
    o.seal()
    with gstore.get("c") as lease:
        got = lease.cupy()
        assert got.data.ptr == lease.data_ptr
        assert bool((got == want).all())
        del got
    # numpy() of a GPU object is a read-only copy of its bytes.
    with gstore.get("c") as lease:
        n = lease.numpy()
        assert n.shape == (1000, 33) and n.dtype.name == "float32" and not n.flags.writeable
        assert (n == cupy.asnumpy(want)).all()


def test_create_in_place_with_torch_and_abort(gstore):
    torch = torch_cuda()
    o = gstore.create("t", 1 << 20, device="cuda:0", dtype=torch.float16, shape=(512, 1024))
    o.tensor().copy_(torch.ones(512, 1024, dtype=torch.float16, device="cuda:0"))
    torch.cuda.synchronize()
    o.abort()
    with pytest.raises(cudaipc.NotFound):
        gstore.stat("t")


def test_kill_9_of_a_gpu_lease_holder(gstore, gpu_daemon):
    torch = torch_cuda()
    gstore.put("victim", torch.randn(4096, device="cuda:0"))
    p = subprocess.Popen([sys.executable, HELPER, "hold", gpu_daemon.socket, "victim"], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"holding"
        assert gstore.stat("victim").leases == 1
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert wait_leases(gstore, "victim", 0) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_go_and_python_exchange_gpu_objects(gstore, gpu_daemon, tmp_path):
    torch = torch_cuda()
    data = os.urandom(3 << 20)
    f = tmp_path / "in.bin"
    f.write_bytes(data)
    gpu_daemon.cli("put", str(f), "--name", "from-go", "--device", "0", "--dtype", "uint8")
    with gstore.get("from-go") as lease:
        t = lease.tensor()
        assert t.is_cuda and bytes(t.cpu().numpy().tobytes()) == data
        del t
    src = torch.randint(0, 255, (5 << 20,), dtype=torch.uint8, device="cuda:0")
    gstore.put("from-py", src)
    out = tmp_path / "out.bin"
    gpu_daemon.cli("get", "from-py", "-o", str(out))
    assert out.read_bytes() == src.cpu().numpy().tobytes()


def test_across_gpus(gstore, gpu_daemon):
    need_gpus(2)
    torch = torch_cuda()
    src = torch.randn(1 << 20, device="cuda:1")
    info = gstore.put("g1", src)
    assert info.device == gstore.put("g1b", src.cpu(), device=1).device
    with gstore.get("g1") as lease:
        t = lease.tensor()
        assert t.device.index == 1 and torch.equal(t, src)
        assert torch.equal(t.to("cuda:0"), src.to("cuda:0"))
        del t
    # A GPU 0 tensor put into GPU 1's memory (peer copy), read on GPU 1.
    s0 = torch.randn(4096, device="cuda:0")
    gstore.put("x01", s0, device=1)
    with gstore.get("x01") as lease:
        assert lease.tensor().device.index == 1 and torch.equal(lease.tensor().cpu(), s0.cpu())


def test_host_object_on_a_cuda_daemon(gstore):
    np = pytest.importorskip("numpy")
    a = np.random.default_rng().integers(0, 255, 10000, dtype=np.uint8)
    gstore.put("h", a)
    with gstore.get("h") as lease:
        assert lease.device == "host" and np.array_equal(lease.numpy(), a)


def test_region_from_torch_through_go_dump(cudaipc_bin, tmp_path):
    """A PyTorch tensor's region (an offset inside the caching allocator's segment)
    read by Go's 'cudaipc dump', and by another Python process."""
    need_gpus(1)
    torch = torch_cuda()
    keep = torch.empty(3, 1000, device="cuda:0")  # so the tensor below is not at offset 0
    t = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    r = cudaipc.Region.from_torch(t)
    assert r.size == 1 << 20 and r.exporter_base + r.offset == t.data_ptr()
    js = tmp_path / "r.json"
    js.write_text(r.to_json())
    out = tmp_path / "out.bin"
    subprocess.run([cudaipc_bin, "dump", "--region", "@%s" % js, "-o", str(out)], check=True, timeout=60)
    assert out.read_bytes() == t.cpu().numpy().tobytes()
    binf = tmp_path / "r.bin"
    binf.write_bytes(r.to_bytes())
    out.unlink()
    subprocess.run([cudaipc_bin, "dump", "--region", "@%s" % binf, "-o", str(out)], check=True, timeout=60)
    assert out.read_bytes() == t.cpu().numpy().tobytes()
    assert helper("import-region", r.to_json()) == sha(t.cpu().numpy().tobytes())
    # In the exporting process itself the memory is mapped without the driver.
    with cudaipc.import_region(r) as m:
        assert m.data_ptr == t.data_ptr()
        assert torch.equal(m.tensor(), t)
    del keep


def test_region_from_go_imported_in_python(cudaipc_bin, tmp_path):
    """The region Go prints for a GPU object (stat --json of a legacy-IPC daemon)
    maps in Python, zero-copy."""
    need_gpus(1)
    torch = torch_cuda()
    d = Daemon(cudaipc_bin, ["--backend", "cuda", "--gpu-share", "ipc"])
    try:
        data = os.urandom(1 << 20)
        f = tmp_path / "in.bin"
        f.write_bytes(data)
        d.cli("put", str(f), "--name", "r", "--device", "0")
        with cudaipc.connect(d.socket) as s, s.get("r") as lease:  # keeps it alive
            js = json.loads(d.cli("stat", "r", "--json").stdout)["region"]
            r = cudaipc.Region.from_json(js)
            assert r == s.stat("r").region
            m = cudaipc.import_region(json.dumps(js))
            assert m.read() == data
            t = m.tensor()
            assert t.data_ptr() == lease.data_ptr and bytes(t.cpu().numpy().tobytes()) == data
            del t
            m.close()
    finally:
        d.stop()


def test_region_from_cupy(tmp_path, cudaipc_bin):
    need_gpus(1)
    need_module("cupy")
    import cupy
    a = cupy.random.randint(0, 255, 100000, dtype=cupy.uint8)
    r = cudaipc.Region.from_cupy(a)
    assert r.exporter_base + r.offset == a.data.ptr
    assert helper("import-region", r.to_json()) == sha(a.get().tobytes())


def test_region_errors():
    need_gpus(1)
    torch = torch_cuda()
    with pytest.raises(ValueError):
        cudaipc.Region.from_torch(torch.zeros(4))  # CPU
    with pytest.raises(ValueError):
        cudaipc.Region.from_torch(torch.zeros(4, 4, device="cuda:0").t())  # not contiguous


def test_fast_path_gpu_cycles(gstore, gpu_daemon):
    """GPU leases through the lease table: taken back with the same mapping, tensors of
    every dtype PyTorch has (built through DLPack where it takes the type) equal the
    source, are zero-copy, and the daemon counts no lease once they are collected."""
    torch = torch_cuda()
    from cudaipc import _fastpath, _views
    if _fastpath.atomics() is None:
        pytest.fail("libatomic.so.1 is missing on this machine: the lease fast path is off")
    assert gstore.fast_path
    watcher = cudaipc.connect(gpu_daemon.socket, fast_path=False)
    g = torch.Generator(device="cuda:0").manual_seed(11)
    for name in ("float32", "bfloat16", "float16", "int64", "uint8", "bool", "float8_e4m3fn"):
        dt = getattr(torch, name)
        raw = torch.randint(0, 2 if name == "bool" else 256, (64 * 1024,), dtype=torch.uint8, device="cuda:0", generator=g)
        src = raw.view(dt).reshape(32, -1)
        gstore.put("fp-" + name, src)
        first = None
        for i in range(20):
            lease = gstore.get("fp-" + name)
            assert lease._rec.table is not None, "no lease-table slot"
            x = lease.tensor()
            if first is None:
                first = (lease.lease_id, lease.data_ptr)
            assert (lease.lease_id, lease.data_ptr) == first, "not taken back"
            assert x.is_cuda and x.dtype == dt and tuple(x.shape) == tuple(src.shape)
            assert x.data_ptr() == lease.data_ptr
            if i % 5 == 0:
                assert torch.equal(x.view(torch.uint8), src.view(torch.uint8))
            lease.release()
            assert watcher.stat("fp-" + name).leases == 1
            del x
            assert watcher.stat("fp-" + name).leases == 0
    torch.cuda.synchronize()
    if _views._dlpack is not None:
        assert not _views._dlpack.live
    # The cached construction used DLPack for CUDA float32 on this PyTorch.
    with gstore.get("fp-float32") as lease:
        assert lease._mem.views["tensor"].__name__ == "make_dl"
    watcher.rm("fp-float32")
    with pytest.raises((cudaipc.NotFound, cudaipc.Timeout)):
        gstore.get("fp-float32", timeout=0)
    watcher.close()
def test_put_orders_after_work_on_the_current_stream(gstore, gpu_daemon):
    """put copies on the tensor's current stream and seals on an event after the copy:
    bytes a kernel on a side stream writes just before put (no sync) are what readers
    get, for a plain put and a reserve_next one."""
    torch = torch_cuda()
    n = 64 << 20
    side = torch.cuda.Stream(device="cuda:0")
    for i, ahead in enumerate((False, True, True)):
        with torch.cuda.stream(side):
            src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
            src.random_(0, 256)           # queued on the side stream, not waited for
            gstore.put("ord%d" % i, src, reserve_next=ahead)
        side.synchronize()
        with gstore.get("ord%d" % i, timeout=5) as lease:
            t = lease.tensor()
            assert torch.equal(t, src), "put %d (reserve_next=%s) sealed before its copy" % (i, ahead)
            del t
    assert gstore._put.events_ok


def test_put_falls_back_when_the_daemon_cannot_use_the_event(gstore, gpu_daemon, monkeypatch):
    """A daemon that refuses the event (here: a garbage descriptor) answers the seal with
    INVALID wait_event: put synchronizes, seals plainly, and stops using events; the
    bytes are right either way."""
    torch = torch_cuda()
    from cudaipc import _put
    n = 8 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    orig = _put.seal_event

    def garbage(ordinal):
        ev = orig(ordinal)
        ev.descriptor = os.urandom(len(ev.descriptor))
        return ev
    monkeypatch.setattr(_put, "seal_event", garbage)
    gstore.put("fb0", src)
    assert gstore._put.events_ok is False
    gstore.put("fb1", src, reserve_next=True)
    gstore.put("fb2", src)
    for name in ("fb0", "fb1", "fb2"):
        with gstore.get(name, timeout=5) as lease:
            assert torch.equal(lease.tensor(), src), name


def test_put_lands_in_the_kept_arena(gstore, gpu_daemon):
    """A put after the previous object went reuses the arena the daemon kept and this
    connection still maps: no new mapping, and every object holds its own bytes."""
    torch = torch_cuda()
    n = (96 << 20) + 4096  # an arena of its own
    ptrs, arenas = set(), set()
    for i in range(4):
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
        gstore.put("k%d" % i, src)
        with gstore.get("k%d" % i, timeout=5) as lease:
            t = lease.tensor()
            assert torch.equal(t, src), "put %d: the object does not hold its bytes" % i
            ptrs.add(lease.data_ptr)
            del t
        arenas.update(gstore._arenas.arenas)
        gstore.rm("k%d" % i)
    assert len(ptrs) == 1 and len(arenas) == 1, (ptrs, arenas)


def test_put_reserve_next_prepared_during_copy(gstore, gpu_daemon):
    """A reserve_next put of at least 256 MiB creates and maps the next object while
    its copy runs: after it the next object is ready (mapped, unsealed, hidden); the
    next put of that size uses it, one of another size gives it back, and nothing
    made ahead outlives the connection."""
    torch = torch_cuda()
    from cudaipc import _put
    n = _put.PREPARE_AHEAD_BYTES + (32 << 20)
    srcs = [torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, device="cuda:0") for _ in range(3)]
    hidden = []
    for i, src in enumerate(srcs):
        gstore.put("big%d" % i, src, reserve_next=True)
        ahead = gstore._put.ahead
        assert ahead is not None and ahead.obj is not None, "the next object was not prepared"
        hidden.append(ahead.hidden)
        assert ahead.obj.state == "open" and ahead.obj.size == n
    for i, src in enumerate(srcs):
        with gstore.get("big%d" % i, timeout=5) as lease:
            t = lease.tensor()
            assert t.dtype == torch.int32 and torch.equal(t, src), i
            del t
    with cudaipc.connect(gpu_daemon.socket) as other:
        names = {o.name for o in other.ls()}
        assert {"big0", "big1", "big2"} <= names
    # Another size: the prepared object is given back (aborted), and none is made.
    small = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    assert gstore.stat(hidden[-1]).size == n          # its creator sees it, unsealed
    gstore.put("small", small)
    assert gstore._put.ahead is None
    with pytest.raises(cudaipc.NotFound):
        gstore.stat(hidden[-1])
    gstore.put("big3", srcs[0], reserve_next=True)
    last = gstore._put.ahead.hidden
    gstore.close()
    with cudaipc.connect(gpu_daemon.socket) as other:
        names = {o.name for o in other.ls()}
        assert last not in names and not any(n.startswith(".put-ahead") for n in names), names
        with other.get("big3", timeout=5) as lease:
            assert torch.equal(lease.tensor(), srcs[0])


def test_put_reserve_next_gpu(gstore, gpu_daemon):
    """put(reserve_next=True) of CUDA tensors: each object holds its own bytes and
    dtype/shape, in at most two arenas this connection maps (the object made ahead
    lives beside the last one)."""
    torch = torch_cuda()
    n = (80 << 20)
    for i in range(5):
        src = torch.randint(0, 255, (n // 4,), dtype=torch.int32, device="cuda:0")
        gstore.put("ahead%d" % i, src, reserve_next=True)
        with gstore.get("ahead%d" % i, timeout=5) as lease:
            t = lease.tensor()
            assert t.dtype == torch.int32 and torch.equal(t, src), i
            del t
        gstore.rm("ahead%d" % i)
    assert len(gstore._arenas.arenas) <= 2, list(gstore._arenas.arenas)
