"""The put pipeline (the Go client's put in client.go and object.go): copy a tensor,
array or buffer into a new object and seal it, overlapping what can be overlapped.

- A GPU-to-GPU put copies on the source's current stream and records an
  interprocess event after the copy; the seal goes at once and the daemon answers
  it once the event completed, so the seal's round trip overlaps the copy.
- ``reserve_next`` creates the next put's object ahead (an unsealed object under a
  hidden name, ``.put-ahead.<pid>.<n>``); the next put of the same device, size and
  sharing copies into it and seals it under its own name (one round trip instead
  of two).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import os
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from . import _cuda
from . import _cuda_ctypes
from . import _store_pb2 as pb
from . import _views
from ._wire import Conn, Reply
from .errors import InvalidArgument, StoreError
from .info import ObjectInfo, TensorDesc, desc_to_pb
from .lease import Object, let_go, seal_as
from .region import event_descriptor, local_identity

__all__ = ["Source", "PutKey", "Ahead", "Putter", "PREPARE_AHEAD_BYTES", "SEAL_SPIN"]

_log = logging.getLogger("cudaipc")

# put(reserve_next=True) of at least this many bytes reads the next object's create
# reply while its own copy runs (a 256 MiB copy outlasts the round trip).
PREPARE_AHEAD_BYTES = 256 << 20
# How long put polls for the answer to a seal once its copy is done (unless polling
# is off: connect(spin=0) or CUDAIPC_SPIN=0).
SEAL_SPIN = 500e-6

_raw_stream: Any = None


def _torch_stream(idx: int) -> int:
    """The raw handle of PyTorch's current stream on GPU ``idx``: through the accessor
    PyTorch's own compiled code uses where it exists (a fraction of a microsecond),
    else torch.cuda.current_stream (several)."""
    global _raw_stream
    if _raw_stream is None:
        import torch
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", False)
    if _raw_stream:
        return int(_raw_stream(idx))
    import torch
    return int(torch.cuda.current_stream(idx).cuda_stream)


@dataclasses.dataclass
class Source:
    """What put copies from: ``nbytes`` at host address ``addr`` (``ordinal`` None) or
    device address ``addr`` on GPU ``ordinal`` (written on ``stream``); ``dtype`` and
    ``shape`` to record, if known; ``keep`` holds what owns the bytes until the copy."""
    nbytes: int
    dtype: Optional[str]
    shape: Optional[Tuple[int, ...]]
    addr: int
    ordinal: Optional[int]
    keep: Any
    stream: int = 0

    @classmethod
    def of(cls, data: Any, name: str = "") -> "Source":
        """The Source of a torch.Tensor, CuPy or NumPy array, or a bytes-like object
        (InvalidArgument, naming the put's ``name``, for what cannot be copied as bytes)."""
        mod = type(data).__module__
        if mod.startswith("torch"):
            t = data.contiguous()
            dn = str(t.dtype).replace("torch.", "")
            if t.is_cuda:
                idx = t.device.index
                return cls(t.numel() * t.element_size(), dn, tuple(t.shape), t.data_ptr(), idx, t,
                           _torch_stream(idx))
            return cls(t.numel() * t.element_size(), dn, tuple(t.shape), t.data_ptr(), None, t)
        if mod.startswith("cupy"):
            import cupy
            a = cupy.ascontiguousarray(data)   # (ndim >= 1: the shape is the input's)
            return cls(a.nbytes, a.dtype.name, tuple(data.shape), a.data.ptr, a.device.id, a,
                       cupy.cuda.get_current_stream().ptr)
        if mod.startswith("numpy"):
            import numpy as np
            if np.dtype(getattr(data, "dtype", None)).hasobject:
                raise InvalidArgument("put", name, "a NumPy array of dtype %s holds Python object references, not data: "
                                      "convert it to a numeric dtype first" % data.dtype)
            a = np.ascontiguousarray(data)     # (ndim >= 1: the shape is the input's)
            known = a.dtype.name in _views.DTYPES
            return cls(a.nbytes, _views.dtype_name(a.dtype) if known else None,
                       tuple(np.shape(data)) if known else None, a.ctypes.data, None, a)
        mv = memoryview(data)
        if "O" in mv.format:
            raise InvalidArgument("put", name, "the buffer holds Python object references (format %r), not data" % mv.format)
        if not mv.contiguous:
            raise InvalidArgument("put", name, "the buffer is not contiguous")
        mv = mv.cast("B")
        if not mv.contiguous:
            raise InvalidArgument("put", name, "the buffer is not contiguous")
        buf = (ctypes.c_char * mv.nbytes).from_buffer_copy(mv) if mv.readonly else (ctypes.c_char * mv.nbytes).from_buffer(mv)
        return cls(mv.nbytes, None, None, ctypes.addressof(buf), None, (mv, buf))

    def copy_to(self, addr: int, ordinal: Optional[int]) -> None:
        """Copy the bytes to ``addr`` (a device address on GPU ``ordinal``, or host
        memory), finished when this returns."""
        if self.nbytes == 0:
            return
        if ordinal is None and self.ordinal is None:
            ctypes.memmove(addr, self.addr, self.nbytes)
            return
        cu = _cuda.driver()
        if ordinal is not None and self.ordinal is not None:
            with _cuda.on(self.ordinal):
                _cuda.memcpy_dtod(addr, self.addr, self.nbytes, cu.CUstream(self.stream))
        elif ordinal is not None:
            with _cuda.on(ordinal):
                _cuda.memcpy_htod(addr, self.addr, self.nbytes)
        else:
            assert self.ordinal is not None
            with _cuda.on(self.ordinal):
                _cuda.check("cuStreamSynchronize", cu.cuStreamSynchronize(cu.CUstream(self.stream)))
                _cuda.memcpy_dtoh(addr, self.addr, self.nbytes)


@dataclasses.dataclass(frozen=True)
class PutKey:
    """What an object made ahead must match for a put to use it."""
    device: str     # the protocol's device string
    nbytes: int
    shared: bool


@dataclasses.dataclass
class Ahead:
    """The object reserve_next made ahead: its create request ``rid`` under the name
    ``hidden``, and the Object once its reply was read."""
    key: PutKey
    hidden: str
    rid: int
    obj: Optional[Object] = None


def seal_event(ordinal: int) -> _cuda_ctypes.IPCEvent:
    """An interprocess event of GPU ``ordinal`` with its EventDescriptor
    (``descriptor``, docs/region.md), which the daemon opens to wait on it."""
    ev = _cuda_ctypes.IPCEvent(ordinal)
    ns, boot = local_identity()
    ev.descriptor = event_descriptor(ev.ipc_handle, _cuda.uuids()[ordinal], os.getpid(), ns, boot)
    return ev


class Putter:
    """One connection's put: its object made ahead and its interprocess events.

    ``create(name, nbytes, device, shared=, dtype=, shape=, _spin=)`` is Store.create;
    ``created(reply, name, nbytes, shared=)`` makes the Object of a create's reply;
    ``device(device, op, name)`` is the protocol's device string (Store._device)."""

    def __init__(self, conn: Conn, create: Callable[..., Object], created: Callable[..., Object],
                 device: Callable[[Any, str, str], str]):
        self.conn = conn
        self.create = create
        self.created = created
        self.device = device
        self.ahead_lock = threading.Lock()
        self.ahead: Optional[Ahead] = None
        self.ahead_seq = 0
        self.event_lock = threading.Lock()
        self.events: Dict[int, Any] = {}   # GPU ordinal -> its seal event
        self.events_ok = True

    def forget_ahead(self) -> None:
        """Drop the object made ahead (the connection closes: the daemon aborts it)."""
        with self.ahead_lock:
            self.ahead = None

    def close_events(self) -> None:
        """Destroy the seal events (the connection closed)."""
        events, self.events = self.events, {}
        for ev in events.values():
            ev.close()

    def put(self, name: str, data: Any, device: Any, shared: bool, reserve_next: bool) -> ObjectInfo:
        """Store.put."""
        src = Source.of(data, name)
        if device is None:
            device = src.ordinal if src.ordinal is not None else "host"
        key = PutKey(self.device(device, "put", name), src.nbytes, shared)
        obj = self.take_ahead(key)
        if obj is None:
            # A GPU put polls for the create's answer as for its seal's (below).
            obj = self.create(name, src.nbytes, device, shared=shared, dtype=src.dtype, shape=src.shape,
                              _spin=SEAL_SPIN if src.ordinal is not None else None)
        if src.ordinal is not None and obj.ordinal is not None:
            ev = self._take_event(src.ordinal)
            if ev is not None:
                try:
                    self._seal_after_event(obj, src, ev, name, key if reserve_next else None)
                finally:
                    self.event_lock.release()
                return ObjectInfo(name, src.nbytes, obj.device, True, 0, shared, os.getuid(),
                                  datetime.datetime.now(datetime.timezone.utc), None, obj.tensor_desc)
        try:
            src.copy_to(obj.data_ptr, obj.ordinal)
        except BaseException:
            obj.abort()
            raise
        if obj.name != name:
            seal_as(obj, name, TensorDesc.of(src.nbytes, src.dtype, src.shape, None, name))
        else:
            obj.seal()
        if reserve_next:
            self.reserve(key)
        return ObjectInfo(name, src.nbytes, obj.device, True, 0, shared, os.getuid(),
                          datetime.datetime.now(datetime.timezone.utc), None, obj.tensor_desc)

    def _take_event(self, ordinal: int) -> Optional[Any]:
        """The event of GPU ``ordinal``, locked for one put; None when another put
        uses it or events do not work here."""
        if not self.events_ok or not self.event_lock.acquire(blocking=False):
            return None
        ev = self.events.get(ordinal)
        if ev is None:
            try:
                ev = self.events[ordinal] = seal_event(ordinal)
            except Exception as e:  # noqa: BLE001 - no interprocess events here: seal after a sync
                _log.debug("cudaipc: no interprocess event for put (%s); puts synchronize before sealing", e)
                self.events_ok = False
                self.event_lock.release()
                return None
        return ev

    def _seal_after_event(self, obj: Object, src: Source, ev: Any, name: str, reserve: Optional[PutKey]) -> None:
        """put's copy into its object (or one created ahead, sealed under ``name``) by a
        seal the daemon answers once ``ev``, recorded after the copy, has completed: the
        seal's round trip overlaps the copy. With ``reserve`` (reserve_next), the next
        put's object is created while the copy runs too. A daemon that cannot use the
        event (another PID namespace, say) gets a plain seal after a sync, and this
        connection stops trying."""
        hidden = obj.name
        sealed = False
        try:
            # The copy first: what follows overlaps it.
            _cuda_ctypes.copy_and_record(obj.data_ptr, src.addr, src.nbytes, src.stream, ev)
            if hidden != name:   # created ahead: published under name, with put's descriptor
                desc = TensorDesc.of(src.nbytes, src.dtype, src.shape, None, name)
                req = pb.Request(seal=pb.SealRequest(name=hidden, rename=name, wait_event=ev.descriptor))
                if desc is not None:
                    req.seal.tensor.CopyFrom(desc_to_pb(desc))
            else:                # created by this put, with its descriptor
                desc = obj.tensor_desc
                req = pb.Request(seal=pb.SealRequest(name=name, wait_event=ev.descriptor))
            try:
                # The seal goes now, so the daemon is awake and waiting on the event
                # when the copy ends; this thread waits for the copy in the driver (no
                # sleep on the socket to wake from), then polls for the answer, which
                # comes a few microseconds later.
                rid = self.conn.send(req)
                if reserve is not None:
                    self.reserve(reserve)
                    if src.nbytes >= PREPARE_AHEAD_BYTES:
                        # A long copy: read the reply and map the object now, not
                        # in the next put.
                        self.prepare_ahead()
                try:
                    _cuda_ctypes.event_synchronize(ev)
                finally:
                    # The copy is done: the daemon, polling the event, answers within
                    # microseconds; poll longer than usual rather than sleep.
                    self.conn.result(rid, "seal", name, spin=SEAL_SPIN)
                sealed = True
            except InvalidArgument as e:
                if not (e.message or "").startswith("wait_event"):
                    raise
                _log.debug("cudaipc: the daemon cannot wait on this process's events (%s); puts synchronize before sealing", e.message)
                self.events_ok = False
                _cuda_ctypes.stream_synchronize(src.ordinal, src.stream)  # type: ignore[arg-type]
                req.seal.ClearField("wait_event")
                self.conn.call(req, "seal", name)
                sealed = True
        finally:
            if not sealed:
                # The copy may still write there: it ends before the memory goes.
                try:
                    _cuda_ctypes.stream_synchronize(src.ordinal, src.stream)  # type: ignore[arg-type]
                finally:
                    let_go(obj, "aborted")
                    self.conn.send_detached(pb.Request(abort=pb.AbortRequest(name=hidden)))
        # Sealed: the copy is complete (the daemon saw the event), and the object
        # keeps its arena, so the mapping may go now.
        let_go(obj, "sealed", name, desc)

    def reserve(self, key: PutKey) -> None:
        """Send the create of the next put's object (put's reserve_next); its reply is
        read by the put that uses it."""
        with self.ahead_lock:
            self.ahead_seq += 1
            hidden = ".put-ahead.%d.%d" % (os.getpid(), self.ahead_seq)
        try:
            rid = self.conn.send(pb.Request(create=pb.CreateRequest(name=hidden, size=key.nbytes, device=key.device,
                                                                    shared=key.shared)))
        except StoreError:
            return
        with self.ahead_lock:
            old, self.ahead = self.ahead, Ahead(key, hidden, rid)
        if old is not None:
            self._give_back(old)

    def _give_back(self, a: Ahead) -> None:
        """Abort an object created ahead that no put will use."""
        if a.obj is None:
            self.conn.abandon(a.rid, "create", a.hidden)
        else:
            try:
                a.obj.abort()
            except StoreError:
                pass

    def prepare_ahead(self) -> None:
        """Read the reply of the create sent ahead and map its object now, so that the
        next put finds it ready."""
        with self.ahead_lock:
            a = self.ahead
            if a is None or a.obj is not None:
                return
            self.ahead = None
        try:
            a.obj = self._ahead_object(a)
        except StoreError as e:   # a bad answer (cleaned up): the next put creates as usual
            _log.debug("cudaipc: the object made ahead is unusable: %s", e)
            return
        if a.obj is None:
            return
        with self.ahead_lock:
            if self.ahead is None:
                self.ahead = a
                return
        self._give_back(a)   # another put reserved meanwhile

    def take_ahead(self, key: PutKey) -> Optional[Object]:
        """The object created ahead for a put of key, or None (then a put that does not
        match gives it back)."""
        with self.ahead_lock:
            a, self.ahead = self.ahead, None
        if a is None:
            return None
        if a.key != key:
            self._give_back(a)
            return None
        if a.obj is not None:
            return a.obj
        return self._ahead_object(a)

    def _ahead_object(self, a: Ahead) -> Optional[Object]:
        """The Object of the create sent ahead, or None when it failed."""
        try:
            r = self.conn.wait(a.rid)
        except StoreError:
            return None
        if r.resp.HasField("error") and r.resp.error.code != 0:
            if r.fd >= 0:
                os.close(r.fd)
            return None   # e.g. the store was full then: put creates as usual
        return self.created(r, a.hidden, a.key.nbytes, shared=a.key.shared)

