"""Importing a region without the store: ``import_region(region) -> Mapping``."""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any, Optional, Sequence, Union

from . import _cuda
from . import _views
from .errors import CudaError
from .region import Region, decode_region, local_identity

__all__ = ["Mapping", "import_region"]


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


def import_region(region: Union[Region, bytes, str]) -> Mapping:
    """Map a region (a Region, or its binary or JSON encoding) exported by another
    process, through the GPU with the region's UUID (or the first visible GPU, over
    peer access). Handles are opened once per process and reference-counted."""
    r = region if isinstance(region, Region) else decode_region(region)
    r.validate()
    ns, boot = local_identity()
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
        return Mapping(_Mapped(r, r.exporter_base + r.offset, ordinal, None))
    base = _cuda.ipc_open(r.handle, r.buffer_id, ordinal)
    return Mapping(_Mapped(r, base + r.offset, ordinal, lambda: _close_ipc(r.handle, r.buffer_id, ordinal)))
