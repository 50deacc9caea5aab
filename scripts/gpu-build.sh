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
cp scripts/gpu-run.sh .gpu/
# The IPC benchmark's C and Python programs and its driver script
# (bash .gpu/bench/run-gpu.sh).
mkdir -p .gpu/bench && cp scripts/bench/*.c scripts/bench/*.py scripts/bench/*.sh .gpu/bench/
echo "built: $(ls .gpu/bin | tr '\n' ' ')($(du -sh .gpu | cut -f1))"
