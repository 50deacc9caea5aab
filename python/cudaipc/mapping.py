"""Importing a region: ``import_region(region[, fds]) -> Mapping``, with or without the
store. Legacy (cuda-ipc) handles are opened once per process and GPU and counted
(_cuda.ipc_open); vmm-fd regions, of one allocation or several (docs/region.md,
version 2), are mapped once per process, GPU and access for the same pieces in the
same order, and counted here: the second import of a registered tensor costs no
driver call."""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import _cuda
from . import _views
from .errors import CudaError
from .region import KIND_VMM_FD, Region, decode_region, local_identity

__all__ = ["Mapping", "import_region", "map_region"]

_vmm_lock = threading.Lock()
_VMMKey = Tuple[Tuple[Tuple[bytes, int], ...], int, bool]
_vmm: Dict[_VMMKey, List[Any]] = {}   # (pieces, ordinal, writable) -> [VMMRange, refs]


def _vmm_open(r: Region, fds: Sequence[int], ordinal: int, writable: bool) -> Tuple[int, Callable[[], None]]:
    """The base of the mapping of r's pieces (imported from ``fds`` if new) and the
    close that drops this reference."""
    key: _VMMKey = (r.pieces, ordinal, writable)
    with _vmm_lock:
        found = _vmm.get(key)
        if found is None:
            found = [_cuda.VMMRange(list(fds), [n for _, n in r.pieces], ordinal, writable), 0]
            _vmm[key] = found
        e: List[Any] = found
        e[1] += 1
        base = int(e[0].ptr)

    def close() -> None:
        with _vmm_lock:
            e[1] -= 1
            if e[1] > 0:
                return
            if _vmm.get(key) is e:
                del _vmm[key]
        e[0].close()
    return base, close


def vmm_mapped_count() -> int:
    """How many vmm-fd ranges this process maps through import_region (for tests)."""
    with _vmm_lock:
        return len(_vmm)


class _Mapped:
    """The open mapping; views keep it alive, and its finalizer closes the handle."""

    def __init__(self, r: Region, ptr: int, ordinal: int, close: Any):
        self.region = r
        self.addr = ptr
        self.ordinal = ordinal
        self.nbytes = r.size
        self.finalizer = weakref.finalize(self, close) if close is not None else None


def _close_ipc(handle: bytes, bid: int, ordinal: int) -> None:
    _cuda.ipc_close(handle, bid, ordinal)


class Mapping:
    """A region mapped into this process. ``tensor()`` and ``cupy()`` return zero-copy
    views; the mapping stays open while the Mapping or any view is alive, and
    ``close()`` gives up the Mapping's own hold."""

    def __init__(self, m: _Mapped):
        self._m: Optional[_Mapped] = m
        self.region = m.region

    @property
    def data_ptr(self) -> int:
        """The region's first byte in this process."""
        return self._live().addr

    @property
    def ordinal(self) -> int:
        """The GPU (this process's ordinal) the region is mapped through."""
        return self._live().ordinal

    def _live(self) -> _Mapped:
        if self._m is None:
            raise ValueError("the Mapping is closed; views made before stay valid")
        return self._m

    def tensor(self, dtype: Any = "uint8", shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy CUDA ``torch.Tensor`` of the region."""
        m = self._live()
        lay = _views.resolve_layout(m.nbytes, None, dtype, shape)
        return _views.torch_cuda_view(m, m.addr, lay, m.ordinal, False)

    def cupy(self, dtype: Any = "uint8", shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy ``cupy.ndarray`` of the region."""
        m = self._live()
        lay = _views.resolve_layout(m.nbytes, None, dtype, shape)
        return _views.cupy_view(m, m.addr, m.nbytes, lay, m.ordinal)

    def read(self) -> bytes:
        """A copy of the region's bytes."""
        m = self._live()
        buf = ctypes.create_string_buffer(m.nbytes)
        with _cuda.on(m.ordinal):
            _cuda.memcpy_dtoh(ctypes.addressof(buf), m.addr, m.nbytes)
        return buf.raw

    def close(self) -> None:
        """Give up the Mapping's hold (views keep the memory mapped). Idempotent."""
        self._m = None

    def __enter__(self) -> "Mapping":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def map_region(r: Region, fds: Sequence[int] = (), writable: bool = False) -> Tuple[int, int, Optional[Callable[[], None]]]:
    """Map ``r`` (validated) as :func:`import_region` does; return the address of its
    first byte, the GPU ordinal it is mapped through, and the close that drops this
    reference (None when nothing was mapped: the exporter's own memory)."""
    ns, boot = local_identity()
    if r.kind == KIND_VMM_FD:
        if r.boot_id != boot:
            raise CudaError("import_region", "other machine", "the region comes from another machine or boot")
        if len(fds) != len(r.pieces):
            raise ValueError("import_region: a vmm-fd region of %d allocations needs %d descriptors, got %d"
                             % (len(r.pieces), len(r.pieces), len(fds)))
        ordinal = _cuda.pick_ordinal(r.device)
        base, close = _vmm_open(r, fds, ordinal, writable)
        return base + r.offset, ordinal, close
    if fds:
        raise ValueError("import_region: descriptors are for vmm-fd regions; this one is cuda-ipc")
    if r.boot_id != boot:
        raise CudaError("import_region", "other machine", "the region comes from another machine or boot")
    if r.pid_namespace != ns:
        raise CudaError("import_region", "other PID namespace",
                        "legacy CUDA IPC finds the exporter by pid: share a PID namespace, or use the store daemon with --gpu-share fd")
    ordinal = _cuda.pick_ordinal(r.device)
    if r.exporter_pid == os.getpid():
        # The driver refuses to open a handle in its exporter: the memory is here.
        cu = _cuda.driver()
        with _cuda.on(ordinal):
            bid = int(_cuda.check("cuPointerGetAttribute", cu.cuPointerGetAttribute(
                cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, r.exporter_base)))
        if bid != r.buffer_id:
            raise CudaError("import_region", "stale region", "the allocation at %#x was freed" % r.exporter_base)
        return r.exporter_base + r.offset, ordinal, None
    base = _cuda.ipc_open(r.handle, r.buffer_id, ordinal)
    return base + r.offset, ordinal, lambda: _close_ipc(r.handle, r.buffer_id, ordinal)


def import_region(region: Union[Region, bytes, str], fds: Sequence[int] = (), writable: bool = False) -> Mapping:
    """Map a region (a Region, or its binary or JSON encoding) exported by another
    process, through the GPU with the region's UUID (or the first visible GPU, over
    peer access). A vmm-fd region needs its descriptors (``fds``, one per piece, first
    piece first; not taken: close them after the call) and is mapped read-only unless
    ``writable`` (a write through it fails or faults, and changes nothing); it works
    across PID namespaces. Mappings are shared within the process and counted."""
    r = region if isinstance(region, Region) else decode_region(region)
    r.validate()
    addr, ordinal, close = map_region(r, fds, writable)
    return Mapping(_Mapped(r, addr, ordinal, close))
