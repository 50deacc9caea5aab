"""The gather kernel's process switches: CUDAIPC_GATHER and CUDAIPC_GATHER_MAX_BYTES
(which sets the limit of no-copy bundles' copies and of an arena's alike)."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)


def _import_gather(env: dict) -> subprocess.CompletedProcess:
    code = "import cudaipc._gather as g; print(g.MAX_BYTES, g.ARENA_MAX_BYTES, g.ENABLED)"
    return subprocess.run([sys.executable, "-c", code], cwd=PKG, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=PKG, **env))


def test_switches_set_the_limit_and_turn_the_kernel_off() -> None:
    out = _import_gather({"CUDAIPC_GATHER_MAX_BYTES": "16777216", "CUDAIPC_GATHER": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["16777216", "16777216", "False"]
    out = _import_gather({"CUDAIPC_GATHER_MAX_BYTES": "", "CUDAIPC_GATHER": ""})
    assert out.returncode == 0, out.stderr
    # Unset: no-copy bundles' copies all go to the kernel, an arena's from 16 MiB on to the batch.
    assert out.stdout.split() == [str(1 << 62), str(16 << 20), "True"]


def test_a_bad_limit_is_one_clear_line() -> None:
    for bad in ("x", "-1", "1.5"):
        out = _import_gather({"CUDAIPC_GATHER_MAX_BYTES": bad})
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert "CUDAIPC_GATHER_MAX_BYTES=" in last and "want a byte count" in last, out.stderr
