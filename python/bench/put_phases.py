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
import statistics
import sys
import re
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import cudaipc  # noqa: E402
    from cudaipc import _cuda, _cuda_ctypes, _put, _wire, store as _store  # noqa: E402
except ImportError as e:   # a missing package: say which, in one line
    sys.exit(str(e))
import _bench  # noqa: E402

STEPS = collections.defaultdict(list)


# timed(owner, attr, label) wraps owner.attr so each call's duration lands in STEPS[label].
timed = functools.partial(_bench.timed, STEPS)


def per_call(f, n=2000):
    """Median µs of f() over n calls, in batches of 20."""
    ts = []
    for _ in range(n // 20):
        t0 = time.perf_counter()
        for _ in range(20):
            f()
        ts.append((time.perf_counter() - t0) / 20)
    return statistics.median(ts) * 1e6


def micro(src, dev, sock):
    """put's small steps, one by one, on small tensors (µs a call)."""
    import torch
    cu = _cuda.driver()
    a = src[:4096]
    b = torch.empty_like(a)
    ev = _put.seal_event(dev.index)
    ev2 = _put.seal_event(dev.index)
    s = torch.cuda.current_stream(dev).cuda_stream
    r = {"current_stream": per_call(lambda: torch.cuda.current_stream(dev).cuda_stream),
         "source_of": per_call(lambda: _put.Source.of(a)),
         "contiguous": per_call(lambda: a.contiguous()),
         "ctx_push_pop": per_call(lambda: _cuda.on(dev.index).__exit__(_cuda.on(dev.index).__enter__())),
         "copy_and_record_4k": per_call(lambda: _cuda_ctypes.copy_and_record(b.data_ptr(), a.data_ptr(), 4096, s, ev)),
         "event_query": per_call(lambda: cu.cuEventQuery(ev.event)),
         "seal_request_encode": per_call(lambda: _store.pb.Request(seal=_store.pb.SealRequest(
             name="x" * 20, wait_event=ev.descriptor)).SerializeToString())}
    torch.cuda.synchronize(dev)
    r["event_synchronize_idle"] = per_call(lambda: _cuda_ctypes.event_synchronize(ev))
    # The whole copy three ways, interleaved: in-process (put's reference), into an
    # object's mapping by PyTorch, and into it by the driver call put makes.
    n = src.numel() * src.element_size()
    dst = torch.empty_like(src)
    with cudaipc.connect(sock) as st:
        obj = st.create("micro-copy", n, dev.index)
        view = obj.tensor(torch.uint8, (n,))
        flat = src.view(torch.uint8).reshape(-1)
        t = {"copy_inprocess": [], "copy_torch_into_object": [], "copy_raw_into_object": []}
        for _ in range(8):
            for k in t:
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                if k == "copy_inprocess":
                    dst.copy_(src)
                    torch.cuda.synchronize(dev)
                elif k == "copy_torch_into_object":
                    view.copy_(flat)
                    torch.cuda.synchronize(dev)
                else:
                    _cuda_ctypes.copy_and_record(obj.data_ptr, src.data_ptr(), n, s, ev2)
                    _cuda_ctypes.event_synchronize(ev2)
                t[k].append(time.perf_counter() - t0)
        del view
        obj.abort()
        # A create right after another answer (the daemon awake) beside a stat: what
        # the create itself costs the client and the daemon, without wake-ups.
        o = st.create("micro-stat", 4096, dev.index)
        o.seal()
        cr, sa = [], []
        for _ in range(30):
            t0 = time.perf_counter()
            o = st.create("micro-create", n, dev.index, _spin=_put.SEAL_SPIN)
            t1 = time.perf_counter()
            o.abort()
            t2 = time.perf_counter()
            st.stat("micro-stat")
            t3 = time.perf_counter()
            cr.append(t1 - t0)
            sa.append(t3 - t2)
        r["create_awake"] = statistics.median(cr[2:]) * 1e6
        r["stat_awake"] = statistics.median(sa[2:]) * 1e6
    for k, v in t.items():
        r[k] = statistics.median(v[1:]) * 1e6
    ev.close()
    return r


def run(a, sock, out, dlog):
    """Every measurement, against the daemon at sock (whose log is dlog, when this
    script started it), into out."""
    import torch
    dev = torch.device("cuda:%d" % int(a.device))
    n = int(a.gib * (1 << 30))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    copies = _bench.copy_times(src, a.count)
    out["copy_median_us"] = statistics.median(copies[1:]) * 1e6
    if a.cprofile:
        import cProfile
        import io
        import pstats
        with cudaipc.connect(sock) as st:
            for mode in ("plain", "reserve_next"):
                for i in range(3):
                    st.put("warm-%s-%d" % (mode, i), src, reserve_next=(mode == "reserve_next"))
                    st.rm("warm-%s-%d" % (mode, i))
                pr = cProfile.Profile()
                t0 = time.perf_counter()
                for i in range(40):
                    pr.enable()
                    st.put("prof-%s-%d" % (mode, i), src, reserve_next=(mode == "reserve_next"))
                    pr.disable()
                    st.rm("prof-%s-%d" % (mode, i))
                buf = io.StringIO()
                ps = pstats.Stats(pr, stream=buf)
                ps.sort_stats("tottime").print_stats(25)
                ps.sort_stats("cumtime").print_stats(30)
                print("==== %s (%.0f us a put+rm with the profiler)" % (mode, (time.perf_counter() - t0) / 40 * 1e6))
                print(buf.getvalue())
        return
    timed(_put.Source, "of", "source")
    timed(_store.Store, "create", "create")
    timed(_put.Putter, "take_ahead", "take_ahead")
    timed(_cuda_ctypes, "copy_and_record", "copy_enqueue")
    timed(_wire.Conn, "send", "send")
    timed(_cuda_ctypes, "event_synchronize", "event_wait")
    after_event = []
    ev_sync = _cuda_ctypes.event_synchronize
    result = _wire.Conn.result
    send = _wire.Conn.send
    # Unix-ns timestamps of this client, by request id, to set beside the daemon's
    # (its debug log): when a request was sent, its answer got, the copy seen done.
    sent, got, ev_done, kinds = {}, {}, {}, {}

    def send_stamped(self, req, *a, **k):
        rid = send(self, req, *a, **k)
        sent[rid], kinds[rid] = time.time_ns(), req.WhichOneof("body")
        return rid

    def ev_sync_marked(*a, **k):
        try:
            return ev_sync(*a, **k)
        finally:
            after_event.append(time.time_ns())

    def result_split(self, rid, *a, **k):
        t0 = time.perf_counter()
        try:
            return result(self, rid, *a, **k)
        finally:
            got[rid] = time.time_ns()
            if after_event:
                ev_done[rid] = after_event[-1]
            STEPS["seal_answer" if after_event else "other_answer"].append(time.perf_counter() - t0)
            after_event.clear()
    poll = _wire.Conn._poll
    polled = []   # (time_ns when a poll got a packet, attempts are not counted)

    def poll_stamped(self, spin):
        got = poll(self, spin)
        if got is not None:
            polled.append(time.time_ns())
        return got

    def result_split_polled(self, rid, *a, **k):
        polled.clear()
        try:
            return result_split(self, rid, *a, **k)
        finally:
            if polled and rid in got:
                recvd[rid] = polled[0]
    recvd = {}
    _cuda_ctypes.event_synchronize = ev_sync_marked
    _wire.Conn.result = result_split_polled
    _wire.Conn._poll = poll_stamped
    _wire.Conn.send = send_stamped
    timed(_put.Putter, "reserve", "reserve")
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
    if dlog is not None:
        dlog.flush()
        dlog.seek(0)
        lines = [(line, dict(kv.split("=", 1) for kv in re.findall(r'(\w+=\S+)', line))) for line in dlog]
        waits = [kv for line, kv in lines if "seal waited" in line][2:]
        handled = {int(kv["id"]): kv for line, kv in lines if "request handled" in line}
        tl = collections.defaultdict(list)
        for w in waits:
            rid = int(w["id"])
            if rid in ev_done and rid in got:
                tl["seal: client saw copy done -> daemon saw event done"].append(int(w["event_done_ns"]) - ev_done[rid])
                tl["seal: daemon event done -> answer sent"].append(int(w["replied_ns"]) - int(w["event_done_ns"]))
                tl["seal: answer sent -> client has it"].append(got[rid] - int(w["replied_ns"]))
                tl["seal: daemon's seal (with its debug log)"].append(_wire.parse_duration(w["seal"]) * 1e9)
                if rid in recvd:
                    tl["seal: answer sent -> client's poll got it"].append(recvd[rid] - int(w["replied_ns"]))
                    tl["seal: client's poll got it -> result returned"].append(got[rid] - recvd[rid])
        for rid, kind in kinds.items():
            h = handled.get(rid)
            if kind in ("create", "delete") and h is not None and rid in got:
                tl[kind + ": sent -> daemon has it"].append(int(h["recv_ns"]) - sent[rid])
                tl[kind + ": daemon's handling"].append(int(h["done_ns"]) - int(h["recv_ns"]))
                tl[kind + ": answered -> client has it"].append(got[rid] - int(h["done_ns"]))
        out["timeline_median_us"] = {k: statistics.median(v) / 1e3 for k, v in tl.items()}
        if waits:
            out["daemon_seal_wait"] = {
                "count": len(waits),
                "wait_median_us": statistics.median(_wire.parse_duration(w["wait"]) for w in waits) * 1e6,
                "polls_median": statistics.median(int(w["polls"]) for w in waits),
                "seal_median_us": statistics.median(_wire.parse_duration(w["seal"]) for w in waits) * 1e6}
    if a.micro:
        out["micro_us"] = micro(src, dev, sock)


def main():
    cudaipc._deps.require("torch", "put_phases.py")
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("CUDAIPC_BIN", "cudaipc"))
    ap.add_argument("--socket")
    ap.add_argument("--device", default="0")
    ap.add_argument("--gpu-share", default="ipc")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--count", type=int, default=12)
    ap.add_argument("--micro", action="store_true", help="also time put's small steps one by one (µs a call)")
    ap.add_argument("--trace", action="store_true",
                    help="run the daemon at debug level and set its timestamps beside this client's "
                         "(timeline_median_us; the daemon's logging slows it down)")
    ap.add_argument("--cprofile", action="store_true",
                    help="instead: cProfile 40 puts of each mode and print the top functions (no wrappers, no debug log)")
    a = ap.parse_args()
    out = {"gpu_share": a.gpu_share}
    # Debug logs (--trace): the daemon says how long each seal waited on the event.
    with tempfile.TemporaryFile("w+") as dlog, _bench.daemon(
            a.bin, a.socket, ["--capacity", "8GiB", "--gpu-share", a.gpu_share],
            pre=["--log-level", "debug" if a.trace else "info"], log=dlog) as sock:
        run(a, sock, out, dlog if a.socket is None else None)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    try:
        main()
    except ImportError as e:   # a missing package: say which, in one line
        sys.exit(str(e))
