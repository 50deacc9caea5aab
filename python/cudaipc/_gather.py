"""Many small device-to-device copies as one kernel launch (load_into, put_bundle).

cuMemcpyBatchAsync runs its copies one after another, each with a start and a
drain of its own: about 4 µs a copy on the H200, so that 2,000 copies of 200 KB
(the MoE shapes' experts) take 10 ms where their 3.8 GB need 2. A kernel that
copies every range at once has no such cost per copy. The kernel is PTX text
(below), compiled by the driver's JIT when first used on a GPU, so the package
stays pure Python; its launch goes through ctypes (the cuLaunchKernel entry point).

The copies are cut into chunks of at most CHUNK bytes, one thread block each,
listed in a table of (destination, source, bytes) in device memory, made once per
set of copies and kept (a cached plan gives the same arrays every version). Each
block copies 16 bytes a thread at a time where both addresses are 16-byte
aligned, and its tail (or a misaligned chunk) a byte at a time.

The kernel is loaded in the background on a GPU's first copies (the batch copies
until it is there) and proves itself before it is used: a copy of random bytes
over aligned, misaligned, one-byte and several-chunk ranges, compared with what a
copy must give. Where it fails, or the driver refuses the PTX, the batch does the
copies and ``unavailable`` says why.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from ._cuda import check, driver, err_name, on, proc
from .errors import CudaError

__all__ = ["CHUNK", "MAX_BYTES", "ARENA_MAX_BYTES", "ENABLED", "unavailable", "launch", "ready", "wait_ready",
           "chunk_table", "upload_table", "write_table", "launch_rows"]

CHUNK = 128 << 10
"""Bytes one thread block copies at most."""


def _env_bytes(name: str, default: int) -> int:
    """An environment variable's byte count (a non-negative integer), or default."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError("%s=%r: want a byte count (e.g. 16777216), or leave it unset" % (name, text))
    return value


_MAX_ENV = _env_bytes("CUDAIPC_GATHER_MAX_BYTES", -1)

MAX_BYTES = _MAX_ENV if _MAX_ENV >= 0 else 1 << 62
"""Copies between parameters and a no-copy bundle's memory (the publisher's own
allocations) of at least this many bytes are left to the driver's batch; by default
none: on the H200 the kernel copied the 8B shapes' 16 GB (219 copies) in 8.13 ms where
the batch took 8.35 (python/bench/nocopy_phases.py), and the MoE shapes' 2,064 copies in
2.3 ms where the batch took 11.7. ``CUDAIPC_GATHER_MAX_BYTES`` sets it (and
ARENA_MAX_BYTES) for a process."""

ARENA_MAX_BYTES = _MAX_ENV if _MAX_ENV >= 0 else 16 << 20
"""The same for copies to and from a bundle in the daemon's arena (``put_bundle``, and
``load_into`` of such a bundle): 16 MiB by default. On the H200 the in-place 8B weight
sync (a put and a load of 16 GB a version, both through the arena) took 1.47-1.54x its
floor with the kernel copying every size, 1.19x with copies from 16 MiB on left to the
batch and 1.17x with the kernel off; its load alone took 14.7 ms of copies through the
kernel where a no-copy bundle's load of the same shapes took 8.4 (scripts/gpu-verify.sh,
2026-12-01; the cause, e.g. the tensors' alignment in the arena, is not established)."""

ENABLED = os.environ.get("CUDAIPC_GATHER", "1").strip() != "0"
"""Whether copy_batch uses the kernel (benchmarks turn it off to compare;
``CUDAIPC_GATHER=0`` turns it off for a process)."""

unavailable: Dict[int, str] = {}
"""Per GPU ordinal, why the kernel is not used there (absent: not tried yet, or used)."""

_NAME = b"cudaipc_gather"
_THREADS = 256
_PTX = r"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry cudaipc_gather(
	.param .u64 tab,
	.param .u64 nchunks
)
{
	.reg .pred %p<4>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<24>;

	ld.param.u64 %rd1, [tab];
	ld.param.u64 %rd2, [nchunks];
	mov.u32 %r1, %ctaid.x;
	cvt.u64.u32 %rd3, %r1;
	setp.ge.u64 %p1, %rd3, %rd2;
	@%p1 bra DONE;
	mul.lo.u64 %rd4, %rd3, 24;
	add.u64 %rd5, %rd1, %rd4;
	cvta.to.global.u64 %rd5, %rd5;
	ld.global.u64 %rd6, [%rd5];
	ld.global.u64 %rd7, [%rd5+8];
	ld.global.u64 %rd8, [%rd5+16];
	cvta.to.global.u64 %rd6, %rd6;
	cvta.to.global.u64 %rd7, %rd7;
	mov.u32 %r2, %tid.x;
	cvt.u64.u32 %rd9, %r2;
	mov.u32 %r3, %ntid.x;
	cvt.u64.u32 %rd10, %r3;
	or.b64 %rd11, %rd6, %rd7;
	and.b64 %rd11, %rd11, 15;
	setp.ne.u64 %p2, %rd11, 0;
	mov.u64 %rd12, 0;
	@%p2 bra TAIL;
	and.b64 %rd12, %rd8, -16;
	shl.b64 %rd13, %rd9, 4;
	shl.b64 %rd14, %rd10, 4;
VEC:
	setp.ge.u64 %p3, %rd13, %rd12;
	@%p3 bra TAIL;
	add.u64 %rd15, %rd7, %rd13;
	add.u64 %rd16, %rd6, %rd13;
	ld.global.v4.u32 {%r4, %r5, %r6, %r7}, [%rd15];
	st.global.v4.u32 [%rd16], {%r4, %r5, %r6, %r7};
	add.u64 %rd13, %rd13, %rd14;
	bra VEC;
TAIL:
	add.u64 %rd17, %rd12, %rd9;
BYTE:
	setp.ge.u64 %p3, %rd17, %rd8;
	@%p3 bra DONE;
	add.u64 %rd18, %rd7, %rd17;
	add.u64 %rd19, %rd6, %rd17;
	ld.global.u8 %r4, [%rd18];
	st.global.u8 [%rd19], %r4;
	add.u64 %rd17, %rd17, %rd10;
	bra BYTE;
DONE:
	ret;
}
"""

_LAUNCH_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p)
_HTOD_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)
_HTOD_ASYNC_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_DTOH_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t)

_lock = threading.Lock()
_loads: Dict[int, threading.Event] = {}                       # ordinal -> set once its load ended
_funcs: Dict[int, int] = {}                                   # ordinal -> CUfunction
_modules: Dict[int, Any] = {}                                 # ordinal -> CUmodule (kept loaded)
_tables: Dict[int, "OrderedDict[bytes, Tuple[int, int]]"] = {}  # ordinal -> key -> (device table, chunks)
_tables_lock = threading.Lock()
_MAX_TABLES = 8


def chunk_table(dsts: Any, srcs: Any, sizes: Any, chunk: int = CHUNK) -> Any:
    """The (destination, source, bytes) rows the kernel copies, as a (chunks, 3)
    uint64 array: each copy cut into pieces of at most ``chunk`` bytes, in order."""
    import numpy as np
    sizes = np.asarray(sizes, dtype=np.uint64)
    if len(sizes) and sizes.min() >= 1 and sizes.max() <= chunk:   # a row a copy
        tab = np.empty((len(sizes), 3), dtype=np.uint64)
        tab[:, 0], tab[:, 1], tab[:, 2] = dsts, srcs, sizes
        return tab
    counts = (sizes + np.uint64(chunk - 1)) // np.uint64(chunk)
    total = int(counts.sum())
    idx = np.repeat(np.arange(len(sizes)), counts.astype(np.int64))
    first = np.cumsum(counts) - counts
    off = (np.arange(total, dtype=np.uint64) - np.repeat(first, counts.astype(np.int64))) * np.uint64(chunk)
    tab = np.empty((total, 3), dtype=np.uint64)
    tab[:, 0] = np.asarray(dsts, dtype=np.uint64)[idx] + off
    tab[:, 1] = np.asarray(srcs, dtype=np.uint64)[idx] + off
    tab[:, 2] = np.minimum(sizes[idx] - off, np.uint64(chunk))
    return tab


def _upload(tab: Any) -> int:
    """A device copy of the table (cuMemAlloc; the caller frees it)."""
    cu = driver()
    n = max(tab.nbytes, 1)
    dev = int(check("cuMemAlloc", cu.cuMemAlloc(n)))
    htod = proc("cuMemcpyHtoD", 3020, _HTOD_PROTO)
    err = htod(dev, tab.ctypes.data, tab.nbytes) if htod is not None else -1
    if err != 0:
        cu.cuMemFree(dev)
        raise CudaError("cuMemcpyHtoD", err_name(err) if err > 0 else "not in this driver", "the copy table")
    return dev


def _run(ordinal: int, fn: int, dev_tab: int, chunks: int, stream: int) -> None:
    launch_fn = proc("cuLaunchKernel", 4000, _LAUNCH_PROTO)
    if launch_fn is None:
        raise CudaError("cuGetProcAddress", "cuLaunchKernel not found")
    a, b = ctypes.c_uint64(dev_tab), ctypes.c_uint64(chunks)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
    done = 0
    while done < chunks:   # (a grid's x dimension stops at 2^31 - 1 blocks)
        n = min(chunks - done, (1 << 31) - 1)
        a.value = dev_tab + 24 * done
        b.value = n
        err = launch_fn(fn, n, 1, 1, _THREADS, 1, 1, 0, stream, ctypes.addressof(params), None)
        if err != 0:
            raise CudaError("cuLaunchKernel", err_name(err), "%d copy chunks" % n)
        done += n


def upload_table(tab: Any) -> int:
    """A device copy (cuMemAlloc: the caller frees it with cuMemFree, once no launch
    reading it can still run) of a chunk table (chunk_table's rows), for callers that
    launch parts of one table themselves (cudaipc.kv: a launch a layer)."""
    return _upload(tab)


def write_table(dev: int, tab: Any, stream: int) -> None:
    """Queue on ``stream`` a copy of a chunk table into device memory at ``dev`` (at
    least ``tab.nbytes`` bytes that no launch still reads), for callers that keep one
    table buffer for many sets of copies (cudaipc.kv: a buffer a stream). From
    pageable memory it returns once the driver staged the bytes (``tab`` may go),
    and, unlike cuMemcpyHtoD, waits for no work of other streams."""
    htod = proc("cuMemcpyHtoDAsync", 3020, _HTOD_ASYNC_PROTO)
    err = htod(dev, tab.ctypes.data, tab.nbytes, stream) if htod is not None else -1
    if err != 0:
        raise CudaError("cuMemcpyHtoDAsync", err_name(err) if err > 0 else "not in this driver", "the copy table")


def launch_rows(fn: int, dev_tab: int, first: int, rows: int, stream: int) -> None:
    """Queue on ``stream`` one launch of kernel ``fn`` over rows [first, first + rows)
    of the device table ``dev_tab`` (the caller holds the GPU's context)."""
    if rows > 0:
        _run(0, fn, dev_tab + 24 * first, rows, stream)


def _self_test(ordinal: int, fn: int) -> Optional[str]:
    """Copy random bytes over ranges of every kind the kernel meets and compare with
    what a copy gives; the reason it failed, or None."""
    import numpy as np
    cu = driver()
    size = 3 * CHUNK + 4096
    data = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
    src = int(check("cuMemAlloc", cu.cuMemAlloc(size)))
    dst = int(check("cuMemAlloc", cu.cuMemAlloc(size)))
    dev_tab = 0
    try:
        htod = proc("cuMemcpyHtoD", 3020, _HTOD_PROTO)
        dtoh = proc("cuMemcpyDtoH", 3020, _DTOH_PROTO)
        if htod is None or dtoh is None:
            return "cuMemcpyHtoD/DtoH not in this driver"
        zero = np.zeros(size, dtype=np.uint8)
        for d, h in ((src, data), (dst, zero)):
            err = htod(d, h.ctypes.data, size)
            if err != 0:
                return "cuMemcpyHtoD: %s" % err_name(err)
        # (dst offset, src offset, bytes): aligned over several chunks, misaligned on
        # either side, a lone byte, a tail of 15, a 16-byte multiple.
        ranges = [(0, 0, 2 * CHUNK + 4007), (2 * CHUNK + 4096, 7, 1000), (2 * CHUNK + 5125, 4096, 999),
                  (2 * CHUNK + 6200, 11, 1), (2 * CHUNK + 6400, 64, 15), (2 * CHUNK + 6656, 4160, 4096),
                  (2 * CHUNK + 12288, 3 * CHUNK, 4096)]
        tab = chunk_table([dst + d for d, _, _ in ranges], [src + s for _, s, _ in ranges], [n for _, _, n in ranges])
        dev_tab = _upload(tab)
        _run(ordinal, fn, dev_tab, len(tab), 0)
        got = np.empty(size, dtype=np.uint8)
        err = dtoh(got.ctypes.data, dst, size)   # (synchronous: after the kernel on the legacy stream)
        if err != 0:
            return "the kernel's test copy: %s" % err_name(err)
        want = zero.copy()
        for d, s, n in ranges:
            want[d:d + n] = data[s:s + n]
        if not np.array_equal(got, want):
            bad = int(np.nonzero(got != want)[0][0])
            return "the kernel's test copy differs at byte %d" % bad
        return None
    finally:
        if dev_tab:
            cu.cuMemFree(dev_tab)
        cu.cuMemFree(src)
        cu.cuMemFree(dst)


def ready(ordinal: int) -> Optional[int]:
    """The kernel of GPU ``ordinal`` (a CUfunction) once it is loaded and passed its
    test there; until then None, and its load starts in the background (once per
    GPU): no copy waits for the driver's JIT compilation (tens of milliseconds, most
    of it loading the compiler), the batch copies meanwhile. None for good where it
    is off or failed (``unavailable`` says why)."""
    if not ENABLED or ordinal in unavailable:
        return None
    fn = _funcs.get(ordinal)
    if fn is None:
        _start(ordinal)
    return fn


def wait_ready(ordinal: int, timeout: float = 60.0) -> Optional[int]:
    """ready(ordinal) after waiting up to ``timeout`` seconds for the load to end
    (tests and benchmarks that want the kernel from the first copy)."""
    if not ENABLED:
        return None
    _start(ordinal).wait(timeout)
    return _funcs.get(ordinal)


def _start(ordinal: int) -> threading.Event:
    """The event set when GPU ``ordinal``'s load ends, either way; the load starts
    on the first call."""
    with _lock:
        ev = _loads.get(ordinal)
        if ev is None:
            ev = _loads[ordinal] = threading.Event()
            threading.Thread(target=_load, args=(ordinal, ev), name="cudaipc-gather-load", daemon=True).start()
    return ev


def _drain(timeout: float = 10.0) -> None:
    """Wait (up to ``timeout`` seconds each) for loads under way: run at exit, so
    that no load is still inside the driver while the process tears it down."""
    for ev in list(_loads.values()):
        ev.wait(timeout)


def _forget_in_child() -> None:
    """A forked child has none of its parent's CUDA state, nor its load threads."""
    _loads.clear()
    _funcs.clear()
    _modules.clear()
    _tables.clear()


atexit.register(_drain)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _compile(ordinal: int) -> Tuple[Any, int]:
    """Load the PTX on GPU ``ordinal`` (the caller holds its context): the module and
    the kernel."""
    cu = driver()
    image = ctypes.create_string_buffer(_PTX.encode())   # (NUL-terminated)
    mod = check("cuModuleLoadData", cu.cuModuleLoadData(ctypes.addressof(image)))
    return mod, int(check("cuModuleGetFunction", cu.cuModuleGetFunction(mod, _NAME)))


def _load(ordinal: int, done: threading.Event) -> None:
    try:
        try:
            with on(ordinal):
                mod, f = _compile(ordinal)
                why = _self_test(ordinal, f)
        except Exception as e:  # noqa: BLE001 - any failure: the batch copies instead
            why = "%s: %s" % (type(e).__name__, e)
        if why is None:
            _modules[ordinal] = mod
            _funcs[ordinal] = f
        else:
            unavailable[ordinal] = why
    finally:
        done.set()


def launch(ordinal: int, fn: int, dsts: Any, srcs: Any, sizes: Any, stream: int) -> None:
    """Queue the copies (uint64 arrays, none overlapping another's destination) on
    ``stream`` as one kernel launch (a few where the chunks exceed one grid). The
    caller holds GPU ``ordinal``'s context. The table of a set of copies is made on
    its first launch and kept."""
    key = dsts.tobytes() + srcs.tobytes() + sizes.tobytes()
    # One lock over the lookup and the launch: a table is freed (after the
    # context's work is done) only once no launch can still be about to use it.
    with _tables_lock:
        tables = _tables.setdefault(ordinal, OrderedDict())
        hit = tables.get(key)
        if hit is None:
            tab = chunk_table(dsts, srcs, sizes)
            hit = tables[key] = (_upload(tab), len(tab))
            old: List[int] = []
            while len(tables) > _MAX_TABLES:
                old.append(tables.popitem(last=False)[1][0])
            if old:
                cu = driver()
                cu.cuCtxSynchronize()   # (no launch may still read a table freed here)
                for d in old:
                    cu.cuMemFree(d)
        else:
            tables.move_to_end(key)
        _run(ordinal, fn, hit[0], hit[1], stream)
