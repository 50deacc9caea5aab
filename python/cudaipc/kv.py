"""KV spaces and vectored block reads between engines on one node (docs/kv.md): the
Python twin of the Go package ``kv``.

An engine registers its paged KV memory once as a *space* and hands readers the
space's description (a small blob, base64 in ``desc.to_text()``) in its own
metadata; a reader copies any set of blocks, of any range of layers, into its own
space with one :func:`read_blocks`, completing layer by layer::

    from cudaipc import kv
    # Engine (prefill): its KV memory, registered once.
    local = kv.vllm_layout(kv_caches)              # per-layer [2, num_blocks, block_size, heads, dim]
    space = kv.register(store, "ns/engine-7/kv", local)
    meta = space.desc.to_text()                    # into the request's metadata

    # Reader (decode): one read for the request's blocks.
    t = kv.read_blocks(store, src=kv.Desc.from_text(meta), src_blocks=prefill_ids,
                       dst=my_local, dst_blocks=my_ids)
    for l in range(num_layers):
        t.wait_layer(l)                            # BlockError names the blocks on failure
        ...                                        # run layer l

A block *pool* is a cache of KV blocks in the daemon by the engines' content hashes
(docs/kv.md, "Block pools"): :func:`create_pool`, then ``pool.put`` from a registered
space, ``pool.lookup`` of a key chain (the present prefix) or ``pool.present`` of
keys one by one, ``pool.get`` into a local space layer by layer::

    pool = kv.create_pool(store, "llama3-8b/prefix", kv.block_bytes(space.desc), 64 << 30)
    pool.put(hashes, space, block_ids)             # after a prefill
    n, pin = pool.lookup(hashes, pin=True)         # before one: the cached prefix
    t = pool.get(hashes[:n], my_local, my_ids[:n], pin=pin)

Lifetimes are registered memory's: a space's regions go when its engine's
connection ends or it closes the space, but a reader mid-read holds leases of them,
so it never reads freed memory; a later read fails with a BlockError whose cause is
NotFound. Reads go host -> host (memfd memory: :func:`alloc_host`) or GPU -> the
same GPU (one gather kernel launch a layer); anything else is KVNotSupported.

A space registered with another daemon of a cluster (its description names that
node) is read the same way, into a space the reader registered with its own daemon,
which moves the bytes between the nodes (docs/kv.md, "Across nodes").
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

from . import _kvgpu, _kvread, _kvremote
from ._kvdesc import (MAX_BLOCKS, MAX_LAYERS, MAX_PARTS, MAX_REGIONS, Desc, Layout, Part, Region, new_id)
from ._kvlocal import Local, Memory, alloc_host, offload_layout, sglang_layout, vllm_layout
from ._kvpool import (BLOCK_EXISTED, BLOCK_FULL, BLOCK_STORED, BLOCK_UNAVAILABLE, MAX_BLOCK_KEYS, MAX_KEY_BYTES, MIN_KEY_BYTES,
                      Pool, PoolInfo, Presence, PutResult, block_bytes)
from ._kvread import Transfer
from .errors import (BlockError, BlockRangeError, InvalidDescError, InvalidKVRequest, KVError, KVNotSupported,
                     LayoutMismatch, MissingBlocks, NotFound, StaleSpaceError)

__all__ = ["Desc", "Layout", "Part", "Region", "Local", "Memory", "Space", "Transfer", "Notice", "alloc_host",
           "vllm_layout", "sglang_layout", "offload_layout", "register", "read_blocks", "new_id",
           "KVError", "InvalidDescError", "LayoutMismatch", "StaleSpaceError", "KVNotSupported", "InvalidKVRequest", "BlockError",
           "BlockRangeError", "MAX_LAYERS", "MAX_PARTS", "MAX_REGIONS", "MAX_BLOCKS",
           "Pool", "PoolInfo", "PutResult", "Presence", "MissingBlocks", "create_pool", "open_pool", "stat_pool", "delete_pool",
           "list_pools", "block_bytes", "MIN_KEY_BYTES", "MAX_KEY_BYTES", "MAX_BLOCK_KEYS", "BLOCK_STORED",
           "BLOCK_EXISTED", "BLOCK_FULL", "BLOCK_UNAVAILABLE"]


@dataclasses.dataclass(frozen=True)
class Notice:
    """A reader's word that its read of this space ended (``read_blocks(...,
    notify=payload)``; vLLM's get_finished): ``payload`` is the reader's (a request
    id, say), ``failed`` set when the read did not complete (its blocks are not all
    at the reader: it may read them again), ``uid`` and ``pid`` the reader's as the
    daemon saw them (Go's kv.Notice)."""
    payload: bytes
    failed: bool
    uid: int
    pid: int


def _notices(raw: List[Any]) -> List[Notice]:
    """The notices of the kv form (a status byte, then the payload); others (any
    reader may notify) are dropped."""
    return [Notice(n.payload[1:], n.payload[0] == 1, n.uid, n.pid) for n in raw if n.payload and n.payload[0] <= 1]


class Space:
    """A registered KV space: its regions are registered memory of the connection
    that registered it (``store``), ``desc`` describes it to readers. Its regions stay
    readable until :meth:`close` or the connection's end (then, for host and VMM
    memory, while a reader holds a lease of them). A context manager: leaving it
    closes the space."""

    def __init__(self, store: Any, desc: Desc, local: Local):
        self.store = store
        self.desc = desc
        self.local = local
        self.names: List[str] = []   # the regions' registered names, region i first
        self._encoded: Optional[Tuple[Desc, bytes]] = None

    def desc_bytes(self) -> bytes:
        """The binary encoding of the space's description, as registered (made once)."""
        e = self._encoded
        if e is None or e[0] is not self.desc:
            e = self._encoded = (self.desc, self.desc.to_bytes())
        return e[1]

    @property
    def name(self) -> str:
        """The space's qualified name (``UID:NAME``)."""
        return self.desc.name

    def take_notices(self) -> List[Notice]:
        """Remove and return the notices readers sent this space, oldest first,
        without waiting (Go's Space.TakeNotices). They reach this process through its
        connection: they are read when this (or another call on ``store``) reads it."""
        return _notices(self.store.take_notices(self.desc.region_name(0)))

    def wait_notices(self, timeout: Optional[float] = None) -> List[Notice]:
        """:meth:`take_notices` that waits until there is at least one, at most
        ``timeout`` seconds (None: no limit); [] when the timeout passes first."""
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            out = _notices(self.store.wait_notices(self.desc.region_name(0), timeout=left))
            if out or (deadline is not None and time.monotonic() >= deadline):
                return out

    def close(self) -> None:
        """Remove the space's regions from the daemon (readers holding leases keep
        what they mapped until they release). Idempotent."""
        names, self.names = self.names, []
        if self.local.space is self:
            self.local.space = None
        first: Optional[BaseException] = None
        for n in names:
            try:
                self.store.delete(n)
            except NotFound:
                pass
            except Exception as e:  # noqa: BLE001 - remove the rest, then raise the first
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "Space":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<kv.Space %s: %d regions%s>" % (self.desc.name, len(self.desc.regions), "" if self.names else ", closed")


def register(store: Any, name: str, local: Any, *, shared: bool = False) -> Space:
    """Register ``local``'s memory as the space ``name`` through ``store`` (region i
    as the registered object ``name/i``, each carrying the space's description, as
    Go's kv.Register) and return the Space. ``local`` is a :class:`Local` (from
    :func:`vllm_layout`, :func:`sglang_layout`, :func:`offload_layout` or your own
    layout), or a list of vLLM per-layer tensors (``vllm_layout(local)``). Host
    regions must be memory from :func:`alloc_host`; GPU regions go through the
    registered-memory path (``Store.register``: VMM memory by descriptor, cudaMalloc
    memory by legacy IPC, which readers may use only while this process lives).
    ``shared`` makes the regions readable by every uid the daemon admits."""
    if not isinstance(local, Local):
        local = vllm_layout(local)
    local.check()
    for i, m in enumerate(local.memory):
        if not m.is_gpu and m.fd < 0:
            raise InvalidDescError("memory", "region %d is host memory outside alloc_host: registered host memory "
                                             "is a memfd readers can map (allocate it with kv.alloc_host)" % i)
    uid = store.server.peer_uid
    desc = Desc("%d:%s" % (uid, name), new_id(), [Region(m.device, m.size) for m in local.memory], local.layout,
                node=store.server.node)
    space_bytes = desc.to_bytes()
    sp = Space(store, desc, local)
    try:
        for i, m in enumerate(local.memory):
            rname = "%s/%d" % (name, i)
            if m.is_gpu:
                store.register(rname, m.addr, m.size, shared=shared, space=space_bytes)
            else:
                store.register_host(rname, m.fd, m.size, shared=shared, space=space_bytes)
            sp.names.append(rname)
        local.space = sp
    except BaseException:
        try:
            sp.close()
        except Exception:  # noqa: BLE001 - the registration's error is the one to raise
            pass
        raise
    return sp


def read_blocks(store: Any, src: Union[Desc, str, bytes], src_blocks: Any, dst: Union[Local, Space],
                dst_blocks: Any, layers: Any = None, notify: Optional[bytes] = None) -> Transfer:
    """Start copying block ``src_blocks[i]`` of the registered space ``src`` (its
    :class:`Desc`, or the text or bytes of one) into block ``dst_blocks[i]`` of
    ``dst`` (a :class:`Local`, or a Space of this process), for ``layers`` (None: all;
    a ``range``; or one layer number), and return its :class:`Transfer` at once.

    The request is checked first: ids in range (else BlockRangeError naming them),
    the two layouts fitting (same layers, parts and block bytes: else LayoutMismatch),
    a valid description (InvalidDescError), memory this version can copy between
    (KVNotSupported). The copy starts at once on a worker thread, or runs on the
    caller's when it waits before a worker took it up (``Transfer.wait``): it
    leases the source regions the layers use, checks each carries this description
    (StaleSpaceError if the space was registered again), copies layer by layer
    (adjacent blocks coalesced; host memory by memmove, a GPU's memory into its own
    with one gather kernel launch a layer) and releases the leases. Its failures
    come as a BlockError from the Transfer (``wait``, ``wait_layer``, ``error``).

    On a GPU the copies run on a stream of the read's own that waits for no other:
    the source's bytes must be written (its engine synchronized) before it handed
    out the blocks, and the destination must have no GPU work pending on it
    (synchronize PyTorch's stream first), as for Go's ReadBlocks.

    ``notify`` (at most 4,095 bytes, e.g. the request's id), when not None, is sent
    to the source's engine as the read ends, completed or failed, before the
    Transfer is done (its :meth:`Space.take_notices`).

    A source whose description names a node other than ``store``'s daemon's
    (``store.server.node``) is read across nodes (docs/kv.md, "Across nodes"):
    ``store``'s daemon reads the blocks from the source's node and writes them into
    ``dst``, which must therefore be a Space registered through ``store`` (or its
    Local, which :func:`register` binds to it), and ``notify`` goes through both
    daemons. No thread is started there: the requests go from the caller's thread,
    and their answers are read by whichever thread waits on a Transfer of ``store``
    (or calls it; ``Transfer.done`` reads what has come). Each side may be host memory or one GPU's, GPU to
    host and host to GPU included (the daemons stage GPU memory through pinned host
    memory). The Transfer is the same: its layers complete as the daemon reports
    them, and a failure is a BlockError whose cause is the daemon's error (NotFound
    for a space gone, registered again, not readable by this uid or of a node no
    longer in the cluster; UnavailableError for a source node that cannot be reached
    or dies mid-read; InvalidArgument for a request the daemon refuses, e.g. a side
    over host and GPU memory). Bytes the daemon wrote into GPU memory are there for
    any stream once a layer's wait returns."""
    src_bytes: Optional[bytes] = None
    if isinstance(src, (str, bytes, bytearray, memoryview)):
        src, src_bytes = _parsed(src)
    if isinstance(src, Desc) and _kvremote.remote(store, src):
        space = dst if isinstance(dst, Space) else dst.space if isinstance(dst, Local) else None
        local = dst.local if isinstance(dst, Space) else dst
        return _kvremote.start(store, src, src_blocks, local, space, dst_blocks, layers, notify, src_bytes)
    if isinstance(dst, Space):
        dst = dst.local
    p = _kvread.plan(src, src_blocks, dst, dst_blocks, layers, notify)
    return _kvread.start(store, p, _kvgpu.copy if p.ordinal is not None else None)



_MAX_PARSED = 256
_parsed_descs: Dict[Union[str, bytes], Tuple[Desc, bytes]] = {}
_parsed_lock = threading.Lock()


def _parsed(v: Union[str, bytes, bytearray, memoryview]) -> Tuple[Desc, bytes]:
    """The description whose text or bytes v is, and its bytes, decoded once for the
    last few hundred seen (an engine reads the same spaces again and again; the
    decoded Desc is used read-only)."""
    key: Union[str, bytes] = v if isinstance(v, str) else bytes(v)
    with _parsed_lock:
        got = _parsed_descs.get(key)
    if got is not None:
        return got
    d = Desc.from_text(key) if isinstance(key, str) else Desc.from_bytes(key)
    got = (d, key if isinstance(key, bytes) else d.to_bytes())
    with _parsed_lock:
        if len(_parsed_descs) >= _MAX_PARSED:
            _parsed_descs.clear()
        _parsed_descs[key] = got
    return got


def create_pool(store: Any, name: str, block_bytes: int, capacity: int, *, key_bytes: int = 32,
                shared: bool = False, device: Optional[str] = None, cluster: bool = False) -> Pool:
    """Make the block pool ``name`` through ``store`` and return it (Go's
    kv.CreatePool): ``capacity`` bytes of the daemon's host memory, taken at once and
    charged to this uid's quota, cut into blocks of ``block_bytes`` (a space's:
    :func:`block_bytes`) under keys of ``key_bytes`` (16 to 32: the engine's content
    hashes). ``shared`` lets every uid the daemon admits look blocks up and get them
    (only this uid and root put, delete and evict). ``cluster`` makes it cluster-wide
    (a daemon of a cluster only): its keys are placed on the cluster's live nodes, a
    pool of this name on each, and the same calls through any node's daemon reach
    them (docs/kv.md, "Across the cluster"); each node's engine makes it, and a node
    that has it already answers as though it made it."""
    pool: Pool = store.create_pool(name, block_bytes, capacity, key_bytes=key_bytes, shared=shared, device=device,
                                   cluster=cluster)
    return pool


def open_pool(store: Any, name: str) -> Pool:
    """The existing block pool ``name`` (another uid's shared one by ``UID:NAME``;
    Go's kv.OpenPool)."""
    pool: Pool = store.open_pool(name)
    return pool


def stat_pool(store: Any, name: str) -> PoolInfo:
    """Describe the block pool ``name``."""
    info: PoolInfo = store.stat_pool(name)
    return info


def delete_pool(store: Any, name: str) -> None:
    """Remove the block pool ``name`` (its owner's uid or root)."""
    store.delete_pool(name)


def list_pools(store: Any) -> List[PoolInfo]:
    """The block pools this uid may read, by qualified name."""
    pools: List[PoolInfo] = store.list_pools()
    return pools
