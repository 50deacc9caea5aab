"""Disaggregated prefill and decode of a transformers Llama (random weights from a
``LlamaConfig``: nothing is downloaded) through GPU KV spaces: a prefill process runs
each prompt, pages its ``DynamicCache`` into its paged KV memory (vLLM's layout, a
``[2, num_blocks, 16, kv_heads, head_dim]`` tensor a layer, scattered block ids) and
registers it; a decode process reads each request's blocks into its own paged memory
with one read, waits layer by layer, rebuilds a ``DynamicCache`` and generates
greedily; tokens and logits equal one process doing both. The decode process's daemon
is the prefill's, or another node of a cluster (NODES in kv_model.py), whose daemons
stage the GPU blocks through pinned host memory. test_kv_model.py is the CPU twin.
Skips without a GPU, torch or transformers, unless CUDAIPC_REQUIRE_GPU is set (and
without etcd and libucx0 for two nodes, unless CUDAIPC_REQUIRE_CLUSTER=1)."""

from __future__ import annotations

import importlib.util
import os
from typing import Dict, Iterator, Tuple

import pytest

import cudaipc
from cudaipc import kv
from conftest import Daemon, need_gpus, need_module
from test_cluster_partial import etcd  # noqa: F401 (the fixture, for NODES' "two-nodes")

try:
    import torch  # noqa: F401 (kv_model's)
except ImportError:
    if os.environ.get("CUDAIPC_REQUIRE_GPU"):
        raise
    pytest.skip("torch is not installed", allow_module_level=True)

from kv_model import NODES, ModelConfig, check_decoded, disaggregate, killed_prefill  # noqa: E402
from kv_model import daemons as kv_daemons  # noqa: E402

LENGTHS = [16, 37, 100, 256]
STEPS = 8
DAEMON_ARGS = ["--backend", "cuda", "--capacity", "256MiB"]


def _need_stack() -> None:
    need_gpus(1)
    need_module("torch")
    import torch
    if not torch.cuda.is_available():
        need_gpus(10**6)   # fails under CUDAIPC_REQUIRE_GPU, skips otherwise
    if importlib.util.find_spec("transformers") is None:
        if os.environ.get("CUDAIPC_REQUIRE_GPU"):
            pytest.fail("CUDAIPC_REQUIRE_GPU is set but transformers is not importable")
        pytest.skip("transformers is not installed")


@pytest.fixture(params=NODES)
def daemons(request, cudaipc_bin: str) -> Iterator[Tuple[Daemon, Daemon]]:
    """(the prefill's daemon, the decode's daemon), with GPU backends."""
    _need_stack()
    etcd_url = request.getfixturevalue("etcd") if request.param == "two-nodes" else None
    with kv_daemons(request.param, cudaipc_bin, DAEMON_ARGS, etcd_url) as pair:
        yield pair


def _env(alloc: str) -> Dict[str, str]:
    """The roles' environment: "vmm" makes torch allocate VMM memory (shared by
    descriptor), "legacy" cudaMalloc memory (shared by legacy IPC)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc == "vmm":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def _cfg(dtype: str) -> ModelConfig:
    return ModelConfig(kind="llama", vocab=1000, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, mlp=512,
                       seed=1234, dtype=dtype, device="cuda:0")


@pytest.mark.parametrize("dtype,alloc", [("float32", "vmm"), ("bfloat16", "legacy")])
def test_llama_prefill_and_decode_processes_equal_one_process(daemons, tmp_path, dtype: str, alloc: str) -> None:
    # Every prompt length (one not a multiple of the block size), in float32 (VMM
    # memory) and bfloat16 (cudaMalloc memory): the decode process's tokens equal the
    # reference's and its logits equal them to 1e-5 (the same kernels on the same
    # inputs: a difference means a byte of the cache moved wrong).
    pre, dec = daemons
    requests, lines, res = disaggregate(_cfg(dtype), LENGTHS, STEPS, pre.socket, dec.socket, str(tmp_path / "out.pt"),
                                        env=_env(alloc))
    assert kv.Desc.from_text(requests[0]["desc"]).node == ("" if pre is dec else "a")
    check_decoded(requests, lines, res, rtol=1e-5, atol=1e-5)


def test_llama_killed_prefill_names_the_blocks_and_nothing_else_is_disturbed(daemons, tmp_path) -> None:
    # A prefill engine killed with kill -9 after handing over its request, before the
    # decode side reads it (a read holds leases of the source regions it copies from,
    # across nodes through the source daemon, so only a read starting after the space
    # went can fail, deterministically): the
    # read fails with a BlockError naming the destination blocks, from layer 0, caused
    # by NotFound; the decode process then reads another engine's request and decodes
    # it as one process does, and both daemons still serve puts and gets.
    pre, dec = daemons
    requests, lines, res = killed_prefill(_cfg("float32"), pre.socket, dec.socket, str(tmp_path / "out.pt"),
                                          env=_env("vmm"))
    dead, ok = lines
    assert dead["length"] == 100 and dead["error"] == "BlockError", dead
    assert sorted(dead["error_blocks"]) == sorted(dead["blocks"]) and len(dead["blocks"]) == 7, dead
    assert dead["layer"] == 0 and dead["cause"] == "NotFound", dead
    assert "kvmodel/doomed/kv" in dead["message"], dead
    check_decoded(requests[1:], [ok], res, rtol=1e-5, atol=1e-5)
    for d in {pre.socket, dec.socket}:
        data = os.urandom(1 << 16)
        with cudaipc.connect(d) as st:
            st.put("kvmodel/after", data)
            with st.get("kvmodel/after", timeout=5) as lease:
                assert lease.read() == data
