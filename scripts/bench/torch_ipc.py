#!/usr/bin/env python3
"""What people use instead of cudaipc, measured like `cudaipc bench ipc`.

  python3 torch_ipc.py --what torch [--size BYTES] [--iters N] [--bw-iters N]
  python3 torch_ipc.py --what cupy  [--size BYTES] [--iters N]

Each prints one JSON object with the keys of `cudaipc bench ipc --json`
(tool, device, gpus, size, iters, bw_iters, metrics{name: {unit, p50, p99, n,
ratio, ref}}, notes), so scripts/bench/compare.py can put them side by side.

torch: a CUDA tensor sent through a torch.multiprocessing (spawn) Queue to a
receiver process. share_* is the time from the sender's put() to the tensor
being usable in the receiver (get() returned and its stream synchronized),
both read on CLOCK_MONOTONIC (time.perf_counter_ns), per tensor. It covers
pickling, cudaIpcGetMemHandle, the pipe, cudaIpcOpenMemHandle and the IPC
event wait. Each 1 MiB tensor is allocated with a 1 MiB neighbour so that
the two fill one 2 MiB segment of the caching allocator: share_1mib sends
the first (a segment the receiver has not mapped: a cold open),
share_1mib_again its neighbour (same segment: torch's handle cache, no
driver open). Bandwidths are timed with CUDA events in the receiver;
host_staged is tensor.cpu() in the sender, the CPU tensor through the queue
(torch moves it into shared memory), .to("cuda") in the receiver.

cupy: cupy.cuda.runtime.ipc* calls (the CUDA runtime API) on cudaMalloc'd
memory exported by a spawned process, timed on the host clock around each
call, as the Go and C programs do.

Latencies in µs, bandwidths in GB/s (1e9 bytes/s of bytes copied); p50 and
p99 by nearest rank, index ceil(p*n/100)-1 of the sorted values.
"""
import argparse
import json
import multiprocessing
import sys
import time

TIMEOUT = 120  # seconds to wait for the other process before giving up

SMALL = 1 << 20
WARMUP = 5
BW_WARMUP = 3


def rank_index(n, pct):
    return max((pct * n + 99) // 100 - 1, 0)


def lat_stat(ns):
    """Latency stat in µs from a list of nanoseconds."""
    s = sorted(ns)
    if not s:
        return {"unit": "us", "p50": 0, "p99": 0, "n": 0}
    return {"unit": "us", "p50": s[rank_index(len(s), 50)] / 1e3,
            "p99": s[rank_index(len(s), 99)] / 1e3, "n": len(s)}


def bw_stat(nbytes, secs, ref):
    """Bandwidth stat in GB/s from a list of seconds a copy."""
    s = sorted(secs)
    if not s:
        return {"unit": "GB/s", "p50": 0, "p99": 0, "n": 0, "ref": ref}

    def gbs(t):
        return nbytes / t / 1e9 if t > 0 else 0

    return {"unit": "GB/s", "p50": gbs(s[rank_index(len(s), 50)]),
            "p99": gbs(s[rank_index(len(s), 99)]), "n": len(s), "ref": ref}


def set_ratios(metrics):
    for m in metrics.values():
        ref = metrics.get(m.get("ref", ""))
        if m["unit"] == "GB/s" and ref and ref["p50"]:
            m["ratio"] = m["p50"] / ref["p50"]


# --------------------------------------------------------------- PyTorch

def torch_receiver(q, back):
    import torch
    torch.cuda.set_device(0)
    keep = []
    while True:
        msg = q.get()
        op = msg[0]
        if op == "share":
            _, t0, t, chk = msg
            torch.cuda.current_stream().synchronize()
            t1 = time.perf_counter_ns()
            keep.append(t)
            ok = int(t[:4096].cpu().sum()) == chk
            back.put((t1 - t0, ok))
        elif op == "staged":
            _, t0, c, chk = msg
            g = c.to("cuda")
            torch.cuda.current_stream().synchronize()
            t1 = time.perf_counter_ns()
            ok = int(g[:4096].cpu().sum()) == chk
            del g, c
            back.put((t1 - t0, ok))
        elif op == "read":
            _, t, reps = msg
            back.put(torch_copy_times(torch, t, reps))
        elif op == "drop":
            keep.clear()
            torch.cuda.synchronize()
            back.put(None)
        elif op == "exit":
            return


def torch_copy_times(torch, remote, reps):
    """Times dst.copy_(remote) and an in-process copy of the same size with
    CUDA events; checks both copies. Returns (ipc_secs, local_secs, ok)."""
    dst = torch.empty_like(remote)
    local = torch.empty_like(remote)
    local.copy_(remote)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def run(src):
        dst.zero_()
        out = []
        for i in range(BW_WARMUP + reps):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            if i >= BW_WARMUP:
                out.append(start.elapsed_time(end) / 1e3)
        return out, bool(torch.equal(dst, src))

    local_secs, ok1 = run(local)
    ipc_secs, ok2 = run(remote)
    del dst, local
    return ipc_secs, local_secs, ok1 and ok2


def torch_bench(args):
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    recv = ctx.Process(target=torch_receiver, args=(q, back), daemon=True)
    recv.start()
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    out = {"tool": "pytorch", "device": torch.cuda.get_device_name(0),
           "gpus": torch.cuda.device_count(), "size": args.size,
           "iters": args.iters, "bw_iters": args.bw_iters, "metrics": {},
           "staging": "tensor.cpu() in the sender, the CPU tensor through a torch.multiprocessing "
                      "queue (moved into shared memory), .to('cuda') in the receiver; end to end",
           "notes": ["torch %s, CUDA %s" % (torch.__version__, torch.version.cuda)]}
    m = out["metrics"]
    keep = []
    bad = 0

    def reply():
        if not recv.is_alive() and back.empty():
            raise SystemExit("torch_ipc: the receiver process died (exit %s)" % recv.exitcode)
        return back.get(timeout=TIMEOUT)

    def new_tensor(n):
        t = torch.empty(n, dtype=torch.uint8, device=dev)
        t.random_(0, 256)  # in place: no other allocation to split segments
        return t

    def checksum(t):
        return int(t[:4096].cpu().sum())

    def share(t, chk):
        nonlocal bad
        torch.cuda.synchronize()
        q.put(("share", time.perf_counter_ns(), t, chk))
        ns, ok = reply()
        bad += not ok
        return ns

    # 1 MiB: a pair per 2 MiB segment, the first cold, the second cached.
    cold, again, split = [], [], 0
    for i in range(WARMUP + args.iters):
        a, b = new_tensor(SMALL), new_tensor(SMALL)
        ca, cb = checksum(a), checksum(b)
        keep += [a, b]
        ta = share(a, ca)
        tb = share(b, cb)
        if i >= WARMUP:
            cold.append(ta)
            again.append(tb)
    try:  # a diagnostic through a private API: never fail the run over it
        for a, b in zip(keep[2 * WARMUP::2], keep[2 * WARMUP + 1::2]):
            split += a.untyped_storage()._share_cuda_()[1] != b.untyped_storage()._share_cuda_()[1]
    except Exception as e:  # noqa: BLE001
        out["notes"].append("could not check that 1 MiB pairs share a segment: %s" % e)
    m["share_1mib"] = lat_stat(cold)
    m["share_1mib_again"] = lat_stat(again)
    if split:
        out["notes"].append("%d of %d 1 MiB pairs did not share a segment: share_1mib_again mixes in cold opens" % (split, len(cold)))
    q.put(("drop",))
    reply()
    keep.clear()
    torch.cuda.empty_cache()

    # Large: every tensor its own cudaMalloc, so every receive opens anew.
    free, _ = torch.cuda.mem_get_info()
    n_large = max(1, min(args.bw_iters, int(free * 0.6) // args.size - 2))
    big, large = [], []
    for i in range(2 + n_large):
        t = new_tensor(args.size)
        ns = share(t, checksum(t))
        big.append(t)
        if i >= 2:
            large.append(ns)
    m["share_large"] = lat_stat(large)
    if n_large < args.bw_iters:
        out["notes"].append("share_large: %d tensors (GPU memory)" % n_large)

    # Bandwidth in the receiver: through the mapping, and in-process.
    q.put(("read", big[0], args.bw_iters))
    ipc_secs, local_secs, ok = reply()
    bad += not ok
    m["d2d_local"] = bw_stat(args.size, local_secs, "d2d_local")
    m["ipc_read"] = bw_stat(args.size, ipc_secs, "d2d_local")
    q.put(("drop",))
    reply()
    src = big[0]
    big.clear()
    torch.cuda.empty_cache()

    # Host-staged: .cpu(), through the queue, .to("cuda").
    n_staged = max(3, args.bw_iters // 4)
    chk = checksum(src)
    staged = []
    for i in range(1 + n_staged):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        c = src.cpu()
        q.put(("staged", t0, c, chk))
        ns, ok = reply()
        bad += not ok
        del c
        if i >= 1:
            staged.append(ns / 1e9)
    m["host_staged"] = bw_stat(args.size, staged, "d2d_local")

    q.put(("exit",))
    recv.join(60)
    if bad:
        raise SystemExit("torch_ipc: %d received tensors did not hold the sent bytes" % bad)
    set_ratios(m)
    return out


# --------------------------------------------------------------- CuPy

def cupy_exporter(conn, size, iters):
    import cupy
    rt = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    small = rt.malloc(SMALL)
    large = rt.malloc(size)
    try:
        data = cupy.random.randint(0, 256, size, dtype=cupy.uint8)
    except (TypeError, ValueError):  # an older randint without unsigned dtypes
        data = cupy.random.random(size // 8 + 1).view(cupy.uint8)[:size]
    rt.memcpy(large, data.data.ptr, size, rt.memcpyDeviceToDevice)
    rt.memcpy(small, data.data.ptr, SMALL, rt.memcpyDeviceToDevice)
    want = cupy.asnumpy(data[:4096]).tobytes()
    del data
    cupy.get_default_memory_pool().free_all_blocks()
    rt.deviceSynchronize()

    fresh = [rt.malloc(SMALL) for _ in range(WARMUP + iters)]
    first, again = [], []
    for p in fresh:
        t0 = time.perf_counter_ns()
        rt.ipcGetMemHandle(p)
        first.append(time.perf_counter_ns() - t0)
    for p in fresh:
        t0 = time.perf_counter_ns()
        rt.ipcGetMemHandle(p)
        again.append(time.perf_counter_ns() - t0)
    for p in fresh:
        rt.free(p)
    ev = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
    ev.record()
    conn.send({"small": rt.ipcGetMemHandle(small), "large": rt.ipcGetMemHandle(large),
               "event": rt.ipcGetEventHandle(ev.ptr), "want": want,
               "export_first": first[WARMUP:], "export_again": again[WARMUP:]})
    conn.poll(TIMEOUT * 5)  # hold the memory until the importer is done
    del ev
    rt.free(large)
    rt.free(small)


def cupy_bench(args):
    import cupy
    import numpy
    rt = cupy.cuda.runtime
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    exp = ctx.Process(target=cupy_exporter, args=(there, args.size, args.iters), daemon=True)
    exp.start()
    cupy.cuda.Device(0).use()
    if not here.poll(TIMEOUT):
        raise SystemExit("torch_ipc: no word from the CuPy exporter (exit %s)" % exp.exitcode)
    hello = here.recv()
    name = rt.getDeviceProperties(0)["name"]
    out = {"tool": "cupy", "device": name.decode() if isinstance(name, bytes) else name,
           "gpus": rt.getDeviceCount(), "size": args.size, "iters": args.iters,
           "bw_iters": 0, "metrics": {}, "notes": ["cupy %s" % cupy.__version__]}
    m = out["metrics"]
    m["export_first"] = lat_stat(hello["export_first"])
    m["export_again"] = lat_stat(hello["export_again"])

    def open_close(key, h):
        p = rt.ipcOpenMemHandle(h)
        got = numpy.empty(4096, dtype=numpy.uint8)
        rt.memcpy(got.ctypes.data, p, 4096, rt.memcpyDeviceToHost)
        rt.ipcCloseMemHandle(p)
        if got.tobytes() != hello["want"]:
            raise SystemExit("torch_ipc: the CuPy mapping does not hold the exporter's bytes")
        opens, closes = [], []
        for i in range(WARMUP + args.iters):
            t0 = time.perf_counter_ns()
            p = rt.ipcOpenMemHandle(h)
            t1 = time.perf_counter_ns()
            rt.ipcCloseMemHandle(p)
            t2 = time.perf_counter_ns()
            if i >= WARMUP:
                opens.append(t1 - t0)
                closes.append(t2 - t1)
        m["open_cold_" + key] = lat_stat(opens)
        m["close_" + key] = lat_stat(closes)

    open_close("1mib", hello["small"])
    open_close("large", hello["large"])

    keep = rt.ipcOpenMemHandle(hello["small"])
    opens, closes = [], []
    for i in range(WARMUP + args.iters):
        t0 = time.perf_counter_ns()
        p = rt.ipcOpenMemHandle(hello["small"])
        t1 = time.perf_counter_ns()
        rt.ipcCloseMemHandle(p)
        t2 = time.perf_counter_ns()
        if p != keep:
            raise SystemExit("torch_ipc: a second open returned another address")
        if i >= WARMUP:
            opens.append(t1 - t0)
            closes.append(t2 - t1)
    rt.ipcCloseMemHandle(keep)
    m["open_already_open"] = lat_stat(opens)
    m["close_decrement"] = lat_stat(closes)

    evs = []
    for i in range(WARMUP + args.iters):
        t0 = time.perf_counter_ns()
        ev = rt.ipcOpenEventHandle(hello["event"])
        t1 = time.perf_counter_ns()
        rt.eventDestroy(ev)
        if i >= WARMUP:
            evs.append(t1 - t0)
    m["event_open"] = lat_stat(evs)

    here.send("done")
    exp.join(60)
    if exp.exitcode != 0:
        raise SystemExit("torch_ipc: the CuPy exporter failed (exit %s)" % exp.exitcode)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=["torch", "cupy"], required=True)
    ap.add_argument("--size", type=int, default=1 << 30, help="bytes of the large tensor/allocation")
    ap.add_argument("--iters", type=int, default=200, help="repetitions of each latency")
    ap.add_argument("--bw-iters", type=int, default=20, help="repetitions of each bandwidth copy")
    args = ap.parse_args(argv)
    if args.size < SMALL or args.iters < 1 or args.bw_iters < 1:
        ap.error("--size >= 1 MiB, --iters >= 1, --bw-iters >= 1")
    out = torch_bench(args) if args.what == "torch" else cupy_bench(args)
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
