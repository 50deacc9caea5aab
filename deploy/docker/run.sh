#!/usr/bin/env bash
# The daemon and two client containers sharing GPU memory on one host.
# Needs the NVIDIA Container Toolkit (--gpus). IMAGE must contain the
# cudaipc binary (and, for the Python client, python3 with cudaipc).
set -euo pipefail
IMAGE=${IMAGE:-ghcr.io/cudaipc/cudaipc:latest}
SOCKDIR=${SOCKDIR:-/run/cudaipc}
install -d -m 0755 -o 65532 -g 65532 "$SOCKDIR"

# The daemon: its own PID, IPC and mount namespaces (Docker's defaults),
# not root, no capabilities; only the socket directory is shared.
docker run -d --name cudaipc-store --restart unless-stopped \
  --gpus all --user 65532:65532 --cap-drop ALL --security-opt no-new-privileges \
  --read-only -v "$SOCKDIR:/run/cudaipc" \
  "$IMAGE" serve --socket /run/cudaipc/store.sock --backend cuda --gpu-share fd --allow-gid 2000

# Clients: other uids whose primary group is the admitted one (SO_PEERCRED
# carries only the primary gid); the socket directory read-only.
client() {
  docker run --rm --gpus all --user "$1:2000" \
    --cap-drop ALL --security-opt no-new-privileges \
    -v "$SOCKDIR:/run/cudaipc:ro" -e CUDAIPC_SOCKET=/run/cudaipc/store.sock \
    -e PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    "$IMAGE" "${@:2}"
}
client 1000 cudaipc doctor
client 1000 sh -c 'head -c 64M /dev/urandom | tee /tmp/r | cudaipc put --name demo/random --shared --device 0 - && sha256sum </tmp/r'
client 1001 sh -c 'cudaipc get 1000:demo/random | sha256sum'   # another user's object: UID:NAME
