#!/usr/bin/env python3
"""Puts the JSON of `cudaipc bench ipc --json`, ipc_bench (C) and
torch_ipc.py (PyTorch, CuPy) side by side.

  python3 compare.py [--markdown] FILE.json...   # files that are missing or empty are skipped
  python3 compare.py --selftest

Rows are metrics; columns the tools, the hardware reference (the in-process
copy measured by the same tool run, for bandwidth rows), and ratios:
Go/C (the Go binding's overhead over the bare driver API), PyTorch/Go and
CuPy/Go (how many times the alternative's p50 is the Go one; for share_*
rows against the Go row named in the footnote).
"""
import json
import sys

TOOLS = [("cudaipc-go", "cudaipc (Go)"), ("c-driver-api", "C driver API"),
         ("pytorch", "PyTorch"), ("cupy", "CuPy")]

# Order and meaning; keys shared by all the programs.
ROWS = [
    ("export_first", "export (first, 1 MiB)"),
    ("export_again", "export (again)"),
    ("open_cold_1mib", "open, 1 MiB"),
    ("close_1mib", "close, 1 MiB"),
    ("open_cold_large", "open, large"),
    ("close_large", "close, large"),
    ("open_already_open", "open, already open"),
    ("close_decrement", "close, refcount only"),
    ("event_open", "IPC event open"),
    ("open_cold_peer", "open, other GPU"),
    ("share_1mib", "send->usable, 1 MiB"),
    ("share_1mib_again", "send->usable, 1 MiB, cached"),
    ("share_large", "send->usable, large"),
    ("d2d_local", "copy in-process (HW ref)"),
    ("ipc_read", "copy via IPC mapping"),
    ("host_staged", "host-staged, end to end"),
    ("host_staged_dma", "host-staged, DMA only"),
    ("peer_local", "GPU1->GPU0 in-process"),
    ("peer_ipc", "GPU1->GPU0 via IPC"),
]

# The Go row a PyTorch-only row is compared with.
COUNTERPART = {"share_1mib": "open_cold_1mib", "share_1mib_again": "open_already_open",
               "share_large": "open_cold_large"}


def fmt_num(v):
    if v == 0:
        return "0"
    if v >= 100:
        return "%.0f" % v
    if v >= 10:
        return "%.1f" % v
    if v >= 1:
        return "%.2f" % v
    return ("%.3f" % v).rstrip("0").rstrip(".")


def fmt_ratio(v):
    if v is None:
        return "-"
    return ("%.0fx" % v) if v >= 1000 else ("%.3gx" % v)


def cell(key, m):
    if m is None:
        return "-"
    if m["unit"] == "us":
        return "%s (%s)" % (fmt_num(m["p50"]), fmt_num(m["p99"]))
    r = m.get("ratio")
    return fmt_num(m["p50"]) + (" (%.3gx)" % r if r and m.get("ref") not in (None, "", key) else "")


def load(paths):
    docs, notes = {}, []
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            notes.append("%s: not read (%s)" % (p, e))
            continue
        for doc in d if isinstance(d, list) else [d]:
            docs[doc.get("tool", p)] = doc
    return docs, notes


def ratio(a, b):
    if a is None or b is None or not b["p50"]:
        return None
    return a["p50"] / b["p50"]


def table(docs):
    """Returns (header, rows, footnotes): rows are lists of strings."""
    header = ["metric"] + [name for _, name in TOOLS] + ["HW ref GB/s", "Go/C", "PyTorch/Go", "CuPy/Go"]
    go = docs.get("cudaipc-go", {}).get("metrics", {})
    rows, foot = [], []
    for key, label in ROWS:
        ms = [docs.get(t, {}).get("metrics", {}).get(key) for t, _ in TOOLS]
        if all(m is None for m in ms):
            continue
        unit = next(m["unit"] for m in ms if m is not None)
        label = "%s [%s]" % (label, "µs p50 (p99)" if unit == "us" else "GB/s (x ref)")
        ref = "-"
        if unit == "GB/s":  # the first tool's in-process reference for this row
            for (t, _), m in zip(TOOLS, ms):
                r = m and docs[t]["metrics"].get(m.get("ref", ""))
                if r:
                    ref = fmt_num(r["p50"])
                    break
        g = go.get(COUNTERPART.get(key, key))
        mark = "*" if key in COUNTERPART else ""
        row = [label] + [cell(key, m) for m in ms] + [ref, fmt_ratio(ratio(ms[0], ms[1]))]
        row += [fmt_ratio(ratio(ms[2], g)) + (mark if ratio(ms[2], g) else ""), fmt_ratio(ratio(ms[3], g))]
        rows.append(row)
    if any(k in COUNTERPART for k, _ in ROWS if any(k in d.get("metrics", {}) for d in docs.values())):
        foot.append("* PyTorch's per-tensor time (pickling, queue, open, event wait) over the Go row: " +
                    ", ".join("%s vs %s" % kv for kv in COUNTERPART.items()))
    for t, name in TOOLS:
        d = docs.get(t)
        if d is None:
            foot.append("%s: no result" % name)
            continue
        if d.get("staging"):
            foot.append("%s host_staged: %s" % (name, d["staging"]))
        for n in d.get("notes", []):
            foot.append("%s: %s" % (name, n))
    return header, rows, foot


def render(docs, markdown=False):
    header, rows, foot = table(docs)
    first = next(iter(docs.values()), {})
    title = "IPC benchmark: %s, %s GPU(s), large = %s bytes" % (first.get("device", "?"), first.get("gpus", "?"), first.get("size", "?"))
    out = [title, ""]
    if markdown:
        out.append("| " + " | ".join(header) + " |")
        out.append("| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |")
        out += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        w = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        def line(r):
            return "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)).rstrip()

        out.append(line(header))
        out += [line(r) for r in rows]
    out.append("")
    out += [("- " if markdown else "") + f for f in foot]
    return "\n".join(out) + "\n"


SAMPLE = [
    {"tool": "cudaipc-go", "device": "NVIDIA H200", "gpus": 2, "size": 1073741824, "iters": 200, "bw_iters": 20,
     "staging": "via a memfd", "metrics": {
         "open_cold_1mib": {"unit": "us", "p50": 44, "p99": 90, "n": 200},
         "open_cold_large": {"unit": "us", "p50": 480, "p99": 600, "n": 200},
         "d2d_local": {"unit": "GB/s", "p50": 2130, "p99": 2100, "n": 20, "ratio": 1, "ref": "d2d_local"},
         "ipc_read": {"unit": "GB/s", "p50": 2120, "p99": 2100, "n": 20, "ratio": 0.995, "ref": "d2d_local"}}},
    {"tool": "c-driver-api", "device": "NVIDIA H200", "gpus": 2, "size": 1073741824, "iters": 200, "metrics": {
        "open_cold_1mib": {"unit": "us", "p50": 40, "p99": 80, "n": 200}}},
    {"tool": "pytorch", "metrics": {
        "share_1mib": {"unit": "us", "p50": 880, "p99": 1500, "n": 200},
        "ipc_read": {"unit": "GB/s", "p50": 2000, "p99": 1900, "n": 20, "ratio": 0.95, "ref": "d2d_local"},
        "d2d_local": {"unit": "GB/s", "p50": 2105, "p99": 2000, "n": 20, "ratio": 1, "ref": "d2d_local"}},
     "notes": ["torch 2.11"]},
]


def selftest():
    docs = {d["tool"]: d for d in json.loads(json.dumps(SAMPLE))}
    text = render(docs)
    lines = text.splitlines()
    assert lines[0] == "IPC benchmark: NVIDIA H200, 2 GPU(s), large = 1073741824 bytes", lines[0]
    row = next(l for l in lines if l.startswith("open, 1 MiB"))
    assert "44.0 (90.0)" in row and "40.0 (80.0)" in row and "1.1x" in row, row
    row = next(l for l in lines if l.startswith("send->usable, 1 MiB "))
    assert "880 (1500)" in row and "20x*" in row, row
    row = next(l for l in lines if l.startswith("copy via IPC mapping"))
    assert "2120 (0.995x)" in row and "2000 (0.95x)" in row and "2130" in row and "0.943x" in row, row
    row = next(l for l in lines if l.startswith("copy in-process"))
    assert "(1x)" not in row, row
    assert not any(l.startswith("IPC event open") for l in lines), "printed an unmeasured row"
    assert "CuPy: no result" in text and "cudaipc (Go) host_staged: via a memfd" in text and "PyTorch: torch 2.11" in text
    md = render(docs, markdown=True)
    assert "| metric | cudaipc (Go) | C driver API | PyTorch | CuPy |" in md, md
    print("compare.py selftest ok")


def main(argv):
    if argv[:1] == ["--selftest"]:
        selftest()
        return 0
    markdown = argv[:1] == ["--markdown"]
    paths = argv[1:] if markdown else argv
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    docs, notes = load(paths)
    sys.stdout.write(render(docs, markdown))
    for n in notes:
        print(("- " if markdown else "") + n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
