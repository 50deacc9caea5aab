#!/usr/bin/env python3
"""CPU costs of the no-copy path's bookkeeping for many tensors, without a GPU: the
MoE (18,867 tensors) and Llama-3-8B (291) shapes of scripts/bench/weight_sync.py as
small host tensors, each figure beside its reference in the same run.

  python3 bench/nocopy_cpu.py [--model moe|dense] [--reps 5]

- first: parsing the manifest and building load_into's plan (what the first version
  costs on the CPU), with Python's collector running as usual vs paused around the
  bulk builds (cudaipc._gcpause), in a process with torch imported.
- steady: the per-version parameter check (signature + plan match), with the
  collector as usual vs paused while the signature is made.
Prints one JSON object of medians in ms and their ratios.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "bench"))

import torch  # noqa: E402

from cudaipc import _manifest, _plan, _gcpause  # noqa: E402
from cudaipc._arrays import TORCH  # noqa: E402
import weight_sync  # noqa: E402


def med(xs):
    return statistics.median(xs) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="moe", choices=["moe", "dense"])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    shapes = weight_sync.MODELS[a.model]()
    # Tensors of the model's shapes without memory (only their metadata is read here).
    params = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes}
    names = list(params)
    sig = TORCH.signature(list(params.values()))
    lay = _manifest.put_layout(names, sig[1], None)
    raw = lay.raw
    # The heap is torch's and this script's: a full collection runs once the objects
    # made since the last one outnumber a quarter of those that survived it.
    out = {"model": a.model, "tensors": len(names), "manifest_bytes": len(raw)}
    firsts = {"gc": [], "paused": []}
    for _ in range(a.reps):
        for mode in ("gc", "paused"):
            gc.collect()
            _gcpause.ENABLED = mode == "paused"
            t0 = time.perf_counter()
            layout = _manifest.Layout(bytes(raw))
            _ = layout.view_types(TORCH)
            firsts[mode].append(time.perf_counter() - t0)
    _gcpause.ENABLED = True
    out["first_parse_gc_ms"] = med(firsts["gc"])
    out["first_parse_paused_ms"] = med(firsts["paused"])
    out["first_ratio_paused_over_gc"] = out["first_parse_paused_ms"] / out["first_parse_gc_ms"]
    # Views of one small storage in the model's shapes: reading their address, shape,
    # dtype and contiguity costs what it costs for real tensors.
    one = torch.empty(1, dtype=torch.bfloat16)
    vals = [one.as_strided(s, [0] * len(s)) for _, s in shapes]
    sig = TORCH.signature(vals)
    # The per-version check, with the collector as usual vs paused while the
    # signature's objects are made, interleaved; the signatures of the last versions
    # are kept alive (as a plan and a publish keep theirs).
    steady = {"gc": [], "paused": []}
    kept = []
    for _ in range(a.reps * 4):
        for mode in ("gc", "paused"):
            _gcpause.ENABLED = mode == "paused"
            t0 = time.perf_counter()
            s2 = TORCH.signature(vals)
            ok = s2[0] == sig[0] and s2[1] == sig[1] and s2[2] == sig[2]
            steady[mode].append(time.perf_counter() - t0)
            assert ok
            kept = (kept + [s2])[-2:]
    _gcpause.ENABLED = True
    out["steady_check_gc_ms"] = med(steady["gc"])
    out["steady_check_paused_ms"] = med(steady["paused"])
    out["steady_ratio_paused_over_gc"] = out["steady_check_paused_ms"] / out["steady_check_gc_ms"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
