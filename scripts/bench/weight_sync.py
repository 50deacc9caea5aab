#!/usr/bin/env python3
"""Weight-sync benchmark: trainer -> inference engine on one node (issue 10).

A producer process holds a synthetic state dict with real model shapes and publishes
version after version; a consumer process loads each version into its own parameters.
Measured per version: publish -> loaded, from the moment the producer starts to
publish (its new weights are in its memory) until the consumer's copies are complete
(CLOCK_MONOTONIC, shared by both processes). Side by side, in the same run:

  cudaipc        the producer writes the new version in place (create_bundle views),
                 seals it; the consumer wait_newer's it and load_into's its params
  cudaipc-put    the producer's weights are its own tensors: put_bundle copies them
                 into the new version, seals; the consumer as above
  cudaipc-nocopy the producer's own tensors without a copy: put_bundle(copy=False)
                 publishes a version that points into them (one region per CUDA
                 allocation); before changing them the producer waits until the
                 consumer released the last version (wait_released); the consumer
                 as above, copying straight from the producer's memory. Reported
                 beside: the reader's driver opens per version (expected: the
                 producer's allocations on the first version, 0 afterwards)
  per-tensor     PyTorch's per-tensor IPC (reduce_tensor / rebuild_cuda_tensor, as
                 OpenRLHF and vLLM use it), one handle per tensor, then copy_
  bucketed       verl-style: one 2 GB IPC buffer shared once; the producer packs
                 tensors into it chunk by chunk, a socket handshake per chunk, the
                 consumer copies each chunk out
  nccl-bucketed  torch.distributed broadcast from the trainer (rank 0) to the engine
                 (rank 1), as verl and SGLang update weights over NCCL: tensors packed
                 into 1 GiB buckets, one broadcast per bucket, unpacked into the
                 engine's parameters (NCCL across two GPUs; gloo in --smoke)
  nccl-per-tensor the same, one broadcast per tensor (SGLang's
                 update_weights_from_distributed without buckets)
  floor          the same bytes copied device-to-device inside one process, tensor
                 by tensor (_foreach_copy_ on one GPU; copy_ per tensor across GPUs,
                 the peer-copy floor), and as one flat copy

Data is random on every version and checked on the consumer: an int64 checksum of
every tensor's bits against the producer's.

The first version is reported apart, broken down (consumer: publish -> lease, of
which opening arenas or regions with the driver; manifest parse; plan build;
copies; producer: create, of which the daemon's allocation and zeroing of a new
arena, and its mapping), beside the driver's own cost of allocating that memory,
measured alone in the floor process (cuMemAlloc of the same bytes, and the
cuMemsetD8 the daemon zeroes a new arena with).

    python3 scripts/bench/weight_sync.py --bin path/to/cudaipc --json out.json
    python3 scripts/bench/weight_sync.py --bin ... --producer-gpu 1 --consumer-gpu 0 --models dense

--cross-node runs the cross-node mode instead (trainer and engine on two daemons joined
as a cluster, against the link's floors and torch.distributed): weight_sync_cluster.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

BUCKET = 2 << 30
DIST_BUCKET = 1 << 30   # the torch.distributed paths' bucket (verl's and SGLang's order of size)
DIST_PATHS = ("nccl-bucketed", "nccl-per-tensor")


def dense_shapes() -> List[Tuple[str, Tuple[int, ...]]]:
    """Llama-3-8B: 32 layers, hidden 4096, MLP 14336, 32 heads / 8 KV heads of 128,
    vocabulary 128256: 291 tensors, 8.03 B parameters."""
    h, mlp, kv, vocab = 4096, 14336, 1024, 128256
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(32):
        p = "model.layers.%d." % i
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (mlp, h)), (p + "mlp.up_proj.weight", (mlp, h)),
                (p + "mlp.down_proj.weight", (h, mlp)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def moe_shapes() -> List[Tuple[str, Tuple[int, ...]]]:
    """Qwen3-30B-A3B's layout (48 layers, 128 experts of 3 matrices each, q/k norms,
    router; 18 867 tensors) with hidden 512 and expert MLP 192 instead of 2048 and
    768, so that it fits beside everything else: about 1.9 B parameters."""
    h, inter, experts, heads, kvh, hd, vocab = 512, 192, 128, 32, 4, 128, 151936 // 8
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(48):
        p = "model.layers.%d." % i
        out += [(p + "self_attn.q_proj.weight", (heads * hd // 4, h)), (p + "self_attn.k_proj.weight", (kvh * hd, h)),
                (p + "self_attn.v_proj.weight", (kvh * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd // 4)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate.weight", (experts, h))]
        for e in range(experts):
            q = p + "mlp.experts.%d." % e
            out += [(q + "gate_proj.weight", (inter, h)), (q + "up_proj.weight", (inter, h)), (q + "down_proj.weight", (h, inter))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def smoke_shapes() -> List[Tuple[str, Tuple[int, ...]]]:
    """A few small tensors, for --smoke (host memory, any machine)."""
    return [("a", (64, 32)), ("b", (7,)), ("c", (1000, 3))] + [("e.%d" % i, (5, 9)) for i in range(200)]


MODELS = {"dense": dense_shapes, "moe": moe_shapes, "smoke": smoke_shapes}


def device(i: int) -> Any:
    import torch
    return torch.device("cpu") if i < 0 else torch.device("cuda", i)


def sync(dev: Any) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- helpers used in the worker processes -------------------------------------------------

def alloc(shapes, device) -> Dict[str, Any]:
    import torch
    return {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes}


def randomize(tensors: Dict[str, Any]) -> None:
    import torch
    for t in tensors.values():
        t.view(torch.int16).random_(-32768, 32767)


def checksums(tensors: Dict[str, Any]) -> List[int]:
    """int64 sum of every tensor's bits (as int16), one list of ints per state dict."""
    import torch
    sums = [t.reshape(-1).view(torch.int16).sum() for t in tensors.values()]
    return torch.stack(sums).cpu().tolist() if sums else []


def nbytes(tensors: Dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def now() -> float:
    return time.perf_counter()   # CLOCK_MONOTONIC: comparable across processes


class Probe:
    """Time spent in some of cudaipc's functions (wrapped in place), per version:
    where a first version's time goes."""

    def __init__(self) -> None:
        self.t: Dict[str, float] = {}
        self.n: Dict[str, int] = {}

    def wrap(self, obj: Any, attr: str, key: str) -> None:
        f = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = now()
            try:
                return f(*a, **k)
            finally:
                self.t[key] = self.t.get(key, 0.0) + now() - t0
                self.n[key] = self.n.get(key, 0) + 1
        setattr(obj, attr, timed)

    def take(self) -> Dict[str, float]:
        out = dict(self.t)
        out.update({"n_" + k: float(v) for k, v in self.n.items()})
        self.t, self.n = {}, {}
        return out


def probe_cudaipc(store: Any) -> Probe:
    import cudaipc
    from cudaipc import _cuda, _plan, bundle, mapping
    p = Probe()
    p.wrap(_cuda, "ipc_open", "open")        # arenas (and legacy regions): cuIpcOpenMemHandle when new
    p.wrap(mapping, "map_region", "map")     # no-copy regions (legacy or VMM)
    p.wrap(bundle, "layout_of", "parse")     # the manifest, parsed once per distinct manifest
    p.wrap(_plan, "plan_for", "plan")        # the copy plan, built once per layout and tensors
    p.wrap(store, "create", "create")        # a put's create: the daemon allocates (and zeroes) a new arena
    return p


# -- producer ---------------------------------------------------------------------------

def producer(conn, cfg) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    import cudaipc
    from cudaipc import bundle as B
    dev = device(cfg["producer_gpu"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    where = cfg["producer_gpu"] if dev.type == "cuda" else "host"
    shapes = MODELS[cfg["model"]]()
    store = cudaipc.connect(cfg["socket"])
    probe = probe_cudaipc(store)
    params = None
    for path, versions in cfg["paths"]:
        name = "%s-%s" % (cfg["model"], path)
        if path == "cudaipc":
            params = None
        elif params is None:
            params = alloc(shapes, dev)
        if path == "bucketed":
            buf = torch.empty(BUCKET, dtype=torch.uint8, device=dev)
            conn.send(("bucket", reduce_tensor(buf)))
            conn.recv()
        for v in range(1, versions + 1):
            if path == "cudaipc-nocopy":
                # Readers copy straight from params: none may hold the last version
                # when they change.
                store.wait_released(name, 120)
            if path == "cudaipc":
                w = B.create_bundle(store, name, {n: (torch.bfloat16, s) for n, s in shapes}, where,
                                    publish=True, keep_last=1)
                src = w.tensors
            else:
                src = params
            randomize(src)
            sync(dev)
            sums = checksums(src)
            assert conn.recv() == "ready"
            probe.take()
            t0 = now()
            if path == "cudaipc":
                w.seal()
            elif path == "cudaipc-put":
                B.put_bundle(store, name, params, where, publish=True, keep_last=1)
            elif path == "cudaipc-nocopy":
                B.put_bundle(store, name, params, where, publish=True, keep_last=1, copy=False)
            elif path == "per-tensor":
                conn.send(("handles", [(n, reduce_tensor(t)) for n, t in params.items()]))
            elif path == "bucketed":
                meta, off = [], 0
                items = list(params.items())
                for i, (n, t) in enumerate(items):
                    k = t.numel() * t.element_size()
                    if off + k > BUCKET:
                        sync(dev)
                        conn.send(("chunk", meta, False))
                        assert conn.recv() == "ack"
                        meta, off = [], 0
                    buf[off:off + k].view(t.dtype).view(t.shape).copy_(t)
                    meta.append((n, off, k))
                    off = (off + k + 255) // 256 * 256
                sync(dev)
                conn.send(("chunk", meta, True))
            t_pub = now() - t0
            extra = probe.take()
            extra["publish"] = t_pub
            if path == "cudaipc-nocopy":
                from cudaipc import _nocopy
                pub = _nocopy._published.get((id(store), name))
                extra["allocations"] = float(len(pub.sources)) if pub is not None else -1.0
            conn.send(("sums", t0, sums, extra))
            assert conn.recv() == "done"
        if path in ("cudaipc", "cudaipc-put", "cudaipc-nocopy"):
            if path == "cudaipc-nocopy":
                store.wait_released(name, 120)
            store.rm(name)
        if path == "bucketed":
            del buf
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    conn.send("bye")


# -- consumer ---------------------------------------------------------------------------

def consumer(conn, cfg, results) -> None:
    import torch
    import cudaipc
    from cudaipc import bundle as B
    dev = device(cfg["consumer_gpu"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shapes = MODELS[cfg["model"]]()
    params = alloc(shapes, dev)
    store = cudaipc.connect(cfg["socket"])
    probe = probe_cudaipc(store)
    from cudaipc import _nocopy
    total = nbytes(params)
    for path, versions in cfg["paths"]:
        name = "%s-%s" % (cfg["model"], path)
        times, bad = [], 0
        firsts: Dict[str, Any] = {}
        opens: List[int] = []
        allocs = 0
        stages: Dict[str, List[float]] = {"get": [], "load": [], "copy": []}
        how = ""
        bucket = None
        if path == "bucketed":
            tag, h = conn.recv()
            fn, args = h
            bucket = fn(*args)
            conn.send("ok")
        seen = 0
        for v in range(1, versions + 1):
            conn.send("ready")
            probe.take()
            o0 = _nocopy.driver_opens()
            if path in ("cudaipc", "cudaipc-put", "cudaipc-nocopy"):
                b = B.get_bundle(store, name, timeout=120, newer_than=seen)
                tg = now()
                seen = b.version
                rep = B.load_into(b, params)
                t1 = now()
                b.release()
                del b
                stages["get"].append(tg)
                stages["load"].append(t1 - tg)
                stages["copy"].append(rep.seconds)
                how = "%s, %d copy calls, %d copies (merged) for %d tensors" % (
                    rep.method, rep.copy_calls, rep.copies, rep.tensors)
            elif path == "per-tensor":
                tag, handles = conn.recv()
                srcs = []
                for n, (fn, args) in handles:
                    t = fn(*args)
                    params[n].copy_(t, non_blocking=True)
                    srcs.append(t)
                sync(dev)
                t1 = now()
                del srcs, handles
            elif path == "bucketed":
                while True:
                    tag, meta, last = conn.recv()
                    for n, off, k in meta:
                        p = params[n]
                        p.copy_(bucket[off:off + k].view(p.dtype).view(p.shape), non_blocking=True)
                    sync(dev)
                    if last:
                        break
                    conn.send("ack")
                t1 = now()
            tag, t0, sums, extra = conn.recv()
            got = probe.take()
            if path == "cudaipc-nocopy":
                opens.append(_nocopy.driver_opens() - o0)
                allocs = int(extra.get("allocations", -1))
            if v == 1:
                firsts = {"consumer": got, "producer": extra}
            if checksums(params) != sums:
                bad += 1
            times.append(t1 - t0)
            if len(stages["get"]) == len(times):
                stages["get"][-1] -= t0   # publish -> the consumer holds the lease and its manifest
            conn.send("done")
        del bucket
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        r = {"model": cfg["model"], "path": path, "times": times, "bad_versions": bad,
             "versions": versions, "bytes": total, "tensors": len(params), "first": firsts}
        if opens:
            r["driver_opens"] = opens
            r["producer_allocations"] = allocs
        if stages["get"]:
            r["stages"] = stages
            r["how"] = how
        results.put(r)
    assert conn.recv() == "bye"


def dist_rank(rank: int, conn, cfg, results) -> None:
    """torch.distributed broadcast of the state dict from rank 0 (the trainer, on the
    producer GPU) to rank 1 (the engine, on the consumer GPU), for each of cfg's
    nccl-* paths: bucketed (packed into DIST_BUCKET buffers) and per tensor. NCCL
    between two GPUs; gloo on host memory (--smoke)."""
    import torch
    import torch.distributed as dist
    dev = device(cfg["producer_gpu"] if rank == 0 else cfg["consumer_gpu"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    os.environ.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % cfg["dist_port"], rank=rank, world_size=2)
    params = alloc(MODELS[cfg["model"]](), dev)
    flat = [t.reshape(-1).view(torch.uint8) for t in params.values()]
    buckets: List[List[Any]] = [[]]
    used = 0
    for t in flat:
        if buckets[-1] and used + t.numel() > DIST_BUCKET:
            buckets.append([])
            used = 0
        buckets[-1].append(t)
        used += t.numel()
    for path, versions in cfg["paths"]:
        if path not in DIST_PATHS:
            continue
        buf = None
        if path == "nccl-bucketed":
            buf = torch.empty(max(sum(t.numel() for t in b) for b in buckets), dtype=torch.uint8, device=dev)
        times, bad = [], 0
        for _ in range(versions):
            sums = None
            if rank == 0:
                randomize(params)
                sync(dev)
                sums = checksums(params)
            dist.barrier()
            t0 = now()
            if path == "nccl-per-tensor":
                for t in flat:   # the same bytes as uint8: gloo has no bfloat16
                    dist.broadcast(t, src=0)
            else:
                for b in buckets:
                    off = 0
                    if rank == 0:
                        for t in b:
                            buf[off:off + t.numel()].copy_(t, non_blocking=True)
                            off += t.numel()
                    dist.broadcast(buf[:sum(t.numel() for t in b)], src=0)
                    if rank == 1:
                        for t in b:
                            t.copy_(buf[off:off + t.numel()], non_blocking=True)
                            off += t.numel()
            sync(dev)
            if rank == 0:
                conn.send((t0, sums))
            else:
                t1 = now()
                t0r, want = conn.recv()
                if checksums(params) != want:
                    bad += 1
                times.append(t1 - t0r)
            dist.barrier()
        if rank == 1:
            results.put({"model": cfg["model"], "path": path, "times": times, "bad_versions": bad,
                         "versions": versions, "bytes": nbytes(params), "tensors": len(params),
                         "how": "%s, %d broadcasts" % (backend, len(params) if path == "nccl-per-tensor" else len(buckets))})
        del buf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def floor(cfg, results) -> None:
    """The same bytes copied device-to-device in one process: tensor by tensor, and as
    one flat copy, producer GPU -> consumer GPU."""
    import torch
    pg, cg = device(cfg["producer_gpu"]), device(cfg["consumer_gpu"])
    shapes = MODELS[cfg["model"]]()
    src, dst = alloc(shapes, pg), alloc(shapes, cg)
    randomize(src)
    total = nbytes(src)
    s, d = list(src.values()), list(dst.values())
    if cg.type == "cuda":
        torch.cuda.set_device(cg)
    per, flat = [], []
    for i in range(cfg["floor_reps"]):
        sync(pg)
        sync(cg)
        t0 = now()
        # The fastest in-process copy of these tensors: copy_ (memcpy) for the
        # large ones, one _foreach_copy_ for the small ones on one GPU.
        small_d, small_s = [], []
        for x, y in zip(d, s):
            if pg == cg and x.numel() * x.element_size() < (1 << 20) and hasattr(torch, "_foreach_copy_"):
                small_d.append(x.view(torch.int16))
                small_s.append(y.view(torch.int16))
            else:
                x.copy_(y, non_blocking=True)
        if small_d:
            torch._foreach_copy_(small_d, small_s)
        sync(cg)
        per.append(now() - t0)
    ok = checksums(src) == checksums(dst)
    batch, how = floor_batch(s, d, pg, cg, cfg["floor_reps"])
    ok = ok and checksums(src) == checksums(dst)
    del dst
    a = torch.empty(total, dtype=torch.uint8, device=pg)
    b = torch.empty(total, dtype=torch.uint8, device=cg)
    for i in range(cfg["floor_reps"]):
        sync(pg)
        sync(cg)
        t0 = now()
        b.copy_(a, non_blocking=True)
        sync(cg)
        flat.append(now() - t0)
    results.put({"model": cfg["model"], "path": "floor", "times": per, "bad_versions": 0 if ok else 1,
                 "versions": len(per), "bytes": total, "tensors": len(src)})
    if pg.type == "cuda":
        del a, b
        torch.cuda.empty_cache()
        al, ze = alloc_floor(total, pg.index, cfg["floor_reps"])
        results.put({"model": cfg["model"], "path": "floor-alloc", "times": al, "bad_versions": 0,
                     "versions": len(al), "bytes": total, "tensors": 1,
                     "how": "cuMemAlloc of the same bytes, alone (first %.2f ms); cuMemsetD8 zeroing them: median %.2f ms"
                            % (al[0] * 1e3, statistics.median(ze) * 1e3), "zero_times": ze})
    results.put({"model": cfg["model"], "path": "floor-flat", "times": flat, "bad_versions": 0,
                 "versions": len(flat), "bytes": total, "tensors": 1})
    if batch:
        results.put({"model": cfg["model"], "path": "floor-batch", "times": batch, "bad_versions": 0 if ok else 1,
                     "versions": len(batch), "bytes": total, "tensors": len(src), "how": how})


def alloc_floor(total: int, ordinal: int, reps: int) -> Tuple[List[float], List[float]]:
    """What the driver itself needs to allocate ``total`` bytes (cuMemAlloc, as the
    daemon allocates an arena), and to zero them (cuMemsetD8, as the daemon zeroes a
    new arena), each timed alone, in a process whose context is up."""
    from cudaipc import _cuda
    cu = _cuda.driver()
    al, ze = [], []
    with _cuda.on(ordinal):
        for _ in range(reps):
            t0 = now()
            ptr = _cuda.check("cuMemAlloc", cu.cuMemAlloc(total))
            al.append(now() - t0)
            t0 = now()
            _cuda.check("cuMemsetD8", cu.cuMemsetD8(ptr, 0, total))
            _cuda.check("cuCtxSynchronize", cu.cuCtxSynchronize())
            ze.append(now() - t0)
            _cuda.check("cuMemFree", cu.cuMemFree(ptr))
    return al, ze


def floor_batch(s, d, pg, cg, reps) -> Tuple[List[float], str]:
    """The same tensors copied in one process with one cuMemcpyBatchAsync (one copy per
    tensor, nothing merged): what the driver's batch costs without any IPC."""
    if cg.type != "cuda":
        return [], ""
    import numpy as np
    import torch
    from cudaipc import _cuda_ctypes
    for x, y in zip(d, s):
        x.zero_()
    dsts = np.array([x.data_ptr() for x in d], dtype=np.uint64)
    srcs = np.array([y.data_ptr() for y in s], dtype=np.uint64)
    sizes = np.array([y.numel() * y.element_size() for y in s], dtype=np.uint64)
    out, method = [], ""
    for i in range(reps):
        sync(pg)
        sync(cg)
        t0 = now()
        _, method = _cuda_ctypes.copy_batch(cg.index, torch.cuda.current_stream(cg).cuda_stream, dsts, srcs, sizes)
        out.append(now() - t0)
    return out, "%s%s" % (method, (" (" + _cuda_ctypes.batch_unavailable + ")") if _cuda_ctypes.batch_unavailable else "")


def run_model(cfg) -> List[dict]:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    f = ctx.Process(target=floor, args=(cfg, results))
    a, b = ctx.Pipe()
    dist_paths = [p for p, _ in cfg["paths"] if p in DIST_PATHS]
    ipc = dict(cfg, paths=[(p, n) for p, n in cfg["paths"] if p not in DIST_PATHS])
    p = ctx.Process(target=producer, args=(a, ipc))
    c = ctx.Process(target=consumer, args=(b, ipc, results))
    ranks = []
    try:
        f.start()
        f.join(cfg["timeout"])
        p.start()
        c.start()
        out = collect(ipc, results, p, c)
        if dist_paths:
            # After the cudaipc paths, alone on the GPUs: two ranks of torch.distributed.
            ra, rb = ctx.Pipe()
            cfg = dict(cfg, dist_port=free_port())
            ranks = [ctx.Process(target=dist_rank, args=(0, ra, cfg, results)),
                     ctx.Process(target=dist_rank, args=(1, rb, cfg, results))]
            for x in ranks:
                x.start()
            out += collect(dict(cfg, paths=[], expect=len(dist_paths)), results, ranks[0], ranks[1])
        return out
    finally:
        for x in [f, p, c] + ranks:
            if x.pid is not None and x.is_alive():
                x.kill()
                x.join(5)


def collect(cfg, results, p, c) -> List[dict]:
    out = []
    if "expect" in cfg:
        want = cfg["expect"]
    else:   # the floors (three on a GPU, one on the host) and one result per path
        want = 4 + len(cfg["paths"]) if cfg["consumer_gpu"] >= 0 else 2 + len(cfg["paths"])
    deadline = time.monotonic() + cfg["timeout"]
    while len(out) < want and time.monotonic() < deadline:
        try:
            out.append(results.get(timeout=1))
            r = out[-1]
            print("  %-11s %s" % (r["path"], summarize(r)), flush=True)
        except Exception:  # noqa: BLE001 - queue.Empty
            if not c.is_alive() and results.empty():
                break   # the consumer is gone (it reports every path): nothing more comes
    for x in (p, c):
        x.join(10)
        if x.is_alive():
            x.kill()
    return out


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(r: dict) -> str:
    t = r["times"][1:] if len(r["times"]) > 1 else r["times"]
    med = statistics.median(t)
    r["median_s"] = med
    r["first_s"] = r["times"][0]
    r["gbps"] = r["bytes"] / med / 1e9
    out = "median %8.2f ms (first %8.2f ms)  %7.1f GB/s  %d tensors  %.2f GB  checksum failures %d" % (
        med * 1e3, r["times"][0] * 1e3, r["gbps"], r["tensors"], r["bytes"] / 1e9, r["bad_versions"])
    st = r.get("stages")
    if st:
        r["stage_median_s"] = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in st.items()}
        m = r["stage_median_s"]
        out += "\n  %-11s   publish->lease+manifest %.2f ms, load_into %.2f ms (of which copies %.2f ms; first version %.2f ms)" % (
            "", m["get"] * 1e3, m["load"] * 1e3, m["copy"] * 1e3, st["load"][0] * 1e3)
    if r.get("how"):
        out += "\n  %-11s   %s" % ("", r["how"])
    if r.get("driver_opens"):
        out += "\n  %-11s   reader driver opens per version %s (the producer's allocations: %d)" % (
            "", r["driver_opens"], r.get("producer_allocations", -1))
    f = r.get("first")
    if f and r["path"].startswith("cudaipc"):
        c, p = f.get("consumer", {}), f.get("producer", {})
        ms = lambda d, k: d.get(k, 0.0) * 1e3  # noqa: E731
        out += ("\n  %-11s   first version: consumer opens %.2f ms (%d), region maps %.2f ms (%d), manifest parse %.2f ms, "
                "plan %.2f ms; producer publish %.2f ms, of which create %.2f ms, opens %.2f ms, plan %.2f ms" % (
                    "", ms(c, "open"), c.get("n_open", 0), ms(c, "map"), c.get("n_map", 0), ms(c, "parse"), ms(c, "plan"),
                    ms(p, "publish"), ms(p, "create"), ms(p, "open"), ms(p, "plan")))
    return out


def main() -> None:
    if "--cross-node" in sys.argv[1:]:
        # Trainer and engine on two daemons joined as a cluster (issue 19):
        # weight_sync_cluster.py, with its own flags.
        sys.path.insert(0, HERE)
        import weight_sync_cluster
        weight_sync_cluster.main([a for a in sys.argv[1:] if a != "--cross-node"])
        return
    # A timeout's SIGTERM unwinds through the finally blocks that stop the
    # workers and the daemon, so that none is left holding GPU memory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    from cudaipc._deps import require
    require("torch", "weight_sync.py")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=shutil.which("cudaipc") or os.path.join(REPO, "cudaipc"), help="the cudaipc binary")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--paths", default="cudaipc,cudaipc-put,cudaipc-nocopy,per-tensor,bucketed,nccl-bucketed,nccl-per-tensor",
                    help="nccl-* need two GPUs (skipped when --producer-gpu equals --consumer-gpu)")
    ap.add_argument("--versions", type=int, default=5, help="versions per path (the first is reported apart)")
    ap.add_argument("--per-tensor-versions-moe", type=int, default=3)
    ap.add_argument("--producer-gpu", type=int, default=0)
    ap.add_argument("--consumer-gpu", type=int, default=0)
    ap.add_argument("--capacity", default="80GiB")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per model")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="a tiny model in host memory (any machine): checks the script")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="weight-sync-")
    sock = os.path.join(d, "store.sock")
    log = open(os.path.join(d, "daemon.log"), "w")
    if args.smoke:
        args.models, args.producer_gpu, args.consumer_gpu, args.capacity = "smoke", -1, -1, "256MiB"
        # Publishing without a copy shares CUDA memory: not in host memory.
        args.paths = ",".join(p for p in args.paths.split(",") if p != "cudaipc-nocopy")
    if args.producer_gpu >= 0 and args.producer_gpu == args.consumer_gpu:
        # NCCL needs one GPU per rank.
        dropped = [p for p in args.paths.split(",") if p in DIST_PATHS]
        if dropped:
            print("skipping %s: NCCL needs two GPUs (--producer-gpu 0 --consumer-gpu 1)" % ",".join(dropped), flush=True)
            args.paths = ",".join(p for p in args.paths.split(",") if p not in DIST_PATHS)
    daemon = subprocess.Popen([args.bin, "serve", "--socket", sock, "--backend", "host" if args.smoke else "cuda",
                               "--capacity", args.capacity,
                               "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    try:
        while not os.path.exists(sock):
            if daemon.poll() is not None:
                sys.exit("cudaipc serve exited: see %s" % log.name)
            time.sleep(0.05)
        all_results = []
        for m in args.models.split(","):
            paths = []
            for p in args.paths.split(","):
                n = args.versions
                if m == "moe" and p == "per-tensor":
                    n = min(n, args.per_tensor_versions_moe)
                paths.append((p, n))
            cfg = {"model": m, "socket": sock, "paths": paths, "producer_gpu": args.producer_gpu,
                   "consumer_gpu": args.consumer_gpu, "floor_reps": 5, "timeout": args.timeout}
            print("model %s, producer GPU %d, consumer GPU %d" % (m, args.producer_gpu, args.consumer_gpu), flush=True)
            rs = run_model(cfg)
            fl = next((r for r in rs if r["path"] == "floor"), None)
            for r in rs:
                r["producer_gpu"], r["consumer_gpu"] = args.producer_gpu, args.consumer_gpu
                if fl is not None and "median_s" in r and "median_s" in fl:
                    r["x_floor"] = r["median_s"] / fl["median_s"]
            nb = next((r for r in rs if r["path"] == "nccl-bucketed" and "median_s" in r), None)
            for r in rs:
                if nb is not None and "median_s" in r:
                    r["x_nccl_bucketed"] = r["median_s"] / nb["median_s"]
            for r in rs:
                if "x_floor" in r:
                    vs = "  %6.2fx nccl-bucketed" % r["x_nccl_bucketed"] if "x_nccl_bucketed" in r else ""
                    print("  %-11s %6.2fx floor%s" % (r["path"], r["x_floor"], vs), flush=True)
            fa = next((r for r in rs if r["path"] == "floor-alloc" and "median_s" in r), None)
            for r in rs:
                if fa is not None and r["path"].startswith("cudaipc") and "median_s" in r:
                    # The first version's target: twice the steady state plus what the
                    # driver needs to allocate the bytes (its first cuMemAlloc, alone).
                    bound = 2 * r["median_s"] + fa["first_s"]
                    r["first_bound_s"] = bound
                    print("  %-11s first version %.2f ms; 2x steady %.2f ms + allocation floor %.2f ms = %.2f ms: %.2fx that" % (
                        r["path"], r["first_s"] * 1e3, 2 * r["median_s"] * 1e3, fa["first_s"] * 1e3, bound * 1e3,
                        r["first_s"] / bound), flush=True)
            all_results += rs
        if args.json:
            with open(args.json, "w") as f:
                json.dump(all_results, f, indent=1)
    finally:
        daemon.terminate()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()


if __name__ == "__main__":
    try:
        main()
    except ImportError as e:   # a missing package: say which, in one line
        sys.exit(str(e))
