"""Sharing GPU memory this process allocated with someone else's allocator (PyTorch,
CuPy, a custom one) through the store, without copying: the Python side of Go's
``cudaipc.ExportPointer`` and ``Client.Register`` (docs/containers.md)::

    import cudaipc
    with cudaipc.connect() as store:
        info = store.register("weights/layer0", tensor, shared=True)

VMM memory (PyTorch with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, or
``cuMemCreate`` with the POSIX file-descriptor handle type) travels as one descriptor per
physical allocation under the range: readers in other containers map it, and their
mappings outlive this process. Memory from ``cudaMalloc`` (PyTorch's default allocator,
CuPy's default pool) is registered as a legacy region: same PID namespace only, and only
while this process lives. Anything else raises :class:`NotExportable` naming the fix.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

from . import _cuda
from ._store_pb2 import RegisterRequest, Request, StageFilesRequest  # type: ignore[attr-defined]
from ._wire import MAX_FILES
from .errors import CudaError, CudaipcError
from .region import KIND_VMM_FD, MAX_PIECES, VERSION, VERSION_PIECES, Region, local_identity

FIX_POOL = ("allocate from a pool created with the POSIX file-descriptor handle type "
            "(cudaMemPoolCreate with handleTypes = cudaMemHandleTypePosixFileDescriptor), or in "
            "PyTorch set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead of backend:cudaMallocAsync")
FIX_VMM_NO_FD = ("create it with cuMemCreate and requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
                 "(PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True does)")


class NotExportable(CudaipcError):
    """The memory cannot be shared; the message names what the allocator must be
    configured with (the same text as Go's cudaipc.NotExportableError)."""

    def __init__(self, ptr: int, allocator: str, fix: str):
        super().__init__("cudaipc: cannot export %#x: it is %s; %s" % (ptr, allocator, fix))
        self.ptr, self.allocator, self.fix = ptr, allocator, fix


class Export:
    """What :func:`export_pointer` made: the memory's region (docs/region.md) and, for
    VMM memory (a vmm-fd region), one descriptor per piece, first piece first.
    ``close()`` closes the descriptors (send them first)."""

    def __init__(self, region: Region, fds: Optional[List[int]] = None):
        self.region, self.fds = region, fds or []

    @property
    def vmm(self) -> bool:
        """True for VMM memory (descriptors), False for a legacy cuda-ipc region."""
        return self.region.kind == KIND_VMM_FD

    @property
    def size(self) -> int:
        return self.region.size

    @property
    def device(self) -> bytes:
        return self.region.device

    @property
    def offset(self) -> int:
        """Where the memory starts in its first allocation."""
        return self.region.offset

    @property
    def pieces(self) -> List[int]:
        """The size of each allocation under the memory (VMM), in address order."""
        return [n for _, n in self.region.pieces] if self.vmm else []

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> "Export":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pointer_and_size(obj: Any, nbytes: Optional[int]) -> Tuple[int, int]:
    """The device address and size of a CUDA tensor/array, VMMBuffer, Timeline, or raw
    pointer (with ``nbytes``)."""
    if isinstance(obj, (Timeline, VMMBuffer)):
        return obj.ptr, nbytes or (obj.nbytes if isinstance(obj, Timeline) else obj.size)
    if isinstance(obj, int):
        if nbytes is None:
            raise ValueError("export_pointer: give nbytes with a raw pointer")
        return obj, nbytes
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_cuda") and hasattr(obj, "element_size"):  # torch.Tensor
        if not obj.is_cuda:
            raise NotExportable(obj.data_ptr(), "host memory (a CPU tensor)", "put host data with store.put")
        if not obj.is_contiguous():
            raise ValueError("export_pointer: the tensor is not contiguous")
        return obj.data_ptr(), nbytes or obj.numel() * obj.element_size()
    if hasattr(obj, "__cuda_array_interface__"):  # CuPy and friends
        cai = obj.__cuda_array_interface__
        return cai["data"][0], nbytes or obj.nbytes
    raise TypeError("export_pointer: want a CUDA torch.Tensor, a CuPy array or an int pointer, got %s" % type(obj).__name__)


def export_pointer(obj: Any, nbytes: Optional[int] = None) -> Export:
    """Export a CUDA tensor/array (or ``nbytes`` at an int device pointer), asking the
    driver what the memory is; see the module's documentation."""
    ptr, size = pointer_and_size(obj, nbytes)
    if size <= 0:
        raise ValueError("export_pointer: size %d must be positive" % size)
    cu = _cuda.driver()
    ordinal = _cuda.pointer_ordinal(ptr)
    _cuda.make_current(ordinal)
    device = _cuda.uuids()[ordinal]
    posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    pieces: List[int] = []
    fds: List[int] = []
    offset = base0 = 0
    nxt, end = ptr, ptr + size
    try:
        while nxt < end:
            err, h = cu.cuMemRetainAllocationHandle(nxt)
            if err != cu.CUresult.CUDA_SUCCESS:
                if not pieces:
                    break  # not VMM memory
                raise CudaError("cuMemRetainAllocationHandle", _cuda.result_name(cu, err), "at %#x" % nxt)
            try:
                base, msize = _cuda.check("cuMemGetAddressRange", cu.cuMemGetAddressRange(nxt))
                base, msize = int(base), int(msize)
                prop = _cuda.check("cuMemGetAllocationPropertiesFromHandle", cu.cuMemGetAllocationPropertiesFromHandle(h))
                if not int(prop.requestedHandleTypes) & int(posix_fd):
                    raise NotExportable(nxt, "VMM memory allocated without the POSIX file-descriptor handle type", FIX_VMM_NO_FD)
                fd = int(_cuda.check("cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(h, posix_fd, 0)))
            finally:
                cu.cuMemRelease(h)
            os.set_inheritable(fd, False)
            fds.append(fd)
            if not pieces:
                offset, base0 = ptr - base, base
            elif base != nxt:
                raise CudaipcError("cudaipc: export_pointer: the mapping at %#x starts at %#x" % (nxt, base))
            pieces.append(msize)
            if len(pieces) > MAX_PIECES:
                raise ValueError("export_pointer: the range spans more than %d physical allocations; register it in parts" % MAX_PIECES)
            nxt = base + msize
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    if pieces:
        ns, boot = local_identity()
        ids = [os.urandom(16) for _ in pieces]  # fresh per export, as Go's ExportPointer
        region = Region(handle=bytes(64), offset=offset, size=size, alloc_size=pieces[0], device=device,
                        exporter_pid=os.getpid(), pid_namespace=ns, boot_id=boot, buffer_id=0,
                        exporter_base=base0, kind=KIND_VMM_FD,
                        version=VERSION_PIECES if len(pieces) > 1 else VERSION, allocation_id=ids[0],
                        more_pieces=tuple(zip(ids[1:], pieces[1:])))
        region.validate()
        return Export(region, fds)
    # Not VMM: cudaMalloc memory is a legacy region; pools without IPC are not exportable.
    ipc = _cuda.check("cuPointerGetAttribute", cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr))
    if not ipc:
        pool = 0
        try:
            pool = int(_cuda.check("cuPointerGetAttribute", cu.cuPointerGetAttribute(
                cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr)))
        except CudaError:
            pass
        what = ("memory of a stream-ordered pool (cudaMallocAsync) without an IPC handle type" if pool
                else "memory that is neither VMM nor legacy-IPC capable")
        raise NotExportable(ptr, what, FIX_POOL)
    return Export(Region.from_pointer(ptr, size))


def register_request(name: str, x: Export, shared: bool, space: bytes = b"") -> Any:
    """The register request (docs/protocol.md) of an export; its descriptors
    (``x.fds``) travel with it. ``space`` is the description of the KV space the
    memory is a region of (cudaipc.kv), if any."""
    r = RegisterRequest(name=name, size=x.size, device="GPU-" + _uuid_text(x.device), shared=shared,
                        region=x.region.to_bytes(), files=len(x.fds), space=space)
    return Request(register=r)


def send_register(conn: Any, name: str, x: Export, shared: bool, space: bytes = b"") -> Any:
    """Register export ``x`` under ``name`` on connection ``conn`` and return the reply.
    Descriptors beyond one packet's (MAX_FILES) are staged first (stage_files), as
    memory of PyTorch's expandable segments has one per 20 MiB piece; the register
    takes them all (docs/protocol.md, section 6.5)."""
    fds = list(x.fds)
    with conn.staging_lock:
        while len(fds) > MAX_FILES:
            conn.call(Request(stage_files=StageFilesRequest()), "register", name, fds=fds[:MAX_FILES])
            fds = fds[MAX_FILES:]
        return conn.call(register_request(name, x, shared, space), "register", name, fds=fds)


def _uuid_text(u: bytes) -> str:
    h = u.hex()
    return "%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


class VMMBuffer:
    """Device memory from ``cuMemCreate`` with the POSIX file-descriptor handle type,
    mapped read-write here: what a VMM-aware allocator gives, exportable by
    :func:`export_pointer` (and what :class:`Timeline` lives in). ``free()`` unmaps it;
    importers keep their own references."""

    def __init__(self, nbytes: int, ordinal: int = 0):
        cu = _cuda.driver()
        _cuda.make_current(ordinal)
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        g = int(_cuda.check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self.size = (nbytes + g - 1) // g * g
        self.handle = _cuda.check("cuMemCreate", cu.cuMemCreate(self.size, prop, 0))
        self.ptr = int(_cuda.check("cuMemAddressReserve", cu.cuMemAddressReserve(self.size, g, 0, 0)))
        _cuda.check("cuMemMap", cu.cuMemMap(self.ptr, self.size, 0, self.handle, 0))
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = ordinal
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _cuda.check("cuMemSetAccess", cu.cuMemSetAccess(self.ptr, self.size, [acc], 1))
        self.ordinal = ordinal

    def free(self) -> None:
        if self.ptr:
            cu = _cuda.driver()
            cu.cuMemUnmap(self.ptr, self.size)
            cu.cuMemAddressFree(self.ptr, self.size)
            cu.cuMemRelease(self.handle)
            self.ptr = 0


class Timeline:
    """Go's ``cudaipc.Timeline`` in Python: a 64-bit counter in fd-shared GPU memory that
    streams raise (``signal``, cuStreamWriteValue64) and wait on (``wait``,
    cuStreamWaitValue64, until the counter >= value): ordering across containers without
    IPC events or a shared /dev/shm. Share it with ``store.register(name, timeline)``;
    a reader maps it read-only and waits on the mapping (Go: Device.TimelineAt)."""

    def __init__(self, ordinal: int = 0, ptr: int = 0):
        self._buf = None
        if ptr == 0:
            self._buf = VMMBuffer(8, ordinal)
            ptr = self._buf.ptr
            _cuda.check("cuMemsetD8", _cuda.driver().cuMemsetD8(ptr, 0, 8))
            _cuda.synchronize(ordinal)
        self.ptr, self.ordinal, self.nbytes = ptr, ordinal, 8

    def signal(self, stream: int, value: int) -> None:
        """Queue on ``stream`` (a CUstream handle, e.g. torch's ``cuda_stream``) a write
        of ``value`` after the stream's earlier work."""
        cu = _cuda.driver()
        _cuda.check("cuStreamWriteValue64", cu.cuStreamWriteValue64(stream, self.ptr, value, 0))

    def wait(self, stream: int, value: int) -> None:
        """Make ``stream`` hold its later work until the counter is at least ``value``."""
        cu = _cuda.driver()
        _cuda.check("cuStreamWaitValue64", cu.cuStreamWaitValue64(stream, self.ptr, value, 0))

    def close(self) -> None:
        if self._buf is not None:
            self._buf.free()
            self._buf = None
