"""Memory records: what a lease or an object maps, and the owners whose collection
ends it (the Go client's lease.go / object.go bookkeeping).

A ``Record`` describes one placement: where its bytes are in this process, what
the daemon must hear when it ends, and (for a lease granted with a lease-table
slot, docs/protocol.md 6.7) the slot's words. It is the one record type: a Lease
and an Object describe themselves from it, the lease table keeps it while the
lease is idle, and the owners below point at it.

Views keep an *owner* alive, never the record itself, so that the lease can end as
soon as the last view goes while an idle lease's record stays in the table:

- ``Hold``: the first owner of a placement (from a get or a create). When the last
  reference goes, a lease with a slot is released by one compare-and-swap (kept
  idle for a later get of the name), else the end request goes to the daemon; an
  object never sealed is aborted.
- ``Taken``: the owner of a lease taken back through the lease table, made on every
  take-back with nothing but its record and view data (the hot path).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Dict, Optional

from . import _cuda
from . import _views
from ._wire import Conn, HostArena

__all__ = ["Record", "Hold", "Taken", "GPUClose", "view", "read"]


class GPUClose:
    """Closes a GPU mapping once (legacy IPC reference or imported arena reference)."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args, self.done = fn, args, False
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
        self.fn(*self.args)


class Record:
    """One placement's memory: ``addr`` (host address, or device address of a GPU
    object), ``nbytes``, ``device`` ("host" or a GPU UUID), ``ordinal`` (the GPU this
    process maps it through; None for host), ``share`` (a SHARE_* kind), the
    mappings it keeps (``arena`` for host memory, ``gpu_close`` for a GPU arena
    reference), the producer's ``tensor`` descriptor, ``end_request`` (what the
    daemon hears when it ends: a release or an abort), ``views`` (default view
    construction data, by kind, kept with an idle lease), and for leases ``name``,
    ``lease_id``, ``info_pb`` (and ``info``, its decoded form once a lease
    asked for it, kept with an idle lease) and, with a lease-table slot, ``table`` and the slot's
    words (set by LeaseTable.prepare)."""

    __slots__ = ("conn", "name", "nbytes", "device", "addr", "ordinal", "writable", "share", "arena",
                 "gpu_close", "tensor", "end_request", "views", "lease_id", "info_pb", "info", "placement",
                 "table", "slot", "gen", "arena_id", "w_held", "w_idle", "p_slot", "p_held", "p_idle")

    def __init__(self, conn: Conn, name: str, nbytes: int, device: str, addr: int, ordinal: Optional[int],
                 writable: bool, share: str, arena: Optional[HostArena], gpu_close: Optional[GPUClose],
                 tensor: Any, end_request: Any):
        self.conn = conn
        self.name = name
        self.nbytes = nbytes
        self.device = device
        self.addr = addr
        self.ordinal = ordinal
        self.writable = writable
        self.share = share
        self.arena = arena
        self.gpu_close = gpu_close
        self.tensor = tensor
        self.end_request = end_request
        self.views: Dict[str, Any] = {}
        self.lease_id = 0
        self.info_pb: Any = None
        self.info: Any = None      # info_pb decoded (lease.Lease.info), for every take-back of the lease
        self.placement: Any = None  # a lease's placement, whose region the info leaves out
        self.table: Any = None     # the LeaseTable of a lease granted with a slot
        self.arena_id = 0

    @property
    def is_gpu(self) -> bool:
        return self.ordinal is not None

    def end(self) -> None:
        """Unmap GPU memory first (the daemon may free it as soon as it hears), then
        tell the daemon (pipelined: the reply is not awaited)."""
        try:
            if self.gpu_close is not None:
                self.gpu_close()
        finally:
            if self.end_request is not None:
                self.conn.send_detached(self.end_request)

    def unmap(self) -> None:
        """Let go of the GPU mapping (an object sealed or aborted explicitly)."""
        if self.gpu_close is not None:
            self.gpu_close()

    def drop(self) -> None:
        """The daemon ended the idle lease: let go of its GPU arena reference (the
        lease table's call)."""
        if self.gpu_close is not None:
            self.gpu_close()


class Hold:
    """The first owner of a placement (see the module's documentation)."""

    __slots__ = ("rec", "views", "alive", "__weakref__")

    def __init__(self, rec: Record):
        self.rec = rec
        self.views = rec.views
        self.alive = True

    def detach(self) -> None:
        """Forget the end request (the object was sealed or aborted explicitly)."""
        self.alive = False

    def __del__(self) -> None:
        # CPython runs this as soon as the last view or lease lets go: the lease
        # ends then, deterministically (cheaper than weakref.finalize on the hot path).
        if self.alive:
            self.alive = False
            try:
                r = self.rec
                t = r.table
                if t is not None and t.release(r):
                    return
                r.end()
            except Exception:  # noqa: BLE001 - interpreter shutdown, closed connection
                pass


class Taken:
    """The owner of a lease taken back through the lease table: made without
    __init__ on every take-back (``rec`` and ``views`` set by the taker). When the
    last reference goes, the lease is released by one compare-and-swap, else
    through the socket."""

    __slots__ = ("rec", "views")
    rec: Record
    views: Dict[str, Any]

    def __del__(self) -> None:
        # Runs once (PEP 442), as soon as the last view or the Lease lets go.
        try:
            r = self.rec
            if not r.table.release(r):
                r.end()
        except Exception:  # noqa: BLE001 - interpreter shutdown, closed connection
            pass


def view(rec: Record, owner: Any, kind: str, dtype: Any, shape: Any) -> Any:
    """A zero-copy view of ``kind`` ("memoryview", "numpy", "tensor" or "cupy") of
    rec's bytes that keeps ``owner`` alive."""
    lay = _views.resolve_layout(rec.nbytes, rec.tensor, dtype, shape)
    ro = not rec.writable
    gpu = rec.ordinal
    if kind == "memoryview":
        if gpu is not None:
            raise TypeError("memoryview() needs a host object; this one is on %s: use tensor() or cupy()" % rec.device)
        return _views.host_memoryview(owner, rec.addr, rec.nbytes, ro)
    if kind == "numpy":
        if gpu is not None:
            # Host code cannot read device memory in place: a read-only copy.
            buf = ctypes.create_string_buffer(rec.nbytes)
            with _cuda.on(gpu):
                _cuda.memcpy_dtoh(ctypes.addressof(buf), rec.addr, rec.nbytes)
            return _views.numpy_view(buf, ctypes.addressof(buf), lay, True)
        return _views.numpy_view(owner, rec.addr, lay, ro)
    if kind == "tensor":
        if gpu is not None:
            return _views.torch_cuda_view(owner, rec.addr, lay, gpu, ro)
        return _views.torch_host_view(owner, rec.addr, lay, ro)
    if kind == "cupy":
        if gpu is None:
            raise TypeError("cupy() needs a GPU object; this one is in host memory: use numpy()")
        return _views.cupy_view(owner, rec.addr, rec.nbytes, lay, gpu)
    raise AssertionError(kind)


def read(rec: Record) -> bytes:
    """A copy of rec's bytes (host or GPU)."""
    if rec.ordinal is None:
        return ctypes.string_at(rec.addr, rec.nbytes)
    buf = ctypes.create_string_buffer(rec.nbytes)
    with _cuda.on(rec.ordinal):
        _cuda.memcpy_dtoh(ctypes.addressof(buf), rec.addr, rec.nbytes)
    return buf.raw


def write(rec: Record, data: Any, offset: int) -> None:
    """Copy the bytes of buffer ``data`` into rec at ``offset`` (checked by the caller)."""
    src = memoryview(data).cast("B")
    n = src.nbytes
    if rec.ordinal is None:
        ctypes.memmove(rec.addr + offset, (ctypes.c_char * n).from_buffer_copy(src) if src.readonly else (ctypes.c_char * n).from_buffer(src), n)
        return
    tmp = (ctypes.c_char * n).from_buffer_copy(src)
    with _cuda.on(rec.ordinal):
        _cuda.memcpy_htod(rec.addr + offset, ctypes.addressof(tmp), n)


class ManifestFD:
    """A bundle's manifest memfd, closed once (when read, or when collected)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass
