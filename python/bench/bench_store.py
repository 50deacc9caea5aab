#!/usr/bin/env python3
"""Python client benchmarks against a running daemon, beside the Go client's in the
same run (docs/python.md, "Tests and benchmarks").

  python3 bench/bench_store.py --bin path/to/cudaipc [--device host|0] [--socket S]

Without --socket it starts 'cudaipc serve' (--backend auto) on a temporary socket.
Prints one JSON object:
  get_release: p50/p99 of get + lease.tensor() + release (the view dropped), Python,
      through the lease fast path (a take-back and a release are compare-and-swaps in
      the connection's lease table) and through the socket (connect(fast_path=False));
      beside them the Go client's 'cudaipc bench store --clients 1' p50 of both paths
      against the same daemon (run before and after Python's; the lower is used).
      ratio_fast = python fast p50 / go fast p50; ratio_socket likewise.
      python_no_view: the same cycle without the tensor (get + release only).
      python_socket_no_polling: the socket cycle with connect(spin=0) (no polling
      before sleeping on the socket), for comparison.
      python_floor: the cycle's irreducible pieces done bare (two compare-and-swaps
      through the same ctypes function on a scratch word, one tensor of the same
      placement from a prebuilt DLPack struct), timed the same way, alternating with
      the other paths; python_fast_over_floor = python fast p50 / floor p50 (what the
      client's bookkeeping adds), python_floor_over_go_fast = floor p50 / go fast p50
      (how far even the floor is from Go); python_floor_cas: the two swaps alone.
      python_timer_p50_us: the same timing of
      a call that does nothing (included in every Python figure).
  zero_copy: the tensor's data pointer equals the lease's mapping (and, for legacy
      IPC, the mapping of the object's region imported separately): no bytes copied.
  put (GPU): put of a --put-gib CUDA tensor vs an in-process device-to-device copy of
      the same tensor, in GB/s; ratio = put / copy (medians; the first put, which maps
      the arena, is left out); the phases of put; and go_put, the Go client's put
      ('cudaipc bench put') against the same daemon; put_reserve_next: the same with
      put(..., reserve_next=True) (one round trip a put).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import cudaipc  # noqa: E402
except ImportError as e:   # a missing package: say which, in one line
    sys.exit(str(e))
import _bench  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def go_bench(binary, sock, device, duration):
    r = subprocess.run([binary, "bench", "store", "--socket", sock, "--clients", "1", "--duration",
                        "%gs" % duration, "--size", "4KiB", "--device", device, "--json"],
                       capture_output=True, check=True, timeout=120)
    return json.loads(r.stdout)


def _cycle(store, name, view):
    """One get + view + release, the view dropped last (the lease ends then: a
    compare-and-swap, or a pipelined release)."""
    get = store.get

    def tensor():
        lease = get(name)
        v = lease.tensor()
        lease.release()
        del v

    def memview():
        lease = get(name)
        v = lease.memoryview()
        lease.release()
        del v

    def bare():
        get(name).release()
    return {"tensor": tensor, "memoryview": memview, None: bare}[view]


def _floor(store, name, view):
    """The Python floor of the fast-path cycle: what no get + tensor + release can do
    without, done bare with the client's own means. Two compare-and-swaps through the
    same ctypes function (libatomic's __atomic_compare_exchange_8, same argument
    objects) on a scratch word, and one tensor of the same placement from a prebuilt
    DLPack struct (a capsule, torch's construction, the deleter callback when it is
    dropped). No dict, lock, lease object or owner."""
    import ctypes
    from cudaipc import _fastpath, _views
    at = _fastpath.atomics()
    if at is None:
        return None
    cas = at.cas
    word, held, idle = ctypes.c_uint64(9), ctypes.c_uint64(9), ctypes.c_uint64(10)
    pw, ph, pi = (ctypes.c_void_p(ctypes.addressof(x)) for x in (word, held, idle))
    make = None
    if view == "tensor":
        if not hasattr(_views, "dlpack_floor"):
            return None   # (an older client, for comparisons)
        with store.get(name) as lease:
            lay = _views.resolve_layout(lease.size, lease.tensor_desc)
            make = _views.dlpack_floor(lease.data_ptr, lay, lease.ordinal)
        if make is None:
            return None

    def floor():
        cas(pw, ph, idle, 5, 5)    # idle -> held: the take-back
        if make is not None:
            v = make()
            del v
        cas(pw, pi, held, 5, 5)    # held -> idle: the release
    floor.keep = (word, held, idle, make)
    return floor


def _timed(fn, duration, lat):
    end = time.perf_counter() + duration
    pc = time.perf_counter
    while True:
        t0 = pc()
        if t0 >= end:
            break
        fn()
        lat.append(pc() - t0)


def _summary(rounds):
    lat = [x for r in rounds for x in r]
    return {"ops": len(lat), "p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6,
            "p50_us_rounds": [round(pct(r, 50) * 1e6, 3) for r in rounds if r]}


def py_paths(sock, name, duration, view, rounds=6):
    """Python's cycle through the fast path, without the view, its floor (_floor),
    and through the socket, each path on its own connection, warmed up (arena
    mapped, view construction data made), measured in `rounds` alternations of
    duration/rounds each (p50 over all of them, and each round's: on a shared
    machine the lowest is the one least disturbed)."""
    fast = cudaipc.connect(sock)
    sockc = cudaipc.connect(sock, fast_path=False)
    nopoll = cudaipc.connect(sock, fast_path=False, spin=0)
    try:
        fns = {"socket": _cycle(sockc, name, view), "socket_no_polling": _cycle(nopoll, name, view),
               "timer": lambda: None}
        if fast.fast_path:
            fns["fast"] = _cycle(fast, name, view)
            fns["fast_no_view"] = _cycle(fast, name, None)
            fl = _floor(fast, name, view)
            if fl is not None:
                fns["floor"] = fl
            fl = _floor(fast, name, None)
            if fl is not None:
                fns["floor_cas"] = fl
        lat = {k: [] for k in fns}
        for k, fn in fns.items():
            _timed(fn, 0.2, [])
        for _ in range(rounds):
            for k, fn in fns.items():
                lat[k].append([])
                _timed(fn, duration / rounds, lat[k][-1])
        out = {k: _summary(v) for k, v in lat.items()}
        for k in ("fast", "fast_no_view", "floor", "floor_cas"):
            out.setdefault(k, None)
        return out
    finally:
        fast.close()
        sockc.close()
        nopoll.close()


def run(a, sock, out):
    """Every measurement, against the daemon at sock, into out."""
    store = cudaipc.connect(sock)
    out["backend"] = store.server.backend
    out["gpu_share"] = a.gpu_share if a.device != "host" else ""
    try:
        import torch
        view = "tensor"
    except ImportError:
        view = "memoryview"
    name = "pybench-%d" % os.getpid()
    obj = store.create(name, 4096, a.device)
    obj.write(os.urandom(4096))
    obj.seal()
    for _ in range(200):  # warm up
        with store.get(name) as l:
            v = l.tensor() if view == "tensor" else l.memoryview()
            del v
    go1 = go_bench(a.bin, sock, a.device, a.duration)
    py = py_paths(sock, name, a.duration, view)
    go2 = go_bench(a.bin, sock, a.device, a.duration)
    go_fast = min(go1["fast"]["p50_us"], go2["fast"]["p50_us"])
    go_sock = min(go1["socket"]["p50_us"], go2["socket"]["p50_us"])
    gr = {"view": view, "python_fast": py["fast"], "python_socket": py["socket"],
          "python_socket_no_polling": py["socket_no_polling"],
          "python_no_view": py["fast_no_view"], "python_floor": py["floor"],
          "python_floor_cas": py["floor_cas"],
          "python_timer_p50_us": py["timer"]["p50_us"],
          "go_fast_p50_us_min": go_fast,
          "go_fast_p50_us": [go1["fast"]["p50_us"], go2["fast"]["p50_us"]],
          "go_socket_p50_us": [go1["socket"]["p50_us"], go2["socket"]["p50_us"]],
          "floor_p50_us": min(go1["floor"]["p50_us"], go2["floor"]["p50_us"]),
          "ratio_socket": py["socket"]["p50_us"] / go_sock}
    if py["fast"] is not None:
        gr["ratio_fast"] = py["fast"]["p50_us"] / go_fast
        gr["python_fast_over_socket"] = py["fast"]["p50_us"] / py["socket"]["p50_us"]
    if py["fast"] is not None and py["floor"] is not None:
        gr["python_fast_over_floor"] = py["fast"]["p50_us"] / py["floor"]["p50_us"]
        gr["python_floor_over_go_fast"] = py["floor"]["p50_us"] / go_fast
    out["get_release"] = gr
    # Zero bytes copied on get.
    with store.get(name) as lease:
        t = lease.tensor() if view == "tensor" else None
        zc = {"lease_ptr": lease.data_ptr}
        if t is not None:
            zc["tensor_ptr"] = t.data_ptr()
        info = store.stat(name)
        if info.region is not None and info.region.kind == 1:
            with cudaipc.import_region(info.region) as m:
                zc["region_ptr"] = m.data_ptr
        zc["zero_copy"] = len(set(v for k, v in zc.items() if k.endswith("ptr"))) == 1
        del t
    out["zero_copy"] = zc
    assert zc["zero_copy"], zc
    store.rm(name)
    if a.device != "host" and a.put_gib > 0:
        import torch
        dev = torch.device("cuda:%d" % int(a.device))
        n = int(a.put_gib * (1 << 30))
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        copies = _bench.copy_times(src, 10)
        puts = []
        for i in range(8):
            t0 = time.perf_counter()
            store.put("pybench-put-%d" % i, src)
            puts.append(time.perf_counter() - t0)
            if i == 0:
                with store.get("pybench-put-0") as l:
                    ok = bool(torch.equal(l.tensor(), src))
            store.rm("pybench-put-%d" % i)
        puts = puts[1:]  # the first maps the arena (once per process)
        # put(reserve_next=True): the next object is created ahead, the put is one
        # round trip (the first two map their arenas: objects alternate between two).
        ahead = []
        for i in range(10):
            t0 = time.perf_counter()
            store.put("pybench-ahead-%d" % i, src, reserve_next=True)
            ahead.append(time.perf_counter() - t0)
            if i == 3:
                with store.get("pybench-ahead-3") as l:
                    ok_ahead = bool(torch.equal(l.tensor(), src))
            store.rm("pybench-ahead-%d" % i)
        ahead = ahead[2:]
        # The phases of put, done by hand as put does them.
        from cudaipc._put import Source as _Source
        phases = {"source": [], "create": [], "copy_sync": [], "seal": []}
        for i in range(6):
            t0 = time.perf_counter()
            srcd = _Source.of(src)
            t1 = time.perf_counter()
            obj = store.create("pybench-ph-%d" % i, srcd.nbytes, srcd.ordinal, dtype=srcd.dtype, shape=srcd.shape)
            t2 = time.perf_counter()
            srcd.copy_to(obj.data_ptr, obj.ordinal)
            t3 = time.perf_counter()
            obj.seal()
            t4 = time.perf_counter()
            store.rm("pybench-ph-%d" % i)
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k].append(v)
        copy_gbs = n / statistics.median(copies) / 1e9
        put_gbs = n / statistics.median(puts) / 1e9
        out["put"] = {"bytes": n, "copy_median_ms": statistics.median(copies) * 1e3,
                      "put_median_ms": statistics.median(puts) * 1e3, "put_best_ms": min(puts) * 1e3,
                      "copy_GBps": copy_gbs, "put_GBps": put_gbs, "ratio_put_to_copy": put_gbs / copy_gbs,
                      "put_best_GBps": n / min(puts) / 1e9, "bytes_equal": ok,
                      "put_reserve_next_median_ms": statistics.median(ahead) * 1e3,
                      "put_reserve_next_GBps": n / statistics.median(ahead) / 1e9,
                      "ratio_put_reserve_next_to_copy": n / statistics.median(ahead) / 1e9 / copy_gbs,
                      "bytes_equal_reserve_next": ok_ahead,
                      "phases_median_us": {k: statistics.median(v[1:]) * 1e6 for k, v in phases.items()}}
        try:
            r = subprocess.run([a.bin, "bench", "put", "--socket", sock, "--size", str(n), "--device", a.device,
                                "--json"], capture_output=True, check=True, timeout=120)
            out["go_put"] = json.loads(r.stdout)
        except (subprocess.CalledProcessError, ValueError) as e:
            out["go_put"] = {"error": str(e), "stderr": getattr(e, "stderr", b"").decode(errors="replace")[-500:]}
    store.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("CUDAIPC_BIN", "cudaipc"))
    ap.add_argument("--socket")
    ap.add_argument("--device", default="host")
    ap.add_argument("--gpu-share", default="ipc")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--put-gib", type=float, default=1.0, help="size of the put benchmark (GPU only; 0 skips)")
    a = ap.parse_args()
    out = {"device": a.device}
    with _bench.daemon(a.bin, a.socket, ["--capacity", "8GiB", "--gpu-share", a.gpu_share]) as sock:
        run(a, sock, out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    try:
        main()
    except ImportError as e:   # a missing package: say which, in one line
        sys.exit(str(e))
