"""Which thread runs a one-node KV read (cudaipc._kvread): a read waited for at once
runs on the caller's thread, a host read waited for layer by layer runs that far
there and leaves the rest to a worker, reads nobody waits for run on a bounded pool
of workers, and several threads waiting on one read all see it end. Against a real
daemon and an engine process, with every byte checked; the pool itself also
without one, over stand-in reads."""

import threading
import time

import numpy as np
import pytest

from cudaipc import _kvread, kv

import kvutil
from test_kv_host import BLOCKS, LAYERS, dst_local, engines, snapshot  # noqa: F401 - engines is a fixture

SRC = [2, 3, 4, 5, 9, 0, 17, 16, 23, 11, 12]
DST = [7, 8, 9, 10, 1, 23, 3, 2, 0, 14, 15]


@pytest.fixture
def no_workers(monkeypatch):
    """Reads handed to a worker are kept here instead: only the caller runs them."""
    held = []
    monkeypatch.setattr(_kvread._workers, "submit", held.append)
    return held


def test_wait_runs_the_read_on_the_caller(store, daemon, engines, no_workers):
    e = engines(daemon.socket, "kv/inline", "vllm", seed=41)
    dst = dst_local("vllm")
    before = snapshot(dst)
    t = kv.read_blocks(store, e.desc, SRC, dst, DST)
    assert not t.done() and no_workers == [t]
    t.wait(30)
    assert t.done() and t.error is None and no_workers == [t]   # not handed out again
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(LAYERS), before))
    # A failure met on the caller's thread comes as the read's BlockError.
    old = e.desc
    e.cmd("reregister")
    t = kv.read_blocks(store, old, [1], dst, [2])
    with pytest.raises(kv.BlockError) as x:
        t.wait(30)
    assert x.value.blocks == [2] and isinstance(x.value.cause, kv.StaleSpaceError) and t.done()


def test_wait_layer_runs_up_to_that_layer_on_the_caller(store, daemon, engines, no_workers):
    """A host read waited for layer by layer: wait_layer(1) copies layers 0 and 1 on
    this thread and hands the rest back (to no worker here: the later layers stay
    untouched until the caller waits for them)."""
    e = engines(daemon.socket, "kv/layerwise", "sglang", seed=42)
    dst = dst_local("sglang")
    before = snapshot(dst)
    t = kv.read_blocks(store, e.desc, SRC, dst, DST)
    t.wait_layer(1, 30)
    assert not t.done() and no_workers == [t, t]
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(2), before))
    t.wait_layer(0, 30)   # complete already: nothing runs
    with pytest.raises(TimeoutError):
        t.wait(0)         # a zero timeout only looks
    assert no_workers == [t, t]
    t.wait_layer(2, 30)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(3), before))
    t.wait(30)
    assert t.done() and t.error is None and no_workers == [t, t, t]
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(LAYERS), before))


def test_reads_nobody_waits_for_run_on_workers(store, daemon, engines):
    """Reads polled with done() only end on the workers; many at once, into
    disjoint blocks, every byte right."""
    e = engines(daemon.socket, "kv/polled", "vllm", seed=43)
    dst = dst_local("vllm")
    before = snapshot(dst)
    pairs = [([s], [d]) for s, d in zip(SRC, DST)] * 4   # the same copies again: same bytes
    ts = [kv.read_blocks(store, e.desc, s, dst, d) for s, d in pairs]
    deadline = time.monotonic() + 30
    while not all(t.done() for t in ts):
        assert time.monotonic() < deadline, "reads nobody waited for did not end"
        time.sleep(0.005)
    assert all(t.error is None for t in ts)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(LAYERS), before))
    assert len([th for th in threading.enumerate() if th.name == "cudaipc-kv-read"]) <= _kvread._workers.limit


def test_many_waiters_on_one_read(store, daemon, engines):
    """Threads waiting on one read at once (wait and wait_layer of every layer):
    one of them or a worker runs it, every wait returns, the bytes are right."""
    e = engines(daemon.socket, "kv/waiters", "offload", seed=44)
    dst = dst_local("offload")
    before = snapshot(dst)
    ids = list(range(BLOCKS))
    for round_ in range(10):
        t = kv.read_blocks(store, e.desc, ids, dst, ids[::-1])
        errs = []
        go = threading.Barrier(LAYERS + 2)

        def waiter(layer):
            try:
                go.wait(10)
                if layer is None:
                    t.wait(30)
                else:
                    t.wait_layer(layer, 30)
                    assert t.reached() > layer
            except BaseException as x:  # noqa: BLE001
                errs.append(x)

        ths = [threading.Thread(target=waiter, args=(li,)) for li in [None] + list(range(LAYERS))]
        for th in ths:
            th.start()
        go.wait(10)
        for th in ths:
            th.join(60)
        assert not errs and not any(th.is_alive() for th in ths), (round_, errs)
        t.wait(30)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, ids, ids[::-1], range(LAYERS), before))


class _Blocked:
    """A stand-in read's work: runs whole, once, after ``gate`` opens."""
    layer_wise = False

    def __init__(self, gate, running, lock):
        self.gate, self.running, self.lock = gate, running, lock
        self.runs = 0

    def run(self, t, upto, waiter):
        with self.lock:
            self.running[0] += 1
            self.running[1] = max(self.running[1], self.running[0])
        self.gate.wait(30)
        with self.lock:
            self.running[0] -= 1
        self.runs += 1
        t.layer_done(t.count - 1)
        t.finish(None)


def test_worker_pool_is_bounded():
    """Reads that block their workers: at most ``limit`` run at once, the rest wait
    for a worker, each runs once and all end."""
    pool = _kvread._Workers(3)
    gate, lock, running = threading.Event(), threading.Lock(), [0, 0]
    ts, jobs = [], []
    for _ in range(20):
        t = _kvread.Transfer("0:kv/stand-in", 0, 1, [0])
        j = _Blocked(gate, running, lock)
        t._job = j
        pool.submit(t)
        ts.append(t)
        jobs.append(j)
    deadline = time.monotonic() + 10
    while running[0] < 3:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.005)
    time.sleep(0.05)
    assert running[0] == 3
    gate.set()
    for t in ts:
        t.wait(30)
    assert running[1] == 3 and all(j.runs == 1 for j in jobs) and pool._threads == 3


def test_layers_arrive_in_order_on_a_worker(store, daemon, engines):
    """A read a worker took up while this thread waits on its layers one by one:
    each wait returns with that layer's bytes there."""
    e = engines(daemon.socket, "kv/order", "sglang", seed=45)
    dst = dst_local("sglang")
    before = snapshot(dst)
    rng = np.random.default_rng(4)
    src = rng.permutation(BLOCKS)[:12].tolist()
    dsts = rng.permutation(BLOCKS)[:12].tolist()
    t = kv.read_blocks(store, e.desc, src, dst, dsts)
    for layer in range(LAYERS):
        t.wait_layer(layer, 30)
        want = kvutil.expected(e.desc, e.seed, dst, src, dsts, range(layer + 1), before)
        for i in (2 * layer, 2 * layer + 1):   # its K and V regions
            assert np.array_equal(kvutil.host_region(dst.memory[i]), want[i]), "layer %d" % layer
    t.wait(30)
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, src, dsts, range(LAYERS), before))


def test_copies_keep_the_gil_only_for_a_waiting_caller(store, daemon, engines, monkeypatch):
    """A caller's own read copies with the GIL kept (no thread can take it at every
    copy), runs of up to _HOLD_BYTES; a worker's copies let other threads run."""
    e = engines(daemon.socket, "kv/gil", "vllm", seed=46)
    dst = dst_local("vllm")
    before = snapshot(dst)
    calls = {"held": 0, "free": 0}

    def counted(name, fn):
        def f(d, s, n):
            calls[name] += 1
            return fn(d, s, n)
        return f
    monkeypatch.setattr(_kvread, "_memmove_held", counted("held", _kvread._memmove_held))
    monkeypatch.setattr(_kvread, "_memmove", counted("free", _kvread._memmove))
    kv.read_blocks(store, e.desc, SRC, dst, DST).wait(30)
    assert calls["held"] > 0 and calls["free"] == 0, calls
    kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, SRC, DST, range(LAYERS), before))
    # Left to a worker.
    n = calls["held"]
    t = kv.read_blocks(store, e.desc, DST, dst, SRC)
    deadline = time.monotonic() + 30
    while not t.done():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert t.error is None and calls["held"] == n and calls["free"] > 0, calls
    # Runs longer than _HOLD_BYTES let go of it on the caller's thread too.
    monkeypatch.setattr(_kvread, "_HOLD_BYTES", 2 * 96 - 1)
    calls["held"] = calls["free"] = 0
    kv.read_blocks(store, e.desc, [0, 1], dst, [0, 1]).wait(30)     # one run of two 96-byte blocks a part
    assert calls["held"] == 0 and calls["free"] > 0, calls


def test_forked_child_reads_on_its_own_workers(store, daemon, engines):
    """A child forked after this process's workers started has none of them: its
    reads nobody waits for start workers of its own (else they would never run)."""
    import os
    import signal
    e = engines(daemon.socket, "kv/fork", "vllm", seed=47)
    dst = dst_local("vllm")
    t = kv.read_blocks(store, e.desc, SRC, dst, DST)
    while not t.done():   # a worker runs it: the pool has threads now
        time.sleep(0.005)
    assert _kvread._workers._threads > 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report, never return into pytest
        ok = b"0"
        try:
            import cudaipc
            with cudaipc.connect(daemon.socket) as s:
                before = snapshot(dst)
                t = kv.read_blocks(s, e.desc, DST, dst, SRC)
                deadline = time.monotonic() + 20
                while not t.done() and time.monotonic() < deadline:
                    time.sleep(0.005)
                t.wait(0)   # only looks: a worker of the child must have run it
                kvutil.check_bytes(dst, kvutil.expected(e.desc, e.seed, dst, DST, SRC, range(LAYERS), before))
                ok = b"1"
        except BaseException as x:  # noqa: BLE001
            ok = repr(x).encode()[:200]
        finally:
            os.write(w, ok)
            os._exit(0)
    os.close(w)
    try:
        got = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            chunk = os.read(r, 256)
            if not chunk:
                break
            got += chunk
        assert got == b"1", got
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
