"""What the store says about objects: ObjectInfo, TensorDesc, Event, ServerInfo, and
the share-kind vocabulary (the Go client's client/info.go)."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Dict, Optional, Sequence, Tuple

from . import _store_pb2 as pb
from . import _views
from .errors import InvalidArgument
from .region import Region, decode_region

__all__ = ["TensorDesc", "ObjectInfo", "Event", "Notice", "ServerInfo", "SHARE_HOST", "SHARE_CUDA_IPC",
           "SHARE_VMM_FD", "SHARE_KINDS"]

# How an object's memory reaches a client: the protocol's Placement kinds (HOST,
# CUDA_IPC, VMM_FD), spelled as region kinds are (docs/region.md: "host",
# "cuda-ipc", "vmm-fd"), the one vocabulary of both clients.
SHARE_HOST = "host"
SHARE_CUDA_IPC = "cuda-ipc"
SHARE_VMM_FD = "vmm-fd"
SHARE_KINDS: Dict[int, str] = {pb.Placement.HOST: SHARE_HOST, pb.Placement.CUDA_IPC: SHARE_CUDA_IPC,
                               pb.Placement.VMM_FD: SHARE_VMM_FD}
# Lease.gpu_share's spelling (the daemon's --gpu-share values), kept for old callers.
LEGACY_GPU_SHARE: Dict[str, str] = {SHARE_HOST: "", SHARE_CUDA_IPC: "ipc", SHARE_VMM_FD: "fd"}


@dataclasses.dataclass(frozen=True)
class TensorDesc:
    """What an object's bytes are as a typed array: dtype name, shape, and strides in
    elements (None: C order). Recorded by the producer, returned by get/stat."""
    dtype: str
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]] = None

    @classmethod
    def of(cls, nbytes: int, dtype: Any, shape: Optional[Sequence[int]], strides: Optional[Sequence[int]],
           name: str) -> Optional["TensorDesc"]:
        """The descriptor a create records for ``nbytes`` of ``dtype`` in ``shape``
        (None without a dtype); InvalidArgument when they do not fit the size."""
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
        return cls(dn, lay.shape, st)


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
    external: bool = False          # memory a client registered (store.register), not the store's
    orphaned: bool = False          # registered VMM memory whose exporter is gone: readable while leased
    exporter_bound: bool = False    # a legacy registration: removed when its exporter disconnects
    partial: bool = False           # a partial replica: only the tensors a get_bundle named (docs/cluster.md)
    creator_can_write: bool = False  # sealed, yet its creator can still change its bytes (docs/hardening.md, "Sealed objects")
    space: bytes = b""              # registered memory of a KV space: the space's description (cudaipc.kv)



def desc_from_pb(t: Any) -> TensorDesc:
    """The TensorDesc of a wire TensorDesc."""
    return TensorDesc(t.dtype, tuple(t.shape), tuple(t.strides) or None)


def desc_to_pb(d: TensorDesc) -> Any:
    """The wire TensorDesc of ``d``."""
    return pb.TensorDesc(dtype=d.dtype, shape=list(d.shape), strides=list(d.strides or ()))


def info_from_pb(o: Any) -> ObjectInfo:
    """The ObjectInfo of a wire ObjectInfo."""
    region = None
    if o.region:
        try:
            region = decode_region(o.region)
        except Exception:  # noqa: BLE001 - a newer daemon's region kind: leave it out
            region = None
    return ObjectInfo(o.name, o.size, o.device, o.sealed, o.leases, o.shared, o.owner_uid,
                      datetime.datetime.fromtimestamp(o.created_unix_nano / 1e9, datetime.timezone.utc),
                      region, desc_from_pb(o.tensor) if o.HasField("tensor") else None,
                      o.version, o.shards, o.shard, o.manifest_size, o.tensors,
                      o.external, o.orphaned, o.exporter_bound, o.partial, o.creator_can_write, bytes(o.space))


@dataclasses.dataclass(frozen=True)
class Event:
    """A change in the store: kind is "sealed", "deleted", "evicted" or "aborted"."""
    kind: str
    name: str
    version: int = 0   # for a versioned name: the version (for "sealed": just published)


EVENT_KINDS = {pb.Event.SEALED: "sealed", pb.Event.DELETED: "deleted", pb.Event.EVICTED: "evicted",
               pb.Event.ABORTED: "aborted"}


@dataclasses.dataclass(frozen=True)
class Notice:
    """What a reader of memory this connection registered sent it (Store.notify):
    ``name`` is the registered memory's qualified name, ``uid`` and ``pid`` the
    sender's as the daemon saw them (Go's client.Notice)."""
    name: str
    payload: bytes
    uid: int
    pid: int


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What the daemon said in the handshake."""
    version: int
    server_version: str
    pid: int
    backend: str
    peer_uid: int = 0   # the uid the daemon sees this connection as (a qualified name's UID:)
    node: str = ""      # the daemon's node name in its cluster (docs/cluster.md); "" without one
