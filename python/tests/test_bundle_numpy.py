"""Bundles of NumPy arrays (host memory), with and without PyTorch: put_bundle,
get_bundle(views="numpy") and load_into on NumPy arrays, and the same in a process
where torch cannot be imported at all."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import cudaipc
from conftest import PYROOT

np = pytest.importorskip("numpy", reason="bundles of NumPy arrays need NumPy (python3-numpy)")

# NumPy dtypes with a safetensors name (NumPy has no bfloat16 or float8).
DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "float16", "int32", "uint32", "float32",
          "float64", "int64", "uint64", "complex64"]


def random_array(rng, dtype, shape):
    """Random bits of dtype (floats include NaNs with payloads: a copy must move bits)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = rng.integers(0, 256, size=n, dtype=np.uint8)
    if dt == np.bool_:
        raw &= 1
    return raw.view(dt).reshape(shape)


def state_dict(rng):
    sd = {}
    for i, dt in enumerate(DTYPES):
        sd["t%d.%s" % (i, dt)] = random_array(rng, dt, (int(rng.integers(1, 9)), int(rng.integers(1, 40))))
    sd["scalar"] = random_array(rng, "float32", ())
    sd["empty"] = np.zeros((0, 7), dtype=np.int16)
    sd["strided"] = random_array(rng, "int32", (6, 10))[:, ::3]   # not contiguous: copied by NumPy
    return sd


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_numpy_bundle_round_trip(store):
    rng = np.random.default_rng()
    sd = state_dict(rng)
    info = store.put_bundle("np", sd, publish=True, metadata={"step": "3"})
    assert info.tensors == len(sd) and info.device == "host"
    with store.get_bundle("np", timeout=5, views="numpy") as b:
        assert b.views == "numpy" and b.metadata == {"step": "3"} and set(b) == set(sd)
        for k, a in sd.items():
            v = b[k]
            assert isinstance(v, np.ndarray) and same_bits(v, a), k
            assert not v.flags.writeable, "a leased view must be read-only"
        # Into NumPy arrays the engine owns: contiguous ones by memmove, strided by NumPy.
        params = {k: np.zeros_like(a) for k, a in sd.items()}
        params["strided"] = np.zeros((6, 12), dtype=np.int32)[:, ::3]
        rep = cudaipc.load_into(b, params)
        assert rep.tensors == len(sd) and rep.method == "host+numpy", rep
        for k, a in sd.items():
            assert same_bits(params[k], a), k
        with pytest.raises(cudaipc.LoadMismatch) as e:
            cudaipc.load_into(b, {"t0.bool": np.zeros((1, 1), dtype=np.bool_), "nope": np.zeros(1),
                                  "scalar": np.zeros((), dtype=np.float64)})
        assert len(e.value.problems) == 3, e.value.problems
    with pytest.raises(TypeError, match="0-d array"):
        store.put_bundle("np-scalar", {"x": np.float32(1)})


def test_subset_get_bundle(store):
    """get_bundle(tensors=[...]): only those tensors, bytes equal; bad names are
    InvalidArgument naming them, and leave no lease behind."""
    rng = np.random.default_rng()
    sd = state_dict(rng)
    store.put_bundle("sub", sd, metadata={"k": "v"})
    want = ["scalar", "t1.uint8", "empty"]
    with store.get_bundle("sub", views="numpy", tensors=want) as b:
        assert set(b) == set(want) and len(b) == 3 and b.metadata == {"k": "v"}
        assert "t0.bool" not in b
        with pytest.raises(KeyError):
            b["t0.bool"]
        for k in want:
            assert same_bits(b[k], sd[k]), k
        assert b.nbytes == sum(np.ascontiguousarray(sd[k]).nbytes for k in want)
        params = {k: np.zeros_like(sd[k]) for k in want}
        cudaipc.load_into(b, params)
        for k in want:
            assert same_bits(params[k], sd[k]), k
    for bad, named in ((["scalar", "nope"], "'nope'"), (["empty", "empty"], "'empty'")):
        with pytest.raises(cudaipc.InvalidArgument, match=named):
            store.get_bundle("sub", views="numpy", tensors=bad)
    with pytest.raises(TypeError, match="list of tensor names"):
        store.get_bundle("sub", views="numpy", tensors="scalar")
    assert store.stat("sub").leases == 0


def test_create_bundle_of_numpy_arrays(store):
    """create_bundle's NumPy views: NumPy's dtypes, and bfloat16 as ml_dtypes' type
    where ml_dtypes is installed (the GPU machines have it, from JAX), else as uint8
    bytes (both branches run deterministically in test_bfloat16_views_follow_ml_dtypes)."""
    rng = np.random.default_rng()
    w = cudaipc.bundle.create_bundle(store, "made", {"a": ("float32", (4, 5)), "b": (np.int64, (3,)),
                                                     "h": ("bfloat16", (2, 2))}, views="numpy")
    a, b = random_array(rng, "float32", (4, 5)), random_array(rng, "int64", (3,))
    w.tensors["a"][...] = a
    w.tensors["b"][...] = b
    h = w.tensors["h"]
    if importlib.util.find_spec("ml_dtypes") is not None:
        import ml_dtypes
        assert h.dtype == np.dtype(ml_dtypes.bfloat16) and h.shape == (2, 2), (h.dtype, h.shape)
    else:
        assert h.dtype == np.uint8 and h.shape == (8,), (h.dtype, h.shape)
    bits = rng.integers(0, 256, size=8, dtype=np.uint8)
    h.reshape(-1).view(np.uint8)[...] = bits
    w.seal()
    with store.get_bundle("made", views="numpy") as got:
        assert same_bits(got["a"], a) and same_bits(got["b"], b)
        assert got["h"].dtype == h.dtype and got["h"].shape == h.shape and got["h"].tobytes() == bits.tobytes()


@pytest.mark.parametrize("ml_dtypes", ["absent", "present"])
def test_bfloat16_views_follow_ml_dtypes(daemon, ml_dtypes):
    """bfloat16 and float8 entries of a bundle's NumPy views: uint8 bytes in a process
    where ml_dtypes cannot be imported, ml_dtypes' types where it can (a stand-in module
    here: the CPU machines lack the package), whatever was imported before; the bits
    round-trip through create_bundle, get_bundle and load_into either way. A lease's
    numpy("bfloat16") agrees: ml_dtypes' type, or a TypeError that names ml_dtypes."""
    script = textwrap.dedent("""
        import sys, types
        import numpy as np
        if sys.argv[2] == "absent":
            sys.modules["ml_dtypes"] = None            # import ml_dtypes raises ImportError
            want = {"h": (np.dtype(np.uint8), (8,)), "f": (np.dtype(np.uint8), (3,))}
        else:
            fake = types.ModuleType("ml_dtypes")      # 2- and 1-byte types NumPy itself lacks
            fake.bfloat16 = np.dtype([("bf16", "<u2")])
            fake.float8_e4m3fn = np.dtype([("f8", "u1")])
            sys.modules["ml_dtypes"] = fake
            want = {"h": (fake.bfloat16, (2, 2)), "f": (fake.float8_e4m3fn, (3,))}
        import cudaipc
        rng = np.random.default_rng()
        bits = {"h": rng.integers(0, 256, size=8, dtype=np.uint8), "f": rng.integers(0, 256, size=3, dtype=np.uint8)}
        with cudaipc.connect(sys.argv[1]) as store:
            w = cudaipc.bundle.create_bundle(store, "bf", {"h": ("bfloat16", (2, 2)), "f": ("float8_e4m3fn", (3,))},
                                             views="numpy")
            for k, (dt, shape) in want.items():
                v = w.tensors[k]
                assert v.dtype == dt and v.shape == shape, (k, v.dtype, v.shape)
                v.reshape(-1).view(np.uint8)[...] = bits[k]
            w.seal()
            with store.get_bundle("bf", timeout=5, views="numpy") as b:
                out = {}
                for k, (dt, shape) in want.items():
                    assert b[k].dtype == dt and b[k].shape == shape and b[k].tobytes() == bits[k].tobytes(), k
                    out[k] = np.zeros(shape, dtype=dt)
                cudaipc.load_into(b, out)
                assert all(out[k].tobytes() == bits[k].tobytes() for k in want), out
            store.put("raw", bits["h"].tobytes())
            with store.get("raw") as lease:                 # a lease's numpy() agrees
                try:
                    v = lease.numpy("bfloat16", (2, 2))
                except TypeError as e:
                    assert sys.argv[2] == "absent" and "ml_dtypes" in str(e), e
                else:
                    assert v.dtype == want["h"][0] and v.shape == (2, 2) and not v.flags.writeable, v
                    assert v.tobytes() == bits["h"].tobytes()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=PYROOT)
    p = subprocess.run([sys.executable, "-c", script, daemon.socket, ml_dtypes], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_bundles_without_torch(daemon):
    """A process where torch cannot be imported: bundles round-trip as NumPy arrays
    (views default to NumPy), and a tensor() says in one line what to install."""
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None          # import torch raises ImportError
        import numpy as np
        import cudaipc
        try:
            import torch  # noqa: F401
            raise SystemExit("torch is importable")
        except ImportError:
            pass
        rng = np.random.default_rng()
        sd = {"w": rng.standard_normal((33, 7)).astype(np.float32),
              "n": np.array([np.nan, -np.inf, 1.5], dtype=np.float64),
              "i": rng.integers(-9, 9, size=(5,), dtype=np.int8), "s": np.array(2.5, dtype=np.float16)}
        with cudaipc.connect(sys.argv[1]) as store:
            store.put_bundle("nt", sd, publish=True)
            for _ in range(2):   # the second load reuses its plan
                with store.get_bundle("nt", timeout=5) as b:
                    assert b.views == "numpy"
                    for k, a in sd.items():
                        assert type(b[k]) is np.ndarray and b[k].dtype == a.dtype and b[k].shape == a.shape, k
                        assert b[k].tobytes() == a.tobytes(), k
                    out = {k: np.empty_like(a) for k, a in sd.items()}
                    rep = cudaipc.load_into(b, out)
                    assert rep.method == "host" and all(out[k].tobytes() == a.tobytes() for k, a in sd.items())
            store.put("raw", b"12345678")
            with store.get("raw") as lease:
                try:
                    lease.tensor()
                    raise SystemExit("tensor() worked without torch")
                except cudaipc.CudaipcError as e:
                    print("MISSING:", e)
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=PYROOT)
    p = subprocess.run([sys.executable, "-c", script, daemon.socket], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr
    line = next(l for l in p.stdout.splitlines() if l.startswith("MISSING:"))
    assert "PyTorch" in line and "python3-torch" in line and "pip install torch" in line, line
