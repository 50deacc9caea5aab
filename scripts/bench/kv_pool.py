#!/usr/bin/env python3
"""KV block pool benchmark: lookups of 10^4 keys, and puts and gets of a prompt's
prefix through a pool of the daemon's host memory (cudaipc.kv pools, docs/kv.md
"Block pools"), against the memcpy floor of the same bytes and against Redis, in one
run.

Shapes are Llama-3-8B's KV cache in vLLM's layout: 32 layers, a tensor a layer of
[2, num_blocks, 16, 8, 128] bf16 (K blocks, then V blocks): 32 KiB a block a part. A
pool block is one KV block of all layers (2 MiB: the 64 pieces of a 16-token block,
layer by layer, K then V), what an engine loads before the forward pass; a prefix
of 1k, 8k or 32k tokens is 64, 512 or 2,048 keys. The engine's space (host memory
from kv.alloc_host, registered) and the destination (the same kind of memory, not
registered) hold --space-factor times the largest prefix's blocks; every operation
reads and writes blocks at scattered ids.

Lookups (one pool of 10^4 keys; a lookup reads keys, not blocks, so its blocks are
256 bytes): --lookup-keys keys in one call, all present (hit), none (miss) and the
first half (half), as a prefix lookup (pool.lookup) and a per-key one
(pool.present); keys as a 2-D uint8 NumPy array, and (hit) as a list of bytes.
p50 and p99 of --lookups calls each, interleaved.

Puts and gets, per prefix size, --reps repetitions after --warmup, interleaved:
  memcpy   the floor: the prefix's bytes copied from the engine's memory to the
           destination's in one process, a contiguous run a layer and part (64 runs),
           on one thread and on --threads threads: the faster of the two
  pieces   the same 32 KiB pieces the put and the get copy, src block ids to dst
           block ids, one ctypes.memmove each (one thread): the floor of a scattered
           copy from Python, its per-call cost included
  put      pool.put(keys, space, ids): the daemon copies the blocks from the space
  get      pool.get(keys, dst, dst_ids).wait(): this process copies them out of its
           read-only mapping of the pool, layer by layer
  mset     Redis MSET of the same blocks, --redis-batch blocks a command, pipelined:
           each value sent straight from the space's pieces (sendmsg of their
           buffers, no copy in the client)
  mget     Redis MGET of them into the destination's pieces (recv_into each piece)
Ratios are of medians: op / memcpy ("x floor"), Redis / cudaipc. Redis runs for
--redis-tokens (the 32k-token prefix would hold 4 GiB more): a private redis-server
on a Unix socket in a temporary directory, no TCP port, no persistence.

Every get's and MGET's blocks are checked after the timing against checksums of the
engine's (a wrapping 64-bit sum of each block's words, a layer a part a block); each
operation of a run reads other source blocks than the operation before it at every
destination position, so a block an operation did not write fails the check. The run
fails when any check does. Across two daemons: pending until a pool spans the nodes
of a cluster (the report says so).

    python3 scripts/bench/kv_pool.py --bin path/to/cudaipc [--json out.json]

Host memory: the engine's space and the destination, each of --space-factor times the
largest prefix, the pool of the largest prefix, and Redis's copy of the largest
--redis-tokens prefix: 13 GiB with the defaults; sizes that do not fit in the memory
available are left out, and the report says so.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

import numpy as np  # noqa: E402

import cudaipc  # noqa: E402
from cudaipc import kv  # noqa: E402

KEY_BYTES = 32
LOOKUP_BLOCK = 256
CROSS_NODE_PENDING = ("pending: a pool serves the clients of its own daemon; lookups and gets across two "
                      "daemons come with pools that span a cluster's nodes")


def now() -> float:
    return time.perf_counter()


def pct(xs: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile of xs."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(math.ceil(q / 100 * len(s))) - 1))]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Shape:
    """A model's KV cache: layers, and a block of block_tokens tokens of kv_heads x
    head_dim 2-byte elements a part (K and V)."""

    def __init__(self, layers: int, block_tokens: int, kv_heads: int, head_dim: int):
        self.layers, self.block_tokens, self.kv_heads, self.head_dim = layers, block_tokens, kv_heads, head_dim
        self.part_bytes = block_tokens * kv_heads * head_dim * 2
        self.block_bytes = 2 * layers * self.part_bytes   # a pool block: every layer's K and V
        if self.part_bytes % 8:
            raise SystemExit("a part of %d bytes: the checksums want a multiple of 8" % self.part_bytes)

    def blocks_of(self, tokens: int) -> int:
        return (tokens + self.block_tokens - 1) // self.block_tokens

    def as_dict(self) -> Dict[str, int]:
        return {"layers": self.layers, "block_tokens": self.block_tokens, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype_bytes": 2, "part_bytes": self.part_bytes,
                "pool_block_bytes": self.block_bytes}


# -- the engine's space and the destination --------------------------------------------

class HostSpace:
    """Per-layer [2, blocks, part_bytes / 8] uint64 arrays in memfd memory (kv.alloc_host),
    vLLM's layout: part p of block b of layer l is tensors[l][p, b]."""

    def __init__(self, shape: Shape, blocks: int):
        self.shape, self.blocks = shape, blocks
        self.tensors = [kv.alloc_host((2, blocks, shape.part_bytes // 8), "uint64") for _ in range(shape.layers)]
        self.local = kv.vllm_layout(self.tensors)
        self.addrs = [int(t.ctypes.data) for t in self.tensors]

    def fill(self, rng: np.random.Generator) -> None:
        for t in self.tensors:
            flat = t.reshape(-1)
            step = 1 << 24
            for i in range(0, len(flat), step):
                k = min(step, len(flat) - i)
                flat[i:i + k] = rng.integers(0, 1 << 64, size=k, dtype=np.uint64, endpoint=False)

    def sums(self, ids: Any) -> Any:
        """(layers, 2, len(ids)) wrapping sums of the words of blocks ids."""
        idx = np.asarray(ids, dtype=np.intp)
        return np.stack([t[:, idx].sum(axis=2, dtype=np.uint64) for t in self.tensors])

    def piece(self, layer: int, part: int, block: int) -> int:
        """The address of part of block of layer."""
        return self.addrs[layer] + (part * self.blocks + block) * self.shape.part_bytes

    def views(self, block: int) -> List[memoryview]:
        """Block's pieces as buffers, layer by layer, K then V: a pool block's bytes."""
        return [memoryview(t[p, block]).cast("B") for t in self.tensors for p in (0, 1)]


def memcpy_floor(src: HostSpace, dst: HostSpace, n: int, threads: int) -> float:
    """Seconds to copy the first n blocks of every layer and part from src to dst (a
    contiguous run each), on threads threads."""
    jobs = [(t_src[p, :n], t_dst[p, :n]) for t_src, t_dst in zip(src.tensors, dst.tensors) for p in (0, 1)]
    if threads <= 1:
        t0 = now()
        for s, d in jobs:
            d[...] = s
        return now() - t0

    def work(part: Sequence[Tuple[Any, Any]]) -> None:
        for s, d in part:
            np.copyto(d, s)

    # Split into equal byte ranges, not whole runs, so that every thread copies alike.
    flat = [(s.reshape(-1), d.reshape(-1)) for s, d in jobs]
    total = sum(len(s) for s, _ in flat)
    per = (total + threads - 1) // threads
    parts: List[List[Tuple[Any, Any]]] = [[] for _ in range(threads)]
    w, room = 0, per
    for s, d in flat:
        i = 0
        while i < len(s):
            k = min(room, len(s) - i)
            parts[w].append((s[i:i + k], d[i:i + k]))
            i += k
            room -= k
            if room == 0 and w + 1 < threads:
                w, room = w + 1, per
    ths = [threading.Thread(target=work, args=(p,)) for p in parts]
    t0 = now()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return now() - t0


def pieces_floor(src: HostSpace, dst: HostSpace, src_ids: Sequence[int], dst_ids: Sequence[int]) -> float:
    """Seconds to copy every piece of src's blocks src_ids into dst's blocks dst_ids,
    one memmove a piece."""
    mm = ctypes.memmove
    nb = src.shape.part_bytes
    jobs = []
    for layer in range(src.shape.layers):
        for p in (0, 1):
            sb, db = src.piece(layer, p, 0), dst.piece(layer, p, 0)
            jobs.append([(db + d * nb, sb + s * nb) for s, d in zip(src_ids, dst_ids)])
    t0 = now()
    for job in jobs:
        for d, s in job:
            mm(d, s, nb)
    return now() - t0


# -- Redis, spoken over its Unix socket ------------------------------------------------------

class RedisError(RuntimeError):
    pass


class Redis:
    """A private redis-server on a Unix socket in tmp, and one connection to it that
    speaks RESP: MSET from a space's pieces, MGET into them."""

    def __init__(self, binary: str, tmp: str, timeout: float = 30):
        self.path = os.path.join(tmp, "redis.sock")
        self.log = open(os.path.join(tmp, "redis.log"), "w+")
        self.proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", self.path, "--unixsocketperm", "700",
                                      "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", tmp,
                                      "--client-query-buffer-limit", "2gb", "--proto-max-bulk-len", "1gb"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(self.path)
                break
            except OSError:
                self.sock.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise RuntimeError("redis-server did not start: %s" % self.log.read()[-2000:])
                time.sleep(0.02)
        self.buf = bytearray()
        self.version = self.info_field("redis_version")

    def stop(self) -> None:
        try:
            self.sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.log.close()

    # RESP
    @staticmethod
    def bulk_header(n: int) -> bytes:
        return b"$%d\r\n" % n

    def send(self, bufs: List[Any]) -> None:
        """Send every buffer, in order (sendmsg, at most 1024 at a time)."""
        i = 0
        views = [memoryview(b) for b in bufs]
        while i < len(views):
            sent = self.sock.sendmsg(views[i:i + 1024])
            while sent > 0:
                if sent >= len(views[i]):
                    sent -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    def command(self, *args: bytes) -> List[bytes]:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            out += [self.bulk_header(len(a)), a, b"\r\n"]
        return out

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise RedisError("redis-server closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return out
            self._fill()

    def read_into(self, view: memoryview) -> None:
        """Fill view from the connection: buffered bytes first, then recv_into."""
        n = min(len(self.buf), len(view))
        if n:
            view[:n] = self.buf[:n]
            del self.buf[:n]
        while n < len(view):
            got = self.sock.recv_into(view[n:], len(view) - n)
            if not got:
                raise RedisError("redis-server closed the connection")
            n += got

    def reply(self) -> Any:
        """One reply, values as bytes (small replies only)."""
        head = self.line()
        kind, rest = head[:1], head[1:]
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind in (b"+", b":"):
            return rest
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            v = bytearray(n + 2)
            self.read_into(memoryview(v))
            return bytes(v[:n])
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        raise RedisError("unexpected reply %r" % head[:64])

    def call(self, *args: bytes) -> Any:
        self.send(self.command(*args))
        return self.reply()

    def info_field(self, field: str) -> str:
        for line in self.call(b"INFO", b"server").decode().splitlines():
            if line.startswith(field + ":"):
                return str(line.split(":", 1)[1].strip())
        return ""

    def mset(self, keys: Sequence[bytes], values: Sequence[List[memoryview]], batch: int) -> None:
        """MSET keys[i] to the concatenation of values[i]'s buffers, batch keys a
        command, every command sent before the first reply is read."""
        size = sum(len(v) for v in values[0])
        head = self.bulk_header(size)
        cmds = 0
        for i in range(0, len(keys), batch):
            ks = keys[i:i + batch]
            bufs: List[Any] = [b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * len(ks))]
            for k, v in zip(ks, values[i:i + batch]):
                bufs += [self.bulk_header(len(k)), k, b"\r\n", head]
                bufs += v
                bufs.append(b"\r\n")
            self.send(bufs)
            cmds += 1
        for _ in range(cmds):
            r = self.reply()
            if r != b"OK":
                raise RedisError("MSET answered %r" % r)

    def mget(self, keys: Sequence[bytes], dests: Sequence[List[memoryview]], batch: int) -> None:
        """MGET keys into dests[i]'s buffers (a value must fill them exactly), batch
        keys a command, one command ahead of the reply being read."""
        chunks = [range(i, min(i + batch, len(keys))) for i in range(0, len(keys), batch)]

        def send(c: range) -> None:
            self.send(self.command(b"MGET", *[keys[j] for j in c]))

        if chunks:
            send(chunks[0])
        for ci, c in enumerate(chunks):
            if ci + 1 < len(chunks):
                send(chunks[ci + 1])
            head = self.line()
            if head != b"*%d" % len(c):
                raise RedisError("MGET answered %r" % head[:64])
            for j in c:
                want = sum(len(v) for v in dests[j])
                h = self.line()
                if h != b"$%d" % want:
                    raise RedisError("MGET: key %d's value is %r, want %d bytes" % (j, h[:32], want))
                for v in dests[j]:
                    self.read_into(v)
                crlf = bytearray(2)
                self.read_into(memoryview(crlf))


# -- the daemon ------------------------------------------------------------------------------

class Daemon:
    """A `cudaipc serve` of host memory on a socket in tmp."""

    def __init__(self, binary: str, tmp: str, capacity: int, timeout: float = 30):
        self.socket = os.path.join(tmp, "store.sock")
        self.log = open(os.path.join(tmp, "daemon.log"), "w+")
        self.proc = subprocess.Popen([binary, "serve", "--socket", self.socket, "--backend", "host",
                                      "--capacity", str(capacity), "--log-level", "warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError("cudaipc serve did not start: %s" % self.log.read()[-2000:])
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- the parts -------------------------------------------------------------------------------

def lookups(store: Any, a: argparse.Namespace, rng: np.random.Generator) -> Dict[str, Any]:
    """Lookups of a.lookup_keys keys: hit, miss, half; prefix and per key."""
    n = a.lookup_keys
    arr = kv.alloc_host((n, LOOKUP_BLOCK))
    space = kv.register(store, "bench/lookup-space", kv.Local(kv.Layout(n, [[kv.Part(0, 0, LOOKUP_BLOCK, LOOKUP_BLOCK)]]), [arr]))
    pool = kv.create_pool(store, "bench/lookup", LOOKUP_BLOCK, n * LOOKUP_BLOCK)
    try:
        keys = rng.integers(0, 256, size=(2 * n, KEY_BYTES), dtype=np.uint8)
        r = pool.put(keys[:n], space, list(range(n)))
        if r.stored != n:
            raise RuntimeError("the lookup pool stored %d of %d keys" % (r.stored, n))
        sets = {"hit": (keys[:n], n), "miss": (keys[n:], 0), "half": (keys[n // 2:n // 2 + n], n // 2)}
        hit_list = [bytes(k) for k in keys[:n]]
        cases: List[Tuple[str, Any]] = []
        for name, (ks, want) in sets.items():
            cases.append((name, lambda ks=ks, want=want: pool.lookup(ks)[0] == want))
            cases.append((name + "_per_key", lambda ks=ks, want=want: pool.present(ks).count == want))
        cases.append(("hit_list", lambda: pool.lookup(hit_list)[0] == n))
        times: Dict[str, List[float]] = {c: [] for c, _ in cases}
        for i in range(a.lookup_warmup + a.lookups):
            for name, f in cases:
                t0 = now()
                ok = f()
                dt = now() - t0
                if not ok:
                    raise RuntimeError("lookup %s: a wrong answer" % name)
                if i >= a.lookup_warmup:
                    times[name].append(dt)
        out: Dict[str, Any] = {"keys": n, "key_bytes": KEY_BYTES, "calls": a.lookups, "keys_as": "a 2-D uint8 NumPy array (hit_list: a list of bytes)"}
        for name, ts in times.items():
            out[name] = {"p50_us": pct(ts, 50) * 1e6, "p99_us": pct(ts, 99) * 1e6, "n": len(ts)}
        return out
    finally:
        pool.close()
        kv.delete_pool(store, "bench/lookup")
        space.close()


class Checker:
    """Checks destination blocks against the engine's checksums."""

    def __init__(self, src: HostSpace, dst: HostSpace):
        self.src, self.dst = src, dst
        self.want = src.sums(np.arange(src.blocks))
        self.ops = 0
        self.bad = 0

    def check(self, what: str, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        got = self.dst.sums(dst_ids)
        bad = int(np.count_nonzero((got != self.want[:, :, np.asarray(src_ids)]).any(axis=(0, 1))))
        self.ops += 1
        if bad:
            self.bad += 1
            print("CHECK FAILED: %s: %d of %d blocks wrong" % (what, bad, len(dst_ids)), file=sys.stderr)
        return bad


def run_size(tokens: int, a: argparse.Namespace, shape: Shape, src: HostSpace, dst: HostSpace, space: Any,
             pool: Any, redis: Optional[Redis], checker: Checker, rng: np.random.Generator,
             perm: Any, dperm: Any) -> Dict[str, Any]:
    """One prefix size: every op a.warmup + a.reps times, interleaved."""
    n = shape.blocks_of(tokens)
    total = n * shape.block_bytes
    N = src.blocks
    dst_ids = [int(x) for x in dperm[:n]]
    ops = ["memcpy_1", "memcpy_n", "pieces", "put", "get"] + (["mset", "mget"] if redis else [])
    times: Dict[str, List[float]] = {o: [] for o in ops}
    checked: Dict[str, Dict[str, int]] = {o: {"ops": 0, "bad_ops": 0} for o in ("get", "mget", "pieces")}
    offset = 0

    def ids_at(off: int) -> List[int]:
        """Source ids of an op: the permutation rotated by off, so that two ops of other
        offsets read other blocks at every position."""
        return [int(perm[(i + off) % N]) for i in range(n)]

    def record(op: str, dt: float, rep: int) -> None:
        if rep >= a.warmup:
            times[op].append(dt)

    def verify(op: str, src_ids: Sequence[int]) -> None:
        checked[op]["ops"] += 1
        if checker.check("%d tokens, %s" % (tokens, op), src_ids, dst_ids):
            checked[op]["bad_ops"] += 1

    for rep in range(a.warmup + a.reps):
        record("memcpy_1", memcpy_floor(src, dst, n, 1), rep)
        record("memcpy_n", memcpy_floor(src, dst, n, a.threads), rep)

        offset += 1
        ids = ids_at(offset)
        record("pieces", pieces_floor(src, dst, ids, dst_ids), rep)
        verify("pieces", ids)

        offset += 1
        ids = ids_at(offset)
        keys = [bytes(k) for k in rng.integers(0, 256, size=(n, KEY_BYTES), dtype=np.uint8)]
        t0 = now()
        r = pool.put(keys, space, ids)
        record("put", now() - t0, rep)
        if r.stored != n:
            raise RuntimeError("%d tokens: the put stored %d of %d blocks (%d present, %d no room)" % (tokens, r.stored, n, r.existed, r.full))
        t0 = now()
        pool.get(keys, dst.local, dst_ids).wait(timeout=600)
        record("get", now() - t0, rep)
        verify("get", ids)
        pool.delete(keys)

        if redis:
            offset += 1
            ids = ids_at(offset)
            rkeys = [bytes(k) for k in rng.integers(0, 256, size=(n, KEY_BYTES), dtype=np.uint8)]
            values = [src.views(b) for b in ids]
            t0 = now()
            redis.mset(rkeys, values, a.redis_batch)
            record("mset", now() - t0, rep)
            dests = [dst.views(b) for b in dst_ids]
            t0 = now()
            redis.mget(rkeys, dests, a.redis_batch)
            record("mget", now() - t0, rep)
            verify("mget", ids)
            redis.call(b"FLUSHALL", b"SYNC")

    def stat(ts: List[float]) -> Dict[str, float]:
        p50 = statistics.median(ts)
        return {"p50_ms": p50 * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3, "GBps": total / p50 / 1e9, "n": len(ts)}

    out: Dict[str, Any] = {"tokens": tokens, "blocks": n, "bytes": total, "pieces": n * 2 * shape.layers}
    for o in ops:
        out[o] = stat(times[o])
    floor = min(out["memcpy_1"]["p50_ms"], out["memcpy_n"]["p50_ms"])
    out["memcpy"] = {"p50_ms": floor, "GBps": total / floor / 1e6, "threads": 1 if out["memcpy_1"]["p50_ms"] <= out["memcpy_n"]["p50_ms"] else a.threads}
    for o in ("put", "get", "pieces", "mset", "mget"):
        if o in out:
            out[o]["x_floor"] = out[o]["p50_ms"] / floor
    if redis:
        out["mset_over_put"] = out["mset"]["p50_ms"] / out["put"]["p50_ms"]
        out["mget_over_get"] = out["mget"]["p50_ms"] / out["get"]["p50_ms"]
    out["checked"] = checked
    return out


# -- the run ---------------------------------------------------------------------------------

def build_binary(tmp: str) -> str:
    out = os.path.join(tmp, "cudaipc")
    subprocess.run(["go", "build", "-o", out, "./cmd/cudaipc"], cwd=REPO, check=True)
    return out


def table(res: Dict[str, Any]) -> str:
    lines = []
    lk = res["lookup"]
    lines.append("Lookups of %d keys in one call (p50 / p99, µs; %d calls each):" % (lk["keys"], lk["calls"]))
    lines.append("  %-6s %22s %22s" % ("keys", "prefix (lookup)", "per key (present)"))
    for c in ("hit", "miss", "half"):
        lines.append("  %-6s %22s %22s" % (c, "%.0f / %.0f" % (lk[c]["p50_us"], lk[c]["p99_us"]),
                                           "%.0f / %.0f" % (lk[c + "_per_key"]["p50_us"], lk[c + "_per_key"]["p99_us"])))
    lines.append("  hit, keys as a list of bytes: %.0f / %.0f" % (lk["hit_list"]["p50_us"], lk["hit_list"]["p99_us"]))
    lines.append("  across two daemons: %s" % res["cross_node"])
    lines.append("")
    lines.append("Put and get of a prefix through the host tier (p50 ms; x the memcpy floor of the same bytes):")
    hdr = "  %-7s %9s %10s %16s %16s %12s %16s %16s %8s %8s"
    lines.append(hdr % ("tokens", "MiB", "memcpy", "put", "get", "pieces", "Redis MSET", "Redis MGET", "MSET/put", "MGET/get"))
    for r in res["sizes"]:
        def cell(o: str) -> str:
            return "%.1f (%.2fx)" % (r[o]["p50_ms"], r[o]["x_floor"]) if o in r else "-"
        lines.append(hdr % (r["tokens"], "%.0f" % (r["bytes"] / (1 << 20)), "%.1f" % r["memcpy"]["p50_ms"], cell("put"), cell("get"),
                            "%.1f" % r["pieces"]["p50_ms"], cell("mset"), cell("mget"),
                            "%.2fx" % r["mset_over_put"] if "mset_over_put" in r else "-",
                            "%.2fx" % r["mget_over_get"] if "mget_over_get" in r else "-"))
    for s in res.get("skipped", []):
        lines.append("  %s" % s)
    lines.append("checked: %d operations, %d with a wrong block" % (res["checked_ops"], res["bad"]))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--bin", help="the cudaipc binary (default: go build it)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", default="1024,8192,32768", help="prefix sizes, comma-separated")
    ap.add_argument("--redis-tokens", default="1024,8192", help="the sizes also run through Redis ('' none)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--space-factor", type=float, default=1.0, help="space blocks / the largest prefix's blocks")
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8), help="the multi-threaded memcpy floor's threads")
    ap.add_argument("--lookup-keys", type=int, default=10000)
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--lookup-warmup", type=int, default=10)
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or "", help="'' runs no Redis")
    ap.add_argument("--redis-batch", type=int, default=32, help="blocks a MSET or MGET command")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)

    shape = Shape(a.layers, a.block_tokens, a.kv_heads, a.head_dim)
    sizes = sorted({int(t) for t in a.tokens.split(",") if t})
    redis_sizes = {int(t) for t in a.redis_tokens.split(",") if t} if a.redis_server else set()
    skipped: List[str] = []
    # What fits: the two spaces and the pool of the largest prefix, Redis's copy of
    # the largest prefix it runs (its buffers of two commands beside), with a margin.
    avail = mem_available()
    while sizes:
        big = shape.blocks_of(sizes[-1])
        N = max(math.ceil(big * a.space_factor), big + 3 * (a.warmup + a.reps) + 1)
        rbig = max([shape.blocks_of(t) for t in redis_sizes if t <= sizes[-1]] or [0])
        need = (2 * N + big + rbig + 2 * a.redis_batch) * shape.block_bytes + (256 << 20)
        if need <= 0.85 * avail:
            break
        skipped.append("%d tokens: left out, the run would need %.1f GiB and %.1f GiB is available" % (sizes[-1], need / (1 << 30), avail / (1 << 30)))
        sizes.pop()
    if not sizes:
        print("\n".join(skipped), file=sys.stderr)
        return 1
    big = shape.blocks_of(sizes[-1])
    N = max(math.ceil(big * a.space_factor), big + 3 * (a.warmup + a.reps) + 1)

    tmp = tempfile.mkdtemp(prefix="cudaipc-kvpool-")
    daemon = None
    redis = None
    try:
        binary = a.bin or build_binary(tmp)
        slot = (shape.block_bytes + 255) // 256 * 256
        capacity = big * slot + a.lookup_keys * LOOKUP_BLOCK + (64 << 20)
        daemon = Daemon(binary, tmp, capacity)
        store = cudaipc.connect(daemon.socket)
        rng = np.random.default_rng([a.seed, 35])
        print("filling %d blocks of %.1f MiB (%s), two spaces..." % (N, shape.block_bytes / (1 << 20), shape.as_dict()), file=sys.stderr)
        src = HostSpace(shape, N)
        src.fill(rng)
        dst = HostSpace(shape, N)
        checker = Checker(src, dst)
        space = kv.register(store, "bench/engine/kv", src.local)
        pool = kv.create_pool(store, "bench/prefix", kv.block_bytes(space.desc), big * slot)
        if kv.block_bytes(space.desc) != shape.block_bytes:
            raise RuntimeError("the space's blocks are %d bytes, want %d" % (kv.block_bytes(space.desc), shape.block_bytes))
        if redis_sizes:
            redis = Redis(a.redis_server, tmp)
        perm = rng.permutation(N)
        dperm = rng.permutation(N)

        res: Dict[str, Any] = {
            "benchmark": "kv_pool", "shape": shape.as_dict(), "device": "host",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "numpy": np.__version__, "loadavg": os.getloadavg()},
            "args": {k: v for k, v in vars(a).items() if k not in ("json", "bin")},
            "redis": {"version": redis.version, "batch": a.redis_batch, "transport": "unix socket"} if redis else None,
        }
        print("lookups...", file=sys.stderr)
        res["lookup"] = lookups(store, a, rng)
        res["cross_node"] = CROSS_NODE_PENDING
        res["sizes"] = []
        for t in sizes:
            print("%d tokens..." % t, file=sys.stderr)
            res["sizes"].append(run_size(t, a, shape, src, dst, space, pool, redis if t in redis_sizes else None,
                                         checker, rng, perm, dperm))
        res["skipped"] = skipped
        res["checked_ops"], res["bad"] = checker.ops, checker.bad
        res["machine"]["loadavg_end"] = os.getloadavg()
        print(table(res))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
                f.write("\n")
        pool.close()
        space.close()
        store.close()
        return 1 if checker.bad else 0
    finally:
        if redis:
            redis.stop()
        if daemon:
            daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
