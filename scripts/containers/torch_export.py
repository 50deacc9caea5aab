"""The exporter of the torch/CuPy container test (client TestRegisterTorchAcrossContainers),
run by the Go test inside a sibling container: it speaks lines on stdin/stdout.

KIND=torch: a uint8 tensor of SIZE bytes (default 64 MiB) from PyTorch's expandable-segments allocator
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set by the test).
KIND=cupy: a CuPy array on memory from a VMM allocator (cuMemCreate, POSIX fd),
installed with cupy.cuda.set_allocator.
It registers NAME and NAME/timeline (a cudaipc.extmem.Timeline), says
"registered <sha256> pieces=<n>"; on "write" it queues, on its stream, busy copies
and then a write of new random bytes and Timeline.signal(1), says "queued <sha256 of
the new bytes>"; on "exit" it exits (os._exit) without freeing anything."""

import hashlib
import os
import sys

import cudaipc
from cudaipc import extmem

KIND = os.environ.get("KIND", "torch")
NAME = os.environ["NAME"]
N = int(os.environ.get("SIZE", 64 << 20))


def say(s):
    sys.stdout.write(s + "\n")
    sys.stdout.flush()


def main():
    store = cudaipc.connect()
    if KIND == "torch":
        import torch
        g = torch.Generator(device="cuda").manual_seed(int(os.environ.get("SEED", "1")))
        arr = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda", generator=g)
        stream = torch.cuda.current_stream()
        sha = lambda a: hashlib.sha256(a.cpu().numpy().tobytes()).hexdigest()
        new = lambda: torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda", generator=g)
        handle = stream.cuda_stream
        busy_a = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        busy_b = torch.empty_like(busy_a)
        def busy():
            for _ in range(200):
                busy_b.copy_(busy_a)
        sync = torch.cuda.synchronize
    else:
        import cupy
        bufs = []
        def vmm_alloc(size):
            b = extmem.VMMBuffer(size, cupy.cuda.Device().id)
            bufs.append(b)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(b.ptr, b.size, b), 0)
        cupy.cuda.set_allocator(vmm_alloc)
        rs = cupy.random.RandomState(int(os.environ.get("SEED", "1")))
        arr = rs.randint(0, 256, N, dtype=cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        sha = lambda a: hashlib.sha256(cupy.asnumpy(a).tobytes()).hexdigest()
        handle = stream.ptr
        busy_a = cupy.empty(256 << 20, dtype=cupy.uint8)
        busy_b = cupy.empty_like(busy_a)
        def new():
            with stream:
                return rs.randint(0, 256, N, dtype=cupy.uint8)
        def busy():
            with stream:
                for _ in range(200):
                    busy_b[...] = busy_a
        sync = cupy.cuda.Device().synchronize
    tl = extmem.Timeline()
    info = store.register(NAME, arr, shared=True)
    store.register(NAME + "/timeline", tl, shared=True)
    with extmem.export_pointer(arr) as x:
        pieces = len(x.pieces) if x.vmm else 0
    say("registered %s pieces=%d size=%d" % (sha(arr), pieces, info.size))
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "write":
            src = new()
            sync()
            want = sha(src)
            busy()
            if KIND == "torch":
                arr.copy_(src)
            else:
                with stream:
                    arr[...] = src
            tl.signal(handle, 1)
            say("queued %s" % want)
            sync()
        elif cmd == "exit":
            sys.stdout.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
