"""Fixtures: a real ``cudaipc serve`` daemon on a temporary socket.

The binary is $CUDAIPC_BIN, else built once per session with ``go build`` from this
checkout. GPU tests skip without a GPU (and cuda-bindings), unless
$CUDAIPC_REQUIRE_GPU=N says the machine has N GPUs: then a test needing at most N
fails instead of skipping, so that a skip can never hide a bug."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
REPO = os.path.dirname(PYROOT)
sys.path.insert(0, PYROOT)

import cudaipc  # noqa: E402


def _build_binary(tmp: str) -> str:
    env = os.environ.get("CUDAIPC_BIN")
    if env:
        return env
    go = shutil.which("go")
    if go is None:
        pytest.fail("no cudaipc binary: set CUDAIPC_BIN or install Go to build it")
    out = os.path.join(tmp, "cudaipc")
    subprocess.run([go, "build", "-o", out, "./cmd/cudaipc"], cwd=REPO, check=True,
                   env=dict(os.environ, CGO_ENABLED="0"))
    return out


@pytest.fixture(scope="session")
def cudaipc_bin(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _build_binary(str(tmp_path_factory.mktemp("bin")))


class Daemon:
    """A running ``cudaipc serve``; config, if given, is the text of its --config file."""

    def __init__(self, binary: str, args: List[str], config: Optional[str] = None):
        self.dir = tempfile.mkdtemp(prefix="cudaipc-py-")
        self.socket = os.path.join(self.dir, "store.sock")
        if config is not None:
            path = os.path.join(self.dir, "serve.toml")
            with open(path, "w") as f:
                f.write(config)
            args = ["--config", path] + list(args)
        self.binary = binary
        self.log = open(os.path.join(self.dir, "daemon.log"), "w+")
        self.proc = subprocess.Popen([binary, "serve", "--socket", self.socket] + args,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError("cudaipc serve did not start: " + self.log.read())
            time.sleep(0.02)

    def cli(self, *args: str, input: Optional[bytes] = None, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, "--socket", self.socket] + list(args), input=input,
                              capture_output=True, check=check, timeout=60)

    def leases(self, name: str) -> int:
        with cudaipc.connect(self.socket) as s:
            return s.stat(name).leases

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemon(cudaipc_bin: str) -> Iterator[Daemon]:
    d = Daemon(cudaipc_bin, ["--backend", "host", "--capacity", "256MiB"])
    yield d
    d.stop()


@pytest.fixture
def store(daemon: Daemon) -> Iterator[cudaipc.Store]:
    s = cudaipc.connect(daemon.socket)
    yield s
    s.close()


def gpu_count() -> int:
    try:
        from cudaipc import _cuda
        return _cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def need_gpus(n: int) -> None:
    """Skip (or fail, under CUDAIPC_REQUIRE_GPU) a test needing n GPUs."""
    have = gpu_count()
    if have >= n:
        return
    req = os.environ.get("CUDAIPC_REQUIRE_GPU", "")
    if req and int(req) >= n:
        pytest.fail("CUDAIPC_REQUIRE_GPU=%s but this test needs %d GPUs and sees %d (cuda-bindings and a driver needed)" % (req, n, have))
    pytest.skip("needs %d GPU(s) with cuda-bindings; this machine has %d" % (n, have))


def need_module(name: str) -> None:
    """Skip a test needing an optional module, saying so (fail under CUDAIPC_REQUIRE_GPU
    for the GPU stack: torch and cupy are installed on the GPU machine)."""
    try:
        __import__(name)
    except ImportError:
        if os.environ.get("CUDAIPC_REQUIRE_GPU") and name in ("torch", "cupy"):
            pytest.fail("CUDAIPC_REQUIRE_GPU is set but %s is not importable" % name)
        pytest.skip("%s is not installed" % name)
