"""Requests encoded by hand: the get/release hot path, and the id field every
packet starts with (a protobuf message costs several times more to build; the
schema tests check these against the protobuf encoding)."""

from __future__ import annotations

__all__ = ["id_field", "encode_get", "Release"]


def id_field(rid: int) -> bytes:
    """Request.id (field 1, varint), encoded by hand."""
    out = bytearray(b"\x08")
    while rid >= 0x80:
        out.append((rid & 0x7F) | 0x80)
        rid >>= 7
    out.append(rid)
    return bytes(out)


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def encode_get(name: str, timeout_ms: int) -> bytes:
    """Request.get{name, timeout_ms} without the id: built by hand, as it is the hot
    path (a protobuf message costs several times more to build); the schema tests
    check it against the protobuf encoding."""
    nb = name.encode("utf-8")
    body = b"\x0a" + _varint(len(nb)) + nb
    if timeout_ms:
        body += b"\x10" + _varint(timeout_ms)
    return b"\x72" + _varint(len(body)) + body   # field 14, length-delimited


class Release:
    """Request.release{lease_id}, encoded by hand (see encode_get): a lease's end
    request, sent by send_detached."""

    __slots__ = ("body",)

    def __init__(self, lease_id: int):
        inner = b"\x08" + _varint(lease_id)
        self.body = b"\x7a" + _varint(len(inner)) + inner   # field 15
