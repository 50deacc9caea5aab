"""The example script runs (host memory here; GPU 0 where there is one)."""

import os
import subprocess
import sys

from conftest import PYROOT, gpu_count


def run_example(cudaipc_bin, *args):
    env = dict(os.environ, CUDAIPC_BIN=cudaipc_bin)
    env.pop("CUDAIPC_SOCKET", None)
    env["XDG_RUNTIME_DIR"] = "/nonexistent-for-example"
    r = subprocess.run([sys.executable, os.path.join(PYROOT, "examples", "trainer_engine.py")] + list(args),
                       capture_output=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return r.stdout.decode()


def test_trainer_engine_host(cudaipc_bin):
    out = run_example(cudaipc_bin, "--steps", "2")
    assert "engine: step 1: 3 tensors" in out and out.strip().endswith("ok")


def test_trainer_engine_gpu(cudaipc_bin):
    from conftest import need_gpus, need_module
    need_gpus(1)
    need_module("torch")
    out = run_example(cudaipc_bin, "--steps", "2", "--device", "0")
    assert "cuda:0" in out and out.strip().endswith("ok")
