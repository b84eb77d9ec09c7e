"""GPU benchmark of the backends on the same shapes: per-step time split and tokens/s of the embedded backend (as it
is), BAPO on verl with 1 GPU and with 2 GPUs, and the bandwidth bound of decode for each shape.

    python scripts/gpu/bench_backends.py models DIR                        # random text-0.5B and VL shapes, saved
    python scripts/gpu/bench_backends.py bound --shape text --model DIR/text --out F.json
    python scripts/gpu/bench_backends.py train --shape text --backend embedded --model DIR/text --out F.json
    python scripts/gpu/bench_backends.py train --shape text --backend verl --gpus 2 --model DIR/text --out F.json
    python scripts/gpu/bench_backends.py report F.json ...                 # the table, ratios against embedded

Shapes (random weights, byte vocabulary; every group is trained on: online_filter=none, no re-evaluation within the
run, kl_coef=0 so neither backend keeps a reference model):
  text  Qwen2-0.5B (hidden 896, 24 layers, 14/2 heads): countdown, 64 prompts x 8 x up to 512 response tokens
  vl    Qwen2.5-VL-3B's vision tower (32 blocks, hidden 1280) and head dimension 128 under a 1.5B-class language
        model (hidden 1536, 28 layers, 12/2 heads), 2.0 B parameters: Geometry3K diagrams at up to 448x448 pixels
        (<= 256 visual tokens), 16 prompts x 8 x up to 256 response tokens. The 3B language model does not fit the
        embedded backend's fp32 AdamW on an 80 GB card next to its bf16 rollout copy.

A `train` run is `bapo train` (embedded) or `python -m bapo_vl.backends.verl_main` (verl) for --steps steps; figures
come from its run record (t_generate, t_verify, t_train, t_sync, rollouts, response_length, step wall times); step 1
(warm-up, CUDA graphs / compilation) is left out of the medians.

Needs bapo-vl installed (`pip install -e .`) and, for the verl rows, its `[verl]` and `[vllm]` extras
(`pip install -e ".[verl,vllm]"`). Run it from outside the checkout, so that Ray's workers import the installed
package (and load its verl plugin through the entry point) rather than the source folder.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXT = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864)
VL_TEXT = dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960)
MAX_PIXELS = 448 * 448

COMMON = dict(online_filter="none", reeval_every=100000, kl_coef=0.0, entropy_coef=0.0, lr=1e-6, device="cuda",
              save_every=0, log_samples=2)
# The verl presets the shapes start from are functional runs with vLLM in eager mode (no compile, no CUDA graphs:
# short runs); a benchmark runs vLLM as users do, as the embedded backend's vLLM engine does. Results recorded before
# this override ran eager: the report says so for results that do not name the mode.
VLLM_AS_USERS_RUN_IT = {"actor_rollout_ref.rollout.enforce_eager": False}

SHAPES = {
    "text": dict(preset="tiny", verl_preset="verl_tiny.yaml", prompt_tokens=64,
                 bapo=dict(COMMON, batch_size=64, group_size=8, max_prompt_length=64, max_response_length=512,
                           mini_batch_size=64, micro_batch_size=16),
                 verl={"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16, **VLLM_AS_USERS_RUN_IT}),
    "vl": dict(preset="geometry3k", verl_preset="verl_tiny_vl.yaml", prompt_tokens=400,
               bapo=dict(COMMON, batch_size=16, group_size=8, max_prompt_length=1024, max_response_length=256,
                         mini_batch_size=16, micro_batch_size=8, max_pixels=MAX_PIXELS),
               verl={"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
                     "actor_rollout_ref.rollout.gpu_memory_utilization": 0.35, **VLLM_AS_USERS_RUN_IT}),
}


def card() -> str:
    import torch
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"


def models(out: Path):
    import torch

    from bapo_vl.tiny import VISION_3B, build_qwen2, build_qwen2_5_vl

    torch.set_default_device("cuda" if torch.cuda.is_available() else "cpu")  # random init on the card, not on the CPU
    for name, build in (("text", lambda: build_qwen2(**TEXT)),
                        ("vl", lambda: build_qwen2_5_vl(**VL_TEXT, vision=VISION_3B, max_pixels=MAX_PIXELS))):
        model, tok = build()
        model.to(torch.bfloat16).save_pretrained(out / name)
        tok.save_pretrained(out / name)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters -> {out / name}",
              flush=True)
        del model
        torch.cuda.empty_cache()


def copy_rate(gib: float = 4.0, repeat: int = 20) -> float:
    """The card's measured device-to-device copy rate, bytes/s (read + write counted)."""
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * repeat / (time.perf_counter() - t0)


def bound(shape: str, model_dir: Path, out: Path):
    """Decode's bandwidth bound: each decode step reads the language model's weights (bf16) once and every row's
    KV cache; rows = prompts x G, context = prompt + half the response budget (the mean over a full decode)."""
    from transformers import AutoConfig

    spec = SHAPES[shape]
    cfg = AutoConfig.from_pretrained(model_dir)
    text = getattr(cfg, "text_config", cfg)
    head_dim = text.hidden_size // text.num_attention_heads
    lm_params = (text.num_hidden_layers * (
        text.hidden_size * head_dim * (text.num_attention_heads * 2 + text.num_key_value_heads * 2)
        + 3 * text.hidden_size * text.intermediate_size) + text.vocab_size * text.hidden_size)
    rows = spec["bapo"]["batch_size"] * spec["bapo"]["group_size"]
    context = spec["prompt_tokens"] + spec["bapo"]["max_response_length"] / 2
    kv = rows * context * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 2
    rate = copy_rate()
    step_s = (2 * lm_params + kv) / rate
    result = dict(kind="bound", shape=shape, card=card(), copy_rate_GBps=rate / 1e9, weight_bytes=2 * lm_params,
                  kv_bytes_per_step=kv, rows=rows, mean_context=context, decode_step_ms=1e3 * step_s,
                  tokens_per_s=rows / step_s)
    _write(out, result)


def _arg(v) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def train(shape: str, backend: str, gpus: int, model_dir: Path, steps: int, out: Path, source: str | None,
          run_dir: Path, timeout: float, extra: list[str], cuda: str | None = None, keep_weights: bool = False):
    spec = SHAPES[shape]
    engine = next((e.split("=", 1)[1] for e in extra if e.startswith("rollout_engine=")), None)
    name = f"bench-{shape}-{backend}{gpus}" + (f"-{engine}" if engine else "")
    bapo = dict(spec["bapo"], model=str(model_dir), steps=steps, run_dir=str(run_dir), name=name)
    bapo.update(item.split("=", 1) for item in extra if not item.startswith("verl."))
    verl_extra = dict(item.removeprefix("verl.").split("=", 1) for item in extra if item.startswith("verl."))
    if verl_extra and backend != "verl":
        raise SystemExit(f"verl.* settings {sorted(verl_extra)} apply to --backend verl only")
    if source:
        bapo["task_options"] = {"source": source}
    if backend == "embedded":
        cmd = [sys.executable, "-c", "from bapo_vl.cli import main; main()", "train", "--preset", spec["preset"],
               *[f"{k}={_arg(v)}" for k, v in bapo.items()]]
    else:
        from bapo_vl.config import BACKEND_OF

        for key in ["device", *(k for k in bapo if BACKEND_OF.get(k) == "embedded")]:
            bapo.pop(key)  # the embedded backend's settings, refused on verl: spec["verl"] has verl's
        verl = dict(spec["verl"], **{"trainer.n_gpus_per_node": gpus}, **verl_extra)
        cmd = [sys.executable, "-m", "bapo_vl.backends.verl_main", "--config",
               str(REPO / "bapo_vl" / "presets" / spec["verl_preset"]),
               *[f"bapo.{k}={_arg(v)}" for k, v in bapo.items()], *[f"verl.{k}={v}" for k, v in verl.items()]]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=cuda or ",".join(str(i) for i in range(gpus)))
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    mode = {} if backend != "verl" else {
        "vllm_mode": "eager" if str(verl["actor_rollout_ref.rollout.enforce_eager"]).lower() == "true" else "cuda graphs"}
    result = dict(kind="train", shape=shape, backend=backend, gpus=gpus, card=card(), rc=rc, wall_s=time.time() - t0,
                  **mode,
                  steps=steps, overrides=extra,
                  **steps_summary(run_dir / name / "run.db"))
    _write(out, result)
    if not keep_weights:  # a 2 B model's checkpoints (fp32 + AdamW) are tens of GB: a few runs fill a GPU machine's disk
        for folder in ("checkpoints", "final"):
            shutil.rmtree(run_dir / name / folder, ignore_errors=True)


def steps_summary(db: Path) -> dict:
    """Medians over steps 2.. of the record's time split and throughput."""
    if not db.exists():
        return {"error": f"no run record at {db}"}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = [(step, t, json.loads(m)) for step, t, m in conn.execute("SELECT step, time, metrics FROM steps ORDER BY step")]
    if len(rows) < 2:
        return {"error": f"{len(rows)} steps recorded"}
    walls = [b[1] - a[1] for a, b in zip(rows, rows[1:])]
    later = [m for _, _, m in rows[1:]]
    med = lambda key: statistics.median(m.get(key) or 0.0 for m in later)
    split = lambda key: med(key) if all(key in m for m in later) else None  # records since generate's split
    tokens = [m["rollouts"] * m["response_length"] for m in later]
    return dict(steps_recorded=len(rows), step_s=statistics.median(walls), generate_s=med("t_generate"),
                generate_engine_s=split("t_generate_sample"), generate_logprobs_s=split("t_generate_logprobs"),
                verify_s=med("t_verify"), train_s=med("t_train"), sync_s=med("t_sync"),
                response_length=med("response_length"), rollouts=med("rollouts"),
                generate_tokens_per_s=statistics.median(t / m["t_generate"] for t, m in zip(tokens, later)),
                train_tokens_per_s=statistics.median(t / m["t_train"] for t, m in zip(tokens, later) if m["t_train"]),
                loss=later[-1].get("loss"), grad_norm=later[-1].get("grad_norm"))


def _write(out: Path, result: dict):
    print(json.dumps(result), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def card_model(row: dict) -> str:
    """The card's model: rows compare across the runs of one machine, whichever of its cards each could see (the
    files given to `report` should come from one machine: one folder of docs/bench)."""
    return row["card"].split(" x ", 1)[-1]


def settings(row: dict) -> list[str]:
    """The overrides that change the work of a step (the rollout engine, micro-batching, verl's own settings and the
    "env ..." switches recorded in older files change only how it is done)."""
    return [o for o in row.get("overrides") or [] if not o.startswith(("rollout_engine=", "micro_batch_size=", "verl.", "env "))]


def report(files: list[Path]):
    results = [r for r in (json.loads(f.read_text()) for f in files) if r["kind"] in ("train", "bound")]
    for shape in SHAPES:
        rows = sorted((r for r in results if r["shape"] == shape and r["kind"] == "train"),
                      key=lambda r: (r["backend"] != "embedded", r["gpus"], sorted(r.get("overrides") or [])))
        b = next((r for r in results if r["shape"] == shape and r["kind"] == "bound"), None)
        if not rows:
            continue
        base = next((r for r in rows if r["backend"] == "embedded" and "step_s" in r
                     and not any(o.startswith("rollout_engine=") for o in r.get("overrides") or [])), None)
        print(f"\n## {shape}" + (f" (decode bound {b['tokens_per_s']:,.0f} tokens/s = {b['decode_step_ms']:.2f} ms "
                                  f"per step at {b['copy_rate_GBps']:.0f} GB/s, {b['card']})" if b else ""))
        print("| backend | card | changed settings | step s | generate / verify / train / sync s "
              "| of generate: engine / log-probs s | response tokens | generate tok/s | step x embedded | of bound "
              "| train tok/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            engine = next((o.split("=", 1)[1] for o in r.get("overrides") or [] if o.startswith("rollout_engine=")), None)
            label = (f"embedded ({engine} engine)" if engine else "embedded") if r["backend"] == "embedded" \
                else f"verl, {r['gpus']} GPU, vLLM {r.get('vllm_mode', 'eager')}"
            changed = " ".join(r.get("overrides") or []) or "-"
            if "step_s" not in r:
                print(f"| {label} | {card_model(r)} | {changed} | failed: rc={r['rc']} {r.get('error', '')} | | | | | | | |")
                continue
            comparable = base and (card_model(base), settings(base)) == (card_model(r), settings(r))
            ratio = f"{base['step_s'] / r['step_s']:.2f}x" if comparable else "- (other card or settings)"
            frac = f"{r['generate_tokens_per_s'] / b['tokens_per_s']:.1%}" if b and card_model(b) == card_model(r) else "-"
            where = " / ".join("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("generate_engine_s", "generate_logprobs_s"))
            verify = r["verify_s"] if "verify_s" in r else r["score_s"]  # results written before t_score's rename
            print(f"| {label} | {card_model(r)} | {changed} | {r['step_s']:.2f} | {r['generate_s']:.2f} / {verify:.2f} / "
                  f"{r['train_s']:.2f} / {r['sync_s']:.2f} | {where} | {r['rollouts']:.0f} x {r['response_length']:.0f} | "
                  f"{r['generate_tokens_per_s']:,.0f} | {ratio} | {frac} | {r['train_tokens_per_s']:,.0f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("models").add_argument("out", type=Path)
    b = sub.add_parser("bound")
    t = sub.add_parser("train")
    for p in (b, t):
        p.add_argument("--shape", choices=SHAPES, required=True)
        p.add_argument("--model", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
    t.add_argument("--backend", choices=["embedded", "verl"], required=True)
    t.add_argument("--gpus", type=int, default=1)
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--source", help="Geometry3K data folder (vl shape)")
    t.add_argument("--run-dir", type=Path, default=Path("/tmp/bench-runs"))
    t.add_argument("--timeout", type=float, default=500)
    t.add_argument("--set", nargs="*", default=[], help="more Config fields, KEY=VALUE (e.g. device=cpu); "
                   "verl.KEY=VALUE: a verl config override (--backend verl)")
    t.add_argument("--cuda", help="CUDA_VISIBLE_DEVICES for the run (default: the first --gpus cards)")
    t.add_argument("--keep-weights", action="store_true", help="keep the run's checkpoints and final/ (default: "
                   "removed once the figures are read; the run record stays)")
    sub.add_parser("report").add_argument("files", type=Path, nargs="+")
    a = ap.parse_args()
    if a.cmd == "models":
        models(a.out)
    elif a.cmd == "bound":
        bound(a.shape, a.model, a.out)
    elif a.cmd == "train":
        train(a.shape, a.backend, a.gpus, a.model, a.steps, a.out, a.source, a.run_dir, a.timeout, a.set, a.cuda,
              a.keep_weights)
    else:
        report(a.files)


if __name__ == "__main__":
    main()
