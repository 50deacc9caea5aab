#!/usr/bin/env bash
# The two-GPU run (a machine with two GPUs of one host, e.g. two H200s over NVLink),
# after scripts/gpu-build.sh, with carry [".gpu"]:
#
#   bash scripts/gpu-two.sh
#
# 1. Weight sync with the trainer on GPU 0 and the engine on GPU 1 (Llama-3-8B and
#    the MoE shapes; in place and no-copy) against, in the same run, the peer-copy
#    floor and torch.distributed NCCL broadcast (bucketed and per tensor).
# 2. Every GPU test, Go and Python, with two GPUs required (CUDAIPC_REQUIRE_GPU=2:
#    a test that needs a second GPU fails rather than skips).
# Results under $OUT as gpu-verify.sh writes them (summary.txt, ws.txt, ws.json,
# gotests.log, pytest.log). Fails at once on a machine with fewer than two GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$n" -ge 2 ] || { echo "gpu-two.sh: this machine has $n GPU(s); the run needs two" >&2; exit 2; }
export CUDAIPC_REQUIRE_GPU=2
export WS_ARGS=${WS_ARGS:---models dense,moe --producer-gpu 0 --consumer-gpu 1 --paths cudaipc,cudaipc-nocopy,nccl-bucketed,nccl-per-tensor --versions 5}
export WS_TIMEOUT=${WS_TIMEOUT:-300} XNODE_TIMEOUT=${XNODE_TIMEOUT:-1}
exec bash scripts/gpu-verify.sh
