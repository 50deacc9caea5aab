"""The store client (the Go client's client.go and ops.go): connect, create/put/seal,
get -> Lease, stat/list/delete/subscribe. The parts it is made of are modules of
their own: the connection and wire (_wire, _encode), memory records (_memory, lease), the GPU
arena cache (_arenas) and the put pipeline (_put)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence

from . import _deps
from . import _fastpath
from . import _store_pb2 as pb
from . import bundle as _bundle
from . import extmem as _extmem
from ._arenas import MAX_IDLE_ARENAS, ArenaCache
from ._external import HostMaps, external_record, host_record
from ._device import is_host, resolve_device
from ._fastpath import LeaseTable
from . import _kvpool
from . import _nocopy
from ._memory import GPUClose, Hold, ManifestFD, Record
from ._put import Putter
from ._encode import Release, encode_get
from ._wire import Conn, Reply, spin_option
from .errors import (Closed, InternalError, InvalidArgument, NotFound, PermissionDenied, StoreError,
                     StoreGone, Timeout, from_code)
from .info import (EVENT_KINDS, SHARE_CUDA_IPC, SHARE_HOST, SHARE_VMM_FD, Event, Notice, ObjectInfo, ServerInfo, TensorDesc,
                   desc_from_pb, desc_to_pb, info_from_pb)
from .lease import Lease, Object, retaken

__all__ = ["connect", "default_socket_path", "share", "Store", "Lease", "Object", "ObjectInfo",
           "TensorDesc", "Event", "ServerInfo", "MAX_IDLE_ARENAS"]

_log = logging.getLogger("cudaipc")

MAX_OBJECT_SIZE = 1 << 40
MAX_NOTICE_PAYLOAD = 4096   # protocol.MaxNoticePayload
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


class Store:
    """A connection to the store daemon (:func:`connect`). Safe to use from several
    threads; a ``get`` that waits holds up no other call."""

    def __init__(self, socket: Optional[str] = None, client_name: Optional[str] = None,
                 fast_path: bool = True, spin: Optional[float] = None,
                 max_idle_arenas: Optional[int] = None):
        path = socket or default_socket_path()
        self._table: Optional[LeaseTable] = None
        self._host_maps = HostMaps()
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
        self._arenas = ArenaCache(self._conn, MAX_IDLE_ARENAS if max_idle_arenas is None else max_idle_arenas)
        self._put = Putter(self._conn, self.create, self._created, self._device)
        self._published = _nocopy.Publications(self._conn)   # this connection's no-copy publishes
        self._kept_sources = _nocopy.KeptSources(self._conn)  # what its no-copy reads keep
        self._conn.on_arenas_freed = self._arenas_freed
        name = client_name or "%s[%d]" % (os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python"), os.getpid())
        try:
            r = self._conn.call(pb.Request(hello=pb.HelloRequest(version=PROTOCOL_VERSION, client_name=name[-255:])), "dial")
        except StoreGone:
            refusal = self._conn.refusal()
            self._conn.close()
            if refusal is not None:
                raise refusal from None
            raise StoreGone("dial", message="the daemon at %s closed the connection during the handshake "
                            "(is this uid admitted? see 'cudaipc serve --allow-uid')" % path) from None
        except BaseException:
            self._conn.close()
            raise
        h = r.resp.hello
        if h.version != PROTOCOL_VERSION:
            self._conn.close()
            raise InternalError("dial", message="daemon answered version %d to version %d" % (h.version, PROTOCOL_VERSION))
        self.server = ServerInfo(h.version, h.server_version, h.pid, h.backend, h.peer_uid, h.node)
        if fast_path:
            self._open_lease_table()
        if h.backend == "cuda":
            _warm_gpu()

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
        self._put.forget_ahead()   # the daemon aborts it with the connection
        self._conn.close()
        self._published.close()
        self._kept_sources.close()
        self._put.close_events()
        if self._table is not None:
            self._table.close()   # idle leases let go of their arenas
        self._arenas.close()
        self._host_maps.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- register (memory this process owns) -------------------------------------------
    def register(self, name: str, obj: Any, nbytes: Optional[int] = None, *, shared: bool = False,
                 space: bytes = b"") -> ObjectInfo:
        """Make a CUDA tensor/array this process allocated readable under ``name``
        without copying it (cudaipc.extmem): VMM memory (PyTorch with
        expandable_segments:True) as descriptors that readers in other containers map
        read-only and that outlive this process; cudaMalloc memory as a legacy region,
        removed when this connection closes. Keep the memory alive meanwhile. Raises
        extmem.NotExportable naming the fix for memory that cannot be shared.
        ``space`` (cudaipc.kv's) is the description of the KV space the memory is a
        region of; the daemon returns it in the object's info."""
        with _extmem.export_pointer(obj, nbytes) as x:
            rep = _extmem.send_register(self._conn, name, x, shared, space)
        return info_from_pb(rep.resp.register.info)

    def register_host(self, name: str, fd: int, nbytes: int, *, shared: bool = False,
                      space: bytes = b"") -> ObjectInfo:
        """Make the first ``nbytes`` of the memfd ``fd`` (created with
        MFD_ALLOW_SEALING; the daemon seals it against shrinking) readable under
        ``name`` without copying (Go's Client.RegisterHost): the daemon keeps a
        duplicate of the descriptor and hands readers duplicates, whose leases map it
        read-only. When this connection ends the object is orphaned: readable while
        leased, gone with its last lease. ``fd`` stays this caller's to close.
        ``space`` as for :meth:`register`."""
        if not isinstance(nbytes, int) or not 0 < nbytes <= MAX_OBJECT_SIZE:
            raise InvalidArgument("register", name, "host memory needs its memfd and a size of 1..%d bytes, not %r" % (MAX_OBJECT_SIZE, nbytes))
        req = pb.Request(register=pb.RegisterRequest(name=name, size=nbytes, device="host", shared=shared,
                                                     files=1, space=space))
        with self._conn.staging_lock:
            rep = self._conn.call(req, "register", name, fds=[fd])
        return info_from_pb(rep.resp.register.info)

    # -- create / put ----------------------------------------------------------------
    def create(self, name: str, nbytes: int, device: Any = None, *, shared: bool = False,
               dtype: Any = None, shape: Optional[Sequence[int]] = None,
               strides: Optional[Sequence[int]] = None, versioned: bool = False, version: int = 0,
               shards: int = 0, shard: int = 0, keep_last: int = 0,
               manifest: Optional[bytes] = None, cluster: bool = False,
               _spin: Optional[float] = None) -> Object:
        """Allocate a writable object of ``nbytes`` on ``device`` ("host" or None, a GPU
        ordinal, "cuda:N", a torch.device, or a GPU UUID). Give ``dtype`` (and ``shape``,
        ``strides`` in elements) to record what the bytes are for readers.

        ``cluster`` makes it cluster-visible once sealed, on a daemon that is part of a
        cluster (docs/cluster.md): other nodes' daemons pull it for their readers.

        ``versioned`` (see :meth:`publish`) makes shard ``shard`` of ``shards`` of a
        version of ``name``; ``manifest`` (a safetensors header) makes a bundle (see
        :meth:`put_bundle`)."""
        dev = self._device(device, "create", name)
        if not isinstance(nbytes, int) or not 0 < nbytes <= MAX_OBJECT_SIZE:
            raise InvalidArgument("create", name, "size %r is outside 1..%d" % (nbytes, MAX_OBJECT_SIZE))
        desc = TensorDesc.of(nbytes, dtype, shape, strides, name)
        req = pb.Request(create=pb.CreateRequest(name=name, size=nbytes, device=dev, shared=shared,
                                                 versioned=versioned, version=version, shards=shards,
                                                 shard=shard, keep_last=keep_last,
                                                 manifest_size=len(manifest or b""), cluster=cluster))
        if desc is not None:
            req.create.tensor.CopyFrom(desc_to_pb(desc))
        r = self._conn.call(req, "create", name, spin=_spin)
        return self._created(r, name, nbytes, desc, manifest, shard, shared)

    def _device(self, device: Any, op: str, name: str) -> str:
        """The protocol's device string of ``device`` (resolve_device), refusing a GPU
        on a daemon without a GPU backend before this process looks for one."""
        if self.server.backend == "host" and not is_host(device):
            msg = ("device %r: the daemon at %s has no GPU backend, only host memory (it runs --backend host, "
                   "or --backend auto found no GPU): GPU objects need 'cudaipc serve --backend auto' (or cuda) "
                   "on a machine with a GPU" % (device, self.socket))
            if not _deps.available("cuda.bindings"):
                msg += "; this process also needs NVIDIA's cuda-bindings for them (%s)" % _deps.install_hint("cuda.bindings")
            raise InvalidArgument(op, name, msg)
        return resolve_device(device)

    def _created(self, r: Reply, name: str, nbytes: int, desc: Optional[TensorDesc] = None,
                 manifest: Optional[bytes] = None, shard: int = 0, shared: bool = False) -> Object:
        """The Object of a create's reply."""
        p = r.resp.create.placement
        if not p.writable or p.size != nbytes or (r.manifest_fd >= 0) != bool(manifest):
            self._conn.cleanup(r, "create", name)
            raise InternalError("create", name, "daemon sent no writable placement of the requested size")
        if r.manifest_fd >= 0:
            try:
                os.pwrite(r.manifest_fd, manifest, 0)   # type: ignore[arg-type]
            except OSError as e:
                self._conn.cleanup(r, "create", name)
                raise InternalError("create", name, "writing the manifest: %s" % e) from None
            os.close(r.manifest_fd)
            r.manifest_fd = -1
        try:
            rec = self._record(r, p, name, desc, pb.Request(abort=pb.AbortRequest(
                name=name, version=r.resp.create.version, shard=shard)), "create")
        except BaseException:
            self._conn.cleanup(r, "create", name)
            raise
        return Object(self._conn, rec, desc, r.resp.create.version, shard, shared)

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
        return _bundle.put_bundle(self, name, state_dict, device, **kw)

    def publish_no_copy(self, name: str, state_dict: Any, *, keep_last: int = 0, shared: bool = False,
                        metadata: Optional[Mapping[str, str]] = None, stream: Any = None,
                        release_timeout: Optional[float] = 60.0) -> Any:
        """Publish the next version of the bundle ``name`` as the tensors' own memory,
        copying nothing (the Go client's PublishNoCopy; ``put_bundle(...,
        publish=True, copy=False)`` is its older spelling), and return its
        ``BundleInfo``. The version points into the tensors, one region per CUDA
        allocation they lie in (legacy IPC for PyTorch's default allocator: readers
        in this PID namespace, valid while this process lives; VMM descriptors for
        ``expandable_segments:True``, across containers). The tensors must be
        contiguous CUDA tensors of one GPU that do not overlap, and must not change
        while readers copy: call :meth:`wait_released` before changing them (this
        call does it first, waiting at most ``release_timeout`` seconds and raising
        Timeout naming the readers' count). The tensors' stream (or ``stream``) is
        synchronized before the seal. The version stays on this node."""
        v, span, n, dev = self._published.publish(name, state_dict, keep_last=keep_last, shared=shared,
                                                  metadata=dict(metadata) if metadata else None, stream=stream,
                                                  release_timeout=release_timeout)
        return _bundle.BundleInfo(name, v, span, n, dev)

    def get_bundle(self, name: str, timeout: Optional[float] = None, **kw: Any) -> Any:
        """Zero-copy tensors of a bundle, by name; see :func:`cudaipc.bundle.get_bundle`."""
        return _bundle.get_bundle(self, name, timeout, **kw)

    def put(self, name: str, data: Any, device: Any = None, *, shared: bool = False,
            reserve_next: bool = False) -> ObjectInfo:
        """Copy ``data`` into a new sealed object and return its info (as created: no
        extra round trip; ``stat`` for the daemon's view). ``data`` is a
        torch.Tensor (CPU or CUDA), a CuPy or NumPy array, or any bytes-like object
        (NumPy arrays of Python objects are refused). ``device`` defaults to where the
        data is; GPU->GPU copies run on the data's current stream and finish before the
        seal. dtype and shape are recorded.

        ``reserve_next`` creates the next object ahead, after this one is sealed
        (pipelined: put does not wait for it): an unsealed object of the same size,
        device and sharing under a name of this connection's own
        (``.put-ahead.<pid>.<n>``). The next ``put`` of that size, device and sharing
        copies straight into it and publishes it under its name with one round trip
        (seal under another name) instead of two. It costs one object's memory until
        then (counted against the daemon's capacity and your quota, never evicted); a
        put that does not match, or :meth:`close`, gives it back."""
        return self._put.put(name, data, device, shared, reserve_next)

    # -- get ---------------------------------------------------------------------------
    def get(self, name: str, timeout: Optional[float] = None, *, version: int = 0, shard: int = 0,
            newer_than: int = 0, wait: bool = False, tensors: Optional[List[str]] = None) -> Lease:
        """Lease the sealed object ``name``. Without ``timeout`` or ``wait`` it does not
        wait: NotFound when no sealed object of that name is visible (none, or one
        still being written: unsealed objects are invisible to readers). With
        ``timeout`` it waits at most that many seconds for it to be sealed (Timeout
        after); with ``wait=True``, without limit (docs/protocol.md, get).

        For a versioned name: ``version`` (0: the latest), ``shard``, and ``newer_than``
        (wait for a version above it; it waits as ``wait`` does). A lease on any shard
        keeps the whole version, so ``get(name, version=lease.version, shard=k)`` finds
        every other shard of it.

        ``tensors`` (get_bundle's) names the tensors of a bundle wanted: a daemon of a
        cluster that does not hold the bundle may then lease a partial replica of
        just those (``info.partial``); one that holds it leases the whole."""
        t = self._table
        if t is not None and t.idle.get(name) and not (version or shard or newer_than or tensors) and self._conn.dead is None:
            g = t.retake(name)
            if g is not None:
                return retaken(g)   # the hot path (docs/python.md, "What a cycle costs")
        return self._get(name, timeout, version, shard, newer_than, wait, tensors)

    def _get(self, name: str, timeout: Optional[float], version: int, shard: int, newer_than: int,
             wait: bool, tensors: Optional[List[str]]) -> Lease:
        """:meth:`get` through the socket. ``tensors`` (from get_bundle) names the
        tensors of a bundle wanted: a daemon of a cluster that does not hold the bundle
        may then lease a partial replica of just those (``info.partial``; its manifest
        lists only them), one that holds it leases the whole."""
        t = self._table
        if timeout is not None:
            ms = max(int(timeout * 1000), 0)
        else:
            ms = -1 if wait or newer_than else 0
        try:
            if version or shard or newer_than or tensors:
                r = self._conn.call(pb.Request(get=pb.GetRequest(name=name, timeout_ms=ms, version=version,
                                                                 shard=shard, newer_than=newer_than,
                                                                 tensors=tensors or [])), "get", name)
            else:
                r = self._conn.call_raw(encode_get(name, ms), "get", name)
        except Timeout:
            if timeout is not None or ms != 0:
                raise
            raise NotFound("get", name, "no sealed object of that name is visible to you "
                           "(get(name, wait=True) or a timeout waits for one)") from None
        g = r.resp.get
        p = g.placement
        if p.writable:
            self._conn.cleanup(r, "get", name)
            raise InternalError("get", name, "daemon sent a writable placement for a get")
        info = g.info if g.HasField("info") else None
        desc = desc_from_pb(info.tensor) if info is not None and info.HasField("tensor") else None
        if info is not None and info.sources_size:
            return self._sources_lease(r, p, info, name, desc)
        try:
            if p.external and p.kind == pb.Placement.HOST:
                rec = host_record(self._host_maps, self._conn, r, p, name, desc, Release(g.lease_id))
            elif p.external:
                rec = external_record(self._conn, r, p, name, desc, Release(g.lease_id), g.lease_id)
            else:
                rec = self._record(r, p, name, desc, Release(g.lease_id), "get")
        except BaseException:
            self._conn.cleanup(r, "get", name)
            raise
        rec.lease_id, rec.info_pb, rec.placement = g.lease_id, info, p
        hold = Hold(rec)   # from here on, the lease ends when this goes
        if r.manifest_fd >= 0:
            manifest, r.manifest_fd = ManifestFD(r.manifest_fd), -1
            return Lease(hold, rec, manifest)
        if g.lease_slot and t is not None and g.lease_slot <= t.slots:
            # A slot in the lease table: this lease ends by a compare-and-swap, and a
            # later get of the name takes it back the same way (docs/protocol.md 6.7).
            t.granted(g.lease_slot)
            rec.arena_id = p.arena_id
            t.prepare(rec, g.lease_slot, g.lease_gen)
            rec.table = t
        return Lease(hold, rec)

    def _sources_lease(self, r: Reply, p: Any, info: Any, name: str, desc: Optional[TensorDesc]) -> Lease:
        """The lease of a version published without a copy (docs/protocol.md 6.8): its
        regions mapped (cudaipc._nocopy), read with get_bundle and load_into."""
        g = r.resp.get
        try:
            maps, manifest = self._kept_sources.lease_sources(r, p, info, name)
        except BaseException:
            self._conn.cleanup(r, "get", name)
            raise
        share = SHARE_VMM_FD if p.kind == pb.Placement.VMM_FD else SHARE_CUDA_IPC
        rec = Record(self._conn, name, p.size, p.device, 0, maps.ordinal, False, share, None,
                     GPUClose(maps.release), desc, Release(g.lease_id))
        rec.lease_id, rec.info_pb = g.lease_id, info
        return _nocopy.SourcesLease(Hold(rec), rec, manifest, maps)

    def wait_released(self, name: str, timeout: Optional[float] = 60.0) -> int:
        """Withdraw the versions of ``name`` this connection published without a copy
        (``put_bundle(..., copy=False)``) and wait until no reader holds a lease of
        them: from then on the tensors they point into may change. No new lease of
        them is granted meanwhile (readers of the latest wait for the next version).
        Raises Timeout, naming how many readers still hold leases, when ``timeout``
        seconds pass first (None: no limit); the versions stay withdrawn. Returns how
        many versions were withdrawn. The next no-copy put_bundle does this first."""
        return self._published.withdraw(name, timeout)

    def _record(self, r: Reply, p: Any, name: str, desc: Optional[TensorDesc], end: Any, op: str) -> Record:
        """The Record of a placement (the placement states its kind: protocol version 2)."""
        if p.kind == pb.Placement.HOST:
            if r.arena is None:
                raise InternalError(op, name, "host placement without a mapped arena")
            return Record(self._conn, name, p.size, "host", r.arena.addr + p.offset, None, p.writable,
                          SHARE_HOST, r.arena, None, desc, end)
        if p.kind == pb.Placement.CUDA_IPC:
            a = self._arenas.ipc_arena(p, op, name)
        elif p.kind == pb.Placement.VMM_FD and r.fd >= 0:
            fd, r.fd = r.fd, -1
            a = self._arenas.fd_arena(fd, p, op, name)
        else:
            raise InternalError(op, name, "placement of kind %d without what it needs" % p.kind)
        return Record(self._conn, name, p.size, p.device, a.ptr + p.offset, a.ordinal, p.writable,
                      a.share, None, self._arenas.use(a), desc, end)

    def _arenas_freed(self, ids: Sequence[int]) -> None:
        """The daemon says these arenas hold no object any more: unmap them (GPU ones
        as soon as no view uses them) and tell it (forget_arenas)."""
        if self._table is not None:
            self._table.drop_arenas(ids)   # their idle leases were reclaimed
        self._conn.drop_host_arenas(ids)
        host = self._arenas.freed(ids)
        if host:
            self._conn.send_detached(pb.Request(forget_arenas=pb.ForgetArenasRequest(arena_ids=host[:1024])))

    # -- the rest --------------------------------------------------------------------------
    def stat(self, name: str) -> ObjectInfo:
        """Describe one object; NotFound if there is none this user may read."""
        r = self._conn.call(pb.Request(stat=pb.StatRequest(name=name)), "stat", name)
        return info_from_pb(r.resp.stat.info)

    def list(self) -> List[ObjectInfo]:
        """The objects this user may read, sorted by name (Go: Client.List)."""
        out: List[ObjectInfo] = []
        after = ""
        while True:
            r = self._conn.call(pb.Request(list=pb.ListRequest(start_after=after)), "list")
            page = r.resp.list
            out.extend(info_from_pb(o) for o in page.objects)
            if not page.more or not page.objects:
                return out
            after = out[-1].name

    def delete(self, name: str) -> None:
        """Remove the object's name now; its memory is freed when its last lease ends
        (Go: Client.Delete)."""
        self._conn.call(pb.Request(delete=pb.DeleteRequest(name=name)), "delete", name)

    ls = list
    """The command line's name of :meth:`list`."""
    rm = delete
    """The command line's name of :meth:`delete`."""

    # -- KV block pools (docs/kv.md, "Block pools"; cudaipc.kv) -------------------
    def create_pool(self, name: str, block_bytes: int, capacity: int, *, key_bytes: int = 32,
                    shared: bool = False, device: Optional[str] = None, cluster: bool = False) -> "_kvpool.Pool":
        """Make the KV block pool ``name`` (Go's Client.CreatePool): ``capacity`` bytes
        of the daemon's host memory, taken at once and charged to this uid's quota,
        cut into blocks of ``block_bytes`` under keys of ``key_bytes`` (16 to 32);
        ``shared`` lets every admitted uid look blocks up and get them; ``cluster``
        makes it cluster-wide (docs/kv.md, "Across the cluster"). Returns the
        :class:`cudaipc.kv.Pool`. Exists, StoreFull, LimitReached, InvalidArgument."""
        return _kvpool.create_pool(self._conn, name, block_bytes, capacity, key_bytes=key_bytes, shared=shared, device=device,
                                   cluster=cluster)

    def open_pool(self, name: str) -> "_kvpool.Pool":
        """The existing KV block pool ``name`` (another uid's shared one by
        ``UID:NAME``); NotFound if there is none this uid may read."""
        return _kvpool.open_pool(self._conn, name)

    def stat_pool(self, name: str) -> "_kvpool.PoolInfo":
        """Describe the KV block pool ``name`` (Go's Client.StatPool)."""
        return _kvpool.stat_pool(self._conn, name)

    def delete_pool(self, name: str) -> None:
        """Remove the KV block pool ``name`` (its owner's uid or root; Go's
        Client.DeletePool); readers that mapped it keep their mappings."""
        _kvpool.delete_pool(self._conn, name)

    def list_pools(self) -> List["_kvpool.PoolInfo"]:
        """The KV block pools this uid may read, by qualified name (Go's
        Client.ListPools)."""
        return _kvpool.list_pools(self._conn)

    def connection(self) -> Conn:
        """The store's connection to its daemon (the wire layer, cudaipc._wire): for the
        package's own modules that stream requests on it (cudaipc.kv across nodes)."""
        return self._conn

    def notify(self, name: str, payload: bytes = b"") -> None:
        """Send ``payload`` (at most MAX_NOTICE_PAYLOAD bytes) to the process that
        registered the memory ``name``, which this connection must be able to get
        (Go's Client.Notify): a KV reader's word that it is done with a space's blocks.
        NotFound when there is no such registered memory or its exporter's connection
        ended; LimitReached when the exporter has too many notices not delivered."""
        if len(payload) > MAX_NOTICE_PAYLOAD:
            raise InvalidArgument("notify", name, "a payload of %d bytes: at most %d" % (len(payload), MAX_NOTICE_PAYLOAD))
        self._conn.call(pb.Request(notify=pb.NotifyRequest(name=name, payload=bytes(payload))), "notify", name)

    def notify_space(self, space: bytes, payload: bytes = b"") -> None:
        """Send ``payload`` (at most MAX_NOTICE_PAYLOAD bytes) to the engine of the KV
        space whose description is ``space`` (its binary encoding), registered on another
        node of the daemon's cluster (Go's Client.NotifySpace): both daemons forward it,
        and the engine gets it as a notice of this uid on the space's first region, pid
        0. NotFound when that node has no such space for this uid or its engine is gone;
        UnavailableError when the node cannot be reached; InvalidArgument for a daemon
        outside a cluster or a space of its own node (use :meth:`notify`)."""
        if len(payload) > MAX_NOTICE_PAYLOAD:
            raise InvalidArgument("kv_notify", "", "a payload of %d bytes: at most %d" % (len(payload), MAX_NOTICE_PAYLOAD))
        self._conn.call(pb.Request(kv_notify=pb.KvNotifyRequest(space=bytes(space), payload=bytes(payload))), "kv_notify", "")

    def read_space(self, src: bytes, dst: bytes, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   first: int = 0, count: int = 0, progress: Optional[Callable[[int], None]] = None,
                   timeout: Optional[float] = None) -> None:
        """Have this connection's daemon read block ``src_blocks[i]`` of the KV space
        whose description (bytes) is ``src``, registered on another node of its
        cluster, into block ``dst_blocks[i]`` of the space ``dst`` registered with it
        by this uid, for layers ``[first, first + count)`` (count 0: all from first):
        one kv_read (docs/protocol.md section 6.9; Go's Client.ReadSpace).
        ``progress(layers)`` is called, on this thread, each time more of the first
        layers are complete. Returns when the read has ended; raises its StoreError
        (InvalidArgument, NotFound, PermissionDenied, UnavailableError, Timeout).
        ``timeout`` (seconds) bounds the read at the daemon. A call left by an
        exception (a progress callback's, say) asks the daemon to stop the read.
        cudaipc.kv.read_blocks is the call engines use."""
        req = pb.KvReadRequest(src=bytes(src), dst=bytes(dst), src_blocks=src_blocks, dst_blocks=dst_blocks,
                               first=first, count=count)
        if timeout is not None:
            req.timeout_ms = max(int(timeout * 1000), 1)
        conn = self._conn
        rid = conn.send(pb.Request(kv_read=req))
        ended = False
        try:
            while True:
                r = conn.wait(rid)
                if r.resp.HasField("error") and r.resp.error.code != 0:
                    ended = True
                    raise from_code(r.resp.error.code, "kv_read", "", r.resp.error.message)
                if r.resp.WhichOneof("body") != "kv_read":
                    ended = True
                    raise InternalError("kv_read", message="the daemon answered a kv_read with %s"
                                        % r.resp.WhichOneof("body"))
                if r.resp.kv_read.done:
                    ended = True
                    return
                if progress is not None:
                    progress(r.resp.kv_read.layers)
        finally:
            if not ended:
                conn.drop_stream(rid)
                conn.send_detached(pb.Request(kv_cancel=pb.KvCancelRequest(read_id=rid)))

    def take_notices(self, *names: str) -> List[Notice]:
        """Remove and return the notices readers sent about the registered memory
        ``names`` (qualified, as Notice.name; every notice without names), oldest
        first, without waiting for more (what the socket holds is read first).
        Notices are kept until taken, the newest 65,536 of them."""
        return [_notice(n) for n in self._conn.take_notices(names, 0.0)]

    def wait_notices(self, *names: str, timeout: Optional[float] = None) -> List[Notice]:
        """:meth:`take_notices` that waits until there is at least one, at most
        ``timeout`` seconds (None: no limit); [] when the timeout passes first."""
        return [_notice(n) for n in self._conn.take_notices(names, timeout)]

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
            kind = EVENT_KINDS.get(ev.kind)
            if kind is not None:
                yield Event(kind, ev.name, ev.version)

    def __repr__(self) -> str:
        return "<cudaipc.Store %s backend=%s>" % (self.socket, getattr(self, "server", None) and self.server.backend)


def _notice(n: Any) -> Notice:
    return Notice(n.name, bytes(n.payload), n.uid, n.pid)


_warmed = False


def _warm_gpu() -> None:
    """The one-time set-up of this process that a GPU bundle's first version would
    otherwise pay inside its publish -> loaded time (tens of milliseconds): importing
    NumPy (copy plans), loading the driver bindings, resolving the batched copy. Done
    when the first connection to a GPU daemon is made; what is missing is left to
    fail where it is needed, with its own message."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    try:
        from . import _cuda, _cuda_ctypes
        _cuda.driver()
        _cuda_ctypes.warm()
    except Exception:  # noqa: BLE001 - no driver or bindings here: GPU calls say so when made
        pass


def connect(socket: Optional[str] = None, client_name: Optional[str] = None, *,
            fast_path: bool = True, spin: Optional[float] = None,
            max_idle_arenas: Optional[int] = None) -> Store:
    """Connect to the store daemon at ``socket`` (default: :func:`default_socket_path`,
    which honours $CUDAIPC_SOCKET). Raises StoreGone when there is no daemon.

    ``fast_path`` (default on) releases leases and takes them back through the
    connection's lease table, with no system call; off, every lease goes through the
    socket (as the Go client's Options.NoFastPath).

    ``spin`` is how long (seconds) a call polls the socket for its own reply before
    it sleeps, so that a quick reply costs no thread wake-up: None means 50 µs, 0
    none; $CUDAIPC_SPIN (a Go duration such as "50us" or "0") overrides it, as for
    the Go client. A window that finds nothing makes the next receives skip polling
    (1, 2, 4 ... 64 of them), so a slow daemon costs little CPU.

    ``max_idle_arenas`` bounds the GPU arenas kept mapped while no lease or object
    uses them (None: MAX_IDLE_ARENAS, 64, as the Go client's DefaultMaxIdleArenas;
    0 or less: none)."""
    return Store(socket, client_name, fast_path, spin, max_idle_arenas)


def share(obj: Any, name: Optional[str] = None, store: Optional[Store] = None, *, shared: bool = True) -> Any:
    """Register ``obj`` with ``store`` (default: a new connection, which must then stay
    open while the registration should last) under ``name`` (default: a name made from
    this process's id and the address). Returns (store, ObjectInfo)."""
    st = store or connect()
    ptr = obj if isinstance(obj, int) else _extmem.pointer_and_size(obj, None)[0]
    info = st.register(name or "shared/%d/%x" % (os.getpid(), ptr), obj, shared=shared)
    return st, info
