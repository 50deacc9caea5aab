"""Typed views (NumPy, PyTorch, CuPy, memoryview) of memory owned by a lease, an
object being written, or an imported region.

Every view keeps its owner alive through its memory-owner chain: a NumPy array's
``base``, the object a PyTorch tensor was built from (its storage's deleter holds a
reference), a CuPy ``UnownedMemory``'s ``owner``, a memoryview's exporter. The owner
ends the lease (or closes the mapping) only when the last of them is collected.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._deps import require

__all__ = ["DTYPES", "ML_DTYPES", "dtype_name", "numpy_dtype", "Layout", "resolve_layout"]

# name -> (itemsize, NumPy typestr or None when NumPy has no such type, typestr of
# an integer type of the same size to carry it)
DTYPES: Dict[str, Tuple[int, Optional[str], str]] = {
    "bool": (1, "|b1", "|u1"), "int8": (1, "|i1", "|i1"), "uint8": (1, "|u1", "|u1"),
    "int16": (2, "<i2", "<i2"), "uint16": (2, "<u2", "<u2"), "int32": (4, "<i4", "<i4"),
    "uint32": (4, "<u4", "<u4"), "int64": (8, "<i8", "<i8"), "uint64": (8, "<u8", "<u8"),
    "float16": (2, "<f2", "<i2"), "bfloat16": (2, None, "<i2"), "float32": (4, "<f4", "<i4"),
    "float64": (8, "<f8", "<i8"), "complex64": (8, "<c8", "<i8"), "complex128": (16, "<c16", "<c16"),
    "float8_e4m3fn": (1, None, "|u1"), "float8_e5m2": (1, None, "|u1"),
}


# Dtypes NumPy itself lacks and the ml_dtypes package (which JAX, among others,
# installs) adds under these names.
ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")


def numpy_dtype(name: str) -> Any:
    """NumPy's dtype for the protocol dtype ``name``, or None where NumPy has none:
    NumPy's own types, and bfloat16 and float8 as ml_dtypes' types when ml_dtypes can
    be imported (it is, then). It depends on whether ml_dtypes is installed, never on
    whether something else imported it first, as ``numpy.dtype("bfloat16")`` would."""
    np = require("numpy", "NumPy dtypes")
    if name in ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            return None
        t = getattr(ml_dtypes, name, None)
        return None if t is None else np.dtype(t)
    return np.dtype(name)


def dtype_name(dtype: Any) -> str:
    """The protocol's name of a dtype given as a string, NumPy/CuPy dtype or torch.dtype."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            import numpy as np
            name = np.dtype(dtype).name
        except Exception:  # noqa: BLE001
            name = str(dtype)
    name = {"bool_": "bool", "half": "float16", "float": "float32", "double": "float64"}.get(name, name)
    if name not in DTYPES:
        raise TypeError("dtype %r is not one of %s" % (dtype, ", ".join(sorted(DTYPES))))
    return name


class Layout:
    """A dtype, shape and strides (in elements) over ``nbytes`` of memory."""

    __slots__ = ("dtype", "shape", "strides")

    def __init__(self, dtype: str, shape: Tuple[int, ...], strides: Optional[Tuple[int, ...]]):
        self.dtype = dtype
        self.shape = shape
        self.strides = strides

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    def c_strides(self) -> Tuple[int, ...]:
        s, acc = [], 1
        for d in reversed(self.shape):
            s.append(acc)
            acc *= d
        return tuple(reversed(s))

    def elem_strides(self) -> Tuple[int, ...]:
        return self.strides if self.strides is not None else self.c_strides()

    def byte_strides(self) -> Tuple[int, ...]:
        return tuple(s * self.itemsize for s in self.elem_strides())

    def extent(self) -> int:
        if any(d == 0 for d in self.shape):
            return 0
        last = sum((d - 1) * s for d, s in zip(self.shape, self.elem_strides()))
        return (last + 1) * self.itemsize


def resolve_layout(nbytes: int, recorded: Optional[Any], dtype: Any = None,
                   shape: Optional[Sequence[int]] = None) -> Layout:
    """The layout to view ``nbytes`` with: the caller's dtype/shape, else what the
    producer recorded (a TensorDesc), else bytes. Raises ValueError when the shape
    does not fit."""
    rec_dtype = recorded.dtype if recorded is not None and recorded.dtype else None
    name = dtype_name(dtype) if dtype is not None else (rec_dtype or "uint8")
    item = DTYPES[name][0]
    strides: Optional[Tuple[int, ...]] = None
    if shape is None:
        if recorded is not None and name == rec_dtype:
            shp = tuple(int(d) for d in recorded.shape)
            strides = tuple(int(s) for s in (recorded.strides or ())) or None
        else:
            if nbytes % item:
                raise ValueError("%d bytes are not a whole number of %s elements (%d bytes each): give a shape"
                                 % (nbytes, name, item))
            shp = (nbytes // item,)
    else:
        if isinstance(shape, int):
            shape = (shape,)
        shp = tuple(int(d) for d in shape)
        if shp.count(-1) > 1 or any(d < -1 for d in shp):
            raise ValueError("shape %r: at most one -1 and no other negative extent" % (shp,))
        if -1 in shp:
            known = 1
            for d in shp:
                if d != -1:
                    known *= d
            if known == 0 or nbytes % (known * item):
                raise ValueError("shape %r of %s does not divide the object's %d bytes" % (shp, name, nbytes))
            shp = tuple(nbytes // (known * item) if d == -1 else d for d in shp)
    lay = Layout(name, shp, strides)
    if lay.extent() > nbytes:
        raise ValueError("shape %r of %s needs %d bytes; the object has %d"
                         % (shp, name, lay.extent(), nbytes))
    return lay


class HostArray:
    """What NumPy builds a host array from: ``__array_interface__`` over raw memory.
    ``owner`` is kept alive as long as any array made from it."""

    def __init__(self, owner: Any, addr: int, lay: Layout, readonly: bool, carrier: bool = False):
        self.owner = owner
        typestr = DTYPES[lay.dtype][2 if carrier else 1]
        if typestr is None:
            raise TypeError("NumPy has no %s: use .tensor(), numpy(dtype=...) with an integer type of the same size, "
                            "or install ml_dtypes (pip install ml-dtypes)" % lay.dtype)
        self.__array_interface__ = {
            "version": 3, "shape": lay.shape, "typestr": typestr,
            "data": (addr, readonly), "strides": lay.byte_strides() if lay.strides is not None else None,
        }


class CudaArray:
    """What PyTorch (or any ``__cuda_array_interface__`` consumer) builds a device
    array from; ``owner`` stays alive as long as any array made from it. The data is
    never flagged read-only: PyTorch refuses the flag, and CUDA maps device memory
    read-write anyway (a leased GPU object must still not be written)."""

    def __init__(self, owner: Any, ptr: int, lay: Layout, readonly: bool = False):
        self.owner = owner
        readonly = False
        self.__cuda_array_interface__ = {
            "version": 3, "shape": lay.shape, "typestr": DTYPES[lay.dtype][2] if DTYPES[lay.dtype][1] is None else DTYPES[lay.dtype][1],
            "data": (ptr, readonly), "strides": lay.byte_strides() if lay.strides is not None else None,
            "stream": None,
        }


def numpy_view(owner: Any, addr: int, lay: Layout, readonly: bool) -> Any:
    """A NumPy array over host memory; of a dtype NumPy lacks (bfloat16, float8), in
    ml_dtypes' type where it is installed (numpy_dtype), else a TypeError."""
    np = require("numpy", "numpy()")
    if DTYPES[lay.dtype][1] is None:
        dt = numpy_dtype(lay.dtype)
        if dt is not None:
            return np.asarray(HostArray(owner, addr, lay, readonly, carrier=True)).view(dt)
    return np.asarray(HostArray(owner, addr, lay, readonly))


# A read-only lease: PyTorch has no read-only tensors and warns on every view of
# one (writing faults). The filter names only that message.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def torch_host_view(owner: Any, addr: int, lay: Layout, readonly: bool) -> Any:
    torch = require("torch", "tensor()")
    np = require("numpy", "tensor() of host memory")
    arr = np.asarray(HostArray(owner, addr, lay, readonly, carrier=DTYPES[lay.dtype][1] is None))
    t = torch.from_numpy(arr)
    if DTYPES[lay.dtype][1] is None:
        t = t.view(getattr(torch, lay.dtype))
    return t


def torch_cuda_view(owner: Any, ptr: int, lay: Layout, ordinal: int, readonly: bool) -> Any:
    torch = require("torch", "tensor()")
    # The device comes from the pointer (the GPU that holds the memory); no copy.
    t = torch.as_tensor(CudaArray(owner, ptr, lay, readonly))
    if DTYPES[lay.dtype][1] is None:
        t = t.view(getattr(torch, lay.dtype))
    return t


def cupy_view(owner: Any, ptr: int, nbytes: int, lay: Layout, ordinal: int) -> Any:
    cupy = require("cupy", "cupy()")
    if DTYPES[lay.dtype][1] is None:
        raise TypeError("CuPy has no %s: use .tensor(), or cupy(dtype=...) with an integer type of the same size" % lay.dtype)
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id=ordinal)
    return cupy.ndarray(lay.shape, dtype=DTYPES[lay.dtype][1], memptr=cupy.cuda.MemoryPointer(mem, 0),
                        strides=lay.byte_strides())


def host_memoryview(owner: Any, addr: int, nbytes: int, readonly: bool) -> memoryview:
    buf = (ctypes.c_char * nbytes).from_address(addr)
    buf._cudaipc_owner = owner  # type: ignore[attr-defined]  # the chain: memoryview -> buf -> owner
    mv = memoryview(buf).cast("B")
    return mv.toreadonly() if readonly else mv


class _CAI:
    """A ``__cuda_array_interface__`` carrier for the cached path: the interface dict
    is made once per placement and shared; ``owner`` is this view's own."""

    __slots__ = ("owner", "__cuda_array_interface__")
    owner: Any
    __cuda_array_interface__: Dict[str, Any]


class _AI:
    """The same for ``__array_interface__`` (host memory)."""

    __slots__ = ("owner", "__array_interface__")
    owner: Any
    __array_interface__: Dict[str, Any]


# DLPack (dlpack.h, the unversioned DLManagedTensor every PyTorch since 1.10 takes):
# a tensor built from one costs no dict parsing and no pointer query. Element types
# and their (type code, bits); the others go through the array interfaces.
_DL_TYPES = {"int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8),
             "float16": (2, 16), "float32": (2, 32), "float64": (2, 64), "bfloat16": (4, 16),
             "complex64": (5, 64), "complex128": (5, 128)}
_KDL_CPU, _KDL_CUDA = 1, 2


class _DLPack:
    """ctypes declarations of DLPack, and the owners of tensors made through it: each
    DLManagedTensor's address -> (its pool entry, its owner), until PyTorch calls the
    deleter (when the tensor's storage is freed), which puts the struct back in its
    placement's pool."""

    def __init__(self, from_dlpack: Any):
        class DLDevice(ctypes.Structure):
            _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

        class DLDataType(ctypes.Structure):
            _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

        class DLTensor(ctypes.Structure):
            _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                        ("dtype", DLDataType), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                        ("byte_offset", ctypes.c_uint64)]

        deleter_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

        class DLManagedTensor(ctypes.Structure):
            _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", deleter_t)]

        live: Dict[int, Any] = {}
        pop = live.pop

        def deleter(p: int) -> None:
            e = pop(p, None)
            if e is not None:
                ent = e[0]
                ent[1].append(ent)   # the struct is free again (its owner goes with e)

        self.DLDevice, self.DLDataType, self.DLManagedTensor = DLDevice, DLDataType, DLManagedTensor
        self.live = live
        self.deleter = deleter_t(deleter)   # kept: PyTorch calls it
        # PyCapsule_New(pointer, name, destructor) through a function object of our
        # own (ctypes.pythonapi's is shared with other libraries), without argtypes:
        # every call passes a c_void_p made once per struct, the name (a c_char_p
        # kept here: the capsule keeps a pointer to it) and None, which ctypes hands
        # over without conversion.
        try:
            new = ctypes.PyDLL(None).PyCapsule_New
        except (OSError, AttributeError):
            new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        self.capsule = new
        self.name = ctypes.c_char_p(b"dltensor")
        self.from_dlpack = from_dlpack


_dlpack: Optional[_DLPack] = None


def _dlpack_maker(torch: Any, addr: int, lay: Layout, ordinal: Optional[int]) -> Any:
    """make(owner) through DLPack, or None when this dtype or PyTorch cannot."""
    global _dlpack
    code = _DL_TYPES.get(lay.dtype)
    fd = getattr(torch._C, "_from_dlpack", None)
    if code is None or fd is None:
        return None
    if _dlpack is None:
        _dlpack = _DLPack(fd)
    dl = _dlpack
    nd = len(lay.shape)
    shape = (ctypes.c_int64 * max(nd, 1))(*lay.shape)
    strides = (ctypes.c_int64 * max(nd, 1))(*lay.elem_strides())
    m = dl.DLManagedTensor()
    t = m.dl_tensor
    t.data, t.ndim, t.byte_offset = addr, nd, 0
    t.device = dl.DLDevice(_KDL_CUDA if ordinal is not None else _KDL_CPU, ordinal or 0)
    t.dtype = dl.DLDataType(code[0], code[1], 1)
    t.shape, t.strides = ctypes.addressof(shape), ctypes.addressof(strides)
    m.deleter = dl.deleter
    template = bytes(m)
    from_buf, live, capsule, name, from_dlpack = dl.DLManagedTensor.from_buffer_copy, dl.live, dl.capsule, dl.name, dl.from_dlpack
    # The placement's pool of DLManagedTensors (all copies of the template: PyTorch
    # only reads them): a tensor takes one, and the deleter gives it back once
    # PyTorch is done with it. An entry: (address, the pool, c_void_p of the address,
    # the struct, the shape and strides it points at); live entries keep the struct.
    free: List[Any] = []

    def make_dl(owner: Any) -> Any:
        try:
            ent = free.pop()
        except IndexError:
            s = from_buf(template)
            a = ctypes.addressof(s)
            ent = (a, free, ctypes.c_void_p(a), s, shape, strides)
        live[ent[0]] = (ent, owner)
        try:
            return from_dlpack(capsule(ent[2], name, None))
        except BaseException:
            live.pop(ent[0], None)   # not consumed: PyTorch will not call the deleter
            free.append(ent)
            raise
    make_dl.free = free   # type: ignore[attr-defined]  # (tests: the pool)
    return make_dl


def dlpack_floor(addr: int, lay: Layout, ordinal: Optional[int]) -> Any:
    """For benchmarks (bench/bench_store.py, "python_floor"): ``make() -> torch.Tensor``
    doing only what no tensor of a lease can do without: one capsule of a prebuilt
    DLManagedTensor of this placement, PyTorch's construction from it, and (when the
    tensor goes) the deleter callback. None when DLPack cannot build this layout."""
    import torch
    if _dlpack_maker(torch, addr, lay, ordinal) is None:
        return None
    dl = _dlpack
    assert dl is not None
    nd = len(lay.shape)
    shape = (ctypes.c_int64 * max(nd, 1))(*lay.shape)
    strides = (ctypes.c_int64 * max(nd, 1))(*lay.elem_strides())
    m = dl.DLManagedTensor()
    t = m.dl_tensor
    code = _DL_TYPES[lay.dtype]
    t.data, t.ndim, t.byte_offset = addr, nd, 0
    t.device = dl.DLDevice(_KDL_CUDA if ordinal is not None else _KDL_CPU, ordinal or 0)
    t.dtype = dl.DLDataType(code[0], code[1], 1)
    t.shape, t.strides = ctypes.addressof(shape), ctypes.addressof(strides)
    m.deleter = dl.deleter   # finds no owner for this struct: a bare callback
    p = ctypes.c_void_p(ctypes.addressof(m))
    capsule, name, from_dlpack = dl.capsule, dl.name, dl.from_dlpack

    def make() -> Any:
        return from_dlpack(capsule(p, name, None))
    make.keep = (m, shape, strides)   # type: ignore[attr-defined]
    return make


def tensor_maker(addr: int, lay: Layout, ordinal: Optional[int], readonly: bool) -> Any:
    """A function ``make(owner) -> torch.Tensor`` of the memory at ``addr`` with layout
    ``lay`` (device memory of GPU ``ordinal``, or host memory when None), made once per
    placement: a lease's ``tensor()`` then costs one small carrier (a DLPack struct, or
    an array-interface object) and PyTorch's own construction. Each tensor keeps
    ``owner`` alive through its storage."""
    torch = require("torch", "tensor()")
    if ordinal is None:
        require("numpy", "tensor() of host memory")
    mk = None
    try:
        mk = _dlpack_maker(torch, addr, lay, ordinal)
    except Exception:  # noqa: BLE001 - no ctypes.pythonapi, an odd build: the interfaces
        mk = None
    iface = _interface_maker(torch, addr, lay, ordinal, readonly)
    if mk is not None:
        # Checked once per placement against the interface path (with a stand-in
        # owner): any difference, and this placement uses the interfaces.
        try:
            probe = object()
            t, ref = mk(probe), iface(probe)
            same = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) == \
                (ref.data_ptr(), tuple(ref.shape), ref.stride(), ref.dtype, ref.device)
            del t, ref
        except Exception:  # noqa: BLE001
            same = False
        if same:
            return mk
    return iface


def _interface_maker(torch: Any, addr: int, lay: Layout, ordinal: Optional[int], readonly: bool) -> Any:
    carrier = DTYPES[lay.dtype][1] is None
    post = getattr(torch, lay.dtype) if carrier else None
    strides = lay.byte_strides() if lay.strides is not None else None
    if ordinal is not None:
        cai = {"version": 3, "shape": lay.shape, "typestr": DTYPES[lay.dtype][2] if carrier else DTYPES[lay.dtype][1],
               "data": (addr, False), "strides": strides, "stream": None}
        as_tensor = torch.as_tensor

        def make_cuda(owner: Any) -> Any:
            o = _CAI()
            o.owner = owner
            o.__cuda_array_interface__ = cai
            t = as_tensor(o)
            return t if post is None else t.view(post)
        return make_cuda
    import numpy as np
    ai = {"version": 3, "shape": lay.shape, "typestr": DTYPES[lay.dtype][2 if carrier else 1],
          "data": (addr, readonly), "strides": strides}
    asarray, from_numpy = np.asarray, torch.from_numpy

    def make_host(owner: Any) -> Any:
        o = _AI()
        o.owner = owner
        o.__array_interface__ = ai
        t = from_numpy(asarray(o))
        return t if post is None else t.view(post)
    return make_host
