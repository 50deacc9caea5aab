"""A get that waits on one node of a cluster for a name another node creates later
(real etcd, real ``cudaipc serve --cluster`` processes, UCX over tcp on loopback):
the engine-starts-first pattern of a weight sync. Needs Debian's etcd-server and
libucx0; skipped without them unless CUDAIPC_REQUIRE_CLUSTER=1 (fixtures:
test_cluster_partial.py)."""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
from typing import Dict, Tuple

import pytest

from conftest import Daemon
from test_cluster_partial import etcd, nodes  # noqa: F401 (fixtures)

import cudaipc
from cudaipc import bundle as B

np = pytest.importorskip("numpy")


def _waiting_gets(port: int) -> float:
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("cudaipc_cluster_waiting_gets "):
                return float(line.split()[1])
    raise AssertionError("no metric cudaipc_cluster_waiting_gets")


def _until_waiting(port: int, proc: "subprocess.Popen[bytes] | None" = None) -> None:
    """Return once B's daemon has a get waiting on the cluster (bounded: 20 s)."""
    deadline = time.monotonic() + 20
    while _waiting_gets(port) < 1:
        assert proc is None or proc.poll() is None, "the get ended before it waited"
        assert time.monotonic() < deadline, "B's get never waited on the cluster"
        time.sleep(0.05)


def test_get_bundle_newer_than_0_woken_by_another_nodes_publish(nodes: Tuple[Daemon, Daemon, int]) -> None:
    a, b, metrics = nodes
    rng = np.random.default_rng(33)
    tensors = {"layer.%d.w" % i: rng.standard_normal((300, 200 + 13 * i)).astype(np.float32) for i in range(4)}
    got: Dict[str, object] = {}

    def reader() -> None:
        try:
            with cudaipc.connect(b.socket) as s:
                bun = B.get_bundle(s, "late3", timeout=20, newer_than=0, views="numpy")
                got["at"] = time.monotonic()
                try:
                    got["version"] = bun.lease.info.version
                    got["tensors"] = {n: np.array(bun[n]) for n in bun.keys()}
                finally:
                    bun.release()
        except BaseException as e:  # reported by the test's thread
            got["error"] = e

    th = threading.Thread(target=reader)
    th.start()
    try:
        _until_waiting(metrics)
        with cudaipc.connect(a.socket) as s:
            info = B.put_bundle(s, "late3", tensors, publish=True, cluster=True)
        published = time.monotonic()
    finally:
        th.join(30)
    assert not th.is_alive(), "B's get_bundle never returned"
    assert "error" not in got, got.get("error")
    assert got["version"] == info.version
    bun_tensors = got["tensors"]
    assert isinstance(bun_tensors, dict) and sorted(bun_tensors) == sorted(tensors)
    for n, t in tensors.items():
        assert np.array_equal(bun_tensors[n], t), n
    wake = float(got["at"]) - published  # type: ignore[arg-type]
    print("B's get_bundle(newer_than=0) answered %.0f ms after A's publish returned" % (wake * 1000))
    assert wake < 10, "B's get took %.1f s after A's publish, half its timeout" % wake


def test_cli_get_timeout_woken_by_another_nodes_put(nodes: Tuple[Daemon, Daemon, int], tmp_path) -> None:
    a, b, metrics = nodes
    want = np.random.default_rng(34).integers(0, 256, size=300_001, dtype=np.uint8).tobytes()
    src, out = tmp_path / "late2.bin", tmp_path / "got.bin"
    src.write_bytes(want)
    get = subprocess.Popen([b.binary, "--socket", b.socket, "get", "late2", "--timeout", "20s", "-o", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _until_waiting(metrics, get)
        a.cli("put", str(src), "--name", "late2", "--cluster")
        _, err = get.communicate(timeout=30)
    finally:
        if get.poll() is None:
            get.kill()
            get.wait()
    assert get.returncode == 0, err.decode()
    assert out.read_bytes() == want
