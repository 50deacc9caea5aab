"""An engine process for the KV tests: python kv_engine.py SOCKET NAME KIND LAYERS
BLOCKS BYTES SEED [shared] [gpu|gpu-vmm]

Registers the space NAME of layout KIND (kvutil.make_local) over alloc_host memory,
or with gpu over PyTorch CUDA tensors of GPU 0 (gpu-vmm: of expandable segments, VMM
memory), filled with kvutil.region_bytes(SEED, i), prints its description's text,
then obeys lines on stdin: "close" closes the space, "reregister" closes it and
registers it again (a new description, printed), "notices N [SECONDS]" waits (at
most SECONDS, 20 by default) for N notices of readers and prints them as a JSON list of {payload (hex), failed,
pid}; each is answered "done".
It exits when stdin ends."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cudaipc  # noqa: E402
from cudaipc import kv  # noqa: E402

import kvutil  # noqa: E402


def main() -> None:
    sock, name, kind = sys.argv[1:4]
    layers, blocks, nbytes, seed = (int(a) for a in sys.argv[4:8])
    flags = set(sys.argv[8:])
    shared = "shared" in flags
    if "gpu-vmm" in flags:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    store = cudaipc.connect(sock)
    if flags & {"gpu", "gpu-vmm"}:
        import torch
        local = kvutil.make_local(kind, layers, blocks, nbytes,
                                  lambda shape: torch.zeros(shape, dtype=torch.uint8, device="cuda:0"))
        torch.cuda.synchronize()
    else:
        local = kvutil.make_local(kind, layers, blocks, nbytes, lambda shape: kv.alloc_host(shape))
    kvutil.fill(local, seed)   # (synchronous copies: the bytes are there before the description goes out)
    space = kv.register(store, name, local, shared=shared)
    print(space.desc.to_text(), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "close":
            space.close()
        elif cmd == "reregister":
            space.close()
            space = kv.register(store, name, local, shared=shared)
            print(space.desc.to_text(), flush=True)
        elif cmd.startswith("notices "):
            args = cmd.split()[1:]
            want, got = int(args[0]), []
            deadline = time.monotonic() + (float(args[1]) if len(args) > 1 else 20)
            while len(got) < want and time.monotonic() < deadline:
                got += space.wait_notices(timeout=max(deadline - time.monotonic(), 0))
            print(json.dumps([dict(payload=n.payload.hex(), failed=n.failed, pid=n.pid) for n in got]), flush=True)
        else:
            raise SystemExit("unknown command %r" % cmd)
        print("done", flush=True)


if __name__ == "__main__":
    main()
