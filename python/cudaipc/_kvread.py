"""Vectored block reads between KV spaces on one node (cudaipc.kv.read_blocks): the
Go package kv's read.go. A read is checked at once (plan), then runs on a thread of
its own: it leases the source regions the layers use (so that their memory stays
valid however the source ends), checks that each carries the description the reader
was given, copies layer by layer (host memory: one memmove per coalesced run; a GPU's
memory into its own: one gather kernel launch a layer, with an event after each) and
releases the leases, which the source sees in its regions' lease counts."""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ._kvdesc import Desc, Layout
from ._kvlocal import Local
from .errors import (BlockError, BlockRangeError, InvalidKVRequest, KVNotSupported, LayoutMismatch, NotFound,
                     StaleSpaceError)

__all__ = ["Transfer", "Plan", "plan", "check_pairs", "runs", "start", "block_ids", "layer_range", "MAX_NOTIFY"]

_log = logging.getLogger("cudaipc")


def runs(src: Sequence[int], dst: Sequence[int]) -> List[Tuple[int, int, int]]:
    """The pairs (src[i], dst[i]) coalesced into (src, dst, n) runs whose ids both
    ascend by one, in order (as Go's runs)."""
    out: List[List[int]] = []
    for s, d in zip(src, dst):
        if out:
            r = out[-1]
            if r[0] + r[2] == s and r[1] + r[2] == d:
                r[2] += 1
                continue
        out.append([s, d, 1])
    return [(s, d, n) for s, d, n in out]


class Transfer:
    """A read in flight (from :func:`cudaipc.kv.read_blocks`); its methods are safe
    to call from any thread. Layers complete in order; ``wait_layer(l)`` returns once
    layer l's blocks are all in the destination (the engine may run that layer's
    attention)."""

    def __init__(self, space: str, first: int, count: int, blocks: List[int]):
        self.space = space
        self.first, self.count = first, count
        self.blocks = blocks
        self._cv = threading.Condition(threading.Lock())
        self._complete = 0      # layers [first, first + _complete) are in place
        self._ended = False
        self._error: Optional[BlockError] = None

    @property
    def layers(self) -> range:
        """The layers the read copies."""
        return range(self.first, self.first + self.count)

    def done(self) -> bool:
        """Whether the read has ended, complete or failed."""
        return self._ended

    @property
    def error(self) -> Optional[BlockError]:
        """The read's BlockError once it failed; None while it runs and on success."""
        with self._cv:
            return self._error if self._ended else None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the read to end (at most ``timeout`` seconds; None: no limit) and
        raise its BlockError if it failed. TimeoutError if it is still running then
        (the read goes on)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._ended, timeout):
                raise TimeoutError("kv: the read of %d blocks of %s is still running after %ss"
                                   % (len(self.blocks), self.space, timeout))
            err = self._error
        if err is not None:
            raise err

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> None:
        """Wait until every requested block of ``layer`` is in the destination, and
        return; raise the read's BlockError if it failed before that layer was
        complete, TimeoutError after ``timeout`` seconds, LayoutMismatch for a layer
        the read does not copy."""
        if not self.first <= layer < self.first + self.count:
            raise LayoutMismatch("kv: layer %d is not among the read's [%d, %d)" % (layer, self.first, self.first + self.count))
        i = layer - self.first
        with self._cv:
            if not self._cv.wait_for(lambda: self._complete > i or self._ended, timeout):
                raise TimeoutError("kv: layer %d of the read of %s is not complete after %ss" % (layer, self.space, timeout))
            if self._complete > i:
                return
            err = self._error
        if err is not None:
            raise err

    def layer_done(self, i: int) -> None:
        """Mark layers up to first + i complete (the reading thread's call)."""
        with self._cv:
            self._complete = max(self._complete, i + 1)
            self._cv.notify_all()

    def reached(self) -> int:
        """The first layer not complete."""
        with self._cv:
            return self.first + self._complete

    def finish(self, err: Optional[BlockError]) -> None:
        """End the read (the reading thread's call)."""
        with self._cv:
            self._error = err
            self._ended = True
            self._cv.notify_all()

    def __repr__(self) -> str:
        state = "running" if not self._ended else ("failed" if self._error is not None else "done")
        return "<kv.Transfer %d blocks of %s, layers [%d, %d), %s>" % (
            len(self.blocks), self.space, self.first, self.first + self.count, state)


class Plan:
    """A checked read: the source description (and its encoding, as its regions
    must carry it), the destination, the ids, the layers and the source regions they
    use; ``ordinal`` is the GPU of every region the read touches (None: host)."""

    def __init__(self, src: Desc, desc: bytes, dst: Local, src_blocks: List[int], dst_blocks: List[int],
                 first: int, count: int, notify: Optional[bytes] = None):
        self.src, self.desc, self.dst = src, desc, dst
        self.notify = notify
        self.src_blocks, self.dst_blocks = src_blocks, dst_blocks
        self.first, self.count = first, count
        self.runs = runs(src_blocks, dst_blocks)
        self.regions: List[int] = []
        self.ordinal: Optional[int] = None

    def fail(self, layer: int, cause: BaseException) -> BlockError:
        e = BlockError(self.src.name, layer, self.dst_blocks, cause)
        e.__cause__ = cause
        return e


def block_ids(v: Any, what: str) -> List[int]:
    """A read's block ids as a list of ints (from any sequence, or an array's tolist)."""
    try:
        if hasattr(v, "tolist"):
            v = v.tolist()
        return [int(x) for x in v]
    except (TypeError, ValueError):
        raise TypeError("kv: %s block ids: want a sequence of ints, got %s" % (what, type(v).__name__)) from None


def layer_range(layers: Any, total: int) -> Tuple[int, int]:
    """(first, count) of None (all), a range of step 1, or one layer."""
    if layers is None:
        return 0, total
    if isinstance(layers, int):
        return layers, 1
    if isinstance(layers, range):
        if layers.step != 1:
            raise LayoutMismatch("kv: layers %r: want a range of step 1" % (layers,))
        return layers.start, len(layers)
    raise TypeError("kv: layers %r: want None (all), a range or a layer number" % (layers,))


MAX_NOTIFY = 4095   # protocol.MaxNoticePayload less the status byte


def plan(src: Desc, src_blocks: Any, dst: Local, dst_blocks: Any, layers: Any, notify: Optional[bytes] = None) -> Plan:
    """Check a read as Go's plan does: the description valid, the ids in range
    (BlockRangeError naming them), the two layouts fitting each other (LayoutMismatch),
    memory this version can copy between (KVNotSupported), a notify payload within
    its bound (InvalidKVRequest)."""
    if not isinstance(src, Desc) or not isinstance(dst, Local):
        raise LayoutMismatch("kv: a read needs a source description and a destination Local")
    if notify is not None and len(notify) > MAX_NOTIFY:
        raise InvalidKVRequest("kv: a notify payload of %d bytes: at most %d" % (len(notify), MAX_NOTIFY))
    desc = src.to_bytes()   # validates
    dst.check()
    sb, db = block_ids(src_blocks, "source"), block_ids(dst_blocks, "destination")
    first, count = check_pairs(src.name, src.layout, dst.layout, sb, db, layers)
    p = Plan(src, desc, dst, sb, db, first, count, None if notify is None else bytes(notify))
    used = [False] * len(src.regions)
    where: Optional[str] = None
    for li in range(first, first + count):
        s, d = src.layers[li], dst.layers[li]
        for i in range(len(s)):
            sdev = src.regions[s[i].region].device
            dm = dst.memory[d[i].region]
            if where is None:
                where, p.ordinal = dm.device, dm.ordinal
            if sdev != dm.device or dm.device != where:
                raise KVNotSupported("kv: layer %d part %d: a read from %s memory into %s memory, in a read into %s memory "
                                     "(this version reads host memory into host memory, and a GPU's memory into its own)"
                                     % (li, i, sdev, dm.device, where))
            if not dm.writable:
                raise LayoutMismatch("kv: layer %d part %d: the destination's region %d is read-only" % (li, i, d[i].region))
            used[s[i].region] = True
    p.regions = [i for i, u in enumerate(used) if u]
    return p


def check_pairs(space: str, src: Layout, dst: Layout, sb: List[int], db: List[int], layers: Any) -> Tuple[int, int]:
    """Check a read's block lists against the two layouts (as many of each, at least
    one; ids in range, else BlockRangeError naming them) and its layers (None: all; a
    range; one layer), in which the layouts must fit each other: the same parts, of
    the same block bytes (LayoutMismatch). Returns (first, count) of the layers (Go's
    checkPairs)."""
    if len(sb) != len(db) or not sb:
        raise LayoutMismatch("kv: %d source and %d destination blocks: want as many, at least one" % (len(sb), len(db)))
    first, count = layer_range(layers, len(src.layers))
    for side, ids, blocks in (("source", sb, src.blocks), ("destination", db, dst.blocks)):
        bad = [b for b in ids if not 0 <= b < blocks]
        if bad:
            cause = IndexError("kv: %s block ids %s of a space of %d blocks" % (side, _short(bad), blocks))
            e = BlockRangeError(space, first, bad, cause)
            e.__cause__ = cause
            raise e
    if first < 0 or count <= 0 or first + count > len(src.layers) or len(src.layers) != len(dst.layers):
        raise LayoutMismatch("kv: layers [%d, %d) of spaces of %d (source) and %d (destination) layers"
                             % (first, first + count, len(src.layers), len(dst.layers)))
    for li in range(first, first + count):
        s, d = src.layers[li], dst.layers[li]
        if len(s) != len(d):
            raise LayoutMismatch("kv: layer %d has %d parts in the source, %d in the destination" % (li, len(s), len(d)))
        for i in range(len(s)):
            if s[i].nbytes != d[i].nbytes:
                raise LayoutMismatch("kv: layer %d part %d: blocks of %d bytes in the source, %d in the destination"
                                     % (li, i, s[i].nbytes, d[i].nbytes))
    return first, count


def _short(ids: List[int]) -> str:
    return str(ids) if len(ids) <= 16 else "%s ... (%d ids)" % (str(ids[:16])[:-1], len(ids))


def lease(store: Any, d: Desc, i: int, desc: bytes) -> Any:
    """Lease region i of the space d, whose encoding is desc, and check that it is
    of that registration."""
    name = d.region_name(i)
    try:
        lease = store.get(name)
    except NotFound as e:
        raise NotFound("get", name, "region %d of the space: %s (the space's engine ended or closed it, "
                       "or it was never registered)" % (i, e.message or "not found"), code=e.code) from None
    info = lease.info
    if info.space != desc or lease.size != d.regions[i].size or lease.device != d.regions[i].device:
        lease.release()
        raise StaleSpaceError("kv: region %d (%s) is not of the registration the description names "
                              "(the space was registered again since)" % (i, name))
    return lease


Copier = Callable[[Plan, List[Any], Transfer], None]


def start(store: Any, p: Plan, gpu_copy: Optional[Copier]) -> Transfer:
    """Run the read p on a thread of its own and return its Transfer."""
    t = Transfer(p.src.name, p.first, p.count, p.dst_blocks)
    th = threading.Thread(target=_run, args=(store, p, t, gpu_copy), name="cudaipc-kv-read", daemon=True)
    th.start()
    return t


def _run(store: Any, p: Plan, t: Transfer, gpu_copy: Optional[Copier]) -> None:
    err: Optional[BlockError] = None
    leases: List[Any] = [None] * len(p.src.regions)
    try:
        for i in p.regions:
            leases[i] = lease(store, p.src, i, p.desc)
        if p.ordinal is not None:
            if gpu_copy is None:
                raise KVNotSupported("kv: GPU reads need the gather kernel (cuda-bindings)")
            gpu_copy(p, leases, t)
        else:
            _host_copy(p, leases, t)
    except BaseException as e:  # noqa: BLE001 - any failure ends the read with its blocks named
        err = p.fail(t.reached(), e)
    finally:
        rel: Optional[BaseException] = None
        for le in leases:
            if le is not None:
                try:
                    le.release()
                except BaseException as e:  # noqa: BLE001
                    rel = rel or e
        if err is None and rel is not None:
            err = p.fail(p.first + p.count, rel)
        if p.notify is not None:
            _notify(store, p, err)
        t.finish(err)


def _notify(store: Any, p: Plan, err: Optional[BlockError]) -> None:
    """Tell the source's engine that the read ended (err: how), before the read's
    end: a reader that exits once its read is done has sent it. The engine may be
    gone: that is logged, not the read's failure."""
    try:
        store.notify(p.src.region_name(0), bytes([1 if err is not None else 0]) + (p.notify or b""))
    except Exception as e:  # noqa: BLE001
        _log.debug("kv: the source's engine was not told that a read of %s ended: %s", p.src.name, e)


_memmove = ctypes.memmove


def _host_copy(p: Plan, leases: List[Any], t: Transfer) -> None:
    """Copy host memory layer by layer: one memmove per coalesced run of a part
    whose blocks are contiguous on both sides (stride = bytes), else per block."""
    src = [le.data_ptr if le is not None else 0 for le in leases]
    dst = p.dst
    for li in range(p.first, p.first + p.count):
        for sp, dp in zip(p.src.layers[li], dst.layers[li]):
            s, d = src[sp.region] + sp.base, dst.memory[dp.region].addr + dp.base
            n = sp.nbytes
            if sp.stride == n and dp.stride == n:
                for rs, rd, k in p.runs:
                    _memmove(d + rd * n, s + rs * n, k * n)
                continue
            ss, ds = sp.stride, dp.stride
            for rs, rd, k in p.runs:
                for j in range(k):
                    _memmove(d + (rd + j) * ds, s + (rs + j) * ss, n)
        t.layer_done(li - p.first)
