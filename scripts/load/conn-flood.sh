#!/usr/bin/env bash
# Connection flood from a uid the daemon does not admit: ATTACKER_UID opens
# N connections to a daemon whose socket is world-writable (it admits
# another uid with --allow-uid) and keeps them open, while root runs
# 'cudaipc ls' and a put/get round trip and times them. Reports how many
# connections the attacker got, the daemon's descriptors at the peak, the
# refusals the metrics counted, the daemon's log lines about them, and the
# admitted client's latencies.
#
#   scripts/load/conn-flood.sh [N] [ATTACKER_UID]     (as root)
set -euo pipefail
N=${1:-20000}
ATTACKER=${2:-65533}
[[ $(id -u) == 0 ]] || { echo "run as root (the attacker runs as uid $ATTACKER)"; exit 2; }

dir=$(mktemp -d /tmp/cudaipc-flood.XXXXXX)
chmod 755 "$dir"
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
bin=${CUDAIPC:-}
if [[ -z $bin ]]; then
	bin=$dir/cudaipc
	(cd "$(dirname "$0")/../.." && CGO_ENABLED=0 go build -o "$bin" ./cmd/cudaipc)
fi
export CUDAIPC_SOCKET=$dir/store.sock
echo 'metrics = "127.0.0.1:0"' >"$dir/serve.toml"
"$bin" serve --backend host --allow-uid 65534 --config "$dir/serve.toml" --log-level info 2>"$dir/daemon.log" &
daemon=$!
for _ in $(seq 100); do "$bin" ls >/dev/null 2>&1 && break; sleep 0.05; done
murl=$(grep -o 'url=http://[^ ]*' "$dir/daemon.log" | head -1 | cut -d= -f2)

head -c 1048576 /dev/urandom >"$dir/obj"
want=$(sha256sum <"$dir/obj" | cut -c1-64)
ms() { date +%s%N; }
probe() { # prints ls ms, put+get ms
	local t0 t1 t2 got
	t0=$(ms)
	"$bin" ls >/dev/null
	t1=$(ms)
	"$bin" put "$dir/obj" --name "probe$1" >/dev/null
	got=$("$bin" get "probe$1" | sha256sum | cut -c1-64)
	"$bin" rm "probe$1" >/dev/null
	t2=$(ms)
	[[ $got == "$want" ]] || { echo "probe $1: bytes differ" >&2; exit 1; }
	echo "$(((t1 - t0) / 1000000)) $(((t2 - t1) / 1000000))"
}
read -r base_ls base_rt < <(probe 0)

# The attacker: N connections, held until stdin closes, split over
# processes of at most 9,000 each (a process's descriptors are limited).
ulimit -n "$(ulimit -Hn)"
PROCS=$(((N + 8999) / 9000))
mkfifo "$dir/hold"
cat >"$dir/attacker.py" <<'PY'
import socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
held, ok, failed = [], 0, {}
t0 = time.time()
for i in range(n):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError as e:
        failed["socket: " + e.strerror] = n - i
        break
    try:
        s.connect(path)
        ok += 1
        held.append(s)
    except OSError as e:
        failed[e.strerror] = failed.get(e.strerror, 0) + 1
        s.close()
# What did the daemon say on a held connection? (the refusal, then EOF)
said = b""
if held:
    held[0].settimeout(2)
    try:
        said = held[0].recv(70000)
    except OSError as e:
        said = str(e).encode()
print("connected=%d failed=%s seconds=%.2f first_reply=%r" % (ok, failed, time.time() - t0, said[:120]), flush=True)
sys.stdin.read()  # hold every connection until the script lets go
PY
chmod 644 "$dir/attacker.py"
attackers=()
for p in $(seq "$PROCS"); do
	n=$((N / PROCS + (p <= N % PROCS ? 1 : 0)))
	setpriv --reuid "$ATTACKER" --regid "$ATTACKER" --clear-groups /usr/bin/python3 "$dir/attacker.py" "$CUDAIPC_SOCKET" "$n" <"$dir/hold" >"$dir/attacker.$p.out" 2>&1 &
	attackers+=($!)
done
exec 9>"$dir/hold" # keeps the attackers' stdin open
done_attacking() { (($(cat "$dir"/attacker.*.out 2>/dev/null | grep -c connected=) == PROCS)); }
# Probe while the attacker connects, then at its peak.
lat=()
peak_fds=0
for i in $(seq 1 20); do
	read -r l r < <(probe "$i")
	lat+=("$l/$r")
	fds=$(ls /proc/$daemon/fd | wc -l)
	((fds > peak_fds)) && peak_fds=$fds
	done_attacking && break
done
for _ in $(seq 600); do done_attacking && break; sleep 0.1; done
read -r peak_ls peak_rt < <(probe 99)
fds=$(ls /proc/$daemon/fd | wc -l)
((fds > peak_fds)) && peak_fds=$fds
exec 9>&-
wait "${attackers[@]}" || true

metrics=$(curl -s "$murl" 2>/dev/null || true)
rejected=$(echo "$metrics" | grep '^cudaipc_store_connections_rejected_total{reason="permission"}' | awk '{print $2}')
loglines=$(grep -c 'refusing connection' "$dir/daemon.log" || true)
echo "attacker uid $ATTACKER, $N connects in $PROCS processes:"
cat "$dir"/attacker.*.out
echo "daemon: peak open fds=$peak_fds, rejected{permission}=${rejected:-?}, refusal log lines=$loglines, alive=$(kill -0 $daemon 2>/dev/null && echo yes || echo no)"
echo "admitted root client (ms, ls / put+get+rm 1 MiB): before=$base_ls/$base_rt during=${lat[*]} at_peak=$peak_ls/$peak_rt"
