#!/usr/bin/env bash
# The project's test command (README, and what .ci/run runs after its static
# checks). On a fresh Debian or Ubuntu machine it first installs the system
# packages the tests need (as root; otherwise it names the missing ones in one
# line and fails), then runs:
#   1. the Go tests with the race detector (extra arguments go to go test);
#      the UCX and cluster (etcd) tests are required: they fail, not skip,
#      when their libraries are missing;
#   2. the Python client's tests against a real daemon, with Debian's
#      python3 ($CUDAIPC_PYTHON overrides it);
#   3. the Python package's type check (mypy).
# It never passes by skipping a suite. GPU tests skip without a GPU
# (CUDAIPC_REQUIRE_GPU=N makes them fail instead: scripts/gpu-run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== set-up"
command -v go >/dev/null || { echo "FAIL: no go on PATH: install Go 1.26 or later (https://go.dev/dl/)"; exit 1; }
# What the tests use, as Debian packages:
#   gcc             go test -race (cgo)
#   python3 python3-protobuf python3-numpy python3-pytest python3-torch
#                   the Python client's tests (torch: the bundle and tensor tests)
#   python3-mypy    the Python type check
#   protobuf-compiler  protoc, which checks the generated Python module against the .proto
#   util-linux      setpriv (tests that run a client as another uid)
#   libucx0 ucx-utils  the UCX data plane (libucp.so.0; ucx_perftest)
#   etcd-server     the cluster directory's tests (a real etcd on loopback)
#   iproute2        ip, for tests in network namespaces
#   redis-server    the KV pool benchmark's smoke test (Redis's MSET and MGET beside a pool)
packages="gcc python3 python3-protobuf python3-numpy python3-pytest python3-torch python3-mypy protobuf-compiler util-linux libucx0 ucx-utils etcd-server iproute2 redis-server"
if command -v dpkg-query >/dev/null; then
  missing=""
  for p in $packages; do
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing="$missing $p"
  done
  if [ -n "$missing" ]; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "FAIL: missing Debian packages; as root run: apt-get install -y$missing"
      exit 1
    fi
    echo "installing:$missing"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
else
  echo "not a Debian/Ubuntu machine (no dpkg-query): the tests need the equivalents of: $packages"
fi
export CUDAIPC_REQUIRE_UCX=1 CUDAIPC_REQUIRE_CLUSTER=1 CUDAIPC_REQUIRE_REDIS=1

py="${CUDAIPC_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x /usr/bin/python3 ]; then py=/usr/bin/python3; else py=$(command -v python3 || true); fi
fi
[ -n "$py" ] || { echo "FAIL: no python3 (Debian: apt-get install python3)"; exit 1; }
missing=""
for m in google.protobuf numpy pytest torch mypy; do
  "$py" -c "import $m" 2>/dev/null || missing="$missing $m"
done
if [ -n "$missing" ]; then
  echo "FAIL: $py cannot import:$missing (Debian: apt-get install python3-protobuf python3-numpy python3-pytest python3-torch python3-mypy; or point CUDAIPC_PYTHON at a python3 that has them)"
  exit 1
fi

echo "== go test -race ./..."
go test -race -count=1 -timeout 10m "$@" ./...

echo "== python tests (python/tests)"
"$py" -c 'import google.protobuf, sys; print("python", sys.version.split()[0], "protobuf", google.protobuf.__version__)'
# The fixture builds the daemon with go build unless CUDAIPC_BIN names one.
(cd python && "$py" -m pytest -q -rs -p no:cacheprovider tests)

echo "== python type check (mypy; configuration in python/pyproject.toml)"
(cd python && "$py" -m mypy)
echo "tests passed"
