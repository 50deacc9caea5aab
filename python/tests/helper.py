"""A second process for the multi-process tests: python helper.py ROLE ARGS...

Roles:
  consume SOCKET NAME       get NAME, print the SHA-256 of its bytes
  hold SOCKET NAME          get NAME, keep a tensor view after release(), print "holding", sleep
  bundle-digests SOCKET NAME  get_bundle NAME, print "tensor sha256" per tensor
  import-region JSON        map the region, print the SHA-256 of its bytes
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
    else:
        raise SystemExit("unknown role " + role)


if __name__ == "__main__":
    main()
