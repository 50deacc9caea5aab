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

import dataclasses
import json
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

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


def _st_dtype(t: Any) -> str:
    name = str(t.dtype).replace("torch.", "")
    st = TO_SAFETENSORS.get(name)
    if st is None:
        raise InvalidArgument("put", "", "dtype %s has no safetensors name" % name)
    return st


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

    ``device`` defaults to where the first tensor is. The copies run on ``stream``
    (default: the current stream of the tensors' device), after the work already
    queued there, as one multi-tensor copy where PyTorch has it (``_foreach_copy_``),
    else one copy per tensor; the stream is synchronized before the seal. With
    ``publish`` the bundle is the next version of ``name`` (shard ``shard`` of
    ``shards``: see Store.publish)."""
    import torch
    items = [(k, v.detach()) for k, v in state_dict.items()]
    specs = [(k, _st_dtype(v), tuple(v.shape)) for k, v in items]
    entries, size = layout(specs)
    if device is None:
        cuda = next((v.device for _, v in items if v.is_cuda), None)
        device = cuda.index if cuda is not None else "host"
    obj = store.create(name, max(size, 1), device, shared=shared, versioned=publish, shards=shards,
                       shard=shard, keep_last=keep_last, manifest=encode_manifest(entries, metadata))
    try:
        base = obj.tensor()  # uint8, the whole object, on its device
        views = _views_of(base, entries)
        dsts, srcs = [], []
        for e, (_, v) in zip(entries, items):
            if e.nbytes:
                dsts.append(views[e.name])
                srcs.append(v)
        _copy(dsts, srcs, base.device, stream)
    except BaseException:
        obj.abort()
        raise
    obj.seal()
    return BundleInfo(name, obj.version, size, len(entries), obj.device)


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
    items = [(k, _st_dtype_of(dt), tuple(int(d) for d in shape)) for k, (dt, shape) in specs.items()]
    entries, size = layout(items)
    obj = store.create(name, max(size, 1), device, shared=shared, versioned=publish, shards=shards,
                       shard=shard, keep_last=keep_last, manifest=encode_manifest(entries, metadata))
    try:
        views = _views_of(obj.tensor(), entries)
    except BaseException:
        obj.abort()
        raise
    return BundleWriter(obj, entries, views)


def _st_dtype_of(dt: Any) -> str:
    name = str(dt).replace("torch.", "")
    st = TO_SAFETENSORS.get(name)
    if st is None:
        raise InvalidArgument("create", "", "dtype %s has no safetensors name" % name)
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


class Bundle(dict):
    """Zero-copy tensors of one bundle lease, by name (a dict of torch.Tensor). The
    lease lasts while the Bundle or any of its tensors is alive; ``release()`` gives up
    the Bundle's own hold."""

    def __init__(self, lease: Any, entries: List[TensorEntry], metadata: Dict[str, str], tensors: Dict[str, Any]):
        super().__init__(tensors)
        self.lease = lease
        self.entries = entries
        self.metadata = metadata

    @property
    def version(self) -> int:
        return self.lease.version

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def release(self) -> None:
        self.clear()
        self.lease.release()

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def get_bundle(store: Any, name: str, timeout: Optional[float] = None, *, version: int = 0,
               shard: int = 0, newer_than: int = 0) -> Bundle:
    """Lease a bundle (``version``, or the latest above ``newer_than``, or the latest)
    and return its tensors as zero-copy views of that one lease, on the object's
    device. The manifest comes from the memfd beside the lease, not from the object.
    Tensors of dtypes PyTorch lacks come as uint8 bytes."""
    lease = store.get(name, timeout, version=version, shard=shard, newer_than=newer_than)
    entries, meta = parse_manifest(lease.manifest_bytes())
    return Bundle(lease, entries, meta, _views_of(lease.tensor(), entries))


class LoadMismatch(InvalidArgument):
    """load_into found parameters that the bundle lacks or that differ in dtype or
    shape; ``problems`` lists them all. Nothing was copied."""

    def __init__(self, problems: List[str]):
        self.problems = problems
        super().__init__("load", "", "%d parameter(s) do not match the bundle: %s" % (len(problems), "; ".join(problems)))


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What load_into copied: tensors, bytes, the wall time from the first copy to
    the stream's completion, and the copy calls it took."""
    tensors: int
    nbytes: int
    seconds: float
    copy_calls: int
    unused: Tuple[str, ...]   # bundle tensors no parameter took

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def load_into(bundle: Bundle, params: Mapping[str, Any], *, stream: Any = None) -> LoadReport:
    """Copy every bundle tensor named in ``params`` into that (engine-owned) tensor,
    bit for bit, in few copy calls (one copy_ per tensor of 1 MiB or more, one
    ``_foreach_copy_`` for the smaller ones of each device pair where PyTorch has it), on ``stream`` (default: the current stream of the parameters'
    device), and wait for it. The producer's writes are complete before its seal, so
    the copies are ordered after them. Every mismatch (a parameter the bundle lacks, a
    dtype or shape that differs) is reported at once, by LoadMismatch, before any copy."""
    problems: List[str] = []
    pairs: List[Tuple[Any, Any]] = []
    for name, p in params.items():
        src = bundle.get(name)
        if src is None:
            problems.append("%s: missing from the bundle" % name)
            continue
        if src.dtype != p.dtype:
            problems.append("%s: dtype %s in the bundle, %s in the parameter" % (name, src.dtype, p.dtype))
        elif src.shape != p.shape:
            problems.append("%s: shape %s in the bundle, %s in the parameter" % (name, tuple(src.shape), tuple(p.shape)))
        else:
            pairs.append((p, src))
    if problems:
        raise LoadMismatch(problems)
    unused = tuple(sorted(set(bundle) - set(params)))
    groups: Dict[Tuple[Any, Any], Tuple[List[Any], List[Any]]] = {}
    for p, src in pairs:
        d, s = groups.setdefault((p.device, src.device), ([], []))
        d.append(p.data if hasattr(p, "data") else p)
        s.append(src)
    t0 = time.perf_counter()
    calls = 0
    nbytes = 0
    for (dev, _), (dsts, srcs) in groups.items():
        calls += _copy(dsts, srcs, dev, stream)
        nbytes += sum(x.numel() * x.element_size() for x in srcs)
    return LoadReport(len(pairs), nbytes, time.perf_counter() - t0, calls, unused)
