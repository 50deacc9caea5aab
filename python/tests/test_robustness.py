"""Decoders of what crosses the process boundary: regions (random mutations of the
shared vectors) and daemon packets (a fake daemon sending garbage)."""

from __future__ import annotations

import array
import json
import os
import random
import socket
import tempfile
import threading

import pytest

import cudaipc
from cudaipc import _store_pb2 as pb
from cudaipc.region import Region
from conftest import REPO

DIR = os.path.join(REPO, "testdata", "region")


@pytest.mark.parametrize("kind", ["cuda-ipc", "vmm-fd"])
def test_region_binary_mutations(kind):
    """Every mutation is refused with InvalidRegion or decodes to a region that
    re-encodes to the same bytes; nothing else escapes."""
    base = open(os.path.join(DIR, kind + ".bin"), "rb").read()
    rng = random.Random(1)
    for _ in range(3000):
        b = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if not b:
                break
            if op < 0.7:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op < 0.85:
                del b[rng.randrange(len(b)):]
            else:
                b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        if rng.random() < 0.7 and len(b) == 164:  # mostly keep the checksum right, to reach the fields
            import zlib
            b[160:164] = zlib.crc32(bytes(b[:160])).to_bytes(4, "little")
        try:
            r = Region.from_bytes(bytes(b))
        except cudaipc.InvalidRegion:
            continue
        assert r.to_bytes() == bytes(b)


def test_region_json_mutations():
    base = json.loads(open(os.path.join(DIR, "cuda-ipc.json")).read())
    rng = random.Random(2)
    values = [None, 0, -1, 1 << 63, 1 << 64, "", "x", "0x", [], {}, True, 1.5, "GPU-" + "0" * 32]
    for _ in range(3000):
        d = dict(base)
        k = rng.choice(list(d) + ["extra", "allocation_id"])
        v = rng.choice(values)
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
        try:
            r = Region.from_json(json.dumps(d))
        except cudaipc.InvalidRegion:
            continue
        assert Region.from_json(r.to_json()) == r


class FakeDaemon:
    """Answers the hello, then sends what the test says."""

    def __init__(self, packets, fds_with=None):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "s.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.packets = packets
        self.fds_with = fds_with or {}
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        c, _ = self.srv.accept()
        req = pb.Request.FromString(c.recv(65536))
        c.send(pb.Response(id=req.id, hello=pb.HelloResponse(version=req.hello.version, backend="host")).SerializeToString())
        req = pb.Request.FromString(c.recv(65536))
        for i, p in enumerate(self.packets):
            data = p(req.id) if callable(p) else p
            if i in self.fds_with:
                fd = os.open("/dev/null", os.O_RDONLY)
                c.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * self.fds_with[i]))])
                os.close(fd)
            else:
                c.send(data)
        c.close()


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("name,packets,fds,exc", [
    ("garbage", [b"\xff\xff\xff\xff"], {}, cudaipc.InternalError),
    ("oversized", [b"\x08\x01" + b"\x00" * 70000], {}, cudaipc.InternalError),
    ("hang-up", [], {}, cudaipc.StoreGone),
    ("too many fds", [lambda rid: pb.Response(id=rid, stat=pb.StatResponse()).SerializeToString()], {0: 64}, cudaipc.InternalError),
    ("placement without descriptor", [lambda rid: pb.Response(id=rid, get=pb.GetResponse(lease_id=1, placement=pb.Placement(
        arena_id=9, device="host", size=10, arena_size=4096, kind=pb.Placement.HOST))).SerializeToString()], {}, cudaipc.InternalError),
])
def test_bad_daemon(name, packets, fds, exc):
    before = open_fds()
    d = FakeDaemon(packets, fds)
    s = cudaipc.connect(d.path, fast_path=False)   # the packets answer the first request after hello
    with pytest.raises(exc):
        if name == "placement without descriptor":
            s.get("x", timeout=1)
        else:
            s.stat("x")
    s.close()
    d.th.join(5)
    d.srv.close()
    assert open_fds() <= before, "descriptors leaked"
