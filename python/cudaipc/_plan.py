"""Bundle copy plans (load_into, put_bundle): which bytes of a bundle go to which
tensor, as arrays of offsets, addresses and sizes per device, merged where both
sides are adjacent, checked once and reused for every version of the same layout
with the same tensors."""

from __future__ import annotations

import ctypes
import dataclasses
import operator
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from . import _cuda
from . import _cuda_ctypes
from . import _gcpause
from ._arrays import ArrayLib, Signature
from ._deps import require
from ._manifest import Layout
from .errors import CudaError, InvalidArgument

_device_of = operator.attrgetter("device")

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
    host memory, "torch" = PyTorch copies, "numpy" = NumPy/CuPy copies (parameters
    not contiguous, or across host and GPU), "+"-joined when several were used), and the
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


class Group:
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
        np = require("numpy", "bundle copies")
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


class Plan:
    """How one set of parameters loads from one layout: checked once, then reused
    for every version with that layout as long as each parameter keeps its address,
    shape, dtype and contiguity (checked on every call by the library's Check: for
    PyTorch two C++ loops where it has them, else four attribute reads per
    parameter; no view, no per-tensor copy call)."""

    def __init__(self, layout: Layout, names: List[str], values: List[Any], gpu: bool,
                 lib: ArrayLib, sig: Optional[Signature] = None):
        self.layout = layout
        self.names = names
        self.gpu = gpu
        self.lib = lib   # the parameters' array library
        self.ptrs, self.meta, self.contig = sig if sig is not None else lib.signature(values)
        problems: List[str] = []
        index = layout.index
        types = layout.view_types(lib)
        entries = layout.entries
        groups: Dict[Optional[int], Tuple[List[int], List[int], List[int]]] = {}
        self.lib_names: List[str] = []   # copied by the library (not contiguous, or across host and GPU)
        self.tensors = 0
        self.nbytes = 0
        uniform, key = self._uniform(layout, names, values, gpu, lib, types)
        if uniform:
            # Every parameter matches its entry in the layout's own order, contiguous,
            # on one device: the per-parameter checks below, made on whole lists.
            sizes = [e.end - e.begin for e in entries]
            self.tensors, self.nbytes = len(entries), sum(sizes)
            keep = [k for k, n in enumerate(sizes) if n]
            if keep:
                groups[key] = ([entries[k].begin for k in keep], [self.ptrs[k] for k in keep], [sizes[k] for k in keep])
            names = []
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
            kind, ordinal = lib.where(p)
            direct = self.contig[k] and ((gpu and kind == "cuda") or (not gpu and kind == "cpu"))
            if not direct:
                self.lib_names.append(name)
            elif n:
                g = groups.setdefault(ordinal if gpu else None, ([], [], []))
                g[0].append(e.begin)
                g[1].append(self.ptrs[k])
                g[2].append(n)
        if problems:
            raise LoadMismatch(problems)
        self.groups: List[Group] = []
        for ordinal, (offs, dsts, sizes) in groups.items():
            grp = Group(ordinal)
            grp.build(offs, dsts, sizes, _gpu_alloc_bases(ordinal) if ordinal is not None else None)
            self.groups.append(grp)
        self.copies = sum(len(grp.size) + len(grp.serial) for grp in self.groups) + len(self.lib_names)
        self._unused: Optional[Tuple[str, ...]] = None
        self._params: Any = None
        self._check = lib.check(values, (self.ptrs, self.meta, self.contig))

    def _uniform(self, layout: Layout, names: List[str], values: List[Any], gpu: bool, lib: ArrayLib,
                 types: List[Tuple[Any, Tuple[int, ...]]]) -> Tuple[bool, Optional[int]]:
        """(True, the group's key: the GPU ordinal, None for host memory) when the
        parameters are the layout's tensors in its order, each of its dtype and shape,
        contiguous and all on one device of the bundle's kind (PyTorch tensors);
        (False, None) otherwise."""
        if lib.name != "torch" or names != layout.names or not all(self.contig):
            return False, None
        if self.meta != [(shape, dt) for dt, shape in types]:
            return False, None
        devices = set(map(_device_of, values))
        if len(devices) != 1:
            return False, None
        d = devices.pop()
        if gpu and d.type == "cuda":
            return True, d.index
        return (not gpu and d.type == "cpu"), None

    @property
    def unused(self) -> Tuple[str, ...]:
        if self._unused is None:
            self._unused = tuple(sorted(set(self.layout.names) - set(self.names)))
        return self._unused

    def matches(self, names: List[str], sig: Signature, lib: ArrayLib) -> bool:
        return lib is self.lib and names == self.names and sig[0] == self.ptrs and sig[1] == self.meta and sig[2] == self.contig

    def fits(self, names: List[str], values: List[Any], lib: ArrayLib) -> bool:
        """matches(names, lib.signature(values), lib), without making the signature."""
        return lib is self.lib and names == self.names and self._check.fits(values)

    def run(self, base: Any, view_of: Any, tensors: Mapping[str, Any], stream: Any, load: bool,
            base_ordinal: Optional[int] = None) -> Tuple[int, str]:
        """Copy between the bundle at address ``base`` and the tensors: into them
        (``load``) or from them. ``base`` is the bundle's address, or for a version
        published without a copy its regions (``base.addresses(off, size)``);
        ``base_ordinal`` the GPU whose context maps it (None: unknown). A group of
        tensors on that same GPU may be copied by the gather kernel (its loads and
        stores reach memory that context maps; another GPU's it may not).
        ``view_of(name)`` gives a view of a bundle entry in the parameters' library,
        for the copies it makes."""
        np = require("numpy", "bundle copies")
        if isinstance(base, int):
            b = np.uint64(base)

            def at(off: Any, size: Any) -> Any:
                return off + b
        else:
            at = base.addresses
        calls = 0
        methods: List[str] = []
        for g in self.groups:
            side = at(g.off, g.size)
            dsts, srcs = (g.addr, side) if load else (side, g.addr)
            serial = g.serial
            if serial:
                so = at(np.array([o for o, _, _ in serial], dtype=np.uint64),
                        np.array([n for _, _, n in serial], dtype=np.uint64)).tolist()
                serial = [(a, s_, n) if load else (s_, a, n) for (_, a, n), s_ in zip(g.serial, so)]
            if g.ordinal is None:
                for d, s_, n in zip(dsts.tolist(), srcs.tolist(), g.size.tolist()):
                    ctypes.memmove(d, s_, n)
                for d, s_, n in serial:
                    ctypes.memmove(d, s_, n)
                calls += len(g.size) + len(serial)
                methods.append("host")
                continue
            c, m = _cuda_ctypes.copy_batch(g.ordinal, self.lib.stream_handle(stream, g.ordinal), dsts, srcs, g.size, serial,
                                           kernel=base_ordinal is not None and base_ordinal == g.ordinal,
                                           arena=isinstance(base, int))
            calls += c
            methods.append(m)
        if self.lib_names:
            ds, ss = [], []
            for name in self.lib_names:
                t, v = tensors[name], view_of(name)
                d, s_ = (self.lib.dest(t), v) if load else (v, t)
                ds.append(d)
                ss.append(s_)
            calls += self.lib.copy(ds, ss, stream)
            methods.append(self.lib.name)
        return calls, "+".join(dict.fromkeys(methods))


def _gpu_alloc_bases(ordinal: int) -> Any:
    def bases(addrs: List[int]) -> List[int]:
        return _cuda.allocation_bases(ordinal, addrs)
    return bases


_PLANS: List[Plan] = []   # the plans built last, oldest first
_MAX_PLANS = 8
_plan_lock = threading.Lock()
plan_stats = {"built": 0, "reused": 0}
"""How often load_into built a copy plan and reused one (for tests and benchmarks)."""


def plan_for(layout: Layout, names: List[str], values: List[Any], gpu: bool, lib: ArrayLib,
             fresh: bool = False, sig: Optional[Signature] = None) -> Plan:
    if sig is None and fresh:
        sig = lib.signature(values)
    with _plan_lock:
        cands = [p for p in _PLANS if p.layout is layout and p.gpu == gpu]
        if fresh:   # drop what matches: it failed
            assert sig is not None
            for p in [p for p in cands if p.matches(names, sig, lib)]:
                _PLANS.remove(p)
            cands = []
    for p in reversed(cands):
        if p.matches(names, sig, lib) if sig is not None else p.fits(names, values, lib):
            plan_stats["reused"] += 1
            return p
    if sig is None:
        sig = lib.signature(values)
    with _gcpause.paused():
        p = Plan(layout, names, values, gpu, lib, sig)
    plan_stats["built"] += 1
    with _plan_lock:
        _PLANS.append(p)
        del _PLANS[:-_MAX_PLANS]
    return p


def run_plan(layout: Layout, names: List[str], values: List[Any], gpu: bool, base: Any, view_of: Any,
             tensors: Mapping[str, Any], stream: Any, load: bool, lib: ArrayLib,
             sig: Optional[Signature] = None, base_ordinal: Optional[int] = None) -> Tuple[Plan, int, str, float]:
    """Find or build the plan and run it (Plan.run says what ``base`` and
    ``base_ordinal`` are). A cached plan whose copies the driver
    refuses (its tensors were freed and others allocated at the same addresses in
    other CUDA allocations, so a merged copy now spans two) is built afresh once."""
    built = plan_stats["built"]
    plan = plan_for(layout, names, values, gpu, lib, sig=sig)
    t0 = time.perf_counter()
    try:
        calls, method = plan.run(base, view_of, tensors, stream, load, base_ordinal)
    except CudaError:
        if plan_stats["built"] != built:
            raise
        plan = plan_for(layout, names, values, gpu, lib, fresh=True)
        t0 = time.perf_counter()
        calls, method = plan.run(base, view_of, tensors, stream, load, base_ordinal)
    return plan, calls, method, time.perf_counter() - t0
