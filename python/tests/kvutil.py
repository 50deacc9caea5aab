"""Shared by the KV tests and their engine process (kv_engine.py): spaces of the
engines' layouts over fresh memory, filled with random bytes the test can make
again, and the check of a read's destination byte for byte.

Layout kinds (as the Go tests' testLayout): "vllm" (a [2, blocks, bytes] tensor a
layer), "vllm-blocks-first" ([blocks, 2, bytes]), "sglang" (a K and a V buffer a
layer), "offload" (one block-major [blocks, layers, 2, bytes] buffer), and
"vllm-one-buffer" (vLLM's per-layer tensors as views of one buffer: one region)."""

import ctypes
import time

import numpy as np

import cudaipc
from cudaipc import kv

KINDS = ["vllm", "vllm-blocks-first", "sglang", "offload", "vllm-one-buffer"]


def make_local(kind, layers, blocks, nbytes, alloc):
    """A kv.Local of ``kind`` over memory from ``alloc(shape)`` (a uint8 array or
    tensor of that shape, zeroed)."""
    if kind == "vllm":
        return kv.vllm_layout([alloc((2, blocks, nbytes)) for _ in range(layers)])
    if kind == "vllm-blocks-first":
        return kv.vllm_layout([alloc((blocks, 2, nbytes)) for _ in range(layers)], blocks_first=True)
    if kind == "sglang":
        return kv.sglang_layout([alloc((blocks, nbytes)) for _ in range(layers)],
                                [alloc((blocks, nbytes)) for _ in range(layers)])
    if kind == "offload":
        return kv.offload_layout(alloc((blocks, layers, 2, nbytes)))
    if kind == "vllm-one-buffer":
        buf = alloc((layers, 2, blocks, nbytes))
        return kv.vllm_layout([buf[i] for i in range(layers)])
    raise ValueError(kind)


def region_bytes(seed, i, size):
    """The random bytes an engine of ``seed`` fills its region i with."""
    return np.frombuffer(np.random.default_rng([seed, i]).bytes(size), dtype=np.uint8)


def fill(local, seed):
    """Fill every region of ``local`` (host or GPU) with region_bytes."""
    for i, m in enumerate(local.memory):
        data = region_bytes(seed, i, m.size)
        if m.is_gpu:
            from cudaipc import _cuda
            with _cuda.on(m.ordinal):
                _cuda.memcpy_htod(m.addr, data.ctypes.data, m.size)
        else:
            host_region(m)[:] = data


def host_region(m):
    """A NumPy view of a host kv.Memory; of a GPU one, a copy of its bytes."""
    if m.is_gpu:
        from cudaipc import _cuda
        out = np.empty(m.size, dtype=np.uint8)
        with _cuda.on(m.ordinal):
            _cuda.memcpy_dtoh(out.ctypes.data, m.addr, m.size)
        return out
    return np.ctypeslib.as_array((ctypes.c_uint8 * m.size).from_address(m.addr))


def expected(src_desc, seed, dst_local, src_ids, dst_ids, layers, before):
    """The destination's regions after the read: ``before`` (a list of arrays, one a
    region) with block src_ids[i] of the source copied into block dst_ids[i], for
    the layers given."""
    src = [region_bytes(seed, i, r.size) for i, r in enumerate(src_desc.regions)]
    out = [b.copy() for b in before]
    for li in layers:
        for sp, dp in zip(src_desc.layers[li], dst_local.layers[li]):
            for s, d in zip(src_ids, dst_ids):
                so, do = sp.base + s * sp.stride, dp.base + d * dp.stride
                out[dp.region][do:do + dp.nbytes] = src[sp.region][so:so + sp.nbytes]
    return out


def check_bytes(dst_local, want):
    """Every byte of the destination's regions is as ``want`` says; a failure
    names the region and the first differing byte."""
    for i, (m, w) in enumerate(zip(dst_local.memory, want)):
        got = host_region(m)
        if not np.array_equal(got, w):
            bad = int(np.nonzero(got != w)[0][0])
            raise AssertionError("destination region %d differs first at byte %d of %d" % (i, bad, m.size))


def wait_gone(store, name, timeout=20.0):
    """Return once the object name is gone from store's daemon (a killed engine's
    region, say); fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.stat(name)
        except cudaipc.NotFound:
            return
        assert time.monotonic() < deadline, "%s is still there after %ss" % (name, timeout)
        time.sleep(0.02)
