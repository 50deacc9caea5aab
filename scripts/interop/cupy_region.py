#!/usr/bin/env python3
"""Export GPU memory made by CuPy (or PyTorch) as a cudaipc region.

Allocates an array of random bytes, prints its region JSON (docs/region.md)
on the first line of stdout and "sha256 <hex> <size>" of the exported bytes
on the second, then keeps the memory alive until stdin closes, so that
another process can import it, e.g.:

    sleep 120 | python3 scripts/interop/cupy_region.py --size 67108864 --offset 12345 > /tmp/cupy.txt &
    until [ "$(wc -l < /tmp/cupy.txt)" -ge 2 ]; do sleep 0.2; done
    head -1 /tmp/cupy.txt > /tmp/region.json
    cudaipc dump --region @/tmp/region.json -o /tmp/dump.bin --sha256   # compare with line 2

Only libcuda.so.1 (through ctypes) and CuPy or PyTorch are needed.
"""

import argparse
import base64
import ctypes
import hashlib
import json
import os
import sys

CU_POINTER_ATTRIBUTE_BUFFER_ID = 7


def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    u64, p = ctypes.c_uint64, ctypes.POINTER
    lib.cuMemGetAddressRange_v2.argtypes = [p(u64), p(ctypes.c_size_t), u64]
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, u64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, u64]
    lib.cuDeviceGet.argtypes = [p(ctypes.c_int), ctypes.c_int]
    return lib


def _check(result, fn):
    if result != 0:
        raise RuntimeError(f"{fn} failed with CUresult {result}")


def _device_uuid(lib, ordinal):
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    raw = ctypes.create_string_buffer(16)
    fn = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    _check(fn(raw, dev), "cuDeviceGetUuid")
    h = raw.raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def region_for(ptr, nbytes, ordinal, handle=None):
    """Region JSON (a dict) for nbytes at device address ptr on CUDA device
    ordinal. The calling thread must have that device's primary context
    current, as CuPy and PyTorch leave it after allocating there."""
    lib = _libcuda()
    base, alloc = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(alloc), ptr), "cuMemGetAddressRange")
    buffer_id = ctypes.c_uint64()
    _check(lib.cuPointerGetAttribute(ctypes.byref(buffer_id), CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr), "cuPointerGetAttribute")
    if handle is None:  # the handle names the allocation, so export its base
        buf = ctypes.create_string_buffer(64)
        _check(lib.cuIpcGetMemHandle(buf, base.value), "cuIpcGetMemHandle")
        handle = buf.raw
    offset = ptr - base.value
    if offset + nbytes > alloc.value:
        raise ValueError("range runs past the end of its allocation")
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return {
        "version": 1,
        "kind": "cuda-ipc",
        "handle": base64.b64encode(bytes(handle)).decode(),
        "offset": offset,
        "size": nbytes,
        "alloc_size": alloc.value,
        "device": _device_uuid(lib, ordinal),
        "exporter_pid": os.getpid(),
        "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
        "boot_id": boot_id,
        "buffer_id": buffer_id.value,
        "exporter_base": hex(base.value),
    }


def with_cupy(size, offset, ordinal):
    import cupy

    cupy.cuda.Device(ordinal).use()
    arr = cupy.random.randint(0, 256, size=offset + size, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    ptr = arr.data.ptr + offset
    # CuPy's own export gives the same bytes as cuIpcGetMemHandle of the base.
    handle = cupy.cuda.runtime.ipcGetMemHandle(ptr)
    data = cupy.asnumpy(arr[offset:]).tobytes()
    return arr, region_for(ptr, size, ordinal, handle), data


def with_torch(size, offset, ordinal):
    import torch

    torch.cuda.set_device(ordinal)
    t = torch.randint(0, 256, (offset + size,), dtype=torch.uint8, device=f"cuda:{ordinal}")
    torch.cuda.synchronize()
    data = t[offset:].cpu().numpy().tobytes()
    return t, region_for(t.data_ptr() + offset, size, ordinal), data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=64 << 20, help="bytes to export (default 64 MiB)")
    ap.add_argument("--offset", type=int, default=0, help="start the region this many bytes into the array")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    ap.add_argument("--lib", choices=["cupy", "torch"], default="cupy")
    args = ap.parse_args()
    make = with_cupy if args.lib == "cupy" else with_torch
    keep, region, data = make(args.size, args.offset, args.device)
    print(json.dumps(region), flush=True)
    print(f"sha256 {hashlib.sha256(data).hexdigest()} {len(data)}", flush=True)
    sys.stdin.read()  # until stdin closes; the memory is freed on exit
    del keep


if __name__ == "__main__":
    main()
