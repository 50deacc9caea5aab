"""Bundles and versions against a real daemon, host memory (runs on any machine)."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading

import pytest

import cudaipc
from cudaipc import bundle as B
from cudaipc import _plan as P
from conftest import HERE

torch = pytest.importorskip("torch", reason="the bundle API works on torch tensors (python3-torch)")


def random_state_dict(n: int = 0, seed: int = 0) -> dict:
    """Random tensors of every dtype this torch has, odd shapes."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i, name in enumerate(sorted(B.TO_SAFETENSORS)):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        shape = (1 + i % 3, 7)
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty((), dtype=dt).element_size(),),
                            dtype=torch.uint8, generator=g)
        sd["layer.%d.%s" % (i, name)] = raw.view(dt).view(shape).clone()
    for i in range(n):
        sd["moe.expert.%d.w" % i] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    return sd


def digest(t) -> str:
    return hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_put_get_bundle_every_dtype(store, daemon):
    sd = random_state_dict()
    sd["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    sd["empty"] = torch.empty(0, 4, dtype=torch.float16)
    sd["strided"] = torch.randn(8, 6)[:, ::2]   # not contiguous: copied as values
    info = store.put_bundle("b", sd, metadata={"format": "pt"})
    assert info.tensors == len(sd)
    st = store.stat("b")
    assert st.tensors == len(sd) and st.manifest_size > 0
    with store.get_bundle("b") as b:
        assert set(b) == set(sd)
        assert b.metadata == {"format": "pt"}
        for e in b.entries:
            assert e.begin % B.ALIGNMENT == 0
        for k, v in sd.items():
            assert b[k].dtype == v.dtype and tuple(b[k].shape) == tuple(v.shape), k
            assert torch.equal(b[k].view(torch.uint8) if v.dtype == torch.bool else b[k], v) or digest(b[k]) == digest(v), k
    # Another process reads the same bundle: the manifest travels beside the lease.
    out = subprocess.run([sys.executable, os.path.join(HERE, "helper.py"), "bundle-digests", daemon.socket, "b"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    assert got == {k: digest(v) for k, v in sd.items()}


def test_manifest_matches_go_layout(store):
    # A bundle written by Python is a safetensors header Go parses: check its shape here.
    entries, size = B.layout([("a", "BF16", (3, 5)), ("b", "U8", (1,)), ("c", "F4", (2,))])
    assert [e.begin for e in entries] == [0, 256, 512] and size == 513
    raw = B.encode_manifest(entries, {"k": "v"})
    assert len(raw) % 8 == 0
    assert B.parse_manifest(raw) == (entries, {"k": "v"})
    with pytest.raises(ValueError):
        B.layout([("x", "F4", (3,))])


def test_many_tensors(store):
    n = 100_000
    sd = {"t%d" % i: torch.full((2,), i, dtype=torch.int32) for i in range(n)}
    store.put_bundle("many", sd)
    with store.get_bundle("many") as b:
        assert len(b) == n
        assert b["t99999"].tolist() == [99999, 99999] and b["t0"].tolist() == [0, 0]


def test_not_a_bundle(store):
    store.put("plain", b"abc")
    with pytest.raises(cudaipc.InvalidArgument, match="not a bundle"):
        store.get_bundle("plain", timeout=1)


def test_versions_and_wait_newer(store):
    seen = []

    def reader():
        v = 0
        for _ in range(3):
            with store.get_bundle("w", timeout=30, newer_than=v) as b:
                v = b.version
                seen.append((v, float(b["x"][0])))

    # The reader uses its own connection: a get that waits holds up nothing else.
    t = threading.Thread(target=reader)
    t.start()
    for v in (1, 2, 3):
        info = store.put_bundle("w", {"x": torch.full((4,), float(v))}, publish=True)
        assert info.version == v
        # Wait until the reader took it, so that it sees every version.
        while len(seen) < v and t.is_alive():
            t.join(0.01)
    t.join(30)
    assert seen == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert store.get("w", timeout=0).version == 3
    with store.get_bundle("w", version=3) as b:
        assert float(b["x"][0]) == 3.0
    with pytest.raises(cudaipc.NotFound):
        store.get("w", timeout=0, version=1)   # superseded, unleased: reclaimed
    evs = []
    it = store.subscribe(timeout=5)
    store.put_bundle("w", {"x": torch.ones(4)}, publish=True)
    for ev in it:
        evs.append(ev)
        break
    assert evs[0].kind == "sealed" and evs[0].version == 4


def test_sharded_version_visible_when_all_sealed(store, daemon):
    o0 = store.publish("tp", 16, shards=2, shard=0)
    o1 = store.publish("tp", 16, shards=2, shard=1)
    assert o0.version == o1.version == 1
    o0.write(b"0" * 16)
    o1.write(b"1" * 16)
    o0.seal()
    with pytest.raises(cudaipc.Timeout):
        store.get("tp", timeout=0.05, version=1)
    o1.seal()
    l0 = store.get("tp", timeout=1)
    l1 = store.get("tp", version=l0.version, shard=1)
    assert (l0.read(), l1.read()) == (b"0" * 16, b"1" * 16)
    assert l0.info.shards == 2 and l1.info.shard == 1


def test_load_into(store):
    sd = {"a": torch.randn(4, 4), "b": torch.randn(3).to(torch.bfloat16), "c": torch.arange(5)}
    store.put_bundle("m", sd)
    with store.get_bundle("m") as b:
        params = {"a": torch.zeros(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16), "c": torch.zeros(5, dtype=torch.int64)}
        rep = cudaipc.load_into(b, params)
        assert rep.tensors == 3 and rep.nbytes == 64 + 6 + 40 and rep.seconds >= 0
        for k in sd:
            assert torch.equal(params[k], sd[k])
        # Every problem at once, and nothing copied.
        bad = {"a": torch.zeros(4, 5), "b": torch.zeros(3), "nope": torch.zeros(1), "c": torch.zeros(5, dtype=torch.int64)}
        with pytest.raises(cudaipc.LoadMismatch) as e:
            cudaipc.load_into(b, bad)
        assert len(e.value.problems) == 3
        msg = str(e.value)
        assert "nope: missing" in msg and "a: shape" in msg and "b: dtype" in msg
        assert not bad["c"].any()


def test_create_bundle_in_place(store):
    specs = {"w": (torch.float32, (3, 4)), "b": (torch.bfloat16, (5,))}
    w = B.create_bundle(store, "inplace", specs, publish=True)
    w.tensors["w"].copy_(torch.arange(12, dtype=torch.float32).view(3, 4))
    w.tensors["b"].fill_(2.5)
    assert w.version == 1
    w.seal()
    with store.get_bundle("inplace", timeout=1) as b:
        assert b["w"].flatten().tolist() == list(range(12))
        assert b["b"].float().tolist() == [2.5] * 5


def test_load_into_is_bit_exact(store):
    # NaN payloads and negative zeros survive: weights are copied as bits.
    raw = torch.tensor([0x7FC1, 0xFF81 - 0x10000, -0x8000, 0x7F80, 0x1234], dtype=torch.int16)
    sd = {"nan": raw.view(torch.bfloat16).clone(), "s": torch.tensor(-0.0)}
    store.put_bundle("nan", sd)
    with store.get_bundle("nan") as b:
        params = {"nan": torch.zeros(5, dtype=torch.bfloat16), "s": torch.tensor(1.0)}
        cudaipc.load_into(b, params)
    assert params["nan"].view(torch.int16).tolist() == raw.tolist()
    assert params["s"].view(torch.int32).item() == torch.tensor(-0.0).view(torch.int32).item()


def random_bits(dt, shape, g):
    """A tensor of dtype dt whose bits are random (NaN payloads included for floats)."""
    item = torch.empty((), dtype=dt).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g)
    return raw.view(dt).view(shape).clone() if n else torch.empty(shape, dtype=dt)


def bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8)


def test_load_into_many_tensors_bit_exact_and_plan_reuse(store):
    # 3,000 tensors of random bits (bf16/fp16 NaN payloads, negative zeros...), odd
    # shapes, empty and scalar ones: every bit lands, version after version, with
    # one plan built for the layout and reused while the parameters stay put.
    g = torch.Generator().manual_seed(11)
    dts = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int64, torch.bool, torch.uint8]
    shapes = [(3, 7), (5,), (), (0, 4), (2, 2, 3)]
    spec = {"t%d" % i: (dts[i % len(dts)], shapes[i % len(shapes)]) for i in range(3000)}
    params = {k: torch.zeros(s, dtype=dt) for k, (dt, s) in spec.items()}
    built, reused = 0, 0   # by load_into (put_bundle plans too)
    seen = 0
    for v in range(1, 4):
        sd = {k: (random_bits(dt, s, g) if dt != torch.bool else torch.randint(0, 2, s, generator=g).bool())
              for k, (dt, s) in spec.items()}
        store.put_bundle("many-v", sd, publish=True)
        with store.get_bundle("many-v", timeout=5, newer_than=seen) as b:
            seen = b.version
            b0, r0 = B.plan_stats["built"], B.plan_stats["reused"]
            rep = cudaipc.load_into(b, params)
            built += B.plan_stats["built"] - b0
            reused += B.plan_stats["reused"] - r0
            assert dict.__len__(b) == 0, "load_into made views"
        assert rep.tensors == len(spec) and rep.method == "host"
        assert rep.nbytes == sum(t.numel() * t.element_size() for t in sd.values())
        for k in spec:
            assert torch.equal(bits(params[k]), bits(sd[k])), (v, k)
    assert (built, reused) == (1, 2)
    # A parameter that moved (new storage): a new plan, the new address gets the bytes.
    params["t5"] = torch.zeros_like(params["t5"])
    with store.get_bundle("many-v", timeout=5) as b:
        b0 = B.plan_stats["built"]
        cudaipc.load_into(b, params)
        assert B.plan_stats["built"] == b0 + 1
    assert torch.equal(bits(params["t5"]), bits(sd["t5"]))


def test_load_into_reports_every_mismatch_with_a_cached_plan(store):
    sd = {"a": torch.randn(4, 6), "b": torch.randn(10).to(torch.float16), "c": torch.arange(8)}
    store.put_bundle("mm", sd, publish=True)
    params = {k: torch.zeros_like(v) for k, v in sd.items()}
    with store.get_bundle("mm", timeout=5) as b:
        cudaipc.load_into(b, params)   # the plan is cached now
        # Same address, other shape/dtype: the cached plan must not be used.
        params["a"].data = params["a"].data.view(6, 4)
        params["b"].data = params["b"].data.view(torch.int16)
        params["extra"] = torch.zeros(3)
        before = {k: v.clone() for k, v in params.items()}
        with pytest.raises(cudaipc.LoadMismatch) as e:
            cudaipc.load_into(b, params)
    assert sorted(e.value.problems) == sorted([
        "a: shape (4, 6) in the bundle, (6, 4) in the parameter",
        "b: dtype torch.float16 in the bundle, torch.int16 in the parameter",
        "extra: missing from the bundle"])
    assert "3 parameter(s) do not match the bundle" in str(e.value)
    for k in params:
        assert torch.equal(params[k], before[k]), k   # nothing copied


def test_load_into_merges_adjacent_copies_and_orders_overlaps(store):
    # Parameters that are views of one flat buffer in the bundle's order: the plan
    # merges them into few copies. Tied/overlapping destinations keep sequential
    # semantics (the last parameter wins).
    g = torch.Generator().manual_seed(3)
    n = 64
    sd = {"w%02d" % i: random_bits(torch.bfloat16, (8, 16), g) for i in range(n)}   # 256 bytes each: adjacent
    sd["tied_a"] = random_bits(torch.float32, (64,), g)
    sd["tied_b"] = random_bits(torch.float32, (64,), g)
    sd["nc"] = random_bits(torch.int16, (6, 4), g)
    store.put_bundle("flat", sd)
    flat = torch.zeros(n * 128, dtype=torch.bfloat16)
    params = {"w%02d" % i: flat[i * 128:(i + 1) * 128].view(8, 16) for i in range(n)}
    tied = torch.zeros(64)
    params["tied_a"] = tied
    params["tied_b"] = tied                  # the same memory twice: tied_b must win
    params["nc"] = torch.zeros(4, 6, dtype=torch.int16).t()   # not contiguous: a PyTorch copy
    with store.get_bundle("flat") as b:
        rep = cudaipc.load_into(b, params)
    assert rep.method == "host+torch"
    assert rep.copy_calls == 4, rep   # 64 views merged into one copy, 2 overlapping, 1 torch
    assert rep.copies == 4, rep
    for i in range(n):
        assert torch.equal(bits(params["w%02d" % i]), bits(sd["w%02d" % i])), i
    assert torch.equal(bits(tied), bits(sd["tied_b"]))
    assert torch.equal(params["nc"], sd["nc"])


def test_bundle_views_are_lazy(store):
    sd = {"x": torch.arange(6, dtype=torch.int32).view(2, 3), "y": torch.ones(4, dtype=torch.float64)}
    store.put_bundle("lazy", sd)
    b = store.get_bundle("lazy")
    assert dict.__len__(b) == 0 and len(b) == 2 and "x" in b and "z" not in b
    assert list(b) == ["x", "y"] and set(b.keys()) == {"x", "y"}
    assert b["x"].tolist() == [[0, 1, 2], [3, 4, 5]] and dict.__len__(b) == 1
    assert b.get("z") is None and b.get("y").tolist() == [1.0] * 4
    assert {k: v.tolist() for k, v in b.items()} == {"x": [[0, 1, 2], [3, 4, 5]], "y": [1.0] * 4}
    assert dict(b).keys() == {"x", "y"}
    b.release()
    assert len(b) == 0 and "x" not in b
    with pytest.raises(cudaipc.LoadMismatch, match="x: missing"):
        cudaipc.load_into(b, {"x": torch.zeros(2, 3, dtype=torch.int32)})


def test_copy_plan_never_merges_across_allocations():
    # GPU copies may not span two allocations even where they touch: the plan
    # merges adjacent copies only within one (allocation bases from the driver on a
    # GPU; here a stand-in that puts a boundary at 0x10000).
    pytest.importorskip("numpy")
    g = P.Group(0)
    offs = [0, 256, 512, 768]
    dsts = [0xFF00, 0x10000, 0x10100, 0x10200]       # adjacent, but the first ends an allocation
    g.build(offs, dsts, [256] * 4, lambda addrs: [a & ~0xFFFF for a in addrs])
    assert list(zip(g.off.tolist(), g.addr.tolist(), g.size.tolist())) == [(0, 0xFF00, 256), (256, 0x10000, 768)]
    h = P.Group(None)   # host memory: one copy
    h.build(offs, dsts, [256] * 4)
    assert list(zip(h.off.tolist(), h.addr.tolist(), h.size.tolist())) == [(0, 0xFF00, 1024)]
    # Overlapping destinations go one by one, in the parameters' order.
    o = P.Group(None)
    o.build([0, 256, 512], [0x1000, 0x1080, 0x5000], [256, 256, 256])
    assert o.serial == [(0, 0x1000, 256), (256, 0x1080, 256)] and o.size.tolist() == [256]


def test_put_bundle_reuses_its_layout_and_plan(store):
    # A trainer re-puts the same tensors, changed in place: the manifest is encoded
    # once and the copy plan reused; every version holds that version's bits.
    g = torch.Generator().manual_seed(9)
    sd = {"w%d" % i: torch.empty(17, 3, dtype=torch.bfloat16) for i in range(500)}
    sd["strided"] = torch.empty(6, 8, dtype=torch.float16)[:, ::2]   # a PyTorch copy
    b0, r0 = B.plan_stats["built"], B.plan_stats["reused"]
    for v in range(1, 4):
        for k, t in sd.items():
            t.copy_(random_bits(t.dtype, tuple(t.shape), g))
        info = store.put_bundle("re", sd, publish=True, metadata={"step": "7"})
        assert info.version == v and info.tensors == len(sd)
        with store.get_bundle("re", timeout=5) as b:
            assert b.metadata == {"step": "7"}
            for k, t in sd.items():
                assert torch.equal(bits(b[k]), bits(t)), (v, k)
    assert B.plan_stats["built"] - b0 == 1 and B.plan_stats["reused"] - r0 == 2
    # Other metadata: another manifest, the same bits.
    store.put_bundle("re", sd, publish=True, metadata={"step": "8"})
    with store.get_bundle("re", timeout=5) as b:
        assert b.metadata == {"step": "8"} and torch.equal(bits(b["w3"]), bits(sd["w3"]))


def test_a_refused_cached_plan_is_built_again(store, monkeypatch):
    # A cached plan whose copies the driver refuses (tensors freed and others
    # allocated at the same addresses in other CUDA allocations) is rebuilt once;
    # a fresh plan's failure is the caller's error.
    sd = {"a": torch.arange(6, dtype=torch.int32), "b": torch.ones(3)}
    store.put_bundle("retry", sd)
    params = {k: torch.zeros_like(v) for k, v in sd.items()}
    fails = []
    real = P.Plan.run

    def refusing(self, *a, **kw):
        if len(fails) < 1:
            fails.append(self)
            raise cudaipc.CudaError("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE")
        return real(self, *a, **kw)

    with store.get_bundle("retry") as b:
        cudaipc.load_into(b, params)   # builds and caches the plan
        monkeypatch.setattr(P.Plan, "run", refusing)
        built = B.plan_stats["built"]
        rep = cudaipc.load_into(b, params)
        assert B.plan_stats["built"] == built + 1 and rep.tensors == 2
        assert torch.equal(params["a"], sd["a"]) and torch.equal(params["b"], sd["b"])
        fails.clear()
        other = {"a": torch.zeros(6, dtype=torch.int32)}   # no cached plan for these
        with pytest.raises(cudaipc.CudaError, match="INVALID_VALUE"):
            cudaipc.load_into(b, other)


def test_gc_pause_restores_the_collector_exactly() -> None:
    """paused() turns the collector off for its block (nested blocks too) and leaves
    it as it found it: on if it was on, off if the program had turned it off, also
    when the block raises."""
    import gc
    from cudaipc import _gcpause
    was = gc.isenabled()
    try:
        gc.enable()
        with _gcpause.paused():
            assert not gc.isenabled()
            with _gcpause.paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError):
            with _gcpause.paused():
                raise RuntimeError("boom")
        assert gc.isenabled()
        gc.disable()
        with _gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_same_agrees_with_comparing_signatures_after_random_changes():
    """TORCH.same (the per-version check that makes no signature) answers what
    comparing a fresh signature with the kept one answers, for each kind of change
    a parameter can go through at any position: a new storage, a view of another
    shape or dtype at the same address, a transpose (same address and shape, not
    contiguous), one parameter more or fewer."""
    from cudaipc._arrays import TORCH
    rng = random.Random(20)
    for trial in range(200):
        n = rng.randint(1, 40)
        vals = [torch.zeros((4, 4) if rng.random() < 0.5 else (rng.randint(1, 5), 8), dtype=torch.float32) for _ in range(n)]
        sig = TORCH.signature(vals)
        assert TORCH.same(vals, sig)
        i = rng.randrange(n)
        kind = rng.choice(["storage", "shape", "dtype", "transpose", "more", "fewer", "none"])
        new = list(vals)
        if kind == "storage":
            new[i] = torch.zeros_like(vals[i])
        elif kind == "shape":
            new[i] = vals[i].view(-1)
        elif kind == "dtype":
            new[i] = vals[i].view(torch.int32)
        elif kind == "transpose":
            new[i] = vals[i].t()
        elif kind == "more":
            new.append(torch.zeros(3))
        elif kind == "fewer":
            del new[i]
        want = TORCH.signature(new) == sig
        assert TORCH.same(new, sig) == want, (trial, kind, i)
        assert want == (kind == "none"), (trial, kind)


@pytest.mark.parametrize("fast", [True, False])
def test_check_agrees_with_same_after_random_changes(fast, monkeypatch):
    """A Check (what a cached plan and a no-copy publisher ask every version) answers
    what TORCH.same answers, for each kind of change at any position: a new storage,
    a view of another shape or dtype at the same address, a transpose, a storage
    offset moved, requires_grad turned on, a tensor given twice, one more or fewer,
    a non-tensor. fast: through PyTorch's C++ loops, where this PyTorch has them
    (2.x built with CUDA; required under CUDAIPC_REQUIRE_GPU); else the reads one by
    one."""
    from cudaipc import _arrays
    from cudaipc._arrays import TORCH
    monkeypatch.setattr(_arrays, "FAST_CHECKS", fast)
    if fast and _arrays._torch_fast_check()[0] is None:
        if os.environ.get("CUDAIPC_REQUIRE_GPU"):
            pytest.fail("CUDAIPC_REQUIRE_GPU is set but this PyTorch lacks TensorGuards or the data-pointer check")
        pytest.skip("this PyTorch (%s) lacks TensorGuards or _tensors_data_ptrs_at_indices_equal" % torch.__version__)
    rng = random.Random(21)
    kinds = ["storage", "shape", "dtype", "transpose", "offset", "grad", "twice", "more", "fewer", "other", "none"]
    for trial in range(300):
        n = rng.randint(2, 40)
        buf = torch.zeros(64 * n + 64)
        vals = [buf[64 * k:64 * k + 16].view(4, 4) if rng.random() < 0.5 else buf[64 * k:64 * k + 8 * (k % 5 + 1)].view(-1, 8)
                for k in range(n)]
        sig = TORCH.signature(vals)
        chk = TORCH.check(vals, sig)
        assert isinstance(chk, _arrays._TorchCheck) == fast
        assert chk.fits(list(vals))
        i = rng.randrange(n)
        kind = kinds[trial % len(kinds)]
        new = list(vals)
        v = vals[i]
        if kind == "storage":
            new[i] = torch.zeros_like(v)
        elif kind == "shape":
            new[i] = v.view(-1)
        elif kind == "dtype":
            new[i] = v.view(torch.int32)
        elif kind == "transpose":
            new[i] = v.t()
        elif kind == "offset":
            new[i] = buf.as_strided(v.shape, v.stride(), v.storage_offset() + 1)
        elif kind == "grad":
            new[i] = v.detach().requires_grad_(True)
        elif kind == "twice":
            new[i] = new[(i + 1) % n]
        elif kind == "more":
            new.append(torch.zeros(3))
        elif kind == "fewer":
            del new[i]
        elif kind == "other":
            new[i] = vals[i].numpy()
        try:
            want = TORCH.same(new, sig)
        except (TypeError, AttributeError):
            with pytest.raises((TypeError, AttributeError)):
                chk.fits(new)
            continue
        assert chk.fits(new) == want, (trial, kind, i)
        assert want == (kind in ("none", "grad")), (trial, kind)
        assert chk.fits(list(vals)), (trial, kind)   # the original values still pass after any answer


def test_gather_chunk_table_tiles_every_copy_in_order():
    """The gather kernel's table (cudaipc._gather.chunk_table): each copy cut into
    rows of at most CHUNK bytes that tile it exactly, in order; applying the rows to
    a buffer one by one gives what the copies give (random copies, odd sizes and
    offsets, sizes of 1 byte and of exact chunk multiples)."""
    import numpy as np
    from cudaipc import _gather
    rng = random.Random(22)
    for trial in range(50):
        chunk = rng.choice([16, 64, 4096])
        n = rng.randint(1, 30)
        sizes = [rng.choice([1, chunk, 3 * chunk, rng.randint(1, 5 * chunk)]) for _ in range(n)]
        srcs, dsts, at = [], [], 0
        for k in sizes:   # sources anywhere in one buffer, destinations disjoint in another
            srcs.append(rng.randrange(0, 6 * chunk))
            at += rng.randint(0, 40)
            dsts.append(at)
            at += k
        src = np.frombuffer(os.urandom(12 * chunk), dtype=np.uint8)
        want = np.zeros(at + 1, dtype=np.uint8)
        for d, s_, k in zip(dsts, srcs, sizes):
            want[d:d + k] = src[s_:s_ + k]
        tab = _gather.chunk_table(np.array(dsts, dtype=np.uint64), np.array(srcs, dtype=np.uint64),
                                  np.array(sizes, dtype=np.uint64), chunk)
        assert tab.dtype == np.uint64 and tab.shape == (sum(-(-k // chunk) for k in sizes), 3)
        assert (tab[:, 2] >= 1).all() and (tab[:, 2] <= chunk).all()
        got = np.zeros(at + 1, dtype=np.uint8)
        for d, s_, k in tab.tolist():
            got[d:d + k] = src[s_:s_ + k]
        assert np.array_equal(got, want), trial
        i = 0
        for d, s_, k in zip(dsts, srcs, sizes):   # each copy's rows: consecutive, in order
            off = 0
            while off < k:
                assert tab[i].tolist() == [d + off, s_ + off, min(chunk, k - off)], (trial, i)
                off += chunk
                i += 1


def test_gather_kernel_loads_in_the_background_once(monkeypatch):
    """ready() never waits for the kernel's load: it starts it in the background (once
    per GPU) and answers None until the kernel is loaded and passed its test, then
    the kernel; a load that fails leaves the GPU to the batch for good, saying why;
    ENABLED off starts nothing. (A stand-in for the driver's compile and test.)"""
    import contextlib
    import threading
    import time
    from cudaipc import _gather
    go = threading.Event()
    compiled = []

    def compile_(ordinal):
        compiled.append(ordinal)
        assert go.wait(10)
        if ordinal == 8:
            raise RuntimeError("the driver refused the PTX")
        return "module", 1000 + ordinal
    monkeypatch.setattr(_gather, "_compile", compile_)
    monkeypatch.setattr(_gather, "_self_test", lambda ordinal, f: None if ordinal != 9 else "differs at byte 3")
    monkeypatch.setattr(_gather, "on", lambda ordinal: contextlib.nullcontext())
    for k in ("_loads", "_funcs", "_modules", "unavailable"):
        monkeypatch.setattr(_gather, k, {})
    t0 = time.monotonic()
    assert _gather.ready(7) is None and _gather.ready(7) is None and _gather.ready(8) is None
    assert _gather.ready(9) is None
    assert time.monotonic() - t0 < 1   # (the loads wait on go: nothing here waited for them)
    go.set()
    assert _gather.wait_ready(7) == 1007 and _gather.ready(7) == 1007
    assert _gather.wait_ready(8) is None and "refused the PTX" in _gather.unavailable[8]
    assert _gather.wait_ready(9) is None and _gather.unavailable[9] == "differs at byte 3"
    assert _gather.ready(8) is None and _gather.ready(9) is None
    assert sorted(compiled) == [7, 8, 9]   # one load per GPU
    monkeypatch.setattr(_gather, "ENABLED", False)
    assert _gather.ready(10) is None and _gather.wait_ready(10) is None and 10 not in _gather._loads
    # At exit, a load under way is waited for (bounded), not left inside the driver.
    monkeypatch.setattr(_gather, "ENABLED", True)
    go.clear()
    assert _gather.ready(11) is None
    threading.Timer(0.2, go.set).start()
    t0 = time.monotonic()
    _gather._drain(5)
    assert _gather._loads[11].is_set() and _gather.ready(11) == 1011 and 0.1 < time.monotonic() - t0 < 5


def test_load_into_with_a_cached_plan_refuses_a_parameter_made_non_contiguous_in_place(store):
    """A parameter that keeps its address, shape and dtype but no longer is
    contiguous (a square matrix transposed into .data) gets the bundle's bytes in
    its own element order: the cached plan (a flat copy) is not used."""
    sd = {"a": torch.randn(6, 6), "b": torch.randn(5)}
    store.put_bundle("nc", sd, publish=True)
    params = {k: torch.zeros_like(v) for k, v in sd.items()}
    with store.get_bundle("nc", timeout=5) as b:
        cudaipc.load_into(b, params)
        assert torch.equal(params["a"], sd["a"])
        params["a"].data = params["a"].data.t()
        assert params["a"].data_ptr() == params["a"].data.t().data_ptr() and not params["a"].is_contiguous()
        b0 = B.plan_stats["built"]
        cudaipc.load_into(b, params)
        assert B.plan_stats["built"] == b0 + 1
    assert torch.equal(params["a"], sd["a"])   # element for element, though laid out transposed


@pytest.mark.parametrize("state_dict, key, kind", [
    ({"a": [1, 2, 3]}, "a", "list"),
    ({"w": torch.ones(3), "b": 3}, "b", "int"),
    ({"w": torch.ones(3), "s": "text"}, "s", "str"),
    ({"w": torch.ones(3), "n": None}, "n", "NoneType"),
])
def test_put_bundle_names_a_value_it_cannot_store(store, state_dict, key, kind):
    """A value that is no tensor or array is refused in one line naming its key, its
    type and what a bundle takes; nothing is created."""
    with pytest.raises(TypeError) as e:
        store.put_bundle("bad", state_dict)
    msg = str(e.value)
    assert "\n" not in msg and "data_ptr" not in msg, msg
    assert "state_dict[%r]" % key in msg and kind in msg, msg
    assert "torch tensor" in msg and "NumPy array" in msg and "CuPy array" in msg, msg
    assert store.list() == []


def test_put_bundle_names_mixed_kinds_and_a_key_that_is_no_string(store):
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError) as e:
        store.put_bundle("mixed", {"t": torch.ones(2), "a": np.ones(2)})
    assert "state_dict['a']" in str(e.value) and "all of one kind" in str(e.value), str(e.value)
    with pytest.raises(TypeError) as e:
        store.put_bundle("keys", {1: torch.ones(2)})
    assert "key 1" in str(e.value) and "strings" in str(e.value), str(e.value)
    assert store.list() == []
    info = store.put_bundle("good", {"t": torch.arange(4)})
    assert info.tensors == 1
