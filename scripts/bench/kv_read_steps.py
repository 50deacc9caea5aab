#!/usr/bin/env python3
"""Where a small one-node KV read's time goes: the steps of cudaipc.kv.read_blocks
on host memory, timed one by one against the read itself and its floor.

An engine process (kv_transfer.py's) registers a Llama-3-8B-shaped host space on a
daemon of its own; this process reads --tokens' blocks (scattered, seeded) from it
into a space of its own, --reads times per operation, interleaved:
  floor      one memmove per coalesced run from the engine's memfds mapped here
             (populated), as kv_transfer.py's floor
  read       kv.read_blocks(...).wait(), fresh source ids each time (drawn
             untimed, as every operation's)
  read-same  the same, always the same source ids (their pages already mapped)
  plan       cudaipc._kvread.plan alone
  leases     the leases of the regions the read uses, taken and released
  copy       the read's host copy over leases already held (_kvread's copier)
Each line: median and p90 in ms, and the minor page faults of the median
operation's kind (getrusage) per operation.

    python3 scripts/bench/kv_read_steps.py --bin path/to/cudaipc [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import kv_transfer as kvt  # noqa: E402

import cudaipc  # noqa: E402
from cudaipc import _kvread, kv  # noqa: E402


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.environ.get("CUDAIPC_BIN"), required=not os.environ.get("CUDAIPC_BIN"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=640, help="blocks in each space (default %(default)s)")
    ap.add_argument("--reads", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    # What kv_transfer's Engine and Daemons read of its arguments.
    ns = argparse.Namespace(bin=a.bin, device="host", seed=a.seed, small_count=0, start_timeout=600.0)
    shape = kvt.Shape(32, 16, 8, 128)
    n = shape.blocks_of(a.tokens)
    mem = kvt.HostMem()
    with tempfile.TemporaryDirectory(prefix="kvsteps-") as tmp:
        d = kvt.Daemons(ns, tmp, 1)
        engine = None
        try:
            engine = eng = kvt.Engine(ns, shape, d.sockets[0], tmp, a.blocks)
            store = cudaipc.connect(d.sockets[0])
            tensors = [mem.alloc(shape.tensor(a.blocks)) for _ in range(shape.layers)]
            dst = kv.vllm_layout(tensors)
            floor = kvt.HostFloor(engine, dst)
            rng = np.random.default_rng([a.seed, 5])
            ids = kvt.IdSets(rng, engine.desc.blocks, n)
            dst_ids = rng.permutation(a.blocks)[:n]
            same = ids.next()
            p_same = _kvread.plan(engine.desc, same, dst, dst_ids, None)

            def read(ids: Any) -> None:
                kv.read_blocks(store, eng.desc, ids, dst, dst_ids).wait(60)

            def read_same(ids: Any) -> None:
                kv.read_blocks(store, eng.desc, same, dst, dst_ids).wait(60)

            def plan(ids: Any) -> None:
                _kvread.plan(eng.desc, ids, dst, dst_ids, None)

            def leases(ids: Any) -> None:
                ls = [_kvread.lease(store, eng.desc, i, p_same.desc) for i in p_same.regions]
                for le in ls:
                    le.release()

            held: List[Any] = [None] * len(engine.desc.regions)
            for i in p_same.regions:
                held[i] = _kvread.lease(store, engine.desc, i, p_same.desc)
            src = [le.data_ptr if le is not None else 0 for le in held]

            def copy(ids: Any) -> None:
                for li in range(p_same.first, p_same.first + p_same.count):
                    _kvread._host_layer(p_same, src, li, False)

            def flr(ids: Any) -> None:
                floor.floor(ids, dst_ids)

            ops: Dict[str, Callable[[Any], None]] = {"floor": flr, "read": read, "read-same": read_same, "plan": plan,
                                                     "leases": leases, "copy": copy}
            times: Dict[str, List[float]] = {k: [] for k in ops}
            faults: Dict[str, List[int]] = {k: [] for k in ops}
            for i in range(a.reads + 3):
                for k, f in ops.items():
                    arg = ids.next()   # fresh source ids (their pages not yet mapped here, for read)
                    f0, t0 = minflt(), time.perf_counter()
                    f(arg)
                    dt, df = time.perf_counter() - t0, minflt() - f0
                    if i >= 3:
                        times[k].append(dt)
                        faults[k].append(df)
            for le in held:
                if le is not None:
                    le.release()
            print("%d tokens (%d blocks, %d memmoves of %d bytes), %d reads, load %s" % (
                a.tokens, n, n * shape.layers * 2, shape.block_bytes, a.reads, os.getloadavg()))
            for k in ops:
                ts = sorted(times[k])
                print("%-10s p50 %8.3f ms  p90 %8.3f ms  faults/op %6.0f" % (
                    k, statistics.median(ts) * 1e3, ts[int(len(ts) * 0.9)] * 1e3, statistics.median(faults[k])))
            floor.close()
            store.close()
        finally:
            if engine is not None:
                engine.stop()
            d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
