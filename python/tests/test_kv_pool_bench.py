"""The KV block pool benchmark (scripts/bench/kv_pool.py) at tiny sizes, so that it
keeps working: lookups (hit, miss, half; prefix and per key), puts and gets against
the memcpy floor, and Redis's MSET and MGET of the same blocks where redis-server is
installed (CUDAIPC_REQUIRE_REDIS=1 makes its absence a failure). The run checks every
get's and MGET's blocks; a wrong byte fails it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from conftest import REPO

SCRIPT = os.path.join(REPO, "scripts", "bench", "kv_pool.py")


def test_tiny(cudaipc_bin: str, tmp_path: Any) -> None:
    redis = shutil.which("redis-server")
    if not redis and os.environ.get("CUDAIPC_REQUIRE_REDIS") == "1":
        pytest.fail("CUDAIPC_REQUIRE_REDIS=1 but redis-server is missing (Debian: redis-server)")
    out = str(tmp_path / "pool.json")
    args = ["--bin", cudaipc_bin, "--json", out, "--layers", "2", "--kv-heads", "1", "--head-dim", "16",
            "--tokens", "16,64", "--redis-tokens", "16,64", "--reps", "3", "--warmup", "1",
            "--lookup-keys", "300", "--lookups", "20", "--lookup-warmup", "2", "--redis-batch", "2",
            "--redis-server", redis or ""]
    r = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out) as f:
        got = json.load(f)
    assert got["bad"] == 0 and got["checked_ops"] > 0
    assert got["shape"]["pool_block_bytes"] == 2 * 2 * 512
    lk = got["lookup"]
    assert lk["keys"] == 300
    for c in ("hit", "miss", "half", "hit_per_key", "miss_per_key", "half_per_key", "hit_list"):
        assert lk[c]["n"] == 20 and lk[c]["p99_us"] >= lk[c]["p50_us"] > 0
    assert got["cross_node"].startswith("pending")
    assert [s["tokens"] for s in got["sizes"]] == [16, 64]
    for s in got["sizes"]:
        assert s["bytes"] == s["blocks"] * 2048
        for op in ("memcpy_1", "memcpy_n", "pieces", "put", "get"):
            assert s[op]["n"] == 3 and s[op]["p50_ms"] > 0
        assert s["put"]["x_floor"] > 0 and s["get"]["x_floor"] > 0
        assert s["checked"]["get"] == {"ops": 4, "bad_ops": 0}
        if redis:
            assert s["mset"]["n"] == 3 and s["mget"]["n"] == 3 and s["mget_over_get"] > 0
            assert s["checked"]["mget"] == {"ops": 4, "bad_ops": 0}
        else:
            assert "mset" not in s
    assert "Redis MGET" in r.stdout
