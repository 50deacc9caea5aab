"""What cudaipc.export_pointer makes of each allocator's memory on this machine: the
probe table of docs/containers.md. Each configuration runs in its own process
(PyTorch reads PYTORCH_CUDA_ALLOC_CONF once). Prints one JSON line per allocator."""

import json
import os
import subprocess
import sys

CASE = r'''
import json, sys
import cudaipc
from cudaipc import extmem
kind = sys.argv[1]
if kind.startswith("torch"):
    import torch
    a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
else:
    import cupy
    if kind == "cupy-vmm":
        keep = []
        def alloc(n):
            b = extmem.VMMBuffer(n); keep.append(b)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(b.ptr, b.size, b), 0)
        cupy.cuda.set_allocator(alloc)
    elif kind == "cupy-async":
        cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
    a = cupy.empty(64 << 20, dtype=cupy.uint8)
try:
    with extmem.export_pointer(a) as x:
        out = {"vmm": x.vmm, "pieces": x.pieces, "offset": x.offset} if x.vmm else {"vmm": False, "legacy_region": True}
except cudaipc.NotExportable as e:
    out = {"not_exportable": str(e)}
except Exception as e:
    out = {"error": "%s: %s" % (type(e).__name__, e)}
print(json.dumps(out))
'''

CASES = [
    ("torch default (cudaMalloc segments)", "torch", ""),
    ("torch expandable_segments:True", "torch", "expandable_segments:True"),
    ("torch backend:cudaMallocAsync", "torch", "backend:cudaMallocAsync"),
    ("cupy default pool (cudaMalloc)", "cupy", ""),
    ("cupy MemoryAsyncPool (cudaMallocAsync)", "cupy-async", ""),
    ("cupy on a VMM allocator (cuMemCreate, POSIX fd)", "cupy-vmm", ""),
]

for label, kind, conf in CASES:
    env = dict(os.environ)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    p = subprocess.run([sys.executable, "-c", CASE, kind], env=env, capture_output=True, text=True, timeout=300)
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else json.dumps({"error": p.stderr.strip()[-400:]})
    print(json.dumps({"allocator": label, "result": json.loads(line)}), flush=True)
