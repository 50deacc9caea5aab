#!/usr/bin/env bash
# Runs 'cudaipc bench cluster' (issue 18) on the GPU machine, from the
# repository root, after scripts/gpu-build.sh: a private etcd and two daemons
# over UCX tcp on lo, then ucx_perftest on the same link, with the etcd,
# ucx_perftest and Debian UCX 1.13 that .gpu/tools.tar.xz carries (unpacked
# into .gpu/tools/). Each repetition runs the daemons on UCX 1.13 (the same
# libucp as ucx_perftest: CUDAIPC_LIBUCP=.gpu/tools/ucx113/lib/libucp.so.0)
# and, unless CLUSTER_BENCH_UCX=113, on the machine's own UCX (Ubuntu's 1.16;
# ucx_perftest stays 1.13 there). JSON lines go to $OUT/bench-cluster.jsonl and stdout, the daemons'
# stderr to $OUT/bench-cluster-err.tgz.
#
#   bash .gpu/gpu-cluster-bench.sh                  # 2 repetitions, defaults (1 GiB, 1,000 x 4 KiB)
#   CLUSTER_BENCH_REPS=3 CLUSTER_BENCH_ARGS='--size 256MiB' bash .gpu/gpu-cluster-bench.sh
#   CLUSTER_BENCH=1 bash .gpu/gpu-run.sh '^$'       # the same after the (here: no) tests
#   CLUSTER_BENCH_BASE=.gpu/bin/cudaipc-base ...    # also an older build (e.g. built here with
#       git worktree add /tmp/b REV && (cd /tmp/b && CGO_ENABLED=0 go build -trimpath
#       -ldflags='-s -w' -o \$OLDPWD/.gpu/bin/cudaipc-base ./cmd/cudaipc) && gzip -9 .gpu/bin/cudaipc-base),
#       alternated with this one in every repetition on UCX 1.13, its lines marked "build":"base"
#   CLUSTER_BENCH_EXTRA='--streams 4' ...          # also this build with these flags, on UCX 1.13,
#       in every repetition, marked "build":"this-extra"
#   CLUSTER_BENCH_TRANSPORT=1 ...                   # first the transport alone against ucx_perftest
#       (BenchmarkGet1GiB of transport/ucx/ucxperf, UCX 1.13), when its test binary is in .gpu/bin
set -uo pipefail
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
# The folder this script lies in (.gpu, or a copy carried under another name).
G=$(cd "$(dirname "$0")" && pwd)
for f in "$G/bin/cudaipc.gz" "$G/bin/transport_ucx_ucxperf.test.gz" ${CLUSTER_BENCH_BASE:+$CLUSTER_BENCH_BASE.gz}; do
  [ -e "$f" ] && gunzip -f "$f"
done
if [ ! -d "$G/tools" ]; then
  [ -e "$G/tools.tar.xz" ] || { echo "no $G/tools.tar.xz: build with scripts/gpu-build.sh (without NO_TOOLS)"; exit 1; }
  mkdir -p "$G/tools" && tar -C "$G/tools" -xJf "$G/tools.tar.xz"
fi
T=$G/tools
export PATH=$T/bin:$PATH CUDAIPC_ETCD=$T/bin/etcd UCX_TLS=${UCX_TLS:-tcp} UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
reps=${CLUSTER_BENCH_REPS:-2}
vers=${CLUSTER_BENCH_UCX:-113 system}
rc_all=0
T113=(env CUDAIPC_LIBUCP="$T/ucx113/lib/libucp.so.0" UCX_MODULE_DIR="$T/ucx113/lib/ucx")
if [ -n "${CLUSTER_BENCH_TRANSPORT:-}" ] && [ -x "$G/bin/transport_ucx_ucxperf.test" ]; then
  ( cd transport/ucx/ucxperf && "${T113[@]}" timeout 150 "$G/bin/transport_ucx_ucxperf.test" -test.run '^$' \
      -test.bench Get1GiB -test.benchtime 2x -test.v ) >"$out/transport-get1gib.txt" 2>&1
  echo "transport alone rc=$?: $(grep -a -E '^BenchmarkGet1GiB|ours ' "$out/transport-get1gib.txt" | tr -s ' \t' ' ')" | tee -a "$out/bench-cluster.txt"
fi
one() { # build-name binary ucx-name [flags...]
  local name=$1 bin=$2 v=$3 lib=(env) line rc
  shift 3
  [ "$v" = 113 ] && lib=("${T113[@]}")
  # shellcheck disable=SC2086 # CLUSTER_BENCH_ARGS is a list of flags
  line=$("${lib[@]}" timeout "${CLUSTER_BENCH_TIMEOUT:-150}" "$bin" bench cluster --json ${CLUSTER_BENCH_ARGS:-} "$@" 2>"$out/bench-cluster-$name-$v-$i.err" | tr -d '\n')
  rc=$?; [ $rc -ne 0 ] && rc_all=$rc
  echo "{\"rep\":$i,\"build\":\"$name\",\"flags\":\"$*\",\"daemon_ucx\":\"$v\",\"rc\":$rc,\"result\":${line:-null}}" | tee -a "$out/bench-cluster.jsonl"
  [ $rc -ne 0 ] && tail -5 "$out/bench-cluster-$name-$v-$i.err"
}
for i in $(seq 1 "$reps"); do
  if [ -n "${CLUSTER_BENCH_BASE:-}" ]; then
    # Alternated: the base first in odd repetitions, second in even ones.
    if [ $((i % 2)) = 1 ]; then one base "$CLUSTER_BENCH_BASE" 113; one this "$G/bin/cudaipc" 113
    else one this "$G/bin/cudaipc" 113; one base "$CLUSTER_BENCH_BASE" 113; fi
    for v in $vers; do [ "$v" != 113 ] && one this "$G/bin/cudaipc" "$v"; done
  else
    for v in $vers; do one this "$G/bin/cudaipc" "$v"; done
  fi
  # shellcheck disable=SC2086 # a list of flags
  [ -n "${CLUSTER_BENCH_EXTRA:-}" ] && one this-extra "$G/bin/cudaipc" 113 $CLUSTER_BENCH_EXTRA
done
# The device tool brings back at most 8 files: the daemons' stderr in one archive.
( cd "$out" && ls bench-cluster-*.err >/dev/null 2>&1 && tar czf bench-cluster-err.tgz bench-cluster-*.err && rm -f bench-cluster-*.err )
exit $rc_all
