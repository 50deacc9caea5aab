"""Vectored block reads between KV spaces on one node (cudaipc.kv.read_blocks): the
Go package kv's read.go. A read is checked at once (plan), then runs: it leases the
source regions the layers use (so that their memory stays valid however the source
ends), checks that each carries the description the reader was given, copies layer
by layer (host memory: one memmove per coalesced run; a GPU's memory into its own:
one gather kernel launch a layer, with an event after each) and releases the leases,
which the source sees in its regions' lease counts.

A read runs on the first thread to want it: a thread of a small pool of workers
(started for it at once), or the caller's own when it waits for the read before a
worker took it up, so that a read waited for at once costs no hand-off between
threads; a host read the caller waits for layer by layer runs that far on the
caller's thread and leaves the rest to a worker."""

from __future__ import annotations

import collections
import ctypes
import logging
import operator
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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
        self._waiters = 0       # threads in a wait: a layer's completion wakes them
        self._layer_waiters = 0  # of which in wait_layer
        self._job: Optional[_Read] = None   # the read's work, until it ends
        self._running = False   # a thread runs _job
        # For a read whose answers come over a connection (across nodes): reads
        # the connection until cond() holds or timeout seconds pass (0: what is
        # there now), when no other thread reads it.
        self._drive: Optional[Callable[[Callable[[], bool], Optional[float]], None]] = None

    @property
    def layers(self) -> range:
        """The layers the read copies."""
        return range(self.first, self.first + self.count)

    def done(self) -> bool:
        """Whether the read has ended, complete or failed."""
        if not self._ended and self._drive is not None:
            self._drive(lambda: self._ended, 0)
        return self._ended

    @property
    def error(self) -> Optional[BlockError]:
        """The read's BlockError once it failed; None while it runs and on success."""
        with self._cv:
            return self._error if self._ended else None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the read to end (at most ``timeout`` seconds; None: no limit) and
        raise its BlockError if it failed. TimeoutError if it is still running then
        (the read goes on). A read no thread has taken up yet runs on the calling
        thread, which then returns once it ended: ``timeout`` bounds the wait for a
        read another thread runs."""
        if timeout is None or timeout > 0:
            self._run_here(self.count, False)
        if self._drive is not None:
            timeout = self._driven(lambda: self._ended, timeout)
        with self._cv:
            if not self._ended:
                self._waiters += 1
                try:
                    ended = self._cv.wait_for(lambda: self._ended, timeout)
                finally:
                    self._waiters -= 1
                if not ended:
                    raise TimeoutError("kv: the read of %d blocks of %s is still running after %ss"
                                       % (len(self.blocks), self.space, timeout))
            err = self._error
        if err is not None:
            raise err

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> None:
        """Wait until every requested block of ``layer`` is in the destination, and
        return; raise the read's BlockError if it failed before that layer was
        complete, TimeoutError after ``timeout`` seconds, LayoutMismatch for a layer
        the read does not copy. Layers of a host read no thread is copying yet are
        copied on the calling thread, up to ``layer``; the rest go on on a worker."""
        if not self.first <= layer < self.first + self.count:
            raise LayoutMismatch("kv: layer %d is not among the read's [%d, %d)" % (layer, self.first, self.first + self.count))
        i = layer - self.first
        if self._complete <= i and (timeout is None or timeout > 0):
            self._run_here(i + 1, False)
        if self._drive is not None:
            timeout = self._driven(lambda: self._complete > i or self._ended, timeout)
        with self._cv:
            if self._complete <= i and not self._ended:
                self._waiters += 1
                self._layer_waiters += 1
                try:
                    ok = self._cv.wait_for(lambda: self._complete > i or self._ended, timeout)
                finally:
                    self._waiters -= 1
                    self._layer_waiters -= 1
                if not ok:
                    raise TimeoutError("kv: layer %d of the read of %s is not complete after %ss" % (layer, self.space, timeout))
            if self._complete > i:
                return
            err = self._error
        if err is not None:
            raise err

    def drive_with(self, drive: Callable[[Callable[[], bool], Optional[float]], None]) -> None:
        """Have waits read the connection themselves with ``drive(cond, timeout)``
        (a read across nodes, whose answers come on the store's connection)."""
        self._drive = drive

    def _driven(self, cond: Callable[[], bool], timeout: Optional[float]) -> Optional[float]:
        """Read the connection until cond holds or timeout passes; return the time
        left (an end the connection's failure brings is on its way then)."""
        assert self._drive is not None
        if timeout is None:
            self._drive(cond, None)
            return None
        end = time.monotonic() + timeout
        self._drive(cond, timeout)
        return max(end - time.monotonic(), 0.0)

    def layer_done(self, i: int) -> None:
        """Mark layers up to first + i complete (the reading thread's call)."""
        with self._cv:
            self._complete = max(self._complete, i + 1)
            if self._waiters:
                self._cv.notify_all()

    def layer_waiters(self) -> int:
        """How many threads wait for a layer now (a hint for the thread running the
        read: while none does, a caller waiting for all of it may mark the layers
        complete in one step at the end)."""
        return self._layer_waiters

    def reached(self) -> int:
        """The first layer not complete."""
        with self._cv:
            return self.first + self._complete

    def finish(self, err: Optional[BlockError]) -> None:
        """End the read (the reading thread's call)."""
        with self._cv:
            self._error = err
            self._ended = True
            self._job = None
            if self._waiters:
                self._cv.notify_all()

    def _start(self, job: "_Read") -> None:
        """Give the read its work and a worker to run it, unless a waiter takes it
        up first."""
        self._job = job
        _workers.submit(self)

    def _take(self, upto: int) -> "Optional[_Read]":
        """The read's work if no thread runs it (now this one does), and it can
        stop after ``upto`` layers or that is all of them; else None."""
        with self._cv:
            j = self._job
            if j is None or self._running or (upto < self.count and not j.layer_wise):
                return None
            self._running = True
            return j

    def _run_here(self, upto: int, worker: bool) -> None:
        """Run the read's first ``upto`` layers on this thread (a ``worker``, or a
        caller that waits) if no thread runs it; then hand what is left back to a
        worker."""
        j = self._take(upto)
        if j is None:
            return
        try:
            j.run(self, upto, not worker)
        finally:
            with self._cv:
                self._running = False
                left = self._job is not None
            if left:
                _workers.submit(self)

    def __repr__(self) -> str:
        state = "running" if not self._ended else ("failed" if self._error is not None else "done")
        return "<kv.Transfer %d blocks of %s, layers [%d, %d), %s>" % (
            len(self.blocks), self.space, self.first, self.first + self.count, state)


class _Workers:
    """Threads that run reads no caller ran itself: as many as reads wait for one,
    up to ``limit``; an idle one waits for the next read."""

    def __init__(self, limit: int):
        self.limit = limit
        self._reset()

    def _reset(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._queue: "collections.deque[Transfer]" = collections.deque()
        self._idle = 0
        self._threads = 0

    def submit(self, t: Transfer) -> None:
        """Have a worker run t's read (unless another thread takes it up first)."""
        with self._cv:
            self._queue.append(t)
            spawn = len(self._queue) > self._idle and self._threads < self.limit
            if spawn:
                self._threads += 1
            else:
                self._cv.notify()
        if spawn:
            try:
                threading.Thread(target=self._work, name="cudaipc-kv-read", daemon=True).start()
            except BaseException:
                with self._cv:
                    self._threads -= 1
                    if self._threads == 0 and t in self._queue:   # no worker: the read goes with its caller's error
                        self._queue.remove(t)
                raise

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._idle += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._idle -= 1
                t = self._queue.popleft()
            try:
                t._run_here(t.count, True)
            except BaseException as e:  # noqa: BLE001 - the read ended with it; the worker goes on
                _log.debug("kv: a read of %s ended with %r", t.space, e)


_workers = _Workers(8)
os.register_at_fork(after_in_child=_workers._reset)   # a child has none of its parent's threads


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
        self.longest = max(r[2] for r in self.runs) if self.runs else 0   # blocks in the longest run
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
    its bound (InvalidKVRequest). What depends only on the two spaces (all but the
    ids) is checked once for a pair of spaces of the same values (_Fit)."""
    if not isinstance(src, Desc) or not isinstance(dst, Local):
        raise LayoutMismatch("kv: a read needs a source description and a destination Local")
    if notify is not None and len(notify) > MAX_NOTIFY:
        raise InvalidKVRequest("kv: a notify payload of %d bytes: at most %d" % (len(notify), MAX_NOTIFY))
    key = _fit_key(src, dst)
    fit = _fits.get(key) if key is not None else None
    if fit is None:
        fit = _Fit(src.to_bytes())   # validates
        dst.check()
    sb, db = block_ids(src_blocks, "source"), block_ids(dst_blocks, "destination")
    first, count = _check_ids(src.name, src.layout, dst.layout, sb, db, layers)
    p = Plan(src, fit.desc, dst, sb, db, first, count, None if notify is None else bytes(notify))
    got = fit.ranges.get((first, count))
    if got is None:
        _check_fit(src.layout, dst.layout, first, count)
        got = fit.ranges[(first, count)] = _regions(src, dst, first, count)
        if key is not None:
            if len(_fits) >= _MAX_FITS:
                _fits.clear()
            _fits[key] = fit
    p.regions, p.ordinal = got
    return p


class _Fit:
    """What a source description and a destination were found to be: the
    description's encoding, and per layer range (first, count) found to fit, the
    source regions it uses and the GPU ordinal of its memory (None: host)."""

    def __init__(self, desc: bytes):
        self.desc = desc
        self.ranges: Dict[Tuple[int, int], Tuple[List[int], Optional[int]]] = {}


_MAX_FITS = 64
_fits: Dict[Any, _Fit] = {}   # by _fit_key: the values of both spaces, so that a changed one is checked again
_part_values = operator.attrgetter("region", "base", "stride", "nbytes")
_memory_values = operator.attrgetter("device", "addr", "size", "ordinal", "writable")


def _fit_key(src: Desc, dst: Local) -> Any:
    """Every value plan's checks of the two spaces read (None: not kept)."""
    if type(src.id) is not bytes or type(src.name) is not str or type(src.node) is not str:
        return None
    try:
        key = (src.name, src.id, src.node, tuple([(r.device, r.size) for r in src.regions]), src.layout.blocks,
               tuple([tuple([_part_values(p) for p in layer]) for layer in src.layout.layers]),
               dst.layout.blocks, tuple([tuple([_part_values(p) for p in layer]) for layer in dst.layout.layers]),
               tuple([_memory_values(m) for m in dst.memory]))
        hash(key)
        return key
    except (AttributeError, TypeError):   # not what a space holds: the full checks say what
        return None


def _regions(src: Desc, dst: Local, first: int, count: int) -> Tuple[List[int], Optional[int]]:
    """The source regions layers [first, first + count) use and the GPU ordinal of
    the memory (None: host), checking that this version copies between it
    (KVNotSupported) into writable memory (LayoutMismatch)."""
    used = [False] * len(src.regions)
    where: Optional[str] = None
    ordinal: Optional[int] = None
    for li in range(first, first + count):
        s, d = src.layers[li], dst.layers[li]
        for i in range(len(s)):
            sdev = src.regions[s[i].region].device
            dm = dst.memory[d[i].region]
            if where is None:
                where, ordinal = dm.device, dm.ordinal
            if sdev != dm.device or dm.device != where:
                raise KVNotSupported("kv: layer %d part %d: a read from %s memory into %s memory, in a read into %s memory "
                                     "(this version reads host memory into host memory, and a GPU's memory into its own)"
                                     % (li, i, sdev, dm.device, where))
            if not dm.writable:
                raise LayoutMismatch("kv: layer %d part %d: the destination's region %d is read-only" % (li, i, d[i].region))
            used[s[i].region] = True
    return [i for i, u in enumerate(used) if u], ordinal


def check_pairs(space: str, src: Layout, dst: Layout, sb: List[int], db: List[int], layers: Any) -> Tuple[int, int]:
    """Check a read's block lists against the two layouts (as many of each, at least
    one; ids in range, else BlockRangeError naming them) and its layers (None: all; a
    range; one layer), in which the layouts must fit each other: the same parts, of
    the same block bytes (LayoutMismatch). Returns (first, count) of the layers (Go's
    checkPairs)."""
    first, count = _check_ids(space, src, dst, sb, db, layers)
    _check_fit(src, dst, first, count)
    return first, count


def _check_ids(space: str, src: Layout, dst: Layout, sb: List[int], db: List[int], layers: Any) -> Tuple[int, int]:
    """check_pairs' checks of the ids; (first, count) of the layers."""
    if len(sb) != len(db) or not sb:
        raise LayoutMismatch("kv: %d source and %d destination blocks: want as many, at least one" % (len(sb), len(db)))
    first, count = layer_range(layers, len(src.layers))
    for side, ids, blocks in (("source", sb, src.blocks), ("destination", db, dst.blocks)):
        if min(ids) < 0 or max(ids) >= blocks:
            bad = [b for b in ids if not 0 <= b < blocks]
            cause = IndexError("kv: %s block ids %s of a space of %d blocks" % (side, _short(bad), blocks))
            e = BlockRangeError(space, first, bad, cause)
            e.__cause__ = cause
            raise e
    return first, count


def _check_fit(src: Layout, dst: Layout, first: int, count: int) -> None:
    """check_pairs' checks of the layers [first, first + count) of the two layouts."""
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


Copier = Callable[[Plan, List[Any], Transfer, bool], None]


def start(store: Any, p: Plan, gpu_copy: Optional[Copier]) -> Transfer:
    """Start the read p (on a worker, or the first thread to wait for it) and
    return its Transfer."""
    t = Transfer(p.src.name, p.first, p.count, p.dst_blocks)
    t._start(_Read(store, p, gpu_copy))
    return t


class _Read:
    """The work of one read, run by one thread at a time: its leases, then its
    layers in order (a host read's can stop after any layer and go on on another
    thread: ``layer_wise``; a GPU read's run whole), then its end."""

    def __init__(self, store: Any, p: Plan, gpu_copy: Optional[Copier]):
        self.store, self.p, self.gpu_copy = store, p, gpu_copy
        self.layer_wise = p.ordinal is None
        self.leases: Optional[List[Any]] = None
        self.src: List[int] = []   # a host read's source region addresses
        self.next = 0              # layers copied

    def run(self, t: Transfer, upto: int, waiter: bool) -> None:
        """Copy layers up to ``upto`` (a GPU read: all), and end the read after its
        last; ``waiter``: on the thread of a caller waiting for it (which keeps the
        GIL over a host read's small copies). Every failure ends it, as a
        BlockError; an interrupt of the calling thread (KeyboardInterrupt) ends it
        so and is raised again."""
        p = self.p
        try:
            if self.leases is None:
                self.leases = [None] * len(p.src.regions)
                for i in p.regions:
                    self.leases[i] = lease(self.store, p.src, i, p.desc)
                self.src = [le.data_ptr if le is not None else 0 for le in self.leases]
            if p.ordinal is not None:
                if self.gpu_copy is None:
                    raise KVNotSupported("kv: GPU reads need the gather kernel (cuda-bindings)")
                self.gpu_copy(p, self.leases, t, waiter)
                self.next = p.count
            else:
                while self.next < upto:
                    _host_layer(p, self.src, p.first + self.next, waiter)
                    t.layer_done(self.next)
                    self.next += 1
            if self.next < p.count:
                return
        except BaseException as e:  # noqa: BLE001 - any failure ends the read with its blocks named
            self._end(t, p.fail(t.reached(), e))
            if not isinstance(e, Exception):
                raise
            return
        self._end(t, None)

    def _end(self, t: Transfer, err: Optional[BlockError]) -> None:
        """Release the leases, tell the source's engine if asked, end t."""
        p = self.p
        leases, self.leases = self.leases or [], []
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
            _notify(self.store, p, err)
        t.finish(err)


def _notify(store: Any, p: Plan, err: Optional[BlockError]) -> None:
    """Tell the source's engine that the read ended (err: how), before the read's
    end: a reader that exits once its read is done has sent it. The engine may be
    gone: that is logged, not the read's failure."""
    try:
        store.notify(p.src.region_name(0), bytes([1 if err is not None else 0]) + (p.notify or b""))
    except Exception as e:  # noqa: BLE001
        _log.debug("kv: the source's engine was not told that a read of %s ended: %s", p.src.name, e)


_Copy = Callable[[int, int, int], Any]
_memmove: _Copy = ctypes.memmove   # lets other threads run while it copies
# The same copy keeping the GIL (a PyDLL function), for a waiting caller's own
# read: its copies of at most _HOLD_BYTES each would otherwise let a thread that
# wants the GIL (a worker woken for the read) take it at every copy, and make the
# caller wait for it at the next; holding it that long is no longer than the
# interpreter lets any thread run before it switches.
_memmove_fn = ctypes.PyDLL(None).memmove
_memmove_fn.restype = ctypes.c_void_p
_memmove_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memmove_held: _Copy = _memmove_fn
_HOLD_BYTES = 1 << 20


def _host_layer(p: Plan, src: List[int], li: int, waiter: bool) -> None:
    """Copy layer li of a host read from the source regions at ``src``: one memmove
    per coalesced run of a part whose blocks are contiguous on both sides (stride =
    bytes), else per block; ``waiter``: on a waiting caller's thread."""
    dst = p.dst
    for sp, dp in zip(p.src.layers[li], dst.layers[li]):
        s, d = src[sp.region] + sp.base, dst.memory[dp.region].addr + dp.base
        n = sp.nbytes
        if sp.stride == n and dp.stride == n:
            mm = _memmove_held if waiter and n * p.longest <= _HOLD_BYTES else _memmove
            for rs, rd, k in p.runs:
                mm(d + rd * n, s + rs * n, k * n)
            continue
        mm = _memmove_held if waiter and n <= _HOLD_BYTES else _memmove
        ss, ds = sp.stride, dp.stride
        for rs, rd, k in p.runs:
            for j in range(k):
                mm(d + (rd + j) * ds, s + (rs + j) * ss, n)
