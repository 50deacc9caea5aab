"""Bundle manifests: the safetensors header that describes a bundle's tensors
(docs/protocol.md 6.3), its layout (256-byte-aligned offsets), and the parsed
layouts shared by the versions of one model (Go's bundle package)."""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import _gcpause
from ._deps import require
from .errors import InvalidArgument

ALIGNMENT = 256
"""Every tensor of a bundle starts at a multiple of this many bytes."""

# protocol dtype name (torch's) -> safetensors dtype name
TO_SAFETENSORS = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32",
    "float64": "F64", "int64": "I64", "uint64": "U64", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
}
FROM_SAFETENSORS = {v: k for k, v in TO_SAFETENSORS.items()}
# Characters Go's encoding/json escapes in strings and json.dumps does not: a
# manifest's bytes are the same whichever language wrote it.
_GO_ESCAPED = ("<", ">", "&", "\u2028", "\u2029")
_GO_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                             "\u2028": "\\u2028", "\u2029": "\\u2029"})
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
        "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
        "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}


@dataclasses.dataclass
class TensorEntry:
    """One tensor of a manifest: its bytes are [begin, end) of the object."""
    __slots__ = ("name", "dtype", "shape", "begin", "end")   # (dataclass(slots=True) needs Python 3.10)
    name: str
    dtype: str              # safetensors name: "BF16", ...
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    bits = BITS.get(dtype)
    if bits is None:
        raise ValueError("unknown safetensors dtype %r" % dtype)
    n = 1
    for d in shape:
        if d < 0:
            raise ValueError("negative dimension in %r" % (tuple(shape),))
        n *= d
    if n * bits % 8:
        raise ValueError("%d elements of %s are not a whole number of bytes" % (n, dtype))
    return n * bits // 8


def check_tensor_name(name: Any) -> None:
    """A TypeError naming a bundle key that is not a string (the manifest's keys are)."""
    if type(name) is not str:
        raise TypeError("state_dict key %r is a %s: a bundle's keys (its tensors' names) are strings"
                        % (name, type(name).__name__))


def layout(specs: Iterable[Tuple[str, str, Sequence[int]]], align: int = ALIGNMENT) -> Tuple[List[TensorEntry], int]:
    """Place (name, safetensors dtype, shape) one after the other, each at the next
    multiple of ``align``; returns the entries and the object size they need."""
    out: List[TensorEntry] = []
    seen = set()
    at = 0
    for name, dt, shape in specs:
        check_tensor_name(name)
        if name == "__metadata__" or name in seen:
            raise ValueError("tensor name %r is reserved or repeated" % name)
        seen.add(name)
        n = _nbytes(dt, shape)
        at = (at + align - 1) // align * align
        out.append(TensorEntry(name, dt, tuple(int(d) for d in shape), at, at + n))
        at += n
    return out, at


def encode_manifest(entries: Sequence[TensorEntry], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """The safetensors header of entries: "__metadata__" first, tensors in offset
    order, padded with spaces to a multiple of 8 bytes (as Go's bundle.Marshal)."""
    parts = []
    if metadata:
        parts.append('"__metadata__":' + json.dumps({str(k): str(v) for k, v in sorted(metadata.items())},
                                                    separators=(",", ":"), ensure_ascii=False))
    for e in entries:
        check_tensor_name(e.name)
    for e in sorted(entries, key=lambda e: (e.begin, e.end, e.name)):
        parts.append('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}' % (
            json.dumps(e.name, ensure_ascii=False), e.dtype, ",".join(str(d) for d in e.shape), e.begin, e.end))
    text = "{" + ",".join(parts) + "}"
    if any(c in text for c in _GO_ESCAPED):   # (only inside strings: nothing else writes them)
        text = text.translate(_GO_ESCAPES)
    b = text.encode("utf-8")
    return b + b" " * (-len(b) % 8)


def parse_manifest(raw: bytes) -> Tuple[List[TensorEntry], Dict[str, str]]:
    """Decode a safetensors header: entries sorted by offset, and the metadata."""
    doc = json.loads(raw.decode("utf-8").rstrip(" "))
    if not isinstance(doc, dict):
        raise ValueError("a safetensors header is a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    out = [TensorEntry(name, e["dtype"], tuple(e["shape"]), e["data_offsets"][0], e["data_offsets"][1])
           for name, e in doc.items()]
    out.sort(key=lambda e: (e.begin, e.end))
    return out, meta


class Layout:
    """A parsed manifest, shared by every lease whose manifest has the same bytes
    (the versions of one model): parsing 18,000 entries takes longer than loading
    them, so it happens once per layout, not once per version."""

    def __init__(self, raw: bytes, parsed: Optional[Tuple[List[TensorEntry], Dict[str, str]]] = None):
        """``parsed``: the entries (sorted by offset) and metadata ``raw`` encodes, when
        the caller just encoded them (parsing them back would only cost time)."""
        self.raw = raw
        with _gcpause.paused():
            self.entries, self.metadata = parsed if parsed is not None else parse_manifest(raw)
            self.names = [e.name for e in self.entries]
            self.index = {n: i for i, n in enumerate(self.names)}
        self.nbytes = sum(e.end - e.begin for e in self.entries)
        self.size = max((e.end for e in self.entries), default=0)
        self._views: Dict[str, List[Tuple[Any, Tuple[int, ...]]]] = {}

    def view_types(self, lib: Any) -> List[Tuple[Any, Tuple[int, ...]]]:
        """(dtype, shape) of each entry's view in array library ``lib`` (_arrays):
        uint8 bytes for dtypes the library lacks."""
        v = self._views.get(lib.name)
        if v is None:
            u8 = lib.uint8()
            v = []
            with _gcpause.paused():
                for e in self.entries:
                    dt = lib.dtype(e.dtype)
                    v.append((dt, e.shape) if dt is not None else (u8, (e.end - e.begin,)))
            self._views[lib.name] = v
        return v


_LAYOUTS: List[Layout] = []   # recently seen layouts, newest last
_MAX_LAYOUTS = 8
_layout_lock = threading.Lock()


def layout_of(raw: bytes) -> Layout:
    with _layout_lock:
        for i in range(len(_LAYOUTS) - 1, -1, -1):
            lay = _LAYOUTS[i]
            if lay.raw == raw:   # a memcmp: far cheaper than parsing (or hashing) it
                if i != len(_LAYOUTS) - 1:
                    _LAYOUTS.append(_LAYOUTS.pop(i))
                return lay
    lay = Layout(raw)
    with _layout_lock:
        _LAYOUTS.append(lay)
        del _LAYOUTS[:-_MAX_LAYOUTS]
    return lay


_PUT_LAYOUTS: List[Tuple[List[str], List[Tuple[Any, Any]], Dict[str, str], "Layout"]] = []


def put_layout(names: List[str], shape_dtypes: List[Tuple[Any, Any]], metadata: Optional[Mapping[str, str]]) -> "Layout":
    """The layout of tensors with these names and (shape, dtype)s: laid out and
    encoded once, then found again by comparing the lists (a put of the next version)."""
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    with _layout_lock:
        for c in reversed(_PUT_LAYOUTS):
            if c[0] == names and c[1] == shape_dtypes and c[2] == meta:
                return c[3]
    with _gcpause.paused():
        entries, size = layout([(k, st_dtype_of(dt), tuple(sh)) for k, (sh, dt) in zip(names, shape_dtypes)])
        entries = sorted(entries, key=lambda e: (e.begin, e.end, e.name))   # as encode_manifest writes them
        lay = Layout(encode_manifest(entries, meta), (entries, meta))
    with _layout_lock:
        _LAYOUTS.append(lay)
        del _LAYOUTS[:-_MAX_LAYOUTS]
        _PUT_LAYOUTS.append((names, shape_dtypes, meta, lay))
        del _PUT_LAYOUTS[:-4]
    return lay


def st_dtype_of(dt: Any, op: str = "put") -> str:
    """The safetensors name of a dtype: a torch.dtype, a NumPy dtype or type, or a
    name ("float32", "bfloat16")."""
    if isinstance(dt, str) or type(dt).__module__.startswith("torch"):
        name = str(dt).replace("torch.", "")
    else:
        name = require("numpy", "NumPy dtypes").dtype(dt).name
    st = TO_SAFETENSORS.get(name)
    if st is None:
        raise InvalidArgument(op, "", "dtype %s has no safetensors name" % name)
    return st
