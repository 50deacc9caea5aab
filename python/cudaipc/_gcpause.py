"""Python's cyclic collector paused around bulk builds of many small objects.

Building the entries and plan of a bundle of 18,000 tensors allocates a few hundred
thousand objects, none of them in a reference cycle; each allocation threshold
crossed starts a collection, and in a process with PyTorch imported (hundreds of
thousands of tracked objects) the older generations' passes cost tens to hundreds of
milliseconds each. Pausing the collector for the build and restoring its state
afterwards leaves only the young collection that follows.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["paused", "ENABLED"]

ENABLED = True
"""Whether paused() pauses (benchmarks turn it off to compare)."""

_lock = threading.Lock()
_depth = 0        # paused() blocks active in any thread
_was_on = False   # whether the collector ran before the outermost one


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the block with the collector off, then restore it exactly: on again only if
    it was on before the outermost active block (nested and concurrent blocks share
    one pause; a collector the program turned off stays off)."""
    global _depth, _was_on
    if not ENABLED:
        yield
        return
    with _lock:
        if _depth == 0:
            _was_on = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_on:
                gc.enable()
