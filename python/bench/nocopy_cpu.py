#!/usr/bin/env python3
"""CPU costs of a bundle reader's bookkeeping for many tensors, without a GPU, as it
was ("before": the collector running through the bulk builds, a signature made and
compared every version) and as it is ("after": the collector paused around the
bulk builds by cudaipc._gcpause, each later version checked by TORCH.same without
making a signature): the MoE (18,867 tensors) or Llama-3-8B (291) shapes of
scripts/bench/weight_sync.py.

  python3 bench/nocopy_cpu.py [--model moe|dense] [--versions 20] [--runs 3]

Each mode runs in fresh processes (torch imported, so the heap is an engine's):
the first version is the manifest parse, its view types and the parameters'
signature; every later version is the per-version parameter check followed
by a fixed burst of allocations standing for the rest of the program, so that a
collection the pause only deferred is paid inside the figures, not outside them.
gc.callbacks sums the collections' time. Prints one JSON object: per mode, the
median over runs of the first version, of the mean later version and of the time
in collections, and the ratios after / before.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(model: str, versions: int, after: bool) -> dict:
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "bench"))
    import torch
    from cudaipc import _gcpause, _manifest
    from cudaipc._arrays import TORCH
    import weight_sync
    _gcpause.ENABLED = after
    shapes = weight_sync.MODELS[model]()
    # Views of one small storage in the model's shapes: reading their address, shape,
    # dtype and contiguity costs what it costs for real tensors.
    one = torch.empty(1, dtype=torch.bfloat16)
    vals = [one.as_strided(s, [0] * len(s)) for _, s in shapes]
    names = [n for n, _ in shapes]
    raw = _manifest.encode_manifest(_manifest.layout([(n, "BF16", s) for n, s in shapes])[0])
    del shapes
    gc_time = [0.0]
    started = [0.0]

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - started[0]
    gc.collect()
    gc.callbacks.append(cb)
    burst = []

    def rest_of_program() -> None:
        # What a trainer or engine allocates between versions (a few thousand
        # tracked objects, most short-lived).
        keep = [(i, [i]) for i in range(5000)]
        burst[:] = keep[::10]

    t0 = time.perf_counter()
    lay = _manifest.Layout(bytes(raw))
    lay.view_types(TORCH)
    kept = TORCH.signature(vals)
    rest_of_program()
    first = time.perf_counter() - t0
    first_gc = gc_time[0]
    gc_time[0] = 0.0
    t0 = time.perf_counter()
    for _ in range(versions):
        if after:
            assert TORCH.same(vals, kept) and lay.names == names
        else:
            sig = TORCH.signature(vals)
            assert sig[0] == kept[0] and sig[1] == kept[1] and sig[2] == kept[2] and lay.names == names
            del sig
        rest_of_program()
    later = (time.perf_counter() - t0) / versions
    gc.callbacks.remove(cb)
    return {"first": first * 1e3, "first_gc": first_gc * 1e3, "later": later * 1e3,
            "later_gc": gc_time[0] / versions * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="moe", choices=["moe", "dense"])
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", choices=["before", "after"])
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.versions, a.child == "after")))
        return
    got = {"before": [], "after": []}
    for _ in range(a.runs):
        for mode in ("before", "after"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", a.model, "--versions",
                                  str(a.versions), "--child", mode], check=True, capture_output=True, text=True)
            got[mode].append(json.loads(out.stdout))
    res = {"model": a.model, "versions": a.versions, "runs": a.runs}
    for mode, rs in got.items():
        for k in rs[0]:
            res["%s_%s_ms" % (mode, k)] = round(statistics.median(r[k] for r in rs), 3)
    for k in ("first", "later"):
        res["ratio_%s_after_over_before" % k] = round(res["after_%s_ms" % k] / res["before_%s_ms" % k], 3)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
