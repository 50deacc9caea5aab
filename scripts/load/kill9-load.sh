#!/usr/bin/env bash
# Load test with random kill -9: WORKERS clients put random objects (1 B to
# 8 MiB) through the CLI for DURATION seconds, recording each sealed object's
# SHA-256 in a manifest; each keeps its KEEP newest objects, verifying an
# older one (get | sha256sum) before removing it. Meanwhile a killer sends
# SIGKILL to random cudaipc client processes (put, get, rm) every few ms.
# At the end every object of the manifest must be in the store with its
# hash, no unsealed object may remain, and the daemon must still answer.
#
#   scripts/load/kill9-load.sh [WORKERS] [DURATION] [KEEP]
#
# Needs a built cudaipc on $PATH or in $CUDAIPC (default: go build).
# Prints a summary and exits non-zero on any lost or corrupted object.
set -euo pipefail
WORKERS=${1:-16}
DURATION=${2:-60}
KEEP=${3:-8}
MAX=$((8 << 20))

dir=$(mktemp -d /tmp/cudaipc-load.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
bin=${CUDAIPC:-}
if [[ -z $bin ]]; then
	bin=$dir/cudaipc
	(cd "$(dirname "$0")/../.." && CGO_ENABLED=0 go build -o "$bin" ./cmd/cudaipc)
fi
export CUDAIPC_SOCKET=$dir/store.sock
echo 'evict = false' >"$dir/serve.toml"
"$bin" serve --backend host --capacity 3GiB --config "$dir/serve.toml" --log-level warn 2>"$dir/daemon.log" &
daemon=$!
for _ in $(seq 100); do "$bin" ls >/dev/null 2>&1 && break; sleep 0.05; done

# worker ID: put, keep KEEP, verify and remove the oldest beyond that.
worker() {
	local id=$1 n=0 end=$((SECONDS + DURATION)) kept=()
	local tmp=$dir/w$id.bin
	while ((SECONDS < end)); do
		n=$((n + 1))
		local size=$(((RANDOM << 15 | RANDOM) % MAX + 1)) name=w$id/o$n
		head -c "$size" /dev/urandom >"$tmp"
		local sum
		sum=$(sha256sum <"$tmp" | cut -c1-64)
		if "$bin" put "$tmp" --name "$name" >/dev/null 2>>"$dir/w$id.err"; then
			echo "$name $sum $size" >>"$dir/manifest.$id"
			kept+=("$name $sum")
			echo put >>"$dir/count.$id"
		else
			echo putfail >>"$dir/count.$id"
		fi
		while ((${#kept[@]} > KEEP)); do
			local old=${kept[0]}
			local oname=${old% *} osum=${old#* }
			local got
			# pipefail: a killed get fails the pipeline.
			if ! got=$("$bin" get "$oname" --timeout 5s 2>>"$dir/w$id.err" | sha256sum | cut -c1-64); then
				echo getfail >>"$dir/count.$id"
				break # killed (or failed): try again next round
			fi
			if [[ $got != "$osum" ]]; then
				echo "CORRUPT $oname: got $got want $osum" >>"$dir/errors"
			fi
			echo verified >>"$dir/count.$id"
			if "$bin" rm "$oname" >/dev/null 2>>"$dir/w$id.err"; then
				echo "$oname" >>"$dir/removed.$id"
				kept=("${kept[@]:1}")
			else
				# Killed mid-rm: the object may or may not be gone.
				if "$bin" stat "$oname" >/dev/null 2>&1; then :; else
					echo "$oname" >>"$dir/removed.$id"
					kept=("${kept[@]:1}")
				fi
			fi
		done
	done
}

killer() {
	local end=$((SECONDS + DURATION)) kills=0
	while ((SECONDS < end)); do
		sleep 0.0$((RANDOM % 9 + 1))
		mapfile -t pids < <(pgrep -f "^$bin (put|get|rm) " || true)
		((${#pids[@]} == 0)) && continue
		if kill -9 "${pids[RANDOM % ${#pids[@]}]}" 2>/dev/null; then
			kills=$((kills + 1))
		fi
	done
	echo "$kills" >"$dir/kills"
}

start=$SECONDS
for i in $(seq "$WORKERS"); do worker "$i" 2>>"$dir/shell.err" & done
killer &
wait $(jobs -p | grep -v "^$daemon$")
elapsed=$((SECONDS - start))

# Verify: every manifest entry not removed is there, sealed, with its hash.
cat "$dir"/manifest.* >"$dir/manifest" 2>/dev/null || : >"$dir/manifest"
cat "$dir"/removed.* >"$dir/removed" 2>/dev/null || : >"$dir/removed"
lost=0 corrupt=0 checked=0
while read -r name sum size; do
	grep -qxF "$name" "$dir/removed" && continue
	checked=$((checked + 1))
	got=$("$bin" get "$name" --timeout 5s 2>/dev/null | sha256sum | cut -c1-64) || true
	if ! "$bin" stat "$name" >/dev/null 2>&1; then
		lost=$((lost + 1)); echo "LOST $name" >>"$dir/errors"
	elif [[ $got != "$sum" ]]; then
		corrupt=$((corrupt + 1)); echo "CORRUPT $name" >>"$dir/errors"
	fi
done <"$dir/manifest"
unsealed=$("$bin" ls --json | grep -c '"sealed": false' || true)
objects=$("$bin" ls --json | grep -c '"name"' || true)
count() { cat "$dir"/count.* 2>/dev/null | grep -cx "$1" || true; }
kill -0 "$daemon" 2>/dev/null && alive=yes || alive=no
echo "workers=$WORKERS duration=${elapsed}s sizes=1B-8MiB kills=$(cat "$dir/kills")"
echo "puts_sealed=$(count put) puts_failed_or_killed=$(count putfail) gets_verified=$(count verified) gets_killed=$(count getfail) removed=$(wc -l <"$dir/removed")"
corrupt_total=$(grep -c ^CORRUPT "$dir/errors" 2>/dev/null || true)
echo "final_check: manifest_entries=$checked lost=$lost corrupt=${corrupt_total:-0} unsealed_left=$unsealed objects_in_store=$objects daemon_alive=$alive"
if [[ -s $dir/errors || $unsealed != 0 || $alive != yes ]]; then
	cat "$dir/errors" 2>/dev/null || true
	echo FAIL
	exit 1
fi
echo PASS
