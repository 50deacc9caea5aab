"""Lease (a read-only hold on a sealed object) and Object (a new object being
written): the Go client's lease.go and object.go. Both describe themselves from one
memory Record (_memory.py) and share their views through ``MemoryViews``."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Optional, Sequence

from . import _memory
from . import _store_pb2 as pb
from . import _views
from ._memory import Hold, ManifestFD, Record
from ._wire import Conn
from .errors import InvalidArgument
from .info import LEGACY_GPU_SHARE, ObjectInfo, TensorDesc, desc_to_pb, info_from_pb
from .region import Region

__all__ = ["Lease", "Object", "MemoryViews"]
# The package's own calls on Leases and Objects (not for users): let_go, seal_as,
# retaken and view_owner below.


class MemoryViews:
    """The views a Lease and an Object share. A subclass keeps its owner (a
    _memory.Hold or Taken, None once it let go) in ``_mem`` and its Record in ``_rec``,
    and says in ``_gone()`` why there is no memory any more."""

    __slots__ = ()
    _mem: Any
    _rec: Record

    def _gone(self) -> Exception:
        raise NotImplementedError

    def _live(self) -> Any:
        """The owner views keep alive; raises once the memory was let go."""
        m = self._mem
        if m is None:
            raise self._gone()
        return m

    @property
    def name(self) -> str:
        return self._rec.name

    @property
    def size(self) -> int:
        """The object's size in bytes."""
        return self._rec.nbytes

    @property
    def device(self) -> str:
        """"host" or the GPU's UUID."""
        return self._rec.device

    @property
    def data_ptr(self) -> int:
        """The address of the object's first byte in this process (device address for GPU objects)."""
        self._live()
        return self._rec.addr

    @property
    def ordinal(self) -> Optional[int]:
        """The GPU (this process's ordinal) a GPU object is mapped through; None for host."""
        self._live()
        return self._rec.ordinal

    @property
    def share(self) -> str:
        """How the object's memory reached this process: "host", "cuda-ipc" or "vmm-fd"
        (the protocol's Placement kinds; info.SHARE_*)."""
        self._live()
        return self._rec.share

    @property
    def gpu_share(self) -> str:
        """The old spelling of :attr:`share`: "ipc" or "fd" for GPU objects, "" for host."""
        return LEGACY_GPU_SHARE[self.share]

    def tensor(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy ``torch.Tensor`` of the object on its device (CUDA for GPU objects,
        CPU for host ones). dtype and shape default to what the producer recorded, else
        uint8 bytes; a shape may contain one -1."""
        m = self._live()
        return _memory.view(m.rec, m, "tensor", dtype, shape)

    def cupy(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy ``cupy.ndarray`` of a GPU object."""
        m = self._live()
        return _memory.view(m.rec, m, "cupy", dtype, shape)

    def numpy(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy ``numpy.ndarray`` of a host object (read-only for a Lease); of a GPU
        object, a read-only copy of its bytes."""
        m = self._live()
        return _memory.view(m.rec, m, "numpy", dtype, shape)

    def memoryview(self) -> memoryview:
        """A zero-copy memoryview of a host object's bytes (read-only for a Lease)."""
        m = self._live()
        return _memory.view(m.rec, m, "memoryview", None, None)  # type: ignore[no-any-return]

    def read(self) -> bytes:
        """A copy of the object's bytes (host or GPU)."""
        m = self._live()
        return _memory.read(m.rec)


class Lease(MemoryViews):
    """A read-only lease on a sealed object (from :meth:`Store.get`).

    ``tensor()``, ``cupy()``, ``numpy()`` and ``memoryview()`` return zero-copy views.
    The lifetime rule: the object's memory stays leased while the Lease *or any view
    made from it* is alive. ``release()`` (or leaving a ``with`` block) gives up the
    Lease's own hold; the daemon hears of the release when the last view is collected
    too. A killed process's leases are released by the daemon.

    GPU memory is writable on the device (CUDA cannot map it read-only) but must not
    be written; host views are read-only (writing through a PyTorch CPU tensor faults).
    """

    __slots__ = ("_mem", "_rec", "_info", "_manifest")

    def __init__(self, mem: Any, rec: Record, manifest: Optional[ManifestFD] = None):
        self._mem: Any = mem       # a Hold or a Taken; None once released
        self._rec = rec
        self._info: Optional[ObjectInfo] = None
        self._manifest: Any = manifest   # a bundle's manifest: its ManifestFD, then its bytes

    def _gone(self) -> Exception:
        return InvalidArgument("use", self._rec.name, "the lease was released; views made before stay valid")

    @property
    def version(self) -> int:
        """The version of a versioned name this lease holds (0 for a plain object)."""
        p = self._rec.info_pb
        return int(p.version) if p is not None else 0

    @property
    def lease_id(self) -> int:
        return self._rec.lease_id

    @property
    def tensor_desc(self) -> Optional[TensorDesc]:
        """The producer's dtype/shape/strides, if it recorded them."""
        return self._rec.tensor  # type: ignore[no-any-return]

    def manifest_bytes(self) -> bytes:
        """A bundle's manifest, as its creator wrote it: a safetensors header (JSON).
        Read from the memfd the daemon sent beside the lease, never from the object."""
        m = self._manifest
        if m is None:
            raise InvalidArgument("get", self._rec.name, "the object is not a bundle (it has no manifest)")
        if isinstance(m, ManifestFD):
            p = self._rec.info_pb
            size = p.manifest_size if p is not None else 0
            try:
                data = os.pread(m.fd, size, 0)
            finally:
                m.close()
            self._manifest = m = data
        return m  # type: ignore[no-any-return]

    @property
    def info(self) -> ObjectInfo:
        """The object, as the daemon described it when granting the lease."""
        if self._info is None:
            d = self._rec
            p = d.info_pb
            if d.info is not None:
                self._info = d.info
            elif p is not None and p.name:
                info = info_from_pb(p)
                pl = d.placement
                if info.region is None and pl is not None and pl.region:
                    # A get's info leaves the region out: it is the placement's, at
                    # the placement's offset (decoded here, when asked for).
                    try:
                        info = dataclasses.replace(info, region=Region.from_bytes(pl.region).sub(pl.offset, pl.size))
                    except Exception:  # noqa: BLE001 - a newer daemon's region kind: leave it out
                        pass
                self._info = d.info = info
            else:
                self._info = ObjectInfo(d.name, d.nbytes, d.device, True, 1, False, 0,
                                        datetime.datetime.now(datetime.timezone.utc), None, d.tensor)
        return self._info

    def tensor(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy ``torch.Tensor`` of the object on its device (CUDA for GPU objects,
        CPU for host ones). dtype and shape default to what the producer recorded, else
        uint8 bytes; a shape may contain one -1."""
        m = self._mem
        if m is None:
            m = self._live()
        if dtype is None and shape is None:
            # The hot path: the construction data of the default view is made once per
            # placement (and kept with an idle lease for the next get).
            mk = m.views.get("tensor")
            if mk is None:
                r = m.rec
                mk = m.views["tensor"] = _views.tensor_maker(r.addr, _views.resolve_layout(r.nbytes, r.tensor),
                                                            r.ordinal, not r.writable)
            return mk(m)
        return _memory.view(m.rec, m, "tensor", dtype, shape)

    def release(self) -> None:
        """Give up this Lease's hold; views made from it keep the memory leased until
        they are collected. Idempotent."""
        self._mem = None

    @property
    def released(self) -> bool:
        return self._mem is None

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        d = self._rec
        return "<cudaipc.Lease %r %d bytes on %s%s>" % (d.name, d.nbytes, d.device,
                                                         " released" if self._mem is None else "")


class Object(MemoryViews):
    """A new object being written (from :meth:`Store.create`): fill its memory in place
    through ``tensor()``, ``cupy()``, ``numpy()``, ``memoryview()`` or ``write()``, then
    ``seal()`` (publish) or ``abort()``. Views of an Object must not be used after
    seal or abort (GPU mappings are closed then, as the protocol requires); those of
    a shared host object turn read-only at its seal (a write through them faults),
    so that no one can change it any more. An Object collected unsealed is aborted."""

    __slots__ = ("_conn", "_mem", "_rec", "_state", "_desc", "_shared", "version", "shard", "__weakref__")

    def __init__(self, conn: Conn, rec: Record, desc: Optional[TensorDesc], version: int = 0, shard: int = 0,
                 shared: bool = False):
        self._conn = conn
        self._rec = rec
        self._mem: Optional[Hold] = Hold(rec)
        self._state = "open"
        self._desc = desc
        self._shared = shared    # a shared object: a host one has an arena of its own
        self.version = version   # for a shard of a version: its version
        self.shard = shard

    def _gone(self) -> Exception:
        return InvalidArgument("write", self._rec.name, "the object is %s: it can no longer be written" % self._state)

    @property
    def state(self) -> str:
        """"open", "sealed" or "aborted"."""
        return self._state

    @property
    def tensor_desc(self) -> Optional[TensorDesc]:
        """The dtype/shape/strides recorded for readers, if any."""
        return self._desc

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy bytes (any buffer) into the object at offset, host or GPU."""
        m = self._live()
        n = memoryview(data).nbytes
        if offset < 0 or offset + n > m.rec.nbytes:
            raise InvalidArgument("write", self.name, "[%d, %d) is outside the %d-byte object" % (offset, offset + n, m.rec.nbytes))
        _memory.write(m.rec, data, offset)

    def seal(self) -> None:
        """Publish the object: readers may get it from now on. Device work writing it
        must be complete (synchronize your stream first)."""
        self._finish("seal", pb.Request(seal=pb.SealRequest(name=self.name, version=self.version, shard=self.shard)))

    def abort(self) -> None:
        """Discard the object."""
        self._finish("abort", pb.Request(abort=pb.AbortRequest(name=self.name, version=self.version, shard=self.shard)))

    def _finish(self, op: str, req: Any, name: Optional[str] = None) -> None:
        if self._mem is None:
            raise InvalidArgument(op, self.name, "object already %s" % self._state)
        # The GPU mapping goes before the daemon hears: it may free the arena at once.
        self._let_go("sealed" if op == "seal" else "aborted")
        self._conn.call(req, op, name or self.name)
        r = self._rec
        if op == "seal" and self._shared and r.arena is not None:
            # Sealed: the host views made before become read-only, and the daemon
            # can seal the memory against writes (creator_can_write false).
            r.writable = False
            self._conn.seal_host_arena(r.arena)

    def _let_go(self, state: str, name: Optional[str] = None, desc: Optional[TensorDesc] = None) -> None:
        """Unmap the object and mark it ``state`` without telling the daemon (the
        caller does); with ``name``, it was sealed under that name with ``desc``."""
        m = self._mem
        if m is not None:
            m.detach()
            self._rec.unmap()
            self._mem = None
        self._state = state
        if name is not None:
            self._rec.name, self._desc = name, desc

    def _seal_as(self, name: str, desc: Optional[TensorDesc]) -> None:
        """Seal this object (created ahead under a name of its own) as ``name``, with
        ``desc``; on failure it is aborted."""
        hidden = self.name
        req = pb.Request(seal=pb.SealRequest(name=hidden, rename=name))
        if desc is not None:
            req.seal.tensor.CopyFrom(desc_to_pb(desc))
        try:
            self._finish("seal", req, name)
        except BaseException:
            self._state = "aborted"
            self._conn.send_detached(pb.Request(abort=pb.AbortRequest(name=hidden)))
            raise
        self._rec.name, self._desc = name, desc

    def __enter__(self) -> "Object":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if self._mem is not None:
            if exc_type is None:
                self.seal()
            else:
                self.abort()

    def __repr__(self) -> str:
        return "<cudaipc.Object %r %d bytes on %s, %s>" % (self.name, self.size, self.device, self._state)


def let_go(obj: Object, state: str, name: Optional[str] = None, desc: Optional[TensorDesc] = None) -> None:
    """Unmap ``obj`` and mark it ``state`` without telling the daemon (the caller
    does: put's seal after an event); with ``name``, it was sealed as that."""
    obj._let_go(state, name, desc)


def seal_as(obj: Object, name: str, desc: Optional[TensorDesc]) -> None:
    """Seal ``obj`` (created ahead under a name of its own) as ``name`` (put's
    reserve_next); on failure it is aborted."""
    obj._seal_as(name, desc)


_new_taken = _memory.Taken.__new__
_new_lease = Lease.__new__


def retaken(rec: Record) -> Lease:
    """The Lease of a lease taken back through the lease table (Store.get's hot
    path, docs/python.md "What a cycle costs"): objects made without __init__, only
    what the cycle needs set."""
    m = _new_taken(_memory.Taken)
    m.rec, m.views = rec, rec.views
    lease = _new_lease(Lease)
    lease._mem, lease._rec, lease._info, lease._manifest = m, rec, None, None
    return lease


def view_owner(lease: Lease) -> Any:
    """What a view of ``lease``'s memory keeps alive (None once released)."""
    return lease._mem
