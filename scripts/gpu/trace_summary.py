"""What a torch profiler trace says the GPU did: how long it was busy, on what (kernel families, the top kernels,
host<->device copies with their bytes) and under which annotated ranges. Reads the Chrome trace JSON (.json or
.json.gz) that `torch.profiler.profile.export_chrome_trace` writes, as verl's torch profiler does
(global_profiler.tool=torch).

    python scripts/gpu/trace_summary.py TRACE [TRACE ...] [--top 15] [--out summary.json]

busy_s is the union of the GPU's kernel, copy and memset intervals over all its streams; span_s runs from the first
to the last of them: busy / span is how much of the window the GPU worked. `idle` says where the rest went: for each
gap, the host launch of the work that ended it (matched by the trace's correlation ids). Launched after the GPU ran
dry, the gap is the host's ("host late"), charged to the annotated range (record_function) and the top-level
operator the launch happened in; launched before, the work waited on something else ("queued": another stream, an
event, a copy). For the largest gaps, `host` says what the launching thread ran between the GPU running dry and the
launch: its top-level operators' seconds within that window, and what no operator covers ("(no operator)": Python,
or work the profiler does not record).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, cudaMemcpyAsync; Triton's cuLaunchKernel
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


def _outermost(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The intervals (start, end, name) no other holds, in order: intervals nested or disjoint, as a thread's
    operators are."""
    outer, end = [], float("-inf")
    for a, b, name in sorted(intervals, key=lambda x: (x[0], -x[1])):
        if a >= end:
            outer.append((a, b, name))
            end = b
    return outer


def _enclosing(outer: list[tuple[float, float, str]]):
    """A lookup of the outermost interval (start, end, name) that holds a time; `outer` from _outermost."""
    starts = [a for a, _, _ in outer]

    def at(t: float) -> str | None:
        i = bisect.bisect_right(starts, t) - 1
        return outer[i][2] if i >= 0 and outer[i][1] >= t else None
    return at


def _innermost(intervals: list[tuple[float, float, str]]):
    """A lookup of the innermost interval that holds a time (the latest-starting one that still covers it)."""
    ordered = sorted(intervals)
    starts = [a for a, _, _ in ordered]

    def at(t: float) -> str | None:
        for i in range(bisect.bisect_right(starts, t) - 1, -1, -1):
            if ordered[i][1] >= t:
                return ordered[i][2]
        return None
    return at


def _during(outer: list[tuple[float, float, str]], a: float, b: float, top: int = 4) -> dict:
    """Seconds of each top-level operator (`outer`, from _outermost) within the window (a, b), the most first, and
    the window's rest as "(no operator)"."""
    i = max(bisect.bisect_right([x[0] for x in outer], a) - 1, 0)
    spent = defaultdict(float)
    for start, end, name in outer[i:]:
        if start >= b:
            break
        if min(end, b) > max(start, a):
            spent[name] += (min(end, b) - max(start, a)) / 1e6
    rest = (b - a) / 1e6 - sum(spent.values())
    shown = dict(sorted(spent.items(), key=lambda kv: -kv[1])[:top])
    return shown | ({"(no operator)": rest} if rest > 0 else {})


def idle(events: list[dict], gpu: list[dict], top: int = 15) -> dict:
    """Where the GPU's idle time between its first and last event went (see the module's docstring)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in gpu)
    launches = {(e.get("args") or {}).get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES}
    by_thread = defaultdict(lambda: ([], []))
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in ("cpu_op", "user_annotation"):
            ops, ranges = by_thread[(e.get("pid"), e.get("tid"))]
            (ops if e["cat"] == "cpu_op" else ranges).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                                                              e["name"]))
    outer = {k: _outermost(ops) for k, (ops, _) in by_thread.items()}
    lookups = {k: (_enclosing(outer[k]), _innermost(ranges)) for k, (_, ranges) in by_thread.items()}
    host_late = queued = unmatched = 0.0
    charged, largest = defaultdict(lambda: [0.0, 0]), []
    end, previous = spans[0][1], spans[0][2]
    for a, b, e in spans[1:]:
        if a > end:
            gap, host = (a - end) / 1e6, None
            launch = launches.get((e.get("args") or {}).get("correlation"))
            if launch is None:
                unmatched += gap
                where = ("(launch not in the trace)", None)
            elif float(launch["ts"]) + float(launch.get("dur", 0)) <= end:
                queued += gap
                where = ("(queued)", None)
            else:
                host_late += gap
                op_at, range_at = lookups.get((launch.get("pid"), launch.get("tid")), (lambda t: None,) * 2)
                t = float(launch["ts"])
                where = (range_at(t) or "(no range)", op_at(t))
                host = (outer.get((launch.get("pid"), launch.get("tid")), []), end, t)
            row = charged[where]
            row[0] += gap
            row[1] += 1
            largest.append((gap, where, previous["name"], e["name"], host))
        if b > end:
            end, previous = b, e
    largest.sort(key=lambda x: -x[0])
    return {"host_late_s": host_late, "queued_s": queued, "unmatched_s": unmatched,
            "by_range": [{"range": r, "op": op, "s": s, "gaps": n}
                         for (r, op), (s, n) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]],
            "largest": [{"s": s, "range": r, "op": op, "after": before[:120], "before": after[:120],
                         **({"host": _during(*host)} if host else {})}
                        for s, (r, op), before, after, host in largest[:top]]}


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
        "annotations": {k: {"s": s, "calls": n} for k, (s, n) in ordered(ranges, top)},
        "idle": idle(events, gpu, top)}


def markdown(s: dict, title: str) -> str:
    if not s.get("gpu_events"):
        return f"{title}: no GPU events in the trace\n"
    lines = [(f"{title}: GPU busy {s['busy_s']:.3f} s of a {s['span_s']:.3f} s window "
              f"({100 * s['busy_fraction']:.0f} %); {s['kernels']:,} kernels, {s['kernel_s']:.3f} s"), "",
             "| kernel family | s | share | calls |", "| --- | --- | --- | --- |"]
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
    gaps = s["idle"]
    lines += ["", (f"GPU idle within the window: host late {gaps['host_late_s']:.3f} s, "
              f"queued {gaps['queued_s']:.3f} s, launch not in the trace {gaps['unmatched_s']:.3f} s"),
              "", "| idle, launched in (range / top-level operator) | s | gaps |", "| --- | --- | --- |"]
    lines += [f"| {g['range']} / {g['op']} | {g['s']:.4f} | {g['gaps']:,} |" for g in gaps["by_range"]]
    lines += ["", "| largest gaps, ms | launched in (range / operator) | the launching thread in the gap, ms |",
              "| --- | --- | --- |"]
    lines += [f"| {1e3 * g['s']:.2f} | {g['range']} / {g['op']} | "
              + (", ".join(f"{k} {1e3 * v:.2f}" for k, v in g["host"].items()) if "host" in g else "–") + " |"
              for g in gaps["largest"][:5]]
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
