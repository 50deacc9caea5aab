"""Tensor bundles: many tensors in one store object, with a safetensors manifest.

A bundle is one object holding every tensor of a state dict at a 256-byte-aligned
offset; its manifest, the header JSON of a Hugging Face safetensors file, travels
beside the object in a sealed memfd (docs/protocol.md, section 6.3), so reading it
never touches GPU memory. The weight sync of an RL trainer to its inference engine::

    # trainer, every step
    store.put_bundle("policy", model.state_dict(), publish=True)

    # engine
    b = store.get_bundle("policy", newer_than=seen)   # zero-copy views of one lease
    report = cudaipc.bundle.load_into(b, dict(engine_model.named_parameters()))
    seen = b.version

Versions (``publish=True``) make each put the next version of the name, visible
atomically once sealed; the store reclaims a version once it is superseded and no
longer leased.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import KeysView
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from .errors import InvalidArgument

__all__ = ["ALIGNMENT", "Bundle", "BundleWriter", "create_bundle", "LoadReport", "LoadMismatch", "TensorEntry", "layout",
           "encode_manifest", "parse_manifest", "put_bundle", "get_bundle", "load_into"]

ALIGNMENT = 256
"""Every tensor of a bundle starts at a multiple of this many bytes."""

# protocol dtype name (torch's) -> safetensors dtype name
TO_SAFETENSORS = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32",
    "float64": "F64", "int64": "I64", "uint64": "U64", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
}
FROM_SAFETENSORS = {v: k for k, v in TO_SAFETENSORS.items()}
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
        "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
        "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}


@dataclasses.dataclass(slots=True)
class TensorEntry:
    """One tensor of a manifest: its bytes are [begin, end) of the object."""
    name: str
    dtype: str              # safetensors name: "BF16", ...
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    bits = BITS.get(dtype)
    if bits is None:
        raise ValueError("unknown safetensors dtype %r" % dtype)
    n = 1
    for d in shape:
        if d < 0:
            raise ValueError("negative dimension in %r" % (tuple(shape),))
        n *= d
    if n * bits % 8:
        raise ValueError("%d elements of %s are not a whole number of bytes" % (n, dtype))
    return n * bits // 8


def layout(specs: Iterable[Tuple[str, str, Sequence[int]]], align: int = ALIGNMENT) -> Tuple[List[TensorEntry], int]:
    """Place (name, safetensors dtype, shape) one after the other, each at the next
    multiple of ``align``; returns the entries and the object size they need."""
    out: List[TensorEntry] = []
    seen = set()
    at = 0
    for name, dt, shape in specs:
        if name == "__metadata__" or name in seen:
            raise ValueError("tensor name %r is reserved or repeated" % name)
        seen.add(name)
        n = _nbytes(dt, shape)
        at = (at + align - 1) // align * align
        out.append(TensorEntry(name, dt, tuple(int(d) for d in shape), at, at + n))
        at += n
    return out, at


def encode_manifest(entries: Sequence[TensorEntry], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """The safetensors header of entries: "__metadata__" first, tensors in offset
    order, padded with spaces to a multiple of 8 bytes (as Go's bundle.Marshal)."""
    parts = []
    if metadata:
        parts.append('"__metadata__":' + json.dumps({str(k): str(v) for k, v in sorted(metadata.items())},
                                                    separators=(",", ":"), ensure_ascii=False))
    for e in sorted(entries, key=lambda e: (e.begin, e.end, e.name)):
        parts.append('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}' % (
            json.dumps(e.name, ensure_ascii=False), e.dtype, ",".join(str(d) for d in e.shape), e.begin, e.end))
    b = ("{" + ",".join(parts) + "}").encode("utf-8")
    return b + b" " * (-len(b) % 8)


def parse_manifest(raw: bytes) -> Tuple[List[TensorEntry], Dict[str, str]]:
    """Decode a safetensors header: entries sorted by offset, and the metadata."""
    doc = json.loads(raw.decode("utf-8").rstrip(" "))
    if not isinstance(doc, dict):
        raise ValueError("a safetensors header is a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    out = [TensorEntry(name, e["dtype"], tuple(e["shape"]), e["data_offsets"][0], e["data_offsets"][1])
           for name, e in doc.items()]
    out.sort(key=lambda e: (e.begin, e.end))
    return out, meta


def _torch_dtype(st: str) -> Any:
    import torch
    name = FROM_SAFETENSORS.get(st)
    return getattr(torch, name, None) if name else None


@dataclasses.dataclass(frozen=True)
class BundleInfo:
    """What put_bundle stored."""
    name: str
    version: int
    nbytes: int
    tensors: int
    device: str


def put_bundle(store: Any, name: str, state_dict: Mapping[str, Any], device: Any = None, *,
               publish: bool = False, shards: int = 0, shard: int = 0, keep_last: int = 0,
               shared: bool = False, metadata: Optional[Mapping[str, str]] = None,
               stream: Any = None) -> BundleInfo:
    """Store the tensors of ``state_dict`` (torch tensors, CPU or CUDA) as one bundle.

    ``device`` defaults to where the first CUDA tensor is (else host memory). The
    copies go as :func:`load_into`'s do, the other way: for contiguous CUDA tensors
    and a GPU object, one ``cuMemcpyBatchAsync`` per source GPU on ``stream``
    (default: the current stream of the tensors' device), after the work already
    queued there; memmove between host memory; PyTorch copies otherwise. The stream
    is synchronized before the seal. The manifest and the copy plan are kept: the
    next put of tensors with the same names, dtypes and shapes (at the same
    addresses) encodes nothing again. With ``publish`` the bundle is the next
    version of ``name`` (shard ``shard`` of ``shards``: see Store.publish)."""
    names = list(state_dict)
    values = list(state_dict.values())
    sig = _signature(values)
    lay = _put_layout(names, sig[1], metadata)
    if device is None:
        cuda = next((v.device for v in values if v.is_cuda), None)
        device = cuda.index if cuda is not None else "host"
    obj = store.create(name, max(lay.size, 1), device, shared=shared, versioned=publish, shards=shards,
                       shard=shard, keep_last=keep_last, manifest=lay.raw)
    try:
        mem = obj._live()
        views: Dict[str, Any] = {}

        def view_of(n: str) -> Any:
            if not views:
                views.update(_views_of(obj.tensor(), lay.entries))
            return views[n]

        _run_plan(lay, names, values, mem.is_gpu, mem.addr, view_of, state_dict, stream, load=False, sig=sig)
    except BaseException:
        obj.abort()
        raise
    obj.seal()
    return BundleInfo(name, obj.version, lay.size, len(lay.entries), obj.device)


_PUT_LAYOUTS: List[Tuple[List[str], List[Tuple[Any, Any]], Dict[str, str], "_Layout"]] = []


def _put_layout(names: List[str], shape_dtypes: List[Tuple[Any, Any]], metadata: Optional[Mapping[str, str]]) -> "_Layout":
    """The layout of tensors with these names and (shape, dtype)s: laid out and
    encoded once, then found again by comparing the lists (a put of the next version)."""
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    with _layout_lock:
        for c in reversed(_PUT_LAYOUTS):
            if c[0] == names and c[1] == shape_dtypes and c[2] == meta:
                return c[3]
    entries, size = layout([(k, _st_dtype_of(dt), tuple(sh)) for k, (sh, dt) in zip(names, shape_dtypes)])
    lay = _layout_of(encode_manifest(entries, meta))
    with _layout_lock:
        _PUT_LAYOUTS.append((names, shape_dtypes, meta, lay))
        del _PUT_LAYOUTS[:-4]
    return lay


BIG = 1 << 20
"""Tensors of at least this many bytes are copied one by one (copy_: a DMA-speed
memcpy); smaller ones together (_foreach_copy_: few launches for many tensors)."""

_INT_OF_SIZE: Dict[int, Any] = {}


def _bits(t: Any) -> Any:
    """t viewed as integers of its element size, so that a copy moves bits: a copy
    of floats may canonicalize NaN payloads (PyTorch's _foreach_copy_ on bfloat16
    does), and a weight copy must be exact."""
    import torch
    if not (t.is_floating_point() or t.is_complex()):
        return t
    if not _INT_OF_SIZE:
        _INT_OF_SIZE.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    it = _INT_OF_SIZE.get(t.element_size())
    if it is None or t.dim() == 0:
        return t if it is None else t.reshape(1).view(it)
    return t.view(it)


def _copy(dsts: List[Any], srcs: List[Any], device: Any, stream: Any) -> int:
    """Copy srcs into dsts, bit for bit, on stream; returns the number of copy calls."""
    import torch
    if not dsts:
        return 0
    ctx: Any = None
    if device.type == "cuda":
        s = stream if stream is not None else torch.cuda.current_stream(device)
        ctx = torch.cuda.stream(s)
    else:
        s = None
    calls = 0
    if ctx is not None:
        ctx.__enter__()
    try:
        small_d, small_s = [], []
        foreach = hasattr(torch, "_foreach_copy_")
        for d, x in zip(dsts, srcs):
            if foreach and d.device == x.device and d.numel() * d.element_size() < BIG:
                small_d.append(_bits(d))
                small_s.append(_bits(x))
            else:
                d.copy_(x, non_blocking=True)
                calls += 1
        if small_d:
            torch._foreach_copy_(small_d, small_s)
            calls += 1
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if s is not None:
        s.synchronize()
    return calls


class BundleWriter:
    """A bundle being written in place (from :func:`create_bundle`): ``tensors`` are
    writable zero-copy views of the new object, by name. Write them (a trainer's
    gather or optimizer output can land there directly: no copy), synchronize, then
    ``seal()``."""

    def __init__(self, obj: Any, entries: List[TensorEntry], tensors: Dict[str, Any]):
        self.obj = obj
        self.entries = entries
        self.tensors = tensors

    @property
    def version(self) -> int:
        return self.obj.version

    def seal(self) -> None:
        """Publish: the views must not be used afterwards."""
        self.tensors = {}
        self.obj.seal()

    def abort(self) -> None:
        self.tensors = {}
        self.obj.abort()


def create_bundle(store: Any, name: str, specs: Mapping[str, Tuple[Any, Sequence[int]]], device: Any = None, *,
                  publish: bool = False, shards: int = 0, shard: int = 0, keep_last: int = 0,
                  shared: bool = False, metadata: Optional[Mapping[str, str]] = None) -> BundleWriter:
    """Create a bundle of tensors given as {name: (torch dtype, shape)} and return
    writable views of them in the new object, to be filled in place and sealed."""
    items = [(k, _st_dtype_of(dt, "create"), tuple(int(d) for d in shape)) for k, (dt, shape) in specs.items()]
    entries, size = layout(items)
    obj = store.create(name, max(size, 1), device, shared=shared, versioned=publish, shards=shards,
                       shard=shard, keep_last=keep_last, manifest=encode_manifest(entries, metadata))
    try:
        views = _views_of(obj.tensor(), entries)
    except BaseException:
        obj.abort()
        raise
    return BundleWriter(obj, entries, views)


def _st_dtype_of(dt: Any, op: str = "put") -> str:
    name = str(dt).replace("torch.", "")
    st = TO_SAFETENSORS.get(name)
    if st is None:
        raise InvalidArgument(op, "", "dtype %s has no safetensors name" % name)
    return st


def _views_of(base: Any, entries: List[TensorEntry]) -> Dict[str, Any]:
    """Views of each entry in base (uint8, the whole object): one as_strided per
    tensor over a view of base per dtype. Dtypes torch lacks come as uint8 bytes."""
    import torch
    by_dtype: Dict[Any, Any] = {}
    out: Dict[str, Any] = {}
    for e in entries:
        dt = _torch_dtype(e.dtype)
        if dt is None:
            out[e.name] = base[e.begin:e.end]
            continue
        v = by_dtype.get(dt)
        if v is None:
            item = torch.empty((), dtype=dt).element_size()
            v = by_dtype[dt] = (base[: base.numel() - base.numel() % item].view(dt), item)
        view, item = v
        strides, acc = [], 1
        for d in reversed(e.shape):
            strides.append(acc)
            acc *= max(d, 1)
        out[e.name] = torch.as_strided(view, e.shape, tuple(reversed(strides)), e.begin // item)
    return out


class _Layout:
    """A parsed manifest, shared by every lease whose manifest has the same bytes
    (the versions of one model): parsing 18,000 entries takes longer than loading
    them, so it happens once per layout, not once per version."""

    def __init__(self, raw: bytes):
        self.raw = raw
        self.entries, self.metadata = parse_manifest(raw)
        self.names = [e.name for e in self.entries]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.nbytes = sum(e.end - e.begin for e in self.entries)
        self.size = max((e.end for e in self.entries), default=0)
        self._views: Optional[List[Tuple[Any, Tuple[int, ...]]]] = None

    def view_types(self) -> List[Tuple[Any, Tuple[int, ...]]]:
        """(torch dtype, shape) of each entry's view: uint8 bytes for dtypes PyTorch lacks."""
        v = self._views
        if v is None:
            import torch
            dts: Dict[str, Any] = {}
            v = []
            for e in self.entries:
                dt = dts.get(e.dtype, False)
                if dt is False:
                    dt = dts[e.dtype] = _torch_dtype(e.dtype)
                v.append((dt, e.shape) if dt is not None else (torch.uint8, (e.end - e.begin,)))
            self._views = v
        return v


_LAYOUTS: List[_Layout] = []   # recently seen layouts, newest last
_MAX_LAYOUTS = 8
_layout_lock = threading.Lock()


def _layout_of(raw: bytes) -> _Layout:
    with _layout_lock:
        for i in range(len(_LAYOUTS) - 1, -1, -1):
            lay = _LAYOUTS[i]
            if lay.raw == raw:   # a memcmp: far cheaper than parsing (or hashing) it
                if i != len(_LAYOUTS) - 1:
                    _LAYOUTS.append(_LAYOUTS.pop(i))
                return lay
    lay = _Layout(raw)
    with _layout_lock:
        _LAYOUTS.append(lay)
        del _LAYOUTS[:-_MAX_LAYOUTS]
    return lay


class Bundle(dict):
    """Zero-copy tensors of one bundle lease, by name (a dict of torch.Tensor). The
    lease lasts while the Bundle or any of its tensors is alive; ``release()`` gives up
    the Bundle's own hold.

    The views are made when first looked up (all of them by ``values()``, ``items()``
    and the like): a consumer that only passes the Bundle to :func:`load_into` never
    pays for one view per tensor."""

    def __init__(self, lease: Any, layout: _Layout):
        super().__init__()
        self.lease = lease
        self.metadata: Dict[str, str] = dict(layout.metadata)
        self._layout: Optional[_Layout] = layout
        self._full = False                     # every view made: the dict itself is the truth
        self._base: Any = None                 # uint8 view of the whole object
        self._by_dtype: Dict[Any, Tuple[Any, int]] = {}

    @property
    def version(self) -> int:
        return self.lease.version

    @property
    def entries(self) -> List[TensorEntry]:
        """The manifest's tensors, in offset order."""
        return list(self._layout.entries) if self._layout is not None else []

    @property
    def nbytes(self) -> int:
        return self._layout.nbytes if self._layout is not None else 0

    def _view(self, i: int) -> Any:
        import torch
        lay = self._layout
        assert lay is not None
        e = lay.entries[i]
        if self._base is None:
            self._base = self.lease.tensor()
        base = self._base
        dt = _torch_dtype(e.dtype)
        if dt is None:
            return base[e.begin:e.end]
        v = self._by_dtype.get(dt)
        if v is None:
            item = torch.empty((), dtype=dt).element_size()
            v = self._by_dtype[dt] = (base[: base.numel() - base.numel() % item].view(dt), item)
        view, item = v
        strides, acc = [], 1
        for d in reversed(e.shape):
            strides.append(acc)
            acc *= max(d, 1)
        return torch.as_strided(view, e.shape, tuple(reversed(strides)), e.begin // item)

    def _materialize(self) -> None:
        if not self._full:
            lay = self._layout
            if lay is not None:
                for i, n in enumerate(lay.names):
                    if not dict.__contains__(self, n):
                        dict.__setitem__(self, n, self._view(i))
            self._full = True

    # Lookups answer from the manifest, making at most the view asked for.
    def __getitem__(self, k: Any) -> Any:
        if self._full or dict.__contains__(self, k):
            return dict.__getitem__(self, k)
        i = self._layout.index.get(k) if self._layout is not None else None
        if i is None:
            raise KeyError(k)
        t = self._view(i)
        dict.__setitem__(self, k, t)
        return t

    def get(self, k: Any, default: Any = None) -> Any:
        try:
            return self[k]
        except KeyError:
            return default

    def __contains__(self, k: Any) -> bool:
        if self._full:
            return dict.__contains__(self, k)
        return self._layout is not None and k in self._layout.index

    def __len__(self) -> int:
        if self._full:
            return dict.__len__(self)
        return len(self._layout.names) if self._layout is not None else 0

    def __iter__(self) -> Iterator[str]:
        if self._full:
            return dict.__iter__(self)
        return iter(self._layout.names if self._layout is not None else ())

    def keys(self) -> Any:  # type: ignore[override]
        if self._full:
            return dict.keys(self)
        return KeysView(self)

    # Everything else works on the whole dict: make every view first.
    def values(self) -> Any:  # type: ignore[override]
        self._materialize()
        return dict.values(self)

    def items(self) -> Any:  # type: ignore[override]
        self._materialize()
        return dict.items(self)

    def copy(self) -> Dict[str, Any]:  # type: ignore[override]
        self._materialize()
        return dict(dict.items(self))

    def __eq__(self, other: Any) -> bool:
        self._materialize()
        return dict.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "<cudaipc.Bundle %d tensors, %d bytes, version %d%s>" % (
            len(self), self.nbytes, self.version, " released" if self._layout is None else "")

    def __reduce__(self) -> Any:
        self._materialize()
        return (dict, (dict(dict.items(self)),))

    def __setitem__(self, k: Any, v: Any) -> None:
        self._materialize()
        dict.__setitem__(self, k, v)

    def __delitem__(self, k: Any) -> None:
        self._materialize()
        dict.__delitem__(self, k)

    def pop(self, *a: Any) -> Any:  # type: ignore[override]
        self._materialize()
        return dict.pop(self, *a)

    def popitem(self) -> Any:
        self._materialize()
        return dict.popitem(self)

    def setdefault(self, *a: Any) -> Any:  # type: ignore[override]
        self._materialize()
        return dict.setdefault(self, *a)

    def update(self, *a: Any, **kw: Any) -> None:  # type: ignore[override]
        self._materialize()
        dict.update(self, *a, **kw)

    def __or__(self, other: Any) -> Any:
        self._materialize()
        return dict(dict.items(self)) | other

    def __ior__(self, other: Any) -> Any:
        self._materialize()
        dict.update(self, other)
        return self

    def clear(self) -> None:
        dict.clear(self)
        self._full = True

    def release(self) -> None:
        """Drop the Bundle's views and its hold on the lease (views handed out stay
        valid while they live). A released Bundle is empty."""
        self.clear()
        self._layout = None
        self._base = None
        self._by_dtype = {}
        self.lease.release()

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def get_bundle(store: Any, name: str, timeout: Optional[float] = None, *, version: int = 0,
               shard: int = 0, newer_than: int = 0) -> Bundle:
    """Lease a bundle (``version``, or the latest above ``newer_than``, or the latest)
    and return its tensors as zero-copy views of that one lease, on the object's
    device, made when first looked up. The manifest comes from the memfd beside the
    lease, not from the object, and is parsed once per distinct manifest (the versions
    of one model share it). Tensors of dtypes PyTorch lacks come as uint8 bytes."""
    lease = store.get(name, timeout, version=version, shard=shard, newer_than=newer_than)
    return Bundle(lease, _layout_of(lease.manifest_bytes()))


class LoadMismatch(InvalidArgument):
    """load_into found parameters that the bundle lacks or that differ in dtype or
    shape; ``problems`` lists them all. Nothing was copied."""

    def __init__(self, problems: List[str]):
        self.problems = problems
        super().__init__("load", "", "%d parameter(s) do not match the bundle: %s" % (len(problems), "; ".join(problems)))


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What load_into copied: tensors, bytes, the wall time from the first copy to
    the stream's completion, the copy calls it took, and how it copied (``method``:
    "batch" = one cuMemcpyBatchAsync per destination GPU, "memcpy" = one
    cuMemcpyAsync per copy where the driver lacks the batch, "host" = memmove between
    host memory, "torch" = PyTorch copies, "+"-joined when several were used), and the
    copies the tensors came down to once adjacent ones were merged."""
    tensors: int
    nbytes: int
    seconds: float
    copy_calls: int
    unused: Tuple[str, ...]   # bundle tensors no parameter took
    method: str = ""
    copies: int = 0           # copies after merging adjacent ones (what the driver was given)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class _Group:
    """The copies of a plan between the bundle and the tensors of one device:
    ``off`` (byte offsets in the bundle), ``addr`` (the tensors' addresses) and
    ``size``, merged where both sides continue where the previous copy ended, none
    overlapping another on the tensors' side; ``serial`` holds the copies whose
    tensor ranges overlap (tied weights, views of one buffer), as (offset,
    address, size) in the tensors' order: loaded one by one after the batch, the
    last one wins, as with sequential copies."""

    def __init__(self, ordinal: Optional[int]):
        self.ordinal = ordinal   # None: host memory on both sides
        self.off: Any = None
        self.addr: Any = None
        self.size: Any = None
        self.serial: List[Tuple[int, int, int]] = []
        self.merged_from = 0

    def build(self, offs: List[int], dsts: List[int], sizes: List[int],
              alloc_bases: Optional[Any] = None) -> None:
        """``alloc_bases(addrs)`` gives the allocation each tensor address lies in: a
        copy must not span two allocations (CUDA refuses it even where they are
        adjacent), so copies merge only within one. None: host memory, where
        adjacent ranges of valid memory can be copied as one."""
        import numpy as np
        self.merged_from = len(sizes)
        off = np.array(offs, dtype=np.uint64)
        dst = np.array(dsts, dtype=np.uint64)
        size = np.array(sizes, dtype=np.uint64)
        if len(size) > 1:
            # A batch has no order: overlapping tensor ranges go to serial.
            order = np.argsort(dst, kind="stable")
            d, e = dst[order], (dst + size)[order]
            reach = np.maximum.accumulate(e)
            fresh = np.concatenate(([True], d[1:] >= reach[:-1]))
            cluster = np.cumsum(fresh) - 1
            shared = np.bincount(cluster)[cluster] > 1
            if shared.any():
                lone = np.zeros(len(size), dtype=bool)
                lone[order[~shared]] = True
                pos = np.nonzero(~lone)[0]
                self.serial = list(zip(off[pos].tolist(), dst[pos].tolist(), size[pos].tolist()))
                off, dst, size = off[lone], dst[lone], size[lone]
        if len(size) > 1:
            # Merge runs that are adjacent on both sides (bundle order).
            order = np.argsort(off, kind="stable")
            off, dst, size = off[order], dst[order], size[order]
            cont = (off[:-1] + size[:-1] == off[1:]) & (dst[:-1] + size[:-1] == dst[1:])
            if alloc_bases is not None and cont.any():
                pairs = np.nonzero(cont)[0]
                both = np.unique(np.concatenate((pairs, pairs + 1)))
                base = np.zeros(len(size), dtype=np.uint64)
                base[both] = np.array(alloc_bases(dst[both].tolist()), dtype=np.uint64)
                cont[pairs] = base[pairs] == base[pairs + 1]
            starts = np.nonzero(np.concatenate(([True], ~cont)))[0]
            if len(starts) < len(size):
                size = np.add.reduceat(size, starts)
                off, dst = off[starts], dst[starts]
        self.off = np.ascontiguousarray(off)
        self.addr = np.ascontiguousarray(dst)
        self.size = np.ascontiguousarray(size)


_shape_dtype = operator.attrgetter("shape", "dtype")


def _signature(values: List[Any]) -> Tuple[List[int], List[Tuple[Any, Any]], List[bool]]:
    """Each tensor's address, (shape, dtype) and contiguity: what a cached plan
    depends on. Unbound torch.Tensor methods in map() are the cheapest way to read
    them (about 0.3 µs a read on the H200's host); this runs on every load."""
    import torch
    return (list(map(torch.Tensor.data_ptr, values)), list(map(_shape_dtype, values)),
            list(map(torch.Tensor.is_contiguous, values)))


class _Plan:
    """How one set of parameters loads from one layout: checked once, then reused
    for every version with that layout as long as each parameter keeps its address,
    shape, dtype and contiguity (checked on every call: four attribute reads per
    parameter, no view, no per-tensor copy call)."""

    def __init__(self, layout: _Layout, names: List[str], values: List[Any], gpu: bool,
                 sig: Optional[Tuple[List[int], List[Tuple[Any, Any]], List[bool]]] = None):
        self.layout = layout
        self.names = names
        self.gpu = gpu
        self.ptrs, self.meta, self.contig = sig if sig is not None else _signature(values)
        problems: List[str] = []
        index = layout.index
        types = layout.view_types()
        entries = layout.entries
        groups: Dict[Optional[int], Tuple[List[int], List[int], List[int]]] = {}
        self.torch_names: List[str] = []
        self.tensors = 0
        self.nbytes = 0
        for k, (name, p) in enumerate(zip(names, values)):
            i = index.get(name)
            if i is None:
                problems.append("%s: missing from the bundle" % name)
                continue
            dt, shape = types[i]
            pshape, pdt = self.meta[k]
            if dt != pdt:
                problems.append("%s: dtype %s in the bundle, %s in the parameter" % (name, dt, pdt))
                continue
            if tuple(pshape) != shape:
                problems.append("%s: shape %s in the bundle, %s in the parameter" % (name, shape, tuple(pshape)))
                continue
            e = entries[i]
            n = e.end - e.begin
            self.tensors += 1
            self.nbytes += n
            dev = p.device
            direct = self.contig[k] and ((gpu and dev.type == "cuda") or (not gpu and dev.type == "cpu"))
            if not direct:
                self.torch_names.append(name)
            elif n:
                g = groups.setdefault(dev.index if gpu else None, ([], [], []))
                g[0].append(e.begin)
                g[1].append(self.ptrs[k])
                g[2].append(n)
        if problems:
            raise LoadMismatch(problems)
        self.groups = []
        for ordinal, (offs, dsts, sizes) in groups.items():
            g = _Group(ordinal)
            g.build(offs, dsts, sizes, _gpu_alloc_bases(ordinal) if ordinal is not None else None)
            self.groups.append(g)
        self.copies = sum(len(g.size) + len(g.serial) for g in self.groups) + len(self.torch_names)
        self._unused: Optional[Tuple[str, ...]] = None
        self._params: Any = None

    @property
    def unused(self) -> Tuple[str, ...]:
        if self._unused is None:
            self._unused = tuple(sorted(set(self.layout.names) - set(self.names)))
        return self._unused

    def matches(self, names: List[str], sig: Tuple[List[int], List[Tuple[Any, Any]], List[bool]]) -> bool:
        return names == self.names and sig[0] == self.ptrs and sig[1] == self.meta and sig[2] == self.contig

    def run(self, base: int, view_of: Any, tensors: Mapping[str, Any], stream: Any, load: bool) -> Tuple[int, str]:
        """Copy between the bundle at address ``base`` and the tensors: into them
        (``load``) or from them. ``view_of(name)`` gives a tensor view of a bundle
        entry, for the copies PyTorch makes."""
        import numpy as np
        b = np.uint64(base)
        calls = 0
        methods: List[str] = []
        for g in self.groups:
            side = g.off + b
            dsts, srcs = (g.addr, side) if load else (side, g.addr)
            serial = [(a, base + o, n) if load else (base + o, a, n) for o, a, n in g.serial]
            if g.ordinal is None:
                for d, s_, n in zip(dsts.tolist(), srcs.tolist(), g.size.tolist()):
                    ctypes.memmove(d, s_, n)
                for d, s_, n in serial:
                    ctypes.memmove(d, s_, n)
                calls += len(g.size) + len(serial)
                methods.append("host")
                continue
            from . import _cuda
            c, m = _cuda.copy_batch(g.ordinal, _stream_handle(stream, g.ordinal), dsts, srcs, g.size, serial)
            calls += c
            methods.append(m)
        if self.torch_names:
            groups: Dict[Tuple[Any, Any], Tuple[List[Any], List[Any]]] = {}
            for name in self.torch_names:
                t, v = tensors[name], view_of(name)
                if load:
                    d, s_ = t.data if hasattr(t, "data") else t, v
                else:
                    d, s_ = v, t.detach()
                ds, ss = groups.setdefault((d.device, s_.device), ([], []))
                ds.append(d)
                ss.append(s_)
            for (dev, _), (ds, ss) in groups.items():
                calls += _copy(ds, ss, dev, stream)
            methods.append("torch")
        return calls, "+".join(dict.fromkeys(methods))


def _gpu_alloc_bases(ordinal: int) -> Any:
    def bases(addrs: List[int]) -> List[int]:
        from . import _cuda
        return _cuda.allocation_bases(ordinal, addrs)
    return bases


def _stream_handle(stream: Any, ordinal: int) -> int:
    if stream is None:
        import torch
        return int(torch.cuda.current_stream(ordinal).cuda_stream)
    return int(getattr(stream, "cuda_stream", stream))


_PLANS: "OrderedDict[Tuple[int, bool, int], _Plan]" = OrderedDict()   # (id(layout), gpu, id(plan))
_MAX_PLANS = 8
_plan_lock = threading.Lock()
plan_stats = {"built": 0, "reused": 0}
"""How often load_into built a copy plan and reused one (for tests and benchmarks)."""


def _plan_for(layout: _Layout, names: List[str], values: List[Any], gpu: bool, fresh: bool = False,
              sig: Any = None) -> _Plan:
    if sig is None:
        sig = _signature(values)
    with _plan_lock:
        cands = [p for k, p in _PLANS.items() if k[0] == id(layout) and k[1] == gpu and p.layout is layout]
        if fresh:   # drop what matches: it failed
            for k in [k for k, p in _PLANS.items() if p in cands and p.matches(names, sig)]:
                del _PLANS[k]
            cands = []
    for p in reversed(cands):
        if p.matches(names, sig):
            plan_stats["reused"] += 1
            return p
    p = _Plan(layout, names, values, gpu, sig)
    plan_stats["built"] += 1
    with _plan_lock:
        _PLANS[(id(layout), gpu, id(p))] = p
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    return p


def _run_plan(layout: _Layout, names: List[str], values: List[Any], gpu: bool, base: int, view_of: Any,
              tensors: Mapping[str, Any], stream: Any, load: bool, sig: Any = None) -> Tuple[_Plan, int, str, float]:
    """Find or build the plan and run it. A cached plan whose copies the driver
    refuses (its tensors were freed and others allocated at the same addresses in
    other CUDA allocations, so a merged copy now spans two) is built afresh once."""
    from .errors import CudaError
    built = plan_stats["built"]
    plan = _plan_for(layout, names, values, gpu, sig=sig)
    t0 = time.perf_counter()
    try:
        calls, method = plan.run(base, view_of, tensors, stream, load)
    except CudaError:
        if plan_stats["built"] != built:
            raise
        plan = _plan_for(layout, names, values, gpu, fresh=True)
        t0 = time.perf_counter()
        calls, method = plan.run(base, view_of, tensors, stream, load)
    return plan, calls, method, time.perf_counter() - t0


def load_into(bundle: Bundle, params: Mapping[str, Any], *, stream: Any = None) -> LoadReport:
    """Copy every bundle tensor named in ``params`` into that (engine-owned) tensor,
    bit for bit, and wait for the copies.

    Every mismatch (a parameter the bundle lacks, a dtype or shape that differs) is
    reported at once, by LoadMismatch, before any copy. The copies come from the
    manifest's offsets and the parameters' addresses, without a view per tensor:
    for a GPU bundle and contiguous CUDA parameters, one ``cuMemcpyBatchAsync`` per
    destination GPU (copies adjacent on both sides merged) on ``stream`` (default: the
    current stream of the parameters' device), where the driver lacks it one
    ``cuMemcpyAsync`` per copy; for a host bundle and contiguous CPU parameters, a
    memmove per copy; otherwise (non-contiguous parameters, host <-> GPU) PyTorch
    copies. The producer's writes are complete before its seal, so the copies are
    ordered after them. The plan (arrays of offsets, addresses and sizes) is kept:
    the next version with the same manifest and the same parameters (same addresses,
    shapes, dtypes) costs a check of the parameters, one add and one driver call."""
    names = list(params)
    values = list(params.values())
    layout = bundle._layout
    if layout is None:   # released: an empty bundle
        if names:
            raise LoadMismatch(["%s: missing from the bundle" % n for n in names])
        return LoadReport(0, 0, 0.0, 0, (), "")
    mem = bundle.lease._live()
    plan, calls, method, seconds = _run_plan(layout, names, values, mem.is_gpu, mem.addr, bundle.__getitem__,
                                             params, stream, load=True)
    return LoadReport(plan.tensors, plan.nbytes, seconds, calls, plan.unused, method, plan.copies)
