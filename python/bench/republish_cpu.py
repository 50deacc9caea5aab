#!/usr/bin/env python3
"""A no-copy version published afresh against a republish (docs/protocol.md 6.8,
like_version), without a GPU: the daemon and the Python client on made-up legacy
regions (the daemon never opens them; the reader's mapping of them is stood in
for), the MoE (18,867 tensors over ~1,900 regions, a 2.3 MB manifest) or Llama-3-8B
(291 tensors over 150 regions) shapes of scripts/bench/weight_sync.py.

  python3 bench/republish_cpu.py --bin path/to/cudaipc [--model moe|dense] [--versions 40]

Alternates a fresh publish (create, manifest and table written, seal) and a
republish of the same bytes, each followed by a reader's get_bundle of it, and
prints the medians (ms) of both steps per mode, the first three rounds left out.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "bench"))

import _bench  # noqa: E402

GPU_TEXT = "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="cudaipc")
    ap.add_argument("--model", default="moe", choices=["moe", "dense"])
    ap.add_argument("--versions", type=int, default=40)
    a = ap.parse_args()
    import cudaipc
    from cudaipc import _cuda, _nocopy, bundle as B, mapping
    from cudaipc._manifest import TensorEntry, encode_manifest
    from cudaipc.region import Region, local_identity
    import weight_sync
    shapes = weight_sync.MODELS[a.model]()
    per = -(-len(shapes) // (1921 if a.model == "moe" else 150))
    groups = [shapes[i:i + per] for i in range(0, len(shapes), per)]

    def nbytes(s):
        n = 2
        for d in s:
            n *= d
        return n
    sizes = [sum(nbytes(s) for _, s in g) + 512 for g in groups]
    starts, span = _nocopy.source_starts(sizes)
    entries = []
    for g, at in zip(groups, starts):
        for n, s in g:
            entries.append(TensorEntry(n, "BF16", tuple(s), at, at + nbytes(s)))
            at += nbytes(s)
    raw = encode_manifest(entries)
    ns, boot = local_identity()
    gpu = bytes.fromhex(GPU_TEXT[4:].replace("-", ""))
    table = _nocopy.encode_sources([
        Region(handle=os.urandom(64), offset=0, size=n, alloc_size=n, device=gpu, exporter_pid=os.getpid() + 1,
               pid_namespace=ns, boot_id=boot, buffer_id=7, exporter_base=0x7F0000000000 + (i << 24)).to_bytes()
        for i, n in enumerate(sizes)])
    mapping.map_region = lambda r, fds, writable=False: (0x7F0000000000, 0, None)
    _cuda.pick_ordinal = lambda u: 0
    res = {m: {"publish": [], "get_bundle": []} for m in ("fresh", "republish")}
    with _bench.daemon(a.bin, None) as sock:
        store = cudaipc.connect(sock)
        last = 0
        for i in range(a.versions):
            for mode in res:
                t0 = time.perf_counter()
                v = _nocopy.send_version(store._conn, "m", raw, table, [], span, GPU_TEXT, keep_last=1,
                                         like=last if mode == "republish" else 0)
                t1 = time.perf_counter()
                b = B.get_bundle(store, "m", timeout=5, newer_than=last)
                t2 = time.perf_counter()
                b.release()
                last = v
                if i >= 3:
                    res[mode]["publish"].append(t1 - t0)
                    res[mode]["get_bundle"].append(t2 - t1)
        store.close()
    print("%s: manifest %d bytes, sources table %d bytes, %d regions" % (a.model, len(raw), len(table), len(sizes)))
    for mode, r in res.items():
        print("  %-9s publish %.3f ms, get_bundle %.3f ms (median of %d)" % (
            mode, statistics.median(r["publish"]) * 1e3, statistics.median(r["get_bundle"]) * 1e3, len(r["publish"])))


if __name__ == "__main__":
    main()
