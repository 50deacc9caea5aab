"""Error codes become typed exceptions: every code of the schema has its class, and a
daemon's answer with a cluster code (UNAVAILABLE, DATA_LOSS) raises it through the
real client, which stays usable afterwards."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

import pytest

import cudaipc
from cudaipc import _store_pb2 as pb
from cudaipc.errors import from_code


def test_every_code_has_its_class():
    for name, code in pb.Error.Code.items():
        if code == pb.Error.OK:
            continue
        e = from_code(code, "get", "w", "detail")
        assert isinstance(e, cudaipc.StoreError) and e.code == code, name
        assert type(e) is not cudaipc.InternalError or name == "INTERNAL", "%s has no class of its own" % name
    assert type(from_code(pb.Error.UNAVAILABLE, "get", "w", "")) is cudaipc.UnavailableError
    assert type(from_code(pb.Error.DATA_LOSS, "get", "w", "")) is cudaipc.DataLossError
    assert type(from_code(99, "get", "w", "")) is cudaipc.InternalError


class ErrorDaemon:
    """Answers the hello, then each request with the next error of codes."""

    def __init__(self, codes):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "s.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.codes = list(codes)
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        c, _ = self.srv.accept()
        with c:
            req = pb.Request.FromString(c.recv(65536))
            c.send(pb.Response(id=req.id, hello=pb.HelloResponse(version=req.hello.version, backend="host")).SerializeToString())
            for code, msg in self.codes:
                req = pb.Request.FromString(c.recv(65536))
                c.send(pb.Response(id=req.id, error=pb.Error(code=code, message=msg)).SerializeToString())
            c.recv(65536)   # until the client closes

    def close(self):
        self.th.join(5)
        self.srv.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


def test_cluster_codes_raise_their_class():
    answers = [
        (pb.Error.UNAVAILABLE, "cluster directory unavailable: etcd at 127.0.0.1:2379 did not answer"),
        (pb.Error.DATA_LOSS, "look up 1000:w: malformed or unauthenticated cluster record"),
        (pb.Error.NOT_FOUND, "pull 1000:w: no live node holds the object"),
    ]
    d = ErrorDaemon(answers)
    s = cudaipc.connect(d.path, fast_path=False)
    try:
        for want, (code, msg) in zip((cudaipc.UnavailableError, cudaipc.DataLossError, cudaipc.NotFound), answers):
            with pytest.raises(want) as ei:
                s.stat("w")     # the same connection answers every one: an error code does not end it
            assert ei.value.code == code and ei.value.name == "w"
            assert msg in str(ei.value), str(ei.value)
    finally:
        s.close()
        d.close()
