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


def test_polling_reads_what_a_fake_daemon_sends_late(tmp_path, monkeypatch):
    """Against a fake daemon that answers after a pause, polling and then sleeping
    both deliver the reply, and a reply inside the window resets the back-off."""
    monkeypatch.delenv("CUDAIPC_SPIN", raising=False)
    from cudaipc import _store_pb2 as pb
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    delays = [0.0, 0.6, 0.0, 0.05, 0.0]

    def serve():
        c, _ = srv.accept()
        for d in delays:
            req = pb.Request()
            req.ParseFromString(c.recv(65536))
            time.sleep(d)
            c.send(pb.Response(id=req.id, stat=pb.StatResponse(info=pb.ObjectInfo(name=req.stat.name, size=d and 7 or 3))).SerializeToString())
        c.close()
    th = threading.Thread(target=serve)
    th.start()
    try:
        conn = _wire.Conn(path, 0.3)
        got = []
        for i in range(len(delays)):
            r = conn.call(pb.Request(stat=pb.StatRequest(name="n%d" % i)), "stat")
            got.append((r.resp.stat.info.name, r.resp.stat.info.size, conn._spin_skip, conn._spin_backoff))
        assert got == [("n0", 3, 0, 0),        # within the window
                       ("n1", 7, 1, 1),        # 0.6 s: the 0.3 s window found nothing
                       ("n2", 3, 0, 1),        # skipped polling, slept
                       ("n3", 7, 0, 0),        # found while polling: the back-off ends
                       ("n4", 3, 0, 0)]
        conn.close()
    finally:
        th.join()
        srv.close()
