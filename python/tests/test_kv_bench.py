"""The KV transfer benchmark (scripts/bench/kv_transfer.py) at tiny sizes, so that it
keeps working: on one node and across two daemons of a cluster, in host memory and
(where there is one) GPU 0's. Each run checks every operation's bytes; a wrong byte
fails it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from conftest import REPO, need_gpus, need_module

SCRIPT = os.path.join(REPO, "scripts", "bench", "kv_transfer.py")
TINY = ["--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens", "16,64", "--reads", "3", "--warmup", "1",
        "--loop-reads", "2", "--small-count", "20"]


def run(binary: str, tmp_path: Any, *args: str) -> Dict[str, Any]:
    out = str(tmp_path / "kv.json")
    r = subprocess.run([sys.executable, SCRIPT, "--bin", binary, "--json", out] + TINY + list(args),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out) as f:
        got: Dict[str, Any] = json.load(f)
    assert got["bad"] == 0
    return got


def check_requests(reqs: List[Dict[str, Any]], floor: bool) -> None:
    assert [r["tokens"] for r in reqs] == [16, 64]
    for r in reqs:
        assert r["bytes"] == r["blocks"] * 2 * 2 * 512
        assert r["read"]["n"] == 3 and r["read"]["p50_ms"] > 0
        kinds = {"read": 4, "floor": 4, "loop": 3} if floor else {"read": 4}
        assert {k: c["ops"] for k, c in r["checked"].items()} == kinds
        assert all(c["bad_ops"] == 0 for c in r["checked"].values())
        if floor:
            assert r["x_floor"] > 0 and r["loop_over_read"] > 0


def check_small(s: Dict[str, Any]) -> None:
    assert s["count"] == 20
    for k in ("sequential", "concurrent"):
        assert s[k]["bad_reads"] == 0 and s[k]["p99_us"] >= s[k]["p50_us"] > 0


def test_one_node_host(cudaipc_bin: str, tmp_path: Any) -> None:
    got = run(cudaipc_bin, tmp_path)
    assert got["shape"]["block_bytes"] == 512 and got["device"] == "host"
    check_requests(got["one_node"]["requests"], floor=True)
    check_small(got["one_node"]["small"])
    assert got["one_node"]["round_trip_us"] > 0


def test_one_node_gpu(cudaipc_bin: str, tmp_path: Any) -> None:
    need_gpus(1)
    need_module("torch")
    got = run(cudaipc_bin, tmp_path, "--device", "cuda")
    check_requests(got["one_node"]["requests"], floor=True)
    check_small(got["one_node"]["small"])


@pytest.mark.parametrize("device", ["host", "cuda"])
def test_cross_node(cudaipc_bin: str, tmp_path: Any, device: str) -> None:
    if device == "cuda":
        need_gpus(1)
        need_module("torch")
    etcd = os.environ.get("CUDAIPC_ETCD") or shutil.which("etcd")
    # The GPU machine's tools (scripts/gpu-build.sh) keep ucx_perftest beside etcd.
    perftest = shutil.which("ucx_perftest") or (etcd and shutil.which("ucx_perftest", path=os.path.dirname(etcd)))
    if not etcd or not perftest:
        if os.environ.get("CUDAIPC_REQUIRE_CLUSTER") == "1":
            pytest.fail("CUDAIPC_REQUIRE_CLUSTER=1 but etcd or ucx_perftest is missing")
        pytest.skip("etcd or ucx_perftest is missing (Debian: etcd-server, ucx-utils)")
    got = run(cudaipc_bin, tmp_path, "--no-one-node", "--cross-node", "--etcd", etcd, "--ucx-perftest", perftest,
              "--perftest-iters", "200", "--device", device)
    x = got["cross_node"]
    assert "pending" not in x, x["pending"]
    check_requests(x["requests"], floor=False)
    check_small(x["small"])
    assert x["floor_GBps"] >= 0 and x["floor_msg_per_s"] > 0 and x["round_trip_us"] > 0
    for r in x["requests"]:
        assert len(r["daemon_cpu_s_per_GB"]) == 2
    if device == "cuda":
        assert x["staging"]["d2h_GBps"] > 0 and "x_staging" in x["requests"][0]
