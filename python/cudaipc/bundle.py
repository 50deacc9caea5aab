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

Without PyTorch, or with ``views="numpy"``, the same works on NumPy arrays (host
bundles) and CuPy arrays (GPU bundles): put_bundle and load_into take them, and
get_bundle and create_bundle hand them out. bfloat16 and float8 tensors, which NumPy
lacks, come as ml_dtypes' types where ml_dtypes is installed, else as uint8 bytes;
tensors of any other dtype the array library lacks come as uint8 bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import KeysView
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ._arrays import ARRAYS, TORCH, ArrayLib, of_values, pick, refuse_values
from ._manifest import (ALIGNMENT, BITS, FROM_SAFETENSORS, TO_SAFETENSORS, Layout, TensorEntry,
                        encode_manifest, layout, layout_of, parse_manifest, put_layout, st_dtype_of)
from ._plan import LoadMismatch, LoadReport, plan_stats, run_plan
from . import _gather
from .errors import InvalidArgument
from .lease import view_owner

__all__ = ["ALIGNMENT", "Bundle", "BundleWriter", "create_bundle", "LoadReport", "LoadMismatch", "TensorEntry", "layout",
           "encode_manifest", "parse_manifest", "put_bundle", "publish_no_copy", "get_bundle", "load_into"]

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
               stream: Any = None, copy: bool = True, release_timeout: Optional[float] = 60.0,
               cluster: bool = False) -> BundleInfo:
    """Store the tensors of ``state_dict`` (torch tensors, CPU or CUDA; or NumPy and
    CuPy arrays; string keys) as one bundle. Any other value or key is a TypeError
    naming it.

    ``copy=False`` (with ``publish``) is the older spelling of
    :func:`publish_no_copy`, which it calls: the version points into the tensors
    themselves.

    ``device`` defaults to where the first CUDA tensor is (else host memory). The
    copies go as :func:`load_into`'s do, the other way: for contiguous CUDA tensors
    and a GPU object, one ``cuMemcpyBatchAsync`` per source GPU on ``stream``
    (default: the current stream of the tensors' device), after the work already
    queued there; memmove between host memory; PyTorch (or NumPy/CuPy) copies
    otherwise. The stream
    is synchronized before the seal. The manifest and the copy plan are kept: the
    next put of tensors with the same names, dtypes and shapes (at the same
    addresses) encodes nothing again. With ``publish`` the bundle is the next
    version of ``name`` (shard ``shard`` of ``shards``: see Store.publish).
    ``cluster`` makes it cluster-visible (``Store.create``; not with ``copy=False``)."""
    if not copy:
        if cluster:
            raise InvalidArgument("put_bundle", name, "copy=False versions stay on this node: put with copy=True for cluster=True")
        if not publish or shards > 1:
            raise InvalidArgument("put_bundle", name, "copy=False publishes a version: set publish=True (one shard)")
        return publish_no_copy(store, name, state_dict, keep_last=keep_last, shared=shared, metadata=metadata,
                               stream=stream, release_timeout=release_timeout)
    names = list(state_dict)
    values = list(state_dict.values())
    try:
        lib = of_values(values, TORCH)
        sig = lib.signature(values)
    except Exception:
        refuse_values("put_bundle", name, names, values)   # a value it cannot store, named
        raise
    lay = put_layout(names, sig[1], metadata)
    if device is None:
        cuda = next((w[1] for w in map(lib.where, values) if w[0] == "cuda"), None)
        device = cuda if cuda is not None else "host"
    obj = store.create(name, max(lay.size, 1), device, shared=shared, versioned=publish, shards=shards,
                       shard=shard, keep_last=keep_last, manifest=lay.raw, cluster=cluster)
    if obj.ordinal is not None:
        _gather.ready(obj.ordinal)   # (its load starts now, beside the plan)
    try:
        views: Dict[str, Any] = {}

        def view_of(n: str) -> Any:
            if not views:
                views.update(lib.views(lib.whole(obj), lay.entries))
            return views[n]

        run_plan(lay, names, values, obj.ordinal is not None, obj.data_ptr, view_of, state_dict, stream,
                 load=False, lib=lib, sig=sig, base_ordinal=obj.ordinal)
    except BaseException:
        obj.abort()
        raise
    obj.seal()
    return BundleInfo(name, obj.version, lay.size, len(lay.entries), obj.device)


def publish_no_copy(store: Any, name: str, state_dict: Mapping[str, Any], **kw: Any) -> BundleInfo:
    """``store.publish_no_copy(name, state_dict, ...)``: the next version of the
    bundle ``name`` as the tensors' own memory, copying nothing (see
    :meth:`cudaipc.Store.publish_no_copy`; Go: PublishNoCopy)."""
    return store.publish_no_copy(name, state_dict, **kw)  # type: ignore[no-any-return]


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
        return int(self.obj.version)

    def seal(self) -> None:
        """Publish: the views must not be used afterwards."""
        self.tensors = {}
        self.obj.seal()

    def abort(self) -> None:
        self.tensors = {}
        self.obj.abort()


def create_bundle(store: Any, name: str, specs: Mapping[str, Tuple[Any, Sequence[int]]], device: Any = None, *,
                  publish: bool = False, shards: int = 0, shard: int = 0, keep_last: int = 0,
                  shared: bool = False, metadata: Optional[Mapping[str, str]] = None,
                  views: str = "auto", cluster: bool = False) -> BundleWriter:
    """Create a bundle of tensors given as {name: (dtype, shape)} (a torch dtype, a
    NumPy dtype or a name such as "bfloat16") and return writable views of them in
    the new object, to be filled in place and sealed: torch tensors, or with
    ``views="numpy"`` (the default without PyTorch) NumPy arrays of a host bundle and
    CuPy arrays of a GPU one. ``cluster`` makes it cluster-visible (``Store.create``)."""
    lib = pick(views)
    items = [(k, st_dtype_of(dt, "create"), tuple(int(d) for d in shape)) for k, (dt, shape) in specs.items()]
    entries, size = layout(items)
    obj = store.create(name, max(size, 1), device, shared=shared, versioned=publish, shards=shards,
                       shard=shard, keep_last=keep_last, manifest=encode_manifest(entries, metadata),
                       cluster=cluster)
    try:
        made = lib.views(lib.whole(obj), entries)
    except BaseException:
        obj.abort()
        raise
    return BundleWriter(obj, entries, made)


class Bundle(dict):
    """Zero-copy tensors of one bundle lease, by name (a dict of torch.Tensor, or of
    NumPy/CuPy arrays: ``views``). The lease lasts while the Bundle or any of its
    tensors is alive; ``release()`` gives up the Bundle's own hold.

    The views are made when first looked up (all of them by ``values()``, ``items()``
    and the like): a consumer that only passes the Bundle to :func:`load_into` never
    pays for one view per tensor."""

    def __init__(self, lease: Any, layout: Layout, lib: ArrayLib = TORCH):
        super().__init__()
        self.lease = lease
        self._lib = lib
        self.metadata: Dict[str, str] = dict(layout.metadata)
        self._layout: Optional[Layout] = layout
        self._full = False                     # every view made: the dict itself is the truth
        self._base: Any = None                 # uint8 view of the whole object
        self._by_dtype: Dict[Any, Any] = {}

    @property
    def version(self) -> int:
        return int(self.lease.version)

    @property
    def views(self) -> str:
        """What the tensors are: "torch", or "numpy" (NumPy arrays of a host bundle,
        CuPy arrays of a GPU one)."""
        return self._lib.name

    @property
    def entries(self) -> List[TensorEntry]:
        """The manifest's tensors, in offset order."""
        return list(self._layout.entries) if self._layout is not None else []

    @property
    def nbytes(self) -> int:
        return self._layout.nbytes if self._layout is not None else 0

    def _view(self, i: int) -> Any:
        lay = self._layout
        assert lay is not None
        src = getattr(self.lease, "sources", None)
        if src is not None:   # a version without a copy: a view in the region the entry lies in
            region, e = src.view(view_owner(self.lease), lay.entries[i])
            return self._lib.entry_view(self._lib.whole(region), {}, e)
        if self._base is None:
            self._base = self._lib.whole(self.lease)
        return self._lib.entry_view(self._base, self._by_dtype, lay.entries[i])

    def _view_in(self, lib: ArrayLib) -> Any:
        """``view_of(name)`` in array library ``lib`` (load_into's copies by the
        parameters' library): this Bundle's own views where it is the same."""
        if lib is self._lib or getattr(self.lease, "sources", None) is not None:
            return self.__getitem__
        lay = self._layout
        assert lay is not None
        entries, index = lay.entries, lay.index
        base: List[Any] = []
        by_dtype: Dict[Any, Any] = {}

        def view_of(name: str) -> Any:
            if not base:
                base.append(lib.whole(self.lease))
            return lib.entry_view(base[0], by_dtype, entries[index[name]])
        return view_of

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
               shard: int = 0, newer_than: int = 0, wait: bool = False, views: str = "auto",
               tensors: Optional[Sequence[str]] = None) -> Bundle:
    """Lease a bundle (``version``, or the latest above ``newer_than``, or the latest;
    waiting as :meth:`Store.get` does: with ``timeout``, ``wait`` or ``newer_than``)
    and return its tensors as zero-copy views of that one lease, on the object's
    device, made when first looked up. The manifest comes from the memfd beside the
    lease, not from the object, and is parsed once per distinct manifest (the versions
    of one model share it). Tensors of dtypes PyTorch lacks come as uint8 bytes.

    ``views``: "torch", "numpy" (NumPy arrays of a host bundle, CuPy arrays of a GPU
    one; bfloat16 and float8 as ml_dtypes' types where it is installed, else as uint8
    bytes), or "auto"
    (PyTorch where it can be imported, else "numpy").

    ``tensors``: the names of the tensors wanted; the bundle then holds only those
    (iteration, ``load_into``, ``nbytes``). Where the daemon holds the whole bundle
    they are views of its lease; a daemon of a cluster that does not reads only those
    tensors from another node into a partial replica of its own and leases that
    (``bundle.lease.info.partial``; docs/cluster.md, "Partial reads"): the same
    tensors, bytes and views either way. A name the bundle lacks, or given twice,
    raises InvalidArgument naming it (no lease is kept)."""
    lib = pick(views)
    if isinstance(tensors, str):
        raise TypeError("tensors is a list of tensor names, not one name: tensors=[%r]" % tensors)
    if tensors is None:
        lease = store.get(name, timeout, version=version, shard=shard, newer_than=newer_than, wait=wait)
    else:
        names = [str(n) for n in tensors]
        seen = set()
        for n in names:
            if not n:
                raise InvalidArgument("get", name, "an empty tensor name")
            if n in seen:
                raise InvalidArgument("get", name, "tensor %r is named twice" % n)
            seen.add(n)
        lease = store.get(name, timeout, version=version, shard=shard, newer_than=newer_than, wait=wait, tensors=names)
    if lease.ordinal is not None:
        _gather.ready(lease.ordinal)   # (its load starts now, beside the parse and the plan)
    try:
        lay = layout_of(lease.manifest_bytes())
        if tensors is not None:
            lay = _subset(lay, name, list(tensors))
    except BaseException:
        lease.release()
        raise
    return Bundle(lease, lay, lib)


def _subset(lay: Layout, name: str, names: List[str]) -> Layout:
    """A layout of ``lay``'s entries named in ``names`` (in ``lay``'s order, by
    offset), with its metadata; an unknown or repeated name is InvalidArgument."""
    want = set()
    for n in names:
        if n in want:
            raise InvalidArgument("get", name, "tensor %r is named twice" % n)
        if n not in lay.index:
            raise InvalidArgument("get", name, "the bundle has no tensor %r" % n)
        want.add(n)
    entries = [e for e in lay.entries if e.name in want]
    # Not cached by raw bytes (layout_of's cache): raw is the whole bundle's.
    return Layout(lay.raw, (entries, dict(lay.metadata)))


def load_into(bundle: Bundle, params: Mapping[str, Any], *, stream: Any = None) -> LoadReport:
    """Copy every bundle tensor named in ``params`` into that (engine-owned) tensor,
    bit for bit, and wait for the copies. ``params`` holds torch tensors, or NumPy
    and CuPy arrays (a CuPy ``stream`` then, or CuPy's current one).

    Every mismatch (a parameter the bundle lacks, a dtype or shape that differs) is
    reported at once, by LoadMismatch, before any copy. The copies come from the
    manifest's offsets and the parameters' addresses, without a view per tensor:
    for a GPU bundle and contiguous CUDA parameters, one ``cuMemcpyBatchAsync`` per
    destination GPU (copies adjacent on both sides merged) on ``stream`` (default: the
    current stream of the parameters' device), where the driver lacks it one
    ``cuMemcpyAsync`` per copy; for a host bundle and contiguous CPU parameters, a
    memmove per copy; otherwise (non-contiguous parameters, host <-> GPU) PyTorch
    (or NumPy/CuPy) copies. The producer's writes are complete before its seal, so the copies are
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
    lease = bundle.lease
    lib = of_values(values, bundle._lib)
    src = getattr(lease, "sources", None)   # a version without a copy: its regions' addresses
    plan, calls, method, seconds = run_plan(layout, names, values, lease.ordinal is not None,
                                            src if src is not None else lease.data_ptr,
                                            bundle._view_in(lib), params, stream, load=True, lib=lib,
                                            base_ordinal=lease.ordinal)
    return LoadReport(plan.tensors, plan.nbytes, seconds, calls, plan.unused, method, plan.copies)
