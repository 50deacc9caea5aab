"""The schema module loads under this protobuf and matches store.proto."""

import os
import shutil
import subprocess

import pytest
from google.protobuf import __version__ as pb_version
from google.protobuf import descriptor_pb2

from conftest import REPO
from cudaipc import _store_pb2 as pb


def test_messages_roundtrip():
    r = pb.Request(id=7)
    r.create.name = "model/layer.0"
    r.create.size = 4096
    r.create.tensor.dtype = "bfloat16"
    r.create.tensor.shape.extend([32, 64])
    b = r.SerializeToString()
    back = pb.Request.FromString(b)
    assert back.WhichOneof("body") == "create"
    assert list(back.create.tensor.shape) == [32, 64]
    assert pb.Error.NOT_FOUND == 2 and pb.Event.ABORTED == 4
    # Field 20 of CreateRequest takes two key bytes: a2 01.
    assert bytes.fromhex("a201") in pb.CreateRequest(tensor=pb.TensorDesc(dtype="uint8")).SerializeToString()


def _strip(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """What protoc and Go's descriptor differ in without meaning anything: json_name and options."""
    def clean(m):
        for f in m.field:
            f.ClearField("json_name")
        for n in m.nested_type:
            clean(n)
    for m in fd.message_type:
        clean(m)
    fd.ClearField("options")
    fd.ClearField("source_code_info")
    return fd


def test_in_sync_with_store_proto(tmp_path):
    """The embedded descriptor is store.proto's (the Go test TestPythonModuleInSync
    checks the same against store.pb.go without protoc)."""
    protoc = shutil.which("protoc")
    if protoc is None:
        pytest.skip("protoc is not installed (Go's TestPythonModuleInSync checks the module instead)")
    out = tmp_path / "set.pb"
    subprocess.run([protoc, "-I", os.path.join(REPO, "protocol", "storev1"), "--descriptor_set_out=%s" % out,
                    "store.proto"], check=True)
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    want = _strip(fds.file[0])
    got = _strip(descriptor_pb2.FileDescriptorProto.FromString(pb._SERIALIZED))
    assert got == want, "python/cudaipc/_store_pb2.py is stale: run go generate ./protocol/storev1"


def test_protobuf_version_reported():
    major = int(pb_version.split(".")[0])
    assert major >= 4, pb_version


def test_hand_encoded_requests_match_protobuf():
    """get and release, the hot path, are encoded by hand: the bytes must be protobuf's."""
    from cudaipc._encode import Release, encode_get
    from cudaipc._encode import id_field as _id_field
    for name, ms in [("x", -1), ("model/layer.0", 0), ("é" * 100, 5000), ("n" * 255, 1 << 40)]:
        want = pb.Request(id=300, get=pb.GetRequest(name=name, timeout_ms=ms)).SerializeToString()
        assert _id_field(300) + encode_get(name, ms) == want
    for lid in [1, 127, 128, 1 << 63]:
        want = pb.Request(id=1, release=pb.ReleaseRequest(lease_id=lid)).SerializeToString()
        assert _id_field(1) + Release(lid).body == want
