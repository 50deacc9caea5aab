#!/usr/bin/env bash
# One device call that checks a stop's GPU work when device time is short:
# the benchmark that needs a quiet GPU first, then every GPU test (Go and
# Python) while the cross-node benchmark runs beside them. Every step has its
# own time limit and writes its results as it ends, so a call cut short still
# brings back what finished. Run after scripts/gpu-build.sh, with carry [".gpu"]:
#
#   bash scripts/gpu-verify.sh
#
# Environment: ISOLATE (Go tests run apart, after the rest of their package;
# default DaemonKilledMid), WS_ARGS (weight_sync.py flags; default both models, in place
# and no-copy, 5 versions), WS_TIMEOUT (170), XNODE_ARGS (default the 8B
# shapes, 3 versions), XNODE_TIMEOUT (300), TEST_TIMEOUT (300, Go and Python
# each), TEST_RUN (Go -test.run regexp, default all), GATHER_COMPARE=1 (the in-place
# path's copies with and without the gather kernel, step 1b), XNODE_ALONE=1 (the
# cross-node benchmark alone on the machine, before the tests, instead of beside
# them), TEST_BINS (which Go test binaries, in that order, e.g. "store cluster_node";
# default all), XNODE_VARIANTS (e.g. "--lanes 4;--lanes 8": after it, the cudaipc path
# again with each set of flags, appended to xnode.txt; 45 s each).
# At most 8 files come back from $OUT: summary.txt, ws.{txt,json},
# xnode.{txt,json}, gotests.log, pytest.log.
set -uo pipefail
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"; sum=$out/summary.txt
export CUDAIPC_REQUIRE_GPU=${CUDAIPC_REQUIRE_GPU:-$(nvidia-smi -L | grep -c '^GPU')}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for f in .gpu/bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
if [ -e .gpu/tools.tar.xz ] && [ ! -d .gpu/tools ]; then mkdir -p .gpu/tools && tar -C .gpu/tools -xJf .gpu/tools.tar.xz; fi
[ -x .gpu/tools/bin/etcd ] && export CUDAIPC_ETCD=${CUDAIPC_ETCD:-$PWD/.gpu/tools/bin/etcd}
stamp() { echo "[$(date +%T)] $*" | tee -a "$sum"; }
stamp "start: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

# 1. Same-GPU weight sync (issue 20), alone on the GPU.
# shellcheck disable=SC2086 # WS_ARGS is a list of flags
timeout "${WS_TIMEOUT:-170}" python3 scripts/bench/weight_sync.py --bin .gpu/bin/cudaipc \
  ${WS_ARGS:---models dense,moe --paths cudaipc,cudaipc-nocopy --versions 5} \
  --json "$out/ws.json" >"$out/ws.txt" 2>&1
stamp "weight_sync rc=$?"
# 1b. With GATHER_COMPARE=1: the in-place 8B path with the gather kernel off, copying every
# size both ways, and limited to copies under 16 MiB both ways (CUDAIPC_GATHER,
# CUDAIPC_GATHER_MAX_BYTES), beside step 1's defaults, appended to ws.txt.
if [ -n "${GATHER_COMPARE:-}" ]; then
  for v in CUDAIPC_GATHER=0 CUDAIPC_GATHER_MAX_BYTES=$((1 << 62)) CUDAIPC_GATHER_MAX_BYTES=16777216; do
    echo "== $v" >>"$out/ws.txt"
    env "$v" timeout 60 python3 scripts/bench/weight_sync.py --bin .gpu/bin/cudaipc --models dense \
      --paths cudaipc --versions 5 >>"$out/ws.txt" 2>&1
    stamp "weight_sync $v rc=$?"
  done
fi

# 2. The cross-node weight sync (issue 19), beside every GPU test or (XNODE_ALONE=1) alone first.
xnode() {
  local x=(python3 scripts/bench/weight_sync.py --cross-node --bin .gpu/bin/cudaipc
    --etcd "$PWD/.gpu/tools/bin/etcd" --ucxperf-test "$PWD/.gpu/bin/transport_ucx_ucxperf.test")
  # shellcheck disable=SC2086 # XNODE_ARGS is a list of flags
  PYTHONUNBUFFERED=1 timeout "${XNODE_TIMEOUT:-300}" "${x[@]}" ${XNODE_ARGS:---models dense --versions 3} \
    --json "$out/xnode.json" >"$out/xnode.txt" 2>&1
  stamp "cross-node weight sync rc=$?"
  local v variants
  IFS=';' read -ra variants <<<"${XNODE_VARIANTS:-}"
  for v in "${variants[@]}"; do
    echo "== $v" >>"$out/xnode.txt"
    # shellcheck disable=SC2086 # v is a list of flags
    PYTHONUNBUFFERED=1 timeout 45 "${x[@]}" --models dense --versions 3 --paths cudaipc-cluster --no-floors $v \
      >>"$out/xnode.txt" 2>&1
    stamp "cross-node weight sync $v rc=$?"
  done
}
if [ -n "${XNODE_ALONE:-}" ]; then xnode; else xnode & fi
(
  # Tests matching ISOLATE (default: the daemon kill -9 tests, whose holder UCX can
  # abort over tcp: docs/cluster.md, "Failure behaviour") run in an invocation of
  # their own after the rest of their package, so that an abort there hides no other test.
  iso=${ISOLATE:-DaemonKilledMid}
  # TEST_BINS: which test binaries, in this order (names as in .gpu/bin, without .test).
  bins=(.gpu/bin/*.test); [ -n "${TEST_BINS:-}" ] && read -ra bins <<<"$(printf '.gpu/bin/%s.test ' $TEST_BINS)"
  for t in "${bins[@]}"; do
    name=$(basename "$t" .test); dir=$(echo "$name" | tr _ /); [ "$name" = root ] && dir=.
    echo "=== $name" >>"$out/gotests.log"
    for part in rest isolated; do
      # With TEST_RUN: that alone, in one invocation.
      sel=(-test.run "${TEST_RUN:-.}"); [ -z "${TEST_RUN:-}" ] && sel+=(-test.skip "$iso")
      [ $part = isolated ] && sel=(-test.run "$iso")
      [ $part = isolated ] && [ -n "${TEST_RUN:-}" ] && continue
      log=/tmp/go-$name-$part.log
      ( cd "$dir" 2>/dev/null || cd .; timeout "${TEST_TIMEOUT:-300}" "$OLDPWD/$t" -test.v -test.count=1 \
          -test.timeout=5m "${sel[@]}" ) >"$log" 2>&1
      rc=$?
      p=$(grep -a -c -- '^\s*--- PASS' "$log"); f=$(grep -a -c -- '^\s*--- FAIL' "$log")
      s=$(grep -a -c -- '^\s*--- SKIP' "$log")
      [ $part = isolated ] && [ $rc -eq 0 ] && [ "$p$f$s" = 000 ] && continue
      # All of a failing run's log; of a passing one, its skips and verdict.
      if [ "$f" -gt 0 ] || [ $rc -ne 0 ]; then cat "$log"; else grep -a -E -A1 -- '--- SKIP|^(ok|PASS|FAIL)' "$log"; fi >>"$out/gotests.log"
      tag=$name; [ $part = isolated ] && tag="$name ($iso)"
      stamp "$(printf 'go %-22s pass %3d fail %3d skip %3d rc %d' "$tag" "$p" "$f" "$s" "$rc")"
    done
  done
) &
(
  cd python && CUDAIPC_BIN="$OLDPWD/.gpu/bin/cudaipc" timeout "${TEST_TIMEOUT:-300}" \
    python3 -m pytest -q -rfEs -p no:cacheprovider tests >"$out/pytest.log" 2>&1
  rc=$?; last=$(tail -1 "$out/pytest.log")
  # A run cut short has no summary line: never report it as a pass (on
  # 2026-12-02 one stopped at TEST_TIMEOUT with its status read as 0).
  case "$last" in *passed* | *failed* | *error*) ;; *) last="no summary line, cut short: $last"; rc="$rc, incomplete" ;; esac
  echo "[$(date +%T)] pytest rc=$rc: $last" >>"$sum"
) &
wait
stamp "done"
