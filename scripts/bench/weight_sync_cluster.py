#!/usr/bin/env python3
"""Cross-node weight sync (issue 19 item 4): weight_sync.py --cross-node.

The trainer is attached to one daemon ("node A"), the engine to another ("node B"),
the two daemons joined as a cluster (a private etcd, UCX over tcp on loopback: on a
machine without a second node they share its loopback; on one GPU both use GPU 0).
Each version: the trainer fills a new version of a cluster-visible GPU bundle in
place (create_bundle(..., cluster=True)) and seals it; node A checks it (CRC-32C of
every 4 MiB chunk, in pinned host memory) and publishes it; the engine's
get_bundle(newer_than=...) on node B makes B pull it (A stages it device->host into
pinned memory registered with UCX, B GETs the chunks into pinned memory, checks each,
copies it host->device into its replica) and load_into's its own parameters.
Timed from the trainer's seal to the engine's copies done (CLOCK_MONOTONIC, shared by
both processes); checksums of every tensor on every version.

In the same run:
  floors          raw UCX GETs between two processes on the same link
                  (transport/ucx/ucxperf's BenchmarkGetChunks, --ucxperf-test), the
                  cluster's own pull of a 1 GiB host object (cudaipc bench cluster),
                  and pinned device->host and host->device copies (1 GiB, torch)
  gloo            torch.distributed broadcast of the same tensors between two
                  processes (gloo over tcp on loopback, on host copies: the trainer
                  packs 1 GiB buckets into pinned memory, broadcasts, the engine
                  copies them to its GPU parameters)

    python3 scripts/bench/weight_sync.py --cross-node --bin .gpu/bin/cudaipc \\
        --etcd .gpu/bin/etcd --ucxperf-test .gpu/bin/transport_ucx_ucxperf.test \\
        --models dense,moe --versions 3 --json out.json

The sync's speed moves by up to a quarter between runs with fresh daemons, more than
between the versions of one run: --repeats N runs the cudaipc-cluster path N times,
each with a fresh etcd and fresh daemons, and prints the median run's ratio to the
floors with the range and how many runs reached 0.8x (issue 19's bound).
--alternate FLAGS makes every second of those runs use the daemon flags FLAGS (e.g.
"--lanes 16") on top of the others, and prints the two sets' medians apart: a paired
comparison, each set spread over the same stretch of the machine's drift.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, HERE)

import weight_sync as ws  # noqa: E402  the shapes and the checksum helpers

BUCKET = 1 << 30
# A cluster-visible bundle's manifest travels in its directory record (at most
# 192 KiB, ~110 bytes a tensor): a model with more tensors is published as the
# shards of one version, this many tensors each.
SHARD_TENSORS = 1000
# The link, for the daemons and the floors alike. UCX's tcp transport emulates a GET
# with active messages of at most UCX_TCP_TX_SEG_SIZE (8 KiB by default): 256 KiB
# segments moved 2-4x the bytes a second in raw GETs on the 2-core CPU machine.
LINK_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n",
            "UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "256K"}
UCX_DEFAULT_SEGS = {"UCX_TCP_TX_SEG_SIZE": "8K", "UCX_TCP_RX_SEG_SIZE": "64K"}
# MiB a round of the raw UCX floor's lanes benchmarks: a round of 1 GiB takes
# 50-100 ms here, against 13-25 ms for 256 MiB, whose rounds the scheduler's
# noise moved by up to 2x between calls.
FLOOR_LANES_MIB = 1024


def shapes_of(model: str, max_gib: float) -> List[Tuple[str, Tuple[int, ...]]]:
    """The model's tensors, the first ones up to max_gib GiB of bf16 when given."""
    out = ws.MODELS[model]()
    if max_gib <= 0:
        return out
    cut, total = [], 0
    for n, s in out:
        k = 2
        for d in s:
            k *= d
        if cut and total + k > max_gib * (1 << 30):
            break
        cut.append((n, s))
        total += k
    return cut


def shards_of(shapes: List[Tuple[str, Tuple[int, ...]]], per: int = 0) -> List[List[Tuple[str, Tuple[int, ...]]]]:
    """The tensors in shards of at most per (SHARD_TENSORS) tensors, in order."""
    per = per or SHARD_TENSORS
    return [shapes[i:i + per] for i in range(0, len(shapes), per)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the cluster: etcd and two daemons --------------------------------------------------

class Cluster:
    """A private etcd and two daemons joined over UCX tcp on loopback."""

    def __init__(self, args: argparse.Namespace, tmp: str) -> None:
        self.procs: List[subprocess.Popen] = []
        self.tmp = tmp
        cp, pp = free_port(), free_port()
        self.etcd = "http://127.0.0.1:%d" % cp
        peer = "http://127.0.0.1:%d" % pp
        data = tempfile.mkdtemp(prefix="ws-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.etcd_dir = data
        log = open(os.path.join(tmp, "etcd.log"), "w")
        self.procs.append(subprocess.Popen([args.etcd, "--name", "ws", "--data-dir", data,
                                            "--listen-client-urls", self.etcd, "--advertise-client-urls", self.etcd,
                                            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                            "--initial-cluster", "ws=" + peer, "--log-level", "warn"],
                                           stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.etcd + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                raise RuntimeError("etcd did not start: see %s" % log.name)
            time.sleep(0.1)
        self.secret = os.path.join(tmp, "secret")
        with open(self.secret, "w") as f:
            f.write(base64.b64encode(os.urandom(32)).decode())
        os.chmod(self.secret, 0o600)
        env = dict(os.environ, **LINK_ENV)
        self.sockets: Dict[str, str] = {}
        for node in ("A", "B"):
            sock = os.path.join(tmp, node + ".sock")
            dlog = open(os.path.join(tmp, "daemon-%s.log" % node), "w")
            checksums = (args.b_checksums if node == "B" else None) or args.checksums
            prefix = shlex.split(args.daemon_prefix or "")
            if args.split_cpus:
                prefix = ["taskset", "-c", cpu_list(args.halves[node])]
            self.procs.append(subprocess.Popen(
                prefix +
                [args.bin, "serve", "--socket", sock, "--backend", args.backend, "--capacity", args.capacity,
                 "--log-level", args.daemon_log_level, "--cluster", "etcd://127.0.0.1:%d" % cp, "--node", node,
                 "--cluster-secret", self.secret, "--cluster-listen", "127.0.0.1:0"]
                + (["--experimental-cluster-streams", str(args.streams)] if args.streams else [])
                + (["--experimental-cluster-lanes", str(args.lanes)] if args.lanes else [])
                + (["--experimental-cluster-read", args.read] if args.read else [])
                + (["--experimental-cluster-checksums", checksums] if checksums else [])
                + (["--experimental-cluster-chunk", args.chunk] if args.chunk else [])
                + (["--experimental-cluster-gpu-publish", args.gpu_publish] if args.gpu_publish else [])
                + (["--experimental-cpu-profile", "%s-%s.pprof" % (args.cpu_profile, node)] if args.cpu_profile else []),
                stdout=dlog, stderr=subprocess.STDOUT, env=env))
            self.sockets[node] = sock
        deadline = time.monotonic() + 60
        for node, sock in self.sockets.items():
            while not os.path.exists(sock):
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("daemon %s did not start: see %s" % (node, os.path.join(tmp, "daemon-%s.log" % node)))
                time.sleep(0.05)

    def cpu_seconds(self) -> Dict[str, float]:
        """User plus system CPU seconds each daemon has used so far (/proc), as "A"
        and "B", and apart, as "A user", "A sys" and so on: in-kernel time here is
        mostly loopback TCP's copies, user time mostly UCX's polling."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for node, p in zip(("A", "B"), self.procs[-2:]):
            try:
                with open("/proc/%d/stat" % p.pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[node] = (int(fields[11]) + int(fields[12])) / tick
                out[node + " user"], out[node + " sys"] = int(fields[11]) / tick, int(fields[12]) / tick
            except (OSError, IndexError, ValueError):
                pass
        return out

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        shutil.rmtree(self.etcd_dir, ignore_errors=True)


# -- trainer and engine -----------------------------------------------------------------

def pin(cpus: Optional[List[int]]) -> None:
    """Run this process (and the threads it starts from now on) on cpus, if any."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def cpu_list(cpus: List[int]) -> str:
    """cpus as taskset's list ("0,1,2")."""
    return ",".join(str(c) for c in cpus)


def split_cpus() -> Dict[str, List[int]]:
    """This process's CPUs in two halves, node A's (the lower) and node B's."""
    cpus = sorted(os.sched_getaffinity(0))
    h = len(cpus) // 2
    if h == 0:
        sys.exit("--split-cpus needs at least two CPUs")
    return {"A": cpus[:h], "B": cpus[h:2 * h]}


def trainer(conn: Any, cfg: Dict[str, Any]) -> None:
    """Node A's side: a new version of a cluster-visible GPU bundle, filled in place."""
    pin(cfg.get("cpus"))
    import torch
    import cudaipc
    from cudaipc import bundle as B
    dev = ws.device(cfg["gpu"])   # -1: host memory (a check of the script on any machine)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shards = shards_of(shapes_of(cfg["model"], cfg["max_gib"]), cfg["shard_tensors"])
    store = cudaipc.connect(cfg["socket"])
    name = "xnode-%s" % cfg["model"]
    for _ in range(cfg["versions"]):
        ws_ = [B.create_bundle(store, name, {n: (torch.bfloat16, s) for n, s in sh}, cfg["gpu"] if cfg["gpu"] >= 0 else "host", publish=True,
                               shards=len(shards), shard=i, keep_last=1, cluster=True) for i, sh in enumerate(shards)]
        sums: List[int] = []
        for w in ws_:
            ws.randomize(w.tensors)
            ws.sync(dev)
            sums += ws.checksums(w.tensors)
        assert conn.recv() == "ready"
        t0 = ws.now()
        for w in ws_:
            w.seal()
        t_seal = ws.now() - t0
        conn.send((t0, sums, t_seal))
        assert conn.recv() == "done"
    conn.send("bye")
    assert conn.recv() == "removed?"
    store.rm(name)
    conn.send("removed")


def engine(conn: Any, cfg: Dict[str, Any], results: Any) -> None:
    """Node B's side: wait for each newer version and load it into the engine's own
    parameters."""
    pin(cfg.get("cpus"))
    import torch
    import cudaipc
    from cudaipc import bundle as B
    dev = ws.device(cfg["gpu"])   # -1: host memory (a check of the script on any machine)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shapes = shapes_of(cfg["model"], cfg["max_gib"])
    params = ws.alloc(shapes, dev)
    shards = [{n: params[n] for n, _ in sh} for sh in shards_of(shapes, cfg["shard_tensors"])]
    store = cudaipc.connect(cfg["socket"])
    name = "xnode-%s" % cfg["model"]
    times, seals, gets, bad, seen = [], [], [], 0, 0
    for v in range(cfg["versions"]):
        conn.send("ready")
        msg = None
        if v == 0:
            # The name is not in the cluster before the first seal: a get would
            # wait for a local one. Later versions wait on the directory's watch.
            msg = conn.recv()
        # Shard 0's get pulls the version's every shard onto this node.
        b = B.get_bundle(store, name, timeout=cfg["timeout"], newer_than=seen)
        tg = ws.now()
        seen = b.version
        B.load_into(b, shards[0])
        b.release()
        del b
        for i in range(1, len(shards)):
            b = B.get_bundle(store, name, timeout=cfg["timeout"], version=seen, shard=i)
            B.load_into(b, shards[i])
            b.release()
            del b
        ws.sync(dev)
        t1 = ws.now()
        t0, sums, t_seal = msg if msg is not None else conn.recv()
        if ws.checksums(params) != sums:
            bad += 1
        times.append(t1 - t0)
        seals.append(t_seal)
        gets.append(tg - t0)
        if v == 0 and "first_done" in cfg:
            # The daemons' CPU is sampled between the first version and the
            # rest (the first allocates and faults in pinned buffers).
            cfg["first_done"].set()
            cfg["sampled"].wait(5)
        conn.send("done")
    assert conn.recv() == "bye"
    conn.send("removed?")
    assert conn.recv() == "removed"
    results.put({"model": cfg["model"], "path": "cudaipc-cluster", "times": times, "seal": seals,
                 "lease": gets, "bad_versions": bad, "versions": cfg["versions"],
                 "bytes": ws.nbytes(params), "tensors": len(params)})


def gloo_rank(rank: int, conn: Any, cfg: Dict[str, Any], results: Any) -> None:
    """torch.distributed broadcast over gloo (tcp on loopback) of host copies: rank 0
    packs its GPU tensors into 1 GiB pinned buckets and broadcasts each, rank 1
    copies each bucket into its GPU parameters."""
    import torch
    import torch.distributed as dist
    dev = ws.device(cfg["gpu"])   # -1: host memory (a check of the script on any machine)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % cfg["port"], rank=rank, world_size=2)
    shapes = shapes_of(cfg["model"], cfg["max_gib"])
    params = ws.alloc(shapes, dev)
    flat = [(n, t.reshape(-1).view(torch.uint8)) for n, t in params.items()]
    buckets: List[List[Tuple[str, Any]]] = [[]]
    used = 0
    for n, t in flat:
        if buckets[-1] and used + t.numel() > BUCKET:
            buckets.append([])
            used = 0
        buckets[-1].append((n, t))
        used += t.numel()
    host = torch.empty(max(sum(t.numel() for _, t in b) for b in buckets), dtype=torch.uint8,
                       pin_memory=dev.type == "cuda")
    times, bad = [], 0
    for _ in range(cfg["versions"]):
        if rank == 0:
            ws.randomize(params)
            ws.sync(dev)
            sums = ws.checksums(params)
        dist.barrier()
        t0 = ws.now()
        for b in buckets:
            k = sum(t.numel() for _, t in b)
            if rank == 0:
                off = 0
                for _, t in b:
                    host[off:off + t.numel()].copy_(t, non_blocking=True)
                    off += t.numel()
                ws.sync(dev)
            dist.broadcast(host[:k], src=0)
            if rank == 1:
                off = 0
                for _, t in b:
                    t.copy_(host[off:off + t.numel()], non_blocking=True)
                    off += t.numel()
                ws.sync(dev)
        if rank == 0:
            conn.send((t0, sums))
        else:
            t1 = ws.now()
            t0r, sums = conn.recv()
            if ws.checksums(params) != sums:
                bad += 1
            times.append(t1 - t0r)
        dist.barrier()
    if rank == 1:
        results.put({"model": cfg["model"], "path": "torch-gloo", "times": times, "bad_versions": bad,
                     "versions": cfg["versions"], "bytes": ws.nbytes(params), "tensors": len(params)})
    dist.destroy_process_group()


def copy_floor(cfg: Dict[str, Any], results: Any) -> None:
    """Pinned device->host and host->device copies of 1 GiB: the staging floor."""
    import torch
    dev = ws.device(cfg["gpu"])   # -1: host memory (a check of the script on any machine)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    n = 1 << 30
    g = torch.empty(n, dtype=torch.uint8, device=dev)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out: Dict[str, float] = {}
    for what, dst, src in (("d2h", h, g), ("h2d", g, h)):
        best = 0.0
        for _ in range(4):
            ws.sync(dev)
            t0 = ws.now()
            dst.copy_(src, non_blocking=True)
            ws.sync(dev)
            best = max(best, n / (ws.now() - t0) / 1e9)
        out[what + "_GBps"] = best
    results.put({"path": "floor-copies", **out})


def copy_side(cfg: Dict[str, Any], ready: Any, go: Any, results: Any) -> None:
    """One side of the staging at full speed: cfg["dirs"] ("d2h", "h2d") between
    1 GiB of GPU memory and 1 GiB of pinned memory, 64 MiB slices (the staging's),
    each direction on its own stream, for cfg["seconds"] from when go is set; with
    cfg["check"], a kernel reads each slice copied in. With cfg["land"], the
    host->device copies go as a pull lands chunks instead: 4 MiB chunks on 8
    streams in turn, each chunk's copy followed by a kernel reading it and the
    copy of the kernel's result back to pinned memory (the checksum's read-back of
    cudaipc.Device.CopyToDeviceCRC32C: a small device->host copy a chunk). Two of
    these in two processes are the two daemons' copies of a sync."""
    import torch
    dev = ws.device(cfg["gpu"])
    torch.cuda.set_device(dev)
    n, sl, chunk = 1 << 30, 64 << 20, 4 << 20
    bufs = {d: (torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, pin_memory=True),
                torch.cuda.Stream()) for d in cfg["dirs"]}
    sink = torch.zeros(1, dtype=torch.int64, device=dev)
    lanes = [torch.cuda.Stream() for _ in range(8)]
    sums = torch.zeros(n // chunk, dtype=torch.int64, device=dev)
    sums_host = torch.zeros(n // chunk, dtype=torch.int64, pin_memory=True)

    def one_pass() -> None:
        for d, (g, h, st) in bufs.items():
            if d == "h2d" and cfg.get("land"):
                for i, off in enumerate(range(0, n, chunk)):
                    with torch.cuda.stream(lanes[i % len(lanes)]):
                        g[off:off + chunk].copy_(h[off:off + chunk], non_blocking=True)
                        torch.sum(g[off:off + chunk].view(torch.int32), dim=0, dtype=torch.int64, out=sums[i])
                        sums_host[i:i + 1].copy_(sums[i:i + 1], non_blocking=True)
                continue
            with torch.cuda.stream(st):
                for off in range(0, n, sl):
                    if d == "d2h":
                        h[off:off + sl].copy_(g[off:off + sl], non_blocking=True)
                    else:
                        g[off:off + sl].copy_(h[off:off + sl], non_blocking=True)
                        if cfg.get("check"):
                            sink.add_(g[off:off + sl].view(torch.int32).sum())
        for st in [b[2] for b in bufs.values()] + lanes:
            st.synchronize()
    one_pass()   # warm
    ready.set()
    go.wait(120)
    moved, t0 = 0, ws.now()
    while ws.now() - t0 < cfg["seconds"]:
        one_pass()
        moved += n
    took = ws.now() - t0
    results.put({"side": cfg["side"], "GBps": moved / took / 1e9, "dirs": cfg["dirs"], "check": bool(cfg.get("check")),
                 "land": bool(cfg.get("land"))})


# The floors of both_sides_floor: a label, what it prints, and each process's side,
# directions and options.
BOTH_SIDES: List[Tuple[str, str, List[Tuple[str, List[str], Dict[str, Any]]]]] = [
    ("two_processes", "A's d2h and B's h2d at once, two processes on GPU %(gpu)d",
     [("A", ["d2h"], {}), ("B", ["h2d"], {})]),
    ("two_processes_b_checks", "the same, a kernel reading each slice B copies in",
     [("A", ["d2h"], {}), ("B", ["h2d"], {"check": True})]),
    ("b_lands_alone", "B landing 4 MiB chunks as a pull does (copy, kernel, its result copied back), alone",
     [("B", ["h2d"], {"land": True})]),
    ("two_processes_b_lands", "A's d2h beside B landing so",
     [("A", ["d2h"], {}), ("B", ["h2d"], {"land": True})]),
    ("one_process", "both directions at once in one process (two streams)",
     [("AB", ["d2h", "h2d"], {})]),
]


def both_sides_floor(gpu: int, seconds: float = 2.0) -> Dict[str, Any]:
    """The staging floor of a sync whose two daemons share one machine: node A's
    device->host copies in one process and node B's host->device copies in another,
    at once, on their GPUs (the same one here), in the ways of BOTH_SIDES: plain
    copies; B's each followed by a kernel reading the slice; B landing chunks as a
    pull does (alone, and beside A's copies: B's small device->host copies of the
    checksums share the device's device->host copy engine with A's staging); both
    directions in one process, for contrast."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out: Dict[str, Any] = {}
    for label, _, sides in BOTH_SIDES:
        q, go = ctx.Queue(), ctx.Event()
        readies = [ctx.Event() for _ in sides]
        procs = [ctx.Process(target=copy_side, args=(dict(opts, gpu=gpu, side=sd, dirs=dirs, seconds=seconds), rd, go, q))
                 for (sd, dirs, opts), rd in zip(sides, readies)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + 120
            while not all(r.is_set() for r in readies):
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("the copy processes did not start")
                time.sleep(0.05)
            go.set()
            got = [q.get(timeout=seconds + 60) for _ in sides]
            out[label] = {r["side"]: r["GBps"] for r in got}
        except Exception as e:  # noqa: BLE001 - queue.Empty or a failed start: reported in place of the floor
            out[label] = {"error": "%s: %s" % (type(e).__name__, e)}
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return out


def copy_loops(cfg: Dict[str, Any], started: Any, stop: Any, results: Any) -> None:
    """Device->host and host->device copies of 256 MiB between pinned and GPU memory,
    on two streams at once, each direction paced to cfg["rate"] GB/s (0: as fast as
    they go), from when started is set until stop is (at most 300 s): the staging
    copies of a sync, beside which the link floor is measured again."""
    import torch
    dev = ws.device(cfg["gpu"])
    torch.cuda.set_device(dev)
    n, rate = 256 << 20, float(cfg["rate"])
    g1, g2 = (torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(2))
    h1, h2 = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    moved, t0 = 0, ws.now()
    started.set()
    while not stop.is_set() and ws.now() - t0 < 300:
        t = ws.now()
        with torch.cuda.stream(s1):
            h1.copy_(g1, non_blocking=True)
        with torch.cuda.stream(s2):
            g2.copy_(h2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()
        moved += n
        if rate > 0:
            time.sleep(max(0.0, n / (rate * 1e9) - (ws.now() - t)))
    took = ws.now() - t0
    results.put({"path": "copy-loops", "d2h_GBps": moved / took / 1e9, "h2d_GBps": moved / took / 1e9, "seconds": took})


def floor_beside_copies(args: argparse.Namespace) -> Dict[str, Any]:
    """The raw UCX lanes floor again while copy_loops runs at args.floor_beside_copies
    GB/s each way: how much of the link's floor the staging copies' memory traffic
    leaves on one host."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q, started, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=copy_loops, args=({"gpu": args.gpu, "rate": args.floor_beside_copies}, started, stop, q))
    p.start()
    try:
        deadline = time.monotonic() + 120
        while not started.wait(1):
            if not p.is_alive() or time.monotonic() > deadline:
                return {"error": "the copy loops did not start (exit code %s)" % p.exitcode}
        f = ucx_floor(args.ucxperf_test, bench="GetLanes|FetchLanes", halves=args.halves)
        stop.set()
        try:
            f["copies"] = q.get(timeout=60)
        except Exception as e:  # noqa: BLE001 - queue.Empty
            f["copies"] = {"error": str(e)}
        return f
    finally:
        stop.set()
        p.join(30)
        if p.is_alive():
            p.kill()


def run_procs(targets: List[Tuple[Any, tuple]], results: Any, want: int, timeout: float) -> List[dict]:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=f, args=a) for f, a in targets]
    out: List[dict] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            try:
                out.append(results.get(timeout=1))
            except Exception:  # noqa: BLE001 - queue.Empty
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                if any(p.exitcode not in (None, 0) for p in procs):
                    break   # one side failed: the other would wait for it until the deadline
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5)
    return out


# -- floors of the link -----------------------------------------------------------------

def ucx_floor(test_bin: Optional[str], extra: Optional[Dict[str, str]] = None,
              bench: str = "GetChunks|GetLanes|FetchLanes", lanes_mib: int = FLOOR_LANES_MIB,
              halves: Optional[Dict[str, List[int]]] = None) -> Dict[str, Any]:
    """Raw UCX reads between two processes on the same link: the best of
    BenchmarkGetChunks's chunk sizes and depths over one connection (256 MiB a
    round), and of BenchmarkGetLanes's and BenchmarkFetchLanes's 1, 2, 4, 8 and 16
    connections (a worker pair each, as the daemons' experimental-cluster-lanes; GETs, and the
    holder sending by rendezvous), lanes_mib MiB a round, 4 rounds after a first:
    over tcp on loopback more connections carry more, so the link's floor is the
    best of them all. With halves (--split-cpus) its two ends run on node A's and
    node B's CPUs."""
    if not test_bin:
        return {"error": "no --ucxperf-test"}
    env = dict(os.environ, **LINK_ENV)
    env.update(extra or {})
    env["UCXPERF_LANES_MIB"] = str(lanes_mib)
    prefix: List[str] = []
    if halves:
        # The reading end (this benchmark process) on node B's half, the holding end
        # (the child it spawns) on node A's: as the daemons, sharing no CPU.
        prefix = ["taskset", "-c", cpu_list(halves["B"])]
        env["CUDAIPC_TEST_CHILD_CPUS"] = cpu_list(halves["A"])
    try:
        r = subprocess.run(prefix + [test_bin, "-test.run", "^$", "-test.bench", bench, "-test.benchtime", "4x"],
                           capture_output=True, text=True, timeout=240, env=env, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    rows = {}
    for line in r.stdout.splitlines():
        m = re.match(r"Benchmark(Get|Fetch)(?:Chunks|Lanes)/(\S+?)(-\d+)?\s+\d+\s+\d+ ns/op\s+([\d.]+) MB/s", line)
        if m:
            rows[m.group(1).lower() + "/" + m.group(2)] = float(m.group(4)) / 1e3
    if not rows:
        return {"error": (r.stdout + r.stderr)[-400:]}
    best = max(rows, key=lambda k: rows[k])
    return {"rows_GBps": rows, "best": best, "GBps": rows[best], "lanes_MiB": lanes_mib}


def print_ucx_floor(label: str, f: Dict[str, Any]) -> None:
    """One line for a ucx_floor result, and one of its rows."""
    print("floor: raw UCX reads%s %s" % (label, ("%.2f GB/s (%s)" % (f["GBps"], f["best"])) if "GBps" in f else f["error"]),
          flush=True)
    if "rows_GBps" in f:
        print("  " + ", ".join("%s %.2f" % kv for kv in f["rows_GBps"].items()), flush=True)


def link_floor(out: Dict[str, Any]) -> Optional[float]:
    """The link floor the ratios use: the higher of the raw UCX floors measured
    before and after the models (the stricter reference)."""
    got = [out[k]["GBps"] for k in ("floor_ucx", "floor_ucx_after") if "GBps" in out.get(k, {})]
    return max(got) if got else None


def cluster_floor(bin_: str, etcd: str) -> Dict[str, Any]:
    """The cluster's own pull of a 1 GiB host object between two daemons on the same
    link (cudaipc bench cluster)."""
    env = dict(os.environ, CUDAIPC_ETCD=etcd, **LINK_ENV)
    try:
        r = subprocess.run([bin_, "bench", "cluster", "--size", "1GiB", "--count", "20", "--json"],
                           capture_output=True, text=True, timeout=240, env=env)
        return dict(json.loads(r.stdout))
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return {"error": str(e)}


def print_pull_phases(log_a: str, log_b: str) -> None:
    """What the daemons logged at debug level of each version: node A's staging
    of the published GPU object ("staged a published GPU object": took, paced)
    and node B's pull ("cluster pull done": setup, transfer, seal, took)."""
    for log, what, label, keys in ((log_a, "staged a published GPU object", "staging on A", ("bytes", "took", "copying", "idle", "err")),
                                   (log_b, "cluster pull done", "pull on B", ("bytes", "setup", "transfer", "seal", "took"))):
        try:
            with open(log) as f:
                lines = [ln for ln in f if what in ln]
        except OSError as e:
            print("%s: %s" % (label, e), flush=True)
            continue
        for ln in lines:
            kv = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', ln))
            print("%s: %s" % (label, " ".join("%s %s" % (k, kv[k]) for k in keys if k in kv)), flush=True)


def summarize(r: dict) -> str:
    t = r["times"][1:] if len(r["times"]) > 1 else r["times"]
    med = statistics.median(t)
    r["median_s"], r["first_s"], r["gbps"] = med, r["times"][0], r["bytes"] / med / 1e9
    out = "median %8.1f ms (first %8.1f ms)  %6.2f GB/s  %d tensors  %.2f GB  checksum failures %d of %d" % (
        med * 1e3, r["times"][0] * 1e3, r["gbps"], r["tensors"], r["bytes"] / 1e9, r["bad_versions"], r["versions"])
    if r.get("daemon_cpu_s_per_version"):
        out += "\n  %-16s daemon CPU a version after the first: %s" % ("", ", ".join(
            "%s %.2f s" % kv for kv in sorted(r["daemon_cpu_s_per_version"].items())))
    if "seal" in r:
        s = r["seal"][1:] if len(r["seal"]) > 1 else r["seal"]
        g = r["lease"][1:] if len(r["lease"]) > 1 else r["lease"]
        out += "\n  %-16s seal (A checks and publishes) %.1f ms, seal -> lease on B (the pull) %.1f ms" % (
            "", statistics.median(s) * 1e3, statistics.median(g) * 1e3)
    return out


def run_path(args: argparse.Namespace, cl: "Cluster", m: str, path: str, out: Dict[str, Any],
             run: int = 1) -> None:
    """Runs one path (cudaipc-cluster or torch-gloo) of model m on cluster cl,
    prints its summary and appends its results to out["results"] (run: which
    of --repeats runs it is)."""
    import torch.multiprocessing as mp
    cfg = {"model": m, "gpu": args.gpu, "versions": args.versions, "max_gib": args.max_gib,
           "timeout": args.timeout, "shard_tensors": args.shard_tensors}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    a, b = ctx.Pipe()
    if path == "cudaipc-cluster":
        first_done, sampled = ctx.Event(), ctx.Event()
        mid: Dict[str, float] = {}

        def sample() -> None:
            if first_done.wait(args.timeout):
                mid.update(cl.cpu_seconds())
            sampled.set()
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        halves = args.halves or {}
        rs = run_procs([(trainer, (a, dict(cfg, socket=cl.sockets["A"], cpus=halves.get("A")))),
                        (engine, (b, dict(cfg, socket=cl.sockets["B"], cpus=halves.get("B"), first_done=first_done,
                                          sampled=sampled), q))], q, 1, args.timeout)
        first_done.set()
        th.join(5)
        end = cl.cpu_seconds()
        if cfg["versions"] > 1:
            for r in rs:
                r["daemon_cpu_s_per_version"] = {k: (end[k] - mid[k]) / (cfg["versions"] - 1)
                                                 for k in end if k in mid}
    elif path == "torch-gloo":
        cfg["port"] = free_port()
        rs = run_procs([(gloo_rank, (0, a, cfg, q)), (gloo_rank, (1, b, cfg, q))], q, 1, args.timeout)
    else:
        sys.exit("unknown path %r (cudaipc-cluster, torch-gloo)" % path)
    if not rs:
        print("  %-16s no result (see %s)" % (path, cl.tmp), flush=True)
    for r in rs:
        r["run"] = run
        print("  %-16s %s" % (r["path"] + ("" if run == 1 else " #%d" % run), summarize(r)), flush=True)
        out["results"].append(r)
    if args.json:   # after every path: a run stopped at its limit keeps what it measured
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def main(argv: List[str]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    ap = argparse.ArgumentParser(prog="weight_sync.py --cross-node", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=shutil.which("cudaipc") or os.path.join(REPO, "cudaipc"), help="the cudaipc binary")
    ap.add_argument("--etcd", default=os.environ.get("CUDAIPC_ETCD") or shutil.which("etcd") or "etcd", help="the etcd binary")
    ap.add_argument("--ucxperf-test", help="transport/ucx/ucxperf's test binary, for the raw UCX floor")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--paths", default="torch-gloo,cudaipc-cluster",
                    help="in this order (torch-gloo first: the daemons keep GPU memory of the last versions)")
    ap.add_argument("--versions", type=int, default=3, help="versions per path (the first is reported apart)")
    ap.add_argument("--max-gib", type=float, default=0, help="only the first tensors of each model, up to this many GiB")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--capacity", default="48GiB", help="each daemon's capacity per device")
    ap.add_argument("--streams", type=int, default=0, help="chunks a pull reads from one holder at once (serve --experimental-cluster-streams; 0: the daemon's default)")
    ap.add_argument("--read", choices=["fetch", "get"], help="how daemon B reads A's memory (serve --experimental-cluster-read; default: the daemon's, fetch)")
    ap.add_argument("--checksums", choices=["auto", "host"], help="where the daemons compute GPU objects' chunk checksums (serve --experimental-cluster-checksums; default: the daemon's, auto: on the GPU)")
    ap.add_argument("--b-checksums", choices=["auto", "host"], help="--checksums for node B alone: host leaves B's landings no copies back from the GPU while A still publishes early")
    ap.add_argument("--split-cpus", action="store_true",
                    help="two nodes on one host that share no CPU: daemon A and the trainer on the lower half of this "
                         "process's CPUs, daemon B and the engine on the upper half, and the UCX floor's two ends the same "
                         "way (overrides --daemon-prefix)")
    ap.add_argument("--daemon-prefix", metavar="CMD", help="run each daemon under this command, e.g. 'numactl --cpunodebind=0 --membind=0' or 'taskset -c 0-7'")
    ap.add_argument("--chunk", help="chunk of the objects node A publishes, e.g. 16MiB (serve --experimental-cluster-chunk; default: the daemon's)")
    ap.add_argument("--gpu-publish", choices=["early", "staged"], help="when node A publishes a GPU object (serve --experimental-cluster-gpu-publish; default: the daemon's, early)")
    ap.add_argument("--cpu-profile", metavar="PREFIX", help="each daemon writes a CPU profile of its whole run to PREFIX-A.pprof and PREFIX-B.pprof (serve --experimental-cpu-profile)")
    ap.add_argument("--lanes", type=int, default=0, help="UCX worker pairs of each daemon (serve --experimental-cluster-lanes; 0: the daemon's default)")
    ap.add_argument("--shard-tensors", type=int, default=SHARD_TENSORS, help="tensors per shard of a version")
    ap.add_argument("--smoke", action="store_true", help="a tiny model in host memory (any machine): checks the script")
    ap.add_argument("--timeout", type=float, default=400, help="seconds per model and path")
    ap.add_argument("--no-floors", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="runs of the cudaipc-cluster path, each with a fresh etcd and fresh daemons (after the first, "
                         "which runs with --paths): runs spread more than the versions of one run do, so the ratios "
                         "are printed for each run and for their median")
    ap.add_argument("--alternate", metavar="FLAGS",
                    help="with --repeats: every second run (2, 4, ...) adds these flags, e.g. '--lanes 16'; "
                         "the medians of both sets are printed apart")
    ap.add_argument("--floor-beside-copies", type=float, metavar="GBPS",
                    help="also measure the link floor while device<->host copies run beside it, each way at this many GB/s "
                         "(0: flat out): what the staging copies' memory traffic leaves of the link on one host")
    ap.add_argument("--daemon-log-level", default="warn", choices=["debug", "info", "warn"],
                    help="the daemons' --log-level; with debug, node A's staging of each version and node B's pull phases (setup, transfer, seal) are printed at the end")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats %d: want 1 or more" % args.repeats)
    alt: Optional[argparse.Namespace] = None
    if args.alternate:
        if args.repeats < 2:
            ap.error("--alternate needs --repeats 2 or more")
        alt = ap.parse_args(argv + shlex.split(args.alternate))
        if alt.alternate != args.alternate:
            ap.error("--alternate %r: its flags may not set --alternate" % args.alternate)
        # Only what FLAGS changes: the rest stays args' (which --smoke changes below).
        base = ap.parse_args(argv)
        alt = argparse.Namespace(**{k: v for k, v in vars(alt).items() if getattr(base, k) != v})
    args.backend = "cuda"
    args.halves = split_cpus() if args.split_cpus else None
    if args.smoke:
        args.models, args.gpu, args.capacity, args.backend, args.no_floors = "smoke", -1, "256MiB", "host", True
    import torch.multiprocessing as mp
    tmp = tempfile.mkdtemp(prefix="weight-sync-xnode-")
    out: Dict[str, Any] = {"cpus": args.halves, "link": LINK_ENV, "streams": args.streams, "lanes": args.lanes, "read": args.read or "fetch", "results": []}
    if not args.no_floors:
        for key, extra in (("floor_ucx", None), ("floor_ucx_default_segments", UCX_DEFAULT_SEGS)):
            out[key] = ucx_floor(args.ucxperf_test, extra, halves=args.halves)
            print_ucx_floor(" (UCX's default tcp segments)" if extra else "", out[key])
        out["floor_cluster_host"] = cluster_floor(args.bin, args.etcd)
        fc = out["floor_cluster_host"]
        print("floor: cluster pull of a 1 GiB host object %s" % (
            "%.2f GB/s" % fc["large_GBps"] if "large_GBps" in fc else fc.get("error")), flush=True)
        q = mp.get_context("spawn").Queue()
        fl = run_procs([(copy_floor, ({"gpu": args.gpu}, q))], q, 1, 120)
        if fl:
            out["floor_copies"] = fl[0]
            print("floor: pinned copies d2h %.1f GB/s, h2d %.1f GB/s" % (fl[0]["d2h_GBps"], fl[0]["h2d_GBps"]), flush=True)
        if args.gpu >= 0:
            fs = out["floor_copies_both_sides"] = both_sides_floor(args.gpu)
            for label, what, _ in BOTH_SIDES:
                what = what % {"gpu": args.gpu}
                r = fs.get(label, {})
                print("floor: pinned copies, %s: %s" % (what, r.get("error") or ", ".join(
                    "%s %.1f GB/s" % kv for kv in sorted(r.items()))), flush=True)
    print("daemons: lanes %s, read %s, streams %s, checksums %s, chunk %s, gpu-publish %s" % (
        args.lanes or "default", args.read or "default (fetch)", args.streams or "default",
        args.checksums or "default (auto)", args.chunk or "default", args.gpu_publish or "default (early)"), flush=True)
    if args.halves:
        print("nodes: A (daemon, trainer, the floor's holding end) on CPUs %s; B (daemon, engine, the floor's reading "
              "end) on CPUs %s" % (cpu_list(args.halves["A"]), cpu_list(args.halves["B"])), flush=True)
    if args.b_checksums or args.daemon_prefix:
        print("daemons: node B's checksums %s; each daemon under %r" % (
            args.b_checksums or "as A's", args.daemon_prefix or ""), flush=True)
    cl = Cluster(args, tmp)
    try:
        for m in args.models.split(","):
            print("model %s%s, GPU %d, %d versions" % (m, " (first %.1f GiB)" % args.max_gib if args.max_gib > 0 else "",
                                                       args.gpu, args.versions), flush=True)
            for path in args.paths.split(","):
                run_path(args, cl, m, path, out)
            mine = [r for r in out["results"] if r["model"] == m]
            c = next((r for r in mine if r["path"] == "cudaipc-cluster"), None)
            g = next((r for r in mine if r["path"] == "torch-gloo"), None)
            if c is not None and g is not None:
                c["x_gloo"] = g["median_s"] / c["median_s"]
                print("  cudaipc-cluster is %.2fx torch-gloo's speed" % c["x_gloo"], flush=True)
    finally:
        cl.close()
    if args.repeats > 1 and "cudaipc-cluster" in args.paths.split(","):
        rargs = argparse.Namespace(**dict(vars(args), cpu_profile=None))  # the first run's profiles stay
        aargs = argparse.Namespace(**dict(vars(rargs), **vars(alt))) if alt else rargs
        for run in range(2, args.repeats + 1):
            rtmp = os.path.join(tmp, "run%d" % run)
            os.mkdir(rtmp)
            alternate = alt is not None and run % 2 == 0
            print("run %d of %d: fresh etcd and daemons%s (logs in %s)" % (
                run, args.repeats, ", with " + args.alternate if alternate else "", rtmp), flush=True)
            cl = Cluster(aargs if alternate else rargs, rtmp)
            try:
                for m in args.models.split(","):
                    run_path(aargs if alternate else rargs, cl, m, "cudaipc-cluster", out, run)
                    if alternate:
                        out["results"][-1]["flags"] = args.alternate
            finally:
                cl.close()
    if not args.no_floors:
        # The link floor again, with the daemons gone: the ratios take the higher of the two.
        out["floor_ucx_after"] = ucx_floor(args.ucxperf_test, bench="GetLanes|FetchLanes", halves=args.halves)
        print_ucx_floor(" again, after the models", out["floor_ucx_after"])
        if args.floor_beside_copies is not None:
            try:
                fb = floor_beside_copies(args)
            except Exception as e:  # noqa: BLE001 - a failed extra floor must not cost the ratios below
                fb = {"error": "%s: %s" % (type(e).__name__, e)}
            out["floor_ucx_beside_copies"] = fb
            print_ucx_floor(" beside copies of %s GB/s each way" % (args.floor_beside_copies or "max"), fb)
            copies: Dict[str, Any] = fb.get("copies", {})
            if "d2h_GBps" in copies:
                print("  the copies meanwhile: %.1f GB/s each way" % copies["d2h_GBps"], flush=True)
    link, cop = link_floor(out), out.get("floor_copies")
    if link and cop:
        staging = min(cop["d2h_GBps"], cop["h2d_GBps"])
        both = out.get("floor_copies_both_sides", {}).get("two_processes", {})
        at_once = min(both["A"], both["B"]) if "A" in both and "B" in both else None
        for c in (r for r in out["results"] if r["path"] == "cudaipc-cluster"):
            c["x_floor"] = c["gbps"] / min(link, staging)
            print("%s: cudaipc-cluster%s %.2f GB/s is %.2fx min(link %.2f, staging %.1f) GB/s" % (
                c["model"], " " + c["flags"] if c.get("flags") else "", c["gbps"], c["x_floor"], link, staging), flush=True)
            if at_once:
                # Both daemons' copies run at once on one GPU here: the staging
                # path's floor is what the two copy at once, not each alone.
                c["x_floor_both_sides"] = c["gbps"] / min(link, at_once)
                print("%s: cudaipc-cluster %.2f GB/s is %.2fx min(link %.2f, staging both sides at once %.1f) GB/s" % (
                    c["model"], c["gbps"], c["x_floor_both_sides"], link, at_once), flush=True)
    if args.repeats > 1:
        for m in args.models.split(","):
            for flags in ([None, args.alternate] if args.alternate else [None]):
                runs = [r for r in out["results"]
                        if r["model"] == m and r["path"] == "cudaipc-cluster" and r.get("flags") == flags]
                if not runs:
                    continue
                g = sorted(r["gbps"] for r in runs)
                med = statistics.median(g)
                summary: Dict[str, Any] = {"runs": len(g), "median_GBps": med, "min_GBps": g[0], "max_GBps": g[-1]}
                line = "%s: cudaipc-cluster%s over %d runs: median %.2f GB/s (%.2f-%.2f)" % (
                    m, " " + flags if flags else "", len(g), med, g[0], g[-1])
                if link and cop:
                    floor = min(link, min(cop["d2h_GBps"], cop["h2d_GBps"]))
                    summary["x_floor_median"] = med / floor
                    summary["runs_at_least_0.8x"] = sum(1 for v in g if v / floor >= 0.8)
                    line += ", %.2fx the floor (%.2f-%.2fx; %d of %d runs at 0.8x or more)" % (
                        med / floor, g[0] / floor, g[-1] / floor, summary["runs_at_least_0.8x"], len(g))
                out.setdefault("repeats", {})[m + (" " + flags if flags else "")] = summary
                print(line, flush=True)
    if args.daemon_log_level == "debug":
        print_pull_phases(os.path.join(tmp, "daemon-A.log"), os.path.join(tmp, "daemon-B.log"))
        for run in range(2, args.repeats + 1):
            print("run %d:" % run, flush=True)
            rtmp = os.path.join(tmp, "run%d" % run)
            print_pull_phases(os.path.join(rtmp, "daemon-A.log"), os.path.join(rtmp, "daemon-B.log"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print("logs in %s" % tmp)


if __name__ == "__main__":
    main(sys.argv[1:])
