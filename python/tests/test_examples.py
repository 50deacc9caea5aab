"""The example script runs (host memory here; GPU 0 where there is one)."""

import os
import subprocess
import sys

from conftest import PYROOT, gpu_count


def run_example(cudaipc_bin, *args, socket=None):
    env = dict(os.environ, CUDAIPC_BIN=cudaipc_bin)
    env.pop("CUDAIPC_SOCKET", None)
    env["XDG_RUNTIME_DIR"] = "/nonexistent-for-example"
    if socket is not None:
        env["CUDAIPC_SOCKET"] = socket
    r = subprocess.run([sys.executable, os.path.join(PYROOT, "examples", "trainer_engine.py")] + list(args),
                       capture_output=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return r.stdout.decode()


def test_trainer_engine_host(cudaipc_bin):
    out = run_example(cudaipc_bin, "--steps", "2")
    assert "engine: step 1: 3 tensors" in out and out.strip().endswith("ok")


def test_trainer_engine_leaves_nothing_in_an_existing_daemon(cudaipc_bin, daemon, store):
    store.put("mine", b"kept")
    out = run_example(cudaipc_bin, "--steps", "3", socket=daemon.socket)
    assert "engine: step 2: 3 tensors" in out and out.strip().endswith("ok")
    assert [o.name for o in store.list()] == ["mine"]


def test_trainer_engine_says_what_to_install(cudaipc_bin, tmp_path):
    """Without protobuf (or NumPy) the example says in one line what to install."""
    for module, deb in (("google.protobuf", "python3-protobuf"), ("numpy", "python3-numpy")):
        shim = tmp_path / module
        shim.mkdir()
        (shim / "sitecustomize.py").write_text("import sys\nsys.modules[%r] = None\n" % module)
        env = dict(os.environ, CUDAIPC_BIN=cudaipc_bin, PYTHONPATH=str(shim))
        r = subprocess.run([sys.executable, os.path.join(PYROOT, "examples", "trainer_engine.py")],
                           capture_output=True, timeout=60, env=env, text=True)
        assert r.returncode == 1 and deb in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_trainer_engine_gpu(cudaipc_bin):
    from conftest import need_gpus, need_module
    need_gpus(1)
    need_module("torch")
    out = run_example(cudaipc_bin, "--steps", "2", "--device", "0")
    assert "cuda:0" in out and out.strip().endswith("ok")
