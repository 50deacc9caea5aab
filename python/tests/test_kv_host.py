"""KV spaces in host memory (cudaipc.kv) against a real daemon: an engine process
(kv_engine.py) registers a space of random bytes, this process reads scattered
blocks into a space of its own and checks every byte of it; layer ranges, per-layer
waits, refused requests, a description of an earlier registration, an engine that
closes its space or is killed, and a reader of another uid."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cudaipc
from conftest import HERE, Daemon
from cudaipc import kv

import kvutil

LAYERS, BLOCKS, BYTES = 4, 24, 96


class Engine:
    """A kv_engine.py process and its space's description."""

    def __init__(self, sock, name, kind="vllm", seed=1, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES, shared=False, gpu=""):
        self.seed = seed
        args = [sys.executable, os.path.join(HERE, "kv_engine.py"), sock, name, kind, str(layers), str(blocks),
                str(nbytes), str(seed)] + (["shared"] if shared else []) + ([gpu] if gpu else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        self.desc = kv.Desc.from_text(self.line())

    def line(self, timeout=30):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if r else b""
        if not line:
            self.proc.kill()
            raise AssertionError("engine said nothing: %s" % self.proc.stderr.read().decode())
        return line.decode().strip()

    def cmd(self, c):
        self.proc.stdin.write(c.encode() + b"\n")
        self.proc.stdin.flush()
        out = self.line()
        said = None
        if c == "reregister":
            self.desc = kv.Desc.from_text(out)
            out = self.line()
        elif c.startswith("notices"):
            said = json.loads(out)
            out = self.line()
        assert out == "done", out
        return said

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def engines():
    started = []

    def start(*a, **kw):
        e = Engine(*a, **kw)
        started.append(e)
        return e
    yield start
    for e in started:
        e.stop()


def dst_local(kind, layers=LAYERS, blocks=BLOCKS, nbytes=BYTES):
    """A zeroed destination space of plain NumPy memory."""
    return kvutil.make_local(kind, layers, blocks, nbytes, lambda shape: np.zeros(shape, dtype=np.uint8))


def snapshot(local):
    return [kvutil.host_region(m).copy() for m in local.memory]


@pytest.mark.parametrize("kind", kvutil.KINDS)
def test_read_scattered_blocks(store, daemon, engines, kind):
    e = engines(daemon.socket, "ns/engine-7/kv", kind, seed=11)
    assert e.desc.name == "%d:ns/engine-7/kv" % os.getuid()
    rng = np.random.default_rng(3)
    # Runs (coalesced copies), lone blocks, and ids out of order on both sides.
    src_ids = [2, 3, 4, 5, 9, 0, 17, 16, 23, 11, 12]
    dst_ids = [7, 8, 9, 10, 1, 23, 3, 2, 0, 14, 15]
    dst = dst_local(kind)
    kvutil.host_region(dst.memory[0])[:] = rng.integers(0, 256, dst.memory[0].size, dtype=np.uint8)
    before = snapshot(dst)
    t = kv.read_blocks(store, e.desc.to_text(), src_ids, dst, dst_ids)
    t.wait(30)
    assert t.done() and t.error is None
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, src_ids, dst_ids, range(LAYERS), before))
    # The same read again (leases taken again), from the binary description.
    t = kv.read_blocks(store, e.desc.to_bytes(), src_ids, dst, dst_ids)
    t.wait(30)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, src_ids, dst_ids, range(LAYERS), before))


def test_read_many_random_blocks_between_layouts(store, daemon, engines):
    """A vLLM space read into an SGLang-shaped one (same layers, parts and block
    bytes, other regions and strides): every block of a random permutation."""
    blocks = 200
    e = engines(daemon.socket, "kv/big", "vllm-blocks-first", seed=5, blocks=blocks, nbytes=1024)
    rng = np.random.default_rng(9)
    src_ids = rng.permutation(blocks)[:150]
    dst_ids = rng.permutation(blocks)[:150]
    dst = dst_local("sglang", blocks=blocks, nbytes=1024)
    before = snapshot(dst)
    kv.read_blocks(store, e.desc, src_ids, dst, dst_ids).wait(30)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, src_ids.tolist(), dst_ids.tolist(), range(LAYERS), before))


def test_layer_range_and_per_layer_waits(store, daemon, engines):
    e = engines(daemon.socket, "kv/layers", "sglang", seed=2)
    dst = dst_local("sglang")
    before = snapshot(dst)
    ids = list(range(BLOCKS))
    t = kv.read_blocks(store, e.desc, ids, dst, ids[::-1], layers=range(1, 3))
    assert t.layers == range(1, 3)
    for layer in (1, 2):
        t.wait_layer(layer, 30)
        # The layer's bytes are there as soon as its wait returns.
        want = kvutil.expected(e.desc, e.seed, dst, ids, ids[::-1], range(1, layer + 1), before)
        for i in (2 * layer, 2 * layer + 1):   # its K and V regions
            assert np.array_equal(kvutil.host_region(dst.memory[i]), want[i])
    t.wait(30)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, ids, ids[::-1], range(1, 3), before))
    with pytest.raises(kv.LayoutMismatch):
        t.wait_layer(0)
    with pytest.raises(kv.LayoutMismatch):
        t.wait_layer(3)
    # One layer by its number.
    t = kv.read_blocks(store, e.desc, [0], dst, [0], layers=3)
    t.wait_layer(3, 30)
    t.wait(30)


def test_refused_requests(store, daemon, engines):
    e = engines(daemon.socket, "kv/refused", "vllm", seed=3)
    dst = dst_local("vllm")
    with pytest.raises(kv.BlockRangeError) as x:
        kv.read_blocks(store, e.desc, [0, BLOCKS, -1], dst, [0, 1, 2])
    assert x.value.blocks == [BLOCKS, -1] and isinstance(x.value, kv.BlockError) and "\n" not in str(x.value)
    assert "source block ids [24, -1]" in str(x.value)
    with pytest.raises(kv.BlockRangeError) as x:
        kv.read_blocks(store, e.desc, [0, 1], dst, [BLOCKS + 5, 1])
    assert x.value.blocks == [BLOCKS + 5] and "destination" in str(x.value)
    with pytest.raises(kv.LayoutMismatch):
        kv.read_blocks(store, e.desc, [0, 1], dst, [0])
    with pytest.raises(kv.LayoutMismatch):
        kv.read_blocks(store, e.desc, [], dst, [])
    with pytest.raises(kv.LayoutMismatch):   # other block bytes
        kv.read_blocks(store, e.desc, [0], dst_local("vllm", nbytes=BYTES * 2), [0])
    with pytest.raises(kv.LayoutMismatch):   # other layer count
        kv.read_blocks(store, e.desc, [0], dst_local("vllm", layers=LAYERS + 1), [0])
    with pytest.raises(kv.LayoutMismatch):
        kv.read_blocks(store, e.desc, [0], dst, [0], layers=range(2, LAYERS + 1))
    with pytest.raises(kv.InvalidDescError):
        kv.read_blocks(store, "bm90IGEgZGVzY3JpcHRpb24=", [0], dst, [0])
    ro = dst_local("vllm")
    for m in ro.memory:
        m.owner.flags.writeable = False
    with pytest.raises(kv.LayoutMismatch):
        kv.read_blocks(store, e.desc, [0], kv.vllm_layout([m.owner for m in ro.memory]), [0])
    # A space on a GPU read into host memory: not in this version.
    gpu = kv.Desc.from_bytes(e.desc.to_bytes())
    for r in gpu.regions:
        r.device = "GPU-00000000-0000-0000-0000-000000000001"
    with pytest.raises(kv.KVNotSupported):
        kv.read_blocks(store, gpu, [0], dst, [0])


def test_unknown_space_fails_naming_the_blocks(store):
    d = kv.Desc("%d:kv/nobody" % os.getuid(), kv.new_id(), [kv.Region("host", 4096)],
                kv.Layout(4, [[kv.Part(0, 0, 1024, 1024)]]))
    dst = kv.Local(kv.Layout(4, [[kv.Part(0, 0, 1024, 1024)]]), [np.zeros(4096, dtype=np.uint8)])
    t = kv.read_blocks(store, d, [0, 1], dst, [3, 2])
    with pytest.raises(kv.BlockError) as x:
        t.wait(30)
    assert x.value.blocks == [3, 2] and x.value.layer == 0 and isinstance(x.value.cause, cudaipc.NotFound)
    assert "kv/nobody/0" in str(x.value) and "\n" not in str(x.value)
    assert t.error is x.value
    with pytest.raises(kv.BlockError):
        t.wait_layer(0, 5)


def test_stale_description(store, daemon, engines):
    e = engines(daemon.socket, "kv/stale", "offload", seed=4)
    old = e.desc
    e.cmd("reregister")
    assert e.desc.id != old.id
    dst = dst_local("offload")
    t = kv.read_blocks(store, old, [1, 2], dst, [1, 2])
    with pytest.raises(kv.BlockError) as x:
        t.wait(30)
    assert isinstance(x.value.cause, kv.StaleSpaceError) and x.value.blocks == [1, 2]
    # The new description reads.
    before = snapshot(dst)
    kv.read_blocks(store, e.desc, [1, 2], dst, [1, 2]).wait(30)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, [1, 2], [1, 2], range(LAYERS), before))


def test_closed_space(store, daemon, engines):
    e = engines(daemon.socket, "kv/closed", "vllm", seed=6)
    e.cmd("close")
    with pytest.raises(kv.BlockError) as x:
        kv.read_blocks(store, e.desc, [0, 1], dst_local("vllm"), [5, 6]).wait(30)
    assert isinstance(x.value.cause, cudaipc.NotFound) and x.value.blocks == [5, 6]
    assert "engine ended or closed it" in str(x.value)


def test_killed_engine(store, daemon, engines):
    """An engine killed with SIGKILL: its regions are orphaned and go with their last
    lease; a later read fails with a BlockError naming the blocks, and the daemon
    serves the rest as before."""
    e = engines(daemon.socket, "kv/killed", "vllm", seed=7)
    other = engines(daemon.socket, "kv/bystander", "vllm", seed=8)
    dst = dst_local("vllm")
    kv.read_blocks(store, e.desc, [0], dst, [0]).wait(30)
    e.proc.send_signal(signal.SIGKILL)
    e.proc.wait(10)
    deadline = time.monotonic() + 20
    while True:
        try:
            store.stat(e.desc.region_name(0))
        except cudaipc.NotFound:
            break
        assert time.monotonic() < deadline, "the killed engine's region is still there"
        time.sleep(0.02)
    t = kv.read_blocks(store, e.desc, [3, 4, 5], dst, [10, 11, 12])
    with pytest.raises(kv.BlockError) as x:
        t.wait(30)
    assert x.value.blocks == [10, 11, 12] and isinstance(x.value.cause, cudaipc.NotFound)
    before = snapshot(dst)
    kv.read_blocks(store, other.desc, [3], dst, [3]).wait(30)
    kvutil.check_bytes(dst, kvutil.expected(other.desc, other.seed, dst, [3], [3], range(LAYERS), before))


def test_register_checks(store):
    with pytest.raises(kv.InvalidDescError) as x:
        kv.register(store, "kv/plain-host", dst_local("vllm"))
    assert "alloc_host" in str(x.value)
    with pytest.raises(ValueError):
        kv.vllm_layout([np.zeros((3, 4, 8), dtype=np.uint8)])
    with pytest.raises(ValueError) as x:
        kv.vllm_layout([np.zeros((4, 2, 8), dtype=np.uint8)])
    assert "blocks_first=True" in str(x.value)
    with pytest.raises(ValueError) as x:
        kv.vllm_layout([np.zeros((2, 4, 8), dtype=np.uint8).transpose(1, 0, 2)])
    assert "not contiguous" in str(x.value)
    with pytest.raises(kv.LayoutMismatch):
        kv.vllm_layout([np.zeros((2, 4, 8), dtype=np.uint8), np.zeros((2, 5, 8), dtype=np.uint8)])
    with pytest.raises(kv.LayoutMismatch):
        kv.sglang_layout([np.zeros((4, 8))] * 2, [np.zeros((4, 8))])
    with pytest.raises(TypeError):
        kv.vllm_layout([[1, 2, 3]])
    with pytest.raises(ValueError):
        kv.alloc_host(0)


def test_space_close_and_context(store):
    local = kvutil.make_local("offload", 2, 4, 64, lambda shape: kv.alloc_host(shape))
    with kv.register(store, "kv/ctx", local) as sp:
        assert [o.name for o in store.list() if o.name.startswith("kv/ctx/")] == ["kv/ctx/0"]
        info = store.stat("kv/ctx/0")
        assert info.external and info.space == sp.desc.to_bytes() and info.size == local.memory[0].size
    with pytest.raises(cudaipc.NotFound):
        store.stat("kv/ctx/0")
    sp.close()   # idempotent


def test_layouts_match_the_table():
    """docs/kv.md's table: base, stride and bytes per layer and part."""
    b = 3 * 8 * 2   # block_size 3, 8 heads... as bytes of a float16 [.., 3, 8] block
    t = [np.zeros((2, 5, 3, 8), dtype=np.float16) for _ in range(2)]
    lay = kv.vllm_layout(t).layout
    assert lay.blocks == 5 and [(p.region, p.base, p.stride, p.nbytes) for p in lay.layers[1]] == [(1, 0, b, b), (1, 5 * b, b, b)]
    t = [np.zeros((5, 2, 3, 8), dtype=np.float16) for _ in range(2)]
    lay = kv.vllm_layout(t, blocks_first=True).layout
    assert [(p.region, p.base, p.stride, p.nbytes) for p in lay.layers[1]] == [(1, 0, 2 * b, b), (1, b, 2 * b, b)]
    k = [np.zeros((10, 8), dtype=np.float16) for _ in range(2)]
    v = [np.zeros((10, 8), dtype=np.float16) for _ in range(2)]
    lay = kv.sglang_layout(k, v, page_size=3).layout
    assert lay.blocks == 3 and [(p.region, p.base, p.stride, p.nbytes) for p in lay.layers[1]] == [(2, 0, 48, 48), (3, 0, 48, 48)]
    lay = kv.offload_layout(np.zeros((5, 4, 2, 3, 8), dtype=np.float16)).layout
    assert lay.blocks == 5 and len(lay.layers) == 4
    assert [(p.region, p.base, p.stride, p.nbytes) for p in lay.layers[2]] == [(0, 4 * b, 8 * b, b), (0, 5 * b, 8 * b, b)]
    # Views of one alloc_host buffer are one region, each at its offset.
    buf = kv.alloc_host((2, 2, 5, 48))
    lay = kv.vllm_layout([buf[0], buf[1]])
    assert len(lay.memory) == 1 and lay.memory[0].fd >= 0
    assert [(p.region, p.base) for p in lay.layers[1]] == [(0, 480), (0, 720)]


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    caches = [torch.zeros((2, 6, 4, 8), dtype=torch.bfloat16) for _ in range(3)]
    lay = kv.vllm_layout({"layer.%d" % i: c for i, c in enumerate(caches)})
    assert lay.blocks == 6 and lay.layers[2][1].base == 6 * 64 and lay.memory[2].addr == caches[2].data_ptr()
    # A tensor over alloc_host memory is registrable memory.
    t = torch.from_numpy(kv.alloc_host((2, 6, 64)))
    assert kv.vllm_layout([t]).memory[0].fd >= 0
    with pytest.raises(ValueError):
        kv.vllm_layout([caches[0].transpose(0, 1)])


def test_reader_of_another_uid(cudaipc_bin, tmp_path):
    """A space registered without sharing is invisible to a reader of another uid
    (NotFound inside the BlockError); shared, that reader reads it."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a reader as another uid")
    d = Daemon(cudaipc_bin, ["--backend", "host", "--capacity", "64MiB", "--allow-uid", "65534"])
    try:
        os.chmod(d.dir, 0o755)
        os.chmod(d.socket, 0o777)
        results = {}
        for shared in (False, True):
            e = Engine(d.socket, "kv/uid-%d" % shared, "vllm", seed=9, shared=shared)
            try:
                code = ("import sys; sys.path[:0] = %r\n"
                        "import numpy as np, cudaipc, kvutil\n"
                        "from cudaipc import kv\n"
                        "s = cudaipc.connect(%r)\n"
                        "dst = kvutil.make_local('vllm', %d, %d, %d, lambda sh: np.zeros(sh, dtype=np.uint8))\n"
                        "try:\n"
                        "    kv.read_blocks(s, %r, [0, 1], dst, [2, 3]).wait(30)\n"
                        "    print('ok', sum(int(kvutil.host_region(m).sum()) for m in dst.memory))\n"
                        "except kv.BlockError as e:\n"
                        "    print(type(e.cause).__name__, e.blocks)\n"
                        % ([os.path.dirname(HERE), HERE], d.socket, LAYERS, BLOCKS, BYTES, e.desc.to_text()))
                r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                                   user=65534, group=65534, cwd="/", env=dict(os.environ, HOME="/"))
                results[shared] = r.stdout.decode().strip() or r.stderr.decode()
            finally:
                e.stop()
        assert results[False] == "NotFound [2, 3]", results
        assert results[True].startswith("ok ") and results[True] != "ok 0", results
    finally:
        d.stop()


def test_notices_to_the_engine(store, daemon, engines):
    """A read with notify tells the engine it ended, completed or failed (vLLM's
    get_finished), through the daemon; the engine takes the notices from its Space."""
    e = engines(daemon.socket, "kv/notices", "vllm", seed=12)
    dst = dst_local("vllm")
    kv.read_blocks(store, e.desc, [0, 1], dst, [2, 3], notify=b"req-1").wait(30)
    # A failed read: a description whose second region the engine never registered
    # (so its regions carry another description): StaleSpaceError, then the notice.
    bad = kv.Desc.from_bytes(e.desc.to_bytes())
    bad.regions.append(kv.Region("host", 4096))
    t = kv.read_blocks(store, bad, [0], dst, [0], notify=b"req-2")
    with pytest.raises(kv.BlockError) as x:
        t.wait(30)
    assert isinstance(x.value.cause, kv.StaleSpaceError)
    kv.read_blocks(store, e.desc, [5], dst, [5]).wait(30)   # without notify: no notice
    got = e.cmd("notices 2")
    assert got == [dict(payload=b"req-1".hex(), failed=False, pid=os.getpid()),
                   dict(payload=b"req-2".hex(), failed=True, pid=os.getpid())]
    assert e.cmd("notices 1 0.5") == []   # nothing more came
    with pytest.raises(kv.InvalidKVRequest):
        kv.read_blocks(store, e.desc, [0], dst, [0], notify=bytes(4096))
    with pytest.raises(cudaipc.NotFound):
        store.notify("%d:kv/nobody/0" % os.getuid(), b"x")
    # The engine's own store: notices it sent to memory of its own come back to it.
    local = kvutil.make_local("offload", 2, 4, 64, lambda shape: kv.alloc_host(shape))
    with kv.register(store, "kv/self-notice", local) as sp:
        kv.read_blocks(store, sp.desc, [1], dst_local("offload", layers=2, blocks=4, nbytes=64), [2], notify=b"me").wait(30)
        assert sp.take_notices() == [kv.Notice(b"me", False, os.getuid(), os.getpid())]
        assert sp.take_notices() == [] and sp.wait_notices(0.05) == []
        store.notify(sp.desc.region_name(0), b"\x07not a kv notice")
        assert sp.wait_notices(0.2) == []


def test_plan_checks_a_changed_space_again():
    """A read's checks of the two spaces are kept for spaces of the same values, and
    made again once any value changes: a description or a destination changed in
    place after a read is refused as a new one would be."""
    from cudaipc import _kvread
    src = kvutil.make_local("vllm", LAYERS, BLOCKS, BYTES, lambda shape: np.zeros(shape, dtype=np.uint8))
    desc = kv.Desc("0:kv/changed", kv.new_id(), [kv.Region("host", m.size) for m in src.memory], src.layout)
    dst = dst_local("vllm")
    p = _kvread.plan(desc, [1, 2], dst, [3, 4], None)
    assert p.desc == desc.to_bytes() and p.regions == list(range(LAYERS)) and p.ordinal is None
    assert _kvread.plan(desc, [1, 2], dst, [3, 4], range(1, 2)).regions == [1]
    # The same values in other objects: the same result.
    same = kv.Desc.from_bytes(desc.to_bytes())
    assert _kvread.plan(same, [5], dst_local("vllm"), [6], None).desc == p.desc
    # Ids are checked every read.
    with pytest.raises(kv.BlockRangeError):
        _kvread.plan(desc, [1, BLOCKS], dst, [3, 4], None)
    # A part of the description moved past its region.
    base = desc.layers[2][1].base
    desc.layers[2][1].base = desc.regions[2].size
    with pytest.raises(kv.InvalidDescError):
        _kvread.plan(desc, [1], dst, [3], None)
    desc.layers[2][1].base = base
    _kvread.plan(desc, [1], dst, [3], None)
    # The destination: a region made read-only, a part made wider than the source's.
    dst.memory[3].writable = False
    with pytest.raises(kv.LayoutMismatch):
        _kvread.plan(desc, [1], dst, [3], None)
    assert _kvread.plan(desc, [1], dst, [3], range(0, 3)).regions == [0, 1, 2]
    dst.memory[3].writable = True
    dst.layers[0][0].nbytes = BYTES - 1
    with pytest.raises(kv.LayoutMismatch):
        _kvread.plan(desc, [1], dst, [3], None)
    dst.layers[0][0].nbytes = BYTES
    dst.layers[0][0].base = dst.memory[0].size
    with pytest.raises(kv.InvalidDescError):
        _kvread.plan(desc, [1], dst, [3], None)
    dst.layers[0][0].base = 0
    # Layers of unequal parts (the first moved last, with one part of two): refused.
    desc.layers.append(desc.layers.pop(0)[:1])
    with pytest.raises((kv.InvalidDescError, kv.LayoutMismatch)):
        _kvread.plan(desc, [1], dst, [3], None)
