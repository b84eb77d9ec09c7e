"""One GPU at engine speed: the embedded backend's rollout engines and its update, measured on one card.

    python scripts/gpu/bench_backends.py models DIR                              # random text-0.5B and VL shapes
    python scripts/bench_gpu.py engine --engine transformers --shape text --model DIR/text --out F.json
    python scripts/bench_gpu.py engine --engine vllm --shape text --model DIR/text --out F.json   # + plain LLM.generate
    python scripts/bench_gpu.py engine --engine transformers --shape vl --model DIR/vl --source G3K --prompts 16 --out F.json
    python scripts/bench_gpu.py update --model DIR/text --out F.json             # 16 x 1,024 tokens
    python scripts/bench_gpu.py update --shape vl3b --model DIR/vl3b --source G3K --out F.json   # 4 prompts x 5
    python scripts/bench_gpu.py report F.json ... [bound.json ...]              # the table, ratios in the same run
    python scripts/bench_gpu.py summary F.json --baseline B.json                # one update row as JSON, its ratio

`engine`: the backend's own `engine.sample` (what `bapo train` calls; no behaviour scoring) on the shape's prompts x 8
at temperature 1 until EOS or the response budget: tokens/s, ms per decode step (the wall time over the decode steps
the engine ran: for `model.generate` the sum over its chunks of each chunk's longest response; for vLLM, which
batches continuously, the longest response), peak allocated and reserved memory. With `--engine vllm` the same
prompts also go through the engine's `LLM.generate` directly (plain vLLM, our integration's cost is the gap). With
`--engine transformers` on a text shape, the same engine with transformers' own SDPA (`transformers-sdpa`: the path
before `bapo_vl/backends/gqa_decode.py`, the ratios' baseline) and transformers' continuous batching
(`generate_batch`) are measured too.
`score`: behaviour scoring (`backend.score`, the no-grad forward over sampled responses that `generate` runs after the
engine) of prompts x 8 random responses at each `score_batch_size`, against the update's micro_batch_size.
`update`: `backend.update` on 2 groups x 8 sequences of 64 prompt + 960 response tokens (a VL shape: `--prompts`
Geometry3K prompts with their diagrams x the shape's group of responses at its response cap, the shape's micro-batches
and pixels, one optimizer step), after one warm-up: tokens/s, MFU (6 N T over the body, 6 V h over the response
tokens for the LM head, causal attention FLOPs, over the card's dense bf16 peak; a VL model's vision tower counted over
the patches it encodes in the update's forwards, its attention not: a micro-batch encodes each distinct prompt's
images once), EasyR1's count of it (the language model only), peak allocated / reserved memory; with
`--profile`, torch.profiler's top operators of one more update and its device time by part (the vision tower's and the
language model's forward and backward, the optimizer step, the rest: what bounds the MFU) and, on a GPU, its timeline
(scripts/gpu/trace_summary.py: where the device waited, by the range and operator the host was in);
`--set compile=true` compiles the policy's repeated blocks and its LM head's chunks (the backend's setting: fused
element-wise kernels); with `--sync-debug`, one more update under torch.cuda.set_sync_debug_mode("warn"): how many
calls made the host wait for the GPU, and from which lines (CUDA only: on CPU it says so and records nothing).
Each call is one process (engines never share a process); `report` prints ratios only between rows of one card.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from bench_backends import SHAPES, _write, card, card_model, provenance  # noqa: E402

from bapo_vl.perf import actor_mfu, peak_flops  # noqa: E402



def _config(shape: str, model: Path, engine: str, source: str | None, extra: list[str]):
    from bapo_vl.config import load_config

    spec = SHAPES[shape]
    fields = dict(spec["bapo"], model=str(model), rollout_engine=engine)
    if source:
        fields["task_options"] = {"source": source}
    fields.update(item.split("=", 1) for item in extra)
    return load_config(spec["preset"], None, [f"{k}={json.dumps(v) if isinstance(v, dict) else v}"
                                              for k, v in fields.items()])


def _memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return dict(peak_allocated_GB=torch.cuda.max_memory_allocated() / 1e9,
                peak_reserved_GB=torch.cuda.max_memory_reserved() / 1e9)


def _reset():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_steps(tokens: list[list[int]], chunk: int | None) -> int:
    """Decode steps an engine ran for these responses: chunked static batches run to each chunk's longest row;
    continuous batching (chunk None) to the longest row overall."""
    if chunk is None:
        return max(map(len, tokens))
    return sum(max(map(len, tokens[i:i + chunk])) for i in range(0, len(tokens), chunk))


def measure(name: str, fn, chunk: int | None) -> dict:
    _reset()
    t0 = time.perf_counter()
    tokens = fn()
    _sync()
    wall = time.perf_counter() - t0
    n = sum(map(len, tokens))
    steps = decode_steps(tokens, chunk)
    return dict(path=name, seconds=wall, sequences=len(tokens), tokens=n, mean_length=n / len(tokens),
                longest=max(map(len, tokens)), tokens_per_s=n / wall, decode_steps=steps,
                ms_per_decode_step=1e3 * wall / steps, **_memory())


def engine_bench(a) -> dict:
    from bapo_vl.backends import gqa_decode
    from bapo_vl.train import load_problems, make_backend

    cfg = _config(a.shape, a.model, a.engine, a.source, a.set)
    t0 = time.perf_counter()
    backend = make_backend(cfg)
    start_s = time.perf_counter() - t0
    _, problems = load_problems(cfg.run)
    G = cfg.sampling.group_size
    encoded = [backend.encode(p) for p in problems[:max(a.prompts)]]
    engine = backend.engine
    engine.sample(encoded[:4], 2, "rollout", False)  # warm-up: kernels, CUDA graphs, caches
    chunk = None if engine.name == "vllm" else cfg.embedded.generate_batch_size
    rows = []
    for n in a.prompts:
        prompts = encoded[:n]
        _cold(engine)
        rows.append(dict(prompts=n, G=G, **measure(engine.name, lambda: engine.sample(prompts, G, "rollout", False),
                                                   chunk)))
        if engine.name == "vllm":
            _cold(engine)
            rows.append(dict(prompts=n, G=G, **measure("vllm-plain", lambda: plain_vllm(engine, prompts, G), None)))
        elif backend.rollout.config._attn_implementation == gqa_decode.NAME:  # the same with transformers' SDPA
            backend.rollout.set_attn_implementation("sdpa")
            rows.append(dict(prompts=n, G=G, **measure("transformers-sdpa",
                                                       lambda: engine.sample(prompts, G, "rollout", False), chunk)))
            backend.rollout.set_attn_implementation(gqa_decode.NAME)
        if engine.name == "transformers" and not backend.is_vl and a.probe_cb:
            rows.append(dict(prompts=n, G=G, **probe_continuous_batching(backend, prompts, G)))
    return dict(kind="engine", shape=a.shape, engine=engine.name, card=card(), model=str(a.model), overrides=a.set,
                engine_start_s=start_s, max_response_length=cfg.sampling.max_response_length, rows=rows)


def score_bench(a) -> dict:
    """Behaviour scoring (the trainer's no-grad forward over sampled responses) of prompts x G responses at each
    score_batch_size, against the update's micro_batch_size (how it was scored before score_batch_size)."""
    import torch

    from bapo_vl.train import load_problems, make_backend

    cfg = _config(a.shape, a.model, "transformers", a.source, a.set)
    backend = make_backend(cfg)
    _, problems = load_problems(cfg.run)
    G, n, R = cfg.sampling.group_size, a.prompts, cfg.sampling.max_response_length
    prompts = [p for p in (backend.encode(q) for q in problems[:n]) for _ in range(G)]
    gen = torch.Generator().manual_seed(0)
    vocab = backend.tokenizer.vocab_size  # ordinary tokens: no image placeholder in a response
    lengths = torch.randint(R // 2, R + 1, (len(prompts),), generator=gen)
    responses = [torch.randint(3, vocab, (int(k),), generator=gen).tolist() for k in lengths]
    rows = []
    for size in dict.fromkeys([cfg.embedded.micro_batch_size, *a.batch]):
        backend.options = dataclasses.replace(cfg.embedded, score_batch_size=size)
        backend.score(backend.rollout, prompts[:size], responses[:size])  # warm-up
        _reset()
        t0 = time.perf_counter()
        backend.score(backend.rollout, prompts, responses)
        _sync()
        rows.append(dict(score_batch_size=size, seconds=time.perf_counter() - t0, **_memory()))
    return dict(kind="score", shape=a.shape, card=card(), model=str(a.model), overrides=a.set, sequences=len(prompts),
                tokens=int(lengths.sum()), micro_batch_size=cfg.embedded.micro_batch_size, rows=rows)


def _cold(engine):
    """vLLM keeps prompt prefixes and processed images between calls: each row starts without them, as a training
    step's new prompts do (otherwise a later row would reuse an earlier row's images and look faster than it is)."""
    if engine.name == "vllm":
        engine.llm.reset_prefix_cache()
        engine.llm.reset_mm_cache()


def plain_vllm(engine, prompts, G) -> list[list[int]]:
    """The same prompts through the engine's vLLM `LLM.generate`, nothing of ours around it."""
    outs = engine.llm.generate(engine.inputs(prompts), engine.sampling(G), use_tqdm=False)
    return [list(o.token_ids) for out in outs for o in out.outputs]


def probe_continuous_batching(backend, prompts, G) -> dict:
    """transformers' continuous batching (`generate_batch`: paged attention, no decode for finished rows) on the
    same prompts and sampling settings; not an engine yet, measured to decide whether it should be."""
    inputs = [p["input_ids"].tolist() for p in prompts for _ in range(G)]
    model = backend.rollout

    def run():
        with backend._autocast():
            out = model.generate_batch(inputs=inputs, generation_config=backend.generation, progress_bar=False)
        return [list(o.generated_tokens) for o in out.values()]

    try:
        run()  # warm-up
        return measure("transformers-generate_batch", run, None)
    except Exception as e:  # noqa: BLE001 - a probe: report what broke, keep the other rows
        return dict(path="transformers-generate_batch", error=f"{type(e).__name__}: {str(e)[:300]}")


def update_inputs(a, cfg, backend):
    """The update's prompts and responses. text: 2 prompts of 64 random tokens x 8 responses of 960 (16 x 1,024
    tokens). A VL shape: --prompts Geometry3K problems of --source, encoded with their diagrams as a run encodes them,
    x group_size responses of max_response_length random ordinary tokens (random weights run to the cap)."""
    import torch

    from bapo_vl.train import load_problems

    gen = torch.Generator().manual_seed(0)
    if a.shape == "text":
        vocab = backend.policy.config.vocab_size
        prompts = [dict(input_ids=torch.randint(3, vocab - 8, (64,), generator=gen)) for _ in range(2)]
        G, R = 8, 960
    else:
        _, problems = load_problems(cfg.run)
        prompts = [backend.encode(p) for p in problems[:a.prompts]]
        vocab = backend.tokenizer.vocab_size  # ordinary tokens: no image placeholder in a response
        G, R = cfg.sampling.group_size, cfg.sampling.max_response_length
    responses = [[tuple(torch.randint(3, vocab - 8, (R,), generator=gen).tolist()) for _ in range(G)]
                 for _ in prompts]
    return prompts, responses


def update_flops(backend, prompts, responses, patches: int) -> tuple[float, list[int]]:
    """Model FLOPs of one update, and each sequence's length: 6 N T over the language model's body (every token),
    6 V h for the LM head over the response tokens (the only positions it runs at; a head tied to the embedding is
    counted all the same, the embedding's lookup is not), causal attention, and for a VL model the vision tower's N
    over the `patches` it encoded (its attention not counted). Recomputation is not counted."""
    model = backend.policy
    text = getattr(model.config, "text_config", model.config)
    lengths = [len(p["input_ids"]) + len(r) for p, rs in zip(prompts, responses) for r in rs]
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    body = sum(p.numel() for p in model.parameters() if p is not head and p is not embedding) - vision
    response_tokens = sum(len(r) for rs in responses for r in rs)
    attention = 6 * text.num_hidden_layers * text.hidden_size * sum(n * n for n in lengths)  # causal: half of 12
    return (6 * body * sum(lengths) + 6 * head.numel() * response_tokens + attention + 6 * vision * patches,
            lengths)


def update_bench(a) -> dict:
    from bapo_vl.backends.base import Response, UpdateBatch
    from bapo_vl.train import make_backend

    if a.shape == "text":
        fixed = ["mini_batch_size=2", "micro_batch_size=16", "max_prompt_length=64", "max_response_length=960"]
    else:  # the shape's own settings (micro-batches, lengths, pixels), one optimizer step over the prompts
        fixed = [f"mini_batch_size={a.prompts}"]
    cfg = _config(a.shape, a.model, "transformers", a.source, [*fixed, *a.set])
    backend = make_backend(cfg)
    prompts, responses = update_inputs(a, cfg, backend)
    flat_p = [p for p, rs in zip(prompts, responses) for _ in rs]
    flat_r = [r for rs in responses for r in rs]
    behaviour = backend.score(backend.rollout, flat_p, flat_r)
    G = len(responses[0])
    groups = tuple(tuple(Response(r, tuple(behaviour[g * G + i, :len(r)].tolist())) for i, r in enumerate(rs))
                   for g, rs in enumerate(responses))
    batch = UpdateBatch(prompts=tuple(prompts), responses=groups,
                        rewards=tuple(tuple(float(i % 2 == 0) for i in range(G)) for _ in prompts),
                        advantages=tuple(tuple(1.0 if i % 2 == 0 else -1.0 for i in range(G)) for _ in prompts),
                        step=1)
    backend.update(batch)  # warm-up (and torch.compile's compilation)
    times = []
    _reset()
    with TrainedPatches(backend) as patches:
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            backend.update(batch)
            _sync()
            times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    flops, lengths = update_flops(backend, prompts, responses, patches.count // a.repeat)
    tokens = sum(lengths)
    peak = peak_flops(card())
    memory = _memory()  # of the timed updates, before the profiled one
    syncs = sync_calls(lambda: backend.update(batch)) if a.sync_debug else {}
    return dict(kind="update", shape=a.shape, card=card(), **provenance(), overrides=list(a.set), model=str(a.model),
                compiled=cfg.embedded.compile, micro_batch_size=cfg.embedded.micro_batch_size,
                mixed_precision=cfg.embedded.mixed_precision, sequences=len(lengths), tokens=tokens,
                longest=max(lengths), seconds=seconds, tokens_per_s=tokens / seconds, tflops=flops / seconds / 1e12,
                mfu=flops / seconds / peak if peak else None,
                mfu_easyr1=actor_mfu(backend.policy.config, lengths, seconds, gpus=1, peak=peak), **memory,
                **(profile(lambda: backend.update(batch), backend.trained) if a.profile else {}), **syncs)


class TrainedPatches:
    """Within the block, `count`: the patches the updated model's vision tower encoded in forwards with a graph (the
    update's; not its no-grad scoring). 0 for a model without a tower."""

    def __init__(self, backend):
        self.visual = getattr(getattr(backend.trained, "model", None), "visual", None)
        self.count, self.hook = 0, None

    def __enter__(self):
        import torch

        def seen(module, args):
            if torch.is_grad_enabled():
                self.count += len(args[0])

        if self.visual is not None:
            self.hook = self.visual.register_forward_pre_hook(seen)
        return self

    def __exit__(self, *exc):
        if self.hook is not None:
            self.hook.remove()


def sync_calls(fn) -> dict:
    """The calls of fn that made the host wait for the GPU (torch.cuda.set_sync_debug_mode("warn") warns on each:
    .item(), .tolist(), .cpu(), a blocking host-to-device copy, nonzero, boolean-mask indexing, ...), counted, with
    the Python lines they came from; {} without CUDA (the mode instruments CUDA calls only)."""
    import collections
    import os
    import warnings

    import torch

    if not torch.cuda.is_available():
        print("--sync-debug needs CUDA (torch.cuda.set_sync_debug_mode instruments CUDA calls): nothing recorded",
              file=sys.stderr)
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()  # the benchmark's own wait, after the mode is off: not counted
    waits = [w for w in caught if "synchroniz" in str(w.message)]
    root = Path(__file__).resolve().parents[1]
    sites = collections.Counter(
        f"{os.path.relpath(w.filename, root) if w.filename.startswith(str(root)) else w.filename}:{w.lineno}"
        for w in waits)
    return dict(sync_calls=len(waits), sync_sites=dict(sites.most_common()))


def profile(fn, model, rows: int = 25) -> dict:
    """torch.profiler on one call of fn, to say what bounds a target that is missed: `profile`, the table of the
    operators with the most device time (CPU time without a GPU), and `profile_parts`, the call's time by part of
    `model`."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    inner = getattr(model, "model", model)
    parts = {name: module for name, module in (("vision tower", getattr(inner, "visual", None)),
                                               ("language model", getattr(inner, "language_model", inner)))
             if module is not None}
    hooks = [h for name, module in parts.items() for h in labelled(module, name)]
    try:
        t0 = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            fn()
            _sync()
        wall = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    return dict(profile=prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60),
                profile_parts=profile_parts(prof.events(), list(parts), on_gpu, wall),
                **({"profile_timeline": timeline(prof)} if on_gpu else {}))


def timeline(prof) -> dict:
    """The profiled call's trace read as a timeline (scripts/gpu/trace_summary.py): the GPU's busy share of the
    window and, for its idle gaps, the range and top-level operator the host was in when it launched the next work."""
    import tempfile

    trace_summary = _trace_summary()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return trace_summary.summarize(trace_summary.load(path))


def _trace_summary():
    """scripts/gpu/trace_summary.py, beside this script's folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    try:
        import trace_summary
    finally:
        sys.path.pop(0)
    return trace_summary


def labelled(module, name: str) -> list:
    """Forward hooks that put each forward of `module` in a profiler range named "NAME forward"; its backward is
    found from the range's autograd sequence numbers (profile_parts)."""
    from torch.autograd.profiler import record_function

    def enter(mod, args):
        mod._profiler_range = record_function(f"{name} forward").__enter__()

    def leave(mod, args, out):
        mod._profiler_range.__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def profile_parts(events, names: list[str], on_gpu: bool, wall: float) -> dict:
    """Seconds of device time (CPU time without a GPU) by part: each named module's forward (its ranges, with
    what they call) and backward (the autograd nodes whose sequence numbers its forward ops took), the optimizer
    step, and the rest (the LM head and loss, gradient accumulation and clipping, ...); `total`, the kernels' time
    (without a GPU, the operators'); `wall`, the profiled call's seconds."""
    from torch.autograd import DeviceType

    def whole(e):  # a host-side event's time with what it calls (its kernels' on a GPU)
        return e.device_time_total if on_gpu else e.cpu_time_total

    def below(e):
        yield e
        for child in e.cpu_children:
            yield from below(child)

    host = [e for e in events if e.device_type == DeviceType.CPU]  # a range's GPU-side twin would count it twice
    parts, backward = {}, {}
    for name in names:
        ranges = [e for e in host if e.name == f"{name} forward"]
        parts[f"{name} forward"] = sum(map(whole, ranges))
        for seq in {d.sequence_nr for r in ranges for d in below(r) if d.sequence_nr >= 0}:
            backward[seq] = name
    for name in names:
        parts[f"{name} backward"] = 0.0
    for e in host:
        if e.name.startswith("autograd::engine::evaluate_function:") and e.sequence_nr in backward:
            parts[f"{backward[e.sequence_nr]} backward"] += whole(e)
    parts["optimizer step"] = sum(whole(e) for e in host if e.name.startswith("Optimizer.step#"))
    total = (sum(e.device_time_total for e in events if e.device_type != DeviceType.CPU
                 and not getattr(e, "is_user_annotation", False)) if on_gpu  # kernels and copies, not ranges
             else sum(e.self_cpu_time_total for e in host))
    parts["rest"] = total - sum(parts.values())
    return {k: v / 1e6 for k, v in parts.items()} | {"total": total / 1e6, "wall": wall}


HOW = ("vllm_options=", "generate_batch_size=")  # engine settings that change how rows are decoded, not what


def report(files: list[Path]):
    results = [json.loads(f.read_text()) for f in files]
    bounds = {(r["shape"], card_model(r)): r for r in results if r["kind"] == "bound"}
    engines = [r for r in results if r["kind"] == "engine"]
    for shape in dict.fromkeys(r["shape"] for r in engines):
        rows = [(r, row) for r in engines if r["shape"] == shape for row in r["rows"]]
        # the baseline: model.generate on the same card, prompts and work (engine options and the chunk size change
        # only how), with its default chunk size where a row has it (else the first given), and with transformers'
        # own SDPA where the row has it (the path before gqa_decode)
        work = lambda r: tuple(o for o in r.get("overrides", []) if not o.startswith(HOW))  # noqa: E731
        ranked = {}  # key -> (rank, row): untuned before tuned, then transformers-sdpa before transformers
        for r, row in rows:
            if row["path"] in ("transformers", "transformers-sdpa"):
                key = (card_model(r), row["prompts"], work(r))
                rank = (any(o.startswith(HOW) for o in r.get("overrides", [])), row["path"] != "transformers-sdpa")
                if key not in ranked or rank < ranked[key][0]:
                    ranked[key] = (rank, row)
        base = {key: row for key, (_, row) in ranked.items()}
        print(f"\n## engines, {shape} shape")
        print("| path | card | settings | prompts x G | tokens/s | ms / decode step | mean / longest | x model.generate "
              "| of bound | peak alloc / reserved GB |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r, row in rows:
            if "error" in row:
                print(f"| {row['path']} | {card_model(r)} | {' '.join(r.get('overrides', [])) or '-'} | {row.get('prompts')} x "
                      f"{row.get('G')} | failed: {row['error']} | | | | | |")
                continue
            b = base.get((card_model(r), row["prompts"], work(r)))
            bound = bounds.get((shape, card_model(r)))
            ratio = f"{row['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "-"
            frac = "-"
            if bound:  # the bound at this row count: weights once per step + KV of every row
                rows_n = row["prompts"] * row["G"]
                step = (bound["weight_bytes"] + bound["kv_bytes_per_step"] * rows_n / bound["rows"]) / (
                    bound["copy_rate_GBps"] * 1e9)
                frac = f"{row['tokens_per_s'] / (rows_n / step):.1%}"
            mem = f"{row.get('peak_allocated_GB', 0):.1f} / {row.get('peak_reserved_GB', 0):.1f}"
            print(f"| {row['path']} | {card_model(r)} | {' '.join(r.get('overrides', [])) or '-'} | {row['prompts']} x {row['G']} | {row['tokens_per_s']:,.0f} | "
                  f"{row['ms_per_decode_step']:.2f} | {row['mean_length']:.0f} / {row['longest']} | {ratio} | {frac} "
                  f"| {mem} |")
    for r in (r for r in results if r["kind"] == "score"):
        base = next(row for row in r["rows"] if row["score_batch_size"] == r["micro_batch_size"])
        print(f"\n## behaviour scoring, {r['shape']} shape ({card_model(r)}): {r['sequences']} sequences, "
              f"{r['tokens']:,} response tokens")
        print("| score_batch_size | seconds | x micro_batch_size | peak alloc / reserved GB |")
        print("| --- | --- | --- | --- |")
        for row in r["rows"]:
            print(f"| {row['score_batch_size']}{' (micro_batch_size)' if row is base else ''} | {row['seconds']:.2f} | "
                  f"{base['seconds'] / row['seconds']:.2f}x | {row.get('peak_allocated_GB', 0):.1f} / {row.get('peak_reserved_GB', 0):.1f} |")
    updates = [r for r in results if r["kind"] == "update"]
    for r in updates:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        if r.get("mfu_easyr1") is not None:
            mfu += f" (EasyR1's count: {r['mfu_easyr1']:.1%})"
        shape = r.get("shape", "text")
        # the baseline: the first update of this card and shape
        base = next(u for u in updates if u["card"] == r["card"] and u.get("shape", "text") == shape)
        ratio = f", {base['seconds'] / r['seconds']:.2f}x the first update of this card" if base is not r else ""
        work = (f"{r['sequences']} x 1,024 tokens" if shape == "text" else
                f"{r['sequences']} sequences of the {shape} shape, {r['tokens']:,} tokens")
        mode = [m for m in ("torch.compile" if r.get("compiled") else "",
                            r.get("mixed_precision", "autocast") if r.get("mixed_precision") != "autocast" else "") if m]
        if r.get("profile"):
            print(f"\nupdate profile ({card_model(r)}):\n{r['profile']}")
        if r.get("profile_parts"):
            print(f"\nupdate profile ({card_model(r)}) by part: {parts_line(r['profile_parts'], r['seconds'])}")
        if r.get("profile_timeline"):
            print("\n" + _trace_summary().markdown(r["profile_timeline"], f"update timeline ({card_model(r)})"))
        if r.get("sync_calls") is not None:
            where = ", ".join(f"{site} x{n}" for site, n in list(r["sync_sites"].items())[:8])
            print(f"\nupdate ({card_model(r)}): {r['sync_calls']} calls waited for the GPU in one update ({where})")
        print(f"\nupdate ({', '.join([card_model(r), *mode])}): {work} in {r['seconds']:.3f} s = "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.1f} TFLOP/s, MFU {mfu}{ratio}" + (
                  f"; peak allocated {r['peak_allocated_GB']:.1f} GB, reserved {r['peak_reserved_GB']:.1f} GB "
                  f"({r['peak_reserved_GB'] / r['peak_allocated_GB']:.2f}x)" if "peak_allocated_GB" in r else ""))


def parts_line(parts: dict, seconds: float) -> str:
    """profile_parts as one line: each part's seconds and share of the total, then the total against the update's
    unprofiled seconds (the profiled call's own wall time includes the profiler's overhead on the host)."""
    total = parts["total"]
    shares = ", ".join(f"{k} {v:.3f} s ({v / total:.0%})" for k, v in parts.items() if k not in ("total", "wall"))
    return (f"{shares}; all {total:.3f} s, against {seconds:.3f} s for the unprofiled update (the device busy "
            f"{min(total / seconds, 1):.0%} of it; the profiled call took {parts['wall']:.3f} s)")


def update_label(r: dict) -> str:
    """An update row's variant: its precision, and torch.compile where it was on."""
    return " + ".join([r.get("mixed_precision", "autocast"), *(["torch.compile"] if r.get("compiled") else [])])


def update_summary(result: dict, baseline: dict | None) -> dict:
    """One update row of a benchmarks/ table: its figures and its speed over the baseline's (baseline seconds / row
    seconds), both measured by the same command; no ratio across cards."""
    keys = ("sequences", "tokens", "seconds", "tokens_per_s", "tflops", "mfu", "mfu_easyr1", "peak_allocated_GB",
            "peak_reserved_GB")
    row = dict(kind="summary", row=f"update ({update_label(result)})", shape=result.get("shape", "text"),
               card=result["card"], date=result.get("date"), commit=result.get("commit"), model=result["model"],
               overrides=result.get("overrides") or [], **{k: result.get(k) for k in keys})
    if baseline is not None:
        row["baseline"] = dict(row=f"update ({update_label(baseline)})", card=baseline["card"],
                               seconds=baseline["seconds"], mfu=baseline.get("mfu"))
        same = (card_model(result) == card_model(baseline) and result["model"] == baseline["model"]
                and result.get("tokens") == baseline.get("tokens"))  # the same work
        row["speed_x_baseline"] = baseline["seconds"] / result["seconds"] if same else None
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--engine", choices=["transformers", "vllm"], required=True)
    e.add_argument("--shape", choices=SHAPES, required=True)
    e.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    e.add_argument("--source", help="Geometry3K data folder (vl shape)")
    e.add_argument("--no-probe-cb", dest="probe_cb", action="store_false", help="skip the generate_batch probe")
    s = sub.add_parser("score")
    s.add_argument("--prompts", type=int, default=16)
    s.add_argument("--batch", type=lambda v: [int(x) for x in v.split(",")], default=[8, 16, 32, 64],
                   help="score_batch_size values to time (micro_batch_size is timed too, first)")
    s.add_argument("--shape", choices=SHAPES, required=True)
    s.add_argument("--source", help="Geometry3K data folder (vl shape)")
    u = sub.add_parser("update")
    u.add_argument("--shape", choices=SHAPES, default="text", help="text (the default) or a VL shape (--source)")
    u.add_argument("--source", help="Geometry3K data folder (VL shapes)")
    u.add_argument("--prompts", type=int, default=4, help="VL shapes: prompts, each with group_size responses")
    u.add_argument("--repeat", type=int, default=3)
    u.add_argument("--profile", action="store_true",
                   help="one more update under torch.profiler: its top operators, its time by part")
    u.add_argument("--sync-debug", action="store_true", help="one more update under torch.cuda.set_sync_debug_mode"
                   "('warn'): how many calls made the host wait for the GPU, and where (CUDA only)")
    for p in (e, s, u):
        p.add_argument("--model", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--set", nargs="*", default=[], help="more Config fields, KEY=VALUE (e.g. device=cpu)")
    sub.add_parser("report").add_argument("files", type=Path, nargs="+")
    m = sub.add_parser("summary", help="one update row as JSON, with its speed over --baseline's")
    m.add_argument("result", type=Path)
    m.add_argument("--baseline", type=Path, help="an update result of the same command to take the ratio against")
    a = ap.parse_args()
    if a.cmd == "engine":
        _write(a.out, engine_bench(a))
    elif a.cmd == "score":
        _write(a.out, score_bench(a))
    elif a.cmd == "update":
        _write(a.out, update_bench(a))
    elif a.cmd == "summary":
        print(json.dumps(update_summary(json.loads(a.result.read_text()),
                                        json.loads(a.baseline.read_text()) if a.baseline else None), indent=1))
    else:
        report(a.files)


if __name__ == "__main__":
    main()
