#!/usr/bin/python3
"""Draws the plots of docs/benchmarks.md from the figures in docs/bench-data/.

  /usr/bin/python3 scripts/bench/plots.py [--data docs/bench-data] [--out docs/img]

Needs matplotlib (Debian: apt-get install python3-matplotlib; run it with the
system's python3). Each JSON file holds the current figures of one workload, in
the form its benchmark's --json output gives (docs/benchmarks.md says which);
update the file from a new run, run this script and commit both. The SVGs carry
no date and a fixed id salt, so a figure that did not change gives the same file.
"""
import argparse
import json
import os
import sys

try:
    import matplotlib
    matplotlib.use("svg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plots.py needs matplotlib: apt-get install python3-matplotlib, then run it with /usr/bin/python3")

plt.rcParams.update({
    "svg.hashsalt": "cudaipc",   # stable element ids
    "svg.fonttype": "none",      # text stays text: smaller, diffable files
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
})

CUDAIPC, OTHER, FLOOR = "#1f77b4", "#bbbbbb", "#2ca02c"


def load(data, name):
    with open(os.path.join(data, name)) as f:
        return json.load(f)


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    print("wrote", path)


def num(v):
    """A figure as the tables print it: whole numbers from 100 up, else 3 digits."""
    return "{:,.0f}".format(v) if v >= 100 else "%.3g" % v


def hbars(ax, labels, values, colors, unit):
    ys = range(len(labels))
    ax.barh(ys, values, color=colors)
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    for y, v in zip(ys, values):
        ax.text(v, y, " %s %s" % (num(v), unit), va="center")


def ipc(data, out):
    docs = {d["tool"]: d["metrics"] for d in load(data, "ipc.json")}
    go, torch = docs["cudaipc-go"], docs["pytorch"]
    rows = [("copy in one process (hardware)", go["d2d_local"]["p50"], FLOOR),
            ("cudaipc: copy through an imported mapping", go["ipc_read"]["p50"], CUDAIPC),
            ("PyTorch: copy through its IPC mapping", torch["ipc_read"]["p50"], OTHER),
            ("host-staged, the two DMA copies alone", go["host_staged_dma"]["p50"], OTHER),
            ("host-staged through a memfd, end to end", go["host_staged"]["p50"], OTHER),
            ("PyTorch: .cpu(), queue, .to('cuda')", torch["host_staged"]["p50"], OTHER)]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    hbars(ax, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], "GB/s")
    ax.set_xscale("log")
    ax.set_xlim(0.3, 60000)
    ax.set_xlabel("GB/s, 1 GiB between two processes on one H200 (log scale)")
    save(fig, out, "ipc-bandwidth.svg")

    keys = [("open_cold_1mib", "open 1 MiB"), ("close_1mib", "close 1 MiB"), ("open_cold_large", "open 1 GiB"),
            ("close_large", "close 1 GiB"), ("open_already_open", "open again"), ("event_open", "event open")]
    tools = [("cudaipc-go", "cudaipc (Go)", CUDAIPC), ("c-driver-api", "C driver API", FLOOR), ("cupy", "CuPy", OTHER)]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    w = 0.27
    for i, (t, name, color) in enumerate(tools):
        ax.bar([k + (i - 1) * w for k in range(len(keys))], [docs[t][k]["p50"] for k, _ in keys], w, label=name, color=color)
    ax.set_xticks(range(len(keys)), [label for _, label in keys])
    ax.set_yscale("log")
    ax.set_ylabel("µs, p50 (log scale)")
    ax.legend(frameon=False)
    save(fig, out, "ipc-latency.svg")


def store(data, out):
    d = load(data, "store-roundtrip.json")
    labels = ["%s, %s" % ("host object" if r["device"] == "host" else "GPU object",
                          "polling" if r["polling"] else "no polling") for r in d["runs"]]
    series = [("one round trip", "round_trip", CUDAIPC), ("get + release through the socket", "socket", OTHER),
              ("get + release, lease fast path", "fast", FLOOR)]
    fig, ax = plt.subplots(figsize=(8, 2.8))
    w = 0.27
    for i, (name, key, color) in enumerate(series):
        vs = [r[key]["p50_us"] for r in d["runs"]]
        xs = [k + (i - 1) * w for k in range(len(vs))]
        ax.bar(xs, vs, w, label=name, color=color)
        for x, v in zip(xs, vs):
            ax.text(x, v, "%.3g" % v, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), [label.replace(", ", ",\n") for label in labels])
    ax.set_yscale("log")
    ax.set_ylim(0.3, 200)
    ax.set_ylabel("µs, p50 (log scale)")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    save(fig, out, "store-roundtrip.svg")


def weight_sync(data, out):
    d = load(data, "weight-sync.json")
    names = {"floor": "floor: copies in one process", "floor-flat": "floor: one flat copy",
             "cudaipc-nocopy": "cudaipc, no copy", "cudaipc": "cudaipc, in place", "cudaipc-put": "cudaipc put_bundle",
             "bucketed": "bucketed IPC buffer", "per-tensor": "PyTorch per tensor"}
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, (model, title) in zip(axes, [("dense", "Llama-3-8B shapes, 16.06 GB"), ("moe", "MoE, 18,867 tensors, 3.82 GB")]):
        rs = [r for r in d["results"] if r["model"] == model and not r.get("producer_gpu")]
        colors = [FLOOR if r["path"].startswith("floor") else CUDAIPC if r["path"].startswith("cudaipc") else OTHER for r in rs]
        hbars(ax, [names[r["path"]] for r in rs], [r["median_s"] * 1e3 for r in rs], colors, "ms")
        ax.set_xscale("log")
        ax.set_xlim(right=max(r["median_s"] for r in rs) * 1e3 * 20)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms a version, publish → loaded (log scale)")
    axes[1].set_yticks(axes[1].get_yticks(), [])
    save(fig, out, "weight-sync.svg")


def cross_node(data, out):
    d = load(data, "weight-sync-cross-node.json")
    calls = sorted({r["call"] for r in d["results"]})
    fig, ax = plt.subplots(figsize=(7, 2.8))
    for i, c in enumerate(calls):
        rs = [r for r in d["results"] if r["call"] == c]
        floor = next(r["link_floor_GBps"] for r in rs if "link_floor_GBps" in r)
        ax.hlines(floor, i - 0.4, i + 0.4, color=FLOOR, label="raw UCX link floor" if i == 0 else None)
        defaults = [r["gbps"] for r in rs if r["path"] == "cudaipc-cluster" and not r.get("flags")]
        lanes = [r["gbps"] for r in rs if r.get("flags")]
        gloo = [r["gbps"] for r in rs if r["path"] == "torch-gloo"]
        ax.plot([i - 0.12] * len(defaults), defaults, "o", color=CUDAIPC, label="cudaipc, defaults (8 lanes)" if i == 0 else None)
        if lanes:
            ax.plot([i + 0.12] * len(lanes), lanes, "s", color=CUDAIPC, mfc="none",
                    label="cudaipc, --experimental-cluster-lanes 16" if i == 0 else None)
        ax.plot([i] * len(gloo), gloo, "x", color="#d62728", label="torch.distributed, gloo" if i == 0 else None)
    ax.set_xticks(range(len(calls)), ["device call %s" % c for c in calls])
    ax.set_ylim(0, 25)
    ax.set_ylabel("GB/s, 16.06 GB a version")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    save(fig, out, "cross-node-sync.svg")


def python_client(data, out):
    d = load(data, "python-client.json")
    modes = [r["gpu_share"] for r in d["runs"]]
    series = [("Python put", lambda r: r["put"]["ratio_put_to_copy"], OTHER),
              ("Python put(reserve_next=True)", lambda r: r["put"]["ratio_put_reserve_next_to_copy"], CUDAIPC),
              ("Go put", lambda r: r["go_put"]["ratio_put_to_copy"], FLOOR)]
    fig, ax = plt.subplots(figsize=(6, 2.4))
    w = 0.27
    for i, (name, f, color) in enumerate(series):
        vs = [f(r) for r in d["runs"]]
        xs = [k + (i - 1) * w for k in range(len(vs))]
        ax.bar(xs, vs, w, label=name, color=color)
        for x, v in zip(xs, vs):
            ax.text(x, v, "%.2f×" % v, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(modes)), ["--gpu-share %s" % m for m in modes])
    ax.set_ylim(0, 1.1)
    ax.axhline(1.0, color=FLOOR, lw=0.8, ls="--")
    ax.set_ylabel("× the in-process copy")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    save(fig, out, "put.svg")


def kv_transfer(data, out):
    """ms a request: one node's read beside its floor and the per-block loop, and the
    read across two daemons: the first run of each part in kv-transfer.json."""
    d = load(data, "kv-transfer.json")
    one = next(r for r in d["runs"] if "one_node" in r)
    cross = next((r for r in d["runs"] if "requests" in r.get("cross_node", {})), None)
    reqs = one["one_node"]["requests"]
    tokens = [r["tokens"] for r in reqs]
    series = [("floor: the copies in one process", [r["floor"]["p50_ms"] for r in reqs], FLOOR, None),
              ("cudaipc.kv read, one node", [r["read"]["p50_ms"] for r in reqs], CUDAIPC, None),
              ("a copy per block", [r["loop"]["p50_ms"] for r in reqs], OTHER, None)]
    if cross:
        by = {r["tokens"]: r["read"]["p50_ms"] for r in cross["cross_node"]["requests"]}
        series.append(("cudaipc.kv read, across two daemons", [by.get(t, 0) for t in tokens], "white", CUDAIPC))
    fig, ax = plt.subplots(figsize=(7.5, 2.8))
    w = 0.8 / len(series)
    for i, (name, vs, color, edge) in enumerate(series):
        xs = [k + (i - (len(series) - 1) / 2) * w for k in range(len(vs))]
        ax.bar([x for x, v in zip(xs, vs) if v], [v for v in vs if v], w, label=name, color=color,
               edgecolor=edge or color, hatch="//" if edge else None)
        for x, v in zip(xs, vs):
            if v:
                ax.text(x, v, num(v), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(tokens)), ["%s tokens\n%s MiB" % ("{:,}".format(t), num(r["bytes"] / (1 << 20)))
                                       for t, r in zip(tokens, reqs)])
    ax.set_yscale("log")
    ax.set_ylabel("ms a request, p50 (log scale)")
    ax.set_title("Llama-3-8B KV blocks, %s memory" % one["device"], fontsize=9)
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    save(fig, out, "kv-transfer.svg")


def kv_pool(data, out):
    """Left: µs a lookup of 10^4 keys (p50, p99 as a tick), prefix and per key.
    Right: ms a put and a get of a prefix beside the memcpy floor and Redis's MSET
    and MGET of the same blocks. From kv-pool.json."""
    d = load(data, "kv-pool.json")
    lk = d["lookup"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 2.9), gridspec_kw={"width_ratios": [1, 2.2]})
    cases = ["hit", "half", "miss"]
    w = 0.38
    for i, (suffix, name, color) in enumerate([("", "lookup (prefix)", CUDAIPC), ("_per_key", "present (per key)", OTHER)]):
        xs = [k + (i - 0.5) * w for k in range(len(cases))]
        p50 = [lk[c + suffix]["p50_us"] for c in cases]
        p99 = [lk[c + suffix]["p99_us"] for c in cases]
        ax.bar(xs, p50, w, label=name, color=color)
        ax.plot(xs, p99, "_", color="black", ms=8, label="p99" if i == 0 else None)
        for x, v in zip(xs, p50):
            ax.text(x, v, num(v), ha="center", va="bottom", fontsize=6)
    ax.axhline(1000, color=FLOOR, lw=0.8, ls="--", label="1 ms")
    ax.set_xticks(range(len(cases)), ["all present", "half", "none"])
    ax.set_ylabel("µs a lookup of %s keys, p50" % "{:,}".format(lk["keys"]))
    ax.legend(frameon=False, fontsize=7)
    sizes = d["sizes"]
    series = [("memcpy floor, same bytes", "memcpy", FLOOR, None), ("pool put", "put", CUDAIPC, None),
              ("pool get", "get", CUDAIPC, "white"), ("Redis MSET", "mset", OTHER, None), ("Redis MGET", "mget", OTHER, "white")]
    w = 0.8 / len(series)
    for i, (name, op, color, face) in enumerate(series):
        xs = [k + (i - (len(series) - 1) / 2) * w for k in range(len(sizes))]
        vs = [s[op]["p50_ms"] if op in s else 0 for s in sizes]
        bx.bar([x for x, v in zip(xs, vs) if v], [v for v in vs if v], w, label=name,
               color=face or color, edgecolor=color, hatch="//" if face else None)
        for x, v in zip(xs, vs):
            if v:
                bx.text(x, v, num(v), ha="center", va="bottom", fontsize=6)
    bx.set_xticks(range(len(sizes)), ["%s tokens\n%s MiB" % ("{:,}".format(s["tokens"]), num(s["bytes"] / (1 << 20))) for s in sizes])
    bx.set_yscale("log")
    bx.set_ylabel("ms a prefix, p50 (log scale)")
    bx.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.suptitle("KV block pool, host tier, Llama-3-8B blocks of 16 tokens (2 MiB)", fontsize=9)
    save(fig, out, "kv-pool.svg")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    ap.add_argument("--data", default=os.path.join(root, "docs", "bench-data"))
    ap.add_argument("--out", default=os.path.join(root, "docs", "img"))
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for f in (ipc, store, weight_sync, cross_node, python_client, kv_transfer, kv_pool):
        f(a.data, a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
