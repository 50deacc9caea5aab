#!/usr/bin/env python3
"""Where the time of a GPU put goes: each step of Store.put timed from inside, beside
an in-process device-to-device copy of the same tensor in the same run.

  python3 bench/put_phases.py --bin path/to/cudaipc [--device 0] [--gib 1] [--count 12]

Without --socket it starts 'cudaipc serve' on a temporary socket. It wraps (for this
process only) the functions put calls and prints one JSON object: per mode (plain
put, put(reserve_next=True)) the median of each step in µs and the median put.
"seal_answer" starts when the client's own wait for its copy (event_wait) ends: it
is the daemon's detection of the event plus the answer's trip.
"""

import argparse
import collections
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudaipc  # noqa: E402
from cudaipc import _cuda, _wire, store as _store  # noqa: E402

STEPS = collections.defaultdict(list)


def timed(owner, attr, label):
    """Wrap owner.attr so each call's duration lands in STEPS[label]."""
    f = getattr(owner, attr)

    @functools.wraps(f)
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            STEPS[label].append(time.perf_counter() - t0)
    setattr(owner, attr, w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("CUDAIPC_BIN", "cudaipc"))
    ap.add_argument("--socket")
    ap.add_argument("--device", default="0")
    ap.add_argument("--gpu-share", default="ipc")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--count", type=int, default=12)
    a = ap.parse_args()
    import torch
    proc, tmp, sock = None, None, a.socket
    if sock is None:
        tmp = tempfile.mkdtemp()
        sock = os.path.join(tmp, "store.sock")
        proc = subprocess.Popen([a.bin, "serve", "--socket", sock, "--capacity", "8GiB", "--gpu-share", a.gpu_share],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(sock):
            time.sleep(0.02)
    out = {"gpu_share": a.gpu_share}
    try:
        dev = torch.device("cuda:%d" % int(a.device))
        n = int(a.gib * (1 << 30))
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        torch.cuda.synchronize(dev)
        copies = []
        for _ in range(a.count):
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(dev)
            copies.append(time.perf_counter() - t0)
        del dst
        out["copy_median_us"] = statistics.median(copies[1:]) * 1e6
        timed(_store._Source, "of", "source")
        timed(_store.Store, "create", "create")
        timed(_store.Store, "_take_ahead", "take_ahead")
        timed(_cuda, "copy_and_record", "copy_enqueue")
        timed(_wire.Conn, "send", "send")
        timed(_cuda, "event_synchronize", "event_wait")
        after_event = []
        ev_sync = _cuda.event_synchronize
        result = _wire.Conn.result

        def ev_sync_marked(*a, **k):
            try:
                return ev_sync(*a, **k)
            finally:
                after_event.append(True)

        def result_split(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return result(self, *a, **k)
            finally:
                STEPS["seal_answer" if after_event else "other_answer"].append(time.perf_counter() - t0)
                after_event.clear()
        _cuda.event_synchronize = ev_sync_marked
        _wire.Conn.result = result_split
        timed(_store.Store, "_reserve", "reserve")
        with cudaipc.connect(sock) as st:
            for mode in ("plain", "reserve_next"):
                STEPS.clear()
                puts = []
                for i in range(a.count):
                    name = "phases-%s-%d" % (mode, i)
                    t0 = time.perf_counter()
                    st.put(name, src, reserve_next=(mode == "reserve_next"))
                    t1 = time.perf_counter()
                    puts.append(t1 - t0)
                    if i == 1:
                        with st.get(name) as l:
                            out.setdefault("bytes_equal", {})[mode] = bool(torch.equal(l.tensor(), src))
                    st.rm(name)
                skip = 2  # the first puts map arenas
                med = {k: statistics.median(v[skip:]) * 1e6 for k, v in STEPS.items() if len(v) > skip}
                out[mode] = {"put_median_us": statistics.median(puts[skip:]) * 1e6,
                             "ratio_put_to_copy": out["copy_median_us"] / (statistics.median(puts[skip:]) * 1e6),
                             "steps_median_us": med}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
