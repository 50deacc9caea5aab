#!/usr/bin/env python3
"""Trainer -> engine weight sync through the cudaipc store, zero-copy.

A "trainer" process publishes a few weight tensors each step; an "engine" process
waits for them and uses them in place (no copy, no pickling, no per-tensor CUDA IPC
open). Runs on CPU (host memory, NumPy or PyTorch CPU) and on GPU (--device 0).

    python3 python/examples/trainer_engine.py                 # host memory
    python3 python/examples/trainer_engine.py --device 0      # GPU 0 (torch + cuda-bindings)

It uses the daemon at --socket / $CUDAIPC_SOCKET if one runs there, else starts
'cudaipc serve' ($CUDAIPC_BIN, or cudaipc on $PATH) on a temporary socket. Its
objects are named example-<pid>/step<N>/<tensor>, and none is left behind.

Needs protobuf, and NumPy or PyTorch (Debian: python3-protobuf python3-numpy).
"""

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import cudaipc  # noqa: E402
    from cudaipc._deps import require  # noqa: E402
    require("numpy", "this example")
except ImportError as e:   # a missing package: say which, in one line
    sys.exit(str(e))

LAYERS = {"embed": (512, 64), "layer.0": (64, 64), "head": (64, 10)}


def make(shape, device, seed):
    try:
        import torch
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(*shape, generator=g)
        return t.to("cuda:%d" % int(device)) if device != "host" else t
    except ImportError:
        import numpy as np
        return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def digest(x):
    try:
        import torch
        if isinstance(x, torch.Tensor):
            return hashlib.sha256(x.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
    except ImportError:
        pass
    return hashlib.sha256(x.tobytes()).hexdigest()[:16]


def trainer(sock, run, device, steps, q, acks):
    with cudaipc.connect(sock) as store:
        for step in range(steps):
            sums = {}
            for i, (name, shape) in enumerate(LAYERS.items()):
                w = make(shape, device, seed=step * 100 + i)      # "training"
                store.put("%s/step%d/%s" % (run, step, name), w)   # copy once into the store
                sums[name] = digest(w)
            q.put(sums)
            acks.get(timeout=60)                                   # the engine holds this step's leases:
            for name in LAYERS:                                    # delete it; the engine's views keep
                store.delete("%s/step%d/%s" % (run, step, name))   # its memory until dropped


def engine(sock, run, steps, q, acks):
    with cudaipc.connect(sock) as store:
        for step in range(steps):
            # Wait for the trainer's put (a get without a timeout would fail at once).
            leases = [store.get("%s/step%d/%s" % (run, step, n), timeout=30) for n in LAYERS]
            acks.put(step)
            views = {l.name.rsplit("/", 1)[1]: (l.tensor() if _has_torch() else l.numpy()) for l in leases}
            for l in leases:
                l.release()          # the views keep the memory leased until they are dropped
            got = {n: digest(v) for n, v in views.items()}
            want = q.get(timeout=30)
            assert got == want, (got, want)
            dev = next(iter(views.values()))
            where = getattr(dev, "device", "host")
            print("engine: step %d: %d tensors on %s, zero-copy, bytes match" % (step, len(views), where), flush=True)
            del views                # the leases end here


def _has_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket")
    ap.add_argument("--device", default="host")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    if a.device != "host":
        try:
            require("torch", "--device (GPU tensors)")
        except ImportError as e:
            sys.exit(str(e))
    sock, daemon, tmp = a.socket or cudaipc.default_socket_path(), None, None
    try:
        cudaipc.connect(sock).close()
    except cudaipc.StoreGone:
        binary = os.environ.get("CUDAIPC_BIN") or shutil.which("cudaipc")
        if binary is None:
            sys.exit("no daemon at %s and no cudaipc binary (set CUDAIPC_BIN or put cudaipc on PATH)" % sock)
        tmp = tempfile.mkdtemp()
        sock = os.path.join(tmp, "store.sock")
        daemon = subprocess.Popen([binary, "serve", "--socket", sock], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(sock):
            time.sleep(0.02)
    try:
        ctx = mp.get_context("spawn")
        q, acks = ctx.Queue(), ctx.Queue()
        run = "example-%d" % os.getpid()
        t = ctx.Process(target=trainer, args=(sock, run, a.device, a.steps, q, acks))
        e = ctx.Process(target=engine, args=(sock, run, a.steps, q, acks))
        e.start()
        t.start()
        t.join(120)
        e.join(120)
        if t.exitcode != 0 or e.exitcode != 0:
            sys.exit("trainer exit %s, engine exit %s" % (t.exitcode, e.exitcode))
        print("ok")
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
