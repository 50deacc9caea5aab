#!/usr/bin/env bash
# One short device call for the KV paths (docs/kv.md) when device time is
# short: the one-node read benchmark on a quiet GPU first, then, side by side,
# the Go tests that touch KV spaces and GPU staging and the Python KV tests
# (one node, across nodes, the real-model tests, the benchmark's smoke), with
# CUDAIPC_REQUIRE_GPU set. Run after scripts/gpu-build.sh, with carry [".gpu"]:
#
#   bash scripts/gpu-kv.sh
#
# Environment: KV_TOKENS (the benchmark's sizes, default 128,1024,8192,32768;
# none: no benchmark), TEST_TIMEOUT (seconds for each Go binary and for pytest;
# default 240), GO_SPECS (the Go tests, "binary regexp" pairs separated by ";"),
# PY_TESTS (the pytest files).
# Files under $OUT: kvbench.txt, gotests.log, pytest.log, summary.txt.
set -uo pipefail
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"; sum=$out/summary.txt
export CUDAIPC_REQUIRE_GPU=${CUDAIPC_REQUIRE_GPU:-$(nvidia-smi -L | grep -c '^GPU')}
for f in .gpu/bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
if [ -e .gpu/tools.tar.xz ] && [ ! -d .gpu/tools ]; then mkdir -p .gpu/tools && tar -C .gpu/tools -xJf .gpu/tools.tar.xz; fi
[ -x .gpu/tools/bin/etcd ] && export CUDAIPC_ETCD=${CUDAIPC_ETCD:-$PWD/.gpu/tools/bin/etcd}
stamp() { echo "[$(date +%T)] $*" | tee -a "$sum"; }
stamp "start: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
t=${TEST_TIMEOUT:-240}
if [ "${KV_TOKENS:-}" != none ]; then
  (cd kv && KV_BENCH_GPU=1 KV_BENCH_TOKENS=${KV_TOKENS:-128,1024,8192,32768} timeout 90 ../.gpu/bin/kv.test \
    -test.run '^$' -test.bench BenchmarkReadBlocks -test.benchtime 20x) >"$out/kvbench.txt" 2>&1
  stamp "kv benchmark rc=$?"
fi
py_tests=${PY_TESTS:-tests/test_kv_gpu.py tests/test_kv_xnode_gpu.py tests/test_kv_model_gpu.py tests/test_kv_prefix_gpu.py tests/test_kv_bench.py tests/test_kv_xnode.py tests/test_external_gpu.py tests/test_nocopy.py}
(
  IFS=';' read -ra specs <<<"${GO_SPECS:-kv .;cluster_node GPU|KVRead|KVNotify;root Gather|RegisterHost}"
  for spec in "${specs[@]}"; do
    read -r name run <<<"$spec"
    dir=$(echo "$name" | tr _ /); [ "$name" = root ] && dir=.
    log=/tmp/gokv-$name.log
    ( cd "$dir" && timeout "$t" "$OLDPWD/.gpu/bin/$name.test" -test.v -test.count=1 -test.run "$run" ) >"$log" 2>&1
    rc=$?
    p=$(grep -a -c -- '^\s*--- PASS' "$log"); f=$(grep -a -c -- '^\s*--- FAIL' "$log"); s=$(grep -a -c -- '^\s*--- SKIP' "$log")
    if [ "$f" -gt 0 ] || [ $rc -ne 0 ]; then cat "$log"; else grep -a -E -A1 -- '--- SKIP|^(ok|PASS|FAIL)' "$log"; fi >>"$out/gotests.log"
    stamp "$(printf 'go %-14s %-24s pass %3d fail %3d skip %3d rc %d' "$name" "$run" "$p" "$f" "$s" "$rc")"
  done
) &
(
  cd python && CUDAIPC_BIN="$OLDPWD/.gpu/bin/cudaipc" timeout "$t" python3 -m pytest -q -rfEs -p no:cacheprovider \
    $py_tests >"$out/pytest.log" 2>&1
  rc=$?; last=$(tail -1 "$out/pytest.log")
  case "$last" in *passed* | *failed* | *error*) ;; *) last="no summary line, cut short: $last"; rc="$rc, incomplete" ;; esac
  echo "[$(date +%T)] pytest rc=$rc: $last" >>"$sum"
) &
wait
stamp "done"
