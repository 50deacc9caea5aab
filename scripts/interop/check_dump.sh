#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh: exports a 64 MiB region at
# an odd offset from CuPy and from PyTorch (cupy_region.py) and checks that
# `cudaipc dump` of each writes the same bytes (by SHA-256).
#
#   bash scripts/interop/check_dump.sh [cupy] [torch]
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${CUDAIPC:-.gpu/bin/cudaipc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
libs=("$@")
[ ${#libs[@]} -eq 0 ] && libs=(cupy torch)
fail=0
for lib in "${libs[@]}"; do
  mkfifo "$tmp/hold"
  python3 scripts/interop/cupy_region.py --lib "$lib" --size $((64 << 20)) --offset 12345 <"$tmp/hold" >"$tmp/out.txt" 2>"$tmp/err.txt" &
  pid=$!
  exec 3>"$tmp/hold" # the exporter holds its memory until this closes
  for _ in $(seq 1 600); do
    [ "$(wc -l <"$tmp/out.txt")" -ge 2 ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  head -1 "$tmp/out.txt" >"$tmp/region.json"
  want=$(sed -n 2p "$tmp/out.txt" | awk '{print $2}')
  got=$("$bin" dump --region @"$tmp/region.json" -o "$tmp/dump.bin" --sha256 2>"$tmp/dump.txt"; awk '/^sha256/{print $2}' "$tmp/dump.txt")
  exec 3>&-
  wait "$pid"
  if [ -n "$want" ] && [ "$got" = "$want" ]; then
    echo "$lib: ok  sha256 $got  region $(sed 's/"handle":"[^"]*"/"handle":"…"/' "$tmp/region.json")"
  else
    echo "$lib: FAIL want '$want' got '$got'"
    cat "$tmp/err.txt" "$tmp/dump.txt"
    fail=1
  fi
  rm -f "$tmp/hold" "$tmp/dump.bin"
done
exit $fail
