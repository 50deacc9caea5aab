"""KV spaces between the Go and Python clients, through one daemon: a space the Go
package kv registers (its test binary's engine role, kv/main_test.go) read from
Python, and a space Python registers read by Go's reader role. The Go test binary is
$CUDAIPC_KV_TEST_BIN, else kv.test beside $CUDAIPC_BIN (the GPU machine's .gpu/bin,
which scripts/gpu-build.sh fills), else built with ``go test -c ./kv`` (skipped where
none is to be had)."""

import hashlib
import json
import os
import select
import shutil
import subprocess

import numpy as np
import pytest

from conftest import REPO
from cudaipc import kv

import kvutil

LAYERS, BLOCKS, BYTES = 3, 12, 160


@pytest.fixture(scope="session")
def kv_test_bin(tmp_path_factory):
    env = os.environ.get("CUDAIPC_KV_TEST_BIN")
    if env:
        return env
    beside = os.path.join(os.path.dirname(os.environ.get("CUDAIPC_BIN", "")), "kv.test")
    if os.environ.get("CUDAIPC_BIN") and os.access(beside, os.X_OK):
        return beside
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain to build the kv test binary (set CUDAIPC_KV_TEST_BIN)")
    out = str(tmp_path_factory.mktemp("kvbin") / "kv.test")
    subprocess.run([go, "test", "-c", "-o", out, "./kv"], cwd=REPO, check=True, env=dict(os.environ, CGO_ENABLED="0"),
                   timeout=600)
    return out


class GoRole:
    """A role of the kv test binary: JSON lines on its stdin and stdout."""

    def __init__(self, binary, role, env):
        self.proc = subprocess.Popen([binary, "-test.run=^$"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0,
                                     env=dict(os.environ, CUDAIPC_TEST_ROLE=role, **env))

    def recv(self, timeout=60):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if r else b""
        if not line:
            self.proc.kill()
            raise AssertionError("Go role said nothing: %s" % self.proc.stderr.read().decode()[-2000:])
        return json.loads(line)

    def send(self, v):
        self.proc.stdin.write(json.dumps(v).encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.parametrize("layout", ["vllm", "vllm-blocks-first", "sglang", "host"])
def test_python_reads_a_go_space(store, daemon, kv_test_bin, layout):
    eng = GoRole(kv_test_bin, "engine", {"SOCK": daemon.socket, "NAME": "go/kv-" + layout, "LAYOUT": layout,
                                         "LAYERS": str(LAYERS), "BLOCKS": str(BLOCKS), "BYTES": str(BYTES), "SEED": "77"})
    try:
        desc = kv.Desc.from_text(eng.recv()["desc"])
        assert desc.name == "%d:go/kv-%s" % (os.getuid(), layout)
        # The source's bytes, as a lease of each region shows them.
        src = []
        for i in range(len(desc.regions)):
            with store.get(desc.region_name(i)) as lease:
                assert lease.info.space == desc.to_bytes()
                src.append(np.array(lease.numpy(), copy=True))
        kind = {"host": "offload"}.get(layout, layout)
        dst = kvutil.make_local(kind, LAYERS, BLOCKS, BYTES, lambda shape: np.zeros(shape, dtype=np.uint8))
        src_ids, dst_ids = [0, 1, 2, 7, 5, 11], [3, 4, 5, 0, 11, 6]
        kv.read_blocks(store, desc, src_ids, dst, dst_ids).wait(30)
        for li in range(LAYERS):
            for sp, dp in zip(desc.layers[li], dst.layers[li]):
                got = kvutil.host_region(dst.memory[dp.region])
                for s, d in zip(src_ids, dst_ids):
                    want = src[sp.region][sp.base + s * sp.stride:sp.base + s * sp.stride + sp.nbytes]
                    assert np.array_equal(got[dp.base + d * dp.stride:dp.base + d * dp.stride + dp.nbytes], want)
        eng.send("close")
        assert eng.recv() == {"done": "close"}
        with pytest.raises(kv.BlockError):
            kv.read_blocks(store, desc, [0], dst, [0]).wait(30)
    finally:
        eng.stop()


@pytest.mark.parametrize("kind", ["vllm", "offload"])
def test_go_reads_a_python_space(store, daemon, kv_test_bin, kind):
    local = kvutil.make_local(kind, LAYERS, BLOCKS, BYTES, lambda shape: kv.alloc_host(shape))
    kvutil.fill(local, 78)
    with kv.register(store, "py/kv-" + kind, local) as space:
        reader = GoRole(kv_test_bin, "reader", {"SOCK": daemon.socket, "DESC": space.desc.to_text()})
        try:
            got = reader.recv()
        finally:
            reader.stop()
    # The reader copies blocks 0..3 into blocks 4..7 of a zeroed space of the same
    # layout (Go memory of the description's region sizes) and sums its regions.
    before = [np.zeros(r.size, dtype=np.uint8) for r in space.desc.regions]
    want = kvutil.expected(space.desc, 78, local, [0, 1, 2, 3], [4, 5, 6, 7], range(LAYERS), before)
    assert got == {"sum": hashlib.sha256(b"".join(w.tobytes() for w in want)).hexdigest()}
