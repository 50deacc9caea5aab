#!/usr/bin/env bash
# Builds everything the GPU machine runs into .gpu/ (ignored by git): one
# test binary per package whose tests use a GPU or UCX, the CLI, and gpu-run.sh. The GPU
# machine has no Go toolchain; these are static CGO_ENABLED=0 binaries.
#
#   scripts/gpu-build.sh            # then run .gpu/gpu-run.sh on the GPU machine,
#                                   # e.g. device run with carry [".gpu"]:
#                                   #   bash .gpu/gpu-run.sh
#                                   # or the IPC benchmark table:
#                                   #   bash .gpu/bench/run-gpu.sh
#                                   # or the cluster benchmark (issue 18):
#                                   #   bash .gpu/gpu-cluster-bench.sh (or CLUSTER_BENCH=1 with gpu-run.sh)
#
# The GPU machine has no etcd and no ucx_perftest, and its UCX is Ubuntu's 1.16.
# .gpu/tools.tar.xz carries, from this Debian machine, what the cluster
# benchmark needs; gpu-run.sh unpacks it into .gpu/tools/:
#   .gpu/tools/bin/etcd           Debian's etcd-server (3.4.23; needs only libc): other
#                                 GPU-machine work (e.g. a cross-node weight sync) may use it
#   .gpu/tools/bin/ucx_perftest   a wrapper running Debian's ucx_perftest (UCX 1.13) with
#                                 the libraries below
#   .gpu/tools/ucx113/lib/        Debian's libucp/libuct/libucs/libucm 1.13 and their
#                                 modules (ucx/), for cudaipc's CUDAIPC_LIBUCP / ucx-lib setting,
#                                 so the daemons and ucx_perftest run the same UCX
# NO_TOOLS=1 leaves them out (~6.5 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/bin
export CGO_ENABLED=0 GOOS=linux GOARCH=amd64
# Only packages whose tests use the GPU (testutil.RequireGPU...) or UCX (Ubuntu's 1.16
# there, Debian's 1.13 in CI) travel: the device tool carries at most 64 MiB, and the
# etcd-bearing cluster test binaries are ~6 MiB each. GPU_PKGS='./a ./b' overrides.
pkgs=${GPU_PKGS:-$(go list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.Dir}} {{.ImportPath}}{{end}}' ./... |
  while read -r dir pkg; do
    if grep -lqE 'RequireGPU|GPURequired|RequireUCX|ucx\.' "$dir"/*_test.go 2>/dev/null; then echo "$pkg"; fi
  done)}
for pkg in $pkgs; do
  name=$(echo "${pkg#github.com/cudaipc/cudaipc}" | tr / _)
  name=${name:-_root}; name=${name#_}; name=${name:-root}
  go test -c -trimpath -ldflags="-s -w" -o ".gpu/bin/$name.test" "$pkg"
done
go build -trimpath -ldflags="-s -w" -o .gpu/bin/cudaipc ./cmd/cudaipc
# Compressed, so that .gpu stays under the device tool's 64 MiB carry limit;
# gpu-run.sh and bench/run-gpu.sh unpack them.
gzip -9 .gpu/bin/*
cp scripts/gpu-run.sh scripts/gpu-cluster-bench.sh .gpu/
if [ -z "${NO_TOOLS:-}" ]; then
  lib=/usr/lib/x86_64-linux-gnu
  for f in /usr/bin/etcd /usr/bin/ucx_perftest $lib/libucp.so.0; do
    [ -e "$f" ] || { echo "gpu-build.sh: $f missing: apt-get install etcd-server ucx-utils libucx0 (or NO_TOOLS=1)" >&2; exit 1; }
  done
  t=.gpu/tools-staging; mkdir -p $t/bin $t/ucx113/bin $t/ucx113/lib/ucx $t/ucx113/compat
  cp /usr/bin/etcd $t/bin/
  cp /usr/bin/ucx_perftest $t/ucx113/bin/
  # cp -L: the sonames, resolved (the device tool carries links only as links).
  for l in libucp libuct libucs libucm libucs_signal; do cp -L $lib/$l.so.0 $t/ucx113/lib/; done
  cp -L $lib/ucx/libuct_cma.so.0 $t/ucx113/lib/ucx/   # tcp, sysv/posix shm live in libuct itself
  # ucx_perftest's own needs, used only where the GPU machine lacks them.
  cp -L $lib/libnuma.so.1 $lib/libgomp.so.1 $t/ucx113/compat/
  cat >$t/bin/ucx_perftest <<'WRAP'
#!/usr/bin/env bash
# Debian's ucx_perftest (UCX 1.13) with the UCX libraries it was built with.
d=$(cd "$(dirname "$0")/../ucx113" && pwd)
lp=$d/lib
for so in libnuma.so.1 libgomp.so.1; do ldconfig -p | grep -q "$so" || { lp=$lp:$d/compat; break; }; done
export LD_LIBRARY_PATH=$lp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} UCX_MODULE_DIR=$d/lib/ucx
exec "$d/bin/ucx_perftest" "$@"
WRAP
  chmod +x $t/bin/ucx_perftest
  # xz: etcd is 21 MB, 5.8 MB in xz (7.8 MB in gzip).
  tar -C $t -cf - . | xz -9 -T0 >.gpu/tools.tar.xz
  rm -rf $t
fi
# The IPC benchmark's C and Python programs and its driver script
# (bash .gpu/bench/run-gpu.sh).
mkdir -p .gpu/bench && cp scripts/bench/*.c scripts/bench/*.py scripts/bench/*.sh .gpu/bench/
echo "built: $(ls .gpu/bin | tr '\n' ' ')($(du -sh .gpu | cut -f1))"
