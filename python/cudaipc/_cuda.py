"""The GPU side, through NVIDIA's cuda-bindings (``cuda.bindings.driver``).

Imported only when a GPU object or region is touched, so that the host backend
needs nothing but protobuf. Every mapping is cached per process: legacy IPC
handles are opened once per (handle, buffer id, GPU) and reference-counted
(docs/region.md "Consuming a region"); imported VMM arenas likewise.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

from .errors import CudaError

_lock = threading.RLock()
_cu: Any = None
_ctx: Dict[int, Any] = {}               # ordinal -> retained primary context
_uuids: Optional[List[bytes]] = None    # UUID bytes by ordinal


def driver() -> Any:
    """The cuda.bindings.driver module, initialised (cuInit) once."""
    global _cu
    if _cu is not None:
        return _cu
    with _lock:
        if _cu is None:
            try:
                from cuda.bindings import driver as cu  # cuda-bindings >= 12.6
            except ImportError:
                try:
                    from cuda import cuda as cu  # type: ignore  # older cuda-python
                except ImportError:
                    raise CudaError("import cuda.bindings.driver", "not installed",
                                    "GPU objects need NVIDIA's cuda-bindings: pip install cuda-bindings") from None
            err = cu.cuInit(0)[0]
            if err != cu.CUresult.CUDA_SUCCESS:
                raise CudaError("cuInit", _name(cu, err), "no usable CUDA driver or GPU")
            _cu = cu
    return _cu


def _name(cu: Any, err: Any) -> str:
    try:
        r = cu.cuGetErrorName(err)
        n = r[1]
        return n.decode() if isinstance(n, bytes) else str(n)
    except Exception:  # noqa: BLE001 - naming an error must not fail
        return str(err)


def check(call: str, res: Any) -> Any:
    """Unpack a cuda-bindings result tuple: raise CudaError unless CUDA_SUCCESS."""
    cu = driver()
    if not isinstance(res, tuple):
        res = (res,)
    err = res[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(call, _name(cu, err))
    rest = res[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _bytes(v: Any, n: int) -> bytes:
    if isinstance(v, str):
        v = v.encode("latin-1")
    if isinstance(v, (list, tuple)):
        v = bytes((x + 256) % 256 for x in v)
    b = bytes(v)
    if len(b) != n:
        raise CudaError("cuda-bindings", "unexpected %d-byte value" % len(b), "want %d bytes" % n)
    return b


def device_count() -> int:
    """How many GPUs this process sees."""
    return int(check("cuDeviceGetCount", driver().cuDeviceGetCount()))


def uuids() -> List[bytes]:
    """The UUID of each visible GPU, by ordinal."""
    global _uuids
    if _uuids is None:
        cu = driver()
        out = []
        for i in range(device_count()):
            dev = check("cuDeviceGet", cu.cuDeviceGet(i))
            fn = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
            u = check("cuDeviceGetUuid", fn(dev))
            out.append(_bytes(u.bytes, 16))
        _uuids = out
    return _uuids


def ordinal_of(uuid: bytes) -> Optional[int]:
    """This process's ordinal of the GPU with that UUID, or None if it does not see it."""
    try:
        return uuids().index(uuid)
    except ValueError:
        return None


def primary_context(ordinal: int) -> Any:
    """The GPU's primary context (the one PyTorch and CuPy use), retained once."""
    cu = driver()
    ctx = _ctx.get(ordinal)
    if ctx is None:
        with _lock:
            ctx = _ctx.get(ordinal)
            if ctx is None:
                dev = check("cuDeviceGet", cu.cuDeviceGet(ordinal))
                ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
                _ctx[ordinal] = ctx
    return ctx


class on:
    """``with on(ordinal):`` runs driver calls in the GPU's primary context and then
    restores the thread's current context (so that PyTorch's current device does
    not change behind its back)."""

    def __init__(self, ordinal: int):
        self.ctx = primary_context(ordinal)

    def __enter__(self) -> "on":
        check("cuCtxPushCurrent", driver().cuCtxPushCurrent(self.ctx))
        return self

    def __exit__(self, *exc: Any) -> None:
        check("cuCtxPopCurrent", driver().cuCtxPopCurrent())


def make_current(ordinal: int) -> None:
    """Make the GPU's primary context current on this thread for good."""
    check("cuCtxSetCurrent", driver().cuCtxSetCurrent(primary_context(ordinal)))


def pick_ordinal(uuid: bytes) -> int:
    """The GPU to map memory of GPU ``uuid`` through: that GPU if visible, else the
    first visible one (peer access reaches it)."""
    o = ordinal_of(uuid)
    if o is not None:
        return o
    if device_count() == 0:
        raise CudaError("cuDeviceGetCount", "no GPU visible in this process")
    return 0


# -- legacy IPC -----------------------------------------------------------------

_ipc: Dict[Tuple[bytes, int, int], List[Any]] = {}   # (handle, buffer id, ordinal) -> [base, refs]


def ipc_open(handle: bytes, buffer_id: int, ordinal: int) -> int:
    """Open (or reuse) a legacy IPC handle on GPU ``ordinal``; return the base address."""
    cu = driver()
    key = (handle, buffer_id, ordinal)
    with _lock:
        e = _ipc.get(key)
        if e is not None:
            e[1] += 1
            return int(e[0])
        h = cu.CUipcMemHandle()
        h.reserved = handle
        flag = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        with on(ordinal):
            base = check("cuIpcOpenMemHandle", cu.cuIpcOpenMemHandle(h, flag))
        _ipc[key] = [base, 1]
        return int(base)


def ipc_close(handle: bytes, buffer_id: int, ordinal: int) -> None:
    """Drop one reference taken by ipc_open; close the handle with the last."""
    cu = driver()
    key = (handle, buffer_id, ordinal)
    with _lock:
        e = _ipc.get(key)
        if e is None:
            return
        e[1] -= 1
        if e[1] > 0:
            return
        del _ipc[key]
        with on(ordinal):
            check("cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle(e[0]))


def ipc_open_count() -> int:
    """How many legacy IPC handles this process has open (for tests)."""
    with _lock:
        return len(_ipc)


# -- VMM arenas shared by descriptor ------------------------------------------------

def _peers_of(ordinal: int) -> List[int]:
    """ordinal, then every other visible GPU that can access its memory."""
    cu = driver()
    out = [ordinal]
    dev = check("cuDeviceGet", cu.cuDeviceGet(ordinal))
    for d in range(device_count()):
        if d == ordinal:
            continue
        other = check("cuDeviceGet", cu.cuDeviceGet(d))
        try:
            if check("cuDeviceCanAccessPeer", cu.cuDeviceCanAccessPeer(other, dev)):
                out.append(d)
        except CudaError:
            pass
    return out


class FDArena:
    """A GPU arena imported from a POSIX file descriptor and mapped once."""

    def __init__(self, fd: int, size: int, ordinal: int):
        self.size = size
        self.ordinal = ordinal
        with on(ordinal):
            self._map(fd, size, ordinal)

    def _map(self, fd: int, size: int, ordinal: int) -> None:
        cu = driver()
        handle = check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        ptr = None
        mapped = False
        try:
            ptr = check("cuMemAddressReserve", cu.cuMemAddressReserve(size, 0, 0, 0))
            check("cuMemMap", cu.cuMemMap(ptr, size, 0, handle, 0))
            mapped = True
            # Every GPU that can reach this one gets access, as legacy IPC's lazy
            # peer access gives it (copies from another GPU's stream need it).
            descs = []
            for d in _peers_of(ordinal):
                acc = cu.CUmemAccessDesc()
                acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                acc.location.id = d
                acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                descs.append(acc)
            check("cuMemSetAccess", cu.cuMemSetAccess(ptr, size, descs, len(descs)))
        except BaseException:
            if mapped:
                cu.cuMemUnmap(ptr, size)
            if ptr is not None:
                cu.cuMemAddressFree(ptr, size)
            cu.cuMemRelease(handle)
            raise
        # The mapping keeps the memory alive; the handle is not needed any more.
        check("cuMemRelease", cu.cuMemRelease(handle))
        self.ptr = int(ptr)
        self._dptr = ptr

    def close(self) -> None:
        """Unmap the arena (the memory stays valid elsewhere)."""
        if self._dptr is None:
            return
        cu = driver()
        with on(self.ordinal):
            check("cuMemUnmap", cu.cuMemUnmap(self._dptr, self.size))
            check("cuMemAddressFree", cu.cuMemAddressFree(self._dptr, self.size))
        self._dptr = None
        self.ptr = 0


# -- copies and regions -------------------------------------------------------------

def memcpy_dtod(dst: int, src: int, n: int, stream: int = 0) -> None:
    """Copy n bytes between device addresses on ``stream`` (0: the legacy stream), then
    wait for it, so that the bytes are there before the caller seals."""
    cu = driver()
    check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(dst, src, n, stream))
    check("cuStreamSynchronize", cu.cuStreamSynchronize(stream))


def memcpy_htod(dst: int, src_addr: int, n: int) -> None:
    """Copy n bytes from host address src_addr to the device."""
    cu = driver()
    check("cuMemcpyHtoD", cu.cuMemcpyHtoD(dst, src_addr, n))


def memcpy_dtoh(dst_addr: int, src: int, n: int) -> None:
    """Copy n bytes from the device to host address dst_addr."""
    cu = driver()
    check("cuMemcpyDtoH", cu.cuMemcpyDtoH(dst_addr, src, n))


def synchronize(ordinal: int) -> None:
    """Wait for all work on the GPU's primary context."""
    with on(ordinal):
        check("cuCtxSynchronize", driver().cuCtxSynchronize())


def pointer_ordinal(ptr: int) -> int:
    """The ordinal of the GPU that holds device address ptr."""
    cu = driver()
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    try:
        return int(check("cuPointerGetAttribute", cu.cuPointerGetAttribute(attr, ptr)))
    except CudaError:
        with on(0):  # no context current on this thread
            return int(check("cuPointerGetAttribute", cu.cuPointerGetAttribute(attr, ptr)))


def export_region(ptr: int, nbytes: int) -> Any:
    """The Region of nbytes at ptr: the allocation's base (cuMemGetAddressRange), its
    legacy IPC handle, buffer id and GPU."""
    cu = driver()
    if nbytes <= 0:
        raise ValueError("export_region: size %d must be positive" % nbytes)
    ordinal = pointer_ordinal(ptr)
    with on(ordinal):
        return _export_region(cu, ptr, nbytes, ordinal)


def _export_region(cu: Any, ptr: int, nbytes: int, ordinal: int) -> Any:
    from .region import Region, local_identity
    base, alloc = check("cuMemGetAddressRange", cu.cuMemGetAddressRange(ptr))
    base, alloc = int(base), int(alloc)
    if ptr + nbytes > base + alloc:
        raise ValueError("export_region: [%#x, +%d) runs past its %d-byte allocation at %#x" % (ptr, nbytes, alloc, base))
    bid = int(check("cuPointerGetAttribute", cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr)))
    try:
        h = check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(base))
    except CudaError as e:
        raise CudaError(e.call, e.result, "legacy IPC cannot export this memory: PyTorch with "
                        "expandable_segments:True or cudaMallocAsync pools are not exportable; "
                        "use the default caching allocator") from None
    ns, boot = local_identity()
    return Region(handle=_bytes(h.reserved, 64), offset=ptr - base, size=nbytes, alloc_size=alloc,
                  device=uuids()[ordinal], exporter_pid=os.getpid(), pid_namespace=ns,
                  boot_id=boot, buffer_id=bid, exporter_base=base)


# -- batched copies (bundle.load_into) ------------------------------------------------
#
# cuMemcpyBatchAsync (CUDA 12.8+) takes host arrays of destination and source
# pointers and sizes and queues every copy with one driver call, in stream order.
# cuda-bindings' own wrapper wants a Python object per pointer; for 18,000 copies
# that costs more than the copies, so the entry point is called through ctypes with
# the arrays' addresses (NumPy uint64 arrays in bundle.py), as vLLM's KV offload does.


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

_procs: Dict[str, Any] = {}
_streams: Dict[int, Any] = {}   # ordinal -> a blocking stream of the primary context
batch_unavailable = ""          # why cuMemcpyBatchAsync is not used ("" while it is)
_attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
_attrs_idx = ctypes.c_size_t(0)


def _proc(symbol: str, version: int, proto: Any) -> Any:
    """A driver entry point (cuGetProcAddress through cuda-bindings) as a ctypes
    function, or None where this driver lacks it."""
    key = "%s@%d" % (symbol, version)
    if key in _procs:
        return _procs[key]
    cu = driver()
    fn = None
    try:
        res = cu.cuGetProcAddress(symbol.encode(), version, 0)
        if res[0] == cu.CUresult.CUDA_SUCCESS and int(res[1]):
            fn = proto(int(res[1]))
    except Exception:  # noqa: BLE001 - old bindings: treat as absent
        fn = None
    _procs[key] = fn
    return fn


def _err_name(err: int) -> str:
    cu = driver()
    try:
        return _name(cu, cu.CUresult(err))
    except Exception:  # noqa: BLE001
        return "CUresult %d" % err


def _blocking_stream(ordinal: int) -> int:
    """A stream of the GPU's primary context created without CU_STREAM_NON_BLOCKING:
    work on it is ordered after the legacy default stream's and before its later work,
    which is what a caller on PyTorch's default stream expects. cuMemcpyBatchAsync
    refuses the legacy stream itself."""
    s = _streams.get(ordinal)
    if s is None:
        with _lock:
            s = _streams.get(ordinal)
            if s is None:
                with on(ordinal):
                    s = check("cuStreamCreate", driver().cuStreamCreate(0))
                _streams[ordinal] = s
    return int(s)


def copy_batch(ordinal: int, stream: int, dsts: Any, srcs: Any, sizes: Any,
               serial: Any = (), wait: bool = True) -> Tuple[int, str]:
    """Copy sizes[i] bytes from srcs[i] to dsts[i] (device or UVA addresses, as
    contiguous uint64 arrays with a ``ctypes.data`` address, e.g. NumPy's) on
    ``stream`` of GPU ``ordinal`` (0: PyTorch's legacy default stream; a blocking
    stream ordered with it is used) with one cuMemcpyBatchAsync, then ``serial``
    (dst, src, n) copies one by one in order, after the batch; then wait for the
    stream unless ``wait`` is false. The batch's copies must not overlap each other.
    Where the driver lacks cuMemcpyBatchAsync, or it fails, the batch is issued as
    one cuMemcpyAsync per copy (``batch_unavailable`` says why). Returns the driver
    copy calls made and the method ("batch" or "memcpy")."""
    global batch_unavailable
    n = len(sizes)
    calls = 0
    method = "batch"
    with on(ordinal):
        s = stream or _blocking_stream(ordinal)
        if n:
            fn = None if batch_unavailable else _proc("cuMemcpyBatchAsync", _BATCH_VERSION, _BATCH_PROTO)
            err = -1
            why = "cuMemcpyBatchAsync: not in this driver (CUDA 12.8 or later has it)"
            if fn is not None:
                fail = ctypes.c_size_t(0)
                err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, ctypes.addressof(_attrs),
                         ctypes.addressof(_attrs_idx), 1, ctypes.addressof(fail), s)
                calls += 1
                why = "cuMemcpyBatchAsync: %s (copy %d of %d)" % (_err_name(err), fail.value, n)
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
            sync = _proc("cuStreamSynchronize", 2000, _SYNC_PROTO)
            err = sync(s) if sync is not None else -1
            if err != 0:
                raise CudaError("cuStreamSynchronize", _err_name(err) if err > 0 else "not in this driver")
    return calls, method


def _copy_each(copies: Any, stream: int) -> int:
    fn = _proc("cuMemcpyAsync", 4000, _COPY_PROTO)
    if fn is None:
        raise CudaError("cuGetProcAddress", "cuMemcpyAsync not found")
    calls = 0
    for d, src, n in copies:
        err = fn(d, src, n, stream)
        calls += 1
        if err != 0:
            raise CudaError("cuMemcpyAsync", _err_name(err), "%d bytes %#x -> %#x" % (n, src, d))
    return calls


def allocation_bases(ordinal: int, addrs: List[int]) -> List[int]:
    """The base of the allocation (cuMemGetAddressRange) each device address lies in;
    addresses in a range already found cost no driver call."""
    import bisect
    cu = driver()
    starts: List[int] = []
    ends: List[int] = []
    out = []
    with on(ordinal):
        for a in addrs:
            j = bisect.bisect_right(starts, a) - 1
            if j >= 0 and a < ends[j]:
                out.append(starts[j])
                continue
            base, size = check("cuMemGetAddressRange", cu.cuMemGetAddressRange(a))
            base, size = int(base), int(size)
            k = bisect.bisect_right(starts, base)
            starts.insert(k, base)
            ends.insert(k, base + size)
            out.append(base)
    return out


# -- interprocess events (a seal that waits on the copy: docs/protocol.md, seal) --------

class IPCEvent:
    """An interprocess event of GPU ``ordinal`` (timing off) and its binary
    EventDescriptor (docs/region.md), which the daemon opens to wait on it."""

    def __init__(self, ordinal: int):
        import os
        from .region import local_identity
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
        from .region import event_descriptor
        ns, boot = local_identity()
        self.descriptor = event_descriptor(_bytes(h.reserved, 64), uuids()[ordinal], os.getpid(), ns, boot)

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
        self.get_ctx = _proc("cuCtxGetCurrent", 4000, _CTX_OUT_PROTO)
        self.push = _proc("cuCtxPushCurrent", 4000, _SYNC_PROTO)
        self.pop = _proc("cuCtxPopCurrent", 4000, _CTX_OUT_PROTO)
        self.copy = _proc("cuMemcpyAsync", 4000, _COPY_PROTO)
        self.record = _proc("cuEventRecord", 2000, _REC_PROTO)
        self.sync = _proc("cuEventSynchronize", 2000, _SYNC_PROTO)
        self.ok = None not in (self.get_ctx, self.push, self.pop, self.copy, self.record, self.sync)


_put_calls: Optional[_PutCalls] = None


def _put_fns() -> _PutCalls:
    global _put_calls
    if _put_calls is None:
        _put_calls = _PutCalls()
    return _put_calls


def _raw(call: str, err: int) -> None:
    if err != 0:
        raise CudaError(call, _err_name(err))


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
