#!/usr/bin/env bash
# A short device call for cluster GPU work: the root package's tests and
# benchmarks matching ROOT_RUN, then the cross-node weight sync (8B shapes)
# with its floors at the daemons' defaults, each daemon's CPU profile beside
# it (xnode-A.pprof, xnode-B.pprof) and XNODE_ARGS's flags, then XNODE_VARIANTS (';'-separated flag
# sets, without floors, VARIANT_TIMEOUT seconds each, default 60), then the Go tests of NODE_PKGS matching NODE_RUN.
# Run after scripts/gpu-build.sh, with carry [".gpu"]:
#
#   ROOT_RUN=CRC32C NODE_RUN=GPU XNODE_VARIANTS="--lanes 8;--checksums host" bash scripts/gpu-xnode-check.sh
#
# Issue 19's bound over several runs, each with fresh daemons (about 20 s a run
# after the floors): XNODE_TIMEOUT=300 XNODE_ARGS="--repeats 5" NODE_PKGS=NONE bash scripts/gpu-xnode-check.sh
# and paired against other daemon flags (runs 2, 4, ... with them):
#   XNODE_TIMEOUT=400 XNODE_ARGS="--repeats 8" XNODE_ALTERNATE="--lanes 16" NODE_PKGS=NONE bash scripts/gpu-xnode-check.sh
#
# Files back from $OUT: summary.txt, topology.txt, root.log, xnode.txt, xnode-{A,B}.pprof, node.log.
# BIN_DIR (default .gpu/bin) takes the CLI and test binaries from another build
# (e.g. a branch's, built with GPU_PKGS and NO_TOOLS=1 and moved to .gpu-branch/bin):
# the tools and ucxperf's test binary stay .gpu's.
# The device tool brings back at most 8 files: a second run in the same call writes
# to OUT=/tmp/o2 and copies what it needs into $OUT (e.g. xnode.txt as block-xnode.txt).
set -uo pipefail
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"; sum=$out/summary.txt
export CUDAIPC_REQUIRE_GPU=${CUDAIPC_REQUIRE_GPU:-$(nvidia-smi -L | grep -c '^GPU')}
bin=${BIN_DIR:-.gpu/bin}
for f in .gpu/bin/*.gz "$bin"/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
if [ -e .gpu/tools.tar.xz ] && [ ! -d .gpu/tools ]; then mkdir -p .gpu/tools && tar -C .gpu/tools -xJf .gpu/tools.tar.xz; fi
export CUDAIPC_ETCD=$PWD/.gpu/tools/bin/etcd
stamp() { echo "[$(date +%T)] $*" | tee -a "$sum"; }
{ # The host's layout, for NUMA questions: GPUs and their NUMA nodes and CPUs.
  nvidia-smi topo -m; lscpu | grep -E 'NUMA|Socket|Model name|^CPU\(s\)'
  command -v numactl >/dev/null && numactl --hardware
  for d in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader); do
    p=/sys/bus/pci/devices/$(echo "${d: -12}" | tr 'A-F' 'a-f') # 00000000:19:00.0 -> 0000:19:00.0
    echo "GPU $d: numa_node $(cat "$p/numa_node" 2>/dev/null) local_cpulist $(cat "$p/local_cpulist" 2>/dev/null)"
  done
} >"$out/topology.txt" 2>&1
count() { printf 'pass %d fail %d skip %d' "$(grep -a -c -- '^\s*--- PASS' "$1")" "$(grep -a -c -- '^\s*--- FAIL' "$1")" "$(grep -a -c -- '^\s*--- SKIP' "$1")"; }
if [ -n "${ROOT_RUN:-}" ]; then
  timeout 120 "$bin/root.test" -test.v -test.run "$ROOT_RUN" -test.bench "$ROOT_RUN" -test.benchtime 3x >"$out/root.log" 2>&1
  rc=$?; stamp "go root ($ROOT_RUN) $(count "$out/root.log") rc $rc"
  [ $rc -ne 0 ] && [ -z "${KEEP_GOING:-}" ] && exit 1
fi
x=(python3 scripts/bench/weight_sync.py --cross-node --bin "$bin/cudaipc" --etcd "$CUDAIPC_ETCD"
  --ucxperf-test "$PWD/.gpu/bin/transport_ucx_ucxperf.test" --models dense --versions 3)
# shellcheck disable=SC2086 # XNODE_ARGS is a list of flags
PYTHONUNBUFFERED=1 timeout "${XNODE_TIMEOUT:-170}" "${x[@]}" --cpu-profile "$out/xnode" ${XNODE_ARGS:-} \
  ${XNODE_ALTERNATE:+--alternate "$XNODE_ALTERNATE"} >"$out/xnode.txt" 2>&1
stamp "cross-node weight sync rc=$?"
IFS=';' read -ra variants <<<"${XNODE_VARIANTS:-}"
for v in "${variants[@]}"; do
  echo "== $v" >>"$out/xnode.txt"
  # shellcheck disable=SC2086 # v is a list of flags
  PYTHONUNBUFFERED=1 timeout "${VARIANT_TIMEOUT:-60}" "${x[@]}" --paths cudaipc-cluster --no-floors $v >>"$out/xnode.txt" 2>&1
  stamp "cross-node weight sync $v rc=$?"
done
for p in ${NODE_PKGS:-cluster_node cluster_staging}; do
  dir=$(echo "$p" | tr _ /)
  (cd "$dir" && timeout "${TEST_TIMEOUT:-200}" "$OLDPWD/$bin/$p.test" -test.v -test.run "${NODE_RUN:-.}" -test.timeout 5m) >/tmp/$p.log 2>&1
  rc=$?; stamp "go $p (${NODE_RUN:-.}) $(count /tmp/$p.log) rc $rc"
  if [ $rc -ne 0 ]; then cat /tmp/$p.log; else grep -a -E -A1 -- '--- SKIP|^(ok|PASS|FAIL)' /tmp/$p.log; fi >>"$out/node.log"
done
stamp done
