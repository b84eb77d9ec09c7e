"""What a torch profiler trace says the GPU did: how long it was busy, on what (kernel families, the top kernels,
host<->device copies with their bytes) and under which annotated ranges. Reads the Chrome trace JSON (.json or
.json.gz) that `torch.profiler.profile.export_chrome_trace` writes, as verl's torch profiler does
(global_profiler.tool=torch).

    python scripts/gpu/trace_summary.py TRACE [TRACE ...] [--top 15] [--out summary.json]

busy_s is the union of the GPU's kernel, copy and memset intervals over all its streams; span_s runs from the first
to the last of them: busy / span is how much of the window the GPU worked, the rest it waited on the host.
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# a kernel's family by the first of these its lower-cased name contains (order matters: a fused Triton softmax is
# "triton", a NCCL copy kernel is "nccl")
FAMILIES = (
    ("nccl (communication)", ("nccl",)),
    ("triton (fused)", ("triton",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matrix products", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor")),
    ("reductions, softmax, norms", ("reduce", "softmax", "norm")),
    ("copies and casts", ("copy", "cast", "cat_", "index")),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "pointwise")),
)


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(events: list[dict], top: int = 15) -> dict:
    """Seconds throughout (the trace's timestamps are microseconds)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "dur" in e]
    out: dict = {"gpu_events": len(gpu), "devices": sorted({str(e.get("pid")) for e in gpu})}
    if not gpu:
        return out | {"busy_s": 0.0, "span_s": 0.0, "busy_fraction": None}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    busy = union(spans) / 1e6
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    kernel_s = sum(e["dur"] for e in kernels) / 1e6
    by_family, by_name = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for e in kernels:
        for table, key in ((by_family, family(e["name"])), (by_name, e["name"])):
            table[key][0] += e["dur"] / 1e6
            table[key][1] += 1
    copies = defaultdict(lambda: [0.0, 0, 0.0])
    for e in gpu:
        if e["cat"] == "gpu_memcpy":
            kind = next((k for k in ("HtoD", "DtoH", "DtoD", "PtoP") if k in e["name"]), e["name"])
            row = copies[kind]
            row[0] += e["dur"] / 1e6
            row[1] += 1
            row[2] += float((e.get("args") or {}).get("bytes", 0)) / 1e9
    ranges = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation" and "dur" in e:
            ranges[e["name"]][0] += e["dur"] / 1e6
            ranges[e["name"]][1] += 1
    share = lambda s: s / kernel_s if kernel_s else None
    ordered = lambda table, n=None: sorted(table.items(), key=lambda kv: -kv[1][0])[:n]
    return out | {
        "span_s": (end - start) / 1e6, "busy_s": busy,
        "busy_fraction": busy / ((end - start) / 1e6) if end > start else None,
        "kernel_s": kernel_s, "kernels": len(kernels),
        "families": {k: {"s": s, "calls": n, "share": share(s)} for k, (s, n) in ordered(by_family)},
        "top_kernels": [{"name": k[:160], "s": s, "calls": n, "share": share(s)}
                        for k, (s, n) in ordered(by_name, top)],
        "copies": {k: {"s": s, "calls": n, "GB": gb} for k, (s, n, gb) in sorted(copies.items())},
        "annotations": {k: {"s": s, "calls": n} for k, (s, n) in ordered(ranges, top)}}


def markdown(s: dict, title: str) -> str:
    if not s.get("gpu_events"):
        return f"{title}: no GPU events in the trace\n"
    lines = [(f"{title}: GPU busy {s['busy_s']:.3f} s of a {s['span_s']:.3f} s window "
              f"({100 * s['busy_fraction']:.0f} %); {s['kernels']:,} kernels, {s['kernel_s']:.3f} s"), "", "| kernel family | s | share | calls |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {v['s']:.3f} | {100 * v['share']:.1f} % | {v['calls']:,} |" for k, v in s["families"].items()]
    if s["copies"]:
        lines += ["", "| copy | s | GB | calls |", "| --- | --- | --- | --- |"]
        lines += [f"| {k} | {v['s']:.3f} | {v['GB']:.2f} | {v['calls']:,} |" for k, v in s["copies"].items()]
    lines += ["", "| kernel | s | share | calls |", "| --- | --- | --- | --- |"]
    lines += [f"| {k['name'][:90]} | {k['s']:.3f} | {100 * k['share']:.1f} % | {k['calls']:,} |"
              for k in s["top_kernels"]]
    if s["annotations"]:
        lines += ["", "| annotated range (GPU time) | s | calls |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['s']:.3f} | {v['calls']:,} |" for k, v in s["annotations"].items()]
    return "\n".join(lines) + "\n"


def summarize_files(paths: list[Path], top: int = 15) -> list[dict]:
    return [dict(trace=p.name, **summarize(load(p), top)) for p in paths]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", type=Path, nargs="+")
    ap.add_argument("--top", type=int, default=15, help="kernels and annotated ranges listed (default 15)")
    ap.add_argument("--out", type=Path, help="write the summaries as JSON here")
    a = ap.parse_args(argv)
    summaries = summarize_files(a.traces, a.top)
    for s in summaries:
        print(markdown(s, s["trace"]))
    if a.out:
        a.out.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
