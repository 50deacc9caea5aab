"""The cluster flag of creates reaches the daemon (host memory, any machine)."""

from __future__ import annotations

import pytest

import cudaipc
from cudaipc import bundle as B


def test_cluster_create_needs_a_cluster_daemon(store: cudaipc.Store) -> None:
    # The test daemon is not part of a cluster: a cluster-visible create is
    # refused, naming why, and nothing is left behind.
    with pytest.raises(cudaipc.InvalidArgument, match="not part of a cluster"):
        store.create("c", 100, cluster=True)
    with pytest.raises(cudaipc.InvalidArgument, match="not part of a cluster"):
        B.create_bundle(store, "cb", {"w": ("uint8", (10,))}, cluster=True, views="numpy")
    np = pytest.importorskip("numpy")
    with pytest.raises(cudaipc.InvalidArgument, match="not part of a cluster"):
        B.put_bundle(store, "pb", {"w": np.arange(10, dtype=np.uint8)}, cluster=True)
    with pytest.raises(cudaipc.InvalidArgument, match="copy=False"):
        B.put_bundle(store, "pb", {"w": np.arange(10, dtype=np.uint8)}, publish=True, copy=False, cluster=True)
    o = store.create("c", 100)   # the name is free, and a plain create works
    o.abort()
