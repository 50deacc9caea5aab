#!/usr/bin/env python3
"""Where a steady no-copy version's time goes, in one process on one GPU: the
publish (put_bundle(copy=False)) of the model's unchanged tensors, then get_bundle
and load_into of it into a second set of tensors, each step timed from inside, in
three modes alternated: the per-version checks of the tensors by PyTorch's C++
loops (fast) or by reads one by one (reads), the copies by the gather kernel where
under its size limit (kernel) or all by cuMemcpyBatchAsync (batch); then the checks'
primitives alone, and a cProfile of one steady version. A fourth mode leaves
copies of 16 MiB or more to the batch (fast+kernel-under-16MiB). The shapes are scripts/bench/weight_sync.py's.

  python3 bench/nocopy_phases.py --bin path/to/cudaipc [--models moe,dense] [--versions 8]

Without --socket it starts 'cudaipc serve' on a temporary socket. Prints one JSON
object (also written to --json): per model and mode, the median over versions 2..n of
each step in ms; the primitives in ms per call over all tensors; the profile's top
lines. The reader's wake-up and the other process's scheduling are not in these
figures (the reader is the publisher's own process): weight_sync.py has them.
"""

import argparse
import cProfile
import collections
import functools
import io
import json
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "bench"))

import _bench  # noqa: E402

STEPS = collections.defaultdict(list)


# timed(owner, attr, label) wraps owner.attr so each call's duration lands in STEPS[label].
timed = functools.partial(_bench.timed, STEPS)


def per_call(f, n=7):
    """Median ms of f() over n calls (after one unmeasured)."""
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 4)


def one_version(store, name, src, dst):
    from cudaipc import bundle as B
    t0 = time.perf_counter()
    B.put_bundle(store, name, src, 0, publish=True, keep_last=1, copy=False)
    t1 = time.perf_counter()
    b = B.get_bundle(store, name, timeout=30)
    t2 = time.perf_counter()
    B.load_into(b, dst)
    t3 = time.perf_counter()
    b.release()
    store.wait_released(name, 30)
    t4 = time.perf_counter()
    return {"publish": t1 - t0, "get_bundle": t2 - t1, "load_into": t3 - t2, "release_wait": t4 - t3, "total": t3 - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="cudaipc")
    ap.add_argument("--socket")
    ap.add_argument("--models", default="moe,dense")
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    import cudaipc
    from cudaipc import _arrays, _gather, _nocopy, _plan, bundle as B
    import weight_sync
    torch.cuda.set_device(0)
    _gather.wait_ready(0)
    timed(_nocopy.Publications, "prepare", "prepare")
    timed(_nocopy.Publications, "withdraw", "withdraw")
    timed(_nocopy, "send_version", "send_version")
    timed(_nocopy.KeptSources, "lease_sources", "lease_sources")
    timed(B, "layout_of", "layout_of")
    timed(_plan, "plan_for", "plan_for")
    timed(_plan.Plan, "run", "plan_run")
    out = {"torch": torch.__version__, "fast_check_available": _arrays._torch_fast_check()[0] is not None,
           "kernel_unavailable": _gather.unavailable}
    with _bench.daemon(a.bin, a.socket) as sock:
        store = cudaipc.connect(sock)
        timed(store._conn, "call", "conn_call")
        for model in a.models.split(","):
            shapes = weight_sync.MODELS[model]()
            src = weight_sync.alloc(shapes, torch.device("cuda", 0))
            dst = weight_sync.alloc(shapes, torch.device("cuda", 0))
            name = "phases-" + model
            res = {}
            limit = _gather.MAX_BYTES
            modes = {"fast+kernel": (True, True, limit), "reads+kernel": (False, True, limit),
                     "fast+batch": (True, False, limit), "fast+kernel-under-16MiB": (True, True, 16 << 20)}
            rows: dict = {m: [] for m in modes}
            for v in range(a.versions):
                for mode, (fast, kernel, most) in modes.items():
                    _arrays.FAST_CHECKS = fast
                    _gather.ENABLED = kernel
                    _gather.MAX_BYTES = most
                    # A fresh check per mode: each mode's own kind of Check.
                    store._published.close()
                    _plan._PLANS.clear()
                    one_version(store, name, src, dst)   # builds (not measured)
                    STEPS.clear()
                    r = one_version(store, name, src, dst)
                    r.update({k: sum(x) for k, x in STEPS.items()})
                    r["n_conn_call"] = len(STEPS["conn_call"])
                    rows[mode].append(r)
            for mode, rs in rows.items():
                res[mode] = {k: round(statistics.median(r.get(k, 0.0) for r in rs) * (1 if k.startswith("n_") else 1e3), 4)
                             for k in rs[0]}
            # The checks' primitives over all the tensors.
            values = list(dst.values())
            sig = _arrays.TORCH.signature(values)
            prim = {"same_reads": per_call(lambda: _arrays.TORCH.same(values, sig)),
                    "data_ptr_map": per_call(lambda: list(map(torch.Tensor.data_ptr, values)) == sig[0]),
                    "shape_dtype_map": per_call(lambda: list(map(_arrays._shape_dtype, values)) == sig[1]),
                    "is_contiguous_map": per_call(lambda: list(map(torch.Tensor.is_contiguous, values)) == sig[2]),
                    "memory_stats": per_call(lambda: torch.cuda.memory_stats(0))}
            guards, ptrs_equal = _arrays._torch_fast_check()
            if guards is not None:
                _arrays.FAST_CHECKS = True
                chk = _arrays.TORCH.check(values, sig)
                g = guards(*values, dynamic_dims_sizes=None, dynamic_dims_strides=None)
                idx = list(range(len(values)))
                prim.update({"check_kind": type(chk).__name__,
                             "fast_quick": per_call(lambda: chk.fits(values)),
                             "guards_make": per_call(lambda: guards(*values, dynamic_dims_sizes=None,
                                                                    dynamic_dims_strides=None)),
                             "guards_check": per_call(lambda: g.check(*values)),
                             "ptrs_equal": per_call(lambda: ptrs_equal(values, sig[0], idx))})
            pub = store._published.last.get(name)
            if pub is not None:
                prim["allocations"] = len(pub.sources)
                prim["buffer_ids"] = per_call(lambda: _nocopy._still_valid(pub))
            res["primitives"] = prim
            # One steady version under cProfile (fast checks, the kernel).
            _arrays.FAST_CHECKS = True
            _gather.ENABLED = True
            _gather.MAX_BYTES = limit
            store._published.close()
            _plan._PLANS.clear()
            one_version(store, name, src, dst)
            prof = cProfile.Profile()
            prof.enable()
            one_version(store, name, src, dst)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            res["profile"] = [ln for ln in s.getvalue().splitlines() if ln.strip()][:40]
            store.wait_released(name, 30)
            store.rm(name)
            out[model] = res
            del src, dst
            torch.cuda.empty_cache()
        store.close()
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
