"""The GPU half of a KV block read (cudaipc.kv, the Go kv package's gather): a GPU's
memory into its own, one gather kernel launch a layer (cudaipc._gather, the kernel
the Go client shares), on a stream of the read's own with an event after each layer,
so that the reading thread marks each layer complete as its event is reached.

The copies of every layer are cut into one chunk table (NumPy over all layers at
once: no Python loop a layer or a copy), uploaded once into a device
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

__all__ = ["copy", "copies", "table"]

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


def table(p: Plan, leases: List[Any]) -> Tuple[Any, List[int]]:
    """The gather kernel's chunk table of the whole read and each layer's rows in
    it: the rows of ``_gather.chunk_table`` of each layer's :func:`copies`, layer
    after layer, computed for every layer at once where every part of the read is
    of one kind (contiguous on both sides, or not), else layer by layer."""
    import numpy as np
    u64 = np.uint64
    src = [part for layer in p.src.layers[p.first:p.first + p.count] for part in layer]
    dst = [part for layer in p.dst.layers[p.first:p.first + p.count] for part in layer]
    whole = [sp.stride == sp.nbytes and dp.stride == dp.nbytes for sp, dp in zip(src, dst)]
    if not (all(whole) or not any(whole)):
        tabs = [_gather.chunk_table(d, s, n) for d, s, n in copies(p, leases)]
        return np.concatenate(tabs), [len(tb) for tb in tabs]
    n = np.array([sp.nbytes for sp in src], dtype=u64)[:, None]
    sbase = np.array([leases[sp.region].data_ptr + sp.base for sp in src], dtype=u64)[:, None]
    dbase = np.array([p.dst.memory[dp.region].addr + dp.base for dp in dst], dtype=u64)[:, None]
    if whole[0]:   # a copy a coalesced run: (dst + rd * n, src + rs * n, k * n)
        runs = np.array(p.runs, dtype=u64).reshape(-1, 3)
        si, di, k = runs[:, 0][None, :], runs[:, 1][None, :], runs[:, 2][None, :]
        sstride = dstride = n
    else:          # a copy a block: (dst + db * dst stride, src + sb * src stride, n)
        si = np.array(p.src_blocks, dtype=u64)[None, :]
        di = np.array(p.dst_blocks, dtype=u64)[None, :]
        k = np.ones_like(si)
        sstride = np.array([sp.stride for sp in src], dtype=u64)[:, None]
        dstride = np.array([dp.stride for dp in dst], dtype=u64)[:, None]
    # The copies as table rows, part after part (so layer after layer), written in place.
    tab = np.empty((len(src), si.shape[1], 3), dtype=u64)
    np.multiply(di, dstride, out=tab[:, :, 0])
    tab[:, :, 0] += dbase
    np.multiply(si, sstride, out=tab[:, :, 1])
    tab[:, :, 1] += sbase
    np.multiply(k, n, out=tab[:, :, 2])
    tab = tab.reshape(-1, 3)
    sizes = tab[:, 2]
    if sizes.max() <= _gather.CHUNK:   # a row a copy (sizes are at least one byte)
        return tab, [len(tab) // p.count] * p.count
    chunks = (sizes + u64(_gather.CHUNK - 1)) // u64(_gather.CHUNK)
    rows = chunks.reshape(p.count, -1).sum(axis=1, dtype=u64)
    return _gather.chunk_table(tab[:, 0], tab[:, 1], sizes), [int(r) for r in rows]


def copy(p: Plan, leases: List[Any], t: Transfer, waiter: bool = False) -> None:
    """Copy the read's layers on its GPU, marking each complete in ``t`` as it is;
    ``waiter``: on the thread of a caller waiting for the whole read, which, while
    no other thread waits for a layer, waits for the last layer's event only."""
    ordinal = p.ordinal
    assert ordinal is not None
    fn = _gather.wait_ready(ordinal)
    if fn is not None:
        tab, rows = table(p, leases)
        groups: List[Tuple[Any, Any, Any]] = []
    else:
        groups = copies(p, leases)
    cu = _cuda.driver()
    with _cuda.on(ordinal):
        s = _take(ordinal)
        dev_tab = 0
        queued = False
        try:
            s.grow(p.count)
            if fn is not None:
                dev_tab = s.table_of(max(tab.nbytes, 1))
                _gather.write_table(dev_tab, tab, int(s.stream))
                queued = True
            row = 0
            for i in range(p.count):
                queued = True
                if fn is not None:
                    _gather.launch_rows(fn, dev_tab, row, rows[i], int(s.stream))
                    row += rows[i]
                else:
                    d, src, n = groups[i]
                    for dd, ss, nn in zip(d.tolist(), src.tolist(), n.tolist()):
                        _cuda.check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(dd, ss, nn, s.stream))
                _cuda.check("cuEventRecord", cu.cuEventRecord(s.events[i], s.stream))
            i, last = 0, p.count - 1
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
