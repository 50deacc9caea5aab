"""The Python reader of the registered-memory container test (client
TestRegisterTorchReadFromPythonAcrossContainers), run inside a sibling container: it
leases NAME (registered memory of another container) and speaks lines on
stdin/stdout. It says "leased <sha256 of read()> <sha256 of the tensor view> share=<share>
external=<bool>"; on "again" it reads both again and says "again <sha> <sha>"; on
"release" it releases and says "released"."""

import hashlib
import os
import sys

import cudaipc


def say(s):
    sys.stdout.write(s + "\n")
    sys.stdout.flush()


def sums(lease, t):
    return "%s %s" % (hashlib.sha256(lease.read()).hexdigest(), hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest())


def main():
    store = cudaipc.connect()
    lease = store.get(os.environ["NAME"], timeout=30)
    t = lease.tensor()
    say("leased %s share=%s external=%s" % (sums(lease, t), lease.share, lease.info.external))
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "again":
            say("again %s" % sums(lease, t))
        elif cmd == "release":
            del t
            lease.release()
            say("released")
            return


if __name__ == "__main__":
    main()
