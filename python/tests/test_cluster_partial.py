"""get_bundle(tensors=[...]) across two daemons of a cluster (real etcd, real
``cudaipc serve --cluster`` processes, UCX over tcp on loopback): the reader's daemon
reads only the named tensors from the publisher's into a partial replica
(docs/cluster.md, "Partial reads"). Needs Debian's etcd-server and libucx0; skipped
without them unless CUDAIPC_REQUIRE_CLUSTER=1."""

from __future__ import annotations

import json
import struct
import urllib.request
from typing import Dict, Iterator, Tuple

import pytest

from clusterutil import cluster_daemons, free_port, start_etcd
from conftest import Daemon

import cudaipc
from cudaipc.errors import InvalidArgument

np = pytest.importorskip("numpy")


@pytest.fixture
def etcd() -> Iterator[str]:
    with start_etcd() as url:
        yield url


@pytest.fixture
def nodes(cudaipc_bin: str, etcd: str) -> Iterator[Tuple[Daemon, Daemon, int]]:
    metrics = free_port()
    with cluster_daemons(cudaipc_bin, etcd, ["--backend", "host", "--capacity", "256MiB"],
                         configs=[None, 'metrics = "%d"\n' % metrics]) as (a, b):
        yield a, b, metrics


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
