"""Reading registered (external) memory: the Go client's placement of a registered
object (client/gpu.go, importPlacement). A get of such an object carries the
registered region (docs/region.md: a vmm-fd region, of version 2 when the memory
spans several allocations, or a legacy cuda-ipc one) and the first descriptors of a
vmm-fd region; the rest come by files requests (docs/protocol.md, section 6.5). The
memory is mapped read-only (CU_MEM_ACCESS_FLAGS_PROT_READ) through the process-wide
mapping cache (mapping.py). Registered host memory (a memfd: a KV space's host
regions) is mapped read-only through a per-connection cache (HostMaps)."""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, List, Optional, Tuple

from . import _store_pb2 as pb
from ._memory import GPUClose, Record
from ._wire import Conn, HostArena, Reply
from .errors import CudaError, InternalError
from .info import SHARE_CUDA_IPC, SHARE_HOST, SHARE_VMM_FD
from .mapping import map_region
from .region import KIND_VMM_FD, Region

__all__ = ["external_record", "host_record", "HostMaps", "MAX_HOST_MAPS"]

MAX_HOST_MAPS = 64
"""Mappings of registered host memory a Store keeps (Go's client keeps as many idle)."""


class HostMaps:
    """Registered host memory mapped once per memfd (by device and inode) and kept,
    the most recently used ``limit`` of them, so that repeated reads (a KV space's)
    neither map the memory again nor fault its pages in again: the Go client's
    hostext.go. A kept mapping keeps its memfd's memory after its registrant is gone,
    until the bound or close() lets go of it (leases still using it keep it)."""

    def __init__(self, limit: int = MAX_HOST_MAPS):
        self._lock = threading.Lock()
        self._maps: "collections.OrderedDict[Tuple[int, int], HostArena]" = collections.OrderedDict()
        self._limit = limit

    def map(self, fd: int, size: int, name: str) -> HostArena:
        """A read-only mapping of the memfd ``fd`` (which this call takes) of at
        least ``size`` bytes."""
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise InternalError("get", name, "registered host memory's memfd: %s" % e) from None
        if st.st_size < size:
            os.close(fd)
            raise InternalError("get", name, "registered host memory of %d bytes in a memfd of %d" % (size, st.st_size))
        key = (st.st_dev, st.st_ino)
        with self._lock:
            a = self._maps.get(key)
            if a is not None and a.size >= size:
                self._maps.move_to_end(key)
                os.close(fd)
                return a
            try:
                a = HostArena(fd, st.st_size, False)
            except OSError as e:
                os.close(fd)
                raise InternalError("get", name, "mapping registered host memory: %s" % e) from None
            if self._limit > 0:
                self._maps[key] = a
                while len(self._maps) > self._limit:
                    self._maps.popitem(last=False)
            return a

    def close(self) -> None:
        """Let go of the kept mappings (those leases use stay until they end)."""
        with self._lock:
            self._maps.clear()


def host_record(maps: HostMaps, conn: Conn, r: Reply, p: Any, name: str, desc: Any, end: Any) -> Record:
    """The read-only Record of a get of registered host memory (placement ``p`` of
    reply ``r``, whose memfd it takes)."""
    fds, r.fds = list(r.fds), ()
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise InternalError("get", name, "registered host memory came with %d descriptors, not its memfd" % len(fds))
    a = maps.map(fds[0], p.size, name)
    return Record(conn, name, p.size, "host", a.addr, None, False, SHARE_HOST, a, None, desc, end)

LEGACY_FIX = ("the exporter registered legacy (cudaMalloc) memory, which opens only in its own PID namespace "
              "and while it lives: have it allocate VMM memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) "
              "so that it registers descriptors")


def more_fds(conn: Conn, name: str, lease_id: int, fds: List[int], n: int) -> None:
    """Append to ``fds`` the lease's descriptors beyond those the get carried."""
    while len(fds) < n:
        req = pb.FilesRequest(lease_id=lease_id)
        setattr(req, "from", len(fds))   # "from" is a Python keyword
        rep = conn.call(pb.Request(files=req), "get", name)
        got, rep.fds = list(rep.fds), ()
        if getattr(rep.resp.files, "from") != len(fds) or not got or len(fds) + len(got) > n:
            for fd in got:
                os.close(fd)
            raise InternalError("get", name, "daemon answered descriptors from %d with %d" % (len(fds), len(got)))
        fds.extend(got)


def external_record(conn: Conn, r: Reply, p: Any, name: str, desc: Any, end: Any, lease_id: int) -> Record:
    """The read-only Record of a get of registered memory (placement ``p`` of reply
    ``r``, whose descriptors it takes and closes)."""
    fds, r.fds = list(r.fds), ()
    try:
        try:
            region = Region.from_bytes(p.region)
        except Exception as e:  # noqa: BLE001
            raise InternalError("get", name, "daemon sent an invalid region: %s" % e) from None
        vmm = region.kind == KIND_VMM_FD
        if vmm != (p.kind == pb.Placement.VMM_FD) or region.device_uuid != p.device:
            raise InternalError("get", name, "a placement of kind %d on %s comes with %r" % (p.kind, p.device, region))
        if p.offset + p.size > region.size:
            raise InternalError("get", name, "placement [%d, %d) lies outside the %d-byte region" % (p.offset, p.offset + p.size, region.size))
        if vmm:
            more_fds(conn, name, lease_id, fds, p.files)
            if len(fds) != len(region.pieces):
                raise InternalError("get", name, "%d descriptors for a region of %d allocations" % (len(fds), len(region.pieces)))
        part = region.sub(p.offset, p.size)
        try:
            addr, ordinal, close = map_region(part, fds if vmm else (), writable=False)
        except CudaError as e:
            if not vmm:
                raise CudaError(e.call, e.result, "%s: %s" % (LEGACY_FIX, e.detail)) from None
            raise
    finally:
        for fd in fds:
            os.close(fd)
    gpu_close: Optional[GPUClose] = GPUClose(close) if close is not None else None
    return Record(conn, name, p.size, p.device, addr, ordinal, False, SHARE_VMM_FD if vmm else SHARE_CUDA_IPC,
                  None, gpu_close, desc, end)
