"""The KV space description codec (cudaipc.kv.Desc) against the shared vectors in
testdata/kvdesc/, which the Go test kv.TestDescVectors writes and checks against the
Go codec: valid descriptions encode to the same bytes and text and decode back; the
refused ones fail with InvalidDescError naming the same field."""

import base64
import json
import os
import random

import pytest

from conftest import REPO
from cudaipc import kv
from cudaipc.errors import CudaipcError, InvalidDescError

with open(os.path.join(REPO, "testdata", "kvdesc", "vectors.json")) as f:
    VECTORS = json.load(f)


def ids(c):
    return c["name"]


@pytest.mark.parametrize("case", VECTORS["valid"], ids=ids)
def test_valid_vectors(case):
    d = kv.Desc.from_dict(case["desc"])
    assert d.to_bytes().hex() == case["binary"]
    assert d.to_text() == case["text"]
    got = kv.Desc.from_bytes(bytes.fromhex(case["binary"]))
    assert got.to_dict() == case["desc"] and got == d
    assert kv.Desc.from_text(case["text"]).to_dict() == case["desc"]
    assert kv.Desc.from_text(case["text"].encode()).to_dict() == case["desc"]


@pytest.mark.parametrize("case", VECTORS["invalid"], ids=ids)
def test_invalid_vectors(case):
    with pytest.raises(InvalidDescError) as e:
        if "desc" in case:
            kv.Desc.from_dict(case["desc"]).to_bytes()
        elif "text" in case:
            kv.Desc.from_text(case["text"])
        else:
            kv.Desc.from_bytes(bytes.fromhex(case.get("binary", "")))
    assert e.value.field == case["field"], "%s (Go: %s)" % (e.value, case["reason"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("kv: invalid space description: " + case["field"] + ": ")
    assert isinstance(e.value, (ValueError, CudaipcError))


def test_encoding_past_16_kib():
    d = kv.Desc.from_dict(VECTORS["valid"][0]["desc"])
    d.layout.layers = [d.layers[0]] * 640
    with pytest.raises(InvalidDescError) as e:
        d.to_bytes()
    assert e.value.field == "size"


def test_id_is_16_bytes():
    d = kv.Desc.from_dict(VECTORS["valid"][0]["desc"])
    d.id = b"short"
    with pytest.raises(InvalidDescError) as e:
        d.to_bytes()
    assert e.value.field == "id"


def test_text_line_breaks_are_skipped_as_go_does():
    c = VECTORS["valid"][1]
    t = c["text"]
    assert kv.Desc.from_text(t[:10] + "\r\n" + t[10:]).to_dict() == c["desc"]


def test_mutated_encodings_decode_or_fail_typed():
    """Random byte flips of valid encodings: each either decodes to a description that
    encodes back to the same bytes, or fails with InvalidDescError (the Python twin of
    Go's FuzzDescBinary, on the same seeds)."""
    rng = random.Random(7)
    for case in VECTORS["valid"]:
        good = bytes.fromhex(case["binary"])
        for _ in range(300):
            b = bytearray(good)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            if rng.random() < 0.2:
                b = b[:rng.randrange(len(b) + 1)]
            try:
                d = kv.Desc.from_bytes(bytes(b))
            except InvalidDescError:
                continue
            assert d.to_bytes() == bytes(b)
            assert kv.Desc.from_text(base64.b64encode(bytes(b)).decode()) == d
