#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-build.sh.
# Every test binary runs with CUDAIPC_REQUIRE_GPU=<number of GPUs>, so a test
# that would skip for lack of a GPU this machine has fails instead. Logs go to $OUT (or /tmp/gpu-out).
#
#   bash .gpu/gpu-run.sh [test-regexp] [bench-regexp]
#   WEIGHT_SYNC=1 STORE_BENCH=1 bash .gpu/gpu-run.sh   # also the weight-sync and store benchmarks
#   BASE_BIN=.gpu-base/cudaipc-base bash .gpu/gpu-run.sh  # the store round trip against an older build, same run
#   STAGING_BENCH=1 ...                                   # the cluster staging pipeline's chunk-size sweep
#   CLUSTER_BENCH=1 ...                                   # 'cudaipc bench cluster' (gpu-cluster-bench.sh)
#   XNODE_SYNC=1 ...                                      # the cross-node weight sync (weight_sync.py --cross-node)
# Unpacks .gpu/tools.tar.xz into .gpu/tools/ first: etcd at .gpu/tools/bin/etcd,
# ucx_perftest and Debian's UCX 1.13 (see scripts/gpu-build.sh).
set -uo pipefail
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
# Every GPU this machine has must be usable: tests needing up to this many
# GPUs fail instead of skipping.
export CUDAIPC_REQUIRE_GPU=${CUDAIPC_REQUIRE_GPU:-$(nvidia-smi -L | grep -c '^GPU')}
# NVLink multicast must stay off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run=${1:-.}; bench=${2:-}
for f in .gpu/bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
if [ -e .gpu/tools.tar.xz ] && [ ! -d .gpu/tools ]; then mkdir -p .gpu/tools && tar -C .gpu/tools -xJf .gpu/tools.tar.xz; fi
# The cluster tests' etcd (they run in their package directories): without it
# they skip, GPU ones included.
[ -x .gpu/tools/bin/etcd ] && export CUDAIPC_ETCD=${CUDAIPC_ETCD:-$PWD/.gpu/tools/bin/etcd}
nvidia-smi --query-gpu=index,name,uuid,driver_version --format=csv,noheader | tee "$out/nvidia-smi.txt"
.gpu/bin/cudaipc info | tee "$out/info.txt"
total_pass=0; total_fail=0; total_skip=0; failed=""
for t in .gpu/bin/*.test; do
  name=$(basename "$t" .test)
  # Test binaries run in their package directory (testdata, relative paths).
  dir=$(echo "$name" | tr _ /); [ "$name" = root ] && dir=.
  ( cd "$dir" 2>/dev/null || cd .; "$OLDPWD/$t" -test.v -test.count=1 -test.timeout=8m -test.run "$run" ) >"$out/$name.log" 2>&1
  rc=$?
  p=$(grep -c -- '^\s*--- PASS' "$out/$name.log"); f=$(grep -c -- '^\s*--- FAIL' "$out/$name.log"); s=$(grep -c -- '^\s*--- SKIP' "$out/$name.log")
  total_pass=$((total_pass+p)); total_fail=$((total_fail+f)); total_skip=$((total_skip+s))
  [ $rc -ne 0 ] && failed="$failed $name(rc=$rc)"
  printf '%-22s pass %3d  fail %3d  skip %3d  rc %d\n' "$name" "$p" "$f" "$s" "$rc"
done | tee "$out/summary.txt"
if [ -n "$bench" ]; then
  for t in .gpu/bin/*.test; do
    name=$(basename "$t" .test)
    "$t" -test.run '^$' -test.bench "$bench" -test.benchtime=200x -test.count=1 2>&1 | grep -E '^(Benchmark|ok|FAIL|---)' | tee -a "$out/bench.txt"
  done
fi
# The Python client's tests, with the CLI just built (GPU tests fail instead of skipping).
if [ -z "${SKIP_PYTHON:-}" ] && python3 -c 'import google.protobuf, pytest' 2>/dev/null; then
  ( cd python && CUDAIPC_BIN="$OLDPWD/.gpu/bin/cudaipc" timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -q -rfE -p no:cacheprovider tests ) >"$out/pytest.log" 2>&1
  echo "pytest rc=$?: $(tail -1 "$out/pytest.log")" | tee -a "$out/summary.txt"
fi
# The weight-sync benchmark (issue 10), when asked for: WEIGHT_SYNC=1.
if [ -n "${WEIGHT_SYNC:-}" ]; then
  timeout 200 python3 scripts/bench/weight_sync.py --bin .gpu/bin/cudaipc --json "$out/weight-sync.json" >"$out/weight-sync.txt" 2>&1
  echo "weight_sync rc=$?" | tee -a "$out/summary.txt"
fi
# The store benchmarks (issues 8 and 9), when asked for: STORE_BENCH=1. The Go bench
# starts its own daemon per row; the Python bench starts one per mode and runs the Go
# bench against it in the same run.
if [ -n "${STORE_BENCH:-}" ]; then
  for dev in host 0; do for n in 1 8; do
    timeout 60 .gpu/bin/cudaipc bench store --device "$dev" --clients "$n" --duration "${STORE_BENCH_DURATION:-2s}" --json >"$out/bench-store-$dev-$n.json" 2>"$out/bench-store-$dev-$n.err"
    echo "bench store device=$dev clients=$n rc=$?" | tee -a "$out/summary.txt"
  done; done
  for mode in ipc fd; do
    ( cd python && timeout 120 python3 bench/bench_store.py --bin "$OLDPWD/.gpu/bin/cudaipc" --device 0 --gpu-share "$mode" --duration 1 --put-gib 1 ) >"$out/py-bench-$mode.txt" 2>&1
    echo "python bench_store $mode rc=$?" | tee -a "$out/summary.txt"
    ( cd python && timeout 60 python3 bench/put_phases.py --bin "$OLDPWD/.gpu/bin/cudaipc" --device 0 --gpu-share "$mode" ) >"$out/py-put-phases-$mode.txt" 2>&1
    echo "python put_phases $mode rc=$?" | tee -a "$out/summary.txt"
  done
fi
# The store round trip of this build against an older one, alternated in the same run
# (issue 17: not slower): BASE_BIN=path/to/old/cudaipc.
if [ -n "${BASE_BIN:-}" ]; then
  [ -e "$BASE_BIN.gz" ] && gunzip -f "$BASE_BIN.gz"
  OUT=$out timeout 180 bash .gpu/bench/store-roundtrip.sh -r "${BASE_ROUNDS:-2}" "$BASE_BIN" .gpu/bin/cudaipc >"$out/store-before-after.txt" 2>&1
  echo "store before/after rc=$?" | tee -a "$out/summary.txt"; cat "$out/store-before-after.txt"
fi
# The cross-node weight sync (issue 19): XNODE_SYNC=1 (two daemons on this machine's
# loopback, its floors and torch.distributed beside it; XNODE_ARGS adds flags, e.g.
# '--models dense --versions 2').
if [ -n "${XNODE_SYNC:-}" ]; then
  # shellcheck disable=SC2086 # XNODE_ARGS is a list of flags
  PYTHONUNBUFFERED=1 timeout "${XNODE_TIMEOUT:-330}" python3 scripts/bench/weight_sync.py --cross-node --bin .gpu/bin/cudaipc \
    --etcd "$PWD/.gpu/tools/bin/etcd" --ucxperf-test "$PWD/.gpu/bin/transport_ucx_ucxperf.test" \
    --json "$out/xnode.json" ${XNODE_ARGS:-} >"$out/xnode.txt" 2>&1
  echo "cross-node weight sync rc=$?" | tee -a "$out/summary.txt"; grep -v -i warn "$out/xnode.txt" | head -40
fi
# The GPU staging pipeline's chunk-size sweep (issue 19): STAGING_BENCH=1.
if [ -n "${STAGING_BENCH:-}" ] && [ -x .gpu/bin/cluster_staging.test ]; then
  ( cd cluster/staging && CUDAIPC_STAGING_BENCH=1 timeout "${STAGING_TIMEOUT:-90}" "$OLDPWD/.gpu/bin/cluster_staging.test" -test.run '^$' -test.bench StagedCopy -test.benchtime 3x ) >"$out/staging-bench.txt" 2>&1
  echo "staging bench rc=$?" | tee -a "$out/summary.txt"
fi
# The cluster benchmark (issue 18): CLUSTER_BENCH=1.
if [ -n "${CLUSTER_BENCH:-}" ]; then
  OUT=$out bash .gpu/gpu-cluster-bench.sh
  echo "cluster bench rc=$?" | tee -a "$out/summary.txt"
fi
grep -h -B2 -A20 -- '--- FAIL' "$out"/*.log | head -150
grep -h -E '^(FAILED|ERROR)' "$out/pytest.log" 2>/dev/null | head -30
# The device tool brings back at most 8 files: everything in one archive, the
# summary beside it.
( cd "$out" && tar czf /tmp/gpu-logs.tgz --exclude=logs.tgz . && find . -maxdepth 1 -type f ! -name summary.txt ! -name bench-cluster.jsonl -delete && mv /tmp/gpu-logs.tgz logs.tgz )
echo "logs in $out/logs.tgz (summary in $out/summary.txt)"
