"""The manifest, sources table, lease slot and packet encodings against the shared
vectors in testdata/ (manifest/, sources/, leaseslot/, framing/), which the Go tests
(bundle/vectors_test.go, protocol/vectors_test.go) check against the Go implementation."""

import ctypes
import json
import os
import struct

import pytest

from conftest import REPO
from cudaipc import _fastpath
from cudaipc import _store_pb2 as pb
from cudaipc._encode import Release, encode_get, id_field
from cudaipc._manifest import TensorEntry, encode_manifest, layout, parse_manifest
from cudaipc._nocopy import decode_sources, encode_sources, source_starts
from cudaipc._wire import MAX_FILES, MAX_MESSAGE
from cudaipc.errors import InternalError


def load(topic):
    with open(os.path.join(REPO, "testdata", topic, "vectors.json")) as f:
        return json.load(f)


MANIFEST = load("manifest")
SOURCES = load("sources")
SLOTS = load("leaseslot")
FRAMING = load("framing")


def ids(c):
    return c["name"]


def entries_of(tensors):
    return [TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["begin"], t["end"]) for t in tensors]


@pytest.mark.parametrize("case", MANIFEST["layouts"], ids=ids)
def test_manifest_layout_vectors(case):
    entries, size = layout((s["name"], s["dtype"], s["shape"]) for s in case["specs"])
    want = entries_of(case["tensors"])
    assert sorted(entries, key=lambda e: (e.begin, e.end, e.name)) == want and size == case["size"]
    assert encode_manifest(entries, case["metadata"]).hex() == case["header"]
    got, meta = parse_manifest(bytes.fromhex(case["header"]))
    assert got == want and meta == (case["metadata"] or {})


@pytest.mark.parametrize("case", MANIFEST["parse"], ids=ids)
def test_manifest_parse_vectors(case):
    got, meta = parse_manifest(bytes.fromhex(case["header"]))
    assert got == entries_of(case["tensors"]) and meta == (case["metadata"] or {})


@pytest.mark.parametrize("case", MANIFEST["invalid_layouts"], ids=ids)
def test_manifest_invalid_layout_vectors(case):
    assert case["error"] == "invalid"
    with pytest.raises(ValueError):
        layout((s["name"], s["dtype"], s["shape"]) for s in case["specs"])


@pytest.mark.parametrize("case", MANIFEST["invalid_headers"], ids=ids)
def test_manifest_invalid_header_vectors(case):
    assert case["error"] == "invalid"
    with pytest.raises(ValueError):
        parse_manifest(bytes.fromhex(case["header"]))


@pytest.mark.parametrize("case", SOURCES["tables"], ids=ids)
def test_sources_table_vectors(case):
    regions = [bytes.fromhex(r) for r in case["regions"]]
    assert encode_sources(regions).hex() == case["table"]
    assert decode_sources(bytes.fromhex(case["table"])) == regions


@pytest.mark.parametrize("case", SOURCES["starts"], ids=ids)
def test_sources_starts_vectors(case):
    assert source_starts(case["sizes"]) == (case["starts"], case["span"])


@pytest.mark.parametrize("case", SOURCES["invalid_tables"], ids=ids)
def test_sources_invalid_table_vectors(case):
    assert case["error"] == "invalid"
    with pytest.raises(InternalError):
        decode_sources(bytes.fromhex(case["table"]))


@pytest.mark.parametrize("case", SOURCES["invalid_sizes"], ids=ids)
def test_sources_invalid_sizes_vectors(case):
    assert case["error"] == "invalid"
    with pytest.raises(ValueError):
        source_starts(case["sizes"])


def word(h):
    (w,) = struct.unpack("<Q", bytes.fromhex(h))
    return w


@pytest.mark.parametrize("case", SLOTS["words"], ids=lambda c: str(c["gen"]))
def test_lease_slot_word_vectors(case):
    assert struct.pack("<Q", _fastpath.held_word(case["gen"])).hex() == case["held"]
    assert struct.pack("<Q", _fastpath.idle_word(case["gen"])).hex() == case["idle"]


class _Entry:
    """What LeaseTable keeps of a lease (a _memory.Record's fields it uses)."""

    def __init__(self, name):
        self.name, self.arena_id, self.dropped = name, 1, 0

    def drop(self):
        self.dropped += 1


@pytest.fixture
def table():
    """A real two-slot lease table in a memfd, swapped with libatomic's CAS."""
    a = _fastpath.atomics()
    if a is None:
        pytest.fail("libatomic.so.1 is missing")
    fd = os.memfd_create("leaseslot-vectors")
    os.ftruncate(fd, 16)
    t = _fastpath.LeaseTable(fd, 2, a.cas)
    os.close(fd)
    yield t
    t.close()


def put_word(t, slot, w):
    ctypes.c_uint64.from_address(t.addr + (slot - 1) * 8).value = w


@pytest.mark.parametrize("case", SLOTS["release"], ids=ids)
def test_lease_slot_release_vectors(table, case):
    e = _Entry("x")
    table.prepare(e, 2, case["gen"])
    put_word(table, 1, 0xA5A5A5A5A5A5A5A5)   # the neighbour slot is left alone
    put_word(table, 2, word(case["word"]))
    assert table.release(e) == case["ok"]
    assert table.word(2) == word(case["next"]) and table.word(1) == 0xA5A5A5A5A5A5A5A5
    assert table.idle_count() == (1 if case["ok"] else 0)


@pytest.mark.parametrize("case", SLOTS["retake"], ids=ids)
def test_lease_slot_retake_vectors(table, case):
    e = _Entry("x")
    table.prepare(e, 2, case["gen"])
    put_word(table, 2, _fastpath.held_word(case["gen"]))
    assert table.release(e)                   # idle, recorded for a take-back
    put_word(table, 2, word(case["word"]))    # what the daemon made of it meanwhile
    got = table.retake("x")
    assert (got is e) == case["ok"] and e.dropped == (0 if case["ok"] else 1)
    assert table.word(2) == word(case["next"])


def test_framing_limits():
    assert (FRAMING["max_message_size"], FRAMING["max_files"]) == (MAX_MESSAGE, MAX_FILES)


@pytest.mark.parametrize("case", FRAMING["requests"], ids=ids)
def test_framing_request_vectors(case):
    if "get" in case:
        g = case["get"]
        packet = id_field(case["id"]) + encode_get(g["name"], g["timeout_ms"])
        want = pb.Request(id=case["id"], get=pb.GetRequest(name=g["name"], timeout_ms=g["timeout_ms"]))
    else:
        packet = id_field(case["id"]) + Release(case["release"]["lease_id"]).body
        want = pb.Request(id=case["id"], release=pb.ReleaseRequest(lease_id=case["release"]["lease_id"]))
    assert packet.hex() == case["packet"]
    assert pb.Request.FromString(bytes.fromhex(case["packet"])) == want


@pytest.mark.parametrize("case", FRAMING["invalid"], ids=ids)
def test_framing_invalid_vectors(case):
    from google.protobuf.message import DecodeError
    assert case["error"] == "malformed"
    with pytest.raises(DecodeError):
        pb.Request.FromString(bytes.fromhex(case["packet"]))
