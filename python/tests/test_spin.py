"""Polling before parking (connect(spin=...), $CUDAIPC_SPIN): the same answers with and
without it, the back-off after a window that found nothing, and the option's errors."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

import cudaipc
from cudaipc import _wire


@pytest.mark.parametrize("text,want", [
    ("0", 0.0), ("50us", 50e-6), ("50µs", 50e-6), ("1.5ms", 1.5e-3), ("2s", 2.0),
    ("1ms500us", 1.5e-3), (".5ms", 0.5e-3), ("100ns", 100e-9), ("-1ms", -1e-3),
])
def test_parse_duration_as_go(text, want):
    assert _wire.parse_duration(text) == pytest.approx(want)


@pytest.mark.parametrize("text", ["fast", "50", "us", "1ms fast", "", "5 ms", "1e3us"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        _wire.parse_duration(text)


def test_spin_option(monkeypatch):
    monkeypatch.delenv("CUDAIPC_SPIN", raising=False)
    assert _wire.spin_option(None) == _wire.DEFAULT_SPIN
    assert _wire.spin_option(0) == 0
    assert _wire.spin_option(-1) == 0
    assert _wire.spin_option(1e-3) == 1e-3
    monkeypatch.setenv("CUDAIPC_SPIN", "200us")
    assert _wire.spin_option(None) == pytest.approx(200e-6)
    assert _wire.spin_option(0) == pytest.approx(200e-6)  # the environment overrides
    monkeypatch.setenv("CUDAIPC_SPIN", "0")
    assert _wire.spin_option(None) == 0


def test_bad_spin_env_is_invalid(daemon, monkeypatch):
    monkeypatch.setenv("CUDAIPC_SPIN", "fast")
    with pytest.raises(cudaipc.InvalidArgument) as ei:
        cudaipc.connect(daemon.socket)
    assert "CUDAIPC_SPIN='fast' is not a duration" in str(ei.value)


@pytest.mark.parametrize("spin", [0, 50e-6, 20e-3])
def test_same_answers_with_and_without_polling(daemon, spin, monkeypatch):
    monkeypatch.delenv("CUDAIPC_SPIN", raising=False)
    data = [os.urandom(1 + (i * 7919) % 70000) for i in range(20)]
    with cudaipc.connect(daemon.socket, spin=spin, fast_path=False) as s:
        assert s._conn.spin == spin
        for i, d in enumerate(data):
            s.put("spin-%d" % i, d)
        for _ in range(3):
            for i, d in enumerate(data):
                with s.get("spin-%d" % i) as lease:
                    assert bytes(lease.memoryview()) == d
        assert sorted(o.name for o in s.ls()) == sorted("spin-%d" % i for i in range(20))
        with pytest.raises(cudaipc.NotFound):
            s.stat("spin-none")
        with pytest.raises(cudaipc.Timeout):
            s.get("spin-none", timeout=0.05)


def test_window_that_finds_nothing_backs_off(daemon, monkeypatch):
    """A get that waits for a seal polls one window in vain: the next receives skip
    polling (1, then 2 ...), and a window that finds its answer resets the back-off."""
    monkeypatch.delenv("CUDAIPC_SPIN", raising=False)
    # Windows long enough (0.2 s) that a prompt answer is always found in them, even
    # on a loaded machine, and seals later than that (0.6 s).
    with cudaipc.connect(daemon.socket, spin=0.2) as s, cudaipc.connect(daemon.socket) as producer:
        c = s._conn
        assert (c._spin_skip, c._spin_backoff) == (0, 0)
        blob = os.urandom(4096)
        t = threading.Timer(0.6, lambda: producer.put("late", blob))
        t.start()
        with s.get("late", timeout=5) as lease:   # waits 0.6 s: longer than the window
            assert bytes(lease.memoryview()) == blob
        t.join()
        assert (c._spin_skip, c._spin_backoff) == (1, 1)
        s.stat("late")                            # skips polling once
        assert c._spin_skip == 0
        t = threading.Timer(0.6, lambda: producer.put("later", blob))
        t.start()
        with s.get("later", timeout=5):
            pass
        t.join()
        assert (c._spin_skip, c._spin_backoff) == (2, 2)
        for _ in range(2):
            s.stat("later")
        assert c._spin_skip == 0


class _Clock:
    """A stand-in for _wire's clock that stands still until the test moves it:
    a polling window then ends when the test says, never because the machine
    was slow. ``polling`` is set when a window starts (its first reading, after
    the receive that found nothing waiting)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.polling = threading.Event()

    def perf_counter(self) -> float:
        now = self.now  # read first: a window's end is always reckoned from 0
        self.polling.set()
        return now


class _Time:
    """The time module with the clock above as its perf_counter."""

    def __init__(self, clock: _Clock) -> None:
        self.perf_counter = clock.perf_counter

    def __getattr__(self, name):
        return getattr(time, name)


def test_polling_reads_what_a_fake_daemon_sends_late(tmp_path, monkeypatch):
    """Against a fake daemon that answers at moments the test picks (on a clock
    that moves only when told): a reply within the window is found polling, a
    window that ends with nothing makes the call sleep for its reply and skip the
    next window, and a reply found while polling resets the back-off."""
    monkeypatch.delenv("CUDAIPC_SPIN", raising=False)
    from cudaipc import _store_pb2 as pb
    clock = _Clock()
    monkeypatch.setattr(_wire, "time", _Time(clock))
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    parked = threading.Event()    # a window ended with nothing: the call sleeps
    # How the fake daemon answers each request: at once; after the window ended
    # with nothing ("late"); or once the window is open ("polled": found while
    # polling, not by the receive before it).
    when = ["now", "late", "now", "polled", "now"]
    errs = []

    def serve():
        c, _ = srv.accept()
        try:
            for w in when:
                req = pb.Request()
                req.ParseFromString(c.recv(65536))
                if w in ("late", "polled") and not clock.polling.wait(10):
                    raise AssertionError("%s: the call did not poll within 10 s" % req.stat.name)
                if w == "late":
                    clock.now = 1e9                # the window ends
                    if not parked.wait(10):
                        raise AssertionError("%s: the window did not end within 10 s" % req.stat.name)
                    clock.now = 0.0
                size = 7 if w != "now" else 3
                c.send(pb.Response(id=req.id, stat=pb.StatResponse(info=pb.ObjectInfo(name=req.stat.name, size=size))).SerializeToString())
        except BaseException as e:  # noqa: BLE001 - reported by the test; closing ends the call
            errs.append(e)
        finally:
            c.close()
    th = threading.Thread(target=serve)
    th.start()
    try:
        conn = _wire.Conn(path, 0.3)
        poll = conn._poll

        def watched_poll(spin):
            got = poll(spin)
            if got is None:
                parked.set()
            return got
        monkeypatch.setattr(conn, "_poll", watched_poll)
        got = []
        for i in range(len(when)):
            clock.polling.clear()
            parked.clear()
            r = conn.call(pb.Request(stat=pb.StatRequest(name="n%d" % i)), "stat")
            got.append((r.resp.stat.info.name, r.resp.stat.info.size, conn._spin_skip, conn._spin_backoff,
                        clock.polling.is_set(), parked.is_set()))
        assert not errs
        assert got == [("n0", 3, 0, 0, got[0][4], False),   # within the window (found before or while polling)
                       ("n1", 7, 1, 1, True, True),          # the window found nothing: slept
                       ("n2", 3, 0, 1, False, False),        # skipped polling, slept
                       ("n3", 7, 0, 0, True, False),         # found while polling: the back-off ends
                       ("n4", 3, 0, 0, got[4][4], False)]
        conn.close()
    finally:
        th.join()
        srv.close()
