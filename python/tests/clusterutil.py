"""Clusters for the tests: a real etcd (Debian's etcd-server) and ``cudaipc serve
--cluster`` daemons on this host (UCX over tcp on loopback), as context managers
that fixtures of any scope can use. Without etcd or libucp, :func:`need_cluster`
skips the test, or fails it under CUDAIPC_REQUIRE_CLUSTER=1."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest

from conftest import Daemon

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
"""The daemons' UCX settings: tcp, on loopback."""


def need(what: str, ok: bool) -> None:
    """Skip (or fail, under CUDAIPC_REQUIRE_CLUSTER=1) a test for which what is missing."""
    if ok:
        return
    if os.environ.get("CUDAIPC_REQUIRE_CLUSTER") == "1":
        pytest.fail("CUDAIPC_REQUIRE_CLUSTER=1 but %s is missing" % what)
    pytest.skip("%s is missing (Debian: etcd-server, libucx0)" % what)


def need_cluster() -> str:
    """The etcd binary, after checking that a cluster can run here (etcd and libucp)."""
    binary = os.environ.get("CUDAIPC_ETCD") or shutil.which("etcd")
    need("etcd (on PATH or at $CUDAIPC_ETCD)", binary is not None)
    need("libucp.so.0", any(os.path.exists(os.path.join(d, "libucp.so.0"))
                            for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib")))
    assert binary is not None
    return binary


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def start_etcd() -> Iterator[str]:
    """A fresh single-member etcd on loopback, for as long as the context lasts: its
    cluster URL (``etcd://127.0.0.1:PORT``, what ``cudaipc serve --cluster`` takes)."""
    binary = need_cluster()
    d = tempfile.mkdtemp(prefix="cudaipc-etcd-")
    client, peer = free_port(), free_port()
    url = "http://127.0.0.1:%d" % client
    log = open(os.path.join(d, "etcd.log"), "w+")
    proc = subprocess.Popen([binary, "--data-dir", os.path.join(d, "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", "http://127.0.0.1:%d" % peer,
                             "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer,
                             "--initial-cluster", "default=http://127.0.0.1:%d" % peer],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError("etcd did not start: " + log.read())
            time.sleep(0.05)
        yield "etcd://127.0.0.1:%d" % client
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def cluster_daemons(cudaipc_bin: str, etcd: str, args: Sequence[str], names: Sequence[str] = ("a", "b"),
                    configs: Optional[Sequence[Optional[str]]] = None) -> Iterator[List[Daemon]]:
    """Daemons of the cluster whose directory is etcd, one a name (the node's),
    each started with args (and configs[i], the text of its --config file), sharing a
    fresh cluster secret, with UCX on tcp over loopback."""
    saved = {k: os.environ.get(k) for k in UCX_ENV}
    os.environ.update(UCX_ENV)
    tmp = tempfile.mkdtemp(prefix="cudaipc-secret-")
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write(base64.b64encode(os.urandom(32)).decode() + "\n")
    os.chmod(secret, 0o600)
    started: List[Daemon] = []
    try:
        for i, name in enumerate(names):
            started.append(Daemon(cudaipc_bin, list(args) + ["--cluster", etcd, "--node", name, "--cluster-secret", secret,
                                                             "--cluster-listen", "127.0.0.1:0"],
                                  config=configs[i] if configs else None))
        yield started
    finally:
        for d in started:
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def daemons(nodes: str, cudaipc_bin: str, args: List[str], etcd: Optional[str] = None) -> Iterator[Tuple[Daemon, Daemon]]:
    """(the reader's source daemon, the reader's daemon) for nodes: "one-node" is one
    daemon for both; "two-nodes" two members (a, b) of the cluster whose directory is
    etcd; each started with args."""
    if nodes == "one-node":
        d = Daemon(cudaipc_bin, args)
        try:
            yield d, d
        finally:
            d.stop()
        return
    if nodes != "two-nodes" or etcd is None:
        raise ValueError("nodes %r (etcd %r): want one-node, or two-nodes with an etcd" % (nodes, etcd))
    with cluster_daemons(cudaipc_bin, etcd, args) as (a, b):
        yield a, b
