"""Driver entry points called through ctypes (found once by cuGetProcAddress):
batched copies (bundle.load_into) and put's copy recorded on an interprocess event.

A cuda-bindings call and its result check cost several microseconds each (a Python
object per pointer, a tuple per result); these paths make thousands of copies, or
time a 0.5 ms copy, so they call the driver's C entry points directly. Everything
else goes through cuda-bindings (_cuda).
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._cuda import as_bytes, check, driver, driver_lock, err_name, on, primary_context, proc
from .errors import CudaError
from . import _gather

# -- batched copies (bundle.load_into) ------------------------------------------------
#
# cuMemcpyBatchAsync (CUDA 12.8+) takes host arrays of destination and source
# pointers and sizes and queues every copy with one driver call, in stream order.
# cuda-bindings' own wrapper wants a Python object per pointer; for 18,000 copies
# that costs more than the copies, so the entry point is called through ctypes with
# the arrays' addresses (NumPy uint64 arrays in _plan.py), as vLLM's KV offload does.


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_SRC_ACCESS_ORDER_STREAM = 1   # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: read the sources in stream order
# The first signature (CUDA 12.8: a failIdx argument before the stream); a CUDA 13
# driver still serves it when asked for version 12080, so one prototype fits both.
_BATCH_VERSION = 12080
_BATCH_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
_COPY_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
_SYNC_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

_streams: Dict[int, Any] = {}   # ordinal -> a blocking stream of the primary context
batch_unavailable = ""          # why cuMemcpyBatchAsync is not used ("" while it is)
_attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
_attrs_idx = ctypes.c_size_t(0)


def warm() -> None:
    """Find cuMemcpyBatchAsync now rather than in the first batched copy."""
    proc("cuMemcpyBatchAsync", _BATCH_VERSION, _BATCH_PROTO)


def _blocking_stream(ordinal: int) -> int:
    """A stream of the GPU's primary context created without CU_STREAM_NON_BLOCKING:
    work on it is ordered after the legacy default stream's and before its later work,
    which is what a caller on PyTorch's default stream expects. cuMemcpyBatchAsync
    refuses the legacy stream itself."""
    s = _streams.get(ordinal)
    if s is None:
        with driver_lock:
            s = _streams.get(ordinal)
            if s is None:
                with on(ordinal):
                    s = check("cuStreamCreate", driver().cuStreamCreate(0))
                _streams[ordinal] = s
    return int(s)


def copy_batch(ordinal: int, stream: int, dsts: Any, srcs: Any, sizes: Any,
               serial: Any = (), wait: bool = True, kernel: bool = False, arena: bool = False) -> Tuple[int, str]:
    """Copy sizes[i] bytes from srcs[i] to dsts[i] (device or UVA addresses, as
    contiguous uint64 arrays with a ``ctypes.data`` address, e.g. NumPy's) on
    ``stream`` of GPU ``ordinal`` (0: PyTorch's legacy default stream; a blocking
    stream ordered with it is used) with one cuMemcpyBatchAsync, then ``serial``
    (dst, src, n) copies one by one in order, after the batch; then wait for the
    stream unless ``wait`` is false. The batch's copies must not overlap each other.
    With ``kernel`` (every address is one this GPU's context maps: its own memory,
    or another GPU's opened through it), copies under _gather.MAX_BYTES (_gather.ARENA_MAX_BYTES
    with ``arena``: copies to or from a bundle in the daemon's arena) go to one
    launch of the gather kernel instead, where it works on this GPU
    (cudaipc._gather: no cost per copy), the others to the batch. Where the driver lacks cuMemcpyBatchAsync, or it fails, the batch is
    issued as one cuMemcpyAsync per copy (``batch_unavailable`` says why). Returns
    the driver calls made and the method ("batch", "memcpy", "kernel", or
    "kernel+" one of the first two)."""
    global batch_unavailable
    n = len(sizes)
    calls = 0
    method = "batch"
    prefix = ""
    with on(ordinal):
        s = stream or _blocking_stream(ordinal)
        fn_k = _gather.ready(ordinal) if kernel and n > 1 else None
        if fn_k is not None:
            small = sizes < (_gather.ARENA_MAX_BYTES if arena else _gather.MAX_BYTES)
            if int(small.sum()) > 1:
                _gather.launch(ordinal, fn_k, dsts[small], srcs[small], sizes[small], s)
                calls += 1
                prefix = "kernel"
                if small.all():
                    n = 0
                else:
                    big = ~small
                    dsts, srcs, sizes = dsts[big], srcs[big], sizes[big]
                    n = len(sizes)
        if n:
            fn = None if batch_unavailable else proc("cuMemcpyBatchAsync", _BATCH_VERSION, _BATCH_PROTO)
            err = -1
            why = "cuMemcpyBatchAsync: not in this driver (CUDA 12.8 or later has it)"
            if fn is not None:
                fail = ctypes.c_size_t(0)
                err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, ctypes.addressof(_attrs),
                         ctypes.addressof(_attrs_idx), 1, ctypes.addressof(fail), s)
                calls += 1
                why = "cuMemcpyBatchAsync: %s (copy %d of %d)" % (err_name(err), fail.value, n)
            if err != 0:
                # The copies one by one: a bad copy fails there with its own error;
                # if they all work, the batch is what this driver cannot do.
                method = "memcpy"
                try:
                    calls += _copy_each(zip(dsts.tolist(), srcs.tolist(), sizes.tolist()), s)
                except CudaError as e:
                    if fn is not None:
                        raise CudaError(e.call, e.result, "%s; before that %s" % (e.detail, why)) from None
                    raise
                if not batch_unavailable:
                    batch_unavailable = why
        calls += _copy_each(serial, s)
        if wait:
            sync = proc("cuStreamSynchronize", 2000, _SYNC_PROTO)
            err = sync(s) if sync is not None else -1
            if err != 0:
                raise CudaError("cuStreamSynchronize", err_name(err) if err > 0 else "not in this driver")
    if prefix:
        method = prefix if not n else prefix + "+" + method
    return calls, method


def _copy_each(copies: Any, stream: int) -> int:
    fn = proc("cuMemcpyAsync", 4000, _COPY_PROTO)
    if fn is None:
        raise CudaError("cuGetProcAddress", "cuMemcpyAsync not found")
    calls = 0
    for d, src, n in copies:
        err = fn(d, src, n, stream)
        calls += 1
        if err != 0:
            raise CudaError("cuMemcpyAsync", err_name(err), "%d bytes %#x -> %#x" % (n, src, d))
    return calls


# -- allocation identity (no-copy publish) ------------------------------------------
#
# A publish of the same tensors at the same addresses checks that each allocation
# they lie in is still the one exported (a freed and reallocated segment has a new
# buffer id): one driver call per allocation, 1,921 for the MoE shapes.

_ATTR_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)
_BUFFER_ID = 7   # CU_POINTER_ATTRIBUTE_BUFFER_ID (cuda.h)


def buffer_ids(ordinal: int, ptrs: Sequence[int]) -> List[int]:
    """The buffer id (CU_POINTER_ATTRIBUTE_BUFFER_ID: never reused within a process)
    of the allocation each device address of GPU ``ordinal`` lies in; 0 for an
    address the driver does not know."""
    fn = proc("cuPointerGetAttribute", 4000, _ATTR_PROTO)
    out: List[int] = []
    if fn is None:
        cu = driver()
        a = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID
        with on(ordinal):
            for p in ptrs:
                err, bid = cu.cuPointerGetAttribute(a, p)
                out.append(int(bid) if err == cu.CUresult.CUDA_SUCCESS else 0)
        return out
    val = ctypes.c_uint64(0)
    at = ctypes.addressof(val)
    with on(ordinal):
        for p in ptrs:
            val.value = 0
            out.append(val.value if fn(at, _BUFFER_ID, p) == 0 else 0)
    return out


# -- interprocess events (a seal that waits on the copy: docs/protocol.md, seal) --------

class IPCEvent:
    """An interprocess event of GPU ``ordinal`` (timing off); ``ipc_handle`` is its
    64-byte cuIpcGetEventHandle (what an EventDescriptor carries, docs/region.md)."""

    def __init__(self, ordinal: int):
        cu = driver()
        self.ordinal = ordinal
        flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(cu.CUevent_flags.CU_EVENT_INTERPROCESS)
        with on(ordinal):
            self.event = check("cuEventCreate", cu.cuEventCreate(flags))
            try:
                h = check("cuIpcGetEventHandle", cu.cuIpcGetEventHandle(self.event))
            except BaseException:
                cu.cuEventDestroy(self.event)
                raise
        self.handle = int(self.event)                 # the CUevent, for raw driver calls
        self.ctx = int(primary_context(ordinal))      # its context
        self.ipc_handle = as_bytes(h.reserved, 64)
        self.descriptor = b""   # its EventDescriptor, for whoever sends it (_put.seal_event)

    def close(self) -> None:
        """Destroy the event (the daemon's opened copy lives until it lets go)."""
        ev, self.event = self.event, None
        if ev is not None:
            driver().cuEventDestroy(ev)


# put's few driver calls go straight to the driver's entry points through ctypes: a
# cuda-bindings call and its result check cost several microseconds each, which a
# put of 1 GiB (a 0.5 ms copy) notices.
_CTX_OUT_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))   # cuCtxGetCurrent, cuCtxPopCurrent
_REC_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)      # cuEventRecord(event, stream)


class _PutCalls:
    """The entry points put uses, found once; ``ok`` is false where one is missing
    (then the cuda-bindings calls are used)."""

    def __init__(self) -> None:
        self.get_ctx = proc("cuCtxGetCurrent", 4000, _CTX_OUT_PROTO)
        self.push = proc("cuCtxPushCurrent", 4000, _SYNC_PROTO)
        self.pop = proc("cuCtxPopCurrent", 4000, _CTX_OUT_PROTO)
        self.copy = proc("cuMemcpyAsync", 4000, _COPY_PROTO)
        self.record = proc("cuEventRecord", 2000, _REC_PROTO)
        self.sync = proc("cuEventSynchronize", 2000, _SYNC_PROTO)
        self.ok = None not in (self.get_ctx, self.push, self.pop, self.copy, self.record, self.sync)


_put_calls: Optional[_PutCalls] = None


def _put_fns() -> _PutCalls:
    global _put_calls
    if _put_calls is None:
        _put_calls = _PutCalls()
    return _put_calls


def _raw(call: str, err: int) -> None:
    if err != 0:
        raise CudaError(call, err_name(err))


class _current:
    """``with _current(f, ctx):`` makes ``ctx`` current unless it is already (the
    usual case: PyTorch made the primary context current on this thread)."""

    __slots__ = ("f", "ctx", "pushed")

    def __init__(self, f: _PutCalls, ctx: int):
        self.f, self.ctx = f, ctx

    def __enter__(self) -> None:
        f = self.f
        cur = ctypes.c_void_p()
        _raw("cuCtxGetCurrent", f.get_ctx(ctypes.byref(cur)))
        self.pushed = cur.value != self.ctx
        if self.pushed:
            _raw("cuCtxPushCurrent", f.push(self.ctx))

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            out = ctypes.c_void_p()
            _raw("cuCtxPopCurrent", self.f.pop(ctypes.byref(out)))


def copy_and_record(dst: int, src: int, n: int, stream: int, ev: IPCEvent) -> None:
    """Enqueue a device-to-device copy on ``stream`` and record ``ev`` after it, without
    waiting: the daemon waits on the event before it seals."""
    f = _put_fns()
    if not f.ok:
        cu = driver()
        with on(ev.ordinal):
            check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(dst, src, n, stream))
            check("cuEventRecord", cu.cuEventRecord(ev.event, cu.CUstream(stream)))
        return
    with _current(f, ev.ctx):
        _raw("cuMemcpyAsync", f.copy(dst, src, n, stream))
        _raw("cuEventRecord", f.record(ev.handle, stream))


def event_synchronize(ev: IPCEvent) -> None:
    """Wait until the work ``ev`` was last recorded after has completed (the driver's
    wait: spinning where the context's scheduling policy says so). The GIL is let go
    meanwhile."""
    f = _put_fns()
    if not f.ok:
        cu = driver()
        with on(ev.ordinal):
            check("cuEventSynchronize", cu.cuEventSynchronize(ev.event))
        return
    with _current(f, ev.ctx):
        _raw("cuEventSynchronize", f.sync(ev.handle))


def stream_synchronize(ordinal: int, stream: int) -> None:
    """Wait for ``stream``'s work."""
    cu = driver()
    with on(ordinal):
        check("cuStreamSynchronize", cu.cuStreamSynchronize(cu.CUstream(stream)))
