"""Regions (docs/region.md): what one process hands another so that it can map a
byte range of GPU memory without copying it. The binary (164 bytes for one
allocation, version 1; 168 + 24 per further piece for a vmm-fd range over several,
version 2) and JSON encodings are byte-for-byte those of the Go package
(region.go); the shared vectors in testdata/region/ keep both honest.

A region is a bearer capability: whoever holds one on the same machine (and,
for legacy CUDA IPC, in the same PID namespace) can read and write the memory.
Never log one.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
import re
import struct
import zlib
from typing import Any, Dict, Optional, Tuple, Union

from . import _cuda
from .errors import InvalidRegion

__all__ = ["Region", "Piece", "KIND_CUDA_IPC", "KIND_VMM_FD", "KIND_HOST", "BINARY_SIZE", "decode_region"]

KIND_CUDA_IPC = 1
"""Memory from cuMemAlloc/cudaMalloc exported with cuIpcGetMemHandle ("cuda-ipc")."""
KIND_VMM_FD = 2
"""A VMM allocation (cuMemCreate) whose POSIX file descriptor travels beside the region ("vmm-fd")."""
KIND_HOST = 3
"""Reserved: shared host memory ("host")."""

_KIND_NAMES = {KIND_CUDA_IPC: "cuda-ipc", KIND_VMM_FD: "vmm-fd", KIND_HOST: "host"}
VERSION = 1
"""The format version of a region of one allocation."""
VERSION_PIECES = 2
"""The format version of a vmm-fd region over several allocations (``more_pieces``)."""
BINARY_SIZE = 164
"""The length of a version 1 binary region."""
MAX_PIECES = 1 << 16
"""The most allocations one region spans (region.go's MaxRegionPieces)."""
_PIECE_SIZE = 24
_MAGIC = b"CIPR"
_FIELDS = ("version", "kind", "handle", "allocation_id", "offset", "size", "alloc_size", "device",
           "exporter_pid", "pid_namespace", "boot_id", "buffer_id", "exporter_base", "more_pieces")
_U63 = 1 << 63

Piece = Tuple[bytes, int]
"""A further allocation of a version 2 region: its 16-byte allocation id and its size."""


def _uuid_text(b: bytes) -> str:
    h = b.hex()
    return "%s-%s-%s-%s-%s" % (h[0:8], h[8:12], h[12:16], h[16:20], h[20:32])


def parse_gpu_uuid(s: str) -> bytes:
    """The 16 bytes of a GPU UUID written "GPU-xxxxxxxx-xxxx-..." (prefix optional)."""
    t = s[4:] if s.startswith("GPU-") else s
    t = t.replace("-", "")
    if len(t) != 32:
        raise ValueError("invalid GPU UUID %r: want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" % s)
    try:
        return bytes.fromhex(t)
    except ValueError as e:
        raise ValueError("invalid GPU UUID %r: %s" % (s, e)) from None


def gpu_uuid_text(b: bytes) -> str:
    """The text form of a GPU UUID's 16 bytes, as nvidia-smi -L prints it."""
    return "GPU-" + _uuid_text(b)


def _parse_boot_id(s: str) -> bytes:
    s = s.lower()
    if len(s) != 36 or s[8] != "-" or s[13] != "-" or s[18] != "-" or s[23] != "-":
        raise ValueError("%r: want xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" % s)
    return bytes.fromhex(s[0:8] + s[9:13] + s[14:18] + s[19:23] + s[24:36])


@dataclasses.dataclass(frozen=True)
class Region:
    """A byte range of a GPU allocation exported by one process (docs/region.md).

    Build one with :meth:`from_torch`, :meth:`from_cupy` or :meth:`from_pointer`;
    encode with :meth:`to_bytes` / :meth:`to_json`; decode with
    :meth:`from_bytes` / :meth:`from_json` (or :func:`decode_region`); map it in
    another process with :func:`cudaipc.import_region`.
    """

    handle: bytes          # cuda-ipc: 64 bytes of cuIpcGetMemHandle of the allocation's base; vmm-fd: 64 zero bytes
    offset: int            # first byte of the region inside the allocation
    size: int              # length in bytes, > 0
    alloc_size: int        # size of the whole allocation
    device: bytes          # 16-byte UUID of the GPU holding the memory
    exporter_pid: int
    pid_namespace: int     # inode of the exporter's /proc/self/ns/pid
    boot_id: bytes         # 16 bytes of /proc/sys/kernel/random/boot_id
    buffer_id: int         # cuda-ipc: CU_POINTER_ATTRIBUTE_BUFFER_ID of the allocation; vmm-fd: 0
    exporter_base: int     # the allocation's base address in the exporter
    kind: int = KIND_CUDA_IPC
    version: int = VERSION
    allocation_id: bytes = bytes(16)  # vmm-fd: 16 bytes naming the allocation; cuda-ipc: zero
    # vmm-fd, version 2: the allocations mapped right after the first one, back to
    # back in address order, as (allocation id, size); offset and size then address
    # the whole range and one descriptor per piece, first piece first, travels beside.
    more_pieces: Tuple[Piece, ...] = ()

    # -- validation ---------------------------------------------------------
    def validate(self) -> None:
        """Raise InvalidRegion naming the first bad field, in the order region.go checks them."""
        bad = InvalidRegion
        if self.version not in (VERSION, VERSION_PIECES):
            raise bad("version", "%d: this package reads versions %d and %d" % (self.version, VERSION, VERSION_PIECES))
        if self.version == VERSION_PIECES and self.kind != KIND_VMM_FD:
            raise bad("version", "%d is the form of a vmm-fd region of several allocations; this region is %s"
                      % (self.version, _KIND_NAMES.get(self.kind, "kind(%d)" % self.kind)))
        if self.version == VERSION_PIECES and not self.more_pieces:
            raise bad("pieces", "a version %d region spans at least two allocations; write one allocation as version %d"
                      % (self.version, VERSION))
        if self.version == VERSION and self.more_pieces:
            raise bad("version", "%d: a region of %d allocations is version %d"
                      % (self.version, 1 + len(self.more_pieces), VERSION_PIECES))
        if len(self.more_pieces) >= MAX_PIECES:
            raise bad("pieces", "%d allocations: at most %d" % (1 + len(self.more_pieces), MAX_PIECES))
        if self.kind == KIND_HOST:
            raise bad("kind", "%s (%d) is reserved and not implemented by this version" % (_KIND_NAMES[self.kind], self.kind))
        if self.kind == 0:
            raise bad("kind", "missing")
        if self.kind not in (KIND_CUDA_IPC, KIND_VMM_FD):
            raise bad("kind", "unknown kind %d" % self.kind)
        if len(self.handle) != 64:
            raise bad("handle", "%d bytes, want 64" % len(self.handle))
        if len(self.allocation_id) != 16:
            raise bad("allocation_id", "%d bytes, want 16" % len(self.allocation_id))
        ipc = self.kind == KIND_CUDA_IPC
        if ipc and self.handle == bytes(64):
            raise bad("handle", "all zero bytes: not an exported handle")
        if ipc and self.allocation_id != bytes(16):
            raise bad("allocation_id", "set in a cuda-ipc region: only vmm-fd regions have one")
        if not ipc and self.allocation_id == bytes(16):
            raise bad("allocation_id", "zero: a vmm-fd region names its allocation by a non-zero id")
        if not ipc and self.handle != bytes(64):
            raise bad("handle", "set in a vmm-fd region: its descriptor travels beside the region, not in it")
        if not 0 < self.size < _U63:
            raise bad("size", "%d: must be positive" % self.size)
        if not 0 <= self.offset < _U63:
            raise bad("offset", "%d: must not be negative" % self.offset)
        if not 0 < self.alloc_size < _U63:
            raise bad("alloc_size", "%d: must be positive" % self.alloc_size)
        mapped = self._check_pieces()
        if self.offset > mapped or self.size > mapped - self.offset:
            if self.more_pieces:
                raise bad("size", "[%d, %d+%d) runs past the end of the %d bytes the %d allocations span"
                          % (self.offset, self.offset, self.size, mapped, 1 + len(self.more_pieces)))
            raise bad("size", "[%d, %d+%d) runs past the end of the %d-byte allocation"
                      % (self.offset, self.offset, self.size, self.alloc_size))
        if len(self.device) != 16 or self.device == bytes(16):
            raise bad("device", "zero GPU UUID")
        if not 0 < self.exporter_pid <= 0x7FFFFFFF:
            raise bad("exporter_pid", "%d: not a process id" % self.exporter_pid)
        if self.pid_namespace == 0:
            raise bad("pid_namespace", "zero: want the inode of the exporter's /proc/self/ns/pid")
        if len(self.boot_id) != 16 or self.boot_id == bytes(16):
            raise bad("boot_id", "zero: want the exporter's /proc/sys/kernel/random/boot_id")
        if ipc and self.buffer_id == 0:
            raise bad("buffer_id", "zero: want CU_POINTER_ATTRIBUTE_BUFFER_ID of the allocation")
        if not ipc and self.buffer_id != 0:
            raise bad("buffer_id", "%d in a vmm-fd region: must be zero (the allocation id names the allocation)" % self.buffer_id)
        if self.exporter_base == 0:
            raise bad("exporter_base", "zero: want the allocation's base address in the exporter")
        if self.exporter_base + mapped >= 1 << 64:
            raise bad("exporter_base", "%#x + %d bytes wraps around the address space" % (self.exporter_base, mapped))

    def _check_pieces(self) -> int:
        """Check more_pieces as region.go's checkPieces does; return the bytes all pieces span."""
        total = self.alloc_size
        if not self.more_pieces:
            return total
        seen = {self.allocation_id}
        for i, p in enumerate(self.more_pieces, 1):
            if not isinstance(p, tuple) or len(p) != 2 or not isinstance(p[0], bytes) or len(p[0]) != 16:
                raise InvalidRegion("pieces", "piece %d: want (16-byte allocation id, size)" % i)
            aid, n = p
            if aid == bytes(16):
                raise InvalidRegion("pieces", "piece %d: zero allocation id" % i)
            if not isinstance(n, int) or n <= 0:
                raise InvalidRegion("pieces", "piece %d: size %r: must be positive" % (i, n))
            if n > (_U63 - 1) // 4 - total:
                raise InvalidRegion("pieces", "piece %d: the pieces' sizes add up past 2^61" % i)
            if aid in seen:
                raise InvalidRegion("pieces", "piece %d: allocation %s appears twice" % (i, aid.hex()))
            seen.add(aid)
            total += n
        return total

    @property
    def mapped_size(self) -> int:
        """The bytes the region's allocations span together (alloc_size plus more_pieces)."""
        return self.alloc_size + sum(n for _, n in self.more_pieces)

    @property
    def pieces(self) -> Tuple[Piece, ...]:
        """Every allocation the region spans, first to last, as (allocation id, size)."""
        return ((self.allocation_id, self.alloc_size),) + tuple(self.more_pieces)

    # -- derived values -------------------------------------------------------
    @property
    def device_uuid(self) -> str:
        """The GPU's UUID in text form, "GPU-…"."""
        return gpu_uuid_text(self.device)

    def sub(self, off: int, size: int) -> "Region":
        """The part of this region that starts ``off`` bytes in and is ``size`` bytes long."""
        if off < 0 or size <= 0 or off > self.size or size > self.size - off:
            raise ValueError("Region.sub: [%d, %d+%d) is outside the %d-byte region" % (off, off, size, self.size))
        return dataclasses.replace(self, offset=self.offset + off, size=size)

    def __repr__(self) -> str:  # never the handle's bytes: it is a capability
        if self.kind == KIND_VMM_FD and self.more_pieces:
            return "Region(vmm-fd %d bytes at +%d of %d in %d allocations, %s, pid %d, first allocation %s)" % (
                self.size, self.offset, self.mapped_size, 1 + len(self.more_pieces), self.device_uuid,
                self.exporter_pid, self.allocation_id.hex())
        if self.kind == KIND_VMM_FD:
            return "Region(vmm-fd %d bytes at +%d of %d, %s, pid %d, allocation %s)" % (
                self.size, self.offset, self.alloc_size, self.device_uuid, self.exporter_pid, self.allocation_id.hex())
        return "Region(%s %d bytes at +%d of %d, %s, pid %d, buffer %d)" % (
            _KIND_NAMES.get(self.kind, self.kind), self.size, self.offset, self.alloc_size,
            self.device_uuid, self.exporter_pid, self.buffer_id)

    __str__ = __repr__

    # -- binary ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The binary encoding (docs/region.md): 164 bytes, or 168 + 24 per further piece."""
        self.validate()
        key = self.allocation_id + bytes(48) if self.kind == KIND_VMM_FD else self.handle
        b = _MAGIC + struct.pack("<HH", self.version, self.kind) + key
        b += struct.pack("<QQQ", self.offset, self.size, self.alloc_size) + self.device
        b += struct.pack("<IIQ", self.exporter_pid, 0, self.pid_namespace) + self.boot_id
        b += struct.pack("<QQ", self.buffer_id, self.exporter_base)
        if self.more_pieces:
            b += struct.pack("<I", 1 + len(self.more_pieces))
            b += b"".join(aid + struct.pack("<Q", n) for aid, n in self.more_pieces)
        return b + struct.pack("<I", zlib.crc32(b))

    @classmethod
    def from_bytes(cls, b: bytes) -> "Region":
        """Decode and validate the binary encoding; raise InvalidRegion otherwise."""
        b = bytes(b)
        if len(b) < 8:
            raise InvalidRegion("length", "%d bytes: too short for a binary region (%d)" % (len(b), BINARY_SIZE))
        if b[:4] != _MAGIC:
            raise InvalidRegion("magic", "%r: want %r" % (b[:4], _MAGIC))
        version, kind = struct.unpack_from("<HH", b, 4)
        if version not in (VERSION, VERSION_PIECES):
            raise InvalidRegion("version", "%d: this package reads versions %d and %d" % (version, VERSION, VERSION_PIECES))
        if version == VERSION_PIECES and kind != KIND_VMM_FD:
            raise InvalidRegion("version", "%d is the form of a vmm-fd region of several allocations; this region is %s"
                                % (version, _KIND_NAMES.get(kind, "kind(%d)" % kind)))
        want, count = BINARY_SIZE, 0
        if version == VERSION_PIECES:
            if len(b) < BINARY_SIZE + 4:
                raise InvalidRegion("length", "%d bytes: a version 2 region has at least %d"
                                    % (len(b), BINARY_SIZE + 4 + _PIECE_SIZE))
            (count,) = struct.unpack_from("<I", b, 160)
            if not 2 <= count <= MAX_PIECES:
                raise InvalidRegion("pieces", "piece count %d: want 2..%d" % (count, MAX_PIECES))
            want = BINARY_SIZE + 4 + _PIECE_SIZE * (count - 1)
        if len(b) != want:
            raise InvalidRegion("length", "%d bytes: want %d" % (len(b), want))
        end = want - 4
        (crc,) = struct.unpack_from("<I", b, end)
        if crc != zlib.crc32(b[:end]):
            raise InvalidRegion("crc32", "%#08x: bytes 0-%d sum to %#08x" % (crc, end - 1, zlib.crc32(b[:end])))
        (flags,) = struct.unpack_from("<I", b, 116)
        if flags:
            raise InvalidRegion("flags", "%#x: no flags are defined; must be zero" % flags)
        off, size, alloc = struct.unpack_from("<QQQ", b, 72)
        if off >= _U63 or size >= _U63 or alloc >= _U63:
            raise InvalidRegion("size", "offset %d, size %d, alloc_size %d: must be below 2^63" % (off, size, alloc))
        (pid,) = struct.unpack_from("<I", b, 112)
        (ns,) = struct.unpack_from("<Q", b, 120)
        bid, base = struct.unpack_from("<QQ", b, 144)
        handle, aid = b[8:72], bytes(16)
        if kind == KIND_VMM_FD:
            if any(b[24:72]):
                raise InvalidRegion("handle", "bytes 24-71 of a vmm-fd region are reserved and must be zero")
            handle, aid = bytes(64), b[8:24]
        more = []
        for i in range(count - 1 if count else 0):
            at = BINARY_SIZE + _PIECE_SIZE * i
            (n,) = struct.unpack_from("<Q", b, at + 16)
            if n >= _U63:
                raise InvalidRegion("pieces", "piece %d: size %d: must be below 2^63" % (i + 1, n))
            more.append((b[at:at + 16], n))
        r = cls(handle=handle, offset=off, size=size, alloc_size=alloc, device=b[96:112],
                exporter_pid=pid, pid_namespace=ns, boot_id=b[128:144], buffer_id=bid,
                exporter_base=base, kind=kind, version=version, allocation_id=aid, more_pieces=tuple(more))
        r.validate()
        return r

    # -- JSON -----------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The JSON encoding as a dict, fields in the order Go writes them."""
        self.validate()
        d: Dict[str, Any] = {"version": self.version, "kind": _KIND_NAMES[self.kind]}
        if self.kind == KIND_VMM_FD:
            d["allocation_id"] = self.allocation_id.hex()
        else:
            d["handle"] = base64.b64encode(self.handle).decode()
        d.update({
            "offset": self.offset, "size": self.size, "alloc_size": self.alloc_size,
            "device": self.device_uuid, "exporter_pid": self.exporter_pid,
            "pid_namespace": self.pid_namespace, "boot_id": _uuid_text(self.boot_id),
        })
        if self.kind != KIND_VMM_FD:
            d["buffer_id"] = self.buffer_id
        d["exporter_base"] = "0x%x" % self.exporter_base
        if self.more_pieces:
            d["more_pieces"] = [{"allocation_id": aid.hex(), "alloc_size": n} for aid, n in self.more_pieces]
        return d

    def to_json(self) -> str:
        """The JSON encoding, byte for byte what Go's json.Marshal writes."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: Union[str, bytes, Dict[str, Any]]) -> "Region":
        """Decode and validate the JSON encoding (a string or an already parsed dict).

        Unknown fields are an error, so that a misspelt field is never read as zero."""
        if isinstance(s, dict):
            d = s
        else:
            try:
                d = json.loads(s)
            except ValueError as e:
                raise InvalidRegion("json", str(e)) from None
        if not isinstance(d, dict):
            raise InvalidRegion("json", "want one JSON object")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise InvalidRegion("json", "unknown field %r" % unknown[0])

        def num(f: str) -> int:
            v = d.get(f, 0)
            if not isinstance(v, int) or isinstance(v, bool):
                raise InvalidRegion("json", "field %s: want an integer, got %r" % (f, v))
            return v

        kind = 0
        if d.get("kind"):
            names = {v: k for k, v in _KIND_NAMES.items()}
            if d["kind"] not in names:
                raise InvalidRegion("kind", "unknown kind %r" % d["kind"])
            kind = names[d["kind"]]
        if kind == KIND_VMM_FD and "handle" in d:
            raise InvalidRegion("handle", "not a field of a vmm-fd region: its descriptor travels beside the region")
        if kind == KIND_VMM_FD and "buffer_id" in d:
            raise InvalidRegion("buffer_id", "not a field of a vmm-fd region")
        if kind == KIND_CUDA_IPC and "allocation_id" in d:
            raise InvalidRegion("allocation_id", "not a field of a cuda-ipc region")
        aid = bytes(16)
        if d.get("allocation_id") is not None:
            v = d["allocation_id"]
            if not isinstance(v, str) or not re.fullmatch(r"[0-9a-fA-F]{32}", v):
                raise InvalidRegion("json", "allocation_id: %r: want 32 hex digits" % (v,))
            aid = bytes.fromhex(v)
        handle = bytes(64)
        if d.get("handle"):
            try:
                handle = base64.b64decode(d["handle"], validate=True)
            except (binascii.Error, ValueError, TypeError) as e:
                raise InvalidRegion("json", "handle: %s" % e) from None
            if len(handle) != 64:
                raise InvalidRegion("json", "handle: %d bytes, want 64" % len(handle))
        device = bytes(16)
        if d.get("device"):
            try:
                device = parse_gpu_uuid(d["device"])
            except (ValueError, AttributeError) as e:
                raise InvalidRegion("json", "device: %s" % e) from None
        boot = bytes(16)
        if d.get("boot_id"):
            try:
                boot = _parse_boot_id(d["boot_id"])
            except (ValueError, AttributeError) as e:
                raise InvalidRegion("json", "boot_id: %s" % e) from None
        base = 0
        if d.get("exporter_base"):
            eb = d["exporter_base"]
            if not isinstance(eb, str) or not re.fullmatch(r"0x[0-9a-fA-F]{1,16}", eb):
                raise InvalidRegion("exporter_base", "%r: want a hex address such as \"0x7f3a00000000\"" % (eb,))
            base = int(eb[2:], 16)
        for f in ("offset", "size", "alloc_size"):
            if num(f) >= _U63 or num(f) < -_U63:
                raise InvalidRegion("json", "field %s: out of range" % f)
        more = cls._pieces_from_json(d)
        r = cls(handle=handle, offset=num("offset"), size=num("size"), alloc_size=num("alloc_size"),
                device=device, exporter_pid=num("exporter_pid"), pid_namespace=num("pid_namespace"),
                boot_id=boot, buffer_id=num("buffer_id"), exporter_base=base, kind=kind,
                version=num("version"), allocation_id=aid, more_pieces=more)
        r.validate()
        return r

    @staticmethod
    def _pieces_from_json(d: Dict[str, Any]) -> Tuple[Piece, ...]:
        """The more_pieces of a JSON region, checked as Go's decoder checks them."""
        if "more_pieces" not in d:
            return ()
        l = d["more_pieces"]
        if not isinstance(l, list):
            raise InvalidRegion("json", "more_pieces: want an array, got %r" % (l,))
        if not l:
            raise InvalidRegion("pieces", "an empty more_pieces: leave the field out for one allocation")
        if len(l) >= MAX_PIECES:
            raise InvalidRegion("pieces", "%d allocations: at most %d" % (1 + len(l), MAX_PIECES))
        out = []
        for i, p in enumerate(l, 1):
            if not isinstance(p, dict):
                raise InvalidRegion("json", "more_pieces: piece %d: want an object" % i)
            unknown = sorted(set(p) - {"allocation_id", "alloc_size"})
            if unknown:
                raise InvalidRegion("json", "unknown field %r" % unknown[0])
            aid = p.get("allocation_id")
            if aid is None:
                raise InvalidRegion("pieces", "piece %d: no allocation_id" % i)
            if not isinstance(aid, str) or not re.fullmatch(r"[0-9a-fA-F]{32}", aid):
                raise InvalidRegion("json", "allocation_id: %r: want 32 hex digits" % (aid,))
            n = p.get("alloc_size", 0)
            if not isinstance(n, int) or isinstance(n, bool) or not -_U63 <= n < _U63:
                raise InvalidRegion("json", "more_pieces: piece %d: alloc_size %r: want an integer" % (i, n))
            out.append((bytes.fromhex(aid), n))
        return tuple(out)

    # -- producers --------------------------------------------------------------
    @classmethod
    def from_pointer(cls, ptr: int, nbytes: int) -> "Region":
        """The region of ``nbytes`` at device address ``ptr`` (cudaMalloc memory, any
        offset inside the allocation: PyTorch's caching allocator and CuPy's pool
        carve tensors out of larger segments). The pointer's context must be
        current or be a primary context (as PyTorch and CuPy leave it)."""
        x = _cuda.export_legacy(ptr, nbytes)
        ns, boot = local_identity()
        return cls(handle=x.handle, offset=ptr - x.base, size=nbytes, alloc_size=x.alloc_size,
                   device=x.device, exporter_pid=os.getpid(), pid_namespace=ns, boot_id=boot,
                   buffer_id=x.buffer_id, exporter_base=x.base)

    @classmethod
    def from_torch(cls, tensor: Any) -> "Region":
        """The region of a CUDA ``torch.Tensor``'s memory (its storage's bytes that the
        tensor spans). Keep the tensor alive while importers use the region."""
        if not getattr(tensor, "is_cuda", False):
            raise ValueError("Region.from_torch: the tensor is on %s, want a CUDA tensor" % getattr(tensor, "device", "?"))
        if not tensor.is_contiguous():
            raise ValueError("Region.from_torch: the tensor is not contiguous; call .contiguous() first")
        n = tensor.numel() * tensor.element_size()
        if n == 0:
            raise ValueError("Region.from_torch: the tensor is empty")
        return cls.from_pointer(tensor.data_ptr(), n)

    @classmethod
    def from_cupy(cls, array: Any) -> "Region":
        """The region of a C-contiguous ``cupy.ndarray``'s memory."""
        if not array.flags.c_contiguous:
            raise ValueError("Region.from_cupy: the array is not C-contiguous")
        if array.nbytes == 0:
            raise ValueError("Region.from_cupy: the array is empty")
        with array.device:
            return cls.from_pointer(array.data.ptr, array.nbytes)


def decode_region(b: Union[bytes, str]) -> Region:
    """Decode either encoding: binary when it starts with the magic "CIPR", JSON otherwise."""
    if isinstance(b, (bytes, bytearray, memoryview)) and bytes(b[:4]) == _MAGIC:
        return Region.from_bytes(bytes(b))
    return Region.from_json(b)


def event_descriptor(handle: bytes, device: bytes, pid: int, pid_namespace: int, boot_id: bytes) -> bytes:
    """The binary EventDescriptor (docs/region.md, 124 bytes) of an interprocess event:
    its 64-byte cuIpcGetEventHandle, GPU UUID, exporter pid, PID namespace and boot id."""
    if len(handle) != 64 or len(device) != 16 or len(boot_id) != 16:
        raise ValueError("event descriptor: handle, device and boot id must be 64, 16 and 16 bytes")
    b = b"CIPE" + struct.pack("<HH", VERSION, 0) + handle + device
    b += struct.pack("<IIQ", pid, 0, pid_namespace) + boot_id
    return b + struct.pack("<I", zlib.crc32(b))


_identity: "Optional[tuple[int, bytes]]" = None


def local_identity() -> "tuple[int, bytes]":
    """This process's PID namespace inode and boot id, as regions record them: read
    once (a stat and a file read, about 20 µs, that a publish of 1,921 allocations
    would pay per allocation); neither changes during a process's life, and a forked
    child reads them afresh (a parent that unshared its PID namespace forks into the
    new one)."""
    global _identity
    ident = _identity
    if ident is None:
        ns = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = _parse_boot_id(f.read().strip())
        ident = _identity = (ns, boot)
    return ident


def _forget_identity() -> None:
    global _identity
    _identity = None


os.register_at_fork(after_in_child=_forget_identity)


_ = Optional  # typing re-export for older Pythons
