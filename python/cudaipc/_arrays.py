"""The array libraries bundle tensors come in and are copied to: PyTorch (TORCH), or
NumPy for host memory and CuPy for GPU memory (ARRAYS), for programs without
PyTorch. Each says how to view a bundle entry, what a parameter's address, dtype,
shape and contiguity are (what a cached copy plan depends on), where it lives, and
how to copy bit for bit what the driver's batched copies do not take."""

from __future__ import annotations

import operator
import sys
from typing import Any, Dict, List, Optional, Tuple

from . import _gcpause
from ._deps import available, require
from ._manifest import FROM_SAFETENSORS, TensorEntry
from ._views import numpy_dtype

__all__ = ["ArrayLib", "TORCH", "ARRAYS", "pick", "of_values", "Signature", "Check", "FAST_CHECKS"]

Signature = Tuple[List[int], List[Tuple[Any, Any]], List[bool]]
"""Each value's address, (shape, dtype) and C contiguity."""


class ArrayLib:
    """One array library (see the module's documentation)."""

    name = ""

    def dtype(self, st: str) -> Any:
        """This library's dtype of a safetensors dtype name; None where it has none."""
        raise NotImplementedError

    def uint8(self) -> Any:
        raise NotImplementedError

    def whole(self, m: Any) -> Any:
        """A uint8 view of all of a Lease's or Object's bytes."""
        raise NotImplementedError

    def signature(self, values: List[Any]) -> Signature:
        raise NotImplementedError

    def same(self, values: List[Any], sig: Signature) -> bool:
        """Whether ``values`` have signature ``sig`` (what signature(values) == sig says)."""
        s = self.signature(values)
        return s[0] == sig[0] and s[1] == sig[1] and s[2] == sig[2]

    def check(self, values: List[Any], sig: Signature) -> "Check":
        """What tells, version after version, whether a list of values still has
        signature ``sig``, which ``values`` have now (the values the signature was
        made of, just made)."""
        return Check(self, sig)

    def where(self, v: Any) -> Tuple[str, Optional[int]]:
        """("cuda", ordinal), ("cpu", None), or ("other", None) for a value neither."""
        raise NotImplementedError

    def copy(self, dsts: List[Any], srcs: List[Any], stream: Any) -> int:
        """Copy srcs into dsts bit for bit, finished on return; the copy calls made."""
        raise NotImplementedError

    def dest(self, v: Any) -> Any:
        """What a copy into parameter v writes (a Parameter's data)."""
        return v

    def stream_handle(self, stream: Any, ordinal: int) -> int:
        """The raw CUstream of ``stream`` (None: this library's current stream of GPU
        ``ordinal``)."""
        raise NotImplementedError

    def entry_view(self, base: Any, by_dtype: Dict[Any, Any], e: TensorEntry) -> Any:
        """A view of entry e in ``base`` (a whole() view), in its dtype and shape; uint8
        bytes for a dtype this library lacks. ``by_dtype`` caches per-dtype views."""
        raise NotImplementedError

    def views(self, base: Any, entries: List[TensorEntry]) -> Dict[str, Any]:
        """entry_view of every entry, by name."""
        by_dtype: Dict[Any, Any] = {}
        return {e.name: self.entry_view(base, by_dtype, e) for e in entries}


class Check:
    """Whether a list of values still has a signature: ``fits(values)`` says what
    ``lib.same(values, sig)`` says. The check of every later version of a bundle (a
    cached copy plan's parameters, a no-copy publisher's tensors), so kept per
    signature: a library may hold something made once that answers faster."""

    def __init__(self, lib: "ArrayLib", sig: Signature):
        self.lib, self.sig = lib, sig

    def fits(self, values: List[Any]) -> bool:
        return self.lib.same(values, self.sig)


FAST_CHECKS = True
"""Whether PyTorch's own C++ checks answer Check.fits where this PyTorch has them
(tests and benchmarks turn it off to compare with the reads one by one)."""


class _TorchCheck(Check):
    """Check of torch tensors through two of PyTorch's C++ loops, with no Python
    object made per tensor: Dynamo's TensorGuards (type, dtype, device index,
    dispatch keys, requires_grad, sizes and strides equal to those recorded, every
    tensor a distinct object) and CUDA graphs' data-pointer check. Equal sizes and
    strides give equal contiguity, so a pass means what ``same`` means. A fail, or
    an error, asks ``same`` (reads one by one), which decides; where ``same`` then
    holds, the guards are made again from the values (a thread-local dispatch state
    that differs from the one they were made under, say)."""

    def __init__(self, lib: "ArrayLib", sig: Signature, values: List[Any], guards: Any, ptrs_equal: Any):
        super().__init__(lib, sig)
        self._make, self._ptrs_equal = guards, ptrs_equal
        self._ptrs = list(sig[0])
        self._idx = list(range(len(self._ptrs)))
        self._guards = guards(*values, dynamic_dims_sizes=None, dynamic_dims_strides=None)

    def quick(self, values: List[Any]) -> bool:
        """The C++ loops' answer alone (True: the signature holds; False: unknown)."""
        if len(values) != len(self._idx):
            return False
        try:
            return bool(self._guards.check(*values)) and bool(self._ptrs_equal(values, self._ptrs, self._idx))
        except Exception:  # noqa: BLE001 - any refusal (a value that is no tensor, ...): ask same()
            return False

    def fits(self, values: List[Any]) -> bool:
        if self.quick(values):
            return True
        if not self.lib.same(values, self.sig):
            return False
        try:
            self._guards = self._make(*values, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        except Exception:  # noqa: BLE001 - keep the old guards: same() decides every time
            pass
        return True


def _torch_fast_check() -> Tuple[Any, Any]:
    """(TensorGuards, _tensors_data_ptrs_at_indices_equal) of this PyTorch, or (None,
    None) where it lacks either (before 2.x, or built without CUDA)."""
    try:
        import torch
        guards = torch._C._dynamo.guards.TensorGuards
        ptrs_equal = torch._C._tensors_data_ptrs_at_indices_equal
    except (ImportError, AttributeError):
        return None, None
    return guards, ptrs_equal


_shape_dtype = operator.attrgetter("shape", "dtype")
_INT_OF_SIZE: Dict[int, Any] = {}
BIG = 1 << 20
"""Tensors of at least this many bytes are copied one by one (copy_: a DMA-speed
memcpy); smaller ones together (_foreach_copy_: few launches for many tensors)."""


def _torch_bits(t: Any) -> Any:
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


def _torch_copy(dsts: List[Any], srcs: List[Any], device: Any, stream: Any) -> int:
    """Copy srcs into dsts (all on one pair of devices), bit for bit, on stream."""
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
                small_d.append(_torch_bits(d))
                small_s.append(_torch_bits(x))
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


class _Torch(ArrayLib):
    name = "torch"

    def __init__(self) -> None:
        self._dtypes: Dict[str, Any] = {}

    def dtype(self, st: str) -> Any:
        dt = self._dtypes.get(st, False)
        if dt is False:
            torch = require("torch", "bundle tensors")
            name = FROM_SAFETENSORS.get(st)
            dt = self._dtypes[st] = getattr(torch, name, None) if name else None
        return dt

    def uint8(self) -> Any:
        return require("torch", "bundle tensors").uint8

    def whole(self, m: Any) -> Any:
        return m.tensor()   # (a bundle records no dtype: its bytes)

    def signature(self, values: List[Any]) -> Signature:
        # Unbound torch.Tensor methods in map() are the cheapest way to read them
        # (about 0.3 µs a read on the H200's host); this runs on every load.
        # The (shape, dtype) pairs are two tracked objects per value: tens of thousands
        # of them start collections, full ones too once they outnumber a quarter of
        # the heap, so the collector waits until they are made.
        torch = require("torch", "bundle tensors")
        with _gcpause.paused():
            return (list(map(torch.Tensor.data_ptr, values)), list(map(_shape_dtype, values)),
                    list(map(torch.Tensor.is_contiguous, values)))

    def same(self, values: List[Any], sig: Signature) -> bool:
        # The check of every later version: each (shape, dtype) pair is compared and
        # freed at once, so that no tracked object outlives its comparison (nothing
        # for the collector to scan), and the addresses and contiguity are lists of
        # untracked ints and bools.
        T = require("torch", "bundle tensors").Tensor
        ptrs, meta, contig = sig
        return (len(values) == len(ptrs) and list(map(T.data_ptr, values)) == ptrs
                and all(map(operator.eq, map(_shape_dtype, values), meta))
                and list(map(T.is_contiguous, values)) == contig)

    def check(self, values: List[Any], sig: Signature) -> Check:
        # The C++ checks want tensors of one kind of list, each a distinct object,
        # all of them held by pointers that fit an int64.
        guards, ptrs_equal = _torch_fast_check() if FAST_CHECKS else (None, None)
        if guards is None or not values or len(set(map(id, values))) != len(values) or max(sig[0]) >= 1 << 63:
            return Check(self, sig)
        try:
            with _gcpause.paused():
                c = _TorchCheck(self, sig, values, guards, ptrs_equal)
        except Exception:  # noqa: BLE001 - a PyTorch whose guards refuse these values
            return Check(self, sig)
        return c if c.quick(values) else Check(self, sig)

    def where(self, v: Any) -> Tuple[str, Optional[int]]:
        d = v.device
        if d.type == "cuda":
            return "cuda", d.index
        return ("cpu", None) if d.type == "cpu" else ("other", None)

    def dest(self, v: Any) -> Any:
        return v.data if hasattr(v, "data") else v

    def copy(self, dsts: List[Any], srcs: List[Any], stream: Any) -> int:
        groups: Dict[Tuple[Any, Any], Tuple[List[Any], List[Any]]] = {}
        for d, s in zip(dsts, srcs):
            s = s.detach()
            ds, ss = groups.setdefault((d.device, s.device), ([], []))
            ds.append(d)
            ss.append(s)
        calls = 0
        for (dev, _), (ds, ss) in groups.items():
            calls += _torch_copy(ds, ss, dev, stream)
        return calls

    def stream_handle(self, stream: Any, ordinal: int) -> int:
        if stream is None:
            import torch
            return int(torch.cuda.current_stream(ordinal).cuda_stream)
        return int(getattr(stream, "cuda_stream", stream))

    def entry_view(self, base: Any, by_dtype: Dict[Any, Any], e: TensorEntry) -> Any:
        import torch
        dt = self.dtype(e.dtype)
        if dt is None:
            return base[e.begin:e.end]
        v = by_dtype.get(dt)
        if v is None:
            item = torch.empty((), dtype=dt).element_size()
            v = by_dtype[dt] = (base[: base.numel() - base.numel() % item].view(dt), item)
        view, item = v
        strides, acc = [], 1
        for d in reversed(e.shape):
            strides.append(acc)
            acc *= max(d, 1)
        return torch.as_strided(view, e.shape, tuple(reversed(strides)), e.begin // item)


def _is_cupy(v: Any) -> bool:
    return type(v).__module__.startswith("cupy")


class _Arrays(ArrayLib):
    """NumPy arrays for host memory, CuPy arrays for GPU memory (dtypes are NumPy's,
    with bfloat16 and float8 from ml_dtypes where it is installed: see numpy_dtype)."""
    name = "numpy"

    def __init__(self) -> None:
        self._dtypes: Dict[str, Any] = {}

    def dtype(self, st: str) -> Any:
        dt = self._dtypes.get(st, False)
        if dt is False:
            require("numpy", "bundle arrays")
            name = FROM_SAFETENSORS.get(st)
            dt = self._dtypes[st] = numpy_dtype(name) if name else None
        return dt

    def uint8(self) -> Any:
        return require("numpy", "bundle arrays").dtype("uint8")

    def whole(self, m: Any) -> Any:
        if m.ordinal is None:
            require("numpy", "bundle arrays of host memory")
            return m.numpy("uint8", (m.size,))
        require("cupy", "bundle arrays of GPU memory without PyTorch")
        return m.cupy("uint8", (m.size,))

    def signature(self, values: List[Any]) -> Signature:
        nd = require("numpy", "bundle arrays").ndarray
        for v in values:
            if not (isinstance(v, nd) or _is_cupy(v)):
                raise TypeError("a bundle's values are all NumPy/CuPy arrays or all torch tensors, not %s "
                                "(a scalar goes as a 0-d array: numpy.asarray)" % type(v).__name__)
        with _gcpause.paused():
            ptrs = [v.data.ptr if _is_cupy(v) else v.__array_interface__["data"][0] for v in values]
            return ptrs, [(tuple(v.shape), v.dtype) for v in values], [bool(v.flags.c_contiguous) for v in values]

    def where(self, v: Any) -> Tuple[str, Optional[int]]:
        if _is_cupy(v):
            return "cuda", int(v.device.id)
        return ("cpu", None) if type(v).__module__.startswith("numpy") else ("other", None)

    def copy(self, dsts: List[Any], srcs: List[Any], stream: Any) -> int:
        gpus = set()
        for d, s in zip(dsts, srcs):
            d, s = _array_bits(d), _array_bits(s)
            if _is_cupy(d):
                import cupy
                gpus.add(d.device.id)
                with d.device:
                    d[...] = s if _is_cupy(s) else cupy.asarray(s)
            elif _is_cupy(s):
                gpus.add(s.device.id)
                d[...] = s.get()
            else:
                d[...] = s
        for g in gpus:
            import cupy
            cupy.cuda.Device(g).synchronize()
        return len(dsts)

    def stream_handle(self, stream: Any, ordinal: int) -> int:
        if stream is None:
            if not available("cupy"):
                return 0   # the legacy default stream (copy_batch orders itself after it)
            import cupy
            with cupy.cuda.Device(ordinal):
                return int(cupy.cuda.get_current_stream().ptr)
        return int(getattr(stream, "ptr", getattr(stream, "cuda_stream", stream)))

    def entry_view(self, base: Any, by_dtype: Dict[Any, Any], e: TensorEntry) -> Any:
        b = base[e.begin:e.end]
        dt = self.dtype(e.dtype)
        if dt is None:
            return b
        return b.view(dt).reshape(e.shape)


def _array_bits(a: Any) -> Any:
    """a viewed as unsigned integers of its item size where it is a float, ml_dtypes'
    bfloat16 and float8 (kind "V") included (a copy of floats must move bits, NaN
    payloads included)."""
    if a.dtype.kind in "fcV" and a.dtype.itemsize in (1, 2, 4, 8):
        return a.view("u%d" % a.dtype.itemsize)
    return a


TORCH: ArrayLib = _Torch()
ARRAYS: ArrayLib = _Arrays()


def pick(views: str) -> ArrayLib:
    """The library of ``views``: "torch", "numpy" (NumPy for host bundles, CuPy for
    GPU ones), or "auto" (PyTorch where it can be imported, else "numpy")."""
    if views == "torch":
        return TORCH
    if views == "numpy":
        return ARRAYS
    if views == "auto":
        return TORCH if available("torch") else ARRAYS
    raise ValueError("views=%r: want \"auto\", \"torch\" or \"numpy\"" % (views,))


ACCEPTED = "torch tensors (CPU or CUDA), NumPy arrays or CuPy arrays"


def _kind(v: Any) -> Optional[str]:
    """"torch", "numpy" or "cupy" for a value a bundle can store, else None."""
    mod = type(v).__module__
    if mod.startswith("torch"):
        torch = sys.modules.get("torch")
        return "torch" if torch is not None and isinstance(v, torch.Tensor) else None
    if mod.startswith("numpy"):
        np = sys.modules.get("numpy")
        return "numpy" if np is not None and isinstance(v, np.ndarray) else None
    if mod.startswith("cupy"):
        cp = sys.modules.get("cupy")
        return "cupy" if cp is not None and isinstance(v, cp.ndarray) else None
    return None


def refuse_values(op: str, name: str, names: List[Any], values: List[Any], one_kind: bool = True) -> None:
    """Raise a one-line TypeError naming the first value of a state dict that a
    bundle cannot store (not an array, or with ``one_kind`` not of the first value's
    kind), its key and what a bundle takes; return when every value is fine. Called
    once a put failed, so that the happy path pays nothing for it."""
    first: Optional[Tuple[Any, str]] = None
    for k, v in zip(names, values):
        kind = _kind(v)
        if kind is None:
            t = type(v)
            tn = t.__name__ if t.__module__ == "builtins" else "%s.%s" % (t.__module__, t.__name__)
            if isinstance(v, (list, tuple)):
                hint = " (numpy.asarray(x) or torch.tensor(x) makes one of it)"
            elif isinstance(v, (int, float, complex)) or t.__module__ == "numpy":
                hint = " (a scalar goes as a 0-d array: numpy.asarray(x) or torch.tensor(x))"
            else:
                hint = ""
            raise TypeError("%s %r: state_dict[%r] is a %s; a bundle's values are %s%s"
                            % (op, name, k, tn, ACCEPTED, hint)) from None
        if not one_kind:
            continue
        if first is None:
            first = (k, kind)
        elif (kind == "torch") != (first[1] == "torch"):
            raise TypeError("%s %r: state_dict[%r] is a %s array and state_dict[%r] a %s one; a bundle's values are "
                            "all of one kind: %s" % (op, name, k, kind, first[0], first[1], ACCEPTED)) from None


def of_values(values: List[Any], default: ArrayLib) -> ArrayLib:
    """The library of a state dict's values (its first value's), else ``default``."""
    if not values:
        return default
    mod = type(values[0]).__module__
    if mod.startswith("torch"):
        return TORCH
    if mod.startswith("numpy") or mod.startswith("cupy"):
        return ARRAYS
    return default
