"""Region encodings against the shared vectors (testdata/region/), which
region_vectors_test.go checks against the Go implementation."""

import json
import os

import pytest

from conftest import REPO
import cudaipc
from cudaipc.region import Region

DIR = os.path.join(REPO, "testdata", "region")
VALID = ["cuda-ipc", "vmm-fd", "vmm-fd-pieces"]
INVALID = json.load(open(os.path.join(DIR, "invalid.json")))


def vector(name):
    with open(os.path.join(DIR, name + ".bin"), "rb") as f:
        b = f.read()
    with open(os.path.join(DIR, name + ".json")) as f:
        j = f.read()
    return b, j


@pytest.mark.parametrize("name", VALID)
def test_valid_vectors(name):
    b, j = vector(name)
    r = Region.from_bytes(b)
    assert r.to_json() == j
    r2 = Region.from_json(j)
    assert r2 == r
    assert r2.to_bytes() == b
    assert cudaipc.decode_region(b) == r
    assert cudaipc.decode_region(j) == r


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c["name"])
def test_invalid_vectors(case):
    with pytest.raises(cudaipc.InvalidRegion) as e:
        if case["encoding"] == "binary":
            Region.from_bytes(bytes.fromhex(case["data"]))
        else:
            Region.from_json(case["data"])
    assert e.value.field == case["field"], str(e.value)


def test_sub_and_repr_hide_the_handle():
    r = Region.from_json(vector("cuda-ipc")[1])
    s = r.sub(100, 200)
    assert (s.offset, s.size) == (r.offset + 100, 200)
    with pytest.raises(ValueError):
        r.sub(0, r.size + 1)
    assert r.handle.hex() not in repr(r) and "AAECAw" not in repr(r)


def test_json_accepts_what_go_accepts():
    j = vector("cuda-ipc")[1]
    d = json.loads(j)
    d["device"] = d["device"][4:]            # without the GPU- prefix
    d["boot_id"] = d["boot_id"].upper()      # upper-case digits
    r = Region.from_json(json.dumps(d, indent=2))
    assert r.to_json() == j


def test_garbage_is_rejected_by_field():
    for data, field in [(b"CIPR\x01\x00\x01\x00", "length"), ("[]", "json"), ("{", "json")]:
        with pytest.raises(cudaipc.InvalidRegion) as e:
            cudaipc.decode_region(data)
        assert e.value.field == field


def test_event_descriptor_matches_go():
    """The binary EventDescriptor Python writes (for seals that wait on an event) is
    byte for byte what Go's EventDescriptor.MarshalBinary writes."""
    from cudaipc.region import event_descriptor
    want = bytes.fromhex(
        "434950450100000001080f161d242b323940474e555c636a71787f868d949ba2a9b0b7bec5ccd3dae1e8eff6fd04"
        "0b121920272e353c434a51585f666d747b828990979ea5acb3baa0a1a2a3a4a5a6a7a8a9aaabacadaeaf92100000"
        "00000000fcffffef00000000101112131415161718191a1b1c1d1e1f9e7c0956")
    got = event_descriptor(bytes((i * 7 + 1) % 256 for i in range(64)), bytes(range(0xa0, 0xb0)),
                           4242, 4026531836, bytes(range(0x10, 0x20)))
    assert got == want and len(got) == 124


def test_pieces_region_round_trips_and_says_what_it_spans():
    b, _ = vector("vmm-fd-pieces")
    r = Region.from_bytes(b)
    assert r.version == 2 and len(r.pieces) == 3 and r.mapped_size == 60 << 20
    assert r.pieces[0] == (r.allocation_id, r.alloc_size)
    s = r.sub(30 << 20, 1 << 20)  # a part in the second piece keeps every piece
    assert Region.from_bytes(s.to_bytes()) == s and s.pieces == r.pieces
    assert "3 allocations" in repr(r)
    # Every truncation and every single-bit flip is refused by field, never misread.
    for n in range(len(b)):
        with pytest.raises(cudaipc.InvalidRegion):
            Region.from_bytes(b[:n])
    for i in range(len(b) * 8):
        c = bytearray(b)
        c[i // 8] ^= 1 << (i % 8)
        with pytest.raises(cudaipc.InvalidRegion):
            Region.from_bytes(bytes(c))


def test_a_get_info_takes_its_region_from_the_placement():
    """A get's info leaves the region out (the placement carries it once); the lease's
    info is the placement's region narrowed to the placement, decoded when asked for."""
    from cudaipc import _store_pb2 as pb
    from cudaipc._memory import Record
    from cudaipc.lease import Lease
    for name in VALID:
        b, _ = vector(name)
        whole = Region.from_bytes(b)
        p = pb.Placement(kind=pb.Placement.VMM_FD if whole.kind == 2 else pb.Placement.CUDA_IPC,
                         device=whole.device_uuid, offset=100, size=200, arena_size=whole.size, region=b)
        rec = Record(None, "w", 200, p.device, 0, 0, False, "vmm-fd", None, None, None, None)
        rec.info_pb = pb.ObjectInfo(name="w", size=200, device=p.device, sealed=True)
        rec.placement = p
        info = Lease(None, rec).info
        assert info.region == whole.sub(100, 200) and info.size == 200


def test_local_identity_is_read_once_and_afresh_in_a_forked_child() -> None:
    """local_identity answers what /proc says, from its first read on; a forked child
    starts without the parent's answer."""
    import os
    from cudaipc import region
    ns, boot = region.local_identity()
    assert ns == os.stat("/proc/self/ns/pid").st_ino
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot == bytes.fromhex(f.read().strip().replace("-", ""))
    assert region.local_identity() is region.local_identity()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if region._identity is None and region.local_identity() == (ns, boot) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
