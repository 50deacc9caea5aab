"""Exceptions. Each store error code has its own class, mirroring the Go
client's sentinels (client.ErrNotFound is NotFound, and so on)."""

from __future__ import annotations

from typing import Dict, List, Optional, Type

__all__ = [
    "CudaipcError", "StoreError", "InvalidArgument", "NotFound", "Exists", "Timeout",
    "StoreFull", "PermissionDenied", "LimitReached", "NotSealed", "Sealed",
    "VersionMismatch", "InternalError", "UnavailableError", "DataLossError", "StoreGone",
    "Closed", "InvalidRegion", "CudaError", "KVError", "InvalidDescError", "LayoutMismatch",
    "StaleSpaceError", "KVNotSupported", "InvalidKVRequest", "BlockError", "BlockRangeError",
]


class CudaipcError(Exception):
    """Base class of every exception this package raises on purpose."""


class StoreError(CudaipcError):
    """A request to the store failed.

    Attributes: ``op`` (``"get"``, ``"create"``, ...), ``name`` (the object,
    or ``""``), ``message`` (the daemon's detail, for humans) and ``code``
    (the protocol's error code, 0 when the failure happened in this process).
    """

    code = 0
    text = "store error"

    def __init__(self, op: str, name: str = "", message: str = "", code: Optional[int] = None):
        self.op = op
        self.name = name
        self.message = message
        if code is not None:
            self.code = code
        s = "store " + op
        if name:
            s += " %r" % name
        s += ": " + self.text
        msg = message
        if msg.endswith(": " + self.text):
            msg = msg[: -len(self.text) - 2]
        if msg.startswith(self.text + ": "):
            msg = msg[len(self.text) + 2:]
        if msg and msg != self.text:
            s += ": " + msg
        super().__init__(s)


class InvalidArgument(StoreError, ValueError):
    """A malformed or out-of-range argument (code INVALID); Go's ErrInvalid."""
    code, text = 1, "invalid argument"


class NotFound(StoreError, KeyError):
    """No such object (or lease) visible to the caller; Go's ErrNotFound."""
    code, text = 2, "object not found"

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class Exists(StoreError):
    """The name is taken; Go's ErrExists."""
    code, text = 3, "object already exists"


class Timeout(StoreError, TimeoutError):
    """get waited its timeout without the object being sealed; Go's ErrTimeout."""
    code, text = 4, "timed out"


class StoreFull(StoreError, MemoryError):
    """Not enough memory on the device even after eviction; Go's ErrStoreFull."""
    code, text = 5, "store full"


class PermissionDenied(StoreError, PermissionError):
    """The caller may not do this, or the daemon does not admit this user; Go's ErrPermission."""
    code, text = 6, "permission denied"


class LimitReached(StoreError):
    """A per-client limit (objects, leases) was reached; Go's ErrLimit."""
    code, text = 7, "per-client limit reached"


class NotSealed(StoreError):
    """The operation needs a sealed object; Go's ErrNotSealed."""
    code, text = 8, "object not sealed"


class Sealed(StoreError):
    """The operation needs an unsealed object; Go's ErrSealed."""
    code, text = 9, "object already sealed"


class VersionMismatch(StoreError):
    """The daemon does not speak this client's protocol version; Go's ErrVersion."""
    code, text = 10, "protocol version not supported by the daemon"


class InternalError(StoreError):
    """A failure inside the daemon, or a reply that breaks the protocol; Go's ErrInternal."""
    code, text = 11, "internal store error"


class UnavailableError(StoreError):
    """A daemon in a cluster could not reach what the answer needs: the cluster
    directory (etcd), or every live node holding the object (code UNAVAILABLE);
    Go's ErrUnavailable.

    Nothing was lost: retry later. The connection to the daemon stays usable."""
    code, text = 12, "unavailable"


class DataLossError(StoreError):
    """A record or the bytes the answer needs do not verify: a directory record
    forged or written with another cluster secret, or an object whose bytes keep
    failing their checksums (code DATA_LOSS); Go's ErrDataLoss.

    Retrying does not help; the daemon's log and ``cudaipc doctor --cluster``
    say which record."""
    code, text = 13, "data does not verify"


class StoreGone(StoreError, ConnectionError):
    """There is no daemon, or the connection to it is lost; Go's ErrStoreGone.

    The Store is unusable afterwards: connect again."""
    text = "store daemon gone"


class Closed(StoreError):
    """A call on a Store after close(); Go's ErrClosed."""
    text = "client closed"


_BY_CODE: Dict[int, Type[StoreError]] = {
    c.code: c for c in (InvalidArgument, NotFound, Exists, Timeout, StoreFull, PermissionDenied,
                        LimitReached, NotSealed, Sealed, VersionMismatch, InternalError,
                        UnavailableError, DataLossError)
}


def from_code(code: int, op: str, name: str, message: str) -> StoreError:
    """The exception for a protocol error code; unknown codes are InternalError."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(op, name, message, code=code)


class InvalidRegion(CudaipcError, ValueError):
    """A malformed region (docs/region.md): ``field`` names the bad field; Go's ErrInvalidRegion."""

    def __init__(self, field: str, reason: str, what: str = "region"):
        self.field = field
        self.reason = reason
        super().__init__("cudaipc: invalid %s: %s: %s" % (what, field, reason))


class CudaError(CudaipcError, RuntimeError):
    """A CUDA driver call failed, or no driver or cuda-bindings is available.

    ``call`` names the driver function, ``result`` the CUresult name."""

    def __init__(self, call: str, result: str, detail: str = ""):
        self.call = call
        self.result = result
        self.detail = detail
        s = "%s: %s" % (call, result)
        if detail:
            s += " (" + detail + ")"
        super().__init__(s)


class KVError(CudaipcError):
    """Base class of the KV space errors (cudaipc.kv; the Go package kv's)."""


class InvalidDescError(KVError, ValueError):
    """A KV space description that breaks the format's rules (docs/kv.md): a bad
    encoding, a block past its region, sizes that overflow. ``field`` names the
    wrong field as Go's kv.DescError does; Go's kv.ErrInvalidDesc."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__("kv: invalid space description: %s: %s" % (field, reason))


class LayoutMismatch(KVError, ValueError):
    """Two spaces' layouts do not fit each other (layers, parts, block bytes), or a
    read's lists do not; Go's kv.ErrMismatch."""


class InvalidKVRequest(KVError, ValueError):
    """A read's field out of its bounds (a notify payload too long); Go's
    kv.ErrInvalidRequest."""


class StaleSpaceError(KVError):
    """The description names an earlier registration of the space: the name was
    registered again since; Go's kv.ErrStale."""


class KVNotSupported(KVError):
    """A read this version cannot do (between host and GPU memory, or between two
    GPUs); Go's kv.ErrNotSupported."""


class BlockError(KVError):
    """A read's failure: ``blocks`` are the destination block ids whose bytes are not
    (all) there, from layer ``layer`` on; ``space`` is the source space's name and
    ``cause`` the error underneath (also ``__cause__``): NotFound for a space that is
    gone, StaleSpaceError, a CudaError...; Go's kv.BlockError."""

    def __init__(self, space: str, layer: int, blocks: List[int], cause: BaseException):
        self.space = space
        self.layer = layer
        self.blocks = list(blocks)
        self.cause = cause
        super().__init__("kv: reading %d blocks of %s failed from layer %d: %s" % (len(self.blocks), space, layer, cause))


class MissingBlocks(KVError):
    """Keys a pool get asked for that the pool does not hold: the ``cause`` of the
    get's BlockError, whose ``blocks`` are their destination blocks; Go's
    kv.ErrMissing. In a cluster-wide pool ``unavailable`` of them are missing
    because the node owning them did not answer (``reason`` says which and why;
    ``__cause__`` is then an UnavailableError, Go's client.ErrUnavailable): a
    retry may find them."""

    def __init__(self, message: str, unavailable: int = 0, reason: str = ""):
        super().__init__(message)
        self.unavailable = unavailable
        self.reason = reason


class BlockRangeError(BlockError, IndexError):
    """A block id past the end of its space, or negative (``blocks`` lists them);
    Go's kv.ErrBlockRange inside a kv.BlockError."""
