"""get_bundle(tensors=[...]) across two daemons of a cluster (real etcd, real
``cudaipc serve --cluster`` processes, UCX over tcp on loopback): the reader's daemon
reads only the named tensors from the publisher's into a partial replica
(docs/cluster.md, "Partial reads"). Needs Debian's etcd-server and libucx0; skipped
without them unless CUDAIPC_REQUIRE_CLUSTER=1."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from typing import Dict, Iterator, List, Tuple

import pytest

from conftest import Daemon

import cudaipc
from cudaipc.errors import InvalidArgument

np = pytest.importorskip("numpy")


def _need(what: str, ok: bool) -> None:
    if ok:
        return
    if os.environ.get("CUDAIPC_REQUIRE_CLUSTER") == "1":
        pytest.fail("CUDAIPC_REQUIRE_CLUSTER=1 but %s is missing" % what)
    pytest.skip("%s is missing (Debian: etcd-server, libucx0)" % what)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def etcd() -> Iterator[str]:
    binary = os.environ.get("CUDAIPC_ETCD") or shutil.which("etcd")
    _need("etcd (on PATH or at $CUDAIPC_ETCD)", binary is not None)
    _need("libucp.so.0", any(os.path.exists(os.path.join(d, "libucp.so.0"))
                             for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib")))
    d = tempfile.mkdtemp(prefix="cudaipc-etcd-")
    client, peer = _free_port(), _free_port()
    url = "http://127.0.0.1:%d" % client
    log = open(os.path.join(d, "etcd.log"), "w+")
    proc = subprocess.Popen([str(binary), "--data-dir", os.path.join(d, "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", "http://127.0.0.1:%d" % peer,
                             "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer,
                             "--initial-cluster", "default=http://127.0.0.1:%d" % peer],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError("etcd did not start: " + log.read())
            time.sleep(0.05)
        yield "etcd://127.0.0.1:%d" % client
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nodes(cudaipc_bin: str, etcd: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tuple[Daemon, Daemon, int]]:
    for k, v in {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}.items():
        monkeypatch.setenv(k, v)
    d = tempfile.mkdtemp(prefix="cudaipc-secret-")
    secret = os.path.join(d, "secret")
    with open(secret, "w") as f:
        f.write(base64.b64encode(os.urandom(32)).decode() + "\n")
    os.chmod(secret, 0o600)
    metrics = _free_port()
    started: List[Daemon] = []
    try:
        for name, config in (("a", None), ("b", 'metrics = "%d"\n' % metrics)):
            started.append(Daemon(cudaipc_bin, ["--backend", "host", "--capacity", "256MiB", "--cluster", etcd,
                                                "--node", name, "--cluster-secret", secret,
                                                "--cluster-listen", "127.0.0.1:0"], config=config))
        yield started[0], started[1], metrics
    finally:
        for dm in started:
            dm.stop()
        shutil.rmtree(d, ignore_errors=True)


def _safetensors(path: str, tensors: Dict[str, "np.ndarray"]) -> None:
    """Write float32 arrays as a safetensors file (dense, in the order given)."""
    header: Dict[str, object] = {}
    at = 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError("no metric %s" % name)


def test_get_bundle_tensors_reads_only_them_from_another_node(nodes: Tuple[Daemon, Daemon, int], tmp_path) -> None:
    a, b, metrics = nodes
    rng = np.random.default_rng(5)
    tensors = {"layer.%d.w" % i: rng.standard_normal((1000, 700 + 97 * i)).astype(np.float32) for i in range(6)}
    path = str(tmp_path / "model.safetensors")
    _safetensors(path, tensors)
    a.cli("put", path, "--name", "model", "--cluster")
    whole = sum(t.nbytes for t in tensors.values())

    with cudaipc.connect(b.socket) as s:
        want = ["layer.4.w", "layer.1.w"]
        bun = s.get_bundle("model", tensors=want, views="numpy")
        try:
            assert sorted(bun.keys()) == sorted(want)
            for n in want:
                assert np.array_equal(bun[n], tensors[n]), n
            assert bun.lease.info.partial
            assert bun.lease.info.name.endswith("model")
            subset = sum(tensors[n].nbytes for n in want)
            read = _metric(metrics, "cudaipc_cluster_partial_bytes_total")
            # The chunks the two tensors touch (4 MiB chunks): at most two more a tensor.
            assert subset <= read <= subset + 4 * (4 << 20) and read < whole
            assert _metric(metrics, "cudaipc_cluster_pulled_bytes_total") == 0
        finally:
            bun.release()

        # The same tensors again: no byte read.
        bun = s.get_bundle("model", tensors=list(reversed(want)), views="numpy")
        assert bun.lease.info.partial and np.array_equal(bun["layer.1.w"], tensors["layer.1.w"])
        bun.release()
        assert _metric(metrics, "cudaipc_cluster_partial_bytes_total") == read

        with pytest.raises(InvalidArgument, match="nope"):
            s.get_bundle("model", tensors=["layer.0.w", "nope"])
        with pytest.raises(InvalidArgument, match="named twice"):
            s.get_bundle("model", tensors=["layer.0.w", "layer.0.w"])

        # The whole bundle: pulled whole, every tensor right, not partial.
        bun = s.get_bundle("model", views="numpy")
        try:
            assert not bun.lease.info.partial and sorted(bun.keys()) == sorted(tensors)
            for n, t in tensors.items():
                assert np.array_equal(bun[n], t), n
        finally:
            bun.release()
        assert _metric(metrics, "cudaipc_cluster_pulled_bytes_total") >= whole
