#!/usr/bin/env bash
# The project's test command (README "Testing", and what .ci/run runs): the Go
# tests with the race detector, then the Python client's tests against a real
# daemon. Python tests run with $CUDAIPC_PYTHON (default /usr/bin/python3 when it
# exists, else python3) when it can import protobuf and pytest; otherwise they
# are skipped with a message saying what to install. Extra arguments go to go test.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== go test -race ./..."
go test -race -count=1 -timeout 10m "$@" ./...

py="${CUDAIPC_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x /usr/bin/python3 ]; then py=/usr/bin/python3; else py=$(command -v python3 || true); fi
fi
echo "== python tests (python/tests)"
if [ -z "$py" ]; then
  echo "SKIPPED: no python3 found; install python3 python3-protobuf python3-pytest (python3-numpy for the array tests)"
  exit 0
fi
missing=""
for m in google.protobuf pytest; do
  "$py" -c "import $m" 2>/dev/null || missing="$missing $m"
done
if [ -n "$missing" ]; then
  echo "SKIPPED: $py cannot import:$missing (Debian: apt-get install python3-protobuf python3-pytest python3-numpy)"
  exit 0
fi
"$py" -c 'import google.protobuf, sys; print("python", sys.version.split()[0], "protobuf", google.protobuf.__version__)'
# The fixture builds the daemon with go build unless CUDAIPC_BIN names one.
(cd python && "$py" -m pytest -q -rs -p no:cacheprovider tests)
echo "== python type check (mypy; configuration in python/pyproject.toml)"
if ! "$py" -c 'import mypy' 2>/dev/null; then
  echo "FAIL: $py cannot import mypy (Debian: apt-get install python3-mypy; pip: mypy)"
  exit 1
fi
(cd python && "$py" -m mypy)
