"""KV space descriptions (docs/kv.md): the Go package kv's desc.go in Python, byte
for byte. A description is what an engine hands a reader in its own metadata and
what the daemon returns with each of the space's regions; the shared vectors in
testdata/kvdesc/ hold both implementations to one encoding and one set of refusals.

Encoding (little-endian): magic "CKVS", u16 version, u16 parts per layer, u32
layers, u32 blocks, the 16-byte id, u16 regions, u16-prefixed name and node; then
per region a kind byte (0 host, 1 GPU), the GPU's 16-byte UUID (zero for host) and
u64 size; then per layer and part u16 region, u64 base, u64 stride, u64 bytes.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .errors import InvalidDescError

__all__ = ["Part", "Layout", "Region", "Desc", "new_id", "MAX_LAYERS", "MAX_PARTS", "MAX_REGIONS",
           "MAX_BLOCKS", "MAX_SPACE_SIZE", "MAX_OBJECT_SIZE", "check_layout", "parse_uuid", "uuid_text"]

MAX_LAYERS = 1024
MAX_PARTS = 8
MAX_REGIONS = 1024
MAX_BLOCKS = 1 << 30
MAX_NODE = 255
MAX_SPACE_SIZE = 16 << 10      # protocol.MaxSpaceSize: a description travels in every info of its regions
MAX_OBJECT_SIZE = 1 << 40      # protocol.MaxObjectSize
MAX_NAME_LEN = 255             # protocol.MaxNameLen

MAGIC = b"CKVS"
VERSION = 1
HEADER = struct.Struct("<4sHHII16sH")   # 34 bytes
REGION = struct.Struct("<B16sQ")        # 25 bytes
PART = struct.Struct("<HQQQ")           # 26 bytes
# The most base64 text a description can take (Go's base64.StdEncoding.EncodedLen).
MAX_TEXT = (MAX_SPACE_SIZE + 2) // 3 * 4
_B64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")


def _bad(field: str, reason: str) -> InvalidDescError:
    return InvalidDescError(field, reason)


@dataclasses.dataclass
class Part:
    """Where one part (K or V, or both of a combined layout) of one layer lies:
    block b is the ``nbytes`` bytes at ``base + b * stride`` of region ``region``."""
    region: int
    base: int
    stride: int
    nbytes: int


@dataclasses.dataclass
class Layout:
    """Where every block of every layer of a KV space lies in its regions:
    ``layers[l][p]`` is layer l's part p. Every layer has the same number of parts,
    and a block id names the same block in every part."""
    blocks: int
    layers: List[List[Part]]


@dataclasses.dataclass
class Region:
    """One memory region of a space as readers see it: on ``"host"`` or on a GPU
    (its UUID, ``"GPU-…"``), of ``size`` bytes."""
    device: str
    size: int


def new_id() -> bytes:
    """A random description id (16 bytes)."""
    return os.urandom(16)


def parse_uuid(s: str) -> bytes:
    """The 16 bytes of a GPU UUID as Go's cudaipc.ParseUUID reads it (the "GPU-"
    prefix optional, dashes anywhere); ValueError otherwise."""
    t = s[4:] if s.startswith("GPU-") else s
    t = t.replace("-", "")
    if len(t.encode()) != 32 or not all(c in "0123456789abcdefABCDEF" for c in t):
        raise ValueError("invalid GPU UUID %r: want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" % s)
    return bytes.fromhex(t)


def uuid_text(u: bytes) -> str:
    """The canonical form of a GPU UUID's 16 bytes ("GPU-" and dashed lowercase hex)."""
    h = u.hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


def _printable(s: str) -> bool:
    """Go's unicode.IsPrint for every rune: letters, marks, numbers, punctuation,
    symbols and the ASCII space (Python's isprintable draws the same line)."""
    return s.isprintable()


def _split_owner(name: str) -> Tuple[bool, str]:
    """Go's protocol.SplitOwner: whether name is "UID:REST" with UID canonical
    decimal within 32 bits, and REST."""
    i = name.find(":")
    if i <= 0 or i > 10 or i == len(name) - 1 or (name[0] == "0" and i > 1):
        return False, name
    if not all("0" <= c <= "9" for c in name[:i]) or int(name[:i]) >= 1 << 32:
        return False, name
    return True, name[i + 1:]


def _name_error(name: str) -> Optional[str]:
    """Go's protocol.ValidateName: why name is no object name, or None."""
    if name == "":
        return "empty object name"
    n = len(name.encode())
    ok, rest = _split_owner(name)
    if not (ok and len(rest.encode()) <= MAX_NAME_LEN) and n > MAX_NAME_LEN:
        return "object name is %d bytes, at most %d" % (n, MAX_NAME_LEN)
    if not _printable(name):
        return "object name %r contains a non-printable character" % name
    bare = rest if ok else name
    if bare[0].isspace() or name[-1].isspace():
        return "object name %r starts or ends with a space" % name
    i = bare.find(":")
    if 0 < i < len(bare) - 1 and bare[:i].strip("0123456789 ") == "" and not _split_owner(bare)[0]:
        return "object name %r: %r is not a uid in canonical decimal" % (name, bare[:i])
    return None


def check_layout(layout: Layout, size: Callable[[int], Optional[int]]) -> None:
    """Check a layout against region sizes (``size(i)``: region i's size, None when
    there is no region i), as Go's Layout.check; raises InvalidDescError."""
    if not isinstance(layout.blocks, int) or not 0 < layout.blocks <= MAX_BLOCKS:
        raise _bad("blocks", "%r blocks, want 1 to %d" % (layout.blocks, MAX_BLOCKS))
    layers = layout.layers
    if not 0 < len(layers) <= MAX_LAYERS:
        raise _bad("layers", "%d layers, want 1 to %d" % (len(layers), MAX_LAYERS))
    parts = len(layers[0])
    if not 0 < parts <= MAX_PARTS:
        raise _bad("layers", "%d parts a layer, want 1 to %d" % (parts, MAX_PARTS))
    last = layout.blocks - 1
    for li, layer in enumerate(layers):
        if len(layer) != parts:
            raise _bad("layers", "layer %d has %d parts, layer 0 %d: every layer has the same parts" % (li, len(layer), parts))
        for pi, p in enumerate(layer):
            n = size(p.region) if isinstance(p.region, int) else None
            if n is None:
                raise _bad("layers", "layer %d part %d names region %r, which the space does not have" % (li, pi, p.region))
            if not (isinstance(p.base, int) and isinstance(p.stride, int) and isinstance(p.nbytes, int)) or \
                    p.nbytes <= 0 or p.base < 0 or p.stride < p.nbytes or p.stride > MAX_OBJECT_SIZE:
                raise _bad("layers", "layer %d part %d: base %r, stride %r, bytes %r: want bytes > 0, base >= 0, bytes <= stride <= %d"
                           % (li, pi, p.base, p.stride, p.nbytes, MAX_OBJECT_SIZE))
            if p.base > n or p.nbytes > n - p.base or (last > 0 and last > (n - p.base - p.nbytes) // p.stride):
                raise _bad("layers", "layer %d part %d: %d blocks of %d bytes every %d bytes from %d pass the end of region %d (%d bytes)"
                           % (li, pi, layout.blocks, p.nbytes, p.stride, p.base, p.region, n))


@dataclasses.dataclass
class Desc:
    """A registered KV space's description: its qualified name (``UID:NAME``; region
    i is the registered object ``NAME/i`` of that uid), ``id`` (16 random bytes drawn
    at each registration: a description of an earlier registration is refused),
    ``node`` (empty on one node), its regions and its layout. ``to_text()`` is what an
    engine puts in its own metadata (vLLM's kv_transfer_params)."""
    name: str
    id: bytes
    regions: List[Region]
    layout: Layout
    node: str = ""

    @property
    def blocks(self) -> int:
        """Blocks in every part of every layer."""
        return self.layout.blocks

    @property
    def layers(self) -> List[List[Part]]:
        """The layout's layers: ``layers[l][p]`` is layer l's part p."""
        return self.layout.layers

    def region_name(self, i: int) -> str:
        """The name of region i's registered object (qualified, so any uid reads it)."""
        return "%s/%d" % (self.name, i)

    def validate(self) -> None:
        """Check the description against the format's rules (Go's Desc.Validate):
        bounds, names, and every block of every part inside its region without
        overflow. Raises InvalidDescError naming the field."""
        why = _name_error(self.name) if isinstance(self.name, str) else "not a string"
        if why is not None or len(self.name.encode()) > 0xFFFF:
            raise _bad("name", "%r is no object name: %s" % (self.name, why))
        if not isinstance(self.node, str) or len(self.node.encode()) > MAX_NODE:
            raise _bad("node", "at most %d bytes of UTF-8" % MAX_NODE)
        if not _printable(self.node):
            raise _bad("node", "%r has a non-printable character" % self.node)
        if not 0 < len(self.regions) <= MAX_REGIONS:
            raise _bad("regions", "%d regions, want 1 to %d" % (len(self.regions), MAX_REGIONS))
        for i, r in enumerate(self.regions):
            if not isinstance(r.size, int) or not 0 < r.size <= MAX_OBJECT_SIZE:
                raise _bad("regions", "region %d is %r bytes, want 1 to %d" % (i, r.size, MAX_OBJECT_SIZE))
            if r.device != "host":
                try:
                    parse_uuid(r.device)
                except (ValueError, AttributeError, TypeError):
                    raise _bad("regions", "region %d is on %r, neither host nor a GPU UUID" % (i, r.device)) from None
        regions = self.regions
        check_layout(self.layout, lambda i: regions[i].size if 0 <= i < len(regions) else None)
        if not isinstance(self.id, (bytes, bytearray)) or len(self.id) != 16:
            raise _bad("id", "%r: want 16 bytes" % (self.id,))

    def to_bytes(self) -> bytes:
        """The binary encoding of a valid description (Go's MarshalBinary)."""
        self.validate()
        layers = self.layers
        name, node = self.name.encode(), self.node.encode()
        out = [HEADER.pack(MAGIC, VERSION, len(layers[0]), len(layers), self.blocks, bytes(self.id), len(self.regions)),
               struct.pack("<H", len(name)), name, struct.pack("<H", len(node)), node]
        for r in self.regions:
            if r.device == "host":
                out.append(REGION.pack(0, bytes(16), r.size))
            else:
                out.append(REGION.pack(1, parse_uuid(r.device), r.size))
        for layer in layers:
            for p in layer:
                out.append(PART.pack(p.region, p.base, p.stride, p.nbytes))
        b = b"".join(out)
        if len(b) > MAX_SPACE_SIZE:
            raise _bad("size", "%d bytes encoded, at most %d: fewer layers, parts or regions" % (len(b), MAX_SPACE_SIZE))
        return b

    @classmethod
    def from_bytes(cls, b: Union[bytes, bytearray, memoryview]) -> "Desc":
        """Decode and validate a binary description (Go's UnmarshalBinary); every
        error is an InvalidDescError."""
        b = bytes(b)
        if len(b) > MAX_SPACE_SIZE:
            raise _bad("size", "%d bytes, at most %d" % (len(b), MAX_SPACE_SIZE))
        if len(b) < HEADER.size or b[:4] != MAGIC:
            raise _bad("magic", "not a space description")
        _, version, parts, layers, blocks, ident, regions = HEADER.unpack_from(b)
        if version != VERSION:
            raise _bad("version", "version %d, this build reads %d" % (version, VERSION))
        if not (0 < parts <= MAX_PARTS and 0 < layers <= MAX_LAYERS and 0 < regions <= MAX_REGIONS and 0 < blocks <= MAX_BLOCKS):
            raise _bad("header", "%d layers of %d parts, %d regions, %d blocks: out of bounds" % (layers, parts, regions, blocks))
        pos = HEADER.size
        strs: List[bytes] = []
        for field in ("name", "node"):
            if len(b) - pos < 2:
                raise _bad(field, "truncated")
            (n,) = struct.unpack_from("<H", b, pos)
            if len(b) - pos < 2 + n:
                raise _bad(field, "truncated")
            strs.append(b[pos + 2:pos + 2 + n])
            pos += 2 + n
        want = regions * REGION.size + layers * parts * PART.size
        if len(b) - pos != want:
            raise _bad("size", "%d bytes of regions and parts, want %d" % (len(b) - pos, want))
        regs: List[Region] = []
        for i in range(regions):
            kind, u, size = REGION.unpack_from(b, pos + i * REGION.size)
            zero = u == bytes(16)
            if kind == 0 and zero:
                dev = "host"
            elif kind == 1 and not zero:
                dev = uuid_text(u)
            else:
                raise _bad("regions", "region %d: kind %d with a UUID that does not fit it" % (i, kind))
            if size > MAX_OBJECT_SIZE:
                raise _bad("regions", "region %d is %d bytes, at most %d" % (i, size, MAX_OBJECT_SIZE))
            regs.append(Region(dev, size))
        pos += regions * REGION.size
        lays: List[List[Part]] = []
        for li in range(layers):
            row: List[Part] = []
            for pi in range(parts):
                region, base, stride, nbytes = PART.unpack_from(b, pos + (li * parts + pi) * PART.size)
                for v in (base, stride, nbytes):
                    if v > MAX_OBJECT_SIZE:
                        raise _bad("layers", "layer %d part %d: a value of %d, past any region" % (li, pi, v))
                row.append(Part(region, base, stride, nbytes))
            lays.append(row)
        # Go keeps undecodable UTF-8 in its strings and refuses it in Validate, name
        # first: so here, after every structural check.
        try:
            name = strs[0].decode("utf-8")
        except UnicodeDecodeError:
            raise _bad("name", "%r is no object name: not valid UTF-8" % strs[0]) from None
        why = _name_error(name)
        if why is not None:
            raise _bad("name", "%r is no object name: %s" % (name, why))
        try:
            node = strs[1].decode("utf-8")
        except UnicodeDecodeError:
            raise _bad("node", "at most %d bytes of UTF-8" % MAX_NODE) from None
        d = cls(name, ident, regs, Layout(blocks, lays), node)
        d.validate()
        return d

    def to_text(self) -> str:
        """Base64 of the binary encoding, for an engine's own (JSON) metadata."""
        return base64.b64encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_text(cls, t: Union[str, bytes]) -> "Desc":
        """Decode :meth:`to_text`'s encoding (Go's UnmarshalText)."""
        raw = t.encode("utf-8", "surrogateescape") if isinstance(t, str) else bytes(t)
        if len(raw) > MAX_TEXT:
            raise _bad("size", "%d bytes of base64, at most %d" % (len(raw), MAX_TEXT))
        raw = raw.replace(b"\r", b"").replace(b"\n", b"")   # as Go's decoder, which skips line breaks
        if len(raw) % 4 or not _B64.fullmatch(raw):
            raise _bad("text", "not base64 (standard alphabet, padded)")
        try:
            b = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad("text", "not base64: %s" % e) from None
        return cls.from_bytes(b)

    def to_dict(self) -> Dict[str, Any]:
        """The description as JSON-ready data (the shared vectors' form)."""
        return {"name": self.name, "id": bytes(self.id).hex(), "node": self.node,
                "regions": [{"device": r.device, "size": r.size} for r in self.regions],
                "blocks": self.blocks,
                "layers": [[{"region": p.region, "base": p.base, "stride": p.stride, "bytes": p.nbytes} for p in layer]
                           for layer in self.layers]}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Desc":
        """The description of :meth:`to_dict`'s data (not validated: :meth:`validate`)."""
        return cls(d["name"], bytes.fromhex(d["id"]), [Region(r["device"], r["size"]) for r in d["regions"]],
                   Layout(d["blocks"], [[Part(p["region"], p["base"], p["stride"], p["bytes"]) for p in layer]
                                        for layer in d["layers"]]), d.get("node", ""))

