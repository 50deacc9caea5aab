#!/usr/bin/env bash
# The store round trip against a separate daemon process, for one or more cudaipc
# binaries (e.g. this build and an older one, to compare in the same run):
#
#   scripts/bench/store-roundtrip.sh [-r ROUNDS] [-d "host 0"] BIN [BIN...]
#
# For each round, device and binary: `BIN serve` on a fresh socket, then `BIN bench store
# --socket S --device D --clients 1 --duration 2s --json`, once with the default polling
# window and once with polling off (`serve --experimental-spin 0`, or `--spin 0` for binaries
# before the config file, CUDAIPC_SPIN=0; binaries older than the polling window run once,
# plainly). Prints one line a run (p50/p99 µs and p50 ÷ the
# floor measured by the same bench); the JSON goes to $OUT (or /tmp). The docs' H200
# table ("The round trip on the H200") came from this, run through the device tool.
set -uo pipefail
rounds=2; devices="host 0"
while getopts r:d: o; do case $o in r) rounds=$OPTARG;; d) devices=$OPTARG;; *) exit 2;; esac; done
shift $((OPTIND-1)); [ $# -ge 1 ] || { echo "usage: $0 [-r ROUNDS] [-d DEVICES] BIN [BIN...]" >&2; exit 2; }
out=${OUT:-/tmp}
one() { # BIN DEV SERVEFLAGS CLIENTENV LABEL
  local s=/tmp/cudaipc-rt-$$.sock j="$out/rt-$5-$2-$RANDOM.json" d
  "$1" serve --socket "$s" --backend auto --log-level warn $3 & d=$!
  for _ in $(seq 50); do [ -S "$s" ] && break; sleep 0.1; done
  env $4 timeout 60 "$1" bench store --socket "$s" --device "$2" --clients 1 --duration 2s --json >"$j"
  python3 - "$j" "$5" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); f = d["floor"]["p50_us"]
line = "%-28s dev=%-4s floor %.1f" % (sys.argv[2], sys.argv[3], f)
for k in ("host_ref", "round_trip", "socket", "first", "fast"):
    if d.get(k):
        line += "  %s %.1f/%.0f (%.2fx)" % (k, d[k]["p50_us"], d[k]["p99_us"], d[k]["p50_us"] / f)
print(line)
PY
  kill "$d"; wait "$d" 2>/dev/null; rm -f "$s" "$s.lock"
}
for _ in $(seq "$rounds"); do for dev in $devices; do for bin in "$@"; do
  name=$(basename "$bin")
  if "$bin" serve --print-config 2>/dev/null | grep -q '^experimental-spin'; then
    one "$bin" "$dev" "" X=1 "$name"
    one "$bin" "$dev" "--experimental-spin 0" CUDAIPC_SPIN=0 "$name,no-polling"
  elif "$bin" serve --help 2>&1 | grep -q -- '--spin'; then
    one "$bin" "$dev" "" X=1 "$name"
    one "$bin" "$dev" "--spin 0" CUDAIPC_SPIN=0 "$name,no-polling"
  else
    one "$bin" "$dev" "" X=1 "$name"
  fi
done; done; done
