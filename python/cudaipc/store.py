"""The store client: connect, put/create/seal, get -> Lease, ls/stat/rm/subscribe."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import re
import datetime
import logging
import os
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import _fastpath
from . import _store_pb2 as pb
from . import _views
from ._fastpath import LeaseTable
from ._wire import Conn, HostArena, Reply, spin_option
from .errors import (Closed, CudaError, InternalError, InvalidArgument, PermissionDenied,
                     StoreError, StoreGone)
from .region import Region, gpu_uuid_text, parse_gpu_uuid

__all__ = ["connect", "default_socket_path", "Store", "Lease", "Object", "ObjectInfo",
           "TensorDesc", "Event", "ServerInfo"]

_log = logging.getLogger("cudaipc")

MAX_OBJECT_SIZE = 1 << 40
PROTOCOL_VERSION = 2  # docs/protocol.md section 4


def default_socket_path() -> str:
    """The daemon's socket when none is given, as the Go client picks it:
    $CUDAIPC_SOCKET; else $XDG_RUNTIME_DIR/cudaipc/store.sock; else
    /run/cudaipc/store.sock for root and /tmp/cudaipc-<uid>/store.sock for others."""
    p = os.environ.get("CUDAIPC_SOCKET")
    if p:
        return p
    d = os.environ.get("XDG_RUNTIME_DIR")
    if d:
        return os.path.join(d, "cudaipc", "store.sock")
    uid = os.getuid()
    if uid == 0:
        return "/run/cudaipc/store.sock"
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", "cudaipc-%d" % uid, "store.sock")


@dataclasses.dataclass(frozen=True)
class TensorDesc:
    """What an object's bytes are as a typed array: dtype name, shape, and strides in
    elements (None: C order). Recorded by the producer, returned by get/stat."""
    dtype: str
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]] = None

    @classmethod
    def _from_pb(cls, t: Any) -> "TensorDesc":
        return cls(t.dtype, tuple(t.shape), tuple(t.strides) or None)

    def _to_pb(self) -> Any:
        return pb.TensorDesc(dtype=self.dtype, shape=list(self.shape), strides=list(self.strides or ()))


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """An object as ``stat`` describes it (the Go client's ObjectInfo)."""
    name: str
    size: int
    device: str            # "host", or a GPU UUID "GPU-…"
    sealed: bool
    leases: int
    shared: bool
    owner_uid: int
    created: datetime.datetime
    region: Optional[Region]        # GPU objects with a region; None otherwise
    tensor: Optional[TensorDesc]    # the producer's typed-array descriptor, if any
    version: int = 0                # a versioned name's version (0: a plain object)
    shards: int = 0                 # shards of that version
    shard: int = 0                  # this shard's index
    manifest_size: int = 0          # a bundle's manifest bytes (0: not a bundle)
    tensors: int = 0                # a bundle's tensor count

    @classmethod
    def _from_pb(cls, o: Any) -> "ObjectInfo":
        region = None
        if o.region:
            try:
                from .region import decode_region
                region = decode_region(o.region)
            except Exception:  # noqa: BLE001 - a newer daemon's region kind: leave it out
                region = None
        return cls(o.name, o.size, o.device, o.sealed, o.leases, o.shared, o.owner_uid,
                   datetime.datetime.fromtimestamp(o.created_unix_nano / 1e9, datetime.timezone.utc),
                   region, TensorDesc._from_pb(o.tensor) if o.HasField("tensor") else None,
                   o.version, o.shards, o.shard, o.manifest_size, o.tensors)


@dataclasses.dataclass(frozen=True)
class Event:
    """A change in the store: kind is "sealed", "deleted", "evicted" or "aborted"."""
    kind: str
    name: str
    version: int = 0   # for a versioned name: the version (for "sealed": just published)


_EVENT_KINDS = {1: "sealed", 2: "deleted", 3: "evicted", 4: "aborted"}


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What the daemon said in the handshake."""
    version: int
    server_version: str
    pid: int
    backend: str


# -- memory held by a lease or an object --------------------------------------------------

def _end(conn: Conn, request: Any, gpu_close: Any) -> None:
    """Finalizer of a _Memory: unmap GPU memory first (the daemon may free it as soon as
    it hears), then tell the daemon (pipelined: the reply is not awaited)."""
    try:
        if gpu_close is not None:
            gpu_close()
    finally:
        if request is not None:
            conn.send_detached(request)


class _GPUClose:
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


class _Grant:
    """What a lease granted with a lease-table slot keeps while it is idle (released
    through the table, not yet reclaimed): everything the next holder needs, the view
    construction data made so far, and its slot. Also the lease's description for its
    Lease objects (the attributes _LeaseMeta has)."""

    __slots__ = ("conn", "nbytes", "device", "addr", "ordinal", "arena", "gpu_close", "tensor",
                 "share", "end_request", "views", "table", "name", "slot", "gen", "arena_id",
                 "lease_id", "info_pb", "w_held", "w_idle", "p_slot", "p_held", "p_idle")

    def drop(self) -> None:
        """The daemon ended the idle lease: let go of its GPU arena reference."""
        if self.gpu_close is not None:
            self.gpu_close()


class _LeaseMeta:
    """The description of a lease without a lease-table slot (what a Lease reports)."""

    __slots__ = ("name", "nbytes", "device", "tensor", "lease_id", "info_pb")

    def __init__(self, name: str, nbytes: int, device: str, tensor: Optional[TensorDesc], lease_id: int, info_pb: Any):
        self.name, self.nbytes, self.device, self.tensor, self.lease_id, self.info_pb = \
            name, nbytes, device, tensor, lease_id, info_pb


class _Taken:
    """The memory of a lease taken back through the lease table (docs/protocol.md
    6.7): the owner its views keep alive, as a _Memory is. Made on every take-back, so
    it holds only its grant (and the grant's view construction data); when the last
    reference goes, __del__ releases the lease by one compare-and-swap, else through
    the socket. Everything else is the grant's."""

    __slots__ = ("grant", "views")
    writable = False
    alive = True

    def __getattr__(self, name: str) -> Any:
        # Only for what the slots and class do not have: the grant's description.
        if name == "grant":
            raise AttributeError(name)
        return getattr(self.grant, name)

    @property
    def is_gpu(self) -> bool:
        return self.grant.ordinal is not None

    def __del__(self) -> None:
        # Runs once (PEP 442), as soon as the last view or the Lease lets go.
        try:
            g = self.grant
            if not g.table.release(g):
                _end(g.conn, g.end_request, g.gpu_close)
        except Exception:  # noqa: BLE001 - interpreter shutdown, closed connection
            pass


_new_taken = _Taken.__new__


class _Memory:
    """The bytes of one lease or object: address, size, device. Views made from it
    keep it alive; when the last reference goes its finalizer ends the lease (or
    aborts an object never sealed). A lease with a lease-table slot (``grant``) ends
    by one compare-and-swap when it can (docs/protocol.md 6.7), else through the
    socket; its take-backs are _Taken."""

    __slots__ = ("nbytes", "device", "addr", "ordinal", "writable", "arena", "gpu_close", "tensor",
                 "share", "end_request", "conn", "alive", "grant", "views", "__weakref__")

    def __init__(self, conn: Conn, nbytes: int, device: str, addr: int, ordinal: Optional[int],
                 writable: bool, arena: Optional[HostArena], gpu_close: Optional[_GPUClose],
                 end_request: Any, tensor: Optional[TensorDesc], share: str):
        self.nbytes = nbytes
        self.device = device
        self.addr = addr          # host address, or device address of a GPU object
        self.ordinal = ordinal    # GPU ordinal this process maps a GPU object through
        self.writable = writable
        self.arena = arena        # keeps a host arena mapped
        self.gpu_close = gpu_close
        self.tensor = tensor
        self.share = share        # "" (host), "ipc" or "fd"
        self.end_request = end_request
        self.conn = conn
        self.alive = True
        self.grant: Optional[_Grant] = None   # set for a lease with a lease-table slot
        self.views: Dict[str, Any] = {}       # default view construction data, by kind

    def make_grant(self, table: Any, name: str, slot: int, gen: int, arena_id: int, lease_id: int, info_pb: Any) -> None:
        g = _Grant()
        g.conn, g.nbytes, g.device, g.addr, g.ordinal = self.conn, self.nbytes, self.device, self.addr, self.ordinal
        g.arena, g.gpu_close, g.tensor, g.share, g.end_request = self.arena, self.gpu_close, self.tensor, self.share, self.end_request
        g.views, g.table, g.name = self.views, table, name
        g.arena_id, g.lease_id, g.info_pb = arena_id, lease_id, info_pb
        table.prepare(g, slot, gen)
        self.grant = g

    def detach(self) -> None:
        """Forget the end request (the object was sealed or aborted explicitly)."""
        self.alive = False

    def __del__(self) -> None:
        # CPython runs this as soon as the last view or lease lets go: the lease
        # ends then, deterministically (cheaper than weakref.finalize on the hot path).
        if self.alive:
            self.alive = False
            try:
                g = self.grant
                if g is not None and g.table.release(g):
                    return
                _end(self.conn, self.end_request, self.gpu_close)
            except Exception:  # noqa: BLE001 - interpreter shutdown, closed connection
                pass

    @property
    def is_gpu(self) -> bool:
        return self.ordinal is not None


def _view(mem: _Memory, owner: Any, kind: str, dtype: Any, shape: Any) -> Any:
    lay = _views.resolve_layout(mem.nbytes, mem.tensor, dtype, shape)
    ro = not mem.writable
    if kind == "memoryview":
        if mem.is_gpu:
            raise TypeError("memoryview() needs a host object; this one is on %s: use tensor() or cupy()" % mem.device)
        return _views.host_memoryview(owner, mem.addr, mem.nbytes, ro)
    if kind == "numpy":
        if mem.is_gpu:
            raise TypeError("numpy() needs a host object; this one is on %s: use tensor() or cupy()" % mem.device)
        return _views.numpy_view(owner, mem.addr, lay, ro)
    if kind == "tensor":
        if mem.is_gpu:
            return _views.torch_cuda_view(owner, mem.addr, lay, mem.ordinal, ro)  # type: ignore[arg-type]
        return _views.torch_host_view(owner, mem.addr, lay, ro)
    if kind == "cupy":
        if not mem.is_gpu:
            raise TypeError("cupy() needs a GPU object; this one is in host memory: use numpy()")
        return _views.cupy_view(owner, mem.addr, mem.nbytes, lay, mem.ordinal)  # type: ignore[arg-type]
    raise AssertionError(kind)


MAX_IDLE_ARENAS = 16
"""GPU arenas a Store keeps mapped while no lease or object uses them (LRU)."""


class _GPUArena:
    """One GPU arena mapped by this connection: legacy IPC or an imported descriptor."""

    def __init__(self, arena_id: int, share: str, key: bytes, ptr: int, size: int, ordinal: int, close: Any):
        self.arena_id, self.share, self.key = arena_id, share, key
        self.ptr, self.size, self.ordinal = ptr, size, ordinal
        self.close = close
        self.users = 0          # leases and objects using it
        self.cached = True      # in Store._gpu_arenas
        self.freed = False      # the daemon said it is empty
        self.unmapped = False


class Lease:
    """A read-only lease on a sealed object (from :meth:`Store.get`).

    ``tensor()``, ``cupy()``, ``numpy()`` and ``memoryview()`` return zero-copy views.
    The lifetime rule: the object's memory stays leased while the Lease *or any view
    made from it* is alive. ``release()`` (or leaving a ``with`` block) gives up the
    Lease's own hold; the daemon hears of the release when the last view is collected
    too. A killed process's leases are released by the daemon.

    GPU memory is writable on the device (CUDA cannot map it read-only) but must not
    be written; host views are read-only (writing through a PyTorch CPU tensor faults).
    """

    __slots__ = ("_mem", "_meta", "_info", "_manifest")

    def __init__(self, mem: Any, meta: Any):
        self._mem: Any = mem       # a _Memory, or a _Taken; None once released
        self._meta = meta          # a _Grant or a _LeaseMeta: name, nbytes, device, tensor, lease_id, info_pb
        self._info: Optional[ObjectInfo] = None
        self._manifest: Any = None   # a bundle's manifest: its _ManifestFD, then its bytes

    @property
    def version(self) -> int:
        """The version of a versioned name this lease holds (0 for a plain object)."""
        p = self._meta.info_pb
        return p.version if p is not None else 0

    def manifest_bytes(self) -> bytes:
        """A bundle's manifest, as its creator wrote it: a safetensors header (JSON).
        Read from the memfd the daemon sent beside the lease, never from the object."""
        m = self._manifest
        if m is None:
            raise InvalidArgument("get", self._meta.name, "the object is not a bundle (it has no manifest)")
        if isinstance(m, _ManifestFD):
            p = self._meta.info_pb
            size = p.manifest_size if p is not None else 0
            try:
                data = os.pread(m.fd, size, 0)
            finally:
                m.close()
            self._manifest = m = data
        return m

    @property
    def info(self) -> ObjectInfo:
        """The object, as the daemon described it when granting the lease."""
        if self._info is None:
            d = self._meta
            p = d.info_pb
            if p is not None and p.name:
                self._info = ObjectInfo._from_pb(p)
            else:
                self._info = ObjectInfo(d.name, d.nbytes, d.device, True, 1, False, 0,
                                        datetime.datetime.now(datetime.timezone.utc), None, d.tensor)
        return self._info

    @property
    def name(self) -> str:
        return self._meta.name

    @property
    def size(self) -> int:
        """The object's size in bytes."""
        return self._meta.nbytes

    @property
    def device(self) -> str:
        """"host" or the GPU's UUID."""
        return self._meta.device

    @property
    def lease_id(self) -> int:
        return self._meta.lease_id

    @property
    def tensor_desc(self) -> Optional[TensorDesc]:
        """The producer's dtype/shape/strides, if it recorded them."""
        return self._meta.tensor

    @property
    def gpu_share(self) -> str:
        """How a GPU object reached this process: "ipc" or "fd"; "" for host objects."""
        return self._live().share

    @property
    def data_ptr(self) -> int:
        """The address of the object's first byte in this process (device address for GPU objects)."""
        return self._live().addr

    @property
    def ordinal(self) -> Optional[int]:
        """The GPU (this process's ordinal) a GPU object is mapped through; None for host."""
        return self._live().ordinal

    def _live(self) -> Any:
        m = self._mem
        if m is None:
            raise InvalidArgument("use", self._meta.name, "the lease was released; views made before stay valid")
        return m

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
                mk = m.views["tensor"] = _views.tensor_maker(m.addr, _views.resolve_layout(m.nbytes, m.tensor),
                                                            m.ordinal, not m.writable)
            return mk(m)
        return _view(m, m, "tensor", dtype, shape)

    def cupy(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy ``cupy.ndarray`` of a GPU object."""
        m = self._live()
        return _view(m, m, "cupy", dtype, shape)

    def numpy(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy, read-only ``numpy.ndarray`` of a host object."""
        m = self._live()
        return _view(m, m, "numpy", dtype, shape)

    def memoryview(self) -> memoryview:
        """A zero-copy, read-only memoryview of a host object's bytes."""
        m = self._live()
        return _view(m, m, "memoryview", None, None)

    def read(self) -> bytes:
        """A copy of the object's bytes (host or GPU)."""
        m = self._live()
        return _read(m)

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
        d = self._meta
        return "<cudaipc.Lease %r %d bytes on %s%s>" % (d.name, d.nbytes, d.device,
                                                         " released" if self._mem is None else "")


_new_lease = Lease.__new__


class _ManifestFD:
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


def _read(m: _Memory) -> bytes:
    if not m.is_gpu:
        return ctypes.string_at(m.addr, m.nbytes)
    from . import _cuda
    buf = ctypes.create_string_buffer(m.nbytes)
    with _cuda.on(m.ordinal):  # type: ignore[arg-type]
        _cuda.memcpy_dtoh(ctypes.addressof(buf), m.addr, m.nbytes)
    return buf.raw


class Object:
    """A new object being written (from :meth:`Store.create`): fill its memory in place
    through ``tensor()``, ``cupy()``, ``numpy()``, ``memoryview()`` or ``write()``, then
    ``seal()`` (publish) or ``abort()``. Views of an Object must not be used after
    seal or abort (GPU mappings are closed then, as the protocol requires). An Object
    collected unsealed is aborted."""

    def __init__(self, store: "Store", name: str, mem: _Memory):
        self._store = store
        self._name = name
        self._mem: Optional[_Memory] = mem
        self._nbytes = mem.nbytes
        self._device = mem.device
        self._state = "open"
        self._desc: Optional[TensorDesc] = None
        self.version = 0   # for a shard of a version: its version
        self.shard = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._nbytes

    @property
    def device(self) -> str:
        return self._device

    @property
    def data_ptr(self) -> int:
        """The address of the object's first byte in this process (device address for GPU objects)."""
        return self._live().addr

    @property
    def ordinal(self) -> Optional[int]:
        return self._live().ordinal

    def _live(self) -> _Memory:
        if self._mem is None:
            raise InvalidArgument("write", self._name, "the object is %s: it can no longer be written" % self._state)
        return self._mem

    def tensor(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A writable zero-copy ``torch.Tensor`` of the object's memory."""
        m = self._live()
        return _view(m, m, "tensor", dtype, shape)

    def cupy(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A writable zero-copy ``cupy.ndarray`` of a GPU object's memory."""
        m = self._live()
        return _view(m, m, "cupy", dtype, shape)

    def numpy(self, dtype: Any = None, shape: Optional[Sequence[int]] = None) -> Any:
        """A writable zero-copy ``numpy.ndarray`` of a host object's memory."""
        m = self._live()
        return _view(m, m, "numpy", dtype, shape)

    def memoryview(self) -> memoryview:
        """A writable memoryview of a host object's bytes."""
        m = self._live()
        return _view(m, m, "memoryview", None, None)

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy bytes (any buffer) into the object at offset, host or GPU."""
        m = self._live()
        src = memoryview(data).cast("B")
        n = src.nbytes
        if offset < 0 or offset + n > m.nbytes:
            raise InvalidArgument("write", self._name, "[%d, %d) is outside the %d-byte object" % (offset, offset + n, m.nbytes))
        if not m.is_gpu:
            ctypes.memmove(m.addr + offset, (ctypes.c_char * n).from_buffer_copy(src) if src.readonly else (ctypes.c_char * n).from_buffer(src), n)
            return
        from . import _cuda
        tmp = (ctypes.c_char * n).from_buffer_copy(src)
        with _cuda.on(m.ordinal):  # type: ignore[arg-type]
            _cuda.memcpy_htod(m.addr + offset, ctypes.addressof(tmp), n)

    def seal(self) -> None:
        """Publish the object: readers may get it from now on. Device work writing it
        must be complete (synchronize your stream first)."""
        self._finish("seal", pb.Request(seal=pb.SealRequest(name=self._name, version=self.version, shard=self.shard)))

    def abort(self) -> None:
        """Discard the object."""
        self._finish("abort", pb.Request(abort=pb.AbortRequest(name=self._name, version=self.version, shard=self.shard)))

    def _finish(self, op: str, req: Any, name: Optional[str] = None) -> None:
        m = self._mem
        if m is None:
            raise InvalidArgument(op, self._name, "object already %s" % self._state)
        # The GPU mapping goes before the daemon hears: it may free the arena at once.
        m.detach()
        if m.gpu_close is not None:
            m.gpu_close()
        self._mem = None
        self._state = "sealed" if op == "seal" else "aborted"
        self._store._conn.call(req, op, name or self._name)

    def _seal_as(self, name: str, desc: Optional[TensorDesc]) -> None:
        """Seal this object (created ahead under a name of its own) as ``name``, with
        ``desc``; on failure it is aborted."""
        hidden = self._name
        req = pb.Request(seal=pb.SealRequest(name=hidden, rename=name))
        if desc is not None:
            req.seal.tensor.CopyFrom(desc._to_pb())
        try:
            self._finish("seal", req, name)
        except BaseException:
            self._state = "aborted"
            self._store._conn.send_detached(pb.Request(abort=pb.AbortRequest(name=hidden)))
            raise
        self._name, self._desc = name, desc

    def __enter__(self) -> "Object":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if self._mem is not None:
            if exc_type is None:
                self.seal()
            else:
                self.abort()

    def __repr__(self) -> str:
        return "<cudaipc.Object %r %d bytes on %s, %s>" % (self._name, self._nbytes, self._device, self._state)


class Store:
    """A connection to the store daemon (:func:`connect`). Safe to use from several
    threads; a ``get`` that waits holds up no other call."""

    def __init__(self, socket: Optional[str] = None, client_name: Optional[str] = None,
                 fast_path: bool = True, spin: Optional[float] = None):
        path = socket or default_socket_path()
        self._table: Optional[LeaseTable] = None
        self.socket = path
        window = spin_option(spin)
        try:
            self._conn = Conn(path, window)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise StoreGone("dial", message="%s: %s (is the daemon running? start it with 'cudaipc serve')" % (path, e.strerror)) from None
        except PermissionError as e:
            raise PermissionDenied("dial", message="%s: %s" % (path, e.strerror)) from None
        except OSError as e:
            raise StoreGone("dial", message="%s: %s" % (path, e)) from None
        self._arena_lock = threading.RLock()
        self._gpu_arenas: Dict[int, _GPUArena] = {}   # arena id -> its mapping, used or idle
        self._idle: "collections.OrderedDict[int, _GPUArena]" = collections.OrderedDict()
        self._ahead_lock = threading.Lock()
        # put's reserve_next: (key, name, create request id, the Object once its reply is read)
        self._ahead: Optional[Tuple[Tuple[str, int, bool], str, int, Optional[Object]]] = None
        self._ahead_seq = 0
        self._event_lock = threading.Lock()
        self._put_events: Dict[int, Any] = {}   # GPU ordinal -> _cuda.IPCEvent for put's seals
        self._events_ok = True
        self._conn.on_arenas_freed = self._arenas_freed
        name = client_name or "%s[%d]" % (os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python"), os.getpid())
        try:
            r = self._conn.call(pb.Request(hello=pb.HelloRequest(version=PROTOCOL_VERSION, client_name=name[-255:])), "dial")
        except StoreGone:
            self._conn.close()
            raise StoreGone("dial", message="the daemon at %s closed the connection during the handshake (is this uid admitted? see 'cudaipc serve --allow-uid')" % path) from None
        except BaseException:
            self._conn.close()
            raise
        h = r.resp.hello
        if h.version != PROTOCOL_VERSION:
            self._conn.close()
            raise InternalError("dial", message="daemon answered version %d to version %d" % (h.version, PROTOCOL_VERSION))
        self.server = ServerInfo(h.version, h.server_version, h.pid, h.backend)
        if fast_path:
            self._open_lease_table()

    def _open_lease_table(self) -> None:
        """Ask for this connection's lease table (docs/protocol.md 6.7). Without a
        compare-and-swap (no libatomic), or from a daemon that has none, every lease
        goes through the socket."""
        at = _fastpath.atomics()
        if at is None:
            return
        try:
            r = self._conn.call(pb.Request(lease_table=pb.LeaseTableRequest()), "lease_table")
        except (StoreGone, Closed):
            raise
        except StoreError as e:
            _log.debug("cudaipc: the daemon has no lease table (%s); leases go through the socket", e)
            return
        if r.fd < 0 or r.resp.WhichOneof("body") != "lease_table":
            if r.fd >= 0:
                os.close(r.fd)
            _log.debug("cudaipc: the daemon sent no lease table; leases go through the socket")
            return
        try:
            self._table = LeaseTable(r.fd, r.resp.lease_table.slots, at.cas)
        except (OSError, ValueError) as e:
            _log.debug("cudaipc: lease table unusable (%s); leases go through the socket", e)
        finally:
            os.close(r.fd)

    @property
    def fast_path(self) -> bool:
        """Whether leases are released and taken back through the lease table (no
        system call) rather than the socket."""
        return self._table is not None

    # -- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Close the connection: the daemon aborts unsealed objects and releases leases.
        Host memory of views still alive stays mapped until they are collected (it may
        be reused by the daemon: do not read it any more). Idle GPU arenas are unmapped.
        Idempotent."""
        with self._ahead_lock:
            self._ahead = None   # the daemon aborts it with the connection
        self._conn.close()
        events, self._put_events = self._put_events, {}
        if events:
            for ev in events.values():
                ev.close()
        if self._table is not None:
            self._table.close()   # idle leases let go of their arenas
        with self._arena_lock:
            arenas = list(self._gpu_arenas.values())
            for a in arenas:
                a.cached = False
        for a in arenas:
            self._maybe_unmap(a, forget=False)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- register (memory this process owns) -------------------------------------------
    def register(self, name: str, obj: Any, nbytes: Optional[int] = None, *, shared: bool = False) -> "ObjectInfo":
        """Make a CUDA tensor/array this process allocated readable under ``name``
        without copying it (cudaipc.extmem): VMM memory (PyTorch with
        expandable_segments:True) as descriptors that readers in other containers map
        read-only and that outlive this process; cudaMalloc memory as a legacy region,
        removed when this connection closes. Raises extmem.NotExportable naming the fix
        for memory that cannot be shared."""
        from .extmem import register
        return register(self, name, obj, nbytes, shared=shared)

    # -- create / put ----------------------------------------------------------------
    def create(self, name: str, nbytes: int, device: Any = None, *, shared: bool = False,
               dtype: Any = None, shape: Optional[Sequence[int]] = None,
               strides: Optional[Sequence[int]] = None, versioned: bool = False, version: int = 0,
               shards: int = 0, shard: int = 0, keep_last: int = 0,
               manifest: Optional[bytes] = None, _spin: Optional[float] = None) -> Object:
        """Allocate a writable object of ``nbytes`` on ``device`` ("host" or None, a GPU
        ordinal, "cuda:N", a torch.device, or a GPU UUID). Give ``dtype`` (and ``shape``,
        ``strides`` in elements) to record what the bytes are for readers.

        ``versioned`` (see :meth:`publish`) makes shard ``shard`` of ``shards`` of a
        version of ``name``; ``manifest`` (a safetensors header) makes a bundle (see
        :meth:`put_bundle`)."""
        dev = _resolve_device(device)
        if not isinstance(nbytes, int) or not 0 < nbytes <= MAX_OBJECT_SIZE:
            raise InvalidArgument("create", name, "size %r is outside 1..%d" % (nbytes, MAX_OBJECT_SIZE))
        desc = _desc(nbytes, dtype, shape, strides, name)
        req = pb.Request(create=pb.CreateRequest(name=name, size=nbytes, device=dev, shared=shared,
                                                 versioned=versioned, version=version, shards=shards,
                                                 shard=shard, keep_last=keep_last,
                                                 manifest_size=len(manifest or b"")))
        if desc is not None:
            req.create.tensor.CopyFrom(desc._to_pb())
        r = self._conn.call(req, "create", name, spin=_spin)
        return self._created(r, name, nbytes, desc, manifest, shard)

    def _created(self, r: Reply, name: str, nbytes: int, desc: Optional[TensorDesc],
                 manifest: Optional[bytes], shard: int) -> Object:
        """The Object of a create's reply."""
        p = r.resp.create.placement
        if not p.writable or p.size != nbytes or (r.manifest_fd >= 0) != bool(manifest):
            self._conn._cleanup(r, "create", name)
            raise InternalError("create", name, "daemon sent no writable placement of the requested size")
        if r.manifest_fd >= 0:
            try:
                os.pwrite(r.manifest_fd, manifest, 0)   # type: ignore[arg-type]
            except OSError as e:
                self._conn._cleanup(r, "create", name)
                raise InternalError("create", name, "writing the manifest: %s" % e) from None
            os.close(r.manifest_fd)
            r.manifest_fd = -1
        try:
            mem = self._memory(r, p, desc, pb.Request(abort=pb.AbortRequest(
                name=name, version=r.resp.create.version, shard=shard)), "create", name)
        except BaseException:
            self._conn._cleanup(r, "create", name)
            raise
        o = Object(self, name, mem)
        o._desc = desc
        o.version, o.shard = r.resp.create.version, shard
        return o

    def publish(self, name: str, nbytes: int, device: Any = None, *, shards: int = 0, shard: int = 0,
                keep_last: int = 0, **kw: Any) -> Object:
        """Create the next version of the versioned ``name`` (or shard ``shard`` of
        ``shards`` of it: N ranks asking for the next version meet in one); ``seal()``
        publishes it. Readers see a version only when all its shards are sealed; a
        creator that dies before sealing aborts the whole version. The newest
        ``keep_last`` versions are kept without leases (0: the daemon's default)."""
        return self.create(name, nbytes, device, versioned=True, shards=shards, shard=shard,
                           keep_last=keep_last, **kw)

    def wait_newer(self, name: str, than: int, timeout: Optional[float] = None, shard: int = 0) -> Lease:
        """Wait until a version of ``name`` above ``than`` is published, then lease
        (shard ``shard`` of) the latest one; ``lease.version`` says which."""
        return self.get(name, timeout, newer_than=than, shard=shard)

    def put_bundle(self, name: str, state_dict: Any, device: Any = None, **kw: Any) -> Any:
        """Store a dict of tensors as one bundle object; see :func:`cudaipc.bundle.put_bundle`."""
        from . import bundle
        return bundle.put_bundle(self, name, state_dict, device, **kw)

    def get_bundle(self, name: str, timeout: Optional[float] = None, **kw: Any) -> Any:
        """Zero-copy tensors of a bundle, by name; see :func:`cudaipc.bundle.get_bundle`."""
        from . import bundle
        return bundle.get_bundle(self, name, timeout, **kw)

    def put(self, name: str, data: Any, device: Any = None, *, shared: bool = False,
            reserve_next: bool = False) -> ObjectInfo:
        """Copy ``data`` into a new sealed object and return its info (as created: no
        extra round trip; ``stat`` for the daemon's view). ``data`` is a
        torch.Tensor (CPU or CUDA), a CuPy or NumPy array, or any bytes-like object.
        ``device`` defaults to where the data is; GPU->GPU copies run on the data's
        current stream and finish before the seal. dtype and shape are recorded.

        ``reserve_next`` creates the next object ahead, after this one is sealed
        (pipelined: put does not wait for it): an unsealed object of the same size,
        device and sharing under a name of this connection's own
        (``.put-ahead.<pid>.<n>``). The next ``put`` of that size, device and sharing
        copies straight into it and publishes it under its name with one round trip
        (seal under another name) instead of two. It costs one object's memory until
        then (counted against the daemon's capacity and your quota, never evicted); a
        put that does not match, or :meth:`close`, gives it back."""
        src = _Source.of(data)
        if device is None:
            device = src.ordinal if src.ordinal is not None else "host"
        key = (_resolve_device(device), src.nbytes, shared)
        obj = self._take_ahead(key)
        if obj is None:
            # A GPU put polls for the create's answer as for its seal's (below).
            obj = self.create(name, src.nbytes, device, shared=shared, dtype=src.dtype, shape=src.shape,
                              _spin=_SEAL_SPIN if src.ordinal is not None else None)
        if src.ordinal is not None and obj._live().is_gpu:
            ev = self._take_event(src.ordinal)
            if ev is not None:
                try:
                    self._seal_after_event(obj, src, ev, name, key if reserve_next else None)
                finally:
                    self._event_lock.release()
                return ObjectInfo(name, src.nbytes, obj.device, True, 0, shared, os.getuid(),
                                  datetime.datetime.now(datetime.timezone.utc), None, obj._desc)
        try:
            src.copy_to(obj._live())
        except BaseException:
            obj.abort()
            raise
        if obj._name != name:
            obj._seal_as(name, _desc(src.nbytes, src.dtype, src.shape, None, name))
        else:
            obj.seal()
        if reserve_next:
            self._reserve(key)
        return ObjectInfo(name, src.nbytes, obj.device, True, 0, shared, os.getuid(),
                          datetime.datetime.now(datetime.timezone.utc), None, obj._desc)

    def _take_event(self, ordinal: int) -> Optional[Any]:
        """This Store's interprocess event of GPU ``ordinal``, locked for one put; None
        when another put uses it or events do not work here."""
        if not self._events_ok or not self._event_lock.acquire(blocking=False):
            return None
        ev = self._put_events.get(ordinal)
        if ev is None:
            from . import _cuda
            try:
                ev = self._put_events[ordinal] = _cuda.IPCEvent(ordinal)
            except Exception as e:  # noqa: BLE001 - no interprocess events here: seal after a sync
                _log.debug("cudaipc: no interprocess event for put (%s); puts synchronize before sealing", e)
                self._events_ok = False
                self._event_lock.release()
                return None
        return ev

    def _seal_after_event(self, obj: Object, src: "_Source", ev: Any, name: str,
                          reserve: Optional[Tuple[str, int, bool]] = None) -> None:
        """put's copy into its object (or one created ahead, sealed under ``name``) by a
        seal the daemon answers once ``ev``, recorded after the copy, has completed: the
        seal's round trip overlaps the copy. With ``reserve`` (reserve_next), the next
        put's object is created while the copy runs too. A daemon that cannot use the
        event (another PID namespace, say) gets a plain seal after a sync, and this
        Store stops trying."""
        from . import _cuda
        m = obj._live()
        hidden = obj._name
        sealed = False
        try:
            # The copy first: what follows overlaps it.
            _cuda.copy_and_record(m.addr, src.addr, src.nbytes, src.stream, ev)
            if hidden != name:   # created ahead: published under name, with put's descriptor
                desc = _desc(src.nbytes, src.dtype, src.shape, None, name)
                req = pb.Request(seal=pb.SealRequest(name=hidden, rename=name, wait_event=ev.descriptor))
                if desc is not None:
                    req.seal.tensor.CopyFrom(desc._to_pb())
            else:                # created by this put, with its descriptor
                desc = obj._desc
                req = pb.Request(seal=pb.SealRequest(name=name, wait_event=ev.descriptor))
            try:
                # The seal goes now, so the daemon is awake and waiting on the event
                # when the copy ends; this thread waits for the copy in the driver (no
                # sleep on the socket to wake from), then polls for the answer, which
                # comes a few microseconds later.
                rid = self._conn.send(req)
                if reserve is not None:
                    self._reserve(reserve)
                    if src.nbytes >= _PREPARE_AHEAD_BYTES:
                        # A long copy: read the reply and map the object now, not
                        # in the next put.
                        self._prepare_ahead()
                try:
                    _cuda.event_synchronize(ev)
                finally:
                    # The copy is done: the daemon, polling the event, answers within
                    # microseconds; poll longer than usual rather than sleep.
                    self._conn.result(rid, "seal", name, spin=_SEAL_SPIN)
                sealed = True
            except InvalidArgument as e:
                if not (e.message or "").startswith("wait_event"):
                    raise
                _log.debug("cudaipc: the daemon cannot wait on this process's events (%s); puts synchronize before sealing", e.message)
                self._events_ok = False
                _cuda.stream_synchronize(src.ordinal, src.stream)
                req.seal.ClearField("wait_event")
                self._conn.call(req, "seal", name)
                sealed = True
        finally:
            if not sealed:
                # The copy may still write there: it ends before the memory goes.
                try:
                    _cuda.stream_synchronize(src.ordinal, src.stream)
                finally:
                    obj._state = "aborted"
                    m.detach()
                    if m.gpu_close is not None:
                        m.gpu_close()
                    obj._mem = None
                    self._conn.send_detached(pb.Request(abort=pb.AbortRequest(name=hidden)))
        # Sealed: the copy is complete (the daemon saw the event), and the object
        # keeps its arena, so the mapping may go now.
        m.detach()
        if m.gpu_close is not None:
            m.gpu_close()
        obj._mem = None
        obj._state = "sealed"
        obj._name, obj._desc = name, desc

    def _reserve(self, key: Tuple[str, int, bool]) -> None:
        """Send the create of the next put's object (put's reserve_next); its reply is
        read by the put that uses it."""
        with self._ahead_lock:
            self._ahead_seq += 1
            hidden = ".put-ahead.%d.%d" % (os.getpid(), self._ahead_seq)
        dev, nbytes, shared = key
        try:
            rid = self._conn.send(pb.Request(create=pb.CreateRequest(name=hidden, size=nbytes, device=dev, shared=shared)))
        except StoreError:
            return
        with self._ahead_lock:
            old, self._ahead = self._ahead, (key, hidden, rid, None)
        if old is not None:
            self._give_back(old)

    def _give_back(self, a: Tuple[Tuple[str, int, bool], str, int, Optional[Object]]) -> None:
        """Abort an object created ahead that no put will use."""
        _, hidden, rid, obj = a
        if obj is None:
            self._conn.abandon(rid, "create", hidden)
        else:
            try:
                obj.abort()
            except StoreError:
                pass

    def _prepare_ahead(self) -> None:
        """Read the reply of the create sent ahead and map its object now, so that the
        next put finds it ready."""
        with self._ahead_lock:
            a = self._ahead
            if a is None or a[3] is not None:
                return
            self._ahead = None
        key, hidden, rid, _ = a
        try:
            obj = self._ahead_object(key, hidden, rid)
        except StoreError as e:   # a bad answer (cleaned up): the next put creates as usual
            _log.debug("cudaipc: the object made ahead is unusable: %s", e)
            return
        if obj is None:
            return
        with self._ahead_lock:
            if self._ahead is None:
                self._ahead = (key, hidden, rid, obj)
                return
        self._give_back((key, hidden, rid, obj))   # another put reserved meanwhile

    def _take_ahead(self, key: Tuple[str, int, bool]) -> Optional[Object]:
        """The object created ahead for a put of key, or None (then a put that does not
        match gives it back)."""
        with self._ahead_lock:
            a, self._ahead = self._ahead, None
        if a is None:
            return None
        if a[0] != key:
            self._give_back(a)
            return None
        if a[3] is not None:
            return a[3]
        return self._ahead_object(key, a[1], a[2])

    def _ahead_object(self, key: Tuple[str, int, bool], hidden: str, rid: int) -> Optional[Object]:
        """The Object of the create sent ahead as request ``rid``, or None when it failed."""
        try:
            r = self._conn.wait(rid)
        except StoreError:
            return None
        if r.resp.HasField("error") and r.resp.error.code != 0:
            if r.fd >= 0:
                os.close(r.fd)
            return None   # e.g. the store was full then: put creates as usual
        return self._created(r, hidden, key[1], None, None, 0)

    # -- get ---------------------------------------------------------------------------
    def get(self, name: str, timeout: Optional[float] = None, *, version: int = 0, shard: int = 0,
            newer_than: int = 0) -> Lease:
        """Wait until ``name`` exists and is sealed (at most ``timeout`` seconds; None:
        without limit; 0: not at all), then lease it. Raises Timeout when it is not
        sealed in time.

        For a versioned name: ``version`` (0: the latest), ``shard``, and ``newer_than``
        (wait for a version above it). A lease on any shard keeps the whole version, so
        ``get(name, version=lease.version, shard=k)`` finds every other shard of it."""
        t = self._table
        if t is not None and t.idle.get(name) and not (version or shard or newer_than) and self._conn.dead is None:
            g = t.retake(name)
            if g is not None:
                # The hot path (docs/python.md, "What a cycle costs"): objects made
                # without __init__, only what the cycle needs set.
                m = _new_taken(_Taken)
                m.grant, m.views = g, g.views
                lease = _new_lease(Lease)
                lease._mem, lease._meta, lease._info, lease._manifest = m, g, None, None
                return lease
        if timeout is None:
            ms = -1
        else:
            ms = max(int(timeout * 1000), 0)
        if version or shard or newer_than:
            r = self._conn.call(pb.Request(get=pb.GetRequest(name=name, timeout_ms=ms, version=version,
                                                             shard=shard, newer_than=newer_than)), "get", name)
        else:
            r = self._conn.call_raw(_encode_get(name, ms), "get", name)
        g = r.resp.get
        p = g.placement
        if p.writable:
            self._conn._cleanup(r, "get", name)
            raise InternalError("get", name, "daemon sent a writable placement for a get")
        info = g.info if g.HasField("info") else None
        desc = TensorDesc._from_pb(info.tensor) if info is not None and info.HasField("tensor") else None
        try:
            mem = self._memory(r, p, desc, _Release(g.lease_id), "get", name)
        except BaseException:
            self._conn._cleanup(r, "get", name)
            raise
        if r.manifest_fd >= 0:
            lease = Lease(mem, _LeaseMeta(name, mem.nbytes, mem.device, desc, g.lease_id, info))
            lease._manifest, r.manifest_fd = _ManifestFD(r.manifest_fd), -1
        elif g.lease_slot and t is not None and g.lease_slot <= t.slots:
            # A slot in the lease table: this lease ends by a compare-and-swap, and a
            # later get of the name takes it back the same way (docs/protocol.md 6.7).
            t.granted(g.lease_slot)
            mem.make_grant(t, name, g.lease_slot, g.lease_gen, p.arena_id, g.lease_id, info)
            lease = Lease(mem, mem.grant)
        else:
            lease = Lease(mem, _LeaseMeta(name, mem.nbytes, mem.device, desc, g.lease_id, info))
        return lease

    def _memory(self, r: Reply, p: Any, desc: Optional[TensorDesc], end: Any, op: str, name: str) -> _Memory:
        # The placement states its kind (protocol version 2).
        if p.kind == pb.Placement.HOST:
            if r.arena is None:
                raise InternalError(op, name, "host placement without a mapped arena")
            return _Memory(self._conn, p.size, "host", r.arena.addr + p.offset, None, p.writable,
                           r.arena, None, end, desc, "")
        if p.kind == pb.Placement.CUDA_IPC:
            return self._ipc_memory(p, desc, end, op, name)
        if p.kind == pb.Placement.VMM_FD and r.fd >= 0:
            fd, r.fd = r.fd, -1
            return self._fd_memory(fd, p, desc, end, op, name)
        raise InternalError(op, name, "placement of kind %d without what it needs" % p.kind)

    def _ipc_memory(self, p: Any, desc: Optional[TensorDesc], end: Any, op: str, name: str) -> _Memory:
        a = self._gpu_arenas.get(p.arena_id)
        if a is None or a.key != p.region:
            a = self._map_ipc_arena(p, op, name)
        if p.offset + p.size > a.size:
            raise InternalError(op, name, "placement [%d, %d) lies outside the arena's %d-byte region" % (p.offset, p.offset + p.size, a.size))
        return self._arena_memory(a, p, desc, end)

    def _map_ipc_arena(self, p: Any, op: str, name: str) -> "_GPUArena":
        from . import _cuda
        try:
            r = Region.from_bytes(p.region)
        except Exception as e:  # noqa: BLE001
            raise InternalError(op, name, "daemon sent an invalid region: %s" % e) from None
        if r.device_uuid != p.device:
            raise InternalError(op, name, "placement on %s comes with a region of %s" % (p.device, r.device_uuid))
        from .region import local_identity
        ns, boot = local_identity()
        if r.boot_id != boot or r.pid_namespace != ns:
            raise InternalError(op, name, "the daemon runs in another PID namespace or boot: legacy CUDA IPC cannot reach it "
                                "(start the daemon with 'cudaipc serve --gpu-share fd', or share its PID namespace)")
        ordinal = _cuda.pick_ordinal(r.device)
        base = _cuda.ipc_open(r.handle, r.buffer_id, ordinal)
        a = _GPUArena(p.arena_id, "ipc", bytes(p.region), base + r.offset, r.size, ordinal,
                      _GPUClose(_cuda.ipc_close, r.handle, r.buffer_id, ordinal))
        self._hold(a)
        return a

    def _fd_memory(self, fd: int, p: Any, desc: Optional[TensorDesc], end: Any, op: str, name: str) -> _Memory:
        from . import _cuda
        try:
            with self._arena_lock:
                a = self._gpu_arenas.get(p.arena_id)
                if a is None or a.share != "fd" or a.size < p.arena_size:
                    ordinal = _cuda.pick_ordinal(parse_gpu_uuid(p.device))
                    m = _cuda.FDArena(fd, p.arena_size, ordinal)
                    a = _GPUArena(p.arena_id, "fd", b"", m.ptr, m.size, ordinal, _GPUClose(m.close))
                    self._hold(a)
        finally:
            os.close(fd)
        if p.offset + p.size > a.size:
            raise InternalError(op, name, "placement [%d, %d) lies outside arena %d's %d-byte mapping" % (p.offset, p.offset + p.size, p.arena_id, a.size))
        return self._arena_memory(a, p, desc, end)

    def _hold(self, a: "_GPUArena") -> None:
        """Cache a newly mapped GPU arena (replacing, and letting go of, an older
        mapping of the same id)."""
        with self._arena_lock:
            old = self._gpu_arenas.get(a.arena_id)
            self._gpu_arenas[a.arena_id] = a
        if old is not None:
            old.cached = False
            self._maybe_unmap(old, forget=False)

    def _arena_memory(self, a: "_GPUArena", p: Any, desc: Optional[TensorDesc], end: Any) -> _Memory:
        with self._arena_lock:
            a.users += 1
            self._idle.pop(a.arena_id, None)
        return _Memory(self._conn, p.size, p.device, a.ptr + p.offset, a.ordinal, p.writable, None,
                       _GPUClose(self._arena_unref, a), end, desc, a.share)

    def _arena_unref(self, a: "_GPUArena") -> None:
        """A lease or object in the arena ended. The mapping stays (the next get there
        costs no driver call) until the daemon says the arena is empty, or the idle
        ones exceed MAX_IDLE_ARENAS."""
        evict: List[_GPUArena] = []
        with self._arena_lock:
            a.users -= 1
            if a.users == 0 and a.cached and not a.freed:
                self._idle[a.arena_id] = a
                while len(self._idle) > MAX_IDLE_ARENAS:
                    _, old = self._idle.popitem(last=False)
                    old.cached = False
                    if self._gpu_arenas.get(old.arena_id) is old:
                        del self._gpu_arenas[old.arena_id]
                    evict.append(old)
        self._maybe_unmap(a, forget=True)
        for old in evict:
            self._maybe_unmap(old, forget=True)

    def _maybe_unmap(self, a: "_GPUArena", forget: bool) -> None:
        with self._arena_lock:
            if a.users > 0 or (a.cached and not a.freed) or a.unmapped:
                return
            a.unmapped = True
            if self._gpu_arenas.get(a.arena_id) is a:
                del self._gpu_arenas[a.arena_id]
            self._idle.pop(a.arena_id, None)
        try:
            a.close()
        finally:
            if forget:
                self._conn.send_detached(pb.Request(forget_arenas=pb.ForgetArenasRequest(arena_ids=[a.arena_id])))

    def _arenas_freed(self, ids: Sequence[int]) -> None:
        """The daemon says these arenas hold no object any more: unmap them (GPU ones
        as soon as no view uses them) and tell it (forget_arenas)."""
        if self._table is not None:
            self._table.drop_arenas(ids)   # their idle leases were reclaimed
        self._conn.drop_host_arenas(ids)
        host = []
        for i in ids:
            with self._arena_lock:
                a = self._gpu_arenas.get(i)
                if a is not None:
                    a.freed = True
                    a.cached = False
            if a is None:
                host.append(i)
            else:
                self._maybe_unmap(a, forget=True)
        if host:
            self._conn.send_detached(pb.Request(forget_arenas=pb.ForgetArenasRequest(arena_ids=host[:1024])))

    # -- the rest --------------------------------------------------------------------------
    def stat(self, name: str) -> ObjectInfo:
        """Describe one object; NotFound if there is none this user may read."""
        r = self._conn.call(pb.Request(stat=pb.StatRequest(name=name)), "stat", name)
        return ObjectInfo._from_pb(r.resp.stat.info)

    def ls(self) -> List[ObjectInfo]:
        """The objects this user may read, sorted by name."""
        out: List[ObjectInfo] = []
        after = ""
        while True:
            r = self._conn.call(pb.Request(list=pb.ListRequest(start_after=after)), "list")
            page = r.resp.list
            out.extend(ObjectInfo._from_pb(o) for o in page.objects)
            if not page.more or not page.objects:
                return out
            after = out[-1].name

    def rm(self, name: str) -> None:
        """Remove the object's name now; its memory is freed when its last lease ends."""
        self._conn.call(pb.Request(delete=pb.DeleteRequest(name=name)), "delete", name)

    def subscribe(self, timeout: Optional[float] = None) -> Iterator[Event]:
        """Iterate over store events (seals, deletions, evictions, aborts) from now on.
        With a timeout (seconds), the iteration ends when no event comes for that long."""
        if not self._conn.subscribed:
            self._conn.call(pb.Request(subscribe=pb.SubscribeRequest()), "subscribe")
            self._conn.subscribed = True
        return self._events(timeout)

    def _events(self, timeout: Optional[float]) -> Iterator[Event]:
        while True:
            ev = self._conn.wait_event(timeout)
            if ev is None:
                return
            kind = _EVENT_KINDS.get(ev.kind)
            if kind is not None:
                yield Event(kind, ev.name, ev.version)

    def __repr__(self) -> str:
        return "<cudaipc.Store %s backend=%s>" % (self.socket, getattr(self, "server", None) and self.server.backend)


def connect(socket: Optional[str] = None, client_name: Optional[str] = None, *,
            fast_path: bool = True, spin: Optional[float] = None) -> Store:
    """Connect to the store daemon at ``socket`` (default: :func:`default_socket_path`,
    which honours $CUDAIPC_SOCKET). Raises StoreGone when there is no daemon.

    ``fast_path`` (default on) releases leases and takes them back through the
    connection's lease table, with no system call; off, every lease goes through the
    socket (as the Go client's Options.NoFastPath).

    ``spin`` is how long (seconds) a call polls the socket for its own reply before
    it sleeps, so that a quick reply costs no thread wake-up: None means 50 µs, 0
    none; $CUDAIPC_SPIN (a Go duration such as "50us" or "0") overrides it, as for
    the Go client. A window that finds nothing makes the next receives skip polling
    (1, 2, 4 ... 64 of them), so a slow daemon costs little CPU."""
    return Store(socket, client_name, fast_path, spin)


# -- helpers ---------------------------------------------------------------------------------

def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _encode_get(name: str, timeout_ms: int) -> bytes:
    """Request.get{name, timeout_ms} without the id: built by hand, as it is the hot
    path (a protobuf message costs several times more to build); the schema tests
    check it against the protobuf encoding."""
    nb = name.encode("utf-8")
    body = b"\x0a" + _varint(len(nb)) + nb
    if timeout_ms:
        body += b"\x10" + _varint(timeout_ms)
    return b"\x72" + _varint(len(body)) + body   # field 14, length-delimited


class _Release:
    """Request.release{lease_id}, encoded by hand (see _encode_get)."""

    __slots__ = ("body",)

    def __init__(self, lease_id: int):
        inner = b"\x08" + _varint(lease_id)
        self.body = b"\x7a" + _varint(len(inner)) + inner   # field 15

_ordinal_uuid: Dict[int, str] = {}   # GPU ordinal -> its UUID text (the ordinals of a process do not change)


def _resolve_device(device: Any) -> str:
    """The protocol's device string: "" for host, a GPU UUID for a GPU."""
    if device is None or device == "host" or device == "":
        return ""
    if type(device) is int and device in _ordinal_uuid:
        return _ordinal_uuid[device]
    if type(device).__module__.startswith("torch") and hasattr(device, "type"):  # torch.device
        if device.type == "cpu":
            return ""
        device = device.index if device.index is not None else 0
    if isinstance(device, str) and re.fullmatch(r"cuda(:\d+)?", device):
        device = int(device[5:] or 0)
    if isinstance(device, str) and device.lstrip("-").isdigit():
        device = int(device)
    if isinstance(device, int) and not isinstance(device, bool):
        from . import _cuda
        us = _cuda.uuids()
        if not 0 <= device < len(us):
            raise InvalidArgument("create", "", "GPU ordinal %d: this process sees %d GPUs" % (device, len(us)))
        text = _ordinal_uuid[device] = gpu_uuid_text(us[device])
        return text
    if isinstance(device, str):
        try:
            return gpu_uuid_text(parse_gpu_uuid(device))
        except ValueError:
            pass
    raise InvalidArgument("create", "", "device %r: want None or 'host', a GPU ordinal, 'cuda:N' or a GPU UUID" % (device,))


def _desc(nbytes: int, dtype: Any, shape: Optional[Sequence[int]], strides: Optional[Sequence[int]], name: str) -> Optional[TensorDesc]:
    if dtype is None:
        if shape is not None or strides is not None:
            raise InvalidArgument("create", name, "shape and strides need a dtype")
        return None
    try:
        dn = _views.dtype_name(dtype)
        lay = _views.resolve_layout(nbytes, None, dn, shape)
    except (TypeError, ValueError) as e:
        raise InvalidArgument("create", name, str(e)) from None
    st = tuple(int(s) for s in strides) if strides is not None else None
    if st is not None:
        if len(st) != len(lay.shape) or any(s < 0 for s in st):
            raise InvalidArgument("create", name, "strides %r: want one non-negative stride per dimension of %r" % (st, lay.shape))
        lay = _views.Layout(dn, lay.shape, st)
        if lay.extent() > nbytes:
            raise InvalidArgument("create", name, "shape %r with strides %r of %s needs %d bytes; the object has %d" % (lay.shape, st, dn, lay.extent(), nbytes))
    return TensorDesc(dn, lay.shape, st)


_raw_stream: Any = None
# put(reserve_next=True) of at least this many bytes reads the next object's create
# reply while its own copy runs (a 256 MiB copy outlasts the round trip).
_PREPARE_AHEAD_BYTES = 256 << 20
# How long put polls for the answer to a seal once its copy is done (unless polling
# is off: connect(spin=0) or CUDAIPC_SPIN=0).
_SEAL_SPIN = 500e-6


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


class _Source:
    """What put copies from: host bytes (an address) or device memory (a pointer)."""

    def __init__(self, nbytes: int, dtype: Optional[str], shape: Optional[Tuple[int, ...]],
                 addr: int, ordinal: Optional[int], keep: Any, stream: int = 0):
        self.nbytes, self.dtype, self.shape = nbytes, dtype, shape
        self.addr, self.ordinal, self.keep, self.stream = addr, ordinal, keep, stream

    @classmethod
    def of(cls, data: Any) -> "_Source":
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
            a = cupy.ascontiguousarray(data)
            return cls(a.nbytes, a.dtype.name, tuple(a.shape), a.data.ptr, a.device.id, a,
                       cupy.cuda.get_current_stream().ptr)
        if mod.startswith("numpy"):
            import numpy as np
            a = np.ascontiguousarray(data)
            return cls(a.nbytes, _views.dtype_name(a.dtype) if a.dtype.name in _views.DTYPES else None,
                       tuple(a.shape) if a.dtype.name in _views.DTYPES else None, a.ctypes.data, None, a)
        mv = memoryview(data).cast("B")
        if not mv.contiguous:
            raise InvalidArgument("put", "", "the buffer is not contiguous")
        buf = (ctypes.c_char * mv.nbytes).from_buffer_copy(mv) if mv.readonly else (ctypes.c_char * mv.nbytes).from_buffer(mv)
        return cls(mv.nbytes, None, None, ctypes.addressof(buf), None, (mv, buf))

    def copy_to(self, m: _Memory) -> None:
        if self.nbytes == 0:
            return
        if not m.is_gpu and self.ordinal is None:
            ctypes.memmove(m.addr, self.addr, self.nbytes)
            return
        from . import _cuda
        cu = _cuda.driver()
        if m.is_gpu and self.ordinal is not None:
            with _cuda.on(self.ordinal):
                _cuda.memcpy_dtod(m.addr, self.addr, self.nbytes, cu.CUstream(self.stream))
        elif m.is_gpu:
            with _cuda.on(m.ordinal):  # type: ignore[arg-type]
                _cuda.memcpy_htod(m.addr, self.addr, self.nbytes)
        else:
            with _cuda.on(self.ordinal):  # type: ignore[arg-type]
                _cuda.check("cuStreamSynchronize", cu.cuStreamSynchronize(cu.CUstream(self.stream)))
                _cuda.memcpy_dtoh(m.addr, self.addr, self.nbytes)


_ = (Closed, CudaError, StoreError, Union)
