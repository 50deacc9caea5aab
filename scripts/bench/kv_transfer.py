#!/usr/bin/env python3
"""KV block transfer benchmark: a request's KV blocks read from an engine's space into
the reader's own with cudaipc.kv, against the floor of the same copies in one process.

Shapes are Llama-3-8B's KV cache in vLLM's layout: 32 layers, a tensor a layer of
[2, num_blocks, 16, 8, 128] bf16 (K blocks, then V blocks): 32 KiB a block a part,
2 MiB of a request's KV a block of 16 tokens. Requests of 128, 1k, 8k and 32k tokens
(8 to 2,048 blocks: 512 to 131,072 pieces of 32 KiB), their block ids scattered
(seeded) over a space of --space-factor times the largest request's blocks.

One node (a): an engine process registers its space (kv.register, host memory from
kv.alloc_host, or GPU 0's with --device cuda); this process reads each request with
one kv.read_blocks and waits for it. Per request size, interleaved in the same run:
  read     kv.read_blocks(...).wait(): median and p90 over --reads reads after
           --warmup reads
  floor    the same copies in one process over the same descriptors: host, one
           memmove per coalesced run, from the engine's pages mapped here (its memfd,
           through /proc); GPU, one launch of the gather kernel the read uses
           (cudaipc._gather) over every layer's copies, from a copy of the source in
           this process's GPU memory
  loop     a copy per block, what a hand-rolled connector does: host, a memmove per
           block; GPU, cuMemcpyAsync per block (through ctypes) on one stream, then
           one synchronize
Ratios are of medians: read/floor ("x floor"), loop/read ("loop/read"). Beside them:
one store round trip (stat) in the same run, so that a small request's read can be
read as "the floor plus N round trips".
Small reads: one layer of 4 KiB blocks, (c) --small-count reads one after another, a
block each (p50/p99), and (d) the same number of reads started at once from this
one client (reads a second, p50/p99 of each read's start to the moment it was seen
done, waiting in start order: an upper bound).

Before the timed reads, one untimed read of every block of the engine's spaces
(unless --cold-reader): the floor maps the engine's memory populated, so that no
operation pays a source page's first touch, and a long-running reader's mappings
are as warm; with --cold-reader a read's first touch of each source page (a page
fault every 64 KiB or so) is in its time.

Every operation (read, floor, loop; warm-up included) reads its own source block
ids, unlike the previous operation's at every position, and the destination's
blocks are checked after it, untimed, against the engine's checksums (a wrapping
64-bit sum of each block's words, a layer a part a block): a block an operation did
not write still holds another block's bytes and fails. The run fails when any
check does.

Across two daemons (--cross-node: (b)-(d)): the engine attached to daemon A, this
reader to daemon B, joined as a cluster (a private etcd, UCX tcp on loopback unless
UCX_TLS/UCX_NET_DEVICES say otherwise), the reader's spaces registered with daemon B,
which reads each request from daemon A's (kv.read_blocks of a space of another
node: one kv_read; GPU spaces staged through pinned host memory by the daemons). The
same requests and small reads, against ucx_perftest on the same link at the same
message sizes: a block (ucp_get with 16 in flight, as the daemons read, and
ucp_am_bw: the higher bandwidth), 4 KiB (ucp_am_lat's round trip; the message rate
of ucp_get with 64 in flight and of ucp_am_bw: the higher; and for scale ucp_get of
1 MiB with 8 in flight, cudaipc bench cluster's floor); for GPU spaces, against the
staging copies too (device to pinned host and back, torch); and CPU seconds per GB
of both daemons over the timed reads (/proc/<pid>/stat) against ucx_perftest's
client and server on their own bytes. --pin puts daemon A, the engine and perftest's
server on the first half of the CPUs, daemon B, this reader and perftest's client on
the second. Where the daemons cannot read across nodes, the first read fails and the
part is reported as pending, with its error.

    python3 scripts/bench/kv_transfer.py --bin path/to/cudaipc [--json out.json]
    python3 scripts/bench/kv_transfer.py --bin ... --device cuda       # GPU 0, torch
    python3 scripts/bench/kv_transfer.py --bin ... --cross-node --etcd etcd

Host memory needs two spaces (the engine's and the reader's) of the largest request
times --space-factor: 16 GiB with the defaults; the run stops before it starts when
the machine has less available.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import platform
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

import numpy as np  # noqa: E402

import cudaipc  # noqa: E402
from cudaipc import kv  # noqa: E402

# The link between the two daemons, and ucx_perftest's (overridable from the environment).
LINK_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
SMALL_BLOCK = 4096


def now() -> float:
    return time.perf_counter()


def pct(xs: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile of xs."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(math.ceil(q / 100 * len(s))) - 1))]


def runs(src: Sequence[int], dst: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(src, dst, count) runs of pairs whose ids both ascend by one, in order."""
    out: List[List[int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return [(s, d, k) for s, d, k in out]


class Shape:
    """A model's KV cache shape: layers, and a block of block_tokens tokens of
    kv_heads x head_dim 2-byte elements per part (K and V)."""

    def __init__(self, layers: int, block_tokens: int, kv_heads: int, head_dim: int):
        self.layers, self.block_tokens, self.kv_heads, self.head_dim = layers, block_tokens, kv_heads, head_dim
        self.block_bytes = block_tokens * kv_heads * head_dim * 2
        if self.block_bytes % 8:
            raise SystemExit("a block of %d bytes: the checksums want a multiple of 8" % self.block_bytes)

    def blocks_of(self, tokens: int) -> int:
        return (tokens + self.block_tokens - 1) // self.block_tokens

    def tensor(self, blocks: int) -> Tuple[int, ...]:
        """vLLM's per-layer cache shape."""
        return (2, blocks, self.block_tokens, self.kv_heads, self.head_dim)

    def as_dict(self) -> Dict[str, int]:
        return {"layers": self.layers, "block_tokens": self.block_tokens, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype_bytes": 2, "block_bytes": self.block_bytes}


# -- memory of either kind, and its checksums ------------------------------------------

class HostMem:
    """Host spaces: NumPy arrays (uint16 for bf16) in memfd memory (kv.alloc_host)."""
    name = "host"

    def alloc(self, shape: Tuple[int, ...]) -> Any:
        return kv.alloc_host(shape, "uint16")

    def fill(self, arr: Any, rng: np.random.Generator) -> None:
        flat = arr.reshape(-1).view(np.uint64)
        step = 1 << 24
        for i in range(0, len(flat), step):
            k = min(step, len(flat) - i)
            flat[i:i + k] = rng.integers(0, 1 << 64, size=k, dtype=np.uint64, endpoint=False)

    def sums(self, arr: Any, ids: Any) -> Any:
        """(parts, len(ids)) wrapping sums of the 64-bit words of blocks ids of a
        [parts, blocks, ...] array."""
        w = arr.reshape(arr.shape[0], arr.shape[1], -1).view(np.uint64)
        return w[:, np.asarray(ids)].sum(axis=2, dtype=np.uint64)

    def zero(self, arr: Any, ids: Any) -> None:
        arr[:, np.asarray(ids)] = 0

    def sync(self) -> None:
        pass


class TorchMem:
    """GPU spaces: torch bf16 tensors on GPU 0 (cudaMalloc memory, legacy IPC)."""
    name = "cuda"

    def __init__(self) -> None:
        import torch
        self.torch = torch
        self.dev = torch.device("cuda", 0)

    def alloc(self, shape: Tuple[int, ...]) -> Any:
        return self.torch.zeros(shape, dtype=self.torch.bfloat16, device=self.dev)

    def fill(self, arr: Any, rng: np.random.Generator) -> None:
        g = self.torch.Generator(device=self.dev)
        g.manual_seed(int(rng.integers(0, 1 << 62)))
        arr.view(self.torch.int16).random_(-32768, 32768, generator=g)

    def sums(self, arr: Any, ids: Any) -> Any:
        t = self.torch
        idx = t.as_tensor(np.asarray(ids, dtype=np.int64), device=self.dev)
        w = arr.view(t.int64).reshape(arr.shape[0], arr.shape[1], -1)
        return w.index_select(1, idx).sum(dim=2).cpu().numpy().view(np.uint64)

    def zero(self, arr: Any, ids: Any) -> None:
        idx = self.torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.dev)
        arr.index_fill_(1, idx, 0)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.dev)


def memory_kind(device: str) -> Any:
    return TorchMem() if device == "cuda" else HostMem()


def space_sums(mem: Any, tensors: Sequence[Any], ids: Any) -> Any:
    """(layers, parts, len(ids)) block checksums of a space of per-layer tensors."""
    return np.stack([mem.sums(t, ids) for t in tensors])


def small_tensor(mem: Any, blocks: int) -> Any:
    """One layer, one part of 4 KiB blocks: a [1, blocks, 2048] array."""
    return mem.alloc((1, blocks, SMALL_BLOCK // 2))


def small_local(t: Any) -> Any:
    """A space of one layer and one part over a [1, blocks, ...] tensor."""
    blocks = t.shape[1]
    return kv.Local(kv.Layout(blocks, [[kv.Part(0, 0, SMALL_BLOCK, SMALL_BLOCK)]]), [t])


# -- the engine process ---------------------------------------------------------------

def engine_main(cfg: Dict[str, Any]) -> None:
    """The engine: registers a KV space of random bytes (and a space of 4 KiB blocks)
    on cfg's daemon, saves every block's checksums to cfg["sums"], prints one JSON
    line (pid, descriptions, the memfds of host regions), and waits for stdin to end."""
    shape = Shape(*cfg["shape"])
    mem = memory_kind(cfg["device"])
    rng = np.random.default_rng([cfg["seed"], 7])
    store = cudaipc.connect(cfg["socket"])
    tensors = [mem.alloc(shape.tensor(cfg["blocks"])) for _ in range(shape.layers)]
    for t in tensors:
        mem.fill(t, rng)
    small = small_tensor(mem, cfg["small_blocks"])
    mem.fill(small, rng)
    mem.sync()
    every = np.arange(cfg["blocks"])
    np.save(cfg["sums"], space_sums(mem, tensors, every))
    np.save(cfg["small_sums"], space_sums(mem, [small], np.arange(cfg["small_blocks"])))
    space = kv.register(store, cfg["name"] + "/kv", kv.vllm_layout(tensors))
    small_space = kv.register(store, cfg["name"] + "/small", small_local(small))
    print(json.dumps({"pid": os.getpid(), "kv": space.desc.to_text(), "small": small_space.desc.to_text(),
                      "fds": [m.fd for m in space.local.memory]}), flush=True)
    sys.stdin.read()
    small_space.close()
    space.close()
    store.close()


class Engine:
    """An engine process (engine_main) attached to a daemon."""

    def __init__(self, a: argparse.Namespace, shape: Shape, sock: str, tmp: str, blocks: int,
                 preexec: Optional[Callable[[], None]] = None):
        self.sums_path = os.path.join(tmp, "engine-sums.npy")
        self.small_sums_path = os.path.join(tmp, "engine-small-sums.npy")
        cfg = {"socket": sock, "device": a.device, "seed": a.seed, "blocks": blocks, "name": "bench/engine",
               "shape": [shape.layers, shape.block_tokens, shape.kv_heads, shape.head_dim],
               "small_blocks": max(a.small_count, 2), "sums": self.sums_path, "small_sums": self.small_sums_path}
        self.log = open(os.path.join(tmp, "engine.log"), "w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     preexec_fn=preexec)
        r, _, _ = select.select([self.proc.stdout], [], [], a.start_timeout)
        line = self.proc.stdout.readline() if r and self.proc.stdout else b""
        if not line:
            self.stop()
            self.log.seek(0)
            raise RuntimeError("the engine did not start: %s" % self.log.read()[-2000:])
        info = json.loads(line)
        self.pid: int = info["pid"]
        self.desc = kv.Desc.from_text(info["kv"])
        self.small = kv.Desc.from_text(info["small"])
        self.fds: List[int] = info["fds"]
        self.sums = np.load(self.sums_path)
        self.small_sums = np.load(self.small_sums_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- daemons -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cpus: Optional[List[int]]) -> Optional[Callable[[], None]]:
    """A preexec_fn putting a child (every thread it starts) on cpus."""
    if not cpus:
        return None
    on = list(cpus)
    return lambda: os.sched_setaffinity(0, on)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process pid has used (/proc/PID/stat)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Daemons:
    """`cudaipc serve` processes: one (one node), or two joined as a cluster through a
    private etcd (cross-node), each with its socket."""

    def __init__(self, a: argparse.Namespace, tmp: str, nodes: int, pins: Sequence[List[int]] = ()):
        self.procs: List[subprocess.Popen] = []
        self.daemons: List[subprocess.Popen] = []
        self.sockets: List[str] = []
        self.etcd_dir = ""
        self.tmp = tmp
        backend = "cuda" if a.device == "cuda" else "host"
        env = dict(os.environ)
        cluster: List[str] = []
        try:
            if nodes > 1:
                for k, v in LINK_ENV.items():
                    env.setdefault(k, v)
                cluster = self._etcd(a)
            for i in range(nodes):
                name = "AB"[i]
                sock = os.path.join(tmp, "%s.sock" % name)
                args = [a.bin, "serve", "--socket", sock, "--backend", backend, "--capacity", "256MiB",
                        "--log-level", "warn"]
                if cluster:
                    args += cluster + ["--node", name]
                log = open(os.path.join(tmp, "daemon-%s.log" % name), "w")
                p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=pinned(pins[i] if i < len(pins) else None))
                self.procs.append(p)
                self.daemons.append(p)
                self.sockets.append(sock)
            deadline = time.monotonic() + a.start_timeout
            for i, sock in enumerate(self.sockets):
                while not os.path.exists(sock):
                    if time.monotonic() > deadline or self.daemons[i].poll() is not None:
                        raise RuntimeError("daemon %s did not start: %s" % ("AB"[i], self.log("AB"[i])))
                    time.sleep(0.02)
        except BaseException:
            self.close()
            raise

    def _etcd(self, a: argparse.Namespace) -> List[str]:
        etcd = a.etcd or shutil.which("etcd")
        if not etcd:
            raise RuntimeError("--cross-node needs etcd: --etcd PATH, or etcd on PATH (Debian: etcd-server)")
        cp, pp = free_port(), free_port()
        url, peer = "http://127.0.0.1:%d" % cp, "http://127.0.0.1:%d" % pp
        self.etcd_dir = tempfile.mkdtemp(prefix="kvbench-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        log = open(os.path.join(self.tmp, "etcd.log"), "w")
        p = subprocess.Popen([etcd, "--name", "kvbench", "--data-dir", self.etcd_dir, "--listen-client-urls", url,
                              "--advertise-client-urls", url, "--listen-peer-urls", peer,
                              "--initial-advertise-peer-urls", peer, "--initial-cluster", "kvbench=" + peer,
                              "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("etcd did not start: see %s" % log.name)
            time.sleep(0.1)
        secret = os.path.join(self.tmp, "secret")
        with open(secret, "w") as f:
            f.write(os.urandom(32).hex())
        os.chmod(secret, 0o600)
        return ["--cluster", "etcd://127.0.0.1:%d" % cp, "--cluster-secret", secret, "--cluster-listen", "127.0.0.1:0"]

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.tmp, "daemon-%s.log" % name)) as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def cpu(self) -> List[float]:
        """CPU seconds each daemon has used so far."""
        return [cpu_seconds(p.pid) for p in self.daemons]

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.etcd_dir:
            shutil.rmtree(self.etcd_dir, ignore_errors=True)


# -- the reader's side -----------------------------------------------------------------

class IdSets:
    """Source block ids for successive operations: n distinct blocks of a space of
    `blocks`, scattered, and at every position unlike the previous set's, so that a
    block an operation failed to write still holds other bytes than it should."""

    def __init__(self, rng: np.random.Generator, blocks: int, n: int):
        if blocks <= n:
            raise ValueError("a space of %d blocks for requests of %d: want more" % (blocks, n))
        self.rng, self.blocks, self.n = rng, blocks, n
        self.prev: Optional[Any] = None

    def next(self) -> Any:
        perm = self.rng.permutation(self.blocks)
        s, spare = perm[:self.n].copy(), list(perm[self.n:])
        if self.prev is not None:
            for k in np.nonzero(s == self.prev)[0]:
                s[k] = spare.pop()   # an unused block: unlike prev[k], which is s[k]
        self.prev = s
        return s


class Checker:
    """Checks a destination's blocks against the engine's checksums after each
    operation, untimed; counts the operations and the wrong blocks."""

    def __init__(self, mem: Any, dst: Sequence[Any], src_sums: Any):
        self.mem, self.dst, self.src_sums = mem, dst, src_sums
        self.ops = self.bad_ops = self.bad_blocks = 0

    def __call__(self, src_ids: Any, dst_ids: Any) -> None:
        got = space_sums(self.mem, self.dst, dst_ids)
        want = self.src_sums[:, :, np.asarray(src_ids)]
        wrong = int(np.count_nonzero(got != want))
        self.ops += 1
        if wrong:
            self.bad_ops += 1
            self.bad_blocks += wrong


class HostFloor:
    """The in-process copies over host memory: the engine's regions mapped here
    (its memfds, through /proc), the destination's own addresses."""

    def __init__(self, engine: Engine, dst: Any):
        self.maps: List[mmap.mmap] = []
        self.src: List[int] = []
        for fd, r in zip(engine.fds, engine.desc.regions):
            f = os.open("/proc/%d/fd/%d" % (engine.pid, fd), os.O_RDONLY)
            try:
                # Populated: no operation pays for the first touch of a source page.
                m = mmap.mmap(f, r.size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
            finally:
                os.close(f)
            self.maps.append(m)
            self.src.append(_mmap_addr(m))
        self.layout = engine.desc.layers
        self.dst = dst

    def floor(self, src_ids: Any, dst_ids: Any) -> None:
        mm = ctypes.memmove
        rs = runs(src_ids.tolist(), dst_ids.tolist())
        for sl, dl in zip(self.layout, self.dst.layers):
            for sp, dp in zip(sl, dl):
                s, d, n = self.src[sp.region] + sp.base, self.dst.memory[dp.region].addr + dp.base, sp.nbytes
                ss, ds = sp.stride, dp.stride
                if ss == n and ds == n:
                    for a, b, k in rs:
                        mm(d + b * n, s + a * n, k * n)
                else:
                    for a, b, k in rs:
                        for j in range(k):
                            mm(d + (b + j) * ds, s + (a + j) * ss, n)

    def loop(self, src_ids: Any, dst_ids: Any) -> None:
        mm = ctypes.memmove
        pairs = list(zip(src_ids.tolist(), dst_ids.tolist()))
        for sl, dl in zip(self.layout, self.dst.layers):
            for sp, dp in zip(sl, dl):
                s, d, n = self.src[sp.region] + sp.base, self.dst.memory[dp.region].addr + dp.base, sp.nbytes
                ss, ds = sp.stride, dp.stride
                for a, b in pairs:
                    mm(d + b * ds, s + a * ss, n)

    def close(self) -> None:
        for m in self.maps:
            m.close()


def _mmap_addr(m: mmap.mmap) -> int:
    """The address of a read-only mapping (NumPy reads it without a copy)."""
    return int(np.frombuffer(m, dtype=np.uint8).ctypes.data)


class GPUFloor:
    """The in-process copies on GPU 0: a copy of the source in this process's memory
    (made once through a lease of each region), one gather kernel launch over every
    layer's copies (the floor), or cuMemcpyAsync per block (the loop)."""

    def __init__(self, store: Any, mem: TorchMem, engine: Engine, dst: Any):
        from cudaipc import _cuda, _gather
        self._cuda, self._gather = _cuda, _gather
        self.dst = dst
        self.layout = engine.desc.layers
        self.copies: List[Any] = []
        for i, r in enumerate(engine.desc.regions):
            t = mem.torch.empty(r.size, dtype=mem.torch.uint8, device=mem.dev)
            lease = store.get(engine.desc.region_name(i))
            try:
                with _cuda.on(0):
                    _cuda.memcpy_dtod(int(t.data_ptr()), lease.data_ptr, r.size)
            finally:
                lease.release()
            self.copies.append(t)
        self.src = [int(t.data_ptr()) for t in self.copies]
        self.fn = _gather.wait_ready(0)
        if self.fn is None:
            raise RuntimeError("the gather kernel is not available on GPU 0: %s" % _gather.unavailable.get(0, "off"))
        cu = _cuda.driver()
        with _cuda.on(0):
            self._stream = _cuda.check("cuStreamCreate", cu.cuStreamCreate(1))   # CU_STREAM_NON_BLOCKING
        self.stream = int(self._stream)
        self.copy_fn = _cuda.proc("cuMemcpyAsync", 4000, ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p))
        self.sync_fn = _cuda.proc("cuStreamSynchronize", 2000, ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p))

    def _sync(self) -> None:
        err = self.sync_fn(self.stream)
        if err:
            raise RuntimeError("cuStreamSynchronize: %s" % self._cuda.err_name(err))

    def floor(self, src_ids: Any, dst_ids: Any) -> None:
        u64 = np.uint64
        rs = np.array(runs(src_ids.tolist(), dst_ids.tolist()), dtype=u64).reshape(-1, 3)
        ds, ss, ns = [], [], []
        for sl, dl in zip(self.layout, self.dst.layers):
            for sp, dp in zip(sl, dl):
                s, d, n = u64(self.src[sp.region] + sp.base), u64(self.dst.memory[dp.region].addr + dp.base), sp.nbytes
                if sp.stride == n and dp.stride == n:
                    ds.append(d + rs[:, 1] * u64(n))
                    ss.append(s + rs[:, 0] * u64(n))
                    ns.append(rs[:, 2] * u64(n))
                else:
                    ds.append(d + dst_ids.astype(u64) * u64(dp.stride))
                    ss.append(s + src_ids.astype(u64) * u64(sp.stride))
                    ns.append(np.full(len(src_ids), n, dtype=u64))
        g, cu = self._gather, self._cuda.driver()
        with self._cuda.on(0):
            tab = g.chunk_table(np.concatenate(ds), np.concatenate(ss), np.concatenate(ns))
            dev = g.upload_table(tab)
            try:
                g.launch_rows(self.fn, dev, 0, len(tab), self.stream)
                self._sync()
            finally:
                cu.cuMemFree(dev)

    def loop(self, src_ids: Any, dst_ids: Any) -> None:
        fn, stream = self.copy_fn, self.stream
        pairs = list(zip(src_ids.tolist(), dst_ids.tolist()))
        with self._cuda.on(0):
            for sl, dl in zip(self.layout, self.dst.layers):
                for sp, dp in zip(sl, dl):
                    s, d, n = self.src[sp.region] + sp.base, self.dst.memory[dp.region].addr + dp.base, sp.nbytes
                    ss, dst_s = sp.stride, dp.stride
                    for a, b in pairs:
                        err = fn(d + b * dst_s, s + a * ss, n, stream)
                        if err:
                            raise RuntimeError("cuMemcpyAsync: %s" % self._cuda.err_name(err))
            self._sync()

    def close(self) -> None:
        with self._cuda.on(0):
            self._cuda.driver().cuStreamDestroy(self._stream)
        self.copies = []


def stats_ms(xs: Sequence[float]) -> Dict[str, float]:
    return {"p50_ms": round(statistics.median(xs) * 1e3, 4), "p90_ms": round(pct(xs, 90) * 1e3, 4), "n": len(xs)}


def round_trip_us(store: Any, name: str, n: int = 200) -> float:
    """The median of n store round trips (stat of one of the space's regions)."""
    ts = []
    for _ in range(n):
        t = now()
        store.stat(name)
        ts.append(now() - t)
    return statistics.median(ts) * 1e6


def measure_requests(a: argparse.Namespace, shape: Shape, store: Any, engine: Engine, mem: Any, dst_tensors: List[Any],
                     dst: Any, floor: Any, daemons: Optional[Daemons] = None) -> List[Dict[str, Any]]:
    """Per request size: reads, floor and loop interleaved, each checked after it."""
    out = []
    rng = np.random.default_rng([a.seed, 11])
    dst_blocks = dst_tensors[0].shape[1]
    for tokens in a.tokens:
        n = shape.blocks_of(tokens)
        ids = IdSets(rng, engine.desc.blocks, n)
        dst_ids = rng.permutation(dst_blocks)[:n]
        for t in dst_tensors:
            mem.zero(t, dst_ids)
        mem.sync()
        checks = {k: Checker(mem, dst_tensors, engine.sums) for k in ("read", "floor", "loop")}
        times: Dict[str, List[float]] = {"read": [], "floor": [], "loop": []}
        nbytes = n * shape.layers * 2 * shape.block_bytes
        cpu0: List[float] = []
        read_s = 0.0

        def read(src_ids: Any) -> None:
            kv.read_blocks(store, engine.desc, src_ids, dst, dst_ids).wait(a.read_timeout)

        for i in range(a.warmup + a.reads):
            if i == a.warmup and daemons:
                cpu0 = daemons.cpu()
            kinds = ["read"] + (["floor"] if floor else []) + (["loop"] if floor and i < a.warmup + a.loop_reads else [])
            kinds = kinds[i % len(kinds):] + kinds[:i % len(kinds)]   # no kind always first after another's check
            for kind in kinds:
                src_ids = ids.next()
                f = read if kind == "read" else getattr(floor, kind)
                t0 = now()
                f(src_ids) if kind == "read" else f(src_ids, dst_ids)
                dt = now() - t0
                if i >= a.warmup:
                    times[kind].append(dt)
                    if kind == "read":
                        read_s += dt
                checks[kind](src_ids, dst_ids)
        r: Dict[str, Any] = {"tokens": tokens, "blocks": n, "pieces": n * shape.layers * 2, "bytes": nbytes,
                             "read": stats_ms(times["read"])}
        r["read"]["GBps"] = round(nbytes / (r["read"]["p50_ms"] / 1e3) / 1e9, 3)
        if daemons:
            cpu1 = daemons.cpu()
            gb = nbytes * a.reads / 1e9
            r["daemon_cpu_s_per_GB"] = [round((c1 - c0) / gb, 4) for c0, c1 in zip(cpu0, cpu1)]
            r["read_wall_s"] = round(read_s, 4)
        if floor:
            r["floor"] = stats_ms(times["floor"])
            r["loop"] = stats_ms(times["loop"])
            r["x_floor"] = round(r["read"]["p50_ms"] / r["floor"]["p50_ms"], 3)
            r["loop_over_read"] = round(r["loop"]["p50_ms"] / r["read"]["p50_ms"], 3)
            r["read_minus_floor_us"] = round((r["read"]["p50_ms"] - r["floor"]["p50_ms"]) * 1e3, 1)
        r["checked"] = {k: {"ops": c.ops, "bad_ops": c.bad_ops, "bad_blocks": c.bad_blocks} for k, c in checks.items() if c.ops}
        out.append(r)
        print_request(r, shape, bool(floor), daemons is not None)
    return out


def measure_small(a: argparse.Namespace, store: Any, engine: Engine, mem: Any, dst_t: Any, dst: Any) -> Dict[str, Any]:
    """(c) one 4 KiB read after another, (d) the same number started at once; each
    read into a block of its own, all checked after."""
    rng = np.random.default_rng([a.seed, 13])
    count = a.small_count
    src_blocks = engine.small.blocks
    out: Dict[str, Any] = {"bytes": SMALL_BLOCK, "count": count}

    def check(src: Any) -> int:
        got = space_sums(mem, [dst_t], np.arange(count))
        return int(np.count_nonzero(got != engine.small_sums[:, :, src]))

    for name in ("sequential", "concurrent"):
        for attempt in range(2):   # a first pass whose times are dropped: the warm-up
            src = rng.integers(0, src_blocks, size=count)
            mem.zero(dst_t, np.arange(count))
            mem.sync()
            lat: List[float] = []
            t_all = now()
            if name == "sequential":
                for i in range(count):
                    t = now()
                    kv.read_blocks(store, engine.small, [int(src[i])], dst, [i]).wait(a.read_timeout)
                    lat.append(now() - t)
            else:
                started = []
                for i in range(count):
                    started.append((now(), kv.read_blocks(store, engine.small, [int(src[i])], dst, [i])))
                for t, tr in started:
                    tr.wait(a.read_timeout)
                    lat.append(now() - t)
            wall = now() - t_all
            bad = check(src)
            if attempt == 1:
                out[name] = {"p50_us": round(statistics.median(lat) * 1e6, 1), "p99_us": round(pct(lat, 99) * 1e6, 1),
                             "reads_per_s": round(count / wall, 1), "bad_reads": bad}
    return out


def print_header(floor: bool, cross: bool) -> None:
    cols = "%7s %6s %8s %10s %10s %8s" % ("tokens", "blocks", "MiB", "read p50", "p90", "GB/s")
    if floor:
        cols += " %10s %8s %10s %9s %10s" % ("floor p50", "x floor", "loop p50", "loop/read", "read-floor")
    if cross:
        cols += " %14s" % "CPU-s/GB A,B"
    print(cols + " %5s" % "bad", flush=True)


def print_request(r: Dict[str, Any], shape: Shape, floor: bool, cross: bool) -> None:
    line = "%7d %6d %8.4g %8.3fms %8.3fms %8.2f" % (r["tokens"], r["blocks"], r["bytes"] / (1 << 20), r["read"]["p50_ms"],
                                                  r["read"]["p90_ms"], r["read"]["GBps"])
    if floor:
        line += " %8.3fms %7.2fx %8.3fms %8.1fx %8.0fµs" % (r["floor"]["p50_ms"], r["x_floor"], r["loop"]["p50_ms"],
                                                           r["loop_over_read"], r["read_minus_floor_us"])
    if cross:
        line += " %14s" % ",".join("%.2f" % c for c in r.get("daemon_cpu_s_per_GB", []))
    bad = sum(c["bad_ops"] for c in r["checked"].values())
    print(line + " %5d" % bad, flush=True)


def print_small(s: Dict[str, Any], floor_label: str, floor_us: Optional[float], rate: Optional[float]) -> None:
    q, c = s["sequential"], s["concurrent"]
    extra = " (%s %.1f µs: %.2fx)" % (floor_label, floor_us, q["p50_us"] / floor_us) if floor_us else ""
    print("4 KiB reads, one after another: p50 %.1f µs, p99 %.1f µs%s; bad %d" % (q["p50_us"], q["p99_us"], extra, q["bad_reads"]))
    extra = " (ucx_perftest %.0f msg/s: %.2fx)" % (rate, c["reads_per_s"] / rate) if rate else ""
    print("%d 4 KiB reads at once: %.0f reads/s%s, p50 %.1f µs, p99 %.1f µs; bad %d" % (
        s["count"], c["reads_per_s"], extra, c["p50_us"], c["p99_us"], c["bad_reads"]), flush=True)


def host_bytes_needed(a: argparse.Namespace, shape: Shape, blocks: int) -> int:
    return 2 * shape.layers * 2 * blocks * shape.block_bytes


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def dst_space(mem: Any, shape: Shape, blocks: int, small_count: int) -> Tuple[List[Any], Any, Any, Any]:
    tensors = [mem.alloc(shape.tensor(blocks)) for _ in range(shape.layers)]
    small = small_tensor(mem, max(small_count, 2))
    mem.sync()
    return tensors, kv.vllm_layout(tensors), small, small_local(small)


def warm_reader(store: Any, engine: Engine, dst: Any, small_dst: Any, timeout: float) -> None:
    """Read every block of the engine's spaces once, untimed: the reader's mappings
    of the source then have every page in place, as the floor's populated mapping
    has and as a long-running reader's have (a page's first touch is paid once a
    process). The measured operations zero and check their own blocks."""
    every = list(range(engine.desc.blocks))
    kv.read_blocks(store, engine.desc, every, dst, every).wait(timeout)
    small = list(range(engine.small.blocks))
    kv.read_blocks(store, engine.small, small, small_dst, small).wait(timeout)


def one_node(a: argparse.Namespace, shape: Shape, tmp: str, blocks: int) -> Dict[str, Any]:
    """(a): an engine and this reader on one daemon."""
    mem = memory_kind(a.device)
    d = Daemons(a, tmp, 1)
    engine = None
    floor: Any = None
    try:
        engine = Engine(a, shape, d.sockets[0], tmp, blocks)
        store = cudaipc.connect(d.sockets[0])

        dst_tensors, dst, small_t, small_dst = dst_space(mem, shape, blocks, a.small_count)
        floor = GPUFloor(store, mem, engine, dst) if a.device == "cuda" else HostFloor(engine, dst)
        if not a.cold_reader:
            warm_reader(store, engine, dst, small_dst, a.read_timeout)
        rt = round_trip_us(store, engine.desc.region_name(0))
        print("one node: an engine process and this reader on one daemon, %s memory; store round trip (stat) %.1f µs"
              % (a.device, rt), flush=True)
        print_header(True, False)
        reqs = measure_requests(a, shape, store, engine, mem, dst_tensors, dst, floor)
        res: Dict[str, Any] = {"round_trip_us": round(rt, 1), "requests": reqs}
        if a.small_count:
            res["small"] = measure_small(a, store, engine, mem, small_t, small_dst)
            print_small(res["small"], "store round trip", rt, None)
        floor.close()
        floor = None
        store.close()
        return res
    finally:
        if floor is not None:
            floor.close()
        if engine is not None:
            engine.stop()
        d.close()


# -- across two daemons -------------------------------------------------------------------

def perftest(a: argparse.Namespace, test: str, size: int, iters: int, outstanding: int = 0,
             pins: Sequence[List[int]] = ()) -> Dict[str, Any]:
    """One ucx_perftest run on the link (server, then client, on loopback), with its
    p50 latency (µs), bandwidth (MB/s of 2^20 bytes, as it prints), message rate and
    the CPU seconds of both ends."""
    bin_ = a.ucx_perftest or shutil.which("ucx_perftest")
    if not bin_:
        return {"error": "no ucx_perftest (Debian: ucx-utils; --ucx-perftest PATH)"}
    env = dict(os.environ)
    for k, v in LINK_ENV.items():
        env.setdefault(k, v)
    port = free_port()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    srv = subprocess.Popen([bin_, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                           preexec_fn=pinned(pins[0] if pins else None))
    args = [bin_, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size), "-n", str(iters), "-w", str(max(iters // 20, 10)),
            "-f", "-v"] + (["-O", str(outstanding)] if outstanding else [])
    out = ""
    try:
        deadline = time.monotonic() + 10
        while True:
            r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300,
                               preexec_fn=pinned(pins[1] if len(pins) > 1 else None))
            out = r.stdout + r.stderr
            if r.returncode == 0 or "Connection refused" not in out or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    finally:
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for line in out.splitlines():
        f = line.strip().split(",")
        if len(f) == 8 and f[0].isdigit():
            got = [float(x) for x in f[1:]]
            nbytes = int(f[0]) * size
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            return {"test": test, "size": size, "iters": int(f[0]), "outstanding": outstanding, "p50_us": got[0],
                    "MBps": got[4], "GBps": round(got[4] * (1 << 20) / 1e9, 3), "msg_per_s": got[6],
                    "cpu_s": round(cpu, 3), "cpu_s_per_GB": round(cpu / (nbytes / 1e9), 4)}
    return {"test": test, "error": out[-500:]}


def halves() -> Tuple[List[int], List[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    h = max(1, len(cpus) // 2)
    return cpus[:h], cpus[h:] or cpus[:h]


def cross_node(a: argparse.Namespace, shape: Shape, tmp: str, blocks: int) -> Dict[str, Any]:
    """(b)-(d): the engine on daemon A, this reader on daemon B, against ucx_perftest
    (and, for GPU spaces, the staging copies)."""
    mem = memory_kind(a.device)
    pins: List[List[int]] = list(halves()) if a.pin else []
    own = os.sched_getaffinity(0)
    res: Dict[str, Any] = {"link": {k: os.environ.get(k, v) for k, v in LINK_ENV.items() if k != "UCX_WARN_UNUSED_ENV_VARS"},
                           "pinned": pins or None}
    d = Daemons(a, tmp, 2, pins)
    engine = None
    try:
        engine = Engine(a, shape, d.sockets[0], tmp, blocks, preexec=pinned(pins[0] if pins else None))
        if pins:
            os.sched_setaffinity(0, pins[1])
        store = cudaipc.connect(d.sockets[1])
        dst_tensors, dst_local, small_t, small_local_ = dst_space(mem, shape, blocks, a.small_count)
        # A read across nodes writes through the reader's daemon: into spaces registered with it.
        dst = kv.register(store, "bench/reader/kv", dst_local)
        small_dst = kv.register(store, "bench/reader/small", small_local_)
        try:
            kv.read_blocks(store, engine.small, [0], small_dst, [0]).wait(a.read_timeout)
        except Exception as e:  # noqa: BLE001 - whatever the read says is the reason
            res["pending"] = ("a read of daemon A's space through daemon B failed (this build cannot read across "
                              "nodes?): %s: %s" % (type(e).__name__, e))
            print("across two daemons: pending. " + res["pending"], flush=True)
            return res
        print("across two daemons: the engine on daemon A, this reader on daemon B, %s memory, %s%s" % (
            a.device, " ".join("%s=%s" % kv_ for kv_ in res["link"].items()),
            ", pinned %s" % res["pinned"] if pins else ""), flush=True)
        print_header(False, True)
        res["requests"] = measure_requests(a, shape, store, engine, mem, dst_tensors, dst, None, d)
        if a.small_count:
            res["small"] = measure_small(a, store, engine, mem, small_t, small_dst)
        if a.device == "cuda":
            res["staging"] = staging_floor(mem, max(r["bytes"] for r in res["requests"]))
        dst.close()
        small_dst.close()
        store.close()
    finally:
        if pins:
            os.sched_setaffinity(0, own)
        if engine is not None:
            engine.stop()
        d.close()
    pt = {"get_block": perftest(a, "ucp_get", shape.block_bytes, a.perftest_iters, 16, pins),
          "am_bw_block": perftest(a, "ucp_am_bw", shape.block_bytes, a.perftest_iters, 0, pins),
          "am_lat_4k": perftest(a, "ucp_am_lat", SMALL_BLOCK, a.perftest_iters, 0, pins),
          "get_4k": perftest(a, "ucp_get", SMALL_BLOCK, a.perftest_iters, 64, pins),
          "am_bw_4k": perftest(a, "ucp_am_bw", SMALL_BLOCK, a.perftest_iters, 0, pins),
          # The link with large messages (bench cluster's floor), for scale: not the ratios' floor.
          "get_1m": perftest(a, "ucp_get", 1 << 20, max(a.perftest_iters // 32, 64), 8, pins)}
    res["perftest"] = pt
    bw = [p for p in (pt["get_block"], pt["am_bw_block"]) if "GBps" in p]
    rate = [p for p in (pt["get_4k"], pt["am_bw_4k"]) if "msg_per_s" in p]
    if bw:
        best = max(bw, key=lambda p: p["GBps"])
        res["floor_GBps"], res["floor_cpu_s_per_GB"] = best["GBps"], best["cpu_s_per_GB"]
        for r in res["requests"]:
            r["x_perftest"] = round(r["read"]["GBps"] / best["GBps"], 3)
            if "GBps" in pt["get_1m"]:
                r["x_perftest_1MiB"] = round(r["read"]["GBps"] / pt["get_1m"]["GBps"], 3)
            r["cpu_over_perftest"] = round(sum(r["daemon_cpu_s_per_GB"]) / best["cpu_s_per_GB"], 3)
    if "p50_us" in pt["am_lat_4k"]:
        res["round_trip_us"] = round(2 * pt["am_lat_4k"]["p50_us"], 2)   # perftest's latency is half a round trip
    if rate:
        res["floor_msg_per_s"] = max(p["msg_per_s"] for p in rate)
    print("ucx_perftest on the same link:")
    for k, v in pt.items():
        print("  %-9s %s" % (k, "%.3f GB/s, %.0f msg/s, %.2f CPU-s/GB, p50 %.1f µs" % (
            v["GBps"], v["msg_per_s"], v["cpu_s_per_GB"], v["p50_us"]) if "GBps" in v else v["error"]))
    for r in res["requests"]:
        if "x_perftest" in r:
            print("  %6d tokens: %.2fx perftest's bandwidth at the block size (%.2fx at 1 MiB), the daemons' CPU "
                  "%.2fx perftest's" % (r["tokens"], r["x_perftest"], r.get("x_perftest_1MiB", 0), r["cpu_over_perftest"]))
    if "staging" in res:
        st = res["staging"]
        print("staging floor (pinned copies of %d MiB): device->host %.1f GB/s, host->device %.1f GB/s" % (
            st["bytes"] >> 20, st["d2h_GBps"], st["h2d_GBps"]))
        for r in res["requests"]:
            r["x_staging"] = round(r["read"]["GBps"] / min(st["d2h_GBps"], st["h2d_GBps"]), 3)
    if "small" in res:
        print_small(res["small"], "UCX round trip", res.get("round_trip_us"), res.get("floor_msg_per_s"))
    return res


def staging_floor(mem: Any, nbytes: int) -> Dict[str, Any]:
    """The copies a GPU read across nodes stages through: device to pinned host memory
    and back, of the largest request's bytes (at most 1 GiB), the median of 5 each."""
    t = mem.torch
    n = min(nbytes, 1 << 30)
    host = t.empty(n, dtype=t.uint8, pin_memory=True)
    dev = t.empty(n, dtype=t.uint8, device=mem.dev)
    out: Dict[str, Any] = {"bytes": n}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        ts = []
        for _ in range(6):
            t.cuda.synchronize(mem.dev)
            t0 = now()
            dst.copy_(src, non_blocking=True)
            t.cuda.synchronize(mem.dev)
            ts.append(now() - t0)
        out[name + "_GBps"] = round(n / statistics.median(ts[1:]) / 1e9, 2)
    return out


def machine(device: str) -> str:
    """A line naming this machine: CPU model and cores, and the GPU with --device cuda."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    out = "%s, %d cores" % (cpu, os.cpu_count() or 0)
    if device == "cuda":
        import torch
        out = "%s; %s" % (torch.cuda.get_device_name(0), out)
    return out


def parse(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--bin", default=os.environ.get("CUDAIPC_BIN") or shutil.which("cudaipc"),
                    help="the cudaipc binary (default: $CUDAIPC_BIN, else cudaipc on PATH)")
    ap.add_argument("--device", choices=["host", "cuda"], default="host", help="host memory, or GPU 0's (torch)")
    ap.add_argument("--tokens", default="128,1024,8192,32768", help="request sizes in tokens (default %(default)s)")
    ap.add_argument("--reads", type=int, default=20, help="timed reads a size, after the warm-up (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed reads a size first (default %(default)s)")
    ap.add_argument("--loop-reads", type=int, default=5, help="timed per-block copy loops a size (default %(default)s)")
    ap.add_argument("--space-factor", type=float, default=2.0,
                    help="blocks in each space, times the largest request's (default %(default)s)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--small-count", type=int, default=1000, help="4 KiB reads in (c) and (d); 0: none (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--one-node", action=argparse.BooleanOptionalAction, default=True, help="run (a) (default: yes)")
    ap.add_argument("--cold-reader", action="store_true",
                    help="(a): no untimed read of every block first, so that reads pay each source page's first "
                         "touch, which the floor's populated mapping does not")
    ap.add_argument("--cross-node", action="store_true", help="run (b)-(d) across two daemons of a cluster")
    ap.add_argument("--etcd", help="the etcd binary for --cross-node (default: etcd on PATH)")
    ap.add_argument("--ucx-perftest", help="the ucx_perftest binary (default: on PATH)")
    ap.add_argument("--perftest-iters", type=int, default=20000, help="ucx_perftest iterations (default %(default)s)")
    ap.add_argument("--pin", action="store_true", help="--cross-node: each node's processes on its own half of the CPUs")
    ap.add_argument("--machine", help="the machine's description in the JSON (default: CPU model and cores, GPU)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    ap.add_argument("--read-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    ap.add_argument("--start-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.engine:
        return a
    if not a.bin:
        ap.error("no cudaipc binary: --bin PATH, $CUDAIPC_BIN, or cudaipc on PATH")
    a.tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    if not a.tokens or min(a.tokens) <= 0 or a.reads < 1 or a.warmup < 0 or a.loop_reads < 1 or a.small_count < 0:
        ap.error("--tokens must be positive, --reads and --loop-reads at least 1, --warmup and --small-count not negative")
    a.loop_reads = min(a.loop_reads, a.reads)
    return a


def main(argv: List[str]) -> int:
    a = parse(argv)
    if a.engine:
        engine_main(json.loads(a.engine))
        return 0
    shape = Shape(a.layers, a.block_tokens, a.kv_heads, a.head_dim)
    n_max = max(shape.blocks_of(t) for t in a.tokens)
    blocks = max(int(n_max * a.space_factor), n_max + 1)
    if a.device == "host":
        need, have = host_bytes_needed(a, shape, blocks), mem_available()
        if need > 0.85 * have:
            print("kv_transfer: two spaces of %d blocks need %.1f GiB of host memory; %.1f GiB is available: "
                  "fewer --tokens or a smaller --space-factor" % (blocks, need / (1 << 30), have / (1 << 30)), file=sys.stderr)
            return 2
    out: Dict[str, Any] = {"machine": a.machine or machine(a.device), "device": a.device, "shape": shape.as_dict(),
                           "space_blocks": blocks, "reads": a.reads, "warmup": a.warmup, "loop_reads": a.loop_reads,
                           "cold_reader": a.cold_reader,
                           "command": " ".join(["python3", "scripts/bench/kv_transfer.py"] + argv)}
    print("KV block reads: %d layers, K and V blocks of %d bytes (%d tokens x %d heads x %d dims x 2 bytes), vLLM's layout, "
          "spaces of %d blocks, %d reads a size after %d; %s" % (
              shape.layers, shape.block_bytes, shape.block_tokens, shape.kv_heads, shape.head_dim, blocks,
              a.reads, a.warmup, out["machine"]), flush=True)
    bad = 0
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        if a.one_node:
            out["one_node"] = one_node(a, shape, tmp, blocks)
            bad += count_bad(out["one_node"])
        if a.cross_node:
            out["cross_node"] = cross_node(a, shape, tmp, blocks)
            bad += count_bad(out["cross_node"])
    out["bad"] = bad
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    if bad:
        print("kv_transfer: %d operations left wrong bytes" % bad, file=sys.stderr)
        return 1
    return 0


def count_bad(part: Dict[str, Any]) -> int:
    n = sum(c["bad_ops"] for r in part.get("requests", []) for c in r["checked"].values())
    s = part.get("small", {})
    return n + sum(s[k]["bad_reads"] for k in ("sequential", "concurrent") if k in s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
