"""KV reads across nodes (cudaipc.kv.read_blocks of a space another node holds;
docs/kv.md, "Across nodes"): the Go package kv's remote.go. A read whose source
names a node other than the reader's daemon's goes through that daemon as kv_read
requests (Store.read_space): one, or as many as it takes to keep each within a
packet. The daemon has the source's daemon expose the regions the layers use and
writes the bytes straight into the destination, which must be a space registered
with it (kv.register); its progress responses complete the Transfer's layers. Either
side may be host memory or one GPU's: the daemons stage GPU memory through pinned
host memory (each side's GPU gathers or scatters), and refuse a side over both.

No thread is started: read_blocks sends the requests from the caller's thread, and
their answers are handled by whichever thread reads the connection (the Transfer's
waiters read it when nobody else does; Transfer.done reads what is there), so many
reads in flight cost a request each, not a thread each."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import _store_pb2 as pb
from ._kvdesc import Desc
from ._kvlocal import Local
from ._kvread import MAX_NOTIFY, Transfer, block_ids, check_pairs
from ._wire import MAX_MESSAGE, Reply
from .errors import BlockError, InternalError, InvalidKVRequest, KVNotSupported, LayoutMismatch, StoreError, from_code

_log = logging.getLogger("cudaipc")

__all__ = ["remote", "start", "split_pairs"]


def remote(store: Any, src: Desc) -> bool:
    """Whether a read of src through store crosses nodes: the space is on a node
    other than store's daemon's (Go's remote)."""
    return src.node != "" and src.node != store.server.node


def _varint_size(v: int) -> int:
    n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


def split_pairs(src: Sequence[int], dst: Sequence[int], budget: int) -> List[Tuple[int, int]]:
    """The pairs of a read cut into ranges [from, to) whose ids take at most budget
    bytes of a kv_read request each (as protobuf varints; Go's splitPairs)."""
    out: List[Tuple[int, int]] = []
    start, used = 0, 0
    for i in range(len(src)):
        n = _varint_size(src[i]) + _varint_size(dst[i])
        if used + n > budget and i > start:
            out.append((start, i))
            start, used = i, 0
        used += n
    out.append((start, len(src)))
    return out


class _Progress:
    """The layers each kv_read of a read has completed; a layer is complete once
    every one has it (Go's remoteProgress)."""

    def __init__(self, t: Transfer, parts: int):
        self.t = t
        self.lock = threading.Lock()
        self.got = [0] * parts

    def set(self, k: int, layers: int) -> None:
        with self.lock:
            self.got[k] = max(self.got[k], min(layers, self.t.count))
            least = min(self.got)
        if least > 0:
            self.t.layer_done(least - 1)

    def failure(self, src: Desc, dst_blocks: List[int], parts: List[Tuple[int, int]],
                errs: List[Optional[BaseException]]) -> Optional[BlockError]:
        """The read's BlockError: the destination blocks of the requests that
        failed, from the first layer one of them lacks, caused by the first
        failure; None when none failed."""
        blocks: List[int] = []
        first: Optional[BaseException] = None
        layer = -1
        with self.lock:
            for k, err in enumerate(errs):
                if err is None:
                    continue
                first = first or err
                blocks += dst_blocks[parts[k][0]:parts[k][1]]
                at = self.t.first + self.got[k]
                layer = at if layer < 0 else min(layer, at)
        if first is None:
            return None
        e = BlockError(src.name, layer, blocks, first)
        e.__cause__ = first
        return e


class _Requests:
    """The kv_read requests of one read and their answers (handled by whichever
    thread reads the connection): progress to the Transfer's layers, and, once
    every request has ended, the notice to the source's engine (kv_notify, when
    asked for) and the Transfer's end."""

    def __init__(self, conn: Any, t: Transfer, src: Desc, src_bytes: bytes, dst_blocks: List[int],
                 parts: List[Tuple[int, int]], notify: Optional[bytes]):
        self.conn, self.t, self.src, self.src_bytes = conn, t, src, src_bytes
        self.dst_blocks, self.parts, self.notify = dst_blocks, parts, notify
        self.pr = _Progress(t, len(parts))
        self.errs: List[Optional[BaseException]] = [None] * len(parts)
        self.lock = threading.Lock()
        self.left = len(parts)

    def handler(self, k: int) -> Callable[[Optional[Reply], Optional[StoreError]], None]:
        return lambda r, err: self.answer(k, r, err)

    def answer(self, k: int, r: Optional[Reply], err: Optional[StoreError]) -> None:
        """An answer to request k, or the connection's end (err)."""
        if r is None:
            self.ended(k, err or InternalError("kv_read", message="the connection ended"))
            return
        resp = r.resp
        if resp.HasField("error") and resp.error.code != 0:
            self.ended(k, from_code(resp.error.code, "kv_read", "", resp.error.message))
        elif resp.WhichOneof("body") != "kv_read":
            self.ended(k, InternalError("kv_read", message="the daemon answered a kv_read with %s" % resp.WhichOneof("body")))
        elif resp.kv_read.done:
            self.pr.set(k, self.t.count)
            self.ended(k, None)
        else:
            self.pr.set(k, resp.kv_read.layers)

    def ended(self, k: int, err: Optional[BaseException]) -> None:
        with self.lock:
            self.errs[k] = err
            self.left -= 1
            last = self.left == 0
        if not last:
            return
        failure = self.pr.failure(self.src, self.dst_blocks, self.parts, self.errs)
        if self.notify is None:
            self.t.finish(failure)
            return
        # The source's engine is told through both daemons (kv_notify), before the
        # read's end, as on one node; a failure to tell it is logged.
        payload = bytes([1 if failure is not None else 0]) + bytes(self.notify)

        def told(r: Optional[Reply], err: Optional[StoreError]) -> None:
            if r is not None and r.resp.HasField("error") and r.resp.error.code != 0:
                err = from_code(r.resp.error.code, "kv_notify", "", r.resp.error.message)
            if err is not None:
                _log.debug("kv: the source's engine was not told that a read of %s ended: %s", self.src.name, err)
            self.t.finish(failure)

        try:
            self.conn.send_stream(pb.Request(kv_notify=pb.KvNotifyRequest(space=self.src_bytes, payload=payload)), told)
        except StoreError as e:
            told(None, e)


def start(store: Any, src: Desc, src_blocks: Any, local: Any, space: Any, dst_blocks: Any, layers: Any,
          notify: Optional[bytes], src_bytes: Optional[bytes] = None) -> Transfer:
    """Check a read of src (on another node; src_bytes its encoding, when known)
    into local, registered with store's daemon as space (a kv.Space; None if it is
    not), as Go's readRemote does, send it as kv_read requests and return its
    Transfer."""
    if not isinstance(src, Desc) or not isinstance(local, Local):
        raise LayoutMismatch("kv: a read needs a source description and a destination Local")
    self_node = store.server.node
    if self_node == "":
        raise KVNotSupported("kv: space %s is on node %s, and this client's daemon is not part of a cluster"
                             % (src.name, src.node))
    if notify is not None and len(notify) > MAX_NOTIFY:
        raise InvalidKVRequest("kv: a notify payload of %d bytes: at most %d" % (len(notify), MAX_NOTIFY))
    if space is None or local.space is not space:
        raise KVNotSupported("kv: a read from another node (%s) is written by this node's daemon, which must know "
                             "the destination: register it (kv.register) and pass the Space" % src.node)
    if src_bytes is None:
        src_bytes = src.to_bytes()   # validates
    dst_desc = space.desc
    dst_bytes = space.desc_bytes()
    local.check()
    sb, db = block_ids(src_blocks, "source"), block_ids(dst_blocks, "destination")
    first, count = check_pairs(src.name, src.layout, dst_desc.layout, sb, db, layers)
    parts = split_pairs(sb, db, MAX_MESSAGE - len(src_bytes) - len(dst_bytes) - 256)
    t = Transfer(src.name, first, count, db)
    conn = store.connection()
    reqs = _Requests(conn, t, src, src_bytes, db, parts, notify)
    t.drive_with(conn.pump)
    for k, (lo, hi) in enumerate(parts):
        req = pb.Request(kv_read=pb.KvReadRequest(src=src_bytes, dst=dst_bytes, src_blocks=sb[lo:hi],
                                                  dst_blocks=db[lo:hi], first=first, count=count))
        try:
            conn.send_stream(req, reqs.handler(k))
        except StoreError as e:
            reqs.ended(k, e)
    return t
