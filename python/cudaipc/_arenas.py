"""The GPU arena cache of one connection (the Go client's park.go and gpu.go).

A GPU placement lies in an arena: one legacy IPC region or one imported VMM
descriptor. The first placement in an arena maps it; later ones (and later get /
release cycles) reuse the mapping, so a cycle costs no driver call. A mapping
lives while leases or objects use it, and afterwards stays idle in an LRU of at
most ``max_idle`` arenas until:

- the daemon says the arena holds no object any more (arenas_freed),
- the LRU is over its bound (the least recently used one goes), or
- the connection closes;

then it is unmapped (once no view uses it) and the daemon is told (forget_arenas).
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Dict, List, Optional, Sequence

from . import _cuda
from . import _store_pb2 as pb
from ._memory import GPUClose
from ._wire import Conn
from .errors import InternalError
from .info import SHARE_CUDA_IPC, SHARE_VMM_FD
from .region import Region, local_identity, parse_gpu_uuid

__all__ = ["MAX_IDLE_ARENAS", "GPUArena", "ArenaCache"]

MAX_IDLE_ARENAS = 64
"""GPU arenas a Store keeps mapped while no lease or object uses them (LRU), by
default: the Go client's DefaultMaxIdleArenas."""


class GPUArena:
    """One GPU arena mapped by this connection: legacy IPC or an imported descriptor."""

    def __init__(self, arena_id: int, share: str, key: bytes, ptr: int, size: int, ordinal: int, close: GPUClose):
        self.arena_id, self.share, self.key = arena_id, share, key
        self.ptr, self.size, self.ordinal = ptr, size, ordinal
        self.close = close
        self.users = 0          # leases and objects using it
        self.cached = True      # in ArenaCache.arenas
        self.freed = False      # the daemon said it is empty
        self.unmapped = False


class ArenaCache:
    """The GPU arenas one connection maps, used or idle (see the module's
    documentation). ``max_idle`` <= 0 keeps none idle."""

    def __init__(self, conn: Conn, max_idle: int = MAX_IDLE_ARENAS):
        self.conn = conn
        self.max_idle = max_idle
        self.lock = threading.RLock()
        self.arenas: Dict[int, GPUArena] = {}   # arena id -> its mapping, used or idle
        self.idle: "collections.OrderedDict[int, GPUArena]" = collections.OrderedDict()

    def ipc_arena(self, p: Any, op: str, name: str) -> GPUArena:
        """The mapping of a CUDA_IPC placement's arena (mapped now if new)."""
        a = self.arenas.get(p.arena_id)
        if a is None or a.key != p.region:
            a = self._map_ipc(p, op, name)
        if p.offset + p.size > a.size:
            raise InternalError(op, name, "placement [%d, %d) lies outside the arena's %d-byte region" % (p.offset, p.offset + p.size, a.size))
        return a

    def _map_ipc(self, p: Any, op: str, name: str) -> GPUArena:
        try:
            r = Region.from_bytes(p.region)
        except Exception as e:  # noqa: BLE001
            raise InternalError(op, name, "daemon sent an invalid region: %s" % e) from None
        if r.device_uuid != p.device:
            raise InternalError(op, name, "placement on %s comes with a region of %s" % (p.device, r.device_uuid))
        ns, boot = local_identity()
        if r.boot_id != boot or r.pid_namespace != ns:
            raise InternalError(op, name, "the daemon runs in another PID namespace or boot: legacy CUDA IPC cannot reach it "
                                "(start the daemon with 'cudaipc serve --gpu-share fd', or share its PID namespace)")
        ordinal = _cuda.pick_ordinal(r.device)
        base = _cuda.ipc_open(r.handle, r.buffer_id, ordinal)
        a = GPUArena(p.arena_id, SHARE_CUDA_IPC, bytes(p.region), base + r.offset, r.size, ordinal,
                     GPUClose(_cuda.ipc_close, r.handle, r.buffer_id, ordinal))
        self._hold(a)
        return a

    def fd_arena(self, fd: int, p: Any, op: str, name: str) -> GPUArena:
        """The mapping of a VMM_FD placement's arena, imported from ``fd`` if new;
        ``fd`` is closed."""
        try:
            with self.lock:
                a = self.arenas.get(p.arena_id)
                if a is None or a.share != SHARE_VMM_FD or a.size < p.arena_size:
                    ordinal = _cuda.pick_ordinal(parse_gpu_uuid(p.device))
                    m = _cuda.FDArena(fd, p.arena_size, ordinal)
                    a = GPUArena(p.arena_id, SHARE_VMM_FD, b"", m.ptr, m.size, ordinal, GPUClose(m.close))
                    self._hold(a)
        finally:
            os.close(fd)
        if p.offset + p.size > a.size:
            raise InternalError(op, name, "placement [%d, %d) lies outside arena %d's %d-byte mapping" % (p.offset, p.offset + p.size, p.arena_id, a.size))
        return a

    def _hold(self, a: GPUArena) -> None:
        """Cache a newly mapped GPU arena (replacing, and letting go of, an older
        mapping of the same id)."""
        with self.lock:
            old = self.arenas.get(a.arena_id)
            self.arenas[a.arena_id] = a
        if old is not None:
            old.cached = False
            self._maybe_unmap(old, forget=False)

    def use(self, a: GPUArena) -> GPUClose:
        """Count one more lease or object in ``a``; the returned close uncounts it."""
        with self.lock:
            a.users += 1
            self.idle.pop(a.arena_id, None)
        return GPUClose(self._unref, a)

    def _unref(self, a: GPUArena) -> None:
        """A lease or object in the arena ended. The mapping stays (the next get there
        costs no driver call) until the daemon says the arena is empty, or the idle
        ones exceed max_idle."""
        evict: List[GPUArena] = []
        with self.lock:
            a.users -= 1
            if a.users == 0 and a.cached and not a.freed:
                self.idle[a.arena_id] = a
                while len(self.idle) > max(self.max_idle, 0):
                    _, old = self.idle.popitem(last=False)
                    old.cached = False
                    if self.arenas.get(old.arena_id) is old:
                        del self.arenas[old.arena_id]
                    evict.append(old)
        self._maybe_unmap(a, forget=True)
        for old in evict:
            self._maybe_unmap(old, forget=True)

    def _maybe_unmap(self, a: GPUArena, forget: bool) -> None:
        with self.lock:
            if a.users > 0 or (a.cached and not a.freed) or a.unmapped:
                return
            a.unmapped = True
            if self.arenas.get(a.arena_id) is a:
                del self.arenas[a.arena_id]
            self.idle.pop(a.arena_id, None)
        try:
            a.close()
        finally:
            if forget:
                self.conn.send_detached(pb.Request(forget_arenas=pb.ForgetArenasRequest(arena_ids=[a.arena_id])))

    def freed(self, ids: Sequence[int]) -> List[int]:
        """The daemon emptied these arenas: unmap the GPU ones (as soon as no view
        uses them; each is forgotten then). Returns the ids that are not GPU arenas
        of this cache."""
        other = []
        for i in ids:
            with self.lock:
                a: Optional[GPUArena] = self.arenas.get(i)
                if a is not None:
                    a.freed = True
                    a.cached = False
            if a is None:
                other.append(i)
            else:
                self._maybe_unmap(a, forget=True)
        return other

    def close(self) -> None:
        """The connection closed: unmap every arena no lease or object uses."""
        with self.lock:
            arenas = list(self.arenas.values())
            for a in arenas:
                a.cached = False
        for a in arenas:
            self._maybe_unmap(a, forget=False)
