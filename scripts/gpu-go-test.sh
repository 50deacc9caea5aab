#!/usr/bin/env bash
# One package's Go tests on the GPU machine, from the binaries scripts/gpu-build.sh
# built, with GPU skips turned into failures: a short device call to re-run tests
# after a fix. Run with carry [".gpu"]:
#
#   bash scripts/gpu-go-test.sh cluster_node 'DaemonKilledMid|GPUStagingPaced' 3
#
# Arguments: the package's binary name (as in .gpu/bin, e.g. cluster_node, root),
# the -test.run pattern, the -test.count (default 1). Output goes to $OUT/go.log;
# a pass/fail/skip count line to stdout.
set -uo pipefail
pkg=${1:?package binary name, e.g. cluster_node}; run=${2:-.}; count=${3:-1}
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
export CUDAIPC_REQUIRE_GPU=${CUDAIPC_REQUIRE_GPU:-$(nvidia-smi -L | grep -c '^GPU')}
[ -e ".gpu/bin/$pkg.test.gz" ] && gunzip -f ".gpu/bin/$pkg.test.gz"
if [ -e .gpu/tools.tar.xz ] && [ ! -d .gpu/tools ]; then mkdir -p .gpu/tools && tar -C .gpu/tools -xJf .gpu/tools.tar.xz; fi
[ -x .gpu/tools/bin/etcd ] && export CUDAIPC_ETCD=${CUDAIPC_ETCD:-$PWD/.gpu/tools/bin/etcd}
dir=$(echo "$pkg" | tr _ /); [ "$pkg" = root ] && dir=.
(cd "$dir" && timeout "${TEST_TIMEOUT:-400}" "$OLDPWD/.gpu/bin/$pkg.test" -test.v -test.run "$run" -test.count "$count" -test.timeout 10m) >"$out/go.log" 2>&1
rc=$?
printf '%s (%s) x%s: pass %d fail %d skip %d rc %d\n' "$pkg" "$run" "$count" \
  "$(grep -a -c -- '^\s*--- PASS' "$out/go.log")" "$(grep -a -c -- '^\s*--- FAIL' "$out/go.log")" \
  "$(grep -a -c -- '^\s*--- SKIP' "$out/go.log")" $rc
grep -a -E -B2 -A20 -- '^\s*--- FAIL' "$out/go.log" | grep -v -E 'raft|level=INFO' | head -60
exit $rc
