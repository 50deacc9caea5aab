"""What the benchmarks here share: a daemon on a temporary socket, the in-process
copy that put is measured against, and timing wrappers around the client's steps."""

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import time
from typing import IO, Any, Dict, Iterator, List, Optional, Sequence


@contextlib.contextmanager
def daemon(binary: str, socket: Optional[str], args: Sequence[str] = (), pre: Sequence[str] = (),
           log: Optional[IO[str]] = None) -> Iterator[str]:
    """Yield ``socket``, or without one start ``binary [pre...] serve --socket S args...`` on a
    temporary socket (output to ``log``, else discarded), yield S, and stop it after."""
    if socket is not None:
        yield socket
        return
    tmp = tempfile.mkdtemp()
    sock = os.path.join(tmp, "store.sock")
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([binary, *pre, "serve", "--socket", sock, *args], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("cudaipc serve did not start (exit status %s)" % proc.poll())
            time.sleep(0.02)
        yield sock
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def copy_times(src, count: int) -> List[float]:
    """Seconds of ``count`` in-process device-to-device copies of the CUDA tensor
    ``src`` (each waited for), the reference a put is measured against."""
    import torch
    dst = torch.empty_like(src)
    torch.cuda.synchronize(src.device)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(src.device)
        times.append(time.perf_counter() - t0)
    return times


def timed(steps: Dict[str, List[float]], owner: Any, attr: str, label: str) -> None:
    """Wrap ``owner.attr`` (for this process only) so that each call's duration in
    seconds lands in ``steps[label]``."""
    f = getattr(owner, attr)

    @functools.wraps(f)
    def w(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            steps[label].append(time.perf_counter() - t0)
    setattr(owner, attr, w)
