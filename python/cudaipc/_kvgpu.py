"""The GPU half of a KV block read (cudaipc.kv, the Go kv package's gather): a GPU's
memory into its own, one gather kernel launch a layer (cudaipc._gather, the kernel
the Go client shares), on a stream of the read's own with an event after each layer,
so that the reading thread marks each layer complete as its event is reached.

The copies of every layer are cut into one chunk table, uploaded once into a device
buffer the stream keeps (no allocation, nor a free that would wait for the whole
GPU, a read), each layer's launch covering its rows. Where the kernel is off or
failed on the GPU (``_gather.unavailable`` says why) the copies go one
cuMemcpyAsync each. Layers are marked complete as their events are reached; a read
run by a caller waiting for all of it waits for its last event only (one blocking
wait, not one a layer) while no other thread waits for a layer.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Tuple

from . import _cuda
from . import _gather
from ._kvread import Plan, Transfer

__all__ = ["copy", "copies"]

_STREAM_NON_BLOCKING = 1   # CU_STREAM_NON_BLOCKING: no wait for the legacy stream
_EVENT_FLAGS = 1 | 2       # CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING: waiting blocks the thread


class _Scratch:
    """A stream, events and a chunk table buffer of one GPU, used by one read at a
    time (whose work has ended before the next takes it)."""

    def __init__(self, ordinal: int):
        cu = _cuda.driver()
        self.ordinal = ordinal
        self.stream = _cuda.check("cuStreamCreate", cu.cuStreamCreate(_STREAM_NON_BLOCKING))
        self.events: List[Any] = []
        self.table = 0         # device buffer of table_bytes bytes
        self.table_bytes = 0

    def grow(self, n: int) -> None:
        cu = _cuda.driver()
        while len(self.events) < n:
            self.events.append(_cuda.check("cuEventCreate", cu.cuEventCreate(_EVENT_FLAGS)))

    def table_of(self, nbytes: int) -> int:
        """The table buffer, of at least nbytes (grown to the next power of two)."""
        if nbytes > self.table_bytes:
            cu = _cuda.driver()
            if self.table:
                cu.cuMemFree(self.table)
                self.table, self.table_bytes = 0, 0
            size = max(1 << (nbytes - 1).bit_length(), 64 << 10)
            self.table = int(_cuda.check("cuMemAlloc", cu.cuMemAlloc(size)))
            self.table_bytes = size
        return self.table


_lock = threading.Lock()
_free: Dict[int, List[_Scratch]] = {}


def _take(ordinal: int) -> _Scratch:
    with _lock:
        pool = _free.setdefault(ordinal, [])
        if pool:
            return pool.pop()
    return _Scratch(ordinal)


def _give(s: _Scratch) -> None:
    with _lock:
        _free.setdefault(s.ordinal, []).append(s)


def copies(p: Plan, leases: List[Any]) -> List[Tuple[Any, Any, Any]]:
    """Per layer of the read, its copies as uint64 arrays (destinations, sources,
    sizes): a coalesced run a copy where a part is contiguous on both sides
    (stride = bytes), else a block a copy, as Go's readPlan.gather."""
    import numpy as np
    u64 = np.uint64
    rs = np.array([r[0] for r in p.runs], dtype=u64)
    rd = np.array([r[1] for r in p.runs], dtype=u64)
    rk = np.array([r[2] for r in p.runs], dtype=u64)
    sb = np.array(p.src_blocks, dtype=u64)
    db = np.array(p.dst_blocks, dtype=u64)
    out = []
    for li in range(p.first, p.first + p.count):
        ds, ss, ns = [], [], []
        for sp, dp in zip(p.src.layers[li], p.dst.layers[li]):
            s = u64(leases[sp.region].data_ptr + sp.base)
            d = u64(p.dst.memory[dp.region].addr + dp.base)
            n = sp.nbytes
            if sp.stride == n and dp.stride == n:
                ds.append(d + rd * u64(n))
                ss.append(s + rs * u64(n))
                ns.append(rk * u64(n))
            else:
                ds.append(d + db * u64(dp.stride))
                ss.append(s + sb * u64(sp.stride))
                ns.append(np.full(len(sb), n, dtype=u64))
        out.append((np.concatenate(ds), np.concatenate(ss), np.concatenate(ns)))
    return out


def copy(p: Plan, leases: List[Any], t: Transfer, waiter: bool = False) -> None:
    """Copy the read's layers on its GPU, marking each complete in ``t`` as it is;
    ``waiter``: on the thread of a caller waiting for the whole read, which, while
    no other thread waits for a layer, waits for the last layer's event only."""
    import numpy as np
    ordinal = p.ordinal
    assert ordinal is not None
    groups = copies(p, leases)
    fn = _gather.wait_ready(ordinal)
    cu = _cuda.driver()
    with _cuda.on(ordinal):
        s = _take(ordinal)
        dev_tab = 0
        queued = False
        try:
            s.grow(len(groups))
            if fn is not None:
                tables = [_gather.chunk_table(d, src, n) for d, src, n in groups]
                tab = np.concatenate(tables) if tables else np.empty((0, 3), np.uint64)
                dev_tab = s.table_of(max(tab.nbytes, 1))
                _gather.write_table(dev_tab, tab, int(s.stream))
                queued = True
            row = 0
            for i, (d, src, n) in enumerate(groups):
                queued = True
                if fn is not None:
                    rows = len(tables[i])
                    _gather.launch_rows(fn, dev_tab, row, rows, int(s.stream))
                    row += rows
                else:
                    for dd, ss, nn in zip(d.tolist(), src.tolist(), n.tolist()):
                        _cuda.check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(dd, ss, nn, s.stream))
                _cuda.check("cuEventRecord", cu.cuEventRecord(s.events[i], s.stream))
            i, last = 0, len(groups) - 1
            while i <= last:
                # The next layer, or for a caller waiting for the whole read the last
                # (a thread that waits for a layer meanwhile waits that long).
                j = last if waiter and not t.layer_waiters() else i
                _cuda.check("cuEventSynchronize", cu.cuEventSynchronize(s.events[j]))
                t.layer_done(j)
                i = j + 1
            queued = False
        finally:
            if queued:
                # Whatever was queued ends before the table and the stream are reused.
                cu.cuStreamSynchronize(s.stream)
            _give(s)
