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
