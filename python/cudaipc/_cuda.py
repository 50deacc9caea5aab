"""The GPU side, through NVIDIA's cuda-bindings (``cuda.bindings.driver``).

cuda-bindings is imported only when a GPU object or region is touched (driver()),
so that the host backend needs nothing but protobuf. Every mapping is cached per process: legacy IPC
handles are opened once per (handle, buffer id, GPU) and reference-counted
(docs/region.md "Consuming a region"); imported VMM arenas likewise.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import threading
from typing import Any, Dict, List, Optional, Tuple

from ._deps import install_hint
from .errors import CudaError

driver_lock = threading.RLock()
_cu: Any = None
_ctx: Dict[int, Any] = {}               # ordinal -> retained primary context
_uuids: Optional[List[bytes]] = None    # UUID bytes by ordinal


def driver() -> Any:
    """The cuda.bindings.driver module, initialised (cuInit) once."""
    global _cu
    if _cu is not None:
        return _cu
    with driver_lock:
        if _cu is None:
            try:
                from cuda.bindings import driver as cu  # cuda-bindings >= 12.6
            except ImportError:
                try:
                    from cuda import cuda as cu  # type: ignore  # older cuda-python
                except ImportError:
                    raise CudaError("import cuda.bindings.driver", "not installed",
                                    "GPU objects need NVIDIA's cuda-bindings: " + install_hint("cuda.bindings")) from None
            err = cu.cuInit(0)[0]
            if err != cu.CUresult.CUDA_SUCCESS:
                raise CudaError("cuInit", result_name(cu, err), "no usable CUDA driver or GPU")
            _cu = cu
    return _cu


def result_name(cu: Any, err: Any) -> str:
    """The CUresult name of ``err`` (its number where the driver cannot name it)."""
    try:
        r = cu.cuGetErrorName(err)
        n = r[1]
        return n.decode() if isinstance(n, bytes) else str(n)
    except Exception:  # noqa: BLE001 - naming an error must not fail
        return str(err)


_procs: Dict[str, Any] = {}


def proc(symbol: str, version: int, proto: Any) -> Any:
    """A driver entry point (cuGetProcAddress through cuda-bindings) as a ctypes
    function of prototype ``proto``, or None where this driver lacks it; found once."""
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


def err_name(err: int) -> str:
    """The CUresult name of a driver entry point's return value."""
    cu = driver()
    try:
        return result_name(cu, cu.CUresult(err))
    except Exception:  # noqa: BLE001
        return "CUresult %d" % err


def check(call: str, res: Any) -> Any:
    """Unpack a cuda-bindings result tuple: raise CudaError unless CUDA_SUCCESS."""
    cu = driver()
    if not isinstance(res, tuple):
        res = (res,)
    err = res[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(call, result_name(cu, err))
    rest = res[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def as_bytes(v: Any, n: int) -> bytes:
    """The ``n`` bytes of a cuda-bindings byte field (a handle, a UUID)."""
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
            out.append(as_bytes(u.bytes, 16))
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
        with driver_lock:
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
    with driver_lock:
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
    with driver_lock:
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
    with driver_lock:
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


class VMMRange:
    """VMM allocations imported from POSIX file descriptors (one per piece) and mapped
    back to back in one reserved range, read-only (CU_MEM_ACCESS_FLAGS_PROT_READ) unless
    ``writable``: a vmm-fd region of one or several allocations (docs/region.md). The
    descriptors are not taken; the mapping keeps the memory alive until close."""

    def __init__(self, fds: List[int], sizes: List[int], ordinal: int, writable: bool = False):
        if not fds or len(fds) != len(sizes):
            raise ValueError("VMMRange: %d descriptors for %d pieces" % (len(fds), len(sizes)))
        self.sizes, self.size, self.ordinal = list(sizes), sum(sizes), ordinal
        self.ptr = 0
        self._dptr: Any = None
        with on(ordinal):
            self._map(fds, writable)

    def _map(self, fds: List[int], writable: bool) -> None:
        cu = driver()
        flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                 else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
        handles: List[Any] = []
        ptr, mapped = None, 0
        try:
            for fd in fds:
                handles.append(check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(
                    fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)))
            ptr = check("cuMemAddressReserve", cu.cuMemAddressReserve(self.size, 0, 0, 0))
            at = int(ptr)
            for h, n in zip(handles, self.sizes):
                check("cuMemMap", cu.cuMemMap(cu.CUdeviceptr(at), n, 0, h, 0))
                mapped += 1
                at += n
            # Access per mapping (a range over several is not documented to work in
            # one call), for every GPU that can reach this one.
            at = int(ptr)
            for n in self.sizes:
                descs = []
                for d in _peers_of(self.ordinal):
                    acc = cu.CUmemAccessDesc()
                    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    acc.location.id = d
                    acc.flags = flags
                    descs.append(acc)
                check("cuMemSetAccess", cu.cuMemSetAccess(cu.CUdeviceptr(at), n, descs, len(descs)))
                at += n
        except BaseException:
            at = int(ptr) if ptr is not None else 0
            for n in self.sizes[:mapped]:
                cu.cuMemUnmap(cu.CUdeviceptr(at), n)
                at += n
            if ptr is not None:
                cu.cuMemAddressFree(ptr, self.size)
            for h in handles:
                cu.cuMemRelease(h)
            raise
        # The mappings keep the memory alive; the handles are not needed any more.
        for h in handles:
            check("cuMemRelease", cu.cuMemRelease(h))
        self.ptr, self._dptr = int(ptr), ptr

    def close(self) -> None:
        """Unmap the range (the memory stays valid elsewhere). Idempotent."""
        if self._dptr is None:
            return
        cu = driver()
        with on(self.ordinal):
            at = self.ptr
            for n in self.sizes:
                check("cuMemUnmap", cu.cuMemUnmap(cu.CUdeviceptr(at), n))
                at += n
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


@dataclasses.dataclass(frozen=True)
class LegacyExport:
    """What the driver says of device memory to export by legacy IPC: its
    allocation's base and size (cuMemGetAddressRange), buffer id, 64-byte
    cuIpcGetMemHandle of the base, and the GPU (ordinal and UUID)."""
    handle: bytes
    base: int
    alloc_size: int
    buffer_id: int
    ordinal: int
    device: bytes


def export_legacy(ptr: int, nbytes: int) -> LegacyExport:
    """The legacy IPC export of nbytes at device address ptr (any offset inside a
    cudaMalloc allocation)."""
    cu = driver()
    if nbytes <= 0:
        raise ValueError("export_region: size %d must be positive" % nbytes)
    ordinal = pointer_ordinal(ptr)
    with on(ordinal):
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
    return LegacyExport(as_bytes(h.reserved, 64), base, alloc, bid, ordinal, uuids()[ordinal])


def allocation_bases(ordinal: int, addrs: List[int]) -> List[int]:
    """The base of the allocation (cuMemGetAddressRange) each device address lies in;
    addresses in a range already found cost no driver call."""
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
