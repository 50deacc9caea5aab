"""KV reads across nodes (cudaipc.kv.read_blocks of a space another node holds;
docs/kv.md, "Across nodes"): the Go package kv's remote.go. A read whose source
names a node other than the reader's daemon's goes through that daemon as kv_read
requests (Store.read_space): one, or as many as it takes to keep each within a
packet. The daemon has the source's daemon expose the regions the layers use and
writes the bytes straight into the destination, which must be a space registered
with it (kv.register); its progress responses complete the Transfer's layers. Either
side may be host memory or one GPU's: the daemons stage GPU memory through pinned
host memory (each side's GPU gathers or scatters), and refuse a side over both."""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional, Sequence, Tuple

from ._kvdesc import Desc
from ._kvlocal import Local
from ._kvread import MAX_NOTIFY, Transfer, block_ids, check_pairs
from ._wire import MAX_MESSAGE
from .errors import BlockError, InvalidKVRequest, KVNotSupported, LayoutMismatch

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


def start(store: Any, src: Desc, src_blocks: Any, local: Any, space: Any, dst_blocks: Any, layers: Any,
          notify: Optional[bytes]) -> Transfer:
    """Check a read of src (on another node) into local, registered with store's
    daemon as space (a kv.Space; None if it is not), as Go's readRemote does, start
    it as kv_read requests on threads of its own, and return its Transfer."""
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
    src_bytes = src.to_bytes()   # validates
    dst_desc = space.desc
    dst_bytes = dst_desc.to_bytes()
    local.check()
    sb, db = block_ids(src_blocks, "source"), block_ids(dst_blocks, "destination")
    first, count = check_pairs(src.name, src.layout, dst_desc.layout, sb, db, layers)
    parts = split_pairs(sb, db, MAX_MESSAGE - len(src_bytes) - len(dst_bytes) - 256)
    t = Transfer(src.name, first, count, db)
    pr = _Progress(t, len(parts))
    errs: List[Optional[BaseException]] = [None] * len(parts)

    def part(k: int) -> None:
        lo, hi = parts[k]
        try:
            store.read_space(src_bytes, dst_bytes, sb[lo:hi], db[lo:hi], first, count,
                             progress=lambda n: pr.set(k, n))
            pr.set(k, count)
        except BaseException as e:  # noqa: BLE001 - any failure ends the read with its blocks named
            errs[k] = e

    def run() -> None:
        others = [threading.Thread(target=part, args=(k,), name="cudaipc-kv-read", daemon=True)
                  for k in range(1, len(parts))]
        for th in others:
            th.start()
        part(0)
        for th in others:
            th.join()
        err = pr.failure(src, db, parts, errs)
        if notify is not None:
            # The source's engine is told through both daemons (kv_notify), before
            # the read's end, as on one node; a failure to tell it is logged.
            try:
                store.notify_space(src_bytes, bytes([1 if err is not None else 0]) + bytes(notify))
            except Exception as e:  # noqa: BLE001
                _log.debug("kv: the source's engine was not told that a read of %s ended: %s", src.name, e)
        t.finish(err)

    threading.Thread(target=run, name="cudaipc-kv-read", daemon=True).start()
    return t
