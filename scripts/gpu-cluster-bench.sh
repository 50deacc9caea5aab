#!/usr/bin/env bash
# Runs 'cudaipc bench cluster' (issue 18) on the GPU machine, from the
# repository root, after scripts/gpu-build.sh: a private etcd and two daemons
# over UCX tcp on lo, then ucx_perftest on the same link, with the etcd,
# ucx_perftest and Debian UCX 1.13 that .gpu/tools.tar.xz carries (unpacked
# into .gpu/tools/). Each repetition runs the daemons on UCX 1.13 (the same
# libucp as ucx_perftest: CUDAIPC_LIBUCP=.gpu/tools/ucx113/lib/libucp.so.0)
# and, unless CLUSTER_BENCH_UCX=113, on the machine's own UCX (Ubuntu's 1.16;
# ucx_perftest stays 1.13 there). JSON lines go to $OUT/bench-cluster.jsonl and stdout.
#
#   bash .gpu/gpu-cluster-bench.sh                  # 2 repetitions, defaults (1 GiB, 1,000 x 4 KiB)
#   CLUSTER_BENCH_REPS=3 CLUSTER_BENCH_ARGS='--size 256MiB' bash .gpu/gpu-cluster-bench.sh
#   CLUSTER_BENCH=1 bash .gpu/gpu-run.sh '^$'       # the same after the (here: no) tests
set -uo pipefail
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
[ -e .gpu/bin/cudaipc.gz ] && gunzip -f .gpu/bin/cudaipc.gz
if [ ! -d .gpu/tools ]; then
  [ -e .gpu/tools.tar.xz ] || { echo "no .gpu/tools.tar.xz: build with scripts/gpu-build.sh (without NO_TOOLS)"; exit 1; }
  mkdir -p .gpu/tools && tar -C .gpu/tools -xJf .gpu/tools.tar.xz
fi
T=$PWD/.gpu/tools
export PATH=$T/bin:$PATH CUDAIPC_ETCD=$T/bin/etcd UCX_TLS=${UCX_TLS:-tcp} UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
reps=${CLUSTER_BENCH_REPS:-2}
vers=${CLUSTER_BENCH_UCX:-113 system}
rc_all=0
for i in $(seq 1 "$reps"); do
  for v in $vers; do
    if [ "$v" = 113 ]; then
      lib=(env CUDAIPC_LIBUCP="$T/ucx113/lib/libucp.so.0" UCX_MODULE_DIR="$T/ucx113/lib/ucx")
    else
      lib=(env)
    fi
    # shellcheck disable=SC2086 # CLUSTER_BENCH_ARGS is a list of flags
    line=$("${lib[@]}" timeout "${CLUSTER_BENCH_TIMEOUT:-150}" .gpu/bin/cudaipc bench cluster --json ${CLUSTER_BENCH_ARGS:-} 2>"$out/bench-cluster-$v-$i.err" | tr -d '\n ')
    rc=$?; [ $rc -ne 0 ] && rc_all=$rc
    echo "{\"rep\":$i,\"daemon_ucx\":\"$v\",\"rc\":$rc,\"result\":${line:-null}}" | tee -a "$out/bench-cluster.jsonl"
    [ $rc -ne 0 ] && tail -5 "$out/bench-cluster-$v-$i.err"
  done
done
exit $rc_all
