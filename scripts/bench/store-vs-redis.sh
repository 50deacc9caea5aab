#!/usr/bin/env bash
# Runs `cudaipc bench store` against a real `cudaipc serve` daemon and
# `redis-benchmark -t get` against a real redis-server on a Unix socket, in
# one run on this machine, with the same client count and payload size.
# Needs redis-server and redis-benchmark (Debian: apt-get install redis-server).
#
#   scripts/bench/store-vs-redis.sh [CLIENTS] [SIZE_BYTES] [DURATION]
set -euo pipefail
cd "$(dirname "$0")/../.."
clients=${1:-8}; size=${2:-4096}; dur=${3:-5s}
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
go build -o "$tmp/cudaipc" ./cmd/cudaipc
"$tmp/cudaipc" serve --socket "$tmp/store.sock" --backend host --log-level warn &
redis-server --port 0 --unixsocket "$tmp/redis.sock" --save '' --appendonly no --daemonize no >/dev/null &
for _ in $(seq 100); do [ -S "$tmp/store.sock" ] && [ -S "$tmp/redis.sock" ] && break; sleep 0.1; done
echo "== cudaipc bench store: $clients clients, $size-byte objects, $dur a path (floor; socket: get+release = 2 round trips; fast path: shared-memory lease table)"
"$tmp/cudaipc" bench store --socket "$tmp/store.sock" --clients "$clients" --size "$size" --duration "$dur" --json | tee "$tmp/store.json"
n=$(python3 -c "import json;print(max(20000,3*int(json.load(open('$tmp/store.json'))['socket']['ops'])))")
echo "== redis-benchmark GET: $clients clients, $size-byte values, $n requests (1 round trip, value copied)"
# -t set,get: the SET pass stores the value that the GET pass then reads;
# a GET alone would read a missing key and return no bytes at all.
redis-benchmark -s "$tmp/redis.sock" -t set,get -c "$clients" -d "$size" -n "$n" -q --csv | tee "$tmp/redis.csv"
redis-cli -s "$tmp/redis.sock" strlen key:__rand_int__ | sed 's/^/stored value length: /'
python3 - "$tmp/store.json" "$tmp/redis.csv" <<'PY'
import csv, json, sys
s = json.load(open(sys.argv[1]))
rows = list(csv.reader(open(sys.argv[2])))
hdr = rows[0]
r = next(row for row in rows[1:] if row[0] == "GET")
red = dict(zip(hdr, r))
rps = float(red["rps"]); p50 = float(red.get("p50_latency_ms", "nan")) * 1000; p99 = float(red.get("p99_latency_ms", "nan")) * 1000
floor, sock, fast = s["floor"], s["socket"], s["fast"]
print(f"\n{'':34}{'ops/s':>12}{'p50 µs':>10}{'p99 µs':>10}{'p50/floor':>11}")
print(f"{'SEQPACKET ping-pong floor (1 pair)':34}{floor['ops_per_sec']:>12.0f}{floor['p50_us']:>10.1f}{floor['p99_us']:>10.1f}{1:>10.2f}x")
print(f"{'cudaipc get+release, socket':34}{sock['ops_per_sec']:>12.0f}{sock['p50_us']:>10.1f}{sock['p99_us']:>10.1f}{sock['p50_us']/floor['p50_us']:>10.2f}x")
print(f"{'cudaipc get+release, fast path':34}{fast['ops_per_sec']:>12.0f}{fast['p50_us']:>10.1f}{fast['p99_us']:>10.1f}{fast['p50_us']/floor['p50_us']:>10.2f}x")
print(f"{'redis GET':34}{rps:>12.0f}{p50:>10.1f}{p99:>10.1f}{p50/floor['p50_us']:>10.2f}x")
print(f"{'ratio socket/redis (ops/s)':34}{sock['ops_per_sec']/rps:>11.2f}x")
print(f"{'ratio fast path/redis (ops/s)':34}{fast['ops_per_sec']/rps:>11.2f}x")
PY
