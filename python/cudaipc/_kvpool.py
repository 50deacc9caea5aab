"""KV block pools (cudaipc.kv.create_pool, open_pool; docs/kv.md, "Block pools"): a
cache of KV blocks in the daemon's memory by the engines' content hashes. The Go
client's kvpool.go (the wire calls, the bulk file) and the Go package kv's pool.go
(puts from a space, gets into one layer by layer).

A request carries its arrays (keys, block ids, the answer's statuses or slots)
inline when they fit one packet, else in a memfd passed with it, its bulk file
(docs/protocol.md section 6.10): the daemon reads them with pread and writes the
answer's array into the file before it answers."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import struct
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import _deps
from . import _store_pb2 as pb
from ._kvdesc import Desc, Layout
from ._kvlocal import Local
from ._kvread import Transfer, block_ids, layer_range
from ._wire import Conn, HostArena
from .errors import (BlockError, BlockRangeError, InternalError, InvalidArgument, KVNotSupported, LayoutMismatch,
                     MissingBlocks, StaleSpaceError, UnavailableError)

__all__ = ["Pool", "PoolInfo", "PutResult", "Presence", "create_pool", "open_pool", "stat_pool", "delete_pool", "list_pools",
           "block_bytes", "MIN_KEY_BYTES", "MAX_KEY_BYTES", "MAX_BLOCK_KEYS", "BLOCK_STORED", "BLOCK_EXISTED", "BLOCK_FULL",
           "BLOCK_UNAVAILABLE"]

MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 32    # protocol.MinKeyBytes, MaxKeyBytes
MAX_BLOCK_KEYS = 1 << 18                 # protocol.MaxBlockKeys
MAX_PIN_TIMEOUT = 600.0                  # seconds: protocol.MaxPinTimeoutMs
NO_SLOT = 0xFFFFFFFF                     # protocol.NoSlot
BLOCK_STORED, BLOCK_EXISTED, BLOCK_FULL = 0, 1, 2   # a put's status of one key
BLOCK_UNAVAILABLE = 3                    # not stored: its node (a cluster-wide pool's) did not answer
MAX_POOL_TIMEOUT = 600.0                 # seconds: protocol.MaxPoolTimeoutMs
_BULK_INLINE = 48 << 10                  # the most bytes of arrays a request carries inline (Go's bulkInline)
_MAX_BULK_KEPT = 4


@dataclasses.dataclass(frozen=True)
class PoolInfo:
    """A pool: its shape, its counts now and its counters since it was made (Go's
    client.PoolInfo). ``name`` is bare for this uid's pools, ``UID:NAME`` for
    another's; ``id`` is this incarnation of the name; block slot s lies at
    ``s * slot_bytes`` of its memory. ``cluster``: the pool is cluster-wide, its
    counts this node's."""
    name: str
    owner_uid: int
    shared: bool
    device: str
    id: int
    block_bytes: int
    key_bytes: int
    slot_bytes: int
    capacity_blocks: int
    memory_size: int
    blocks: int
    writing: int
    pinned: int
    hits: int
    misses: int
    stored: int
    evictions: int
    created_unix_nano: int
    cluster: bool = False

    @classmethod
    def from_pb(cls, p: Any) -> "PoolInfo":
        return cls(p.name, p.owner_uid, p.shared, p.device, p.id, p.block_bytes, p.key_bytes, p.slot_bytes,
                   p.capacity_blocks, p.memory_size, p.blocks, p.writing, p.pinned, p.hits, p.misses, p.stored,
                   p.evictions, p.created_unix_nano, p.cluster)


@dataclasses.dataclass(frozen=True)
class PutResult:
    """What a put did: ``status[i]`` is key i's (BLOCK_STORED, BLOCK_EXISTED,
    BLOCK_FULL, or in a cluster-wide pool BLOCK_UNAVAILABLE: its node did not
    answer); the counts of each (Go's client.PutResult)."""
    stored: int
    existed: int
    full: int
    status: bytes
    unavailable: int = 0


@dataclasses.dataclass(frozen=True)
class Presence:
    """A per-key lookup's answer (Go's client.Presence): ``found`` is the length of
    the present prefix (as :meth:`Pool.lookup` counts it), ``count`` the keys
    present, ``pin`` the pin holding them (0 when not pinned), and ``bits`` a bit a
    key: bit i%8 (least significant first) of byte i//8 is set when key i is
    present. ``presence[i]`` is key i's answer, ``list(presence)`` all of them."""
    found: int
    count: int
    pin: int
    bits: bytes
    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bool:
        if not -self.n <= i < self.n:
            raise IndexError("key %d of %d" % (i, self.n))
        i %= self.n
        return bool(self.bits[i >> 3] >> (i & 7) & 1)

    def __iter__(self) -> Iterator[bool]:
        bits = self.bits
        return (bool(bits[i >> 3] >> (i & 7) & 1) for i in range(self.n))


def _timeout_ms(op: str, name: str, timeout: Optional[float]) -> int:
    """A cluster-wide pool's timeout in milliseconds (None: 0, the daemon's default)."""
    if timeout is None:
        return 0
    if not 0.001 <= timeout <= MAX_POOL_TIMEOUT:
        raise InvalidArgument(op, name, "timeout %ss: want 0.001 to %s" % (timeout, MAX_POOL_TIMEOUT))
    return int(timeout * 1000)


def block_bytes(layout: Union[Layout, Desc, Local], layers: Any = None) -> int:
    """The bytes of one block of ``layers`` (None: all; a range; one layer) of
    ``layout`` (a Layout, or a Desc's or a Local's): the block size of a pool that
    holds them (Go's Layout.BlockBytes)."""
    if isinstance(layout, (Desc, Local)):
        layout = layout.layout
    first, count = layer_range(layers, len(layout.layers))
    if first < 0 or count <= 0 or first + count > len(layout.layers):
        raise LayoutMismatch("kv: layers [%d, %d) of a space of %d layers" % (first, first + count, len(layout.layers)))
    return sum(p.nbytes for parts in layout.layers[first:first + count] for p in parts)


def _pack_keys(keys: Any) -> Tuple[Any, int, int]:
    """The keys end to end (bytes, or a C-contiguous NumPy array of them), their count
    and their size: a sequence of bytes-like keys of one size, or a 2-D uint8 NumPy
    array (a key a row)."""
    if hasattr(keys, "ndim") and hasattr(keys, "tobytes"):
        if keys.ndim != 2 or keys.dtype.itemsize != 1:
            raise InvalidArgument("block", "", "keys as an array: want 2-D of bytes (a key a row), not %s of %s" % (keys.shape, keys.dtype))
        n, k = int(keys.shape[0]), int(keys.shape[1])
        raw: Any = keys if keys.flags.c_contiguous else keys.tobytes()
    else:
        ks = keys if isinstance(keys, (list, tuple)) else list(keys)
        n = len(ks)
        # Engines' hashes are bytes: joined and measured in C, ten thousand of them
        # in a tenth of a millisecond. Anything else goes key by key.
        try:
            raw = b"".join(ks)
            sizes = set(map(len, ks))
        except TypeError:
            ks = [bytes(x) for x in ks]
            raw = b"".join(ks)
            sizes = set(map(len, ks))
        k = len(raw) // n if n else 0
        if len(sizes) > 1 or n * k != len(raw):
            raise InvalidArgument("block", "", "keys of several sizes: a request's keys are all of one size")
    if not 0 < n <= MAX_BLOCK_KEYS:
        raise InvalidArgument("block", "", "%d keys: want 1 to %d" % (n, MAX_BLOCK_KEYS))
    if not MIN_KEY_BYTES <= k <= MAX_KEY_BYTES:
        raise InvalidArgument("block", "", "keys of %d bytes: want %d to %d" % (k, MIN_KEY_BYTES, MAX_KEY_BYTES))
    return raw, n, k


class _Bulk:
    """A memfd mapped read-write: a block request's bulk file."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("cudaipc-bulk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self.mem = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size

    def close(self) -> None:
        self.mem.close()
        os.close(self.fd)


class _Call:
    """One block request's arrays, inline or in a bulk file (Go's blockCall)."""

    def __init__(self, pool: "Pool", op: str, keys: Any, beside: int = 0):
        self.pool, self.op = pool, op
        raw, self.n, k = _pack_keys(keys)
        self.bulk: Optional[_Bulk] = None
        self.next = 0
        if self.n * (k + 8) + beside > _BULK_INLINE:
            self.bulk = pool._take_bulk(self.n * (k + 8) + 3 * 64)
        self.keys = self.array(raw)

    def array(self, data: Any) -> Any:
        """A request array's Blob (data: bytes or a C-contiguous NumPy array)."""
        if self.bulk is None:
            return pb.Blob(data=data if isinstance(data, bytes) else data.tobytes())
        if not isinstance(data, bytes):
            data = memoryview(data).cast("B")
        off = self.reserve(len(data))
        self.bulk.mem[off:off + len(data)] = data
        return pb.Blob(offset=off, length=len(data))

    def reserve(self, n: int) -> int:
        """The offset of n bytes of the bulk file for the answer's array (0 inline)."""
        if self.bulk is None:
            return 0
        off = self.next
        self.next = (off + n + 63) & ~63
        return off

    def call(self, req: Any) -> Any:
        """Send req with the bulk file, if any; return the response. The bulk file
        goes back for reuse once answered (not when the call failed: the daemon may
        still write into it)."""
        fds = [self.bulk.fd] if self.bulk is not None else []
        try:
            r = self.pool.conn.call(req, self.op, self.pool.name, fds=fds)
        except BaseException:
            self.done(False)
            raise
        return r.resp

    def read(self, blob: Any, n: int) -> bytes:
        """A response's array of n bytes."""
        if self.bulk is None:
            if len(blob.data) != n:
                raise InternalError(self.op, self.pool.name, "an answer of %d bytes, want %d" % (len(blob.data), n))
            return bytes(blob.data)
        if blob.length != n or blob.offset + n > self.bulk.size:
            raise InternalError(self.op, self.pool.name, "an answer of %d bytes at %d of a bulk file of %d, want %d"
                                % (blob.length, blob.offset, self.bulk.size, n))
        return bytes(self.bulk.mem[blob.offset:blob.offset + n])

    def done(self, reuse: bool = True) -> None:
        b, self.bulk = self.bulk, None
        if b is not None:
            self.pool._give_bulk(b, reuse)


class Pool:
    """A KV block pool as this process uses it (Go's kv.Pool): its name, and once a
    get needed it, a read-only mapping of its memory. Made by :func:`create_pool` or
    :func:`open_pool` (``Store.create_pool``, ``Store.open_pool``); safe to use from
    several threads. A context manager: leaving
    it unmaps the memory (the pool stays in the daemon: :func:`delete_pool`)."""

    def __init__(self, conn: Conn, name: str, info: PoolInfo):
        self.conn, self.name, self.info = conn, name, info
        self._lock = threading.Lock()
        self._bulk: List[_Bulk] = []
        self._mem: Optional[HostArena] = None
        self._mem_id = 0

    # -- bulk files
    def _take_bulk(self, n: int) -> _Bulk:
        with self._lock:
            for i, b in enumerate(self._bulk):
                if b.size >= n:
                    return self._bulk.pop(i)
        return _Bulk(max(1 << 20, (n + (1 << 20) - 1) & ~((1 << 20) - 1)))

    def _give_bulk(self, b: _Bulk, reuse: bool) -> None:
        with self._lock:
            if reuse and len(self._bulk) < _MAX_BULK_KEPT:
                self._bulk.append(b)
                return
        b.close()

    # -- calls
    def stat(self) -> PoolInfo:
        """The pool's counts, from the daemon."""
        self.info = stat_pool(self.conn, self.name)
        return self.info

    def put(self, keys: Any, src: Any, src_blocks: Any, layers: Any = None, timeout: Optional[float] = None) -> PutResult:
        """Store block ``src_blocks[i]`` of the registered space ``src`` (a Space of
        this process, or a :class:`Desc`), for ``layers`` (None: all; a range; one
        layer), under ``keys[i]``, in one round trip: the daemon copies them from the
        space's registered host memory (no copy in this process). Keys present
        already are left as they are (BLOCK_EXISTED); a key that finds every block
        pinned or being written is not stored (BLOCK_FULL). In a cluster-wide pool each
        key goes to its node, which has ``timeout`` seconds (None: 30) to store it
        (BLOCK_UNAVAILABLE otherwise). LayoutMismatch for blocks of another size than
        the pool's, BlockRangeError for ids out of the space."""
        tms = _timeout_ms("block_put", self.name, timeout)
        desc = getattr(src, "desc", src)
        if not isinstance(desc, Desc):
            raise LayoutMismatch("kv: a put's source is a registered space or its Desc")
        space = desc.to_bytes()   # validates
        first, count = layer_range(layers, len(desc.layers))
        n = block_bytes(desc.layout, range(first, first + count)) if count > 0 else 0
        if n != self.info.block_bytes:
            raise LayoutMismatch("kv: layers [%d, %d) of %s are %d bytes a block, the pool's blocks %d"
                                 % (first, first + count, desc.name, n, self.info.block_bytes))
        ids = block_ids(src_blocks, "source")
        bad = [b for b in ids if not 0 <= b < desc.blocks]
        if bad:
            cause = IndexError("kv: source block ids %s of a space of %d blocks" % (bad[:16], desc.blocks))
            e = BlockRangeError(desc.name, first, bad, cause)
            e.__cause__ = cause
            raise e
        index = {}
        s = pb.BlockSource(space=space)
        for li in range(first, first + count):
            for pt in desc.layers[li]:
                if pt.region not in index:
                    if desc.regions[pt.region].device != "host":
                        raise KVNotSupported("kv: region %d of %s is memory of %s: puts copy from host memory"
                                             % (pt.region, desc.name, desc.regions[pt.region].device))
                    index[pt.region] = len(s.regions)
                    s.regions.append(desc.region_name(pt.region))
                s.parts.add(region=index[pt.region], base=pt.base, stride=pt.stride, bytes=pt.nbytes)
        c = _Call(self, "block_put", keys, beside=s.ByteSize())
        if len(ids) != c.n:
            c.done()
            raise LayoutMismatch("kv: %d keys and %d source blocks" % (c.n, len(ids)))
        s.ids.CopyFrom(c.array(struct.pack("<%dI" % len(ids), *ids)))
        at = c.reserve(c.n)
        resp = c.call(pb.Request(block_put=pb.BlockPutRequest(pool=self.name, count=c.n, keys=c.keys, source=s, status_at=at,
                                                              timeout_ms=tms)))
        try:
            p = resp.block_put
            return PutResult(p.stored, p.existed, p.full, c.read(p.status, c.n), p.unavailable)
        finally:
            c.done()

    def lookup(self, keys: Any, pin: bool = False, pin_timeout: Optional[float] = None,
               timeout: Optional[float] = None) -> Tuple[int, int]:
        """How many of ``keys``, from the first, the pool holds (the first absent key
        ends the prefix), in one round trip, and the pin holding them: with ``pin``
        those blocks stay until a :meth:`get` takes the pin over, :meth:`unpin`,
        ``pin_timeout`` seconds (None: 30) or the end of the connection; 0 when not
        pinned or none was found. In a cluster-wide pool the nodes owning keys have
        ``timeout`` seconds (None: 1) to answer, and one that did not ends the prefix
        at its first key; with ``pin`` the prefix's blocks held elsewhere are first
        brought to this daemon (within ``timeout`` again; None: 30) and pinned here."""
        c = _Call(self, "block_lookup", keys)
        resp = c.call(self._lookup_request(c, pin, pin_timeout, 0, False, timeout))
        c.done()
        return int(resp.block_lookup.found), int(resp.block_lookup.pin)

    def present(self, keys: Any, pin: bool = False, pin_timeout: Optional[float] = None,
                timeout: Optional[float] = None) -> Presence:
        """Which of ``keys`` the pool holds, each on its own (keys that are not a
        chain: Mooncake's ``batch_is_exist``), in one round trip, as a
        :class:`Presence`. With ``pin`` every key present stays until a :meth:`get`
        takes the pin over, :meth:`unpin`, ``pin_timeout`` seconds (None: 30) or the
        end of the connection. ``timeout`` as for :meth:`lookup`: a node that did not
        answer in time holds none of its keys."""
        c = _Call(self, "block_lookup", keys)
        nbits = (c.n + 7) // 8
        resp = c.call(self._lookup_request(c, pin, pin_timeout, c.reserve(nbits), True, timeout))
        lk = resp.block_lookup
        try:
            bits = c.read(lk.present, nbits)
        except BaseException:
            if lk.pin:
                self.conn.send_detached(pb.Request(block_unpin=pb.BlockUnpinRequest(pin=lk.pin)))
            raise
        finally:
            c.done()
        return Presence(int(lk.found), int(lk.present_count), int(lk.pin), bits, c.n)

    def _lookup_request(self, c: _Call, pin: bool, pin_timeout: Optional[float], present_at: int, per_key: bool,
                        timeout: Optional[float]) -> Any:
        ms = 0
        try:
            if pin_timeout is not None:
                if not 0.001 <= pin_timeout <= MAX_PIN_TIMEOUT:
                    raise InvalidArgument("block_lookup", self.name, "pin timeout %ss: want 0.001 to %s" % (pin_timeout, MAX_PIN_TIMEOUT))
                ms = int(pin_timeout * 1000)
            tms = _timeout_ms("block_lookup", self.name, timeout)
        except BaseException:
            c.done()
            raise
        return pb.Request(block_lookup=pb.BlockLookupRequest(pool=self.name, count=c.n, keys=c.keys, pin=pin, pin_timeout_ms=ms,
                                                             per_key=per_key, present_at=present_at, timeout_ms=tms))

    def unpin(self, pin: int) -> None:
        """End a lookup's pin that no get took over."""
        self.conn.call(pb.Request(block_unpin=pb.BlockUnpinRequest(pin=pin)), "block_unpin", self.name)

    def delete(self, keys: Any) -> int:
        """Remove ``keys`` from the pool; how many it held."""
        c = _Call(self, "block_delete", keys)
        resp = c.call(pb.Request(block_delete=pb.BlockDeleteRequest(pool=self.name, count=c.n, keys=c.keys)))
        c.done()
        return int(resp.block_delete.deleted)

    def evict(self, n: int) -> int:
        """Evict up to ``n`` least recently used blocks neither pinned nor being
        written; how many went."""
        if not 0 < n < 1 << 32:
            raise InvalidArgument("block_evict", self.name, "%d blocks: want 1 to 2^32-1" % n)
        r = self.conn.call(pb.Request(block_evict=pb.BlockEvictRequest(pool=self.name, blocks=n)), "block_evict", self.name)
        return int(r.resp.block_evict.evicted)

    def get(self, keys: Any, dst: Any, dst_blocks: Any, layers: Any = None, pin: int = 0,
            timeout: Optional[float] = None) -> Transfer:
        """Find and pin the blocks of ``keys`` in one round trip, then, on a thread of
        its own, copy them out of the pool's memory into block ``dst_blocks[i]`` of
        ``dst`` (a :class:`Local` in host memory, or a Space of this process) for
        ``layers`` (None: all; a range; one layer), layer by layer, and unpin them.
        Returns the :class:`Transfer` at once (``wait_layer``, ``wait``, ``error``). A
        key the pool does not hold fails the transfer at its end with a BlockError
        naming its destination blocks (cause MissingBlocks); the others are copied.
        ``pin``, when not 0, is a lookup's pin on this connection that the get takes
        over. In a cluster-wide pool the daemon first brings the blocks held on other
        nodes, which have ``timeout`` seconds (None: 30) to send them; keys of a node
        that did not are missing, and the MissingBlocks says how many and why
        (``unavailable``, ``reason``; ``__cause__`` an UnavailableError)."""
        tms = _timeout_ms("block_get", self.name, timeout)
        if not isinstance(dst, Local):
            dst = getattr(dst, "local", dst)
        if not isinstance(dst, Local):
            raise LayoutMismatch("kv: a get's destination is a Local or a Space of this process")
        dst.check()
        db = block_ids(dst_blocks, "destination")
        first, count = layer_range(layers, len(dst.layers))
        bad = [b for b in db if not 0 <= b < dst.blocks]
        if bad:
            cause = IndexError("kv: destination block ids %s of a space of %d blocks" % (bad[:16], dst.blocks))
            e = BlockRangeError(self.name, first, bad, cause)
            e.__cause__ = cause
            raise e
        n = block_bytes(dst.layout, range(first, first + count)) if count > 0 else 0
        if n != self.info.block_bytes:
            raise LayoutMismatch("kv: layers [%d, %d) of the destination are %d bytes a block, the pool's blocks %d"
                                 % (first, first + count, n, self.info.block_bytes))
        for li in range(first, first + count):
            for j, pt in enumerate(dst.layers[li]):
                m = dst.memory[pt.region]
                if m.is_gpu:
                    raise KVNotSupported("kv: layer %d part %d is GPU memory: gets copy into host memory (the GPU tier is not built)" % (li, j))
                if not m.writable:
                    raise LayoutMismatch("kv: layer %d part %d: the destination's region %d is read-only" % (li, j, pt.region))
        c = _Call(self, "block_get", keys)
        if len(db) != c.n:
            c.done()
            raise LayoutMismatch("kv: %d keys and %d destination blocks: want as many" % (c.n, len(db)))
        at = c.reserve(4 * c.n)
        resp = c.call(pb.Request(block_get=pb.BlockGetRequest(pool=self.name, count=c.n, keys=c.keys, pin=pin, slots_at=at,
                                                              timeout_ms=tms)))
        g = resp.block_get
        try:
            slots = struct.unpack("<%dI" % c.n, c.read(g.slots, 4 * c.n))
            c.done()
            base = self._memory(g.pool_id)
        except BaseException:
            if g.pin:
                self.conn.send_detached(pb.Request(block_unpin=pb.BlockUnpinRequest(pin=g.pin)))
            raise
        t = Transfer(self.name, first, count, db)
        th = threading.Thread(target=self._copy, args=(t, base, slots, dst, db, first, count, g.pin,
                                                       int(g.unavailable), g.unavailable_reason),
                              name="cudaipc-kv-pool-get", daemon=True)
        th.start()
        return t

    def _memory(self, pool_id: int) -> HostArena:
        """The pool's memory mapped, mapped (again) when the pool's id is not the
        mapping's: the name was made again since."""
        with self._lock:
            if self._mem is not None and self._mem_id == pool_id:
                return self._mem
        r = self.conn.call(pb.Request(pool_stat=pb.PoolStatRequest(name=self.name, map=True)), "pool_stat", self.name)
        if r.fd < 0:
            raise InternalError("pool_stat", self.name, "the daemon sent no memory for the pool")
        info = PoolInfo.from_pb(r.resp.pool_stat.info)
        try:
            if os.fstat(r.fd).st_size < info.memory_size:
                raise InternalError("pool_stat", self.name, "the pool's memory is smaller than it says")
            mem = HostArena(r.fd, info.memory_size, False)   # keeps and closes the descriptor
        except BaseException:
            os.close(r.fd)
            raise
        if info.id != pool_id:
            raise StaleSpaceError("kv: pool %s was made again during the get" % self.name)
        with self._lock:
            self._mem, self._mem_id, self.info = mem, pool_id, info   # an older mapping goes with its last user
        return mem

    def _copy(self, t: Transfer, mem: HostArena, slots: Sequence[int], dst: Local, db: List[int], first: int, count: int, pin: int,
              unavailable: int = 0, reason: str = "") -> None:
        err: Optional[BlockError] = None
        missing = [db[i] for i, s in enumerate(slots) if s == NO_SLOT]
        try:
            _copy_out(t, mem, self.info.slot_bytes, slots, dst, db, first, count, not missing)
        except BaseException as e:  # noqa: BLE001 - the transfer says what failed
            err = BlockError(self.name, t.reached(), db, e)
            err.__cause__ = e
        finally:
            if pin:
                self.conn.send_detached(pb.Request(block_unpin=pb.BlockUnpinRequest(pin=pin)))
        if err is None and missing:
            msg = "kv: %d of %d keys are not in pool %s" % (len(missing), len(slots), self.name)
            if unavailable:
                msg += ": %d of them because the nodes owning them did not answer (%s)" % (unavailable, reason)
            cause = MissingBlocks(msg, unavailable, reason)
            if unavailable:
                cause.__cause__ = UnavailableError("block_get", self.name, reason)
            err = BlockError(self.name, first, missing, cause)
            err.__cause__ = cause
        t.finish(err)

    def close(self) -> None:
        """Unmap the pool's memory in this process and drop its bulk files (the pool
        stays in the daemon). Idempotent; transfers still copying keep the mapping."""
        with self._lock:
            self._mem = None
            bulk, self._bulk = self._bulk, []
        for b in bulk:
            b.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        i = self.info
        return "<kv.Pool %s: %d of %d blocks of %d bytes on %s>" % (self.name, i.blocks, i.capacity_blocks, i.block_bytes, i.device)


# A get copies on up to this many threads, one for every _COPY_WORKER_BYTES at least
# (Go's copyWorkerBytes); runs of at least _MIN_RUN consecutive slots copy with one
# NumPy scatter a part, shorter ones a memmove a piece.
_MAX_COPY_WORKERS = 8
_COPY_WORKER_BYTES = 8 << 20
_MIN_RUN = 4


def _copy_out(t: Transfer, mem: HostArena, slot_bytes: int, slots: Sequence[int], dst: Local, db: List[int],
              first: int, count: int, complete: bool) -> None:
    """Copy every found block into the destination layer by layer (marking each
    layer done when ``complete``). With NumPy, the blocks in order of their slots:
    a run of consecutive slots is one scatter a part of a layer (the pool's rows a
    plain view, so no temporary copy), the rest a memmove a piece, on several
    threads for large gets, each taking a share of every layer so that layers still
    complete in order. Without NumPy, a memmove a piece on this thread."""
    found = [i for i, s in enumerate(slots) if s != NO_SLOT]
    offs: List[List[int]] = []
    off = 0
    for li in range(first, first + count):
        row = []
        for pt in dst.layers[li]:
            row.append(off)
            off += pt.nbytes
        offs.append(row)
    if not found or not _deps.available("numpy"):
        for li in range(first, first + count):
            for j, pt in enumerate(dst.layers[li]):
                base = dst.memory[pt.region].addr + pt.base
                o = offs[li - first][j]
                for i in found:
                    ctypes.memmove(base + db[i] * pt.stride, mem.addr + slots[i] * slot_bytes + o, pt.nbytes)
            if complete:
                t.layer_done(li - first)
        return
    import numpy as np
    order = sorted(found, key=lambda i: slots[i])
    workers = max(1, min(os.cpu_count() or 1, _MAX_COPY_WORKERS, len(found) * off // _COPY_WORKER_BYTES))
    per = (len(order) + workers - 1) // workers
    shares = [_runs(order[w * per:(w + 1) * per], slots, db, np) for w in range(workers)]
    shares = [sh for sh in shares if sh[0] or sh[1]]
    nslots = max(slots[i] for i in found) + 1
    pool = np.ctypeslib.as_array((ctypes.c_uint8 * (nslots * slot_bytes)).from_address(mem.addr)).reshape(nslots, slot_bytes)
    views: Dict[Tuple[int, int, int, int], Any] = {}
    for li in range(first, first + count):
        for pt in dst.layers[li]:
            key = (pt.region, pt.base, pt.stride, pt.nbytes)
            if key not in views:
                m = dst.memory[pt.region]
                arr = np.ctypeslib.as_array((ctypes.c_uint8 * m.size).from_address(m.addr))
                views[key] = np.lib.stride_tricks.as_strided(arr[pt.base:], shape=(dst.blocks, pt.nbytes), strides=(pt.stride, 1))
    lock = threading.Lock()
    passed = [0] * count
    errors: List[BaseException] = []

    def work(share: Tuple[List[Tuple[int, Any]], List[Tuple[int, int]]]) -> None:
        runs, singles = share
        try:
            for li in range(first, first + count):
                if errors:
                    return
                for j, pt in enumerate(dst.layers[li]):
                    d = views[(pt.region, pt.base, pt.stride, pt.nbytes)]
                    o = offs[li - first][j]
                    for s0, to in runs:
                        d[to] = pool[s0:s0 + len(to), o:o + pt.nbytes]
                    if singles:
                        base = dst.memory[pt.region].addr + pt.base
                        src = mem.addr + o
                        for s, b in singles:
                            ctypes.memmove(base + b * pt.stride, src + s * slot_bytes, pt.nbytes)
                with lock:
                    passed[li - first] += 1
                    if complete and passed[li - first] == len(shares):
                        t.layer_done(li - first)
        except BaseException as e:  # noqa: BLE001 - the get's thread raises it
            errors.append(e)

    helpers = [threading.Thread(target=work, args=(sh,), name="cudaipc-kv-pool-copy", daemon=True) for sh in shares[1:]]
    for h in helpers:
        h.start()
    work(shares[0])
    for h in helpers:
        h.join()
    if errors:
        raise errors[0]


def _runs(order: List[int], slots: Sequence[int], db: List[int], np: Any) -> Tuple[List[Tuple[int, Any]], List[Tuple[int, int]]]:
    """Keys (indices in order of their slots) as runs of consecutive slots, each its
    first slot and its destination blocks (an index array), and the (slot, block)
    pairs of runs shorter than _MIN_RUN."""
    runs: List[Tuple[int, Any]] = []
    singles: List[Tuple[int, int]] = []
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and slots[order[j]] == slots[order[j - 1]] + 1:
            j += 1
        if j - i >= _MIN_RUN:
            runs.append((slots[order[i]], np.array([db[k] for k in order[i:j]], dtype=np.intp)))
        else:
            singles.extend((slots[k], db[k]) for k in order[i:j])
        i = j
    return runs, singles


def _pool_create_args(block_bytes_: int, capacity: int, key_bytes: int) -> None:
    for what, v in (("block_bytes", block_bytes_), ("capacity", capacity), ("key_bytes", key_bytes)):
        if not isinstance(v, int) or v <= 0:
            raise InvalidArgument("pool_create", "", "%s %r: want a positive int" % (what, v))


def create_pool(conn: Conn, name: str, block_bytes: int, capacity: int, *, key_bytes: int = 32,
                shared: bool = False, device: Optional[str] = None, cluster: bool = False) -> Pool:
    """Make the pool ``name``: ``capacity`` bytes of the daemon's host memory (taken
    at once, charged to this uid's quota) cut into blocks of ``block_bytes`` (see
    :func:`block_bytes`) under keys of ``key_bytes`` (16 to 32), and return it.
    ``shared`` lets every uid the daemon admits look blocks up and get them (only
    this uid and root put, delete and evict). ``cluster`` makes it cluster-wide (a
    daemon of a cluster only): its keys are placed on the cluster's live nodes, a
    pool of this name on each (docs/kv.md, "Across the cluster"); a node that has
    it already, of the same shape, answers as though it made it. Exists, StoreFull,
    LimitReached, InvalidArgument."""
    _pool_create_args(block_bytes, capacity, key_bytes)
    r = conn.call(pb.Request(pool_create=pb.PoolCreateRequest(
        name=name, block_bytes=block_bytes, key_bytes=key_bytes, capacity=capacity, device=device or "", shared=shared,
        cluster=cluster)),
        "pool_create", name)
    return Pool(conn, name, PoolInfo.from_pb(r.resp.pool_create.info))


def stat_pool(conn: Conn, name: str) -> PoolInfo:
    """Describe the pool ``name``; NotFound if there is none this uid may read."""
    r = conn.call(pb.Request(pool_stat=pb.PoolStatRequest(name=name)), "pool_stat", name)
    return PoolInfo.from_pb(r.resp.pool_stat.info)


def open_pool(conn: Conn, name: str) -> Pool:
    """The existing pool ``name`` (another uid's shared one by ``UID:NAME``)."""
    return Pool(conn, name, stat_pool(conn, name))


def delete_pool(conn: Conn, name: str) -> None:
    """Remove the pool ``name`` (its owner's uid or root); readers that mapped it
    keep their mappings."""
    conn.call(pb.Request(pool_delete=pb.PoolDeleteRequest(name=name)), "pool_delete", name)


def list_pools(conn: Conn) -> List[PoolInfo]:
    """The pools this uid may read, by qualified name."""
    out: List[PoolInfo] = []
    after = ""
    while True:
        r = conn.call(pb.Request(pool_list=pb.PoolListRequest(start_after=after)), "pool_list")
        page = r.resp.pool_list
        out.extend(PoolInfo.from_pb(p) for p in page.pools)
        if not page.more or not page.pools:
            return out
        after = out[-1].name
