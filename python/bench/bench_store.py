#!/usr/bin/env python3
"""Python client benchmarks against a running daemon, beside the Go client's in the
same run (docs/python.md "Benchmarks").

  python3 bench/bench_store.py --bin path/to/cudaipc [--device host|0] [--socket S]

Without --socket it starts 'cudaipc serve' (--backend auto) on a temporary socket.
Prints one JSON object:
  get_release: p50/p99 of get + lease.tensor() + release (the view dropped), Python,
      and the Go client's 'cudaipc bench store --clients 1' p50 against the same daemon
      (run before and after Python's); ratio = python p50 / go p50.
  zero_copy: the tensor's data pointer equals the lease's mapping (and, for legacy
      IPC, the mapping of the object's region imported separately): no bytes copied.
  put_1gib (GPU): put of a 1 GiB CUDA tensor vs an in-process device-to-device copy of
      the same tensor, in GB/s; ratio = put / copy.
"""

import argparse
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


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def go_bench(binary, sock, device, duration):
    r = subprocess.run([binary, "bench", "store", "--socket", sock, "--clients", "1", "--duration",
                        "%gs" % duration, "--size", "4KiB", "--device", device, "--json"],
                       capture_output=True, check=True, timeout=120)
    return json.loads(r.stdout)


def py_get_release(store, name, duration, view):
    lat = []
    end = time.perf_counter() + duration
    while True:
        t0 = time.perf_counter()
        if t0 >= end:
            break
        lease = store.get(name)
        v = lease.tensor() if view == "tensor" else lease.memoryview()
        lease.release()
        del v  # the lease ends here: its release is sent (pipelined, as the Go client does)
        lat.append(time.perf_counter() - t0)
    return {"ops": len(lat), "p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6}


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
    proc, tmp = None, None
    sock = a.socket
    if sock is None:
        tmp = tempfile.mkdtemp()
        sock = os.path.join(tmp, "store.sock")
        proc = subprocess.Popen([a.bin, "serve", "--socket", sock, "--capacity", "8GiB", "--gpu-share", a.gpu_share],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(sock):
            time.sleep(0.02)
    try:
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
        py = py_get_release(store, name, a.duration, view)
        go2 = go_bench(a.bin, sock, a.device, a.duration)
        gop50 = min(go1["p50_us"], go2["p50_us"])
        out["get_release"] = {"view": view, "python": py, "go_before": go1["p50_us"], "go_after": go2["p50_us"],
                              "ratio_python_to_go_p50": py["p50_us"] / gop50}
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
            dst = torch.empty_like(src)
            torch.cuda.synchronize(dev)
            copies = []
            for _ in range(10):
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize(dev)
                copies.append(time.perf_counter() - t0)
            del dst
            puts = []
            for i in range(8):
                t0 = time.perf_counter()
                store.put("pybench-put-%d" % i, src)
                puts.append(time.perf_counter() - t0)
                if i == 0:
                    with store.get("pybench-put-0") as l:
                        ok = bool(torch.equal(l.tensor(), src))
                store.rm("pybench-put-%d" % i)
            copy_gbs = n / statistics.median(copies) / 1e9
            put_gbs = n / statistics.median(puts) / 1e9
            out["put"] = {"bytes": n, "copy_median_ms": statistics.median(copies) * 1e3,
                          "put_median_ms": statistics.median(puts) * 1e3, "put_best_ms": min(puts) * 1e3,
                          "copy_GBps": copy_gbs, "put_GBps": put_gbs, "ratio_put_to_copy": put_gbs / copy_gbs,
                          "put_best_GBps": n / min(puts) / 1e9, "bytes_equal": ok}
        store.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
