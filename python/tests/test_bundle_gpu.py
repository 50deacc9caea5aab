"""Bundles and versions of GPU objects (skip without a GPU; CUDAIPC_REQUIRE_GPU=N fails
instead), against daemons sharing GPU arenas by legacy IPC and by descriptor."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import cudaipc
from cudaipc import bundle as B
from conftest import HERE, need_gpus
from test_gpu import gpu_daemon, gstore, torch_cuda  # noqa: F401 - fixtures

HELPER = os.path.join(HERE, "helper.py")


def digest(t) -> str:
    import torch
    return hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def state_dict(torch, dev, n=40):
    g = torch.Generator(device=dev).manual_seed(7)
    sd = {"embed": torch.randn(1000, 64, device=dev, generator=g).to(torch.bfloat16)}
    for i in range(n):
        sd["l%d.w" % i] = torch.randn(33, 17, device=dev, generator=g).to(torch.bfloat16)
        sd["l%d.b" % i] = torch.randn(17, device=dev, generator=g)
        sd["l%d.i" % i] = torch.randint(0, 1000, (5,), device=dev, generator=g)
    return sd


def test_gpu_bundle_versions_load_into(gstore, gpu_daemon):
    torch = torch_cuda()
    sd = state_dict(torch, "cuda:0")
    params = {k: torch.zeros_like(v) for k, v in sd.items()}
    seen = 0
    for v in (1, 2, 3):
        for t in sd.values():
            t.add_(1)
        info = gstore.put_bundle("policy", sd, publish=True)
        assert info.version == v and info.device.startswith("GPU-")
        with gstore.get_bundle("policy", timeout=10, newer_than=seen) as b:
            assert b.version == v
            assert all(t.is_cuda for t in b.values())
            rep = cudaipc.load_into(b, params)
            seen = b.version
        assert rep.tensors == len(sd) and rep.nbytes == sum(t.numel() * t.element_size() for t in sd.values())
        for k in sd:
            assert torch.equal(params[k], sd[k]), k
    # Another process reads the latest version: the manifest comes beside the lease.
    out = subprocess.run([sys.executable, HELPER, "bundle-digests", gpu_daemon.socket, "policy"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    assert got == {k: digest(v) for k, v in sd.items()}
    # In place: the producer writes the version's own memory.
    w = B.create_bundle(gstore, "policy", {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}, 0, publish=True)
    for k, v in sd.items():
        w.tensors[k].copy_(v * 2 if v.is_floating_point() else v)
    torch.cuda.synchronize()
    w.seal()
    with gstore.get_bundle("policy", timeout=10) as b:
        assert b.version == 4
        assert torch.equal(b["embed"], sd["embed"] * 2)


def test_gpu_bundle_across_gpus(gstore):
    torch = torch_cuda()
    need_gpus(2)
    sd = state_dict(torch, "cuda:1", n=5)
    gstore.put_bundle("x", sd, publish=True)
    params = {k: torch.zeros_like(v, device="cuda:0") for k, v in sd.items()}
    with gstore.get_bundle("x", timeout=10) as b:
        rep = cudaipc.load_into(b, params)
    assert rep.tensors == len(sd)
    for k in sd:
        assert torch.equal(params[k].cpu(), sd[k].cpu()), k
