"""A second process for the multi-process tests: python helper.py ROLE ARGS...

Roles:
  consume SOCKET NAME       get NAME, print the SHA-256 of its bytes
  hold SOCKET NAME          get NAME, keep a tensor view after release(), print "holding", sleep
  bundle-digests SOCKET NAME  get_bundle NAME, print "tensor sha256" per tensor
  import-region JSON        map the region, print the SHA-256 of its bytes
  publish-fake SOCKET NAME  publish a no-copy version of NAME over a made-up legacy
                            region (the daemon never opens it), print its version, sleep
  hold-version SOCKET NAME  lease NAME's latest version at the protocol level (no
                            mapping), print "holding", sleep
  nocopy-publisher SOCKET NAME VERSIONS [realloc]
                            (GPU) publish VERSIONS versions of a state dict of random
                            tensors without a copy; after each, print a JSON line
                            {version, digests} and wait for a line on stdin; with
                            realloc, free and allocate every tensor anew before each
                            version after the first
"""

import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudaipc  # noqa: E402


def main() -> None:
    role = sys.argv[1]
    if role == "consume":
        with cudaipc.connect(sys.argv[2]) as s:
            with s.get(sys.argv[3], timeout=30) as lease:
                print(hashlib.sha256(lease.read()).hexdigest(), flush=True)
    elif role == "hold":
        s = cudaipc.connect(sys.argv[2])
        lease = s.get(sys.argv[3], timeout=30)
        view = lease.tensor() if lease.device != "host" else lease.memoryview()
        lease.release()
        print("holding", flush=True)
        time.sleep(120)
        print(view is not None)
    elif role == "bundle-digests":
        import torch
        with cudaipc.connect(sys.argv[2]) as s:
            with s.get_bundle(sys.argv[3], timeout=30) as b:
                for k, v in b.items():
                    print(k, hashlib.sha256(v.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest(), flush=True)
    elif role == "import-region":
        m = cudaipc.import_region(sys.argv[2])
        print(hashlib.sha256(m.read()).hexdigest(), flush=True)
    elif role == "publish-fake":
        from test_nocopy import publish_fake
        s = cudaipc.connect(sys.argv[2])
        print(publish_fake(s, sys.argv[3]), flush=True)
        time.sleep(120)
    elif role == "nocopy-publisher":
        import json
        import torch
        torch.cuda.set_device(0)
        shapes = {"embed": (1000, 64), "norm": (64,), "w0": (256, 64), "w1": (64, 256), "tiny": (3,), "empty": (0, 4)}
        sd = {k: torch.empty(v, dtype=torch.bfloat16, device="cuda") for k, v in shapes.items()}
        s = cudaipc.connect(sys.argv[2])
        realloc = sys.argv[5:] == ["realloc"]
        for i in range(int(sys.argv[4])):
            s.wait_released(sys.argv[3], 30)
            if realloc and i:
                # Free every tensor and its segment, then allocate them again: the
                # driver tends to give the same addresses to the new allocations.
                sd.clear()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                sd = {k: torch.empty(v, dtype=torch.bfloat16, device="cuda") for k, v in shapes.items()}
            for t in sd.values():
                t.view(torch.int16).random_(-32768, 32767)
            info = s.put_bundle(sys.argv[3], sd, publish=True, copy=False, keep_last=1)
            digests = {k: hashlib.sha256(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for k, t in sd.items()}
            print(json.dumps({"version": info.version, "digests": digests}), flush=True)
            sys.stdin.readline()
    elif role == "hold-version":
        from cudaipc import _store_pb2 as pb
        s = cudaipc.connect(sys.argv[2])
        r = s._conn.call(pb.Request(get=pb.GetRequest(name=sys.argv[3], timeout_ms=30000, newer_than=0)), "get", sys.argv[3])
        for fd in (r.fds or []) + ([r.manifest_fd] if r.manifest_fd >= 0 else []):
            os.close(fd)
        print("holding", r.resp.get.info.version, flush=True)
        time.sleep(120)
    else:
        raise SystemExit("unknown role " + role)


if __name__ == "__main__":
    main()
