"""Versions published without a copy (docs/protocol.md, section 6.8): the version's
bytes are the publisher's own CUDA tensors, one region per CUDA allocation they lie
in, listed in a *sources table* that follows the manifest in its memfd.

Publisher side (:class:`Publications`, one per Store): the tensors are grouped by
allocation (legacy IPC regions of ``cudaMalloc`` memory, base + offset; VMM regions
with descriptors for PyTorch's expandable segments, ranges of adjacent chunks), laid
end to end as the protocol says, and the manifest's offsets point into that span.
The allocation lookups, exports and the encoded manifest are kept for the next
version of the same tensors at the same addresses (buffer ids are checked on every
publish, so a freed and reallocated segment is exported afresh).

Reader side (:class:`KeptSources`, one per Store, and :class:`SourceMaps`): each
region is mapped read-only through the process-wide mapping cache, and one reference
per region of the latest version read under a name is kept between leases, so that
later versions over the same allocations open nothing (``driver_opens()`` counts
what was mapped anew). The publisher exports VMM memory afresh for every version
(nothing tells it that a chunk of an expandable segment was not replaced), so VMM
regions map per version.
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from . import _cuda
from . import _cuda_ctypes
from . import _gcpause
from . import _store_pb2 as pb
from ._arrays import refuse_values
from ._manifest import TensorEntry, encode_manifest, st_dtype_of
from .errors import CudaError, InternalError, InvalidArgument, NotFound
from ._external import more_fds
from .lease import Lease
from .region import KIND_CUDA_IPC, KIND_VMM_FD, Region, local_identity

__all__ = ["SOURCE_ALIGN", "source_starts", "encode_sources", "decode_sources", "Publications", "KeptSources",
           "SourceMaps", "driver_opens", "MAX_FILES"]

SOURCE_ALIGN = 256
MAX_FILES = 60          # protocol.MaxFiles: descriptors one packet carries
_MAX_ENTRY = 1 << 16    # bundle.maxSourceLen


def source_starts(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """Where regions of these sizes start when laid end to end (region 0 at 0, each
    next one at the first multiple of 256 past the previous end, plus 256: never
    adjacent, so no copy merged by offset spans two allocations), and the span."""
    starts: List[int] = []
    span = 0
    for i, n in enumerate(sizes):
        if n <= 0:
            raise ValueError("sources: region %d has %d bytes" % (i, n))
        at = 0 if i == 0 else (span + SOURCE_ALIGN - 1) // SOURCE_ALIGN * SOURCE_ALIGN + SOURCE_ALIGN
        starts.append(at)
        span = at + n
    return starts, span


def encode_sources(regions: Sequence[bytes]) -> bytes:
    """The sources table: each region's binary encoding after its length (u32 LE)."""
    return b"".join(struct.pack("<I", len(r)) + r for r in regions)


def decode_sources(b: bytes) -> List[bytes]:
    """Split a sources table into its regions' encodings (InternalError when malformed:
    the table comes from the daemon, which checked it)."""
    out: List[bytes] = []
    i = 0
    while i < len(b):
        if len(b) - i < 4:
            raise InternalError("get", "", "sources table: %d stray bytes at its end" % (len(b) - i))
        (n,) = struct.unpack_from("<I", b, i)
        i += 4
        if n == 0 or n > _MAX_ENTRY or i + n > len(b):
            raise InternalError("get", "", "sources table: entry %d of %d bytes is malformed" % (len(out), n))
        out.append(bytes(b[i:i + n]))
        i += n
    if not out:
        raise InternalError("get", "", "sources table: no region")
    return out


# -- publisher ---------------------------------------------------------------------

class _Source:
    """One region of the publisher's memory: [base, base + size) of one allocation
    (legacy) or of adjacent VMM chunks; its encoded region, and for VMM memory its
    descriptors (kept: dup'd into every create)."""

    def __init__(self, base: int, size: int, region: bytes, buffer_id: int, fds: List[int]):
        self.base, self.size, self.region, self.buffer_id, self.fds = base, size, region, buffer_id, fds

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class _Published:
    """What one publish of a set of tensors computed, kept for the next one."""

    def __init__(self, key: Any, ordinal: int, device: bytes, sources: List[_Source], raw: bytes, table: bytes,
                 span: int):
        self.key, self.ordinal, self.device, self.sources = key, ordinal, device, sources
        self.raw, self.table, self.span = raw, table, span
        self.sig: Any = None     # the tensors' signature (_arrays.Signature), all contiguous
        self.check: Any = None   # its _arrays.Check
        self.sent = 0            # the last version published from this, through its store

    def close(self) -> None:
        for s in self.sources:
            s.close()



def _attr(cu: Any, attr: Any, ptr: int) -> int:
    return int(_cuda.check("cuPointerGetAttribute", cu.cuPointerGetAttribute(attr, ptr)))


def _find_sources(ptrs: List[int], sizes: List[int], ordinal: int) -> List[_Source]:
    """The regions the tensors at ptrs lie in, in address order."""
    from .extmem import export_pointer, NotExportable, FIX_POOL
    cu = _cuda.driver()
    A = cu.CUpointer_attribute
    legacy: Dict[int, Tuple[int, int]] = {}     # base -> (size, buffer id)
    chunks: Dict[int, int] = {}                 # VMM chunk base -> size
    starts: List[int] = []
    ends: List[int] = []
    with _cuda.on(ordinal):
        for p, n in zip(ptrs, sizes):
            if n == 0:
                continue
            end = p + n
            q = p
            while q < end:
                j = bisect.bisect_right(starts, q) - 1
                if j >= 0 and q < ends[j]:
                    q = ends[j]
                    continue
                base, size = _cuda.check("cuMemGetAddressRange", cu.cuMemGetAddressRange(q))
                base, size = int(base), int(size)
                if _attr(cu, A.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, q):
                    legacy[base] = (size, _attr(cu, A.CU_POINTER_ATTRIBUTE_BUFFER_ID, q))
                else:
                    err, h = cu.cuMemRetainAllocationHandle(q)
                    if err != cu.CUresult.CUDA_SUCCESS:
                        raise NotExportable(q, "memory that is neither VMM nor legacy-IPC capable "
                                               "(a cudaMallocAsync pool without an IPC handle type?)", FIX_POOL)
                    cu.cuMemRelease(h)
                    chunks[base] = size
                k = bisect.bisect_right(starts, base)
                starts.insert(k, base)
                ends.insert(k, base + size)
                q = base + size
    out: List[_Source] = []
    if legacy:
        # What Region.from_pointer(base, size) records, from what the lookup above
        # already asked the driver: one driver call per allocation, not six.
        ns, boot = local_identity()
        uuid = _cuda.uuids()[ordinal]
        me = os.getpid()
        with _cuda.on(ordinal):
            for base, (size, bid) in legacy.items():
                h = _cuda.check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(base))
                r = Region(handle=_cuda.as_bytes(h.reserved, 64), offset=0, size=size, alloc_size=size, device=uuid,
                           exporter_pid=me, pid_namespace=ns, boot_id=boot, buffer_id=bid, exporter_base=base)
                out.append(_Source(base, size, r.to_bytes(), bid, []))
    # Adjacent VMM chunks (one expandable segment) make one region over several pieces.
    run: List[Tuple[int, int]] = []
    for base in sorted(chunks) + [None]:  # type: ignore[list-item]
        if base is not None and run and run[-1][0] + run[-1][1] == base:
            run.append((base, chunks[base]))
            continue
        if run:
            lo, hi = run[0][0], run[-1][0] + run[-1][1]
            x = export_pointer(lo, hi - lo)
            out.append(_Source(lo, hi - lo, x.region.to_bytes(), 0, list(x.fds)))
            x.fds = []
        run = [(base, chunks[base])] if base is not None else []
    out.sort(key=lambda s: s.base)
    return out


def _still_valid(p: _Published) -> bool:
    """Whether the legacy allocations of an earlier publish are the same ones (a
    freed and reallocated segment has a new buffer id): one driver call per
    allocation, through ctypes."""
    if any(s.fds for s in p.sources):
        return False   # VMM memory: nothing tells that a chunk was not replaced, export afresh
    checked = [s for s in p.sources if s.buffer_id]
    if not checked:
        return True
    return _cuda_ctypes.buffer_ids(p.ordinal, [s.base for s in checked]) == [s.buffer_id for s in checked]


def _refuse_non_tensors(name: str, names: List[str], values: List[Any]) -> None:
    refuse_values("put_bundle", name, names, values, one_kind=False)   # no array at all
    import torch
    for k, v in zip(names, values):
        if not isinstance(v, torch.Tensor):
            raise InvalidArgument("put_bundle", name, "copy=False publishes torch CUDA tensors in place; state_dict[%r] "
                                  "is a %s: publish with copy=True" % (k, type(v).__name__)) from None


def _uuid_text(u: bytes) -> str:
    h = u.hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


class Publications:
    """What a Store's no-copy publishes keep between versions (one per Store, closed
    with it): per name, what the last publish computed (its sources, manifest and
    table, reused for the same tensors over the same allocations), and the names
    whose versions are all withdrawn and unleased (a withdraw answered since their
    last no-copy create): a publish of such a name has nothing to wait for and skips
    the request."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.lock = threading.Lock()
        self.last: Dict[str, _Published] = {}
        self.released: Set[str] = set()

    def publish(self, name: str, state_dict: Any, *, keep_last: int = 0, shared: bool = False,
                metadata: Optional[Dict[str, str]] = None, stream: Any = None,
                release_timeout: Optional[float] = 60.0) -> Tuple[int, int, int, str]:
        """Store.publish_no_copy: see there. Returns (version, span, tensors, device)."""
        import torch
        names = list(state_dict)
        values = list(state_dict.values())
        if not values:
            raise InvalidArgument("put_bundle", name, "copy=False needs at least one CUDA tensor")
        pub = self.prepare(name, names, values, metadata)
        # The previous no-copy versions alias these tensors: none may be read from now on
        # (nothing to wait for when a wait_released answered since the last publish).
        if self._unreleased(name):
            self.withdraw(name, release_timeout)
            self._unreleased(name)
        # The tensors' writes are done before readers may copy.
        s = stream if stream is not None else torch.cuda.current_stream(pub.ordinal)
        s.synchronize()
        fds = [d for src in pub.sources for d in src.fds]
        version = send_version(self.conn, name, pub.raw, pub.table, fds, pub.span, _uuid_text(pub.device),
                               keep_last=keep_last, shared=shared, like=pub.sent)
        pub.sent = version
        return version, pub.span, len(names), _uuid_text(pub.device)

    def prepare(self, name: str, names: List[str], values: List[Any],
                metadata: Optional[Dict[str, str]]) -> _Published:
        """The sources, manifest and table of a no-copy publish of these tensors: those of
        the last publish when the tensors are the same (names, addresses, shapes, dtypes:
        the cheapest reads, as load_into's plan check) over the same allocations."""
        from ._arrays import TORCH
        meta_items = sorted((metadata or {}).items())
        with self.lock:
            old = self.last.get(name)
        try:   # (a TypeError for a value that is no tensor)
            same = (old is not None and old.check is not None and old.key[0] == names and old.key[3] == meta_items
                    and old.check.fits(values))
            if same and old is not None and _still_valid(old):
                return old
            ptrs, metas, contig = TORCH.signature(values)
        except TypeError:
            _refuse_non_tensors(name, names, values)
            raise
        key = (names, ptrs, metas, meta_items)
        for n, v, c in zip(names, values, contig):
            if not v.is_cuda:
                raise InvalidArgument("put_bundle", name, "copy=False publishes CUDA tensors in place; %r is on %s: "
                                      "publish it with copy=True" % (n, v.device))
            if not c:
                raise InvalidArgument("put_bundle", name, "copy=False needs contiguous tensors; %r is not "
                                      "(pass .contiguous(), or copy=True)" % n)
        ordinals = {v.device.index for v in values}
        if len(ordinals) != 1:
            raise InvalidArgument("put_bundle", name, "copy=False publishes tensors of one GPU, these are on %s"
                                  % sorted(ordinals))
        ordinal = ordinals.pop()
        sizes = [v.numel() * v.element_size() for v in values]
        sources = _find_sources(ptrs, sizes, ordinal)
        try:
            starts, span = source_starts([s.size for s in sources])
            bases = [s.base for s in sources]
            entries: List[TensorEntry] = []
            with _gcpause.paused():
                for n, p, nb, (shape, dt) in zip(names, ptrs, sizes, metas):
                    st = st_dtype_of(dt)
                    if nb == 0:
                        entries.append(TensorEntry(n, st, tuple(shape), span, span))
                        continue
                    j = bisect.bisect_right(bases, p) - 1
                    off = starts[j] + p - bases[j]
                    entries.append(TensorEntry(n, st, tuple(shape), off, off + nb))
                entries.sort(key=lambda e: (e.begin, e.end))
                raw = encode_manifest(entries, metadata)
            for a, b in zip(entries, entries[1:]):
                if b.begin < a.end:
                    raise InvalidArgument("put_bundle", name, "tensors %r and %r share memory (tied weights?): a bundle's "
                                          "tensors may not overlap; publish one of them, or copy=True" % (a.name, b.name))
            table = encode_sources([s.region for s in sources])
        except BaseException:
            for s in sources:
                s.close()
            raise
        pub = _Published(key, ordinal, _cuda.uuids()[ordinal], sources, raw, table, span)
        pub.sig = (ptrs, metas, contig)
        pub.check = TORCH.check(values, pub.sig)
        with self.lock:
            old = self.last.get(name)
            self.last[name] = pub
        if old is not None:
            old.close()
        return pub

    def withdraw(self, name: str, timeout: Optional[float]) -> int:
        """Store.wait_released's request: see there."""
        ms = -1 if timeout is None else max(int(timeout * 1000), 0)
        r = self.conn.call(pb.Request(withdraw=pb.WithdrawRequest(name=name, timeout_ms=ms)), "wait_released", name)
        with self.lock:
            self.released.add(name)
        return int(r.resp.withdraw.versions)

    def _unreleased(self, name: str) -> bool:
        """Mark ``name`` as about to have a no-copy version; say whether one may still
        be live or leased (no withdraw answered since the last create)."""
        with self.lock:
            if name not in self.released:
                return True
            self.released.discard(name)
            return False

    def close(self) -> None:
        """Close the exports kept for the next publishes (the store closes)."""
        with self.lock:
            pubs = list(self.last.values())
            self.last.clear()
            self.released.clear()
        for p in pubs:
            p.close()


def send_version(conn: Any, name: str, raw: bytes, table: bytes, fds: List[int], span: int, device: str, *,
                 keep_last: int = 0, shared: bool = False, like: int = 0) -> int:
    """Create, write and seal a no-copy version of ``name``: manifest ``raw``, sources
    ``table`` (whose vmm-fd pieces' descriptors are ``fds``, in order; they stay the
    caller's), ``span`` bytes on GPU ``device`` (its UUID text). Returns the version.

    ``like``: the version this connection last published from the same tensors over
    the same allocations (0: none). Where there are no descriptors, the create asks
    the daemon to republish it (docs/protocol.md 6.8, like_version): one request,
    nothing written. A daemon that refuses (that version is not the last it kept for
    this connection) gets the version afresh; one that does not know the field
    answers as to any create, and the bytes are written and sealed as always."""
    like = like if not fds else 0
    req = pb.Request(create=pb.CreateRequest(name=name, size=span, device=device, shared=shared,
                                             versioned=True, keep_last=keep_last, manifest_size=len(raw),
                                             sources_size=len(table), files=len(fds), like_version=like))
    with conn.staging_lock:
        rest = fds
        while len(rest) > MAX_FILES:
            conn.call(pb.Request(stage_files=pb.StageFilesRequest()), "put_bundle", name, fds=rest[:MAX_FILES])
            rest = rest[MAX_FILES:]
        try:
            r = conn.call(req, "put_bundle", name, fds=rest)
        except (NotFound, InvalidArgument):
            if not like:
                raise
            r = None
    if r is None:
        return send_version(conn, name, raw, table, fds, span, device, keep_last=keep_last, shared=shared)
    version = int(r.resp.create.version)
    if like and not r.resp.create.manifest_attached and r.manifest_fd < 0:
        return version   # republished: sealed by the daemon
    abort = pb.Request(abort=pb.AbortRequest(name=name, version=version))
    p = r.resp.create.placement
    mfd, r.manifest_fd = r.manifest_fd, -1
    try:
        if mfd < 0 or not p.external or p.size != span:
            raise InternalError("put_bundle", name, "the daemon answered a no-copy create without its manifest memfd")
        n = os.pwritev(mfd, [raw, table], 0)
        if n != len(raw) + len(table):
            raise InternalError("put_bundle", name, "wrote %d of the manifest's and sources table's %d bytes"
                                % (n, len(raw) + len(table)))
    except BaseException:
        conn.send_detached(abort)
        raise
    finally:
        if mfd >= 0:
            os.close(mfd)
    conn.call(pb.Request(seal=pb.SealRequest(name=name, version=version)), "put_bundle", name)
    return version


# -- reader ------------------------------------------------------------------------

_opens = [0]   # driver_opens(): a count of the whole process


def driver_opens() -> int:
    """How many regions readers of no-copy versions in this process have mapped anew
    (a legacy handle opened, VMM pieces imported): 0 for a version over the same
    allocations as the one read before it."""
    return _opens[0]


class RegionView:
    """One mapped region as the array libraries view a lease (``tensor()``,
    ``cupy()``, ``ordinal``, ``size``): what Bundle views of a no-copy version are
    made from."""

    def __init__(self, owner: Any, ptr: int, size: int, ordinal: int):
        self.owner, self.ptr, self.size, self.ordinal = owner, ptr, size, ordinal

    def tensor(self, dtype: Any = None, shape: Any = None) -> Any:
        from . import _views
        lay = _views.resolve_layout(self.size, None, dtype, shape)
        return _views.torch_cuda_view(self.owner, self.ptr, lay, self.ordinal, True)

    def cupy(self, dtype: Any = None, shape: Any = None) -> Any:
        from . import _views
        lay = _views.resolve_layout(self.size, None, dtype, shape)
        return _views.cupy_view(self.owner, self.ptr, self.size, lay, self.ordinal)


class SourceMaps:
    """The regions of a no-copy version, mapped (read-only, through the process-wide
    mapping cache of mapping.map_region), shared by the leases of the versions with
    the same sources table (see ``acquire``): ``addresses(off, size)`` turns offsets
    of the version (arrays) into device addresses, checking that each range lies
    inside one region."""

    def __init__(self, name: str, table: bytes, fds: List[int], ordinal: int, before: Optional["SourceMaps"]):
        import numpy as np
        from .mapping import map_region
        self.name, self.table, self.ordinal = name, table, ordinal
        self.users = 0
        self.kept: Any = None   # the KeptSources that acquired it
        encoded = decode_sources(table)
        regions = [Region.from_bytes(b) for b in encoded]
        starts, self.span = source_starts([r.size for r in regions])
        self.starts = np.array(starts, dtype=np.uint64)
        self.sizes = np.array([r.size for r in regions], dtype=np.uint64)
        self._closes: List[Any] = []
        self._memo: List[Tuple[Any, Any, Any]] = []   # addresses(): (off, size, answer), newest last
        self.keys: Set[bytes] = set()
        had = before.keys if before is not None else set()
        ptrs: List[int] = []
        fi = 0
        me = os.getpid()
        try:
            for b, r in zip(encoded, regions):
                if r.kind == KIND_VMM_FD:
                    n = len(r.pieces)
                    if fi + n > len(fds):
                        raise InternalError("get", name, "the version's vmm-fd regions have more pieces than descriptors came")
                    mine = fds[fi:fi + n]
                    fi += n
                elif r.kind == KIND_CUDA_IPC:
                    mine = []
                else:
                    raise InternalError("get", name, "sources table: a region of kind %d" % r.kind)
                try:
                    addr, _, close = map_region(r, mine, writable=False)
                except CudaError as e:
                    raise CudaError(e.call, e.result, "%s (a version published without a copy: legacy regions open only "
                                    "in the publisher's PID namespace and while it lives)" % e.detail) from None
                if close is not None:
                    self._closes.append(close)
                    if b not in had and b not in self.keys and (r.exporter_pid != me or r.kind == KIND_VMM_FD):
                        _opens[0] += 1
                    self.keys.add(b)
                ptrs.append(addr)
        except BaseException:
            self.close()
            raise
        self.bases = np.array(ptrs, dtype=np.uint64)
        self.delta = self.bases - self.starts   # modulo 2^64: added back in addresses()

    def release(self) -> None:
        """One lease of these regions ended."""
        if self.kept.let_go(self):
            self.close()

    def region_of(self, off: int) -> int:
        import numpy as np
        return max(int(np.searchsorted(self.starts, np.uint64(off), side="right")) - 1, 0)

    def addresses(self, off: Any, size: Any) -> Any:
        """Device addresses of the version's byte ranges [off, off + size), read-only.
        The answers for the last few (off, size) array objects are kept, by identity
        (a copy plan's arrays, which never change): a cached plan asks the same of
        every version over these regions."""
        memo = self._memo
        for m in memo:
            if m[0] is off and m[1] is size:
                return m[2]
        out = self._addresses(off, size)
        out.flags.writeable = False
        memo.append((off, size, out))   # (the arrays are held, so their identity stays theirs)
        del memo[:-4]
        return out

    def _addresses(self, off: Any, size: Any) -> Any:
        import numpy as np
        j = np.searchsorted(self.starts, off, side="right").astype(np.int64) - 1
        jj = np.maximum(j, 0)
        bad = (j < 0) | (off + size > self.starts[jj] + self.sizes[jj])
        if bad.any():
            k = int(np.nonzero(bad)[0][0])
            raise InternalError("load", self.name, "the manifest's range [%d, %d) lies outside the version's regions"
                                % (int(off[k]), int(off[k] + size[k])))
        return off + self.delta[jj]

    def view(self, owner: Any, e: TensorEntry) -> Tuple["RegionView", TensorEntry]:
        """The region entry e lies in, and e relative to it."""
        j = self.region_of(e.begin)
        start, size = int(self.starts[j]), int(self.sizes[j])
        if e.end - e.begin and not (start <= e.begin and e.end <= start + size):
            raise InternalError("get", self.name, "tensor %r lies outside the version's regions" % e.name)
        return (RegionView(owner, int(self.bases[j]), size, self.ordinal),
                TensorEntry(e.name, e.dtype, e.shape, e.begin - start, e.end - start))

    def close(self) -> None:
        """Drop the references to the regions (each is unmapped with its last one)."""
        closes, self._closes = self._closes, []
        for c in closes:
            try:
                c()
            except CudaError:
                pass


class KeptSources:
    """What a Store's readers of no-copy versions keep between leases (one per Store,
    closed with it), per name: the regions of the latest version read under that
    name, mapped (:class:`SourceMaps`), and that version's manifest memfd (kept open:
    its inode can be no other file's while it is) with its (st_dev, st_ino) and the
    manifest and sources table read from it. A lease of a later version with the
    same sources table shares the regions (no driver call, no parse); one with
    another table maps anew, taking its references before the older set lets go, so
    that regions both have stay mapped. A set is unmapped once it is no longer the
    latest and no lease uses it."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.lock = threading.Lock()
        self.latest: Dict[str, SourceMaps] = {}
        self.memfds: Dict[str, Tuple[int, Tuple[int, int], bytes, bytes]] = {}

    def lease_sources(self, r: Any, p: Any, info: Any, name: str) -> Tuple[SourceMaps, bytes]:
        """A no-copy version's get: read its manifest and sources table from the memfd,
        fetch the descriptors beyond the attached ones, map the regions. Returns the
        maps and the manifest bytes; closes every descriptor."""
        fds, r.fds = list(r.fds), ()
        mfd, r.manifest_fd = r.manifest_fd, -1
        try:
            if mfd < 0:
                raise InternalError("get", name, "a no-copy version without its manifest memfd")
            msize, ssize = int(info.manifest_size), int(info.sources_size)
            got = self.read_memfd(name, mfd, msize, ssize)
            if got is None:
                raise InternalError("get", name, "the manifest memfd is shorter than its manifest and sources table")
            manifest, table = got
            mfd = -1   # (kept by read_memfd)
            more_fds(self.conn, name, r.resp.get.lease_id, fds, p.files)
            ordinal = _cuda.pick_ordinal(bytes.fromhex(p.device[4:].replace("-", "")))
            maps = self.acquire(name, table, fds, ordinal)
            return maps, manifest
        finally:
            if mfd >= 0:
                os.close(mfd)
            for fd in fds:
                os.close(fd)

    def acquire(self, name: str, table: bytes, fds: List[int], ordinal: int) -> SourceMaps:
        """The mapped regions of a version of ``name`` with this sources table, for one
        more lease (``SourceMaps.release`` when it ends)."""
        with self.lock:
            cur = self.latest.get(name)
            if cur is not None and cur.table == table and cur.ordinal == ordinal:
                cur.users += 1
                return cur
        new = SourceMaps(name, table, fds, ordinal, cur)
        new.kept = self
        with self.lock:
            new.users += 1
            prev = self.latest.get(name)
            self.latest[name] = new
            gone = prev is not None and prev.users == 0
        if gone:
            assert prev is not None
            prev.close()
        return new

    def let_go(self, m: SourceMaps) -> bool:
        """One lease of ``m`` ended: whether that was its last one and it is no longer
        the latest (then the caller unmaps it)."""
        with self.lock:
            m.users -= 1
            return m.users == 0 and self.latest.get(m.name) is not m

    def read_memfd(self, name: str, mfd: int, msize: int, ssize: int) -> Optional[Tuple[bytes, bytes]]:
        """The manifest and sources table in memfd ``mfd`` (taken: kept or closed);
        None when it is shorter. A republished version (like_version) comes with the
        very memfd of the version before it: sealed against writes, so the bytes read
        from it then are its bytes now, the same objects (which the parse's and the
        mapped regions' caches then recognize by identity)."""
        import fcntl
        st = os.fstat(mfd)
        key = (st.st_dev, st.st_ino)
        with self.lock:
            old = self.memfds.get(name)
        if (old is not None and old[1] == key and len(old[2]) == msize and len(old[3]) == ssize
                and fcntl.fcntl(mfd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE):
            os.close(mfd)
            return old[2], old[3]
        try:
            manifest = os.pread(mfd, msize, 0)
            table = os.pread(mfd, ssize, msize)
        except BaseException:
            os.close(mfd)
            raise
        if len(manifest) != msize or len(table) != ssize:
            os.close(mfd)
            return None
        with self.lock:
            old = self.memfds.get(name)
            self.memfds[name] = (mfd, key, manifest, table)
        if old is not None:
            os.close(old[0])
        return manifest, table

    def close(self) -> None:
        """Let go of the regions of the latest versions read (each set is unmapped once
        no lease uses it) and of their manifest memfds (the store closes)."""
        with self.lock:
            sets = [m for m in self.latest.values() if m.users == 0]
            self.latest.clear()
            kept = [e[0] for e in self.memfds.values()]
            self.memfds.clear()
        for m in sets:
            m.close()
        for fd in kept:
            os.close(fd)


class SourcesLease(Lease):
    """A lease on a no-copy version: its bytes are several regions of the
    publisher's memory, not one range, so it has no single address or whole-object
    view; read it with :func:`cudaipc.bundle.get_bundle` (views per tensor) and
    :func:`cudaipc.bundle.load_into` (batched copies straight from the regions)."""

    __slots__ = ("sources",)

    def __init__(self, mem: Any, rec: Any, manifest: bytes, sources: SourceMaps):
        super().__init__(mem, rec, None)
        self._manifest = manifest
        self.sources = sources

    def _whole(self) -> Exception:
        return InvalidArgument("get", self._rec.name, "a version published without a copy lies in several regions "
                               "of its publisher's memory: read it with get_bundle and load_into")

    @property
    def data_ptr(self) -> int:
        raise self._whole()

    def tensor(self, dtype: Any = None, shape: Any = None) -> Any:
        raise self._whole()

    def cupy(self, dtype: Any = None, shape: Any = None) -> Any:
        raise self._whole()

    def numpy(self, dtype: Any = None, shape: Any = None) -> Any:
        raise self._whole()

    def memoryview(self) -> memoryview:
        raise self._whole()

    def read(self) -> bytes:
        raise self._whole()
