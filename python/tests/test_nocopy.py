"""Versions published without a copy (put_bundle(copy=False), docs/protocol.md 6.8):
what runs without a GPU. The daemon never opens a no-copy version's regions, so a
made-up legacy region stands in for a trainer's cudaMalloc segment; readers hold
leases at the protocol level. Real processes, real kill -9."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List

import pytest

import cudaipc
from cudaipc import _nocopy
from cudaipc import _store_pb2 as pb
from cudaipc._manifest import TensorEntry, encode_manifest
from cudaipc.region import Region, local_identity

HERE = os.path.dirname(os.path.abspath(__file__))
GPU = bytes.fromhex("5f1c2a3b4d5e6f708192a3b4c5d6e7f8")
GPU_TEXT = "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"


def fake_region(size: int) -> bytes:
    ns, boot = local_identity()
    return Region(handle=os.urandom(64), offset=0, size=size, alloc_size=size, device=GPU, exporter_pid=os.getpid(),
                  pid_namespace=ns, boot_id=boot, buffer_id=7, exporter_base=0x7F0000000000).to_bytes()


def publish_fake(store: cudaipc.Store, name: str, sizes: List[int] = [1 << 20, 3 << 20]) -> int:
    """A no-copy version over made-up legacy regions of these sizes, one tensor in each."""
    starts, span = _nocopy.source_starts(sizes)
    entries = [TensorEntry("t%d" % i, "U8", (n // 2,), at, at + n // 2) for i, (at, n) in enumerate(zip(starts, sizes))]
    table = _nocopy.encode_sources([fake_region(n) for n in sizes])
    return _nocopy.send_version(store._conn, name, encode_manifest(entries), table, [], span, GPU_TEXT, keep_last=1)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "helper.py")] + list(args),
                            stdout=subprocess.PIPE, text=True, cwd=HERE)


def first_line(p: subprocess.Popen) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, "the helper process ended early (rc %s)" % p.poll()
    return line.strip()


def kill(p: subprocess.Popen) -> None:
    p.kill()
    p.wait(10)


def test_sources_table_layout() -> None:
    starts, span = _nocopy.source_starts([1000, 1, 4096])
    assert starts == [0, 1280, 1792] and span == 1792 + 4096
    regions = [os.urandom(n) for n in (164, 7, 300)]
    assert _nocopy.decode_sources(_nocopy.encode_sources(regions)) == regions
    for bad in (b"", b"\x01\x00\x00", b"\x05\x00\x00\x00ab"):
        with pytest.raises(cudaipc.InternalError):
            _nocopy.decode_sources(bad)


class _NoContext:
    def __init__(self, ordinal: int) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_buffer_ids_read_each_allocation_through_the_driver_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """buffer_ids asks cuPointerGetAttribute (a stand-in C callback here) for
    CU_POINTER_ATTRIBUTE_BUFFER_ID of each address, in order, and gives 0 where the
    driver answers an error."""
    import ctypes
    import random
    from cudaipc import _cuda_ctypes
    rng = random.Random(20)
    ids = {rng.randrange(1 << 40, 1 << 47) & ~0xFF: rng.randrange(1, 1 << 62) for _ in range(200)}
    unknown = max(ids) + (1 << 20)
    asked = []

    def get_attribute(data: int, attr: int, ptr: int) -> int:
        asked.append((attr, ptr))
        if ptr not in ids:
            return 1   # CUDA_ERROR_INVALID_VALUE
        ctypes.c_uint64.from_address(data).value = ids[ptr]
        return 0
    fn = _cuda_ctypes._ATTR_PROTO(get_attribute)
    from cudaipc import _cuda
    monkeypatch.setitem(_cuda._procs, "cuPointerGetAttribute@4000", fn)
    monkeypatch.setattr(_cuda_ctypes, "on", _NoContext)
    ptrs = list(ids) + [unknown]
    rng.shuffle(ptrs)
    got = _cuda_ctypes.buffer_ids(0, ptrs)
    assert got == [ids.get(p, 0) for p in ptrs]
    assert asked == [(7, p) for p in ptrs]


def test_publish_reuses_its_exports_only_while_every_allocation_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish over the same tensors at the same addresses reuses the last one's
    exports only when every legacy allocation still has its buffer id: one freed
    and reallocated at the same address (a new id), or one the driver no longer
    knows (0), is exported afresh, and VMM exports always are."""
    import random
    from cudaipc import _cuda_ctypes
    rng = random.Random(7)
    sources = [_nocopy._Source(0x7F0000000000 + (i << 24), 1 << 20, b"r", rng.randrange(1, 1 << 60), [])
               for i in range(1921)]
    pub = _nocopy._Published(None, 0, GPU, sources, b"", b"", 0)
    live = {s.base: s.buffer_id for s in sources}
    calls = []

    def buffer_ids(ordinal: int, ptrs: List[int]) -> List[int]:
        calls.append(len(ptrs))
        return [live.get(p, 0) for p in ptrs]
    monkeypatch.setattr(_cuda_ctypes, "buffer_ids", buffer_ids)
    assert _nocopy._still_valid(pub)
    assert calls == [1921]   # one read per allocation, in one call
    moved = rng.choice(sources).base
    live[moved] += 1            # freed and reallocated at the same address
    assert not _nocopy._still_valid(pub)
    live[moved] -= 1
    assert _nocopy._still_valid(pub)
    del live[moved]             # freed
    assert not _nocopy._still_valid(pub)
    vmm = _nocopy._Published(None, 0, GPU, sources + [_nocopy._Source(1 << 46, 1 << 21, b"v", 0, [99])], b"", b"", 0)
    live = {s.base: s.buffer_id for s in sources}
    assert not _nocopy._still_valid(vmm)


def test_copy_false_refuses_what_it_cannot_share(store: cudaipc.Store) -> None:
    torch = pytest.importorskip("torch")
    sd = {"w": torch.arange(10, dtype=torch.float32)}
    with pytest.raises(cudaipc.InvalidArgument, match="CUDA tensors"):
        store.put_bundle("m", sd, publish=True, copy=False)
    with pytest.raises(cudaipc.InvalidArgument, match="publish=True"):
        store.put_bundle("m", sd, copy=False)
    import numpy as np
    with pytest.raises(cudaipc.InvalidArgument, match=r"state_dict\['x'\] is a ndarray: publish with copy=True"):
        store.put_bundle("m", {"w": sd["w"], "x": np.zeros(4, dtype=np.float32)}, publish=True, copy=False)
    for other in (b"bytes", 3):   # what no bundle takes
        with pytest.raises(TypeError, match=r"state_dict\['x'\] is a %s; a bundle's values are torch tensors" % type(other).__name__):
            store.put_bundle("m", {"w": sd["w"], "x": other}, publish=True, copy=False)


def test_wait_released_names_the_readers(daemon, store: cudaipc.Store) -> None:
    v = publish_fake(store, "policy")
    readers = [spawn("hold-version", daemon.socket, "policy") for _ in range(2)]
    try:
        for r in readers:
            assert first_line(r) == "holding %d" % v
        with pytest.raises(cudaipc.Timeout, match="2 readers still hold 2 leases"):
            store.wait_released("policy", 0.2)
        # Withdrawn: a new reader finds no version, by number or as the latest.
        with cudaipc.connect(daemon.socket) as late:
            with pytest.raises(cudaipc.NotFound):
                late._conn.call(pb.Request(get=pb.GetRequest(name="policy", version=v)), "get", "policy")
            with pytest.raises(cudaipc.Timeout):
                late._conn.call(pb.Request(get=pb.GetRequest(name="policy", timeout_ms=0, newer_than=0)), "get", "policy")
        kill(readers[0])   # the daemon ends its lease
        deadline = time.monotonic() + 10
        while True:
            try:
                store.wait_released("policy", 0.1)
                raise AssertionError("released while a reader still holds a lease")
            except cudaipc.Timeout as e:
                if "1 readers still hold 1 leases" in str(e):
                    break
                assert time.monotonic() < deadline, str(e)
        kill(readers[1])
        store.wait_released("policy", 10)   # answers once the last lease ended (no Timeout)
        # The next version is the latest.
        v2 = publish_fake(store, "policy")
        assert v2 > v and store.stat("policy").version == v2
    finally:
        for r in readers:
            if r.poll() is None:
                kill(r)


def test_publisher_killed_withdraws_its_legacy_version(daemon, store: cudaipc.Store) -> None:
    pub = spawn("publish-fake", daemon.socket, "weights")
    try:
        v = int(first_line(pub))
        r = store._conn.call(pb.Request(get=pb.GetRequest(name="weights", version=v)), "get", "weights")
        for fd in (r.fds or []) + [r.manifest_fd]:
            os.close(fd)
        info = r.resp.get.info
        assert info.external and info.exporter_bound and info.sources_size > 0
        kill(pub)
        deadline = time.monotonic() + 10
        while True:
            try:
                # Still readable: release this get's own lease (not the first's,
                # which the test releases at the end) and look again.
                again = store._conn.call(pb.Request(get=pb.GetRequest(name="weights", timeout_ms=0, newer_than=0)), "get", "weights")
                again.close_fds()
                store._conn.send_detached(pb.Request(release=pb.ReleaseRequest(lease_id=again.resp.get.lease_id)))
            except cudaipc.Timeout:
                break
            assert time.monotonic() < deadline, "the dead publisher's legacy version is still readable"
            time.sleep(0.02)
        with pytest.raises(cudaipc.NotFound, match="withdrawn"):
            store._conn.call(pb.Request(get=pb.GetRequest(name="weights", version=v)), "get", "weights")
        # The lease taken before stays the reader's to release.
        store._conn.call(pb.Request(release=pb.ReleaseRequest(lease_id=r.resp.get.lease_id)), "release", "weights")
    finally:
        if pub.poll() is None:
            kill(pub)


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_gpu_nocopy_versions_load_from_the_publishers_tensors(cudaipc_bin: str, alloc_conf: str) -> None:
    """A publisher in another process (PyTorch's default allocator: legacy regions;
    expandable segments: VMM descriptors) publishes versions of its own tensors; the
    reader loads each, bytes equal, opening the publisher's allocations once."""
    import hashlib
    import json
    from conftest import Daemon, need_gpus, need_module
    need_gpus(1)
    need_module("torch")
    import torch
    d = Daemon(cudaipc_bin, ["--backend", "cuda", "--capacity", "1GiB"])
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc_conf)
    pub = subprocess.Popen([sys.executable, os.path.join(HERE, "helper.py"), "nocopy-publisher", d.socket, "policy", "3"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE, env=env)
    try:
        assert pub.stdin is not None and pub.stdout is not None
        torch.cuda.set_device(0)
        with cudaipc.connect(d.socket) as s:
            params = None
            seen = 0
            opens = []
            for i in range(3):
                msg = json.loads(pub.stdout.readline())
                before = _nocopy.driver_opens()
                with s.get_bundle("policy", timeout=30, newer_than=seen) as b:
                    assert b.version == msg["version"]
                    if params is None:
                        params = {k: torch.empty_like(b[k]) for k in b}
                    rep = cudaipc.bundle.load_into(b, params)
                    assert rep.tensors == len(params)
                    got = {k: hashlib.sha256(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for k, t in params.items()}
                    assert got == msg["digests"], "version %d: bytes differ" % b.version
                    # A view of one tensor reads the same bytes.
                    assert torch.equal(b["w0"].view(torch.int16), params["w0"].view(torch.int16))
                    with pytest.raises(cudaipc.InvalidArgument, match="get_bundle and load_into"):
                        b.lease.tensor()
                    seen = b.version
                opens.append(_nocopy.driver_opens() - before)
                pub.stdin.write("next\n")
                pub.stdin.flush()
            if not alloc_conf:
                assert opens[0] >= 1 and opens[1:] == [0, 0], "driver opens per version: %s" % opens
            else:
                assert all(n >= 1 for n in opens), opens   # VMM regions map per version
        pub.wait(30)
        assert pub.returncode == 0
    finally:
        if pub.poll() is None:
            kill(pub)
        d.stop()


def test_gpu_nocopy_publisher_that_reallocates_its_tensors_is_read_from_the_new_ones(cudaipc_bin: str) -> None:
    """A publisher that frees its tensors and their segments and allocates them again
    between versions (often at the same addresses, in new allocations) publishes
    the new allocations, not what it exported before: each version's bytes are
    equal and each is opened anew."""
    import hashlib
    import json
    from conftest import Daemon, need_gpus, need_module
    need_gpus(1)
    need_module("torch")
    import torch
    d = Daemon(cudaipc_bin, ["--backend", "cuda", "--capacity", "1GiB"])
    pub = subprocess.Popen([sys.executable, os.path.join(HERE, "helper.py"), "nocopy-publisher", d.socket, "policy", "3",
                            "realloc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE,
                           env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=""))
    try:
        assert pub.stdin is not None and pub.stdout is not None
        torch.cuda.set_device(0)
        with cudaipc.connect(d.socket) as s:
            params = None
            seen = 0
            opens = []
            for _ in range(3):
                msg = json.loads(pub.stdout.readline())
                before = _nocopy.driver_opens()
                with s.get_bundle("policy", timeout=30, newer_than=seen) as b:
                    if params is None:
                        params = {k: torch.empty_like(b[k]) for k in b}
                    cudaipc.bundle.load_into(b, params)
                    got = {k: hashlib.sha256(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for k, t in params.items()}
                    assert got == msg["digests"], "version %d: bytes differ" % b.version
                    seen = b.version
                opens.append(_nocopy.driver_opens() - before)
                pub.stdin.write("next\n")
                pub.stdin.flush()
            assert all(n >= 1 for n in opens), "driver opens per version: %s" % opens
        pub.wait(30)
        assert pub.returncode == 0
    finally:
        if pub.poll() is None:
            kill(pub)
        d.stop()


@pytest.mark.parametrize("fast", [True, False])
def test_publish_reuses_the_last_exports_only_for_the_same_tensors(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    """Publications.prepare's cache, exercised with host tensors standing in for CUDA
    ones (only a rebuild looks at the device, and refuses them: that is how a
    rebuild shows here): the same tensors, metadata and allocations reuse the last
    publish; a tensor with a new storage, a reshaped or retyped view at the same
    address, another name order, other metadata or a reallocated allocation do
    not."""
    torch = pytest.importorskip("torch")
    from cudaipc import _arrays, _cuda_ctypes
    names = ["a", "b", "c"]
    sd = {"a": torch.zeros(4, 4), "b": torch.zeros(8, dtype=torch.bfloat16), "c": torch.zeros(2, 3)}
    ids = {"buf": 41}
    src = _nocopy._Source(sd["a"].data_ptr(), 1 << 20, b"r", 41, [])
    ptrs, metas, contig = _arrays.TORCH.signature(list(sd.values()))
    pub = _nocopy._Published((names, ptrs, metas, [("k", "v")]), 0, GPU, [src], b"", b"", 0)
    pub.sig = (ptrs, metas, contig)
    monkeypatch.setattr(_arrays, "FAST_CHECKS", fast)
    pub.check = _arrays.TORCH.check(list(sd.values()), pub.sig)
    monkeypatch.setattr(_cuda_ctypes, "buffer_ids", lambda ordinal, ptrs: [ids["buf"]] * len(ptrs))
    pubs = _nocopy.Publications(None)
    pubs.last["m"] = pub

    def prepare(d: dict, meta: dict = {"k": "v"}) -> _nocopy._Published:
        return pubs.prepare("m", list(d), list(d.values()), meta)
    assert prepare(sd) is pub
    changed = [dict(sd, b=torch.zeros(8, dtype=torch.bfloat16)),      # new storage
               dict(sd, a=sd["a"].view(2, 8)),                          # same address, other shape
               dict(sd, c=sd["c"].view(torch.int32)),                   # same address, other dtype
               dict(sd, a=sd["a"].t()),                                 # same address and shape, transposed
               {"b": sd["b"], "a": sd["a"], "c": sd["c"]}]              # another order
    for d in changed:
        with pytest.raises(cudaipc.InvalidArgument, match="CUDA tensors in place|contiguous"):
            prepare(d)
    with pytest.raises(cudaipc.InvalidArgument, match="CUDA tensors in place"):
        prepare(sd, {"k": "w"})
    ids["buf"] = 42   # the allocation was freed and another made at the same address
    with pytest.raises(cudaipc.InvalidArgument, match="CUDA tensors in place"):
        prepare(sd)
    ids["buf"] = 41
    assert prepare(sd) is pub


class _FakeDriver:
    """A stand-in for cuda-bindings over made-up cudaMalloc allocations (base, size,
    buffer id): what a no-copy publish asks the driver to find and export them."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUpointer_attribute:
        CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = "legacy"
        CU_POINTER_ATTRIBUTE_BUFFER_ID = "buffer id"
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = "ordinal"

    class _Handle:
        def __init__(self, b: bytes) -> None:
            self.reserved = b

    def __init__(self, allocs: List[tuple]) -> None:
        self.allocs = allocs
        self.calls = 0

    def _find(self, p: int) -> tuple:
        for a in self.allocs:
            if a[0] <= p < a[0] + a[1]:
                return a
        raise AssertionError("address %#x in no allocation" % p)

    def cuMemGetAddressRange(self, p: int) -> tuple:
        self.calls += 1
        base, size, _ = self._find(p)
        return 0, base, size

    def cuPointerGetAttribute(self, attr: str, p: int) -> tuple:
        self.calls += 1
        a = self._find(p)
        return 0, {"legacy": 1, "buffer id": a[2], "ordinal": 0}[attr]

    def cuIpcGetMemHandle(self, base: int) -> tuple:
        self.calls += 1
        a = self._find(base)
        assert a[0] == base, "a legacy handle is of an allocation's base"
        return 0, self._Handle((b"%x:%d:" % (base, a[2])).ljust(64, b"\0"))

    def cuGetErrorName(self, err: int) -> tuple:
        return 0, b"CUDA_ERROR_%d" % err


def test_publish_exports_each_allocation_as_region_from_pointer_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """_find_sources (with a stand-in driver) gives one source per cudaMalloc
    allocation the tensors lie in, in address order, each region byte for byte
    what Region.from_pointer of the allocation records, with a single driver call
    per allocation beyond the lookup."""
    import random
    from cudaipc import _cuda
    rng = random.Random(5)
    allocs, at = [], 0x7F0000000000
    for i in range(60):
        size = rng.choice([2, 20, 64]) << 20
        allocs.append((at, size, 1000 + i))
        at += size + rng.choice([0, 2 << 20])   # adjacent or not: separate allocations either way
    fake = _FakeDriver(allocs)
    monkeypatch.setattr(_cuda, "_cu", fake)
    monkeypatch.setattr(_cuda, "_uuids", [GPU])
    monkeypatch.setattr(_cuda, "on", _NoContext)
    ptrs, sizes = [], []
    used = sorted(rng.sample(allocs, 40))
    for base, size, _ in used:
        for _ in range(rng.randint(1, 3)):
            off = rng.randrange(0, size // 2, 512)
            n = rng.randrange(1, size - off)
            ptrs.append(base + off)
            sizes.append(n)
    order = list(range(len(ptrs)))
    rng.shuffle(order)
    fake.calls = 0
    got = _nocopy._find_sources([ptrs[i] for i in order], [sizes[i] for i in order], 0)
    calls = fake.calls
    assert [(s.base, s.size, s.buffer_id) for s in got] == used
    assert calls == 4 * len(used)   # range, legacy?, buffer id, handle
    for s in got:
        assert s.region == Region.from_pointer(s.base, s.size).to_bytes()


def test_source_addresses_are_kept_per_plan_array_and_still_checked() -> None:
    """SourceMaps.addresses answers a plan's (off, size) arrays from what it kept
    (the same read-only answer, equal to a fresh computation); other arrays, even
    of equal contents, are computed and checked, and a range outside the regions
    is refused every time."""
    import numpy as np
    rng = np.random.default_rng(3)
    m = _nocopy.SourceMaps.__new__(_nocopy.SourceMaps)
    m.name = "x"
    m._memo = []
    starts, _ = _nocopy.source_starts([2 << 20] * 50)
    m.starts = np.array(starts, dtype=np.uint64)
    m.sizes = np.full(50, 2 << 20, dtype=np.uint64)
    m.delta = rng.integers(1 << 40, 1 << 41, 50, dtype=np.uint64)
    j = rng.integers(0, 50, 500)
    off = m.starts[j] + rng.integers(0, 1 << 20, 500, dtype=np.uint64)
    size = rng.integers(1, 1 << 20, 500, dtype=np.uint64)
    want = off + m.delta[j]
    a = m.addresses(off, size)
    assert np.array_equal(a, want) and not a.flags.writeable
    assert m.addresses(off, size) is a
    b = m.addresses(off.copy(), size.copy())
    assert b is not a and np.array_equal(b, want)
    bad = size.copy()
    bad[7] = (2 << 20) + 1   # runs past its region
    for _ in range(2):
        with pytest.raises(cudaipc.InternalError, match="outside the version's regions"):
            m.addresses(off, bad)
    for _ in range(5):   # a few other arrays push the first answer out: computed afresh, equal
        m.addresses(off.copy(), size)
    c = m.addresses(off, size)
    assert c is not a and np.array_equal(c, want)


def test_republish_sends_nothing_and_readers_reuse_its_bytes(store: cudaipc.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A no-copy version over the same allocations as the connection's last one
    (send_version(like=)) is one create, which the daemon seals: a reader gets the
    very memfd of the version before, and lease_sources takes the manifest and table
    it read from it then (the same objects); a like of a version the daemon did not
    keep for this connection is published afresh, written and sealed. (Regions are
    made up: mapping them is stood in for.)"""
    from cudaipc import _cuda, mapping
    monkeypatch.setattr(mapping, "map_region", lambda r, fds, writable=False: (0x7F0000000000, 0, None))
    monkeypatch.setattr(_cuda, "pick_ordinal", lambda u: 0)
    sizes = [1 << 20, 3 << 20]
    starts, span = _nocopy.source_starts(sizes)
    entries = [TensorEntry("t%d" % i, "U8", (n // 2,), at, at + n // 2) for i, (at, n) in enumerate(zip(starts, sizes))]
    raw, table = encode_manifest(entries), _nocopy.encode_sources([fake_region(n) for n in sizes])
    calls: List[str] = []
    call = store._conn.call

    def counted(req: pb.Request, *a: object, **k: object) -> object:
        calls.append(str(req.WhichOneof("body")))
        return call(req, *a, **k)
    monkeypatch.setattr(store._conn, "call", counted)

    def read(newer_than: int) -> tuple:
        lease = store.get("rp", 5, newer_than=newer_than)
        try:
            return lease.version, lease._manifest, lease.sources.table
        finally:
            lease.release()
    v1 = _nocopy.send_version(store._conn, "rp", raw, table, [], span, GPU_TEXT, keep_last=1)
    assert calls == ["create", "seal"]
    got1 = read(0)
    assert got1[0] == v1 and got1[1] == raw and got1[2] == table
    del calls[:]
    v2 = _nocopy.send_version(store._conn, "rp", raw, table, [], span, GPU_TEXT, keep_last=1, like=v1)
    assert v2 == v1 + 1 and calls == ["create"]
    got2 = read(v1)
    assert got2[0] == v2 and got2[1] is got1[1] and got2[2] is got1[2]
    del calls[:]
    v3 = _nocopy.send_version(store._conn, "rp", raw, table, [], span, GPU_TEXT, keep_last=1, like=v1)   # not the last
    assert v3 == v2 + 1 and calls == ["create", "create", "seal"]
    got3 = read(v2)
    assert got3[0] == v3 and got3[1] == raw and got3[1] is not got1[1] and got3[2] == table


def test_no_copy_reads_keep_per_store_and_close_with_it(daemon, store: cudaipc.Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What no-copy reads keep between leases (the latest version's manifest memfd,
    manifest, sources table and mapped regions, per name) is their Store's: two
    Stores reading one name each read and keep their own, and closing a Store closes
    what it kept (no descriptor of it stays open). (Regions are made up: mapping
    them is stood in for.)"""
    from cudaipc import _cuda, mapping
    monkeypatch.setattr(mapping, "map_region", lambda r, fds, writable=False: (0x7F0000000000, 0, None))
    monkeypatch.setattr(_cuda, "pick_ordinal", lambda u: 0)
    publish_fake(store, "kept")

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))
    before = open_fds()
    readers = [cudaipc.connect(daemon.socket) for _ in range(2)]
    got = []
    for r in readers:
        for _ in range(2):
            lease = r.get("kept", 5)
            got.append((lease._manifest, lease.sources))
            lease.release()
    assert got[0][0] is got[1][0] and got[0][1] is got[1][1], "one Store's second read did not reuse what it kept"
    assert got[2][0] is got[3][0] and got[2][1] is got[3][1]
    assert got[0][0] == got[2][0] and got[0][0] is not got[2][0] and got[0][1] is not got[2][1], \
        "two Stores share what their reads keep"
    for r in readers:
        r.close()
    assert open_fds() == before, "a closed Store left descriptors of its no-copy reads open"


def test_publish_no_copy_and_its_older_spelling(store: cudaipc.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Store.publish_no_copy (Go's PublishNoCopy) is the no-copy publish;
    put_bundle(publish=True, copy=False) and bundle.publish_no_copy call it."""
    torch = pytest.importorskip("torch")
    sd = {"w": torch.arange(10, dtype=torch.float32)}
    with pytest.raises(cudaipc.InvalidArgument, match="CUDA tensors"):
        store.publish_no_copy("m", sd)   # CPU tensors cannot be published in place
    calls = []

    def fake(self: cudaipc.Store, name: str, state_dict, **kw):   # type: ignore[no-untyped-def]
        calls.append((name, list(state_dict), kw))
        return "info"
    monkeypatch.setattr(cudaipc.Store, "publish_no_copy", fake)
    assert store.put_bundle("m", sd, publish=True, copy=False, keep_last=3) == "info"
    assert cudaipc.bundle.publish_no_copy(store, "n", sd, shared=True) == "info"
    assert [c[:2] for c in calls] == [("m", ["w"]), ("n", ["w"])]
    assert calls[0][2]["keep_last"] == 3 and calls[1][2] == {"shared": True}
