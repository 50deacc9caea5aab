"""The connection to the daemon: SOCK_SEQPACKET framing, SCM_RIGHTS, request ids,
replies matched to callers, events, and the per-connection host arena cache
(docs/protocol.md sections 1, 2, 5 and 8)."""

from __future__ import annotations

import array
import collections
import ctypes
import itertools
import logging
import os
import re
import select
import socket
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from . import _store_pb2 as pb
from ._encode import id_field
from .errors import Closed, InternalError, InvalidArgument, StoreGone, StoreError, from_code

_log = logging.getLogger("cudaipc")

MAX_MESSAGE = 65536
MAX_FILES = 60  # protocol.MaxFiles: a register request or its get carries one per piece
_ANC = socket.CMSG_SPACE(4 * (MAX_FILES + 4))  # room for more than MAX_FILES, so extras are seen and closed

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_READ, PROT_WRITE, MAP_SHARED, MAP_PRIVATE, MAP_FIXED = 1, 2, 1, 2, 0x10
MAP_FAILED = ctypes.c_void_p(-1).value

# The socket module's flags as plain ints: combining its IntFlag members costs
# microseconds a receive (enum machinery).
_RECV = int(socket.MSG_CMSG_CLOEXEC)
_RECV_NOWAIT = int(socket.MSG_CMSG_CLOEXEC) | int(socket.MSG_DONTWAIT)
_TRUNC = int(socket.MSG_TRUNC) | int(socket.MSG_CTRUNC)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)
_PLACED = frozenset(("create", "get", "lease_table", "files"))   # answers that may carry a placement or descriptor
DEFAULT_SPIN = 50e-6   # seconds; the Go client's DefaultSpin
MAX_SPIN_SKIP = 64     # the most receives a fruitless polling window makes skip polling
MAX_KEPT_NOTICES = 1 << 16   # notices kept until taken (Go's client.MaxKeptNotices); the oldest go first
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(v: str) -> float:
    """Seconds of a Go duration string ("50us", "1.5ms", "0"); ValueError otherwise."""
    v = v.strip()
    if v in ("0", "+0", "-0"):
        return 0.0
    neg = v.startswith("-")
    body = v.lstrip("+-")
    total, pos = 0.0, 0
    for m in _DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError("not a duration: %r" % v)
    return -total if neg else total


def spin_option(spin: Optional[float]) -> float:
    """The polling window in seconds: $CUDAIPC_SPIN (a Go duration such as "50us", or
    "0" for none) overrides ``spin``; None means DEFAULT_SPIN; 0 or less, none."""
    v = os.environ.get("CUDAIPC_SPIN", "")
    if v:
        try:
            spin = parse_duration(v)
        except ValueError:
            raise InvalidArgument("dial", message="CUDAIPC_SPIN=%r is not a duration (e.g. 50us, or 0 for none)" % v) from None
    if spin is None:
        return DEFAULT_SPIN
    return max(float(spin), 0.0)


def _unmap(addr: int, size: int, fd: int) -> None:
    libc.munmap(addr, size)
    if fd < 0:
        return
    try:
        os.close(fd)
    except OSError:
        pass


def _fds_of(anc: Any) -> List[int]:
    """The descriptors of a received packet's SCM_RIGHTS messages."""
    fds: List[int] = []
    for level, typ, cdata in anc:
        if level == _SOL_SOCKET and typ == _SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[: len(cdata) - len(cdata) % a.itemsize])
            fds.extend(a)
    return fds


class HostArena:
    """One mmap of a memfd arena, unmapped (and its descriptor closed) when the
    connection and every lease or object using it have let go of it."""

    def __init__(self, fd: int, size: int, writable: bool, arena_id: int = 0):
        prot = PROT_READ | (PROT_WRITE if writable else 0)
        addr = libc.mmap(None, size, prot, MAP_SHARED, fd, 0)
        if addr is None or addr == MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, "mmap of a %d-byte arena: %s" % (size, os.strerror(e)))
        self.addr = int(addr)
        self.size = size
        self.fd = fd
        self.key = (arena_id, writable)
        self._fin = weakref.finalize(self, _unmap, self.addr, size, fd)

    def make_read_only(self) -> bool:
        """Replace the writable shared mapping by a read-only private one of the same
        bytes at the same address, and close the writable descriptor: views made
        before read the same memory and fault on a write, and since no writable
        mapping of the memfd is left, the daemon can seal it against writes for every
        reader (docs/hardening.md, "Sealed objects"). False if the kernel refused
        (the mapping stays as it was)."""
        addr = libc.mmap(self.addr, self.size, PROT_READ, MAP_PRIVATE | MAP_FIXED, self.fd, 0)
        if addr is None or addr == MAP_FAILED or int(addr) != self.addr:
            return False
        self._fin.detach()
        os.close(self.fd)
        self.fd = -1
        self._fin = weakref.finalize(self, _unmap, self.addr, self.size, -1)
        return True


StreamHandler = Callable[[Optional["Reply"], Optional[StoreError]], None]


class Reply:
    """A response, with what the reader did with its placement."""

    __slots__ = ("resp", "arena", "fd", "manifest_fd", "fds")

    def __init__(self, resp: Any, arena: Optional[HostArena] = None, fd: int = -1, fds: Sequence[int] = ()):
        self.resp = resp
        self.arena = arena
        self.fd = fd  # a GPU arena's descriptor, for the caller to import and close
        self.manifest_fd = -1  # a bundle's manifest memfd (docs/protocol.md 6.3), for the caller to close
        # Registered memory's descriptors (an external get's first ones, or a files
        # answer's), for the caller to import and close.
        self.fds: Sequence[int] = fds

    def close_fds(self) -> None:
        """Close the descriptors the reply still holds."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.manifest_fd >= 0:
            os.close(self.manifest_fd)
            self.manifest_fd = -1
        fds, self.fds = self.fds, ()
        for fd in fds:
            os.close(fd)


def _last_answer(resp: Any, body: Optional[str]) -> bool:
    """Whether resp is the last answer to its request: anything but a kv_read's
    progress (docs/protocol.md section 6.9)."""
    return body != "kv_read" or resp.kv_read.done or (resp.HasField("error") and resp.error.code != 0)


class Conn:
    """A protocol connection. Calls from several threads may wait at once: whichever
    waiter finds no reader reads the next packet and hands it out (no thread of its
    own, so nothing runs behind the user's back)."""

    def __init__(self, path: str, spin: float = 0.0):
        self.path = path
        # A call that reads its own reply polls the socket this long (seconds) before
        # it sleeps in recvmsg, so that a reply within the window costs no wake-up
        # (the Go client's Options.Spin; docs/architecture.md "The round trip"). A
        # window that finds nothing makes the next 1, 2, 4 ... 64 receives skip it.
        self.spin = spin
        self._spin_skip = 0
        self._spin_backoff = 0
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.connect(path)
        except BaseException:
            s.close()
            raise
        self.sock = s
        self._poller = select.poll()   # for polling before parking (_poll)
        self._poller.register(s.fileno(), select.POLLIN)
        self._ids = itertools.count(1)
        self._send_lock = threading.RLock()  # re-entrant: a finalizer may release during a send
        # Held from a stage_files request to the request that takes the staged
        # descriptors (register, a no-copy create), so that no other's come between.
        self.staging_lock = threading.Lock()
        self._cv = threading.Condition(threading.Lock())
        self._reading = False
        self._replies: Dict[int, Reply] = {}
        self._waiting: Set[int] = set()
        self._abandoned: Dict[int, Tuple[str, str]] = {}   # id -> (op, name): clean up the reply
        self._detached: Set[int] = set()                   # ids whose reply nobody reads
        self._dropped_streams: Set[int] = set()            # kv_read ids whose answers nobody reads any more
        # Requests whose answers go to a handler, called by whichever thread reads
        # them (send_stream), up to the last answer or the connection's end.
        self._streams: Dict[int, StreamHandler] = {}
        self._arenas: Dict[Tuple[int, bool], HostArena] = {}
        self.events: Deque[Any] = collections.deque()
        self.notices: Deque[Any] = collections.deque()   # Notice messages not taken yet
        self.notices_dropped = 0
        self.subscribed = False
        self.on_arenas_freed: Any = None   # called with arena ids the daemon emptied
        self.dead: Optional[StoreError] = None
        self.closed = False

    # -- sending ---------------------------------------------------------------
    def send(self, req: Any, fds: Sequence[int] = ()) -> int:
        rid = next(self._ids)
        req.id = rid
        data = req.SerializeToString()
        with self._send_lock:
            if self.dead is not None:
                raise self.dead
            try:
                if fds:
                    self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                else:
                    self.sock.send(data)
            except OSError as e:
                self._fail(StoreGone("send", message="%s: %s" % (self.path, e)))
                raise self.dead  # type: ignore[misc]
        return rid

    def send_raw(self, body: bytes) -> int:
        """Send a request given as its encoded body (everything but the id)."""
        rid = next(self._ids)
        data = id_field(rid) + body
        with self._send_lock:
            if self.dead is not None:
                raise self.dead
            try:
                self.sock.send(data)
            except OSError as e:
                self._fail(StoreGone("send", message="%s: %s" % (self.path, e)))
                raise self.dead  # type: ignore[misc]
        return rid

    def send_stream(self, req: Any, handler: "StreamHandler") -> int:
        """Send req and have ``handler(reply, None)`` called with each of its answers
        (a kv_read's progress, then its end; one answer for other requests), or
        ``handler(None, error)`` once if the connection ends first; by whichever
        thread reads the connection (a waiter in :meth:`pump`, or any call), so the
        handler must be quick and must not wait for the connection. Raises the
        connection's error (the handler is then not called)."""
        rid = next(self._ids)
        req.id = rid
        data = req.SerializeToString()
        with self._cv:
            if self.dead is not None:
                raise self.dead
            self._streams[rid] = handler
        with self._send_lock:
            err = self.dead
            if err is None:
                try:
                    self.sock.send(data)
                except OSError as e:
                    err = StoreGone("send", message="%s: %s" % (self.path, e))
        if err is not None:
            with self._cv:
                self._streams.pop(rid, None)
            self._fail(err)
            raise self.dead  # type: ignore[misc]
        return rid

    def pump(self, cond: Callable[[], bool], timeout: Optional[float]) -> None:
        """Read the connection (when no other thread does) until ``cond()`` holds, at
        most ``timeout`` seconds (None: no limit; 0: only what is there now), or the
        connection ends. cond is called under the connection's lock, after each
        answer read: it must be quick."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                while True:
                    if cond() or self.dead is not None:
                        return
                    left = None if deadline is None else deadline - time.monotonic()
                    if not self._reading:
                        self._reading = True
                        break
                    if left is not None and left <= 0:
                        return
                    self._cv.wait(left)
            try:
                got = self._poll(self.spin) if self.spin > 0 and (left is None or left > 0) else None
                if got is None:
                    ms = -1 if left is None else max(int(left * 1000), 0)
                    if not self._poller.poll(ms):
                        got = None
                    else:
                        try:
                            got = self.sock.recvmsg(MAX_MESSAGE + 1, _ANC, _RECV_NOWAIT)
                        except (BlockingIOError, InterruptedError):
                            got = None
                        except OSError as e:
                            self._fail(StoreGone("recv", message="%s: %s" % (self.path, e)))
                            return
                if got is not None:
                    data, anc, flags, _ = got
                    fds = _fds_of(anc)
                    try:
                        self._handle(data, flags, fds)
                    except BaseException:
                        for fd in fds:
                            os.close(fd)
                        raise
                elif left is not None and left <= 0:
                    return
            finally:
                with self._cv:
                    self._reading = False
                    self._cv.notify_all()

    def send_detached(self, req: Any) -> None:
        """Send a request (a message, or an object with an encoded ``body``) whose
        reply is dropped unread: a pipelined release."""
        if self.dead is not None or self.closed:
            return
        try:
            rid = next(self._ids)
            if hasattr(req, "body") and isinstance(req.body, bytes):
                data = id_field(rid) + req.body
            else:
                req.id = rid
                data = req.SerializeToString()
            self._detached.add(rid)  # set.add is atomic under the GIL
            with self._send_lock:
                self.sock.send(data)
        except (OSError, StoreError):
            pass

    # -- receiving -------------------------------------------------------------
    def call(self, req: Any, op: str, name: str = "", fds: Sequence[int] = (),
             spin: Optional[float] = None) -> Reply:
        """Send req (with descriptors fds, which the caller keeps) and wait for its reply
        (``spin``: see :meth:`result`); raise the StoreError of a failed response."""
        return self._call(req, None, op, name, fds, spin)

    def call_raw(self, body: bytes, op: str, name: str = "") -> Reply:
        """call with the request's encoded body (see send_raw)."""
        return self._call(None, body, op, name)

    def _call(self, req: Any, body: Optional[bytes], op: str, name: str, fds: Sequence[int] = (),
              spin: Optional[float] = None) -> Reply:
        dead = self.dead
        if dead is not None:
            raise type(dead)(op, name, dead.message, code=dead.code)
        rid = self.send(req, fds) if body is None else self.send_raw(body)
        return self.result(rid, op, name, spin)

    def result(self, rid: int, op: str, name: str = "", spin: Optional[float] = None) -> Reply:
        """Wait for the reply of request ``rid`` (sent with :meth:`send`); raise the
        StoreError of a failed response. ``spin`` overrides the polling window for a
        reply known to be due at once (it still counts for the back-off). A caller
        interrupted here leaves the reply to be cleaned up when it comes."""
        try:
            r = self.wait(rid, spin)
        except BaseException:
            with self._cv:
                self._waiting.discard(rid)
                if rid not in self._replies and self.dead is None:
                    self._abandoned[rid] = (op, name)
                r2 = self._replies.pop(rid, None)
            if r2 is not None:
                self.cleanup(r2, op, name)
            raise
        err = r.resp.error if r.resp.HasField("error") else None
        if err is not None and err.code != 0:
            if r.fd >= 0:
                os.close(r.fd)
            raise from_code(err.code, op, name, err.message)
        return r

    def wait(self, rid: int, spin: Optional[float] = None) -> Reply:
        while True:
            with self._cv:
                while True:
                    r = self._replies.pop(rid, None)
                    if r is not None:
                        self._waiting.discard(rid)
                        return r
                    if self.dead is not None:
                        self._waiting.discard(rid)
                        raise self.dead
                    if not self._reading:
                        self._reading = True
                        break
                    self._cv.wait()
            try:
                self._read_one(self._spin_window() if spin is None or self.spin <= 0 else spin)
            finally:
                with self._cv:
                    self._reading = False
                    self._cv.notify_all()

    def _spin_window(self) -> float:
        """How long the next receive of a caller's own reply polls (reader role held)."""
        if self.spin <= 0:
            return 0.0
        if self._spin_skip > 0:
            self._spin_skip -= 1
            return 0.0
        return self.spin

    def wait_event(self, timeout: Optional[float]) -> Optional[Any]:
        """The next event (an Event message), or None when timeout seconds pass."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                while True:
                    if self.events:
                        return self.events.popleft()
                    if self.dead is not None:
                        raise self.dead
                    if not self._reading:
                        self._reading = True
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    self._cv.wait(left)
            try:
                left = None if deadline is None else max(deadline - time.monotonic(), 0)
                self.sock.settimeout(left)
                try:
                    self._read_one()
                except socket.timeout:
                    return None
                finally:
                    if self.dead is None:
                        self.sock.settimeout(None)
            finally:
                with self._cv:
                    self._reading = False
                    self._cv.notify_all()

    def take_notices(self, names: Sequence[str], timeout: Optional[float]) -> List[Any]:
        """Remove and return the Notice messages about ``names`` (every one without
        names), oldest first, after reading what the socket holds; with ``timeout``
        (seconds; None: no limit) wait until there is at least one, [] when it
        passes first. Notices arrive unasked (id 0) and are read by whichever call
        reads the socket, this one included."""
        deadline = None if timeout is None else time.monotonic() + timeout
        want = set(names)
        drained = False
        while True:
            with self._cv:
                while True:
                    out = [n for n in self.notices if not want or n.name in want]
                    if out:
                        keep = [n for n in self.notices if want and n.name not in want]
                        self.notices.clear()
                        self.notices.extend(keep)
                        return out
                    if self.dead is not None:
                        raise self.dead
                    left = None if deadline is None else deadline - time.monotonic()
                    if drained and left is not None and left <= 0:
                        return []
                    if not self._reading:
                        self._reading = True
                        break
                    if left is not None and left <= 0:
                        return []   # another caller is reading: what it reads comes next time
                    self._cv.wait(left)
            try:
                # At least one read that does not wait (the socket's backlog), then
                # reads that wait as long as the timeout allows.
                left = None if deadline is None else max(deadline - time.monotonic(), 1e-6)
                self.sock.settimeout(1e-6 if not drained else left)
                try:
                    self._read_one()
                except socket.timeout:
                    drained = True
                finally:
                    if self.dead is None:
                        self.sock.settimeout(None)
            finally:
                with self._cv:
                    self._reading = False
                    self._cv.notify_all()

    def _poll(self, spin: float) -> Optional[Tuple[bytes, Any, int, Any]]:
        """Retry a non-blocking receive for at most ``spin`` seconds: the packet, or
        None when none came (then the next receives skip polling, backing off). The
        loop asks poll(2) with a zero timeout (about a microsecond, no exception)
        rather than retrying recvmsg (an EAGAIN costs an exception, ~3x as much)."""
        sock = self.sock
        try:
            return sock.recvmsg(MAX_MESSAGE + 1, _ANC, _RECV_NOWAIT)
        except (BlockingIOError, InterruptedError):
            pass
        ready = self._poller.poll
        clock = time.perf_counter
        end = clock() + spin
        while True:
            if ready(0):
                try:
                    got = sock.recvmsg(MAX_MESSAGE + 1, _ANC, _RECV_NOWAIT)
                except (BlockingIOError, InterruptedError):
                    got = None
                if got is not None:
                    self._spin_backoff = 0
                    return got
            if clock() >= end:
                self._spin_backoff = min(max(2 * self._spin_backoff, 1), MAX_SPIN_SKIP)
                self._spin_skip = self._spin_backoff
                return None

    def _read_one(self, spin: float = 0.0) -> None:
        try:
            got = self._poll(spin) if spin > 0 else None
            if got is None:
                got = self.sock.recvmsg(MAX_MESSAGE + 1, _ANC, _RECV)
            data, anc, flags, _ = got
        except socket.timeout:
            raise
        except OSError as e:
            self._fail(StoreGone("recv", message="%s: %s" % (self.path, e)))
            return
        fds = _fds_of(anc)
        try:
            self._handle(data, flags, fds)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _handle(self, data: bytes, flags: int, fds: List[int]) -> None:
        if not data:
            self._fail(StoreGone("recv", message="the daemon at %s closed the connection" % self.path))
            for fd in fds:
                os.close(fd)
            return
        if flags & _TRUNC or len(data) > MAX_MESSAGE or len(fds) > MAX_FILES:
            for fd in fds:
                os.close(fd)
            self._fail(InternalError("recv", message="oversized packet or too many descriptors from the daemon"))
            return
        resp = pb.Response()
        try:
            resp.ParseFromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError differs between versions
            for fd in fds:
                os.close(fd)
            self._fail(InternalError("recv", message="undecodable packet from the daemon: %s" % e))
            return
        rid = resp.id
        body = resp.WhichOneof("body")
        if rid == 0:
            for fd in fds:
                os.close(fd)
            if body == "event":
                with self._cv:
                    self.events.append(resp.event)
            elif body == "notice":
                with self._cv:
                    if len(self.notices) >= MAX_KEPT_NOTICES:
                        self.notices.popleft()
                        self.notices_dropped += 1
                    self.notices.append(resp.notice)
                    self._cv.notify_all()
            elif body == "arenas_freed":
                if self.on_arenas_freed is not None:
                    self.on_arenas_freed(list(resp.arenas_freed.arena_ids))
            elif resp.HasField("error"):
                self._fail(from_code(resp.error.code, "connection", "", resp.error.message)
                           if resp.error.code not in (0,) else StoreGone("connection"))
            return
        if rid in self._detached:  # a pipelined release's reply: nobody reads it
            self._detached.discard(rid)
            for fd in fds:
                os.close(fd)
            return
        if body in _PLACED or fds:
            mfd = -1
            if fds and ((body == "create" and resp.create.manifest_attached)
                        or (body == "get" and resp.get.manifest_attached)):
                mfd = fds.pop()   # the manifest travels last
            try:
                reply = self._place(resp, body, fds)
            except BaseException:
                if mfd >= 0:
                    os.close(mfd)
                raise
            reply.manifest_fd = mfd
        else:
            reply = Reply(resp)   # an answer without a placement: the common short path
        with self._cv:
            handler = self._streams.get(rid)
            if handler is not None and _last_answer(resp, body):
                del self._streams[rid]
        if handler is not None:
            try:
                handler(reply, None)
            except Exception:  # noqa: BLE001 - a handler's bug must not stop the reader
                _log.exception("cudaipc: a stream handler failed")
            return
        with self._cv:
            if rid in self._detached:
                self._detached.discard(rid)
                drop = True
            elif rid in self._dropped_streams:
                if _last_answer(resp, body):
                    self._dropped_streams.discard(rid)
                drop = True
            elif rid in self._abandoned:
                op, name = self._abandoned.pop(rid)
                drop = False
                cleanup = (op, name)
            else:
                self._replies[rid] = reply
                return
        if drop:
            reply.close_fds()
            return
        self.cleanup(reply, *cleanup)

    def _place(self, resp: Any, body: Optional[str], fds: List[int]) -> Reply:
        """Map a host placement now, in the order the daemon sent them, so that the
        arena cache follows what this connection was given."""
        p = None
        failed = resp.HasField("error") and resp.error.code != 0
        if body == "lease_table" and len(fds) == 1 and not failed:
            return Reply(resp, fd=fds[0])   # the table's memfd, for the caller to map and close
        if body == "files" and not failed and 0 < len(fds) == resp.files.count:
            return Reply(resp, fds=fds)     # more descriptors of registered memory
        if body == "pool_stat" and not failed and len(fds) == 1 and resp.pool_stat.fd_attached:
            return Reply(resp, fd=fds[0])   # a KV block pool's memory, for the caller to map and close
        if body == "create":
            p = resp.create.placement
        elif body == "get":
            p = resp.get.placement
        if p is None or (resp.HasField("error") and resp.error.code != 0):
            for fd in fds:
                os.close(fd)
            return Reply(resp)
        host = p.kind == pb.Placement.HOST
        if p.external:
            # A no-copy version's memfd travels with them (docs/protocol.md 6.8).
            # Registered host memory comes with its memfd (one descriptor).
            attached = MAX_FILES - 1 if body == "get" and resp.get.manifest_attached else MAX_FILES
            if len(fds) != min(p.files, attached) or (host and (len(fds) != 1 or body != "get")):
                for fd in fds:
                    os.close(fd)
                self._fail(InternalError("recv", message="registered memory of %d descriptors came with %d" % (p.files, len(fds))))
                return Reply(resp)
            return Reply(resp, fds=fds)
        if not host:
            if p.fd_attached and len(fds) == 1:
                return Reply(resp, fd=fds[0])
            for fd in fds:
                os.close(fd)
            if p.fd_attached:
                raise_later = InternalError("recv", message="GPU placement says a descriptor is attached, %d came" % len(fds))
                self._fail(raise_later)
            return Reply(resp)
        key = (p.arena_id, p.writable)
        if p.fd_attached != (len(fds) == 1):
            for fd in fds:
                os.close(fd)
            self._fail(InternalError("recv", message="host placement: fd_attached is %s with %d descriptors" % (p.fd_attached, len(fds))))
            return Reply(resp)
        a = self._arenas.get(key)
        if p.fd_attached:
            a = HostArena(fds[0], p.arena_size, p.writable, p.arena_id)
            self._arenas[key] = a
        elif a is None:
            self._fail(InternalError("recv", message="placement in arena %d without its descriptor" % p.arena_id))
            return Reply(resp)
        elif a.size < p.offset + p.size:  # the arena grew: map it again
            a = HostArena(os.dup(a.fd), p.arena_size, p.writable, p.arena_id)
            self._arenas[key] = a
        return Reply(resp, arena=a)

    def seal_host_arena(self, a: HostArena) -> None:
        """Let go of the writable mapping of a sealed shared host object, whose arena
        is its own and is never written again (the Go client's unrefSealed): the
        connection forgets the arena and its mapping becomes read-only."""
        if self._arenas.get(a.key) is a:
            self._arenas.pop(a.key, None)
        if not a.make_read_only():
            _log.debug("cudaipc: arena %d stays mapped writable: %s", a.key[0], os.strerror(ctypes.get_errno()))

    def drop_host_arenas(self, ids: Any) -> None:
        """Forget host arenas the daemon emptied (mappings go when unused)."""
        for i in ids:
            self._arenas.pop((i, True), None)
            self._arenas.pop((i, False), None)

    def abandon(self, rid: int, op: str, name: str) -> None:
        """Give up the reply of a request sent with send: it is cleaned up (a created
        object aborted, a lease released, descriptors closed) now or when it comes."""
        with self._cv:
            r = self._replies.pop(rid, None)
            if r is None:
                if self.dead is None:
                    self._abandoned[rid] = (op, name)
                return
        self.cleanup(r, op, name)

    def drop_stream(self, rid: int) -> None:
        """Give up the answers of a request answered more than once (a kv_read's
        progress, then its end): the one waiting, if any, and those still to come, up
        to its last, are dropped as they arrive."""
        with self._cv:
            r = self._replies.pop(rid, None)
            if r is not None:
                r.close_fds()
                if _last_answer(r.resp, r.resp.WhichOneof("body")):
                    return
            if self.dead is None:
                self._dropped_streams.add(rid)

    def cleanup(self, r: Reply, op: str, name: str) -> None:
        """Undo the reply of a call whose caller gave up."""
        r.close_fds()
        body = r.resp.WhichOneof("body")
        if body == "get":
            self.send_detached(pb.Request(release=pb.ReleaseRequest(lease_id=r.resp.get.lease_id)))
        elif body == "create":
            self.send_detached(pb.Request(abort=pb.AbortRequest(name=name, version=r.resp.create.version)))
        elif body in ("block_get", "block_lookup") and getattr(r.resp, body).pin:
            self.send_detached(pb.Request(block_unpin=pb.BlockUnpinRequest(pin=getattr(r.resp, body).pin)))

    def refusal(self) -> Optional[StoreError]:
        """Why the daemon refused this connection, if it said so: the error (id 0) it
        sends before it closes a connection it will not serve (a connection limit, a
        uid it does not admit), read from what is left on the socket. None when it
        said nothing."""
        d = self.dead
        if d is not None and not isinstance(d, StoreGone):
            return d
        for _ in range(4):
            try:
                data, anc, _, _ = self.sock.recvmsg(MAX_MESSAGE + 1, _ANC, _RECV_NOWAIT)
            except OSError:
                return None
            for fd in _fds_of(anc):
                os.close(fd)
            if not data:
                return None
            resp = pb.Response()
            try:
                resp.ParseFromString(data)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError differs between versions
                return None
            if resp.id == 0 and resp.HasField("error") and resp.error.code != 0:
                return from_code(resp.error.code, "connect", "", resp.error.message)
        return None

    def _fail(self, err: StoreError) -> None:
        with self._cv:
            if self.dead is None:
                self.dead = err
            streams, self._streams = self._streams, {}
            self._cv.notify_all()
        self._end_streams(streams)

    def _end_streams(self, streams: Dict[int, "StreamHandler"]) -> None:
        for handler in streams.values():
            try:
                handler(None, self.dead)
            except Exception:  # noqa: BLE001
                _log.exception("cudaipc: a stream handler failed")

    def close(self) -> None:
        with self._cv:
            if self.closed:
                return
            self.closed = True
            self.dead = Closed("call")
            streams, self._streams = self._streams, {}
            self._cv.notify_all()
        self._end_streams(streams)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        # Arenas still used by live leases stay mapped until those end.
        self._arenas.clear()
        for r in self._replies.values():
            r.close_fds()
        self._replies.clear()
