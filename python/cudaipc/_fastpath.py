"""The lease fast path (docs/protocol.md 6.7, docs/architecture.md "Lease fast path").

At connect the client asks for its connection's lease table: a memfd of 64-bit words,
one per lease slot, that the daemon and this client change only by atomic
compare-and-swap. A lease of a plain object granted with a slot is released by one
swap (held -> idle), with no system call; the client keeps the released lease's
mapping, and a later ``get`` of the same name takes it back with one swap (idle ->
held). A swap that fails (the daemon reclaimed the lease, or doomed it because the
object was deleted) sends the operation through the socket instead.

Python has no compare-and-swap of its own. It is called through ctypes in
libatomic (GCC's runtime, ``__atomic_compare_exchange_8``: ``lock cmpxchg`` on
x86-64), and only when libatomic says 8-byte atomics are lock-free (a lock-based
libatomic would not be atomic against the daemon). Without it the client uses the
socket for every lease (logged once at debug level); it never falls back to a plain
read-modify-write of a shared word.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Any, Dict, List, Optional

from ._wire import MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, libc

_log = logging.getLogger("cudaipc")

_SEQ_CST = 5            # __ATOMIC_SEQ_CST
_HELD, _IDLE = 1, 2     # slot states (bits 1..0); bit 2: doomed; bits 63..3: generation
_GEN_SHIFT = 3
MAX_SLOTS = 1 << 16     # protocol.MaxLeaseSlots

_NO_ATOMICS_ENV = "CUDAIPC_NO_ATOMICS"   # tests: behave as if libatomic were missing


class _Atomics:
    """``cas(addr, expected_addr, desired) -> bool``, bound once per process."""

    def __init__(self, cas: Any):
        self.cas = cas


_atomics: Optional[_Atomics] = None
_atomics_loaded = False
_atomics_lock = threading.Lock()


def atomics() -> Optional[_Atomics]:
    """The process's compare-and-swap, or None when no lock-free one can be had."""
    global _atomics, _atomics_loaded
    if _atomics_loaded:
        return _atomics
    with _atomics_lock:
        if not _atomics_loaded:
            _atomics = _load()
            _atomics_loaded = True
    return _atomics


def _reset_for_tests() -> None:
    global _atomics, _atomics_loaded
    with _atomics_lock:
        _atomics, _atomics_loaded = None, False


def _load() -> Optional[_Atomics]:
    if os.environ.get(_NO_ATOMICS_ENV):
        _log.debug("cudaipc: lease fast path off: %s is set; leases go through the socket", _NO_ATOMICS_ENV)
        return None
    names = ["libatomic.so.1"]
    found = ctypes.util.find_library("atomic")
    if found and found not in names:
        names.append(found)
    for name in names:
        try:
            # PyDLL: the call keeps the GIL (it takes nanoseconds; releasing and
            # re-taking the GIL would cost more than the swap).
            lib = ctypes.PyDLL(name)
            cas = lib.__atomic_compare_exchange_8
            lock_free = lib.__atomic_is_lock_free
        except (OSError, AttributeError):
            continue
        # No argtypes: every call passes ctypes objects made once per lease (the
        # slot's address, the expected word's address, the desired word) and two
        # small ints, which ctypes hands over without conversion (half the cost of
        # converting Python ints through argtypes). The result is read as a C bool:
        # the function sets only the low byte of its return register.
        cas.restype = ctypes.c_bool
        lock_free.restype = ctypes.c_bool
        lock_free.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
        probe = ctypes.c_uint64(0)
        if not lock_free(8, ctypes.addressof(probe)):
            _log.debug("cudaipc: lease fast path off: %s's 8-byte atomics are not lock-free", name)
            return None
        # A self-check on private memory: a swap that must succeed and one that must fail.
        exp = ctypes.c_uint64(0)
        pp, pe = ctypes.c_void_p(ctypes.addressof(probe)), ctypes.c_void_p(ctypes.addressof(exp))
        big = (1 << 63) | (5 << 3) | 2   # all 64 bits travel
        ok1 = cas(pp, pe, ctypes.c_uint64(big), _SEQ_CST, _SEQ_CST)
        exp.value = 7
        ok2 = cas(pp, pe, ctypes.c_uint64(9), _SEQ_CST, _SEQ_CST)
        if ok1 is not True or ok2 is not False or probe.value != big or exp.value != big:
            _log.debug("cudaipc: lease fast path off: %s's compare-and-swap misbehaved", name)
            return None
        return _Atomics(cas)
    _log.debug("cudaipc: lease fast path off: no libatomic.so.1 (GCC's atomics runtime); leases go through the socket")
    return None


def held_word(gen: int) -> int:
    return (gen << _GEN_SHIFT) | _HELD


def idle_word(gen: int) -> int:
    return (gen << _GEN_SHIFT) | _IDLE


class LeaseTable:
    """This client's mapping of its connection's lease table, and the leases it
    released through it (by object name, newest last). An entry is the store's record
    of the lease (its _memory.Record): it has ``name``, ``slot``, ``gen``, ``arena_id`` and
    ``drop()`` (let go of what it keeps once the daemon ended the lease)."""

    def __init__(self, fd: int, slots: int, cas: Any):
        if not 0 < slots <= MAX_SLOTS:
            raise ValueError("lease table of %d slots (want 1..%d)" % (slots, MAX_SLOTS))
        size = slots * 8
        st = os.fstat(fd)
        if st.st_size < size:
            raise ValueError("lease table memfd has %d bytes, %d slots need %d" % (st.st_size, slots, size))
        addr = libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if addr is None or addr == MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, "mmap of the lease table: %s" % os.strerror(e))
        self.addr = int(addr)
        self.size = size
        self.slots = slots
        self._cas = cas
        # Re-entrant: a lease collected while this thread holds the lock (a garbage
        # collection inside the critical section) releases through it too.
        self.lock = threading.RLock()
        self._acquire, self._release = self.lock.acquire, self.lock.release
        self.idle: Dict[str, List[Any]] = {}
        self.by_slot: Dict[int, Any] = {}
        self.closed = False

    def word(self, slot: int) -> int:
        """The slot's word as it is now (tests and diagnostics; aligned 8-byte read)."""
        with self.lock:
            if self.closed:
                return 0
            return ctypes.c_uint64.from_address(self.addr + (slot - 1) * 8).value

    def prepare(self, e: Any, slot: int, gen: int) -> None:
        """Give lease e (granted in slot with generation gen) what its swaps pass:
        the slot's address, and its held and idle words, each a c_uint64 (the
        expected word by address, the desired one by value)."""
        if not 0 < slot <= self.slots:
            raise ValueError("lease slot %d outside the table's 1..%d" % (slot, self.slots))
        e.slot, e.gen = slot, gen
        e.w_held, e.w_idle = ctypes.c_uint64((gen << _GEN_SHIFT) | _HELD), ctypes.c_uint64((gen << _GEN_SHIFT) | _IDLE)
        e.p_slot = ctypes.c_void_p(self.addr + (slot - 1) * 8)
        e.p_held, e.p_idle = ctypes.c_void_p(ctypes.addressof(e.w_held)), ctypes.c_void_p(ctypes.addressof(e.w_idle))

    # The swaps run under self.lock: it keeps the table mapped, and an entry's words
    # are used by one swap at a time. A failed swap writes the word it found into the
    # expected word; it is put back (the entry is dropped anyway). The hot paths take
    # the lock by acquire()/release() bound once (a with block costs twice as much).
    def release(self, e: Any) -> bool:
        """Release lease e: (gen, held) -> (gen, idle), and keep it for a later
        take-back. False: the swap failed (doomed, or the word is not this held
        lease) or the table is gone; release through the socket."""
        stale = None
        self._acquire()
        try:
            if self.closed:
                return False
            if not self._cas(e.p_slot, e.p_held, e.w_idle, _SEQ_CST, _SEQ_CST):
                e.w_held.value = (e.gen << _GEN_SHIFT) | _HELD
                return False
            by_slot = self.by_slot
            old = by_slot.setdefault(e.slot, e)
            if old is not e:   # cannot be: the daemon grants only free slots
                stale = self._forget(old)
                by_slot[e.slot] = e
            lst = self.idle.get(e.name)
            if lst is None:
                if len(self.idle) >= 2 * self.slots:   # names emptied by take-backs: prune
                    for k in [k for k, v in self.idle.items() if not v]:
                        del self.idle[k]
                self.idle[e.name] = [e]
            else:
                lst.append(e)   # (an emptied list is kept: the next release of the name refills it)
        finally:
            self._release()
        if stale is not None:
            return_stale([stale])
        return True

    def retake(self, name: str) -> Any:
        """Take back an idle lease of name the daemon has not reclaimed: its entry,
        or None. Leases found reclaimed are forgotten (their ``drop`` runs)."""
        stale = None
        got = None
        self._acquire()
        try:
            lst = self.idle.get(name)   # (close() empties idle: nothing is taken back from a closed table)
            while lst:
                e = lst.pop()
                self.by_slot.pop(e.slot, None)   # (an idle entry is recorded in its slot)
                if self._cas(e.p_slot, e.p_idle, e.w_held, _SEQ_CST, _SEQ_CST):
                    got = e
                    break
                e.w_idle.value = (e.gen << _GEN_SHIFT) | _IDLE
                if stale is None:
                    stale = []
                stale.append(e)   # reclaimed or doomed: the daemon ended it
        finally:
            self._release()
        if stale:
            return_stale(stale)
        return got

    def granted(self, slot: int) -> None:
        """The daemon granted a lease in slot: an idle lease still recorded there was
        reclaimed (the daemon grants only free slots); forget it."""
        if not self.by_slot:
            return
        with self.lock:
            e = self.by_slot.get(slot)
            if e is None:
                return
            self._forget(e)
        return_stale([e])

    def _forget(self, e: Any) -> Any:
        """Remove e from the records (lock held)."""
        if self.by_slot.get(e.slot) is e:
            del self.by_slot[e.slot]
        lst = self.idle.get(e.name)
        if lst is not None:
            try:
                lst.remove(e)
            except ValueError:
                pass
            if not lst:
                del self.idle[e.name]
        return e

    def drop_arenas(self, ids: Any) -> None:
        """Forget idle leases in arenas the daemon emptied (so reclaimed)."""
        want = set(ids)
        out: List[Any] = []
        with self.lock:
            for e in list(self.by_slot.values()):
                if e.arena_id in want:
                    out.append(self._forget(e))
        return_stale(out)

    def close(self) -> None:
        """Unmap the table and forget every idle lease (the connection is closed: the
        daemon ends them)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            out = list(self.by_slot.values())
            self.by_slot.clear()
            self.idle.clear()
            libc.munmap(self.addr, self.size)
        return_stale(out)

    def idle_count(self) -> int:
        with self.lock:
            return len(self.by_slot)


def return_stale(entries: List[Any]) -> None:
    """Let go of what idle leases that ended kept (their GPU arena references)."""
    for e in entries:
        try:
            e.drop()
        except Exception:  # noqa: BLE001 - a closed connection, interpreter shutdown
            pass
