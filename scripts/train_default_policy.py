"""Train a countdown start policy: a byte-level Qwen2-architecture model that already solves some countdown problems.
`--size countdown-tiny` (the default) is the embedded default policy (822k parameters, bapo_vl/policy/countdown-tiny);
`--size countdown-13m` a 13.1 M-parameter one with more room for RL, too large for the wheel: build it
into a folder outside bapo_vl/ and pass that path as model=. Shape and recipe flags override the size's values.

Supervised fine-tuning (seeded; --deterministic, on by default, asks torch for deterministic kernels, as CUDA's
fastest ones make two runs of one command drift apart) of a `bapo_vl.tiny.build_qwen2` model on
problems made forward by `generate_problems` (tasks/countdown/task.py; no solver), in the compact format:

    prompt   (user message "44 19 35 -> 98", chat-rendered)  "44 19 35 -> 98\\n"
    response                                                 "<answer>(44+19)+35</answer><|im_end|>"

The loss is on response tokens only (eos included); AdamW, linear warm-up then cosine decay, grad-clip 1.
Saves model + tokenizer (save_pretrained, fp32 safetensors) to --out with TRAINING.md and training.json
(command, seed, steps, parameters, final loss, measured accuracy when --eval-data is given). TEST below is
TinyZero's countdown test split (`tinyzero_test_1024_base.jsonl`, nums/target rows), or any such JSONL.

    PYTHONPATH=. python scripts/train_default_policy.py --out runs/policy --steps 2000 --batch 512 \
        --eval-data TEST
    PYTHONPATH=. python scripts/train_default_policy.py --size countdown-13m --out runs/policies/countdown-13m \
        --exclude-file TEST --eval-data TEST --eval-every 1000   # one GPU
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import shlex
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


evalmod = _load_by_path("eval_countdown_policy", ROOT / "scripts" / "eval_countdown_policy.py")
evalmod.ensure_source_packages()  # task.py imports bapo_vl.verifiers.* (mapped by hand when not installed)
task = _load_by_path("countdown_task_for_sft", ROOT / "tasks" / "countdown" / "task.py")

CHUNK = 10_000
# --size: shape and recipe. countdown-tiny is what the bundled policy was trained with (its TRAINING.md adds
# --steps 800 --problems 1000000); countdown-13m is the shape and recipe of a 13 M byte-level Qwen2 that learned
# countdown well from SFT alone (with a 128-byte vocabulary and another prompt: this script's recipe is that one in
# this script's format, not a copy of that run).
SIZES = {
    "countdown-tiny": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384,
                           steps=2000, batch=512, problems=200_000, lr=2e-3, warmup=100),
    "countdown-13m": dict(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1536,
                          steps=8000, batch=1024, problems=1_000_000, lr=1e-3, warmup=200),
}
PACKAGED = ROOT / "bapo_vl"  # everything under it goes into the wheel (package-data policy/*/*)
MAX_PACKAGED_PARAMS = 2_000_000  # 8 MB of fp32: larger policies are built where the wheel does not look
SEED_BASE = 1_000_000_000  # chunk seeds live far from the small seeds tasks use (countdown.load: 42 train, 43 test)


def _chunk(args):
    seed, i = args
    return task.generate_problems(CHUNK, seed=SEED_BASE + seed * 100_003 + i)


def problem_key(nums, target) -> tuple:
    return tuple(sorted(nums)), int(target)


def exclusion_set(generated: list[str], files: list[str]) -> set:
    """Problems kept out of the training data: `SEED:N` = generate_problems(N, seed=SEED) (what countdown.load
    makes without a source: 42:10000 train, 43:1024 test), and every nums/target row of the given jsonl files."""
    keys = set()
    for spec in generated:
        seed, n = (int(x) for x in spec.split(":"))
        keys.update(problem_key(nums, t) for nums, t, _ in task.generate_problems(n, seed=seed))
    for f in files:
        keys.update(problem_key(p["nums"], p["target"]) for p in evalmod.load_problems(f))
    return keys


def make_problems(n: int, seed: int, workers: int, exclude: set | frozenset = frozenset()) -> list:
    """n forward-generated problems not in `exclude` (same multiset of numbers and target), made in chunks
    with fixed seeds, taken in chunk order (the same result for any worker count)."""
    out, i = [], 0
    pool = Pool(workers) if workers > 1 else None
    try:
        while len(out) < n:
            k = math.ceil((n - len(out)) / CHUNK) + (1 if exclude else 0)
            jobs = [(seed, j) for j in range(i, i + k)]
            i += k
            for c in (pool.map(_chunk, jobs) if pool else map(_chunk, jobs)):
                out.extend(p for p in c if problem_key(p[0], p[1]) not in exclude)
    finally:
        if pool:
            pool.close()
            pool.join()
    return out[:n]


def encode(problems, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) right-padded; labels are -100 outside the response. Byte-level: id == byte."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    rows, starts = [], []
    for nums, target, sol in problems:
        prompt = f"{' '.join(map(str, nums))} -> {target}\n"
        resp = f"<answer>{sol}</answer>"
        rows.append(list(prompt.encode()) + list(resp.encode()) + [eos])
        starts.append(len(prompt.encode()))
    # the byte shortcut must equal the tokenizer + chat template
    for (nums, target, sol), r in zip(problems[:8], rows):
        msgs = evalmod.compact_messages(nums, target) + [{"role": "assistant", "content": f"<answer>{sol}</answer>"}]
        assert tok(tok.apply_chat_template(msgs, tokenize=False))["input_ids"] == r, "encoding mismatch"
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for k, (r, s) in enumerate(zip(rows, starts)):
        ids[k, :len(r)] = torch.tensor(r)
        labels[k, s:len(r)] = ids[k, s:len(r)]
    return ids, labels


def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=list(SIZES), default="countdown-tiny",
                    help="shape and recipe (the flags below override its values): " + "; ".join(
                        f"{name}: {', '.join(f'{k}={v}' for k, v in d.items())}" for name, d in SIZES.items()))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--problems", type=int, help="training problems (cycled in epochs)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--min-lr-ratio", type=float, default=0.0)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="deterministic kernels (torch.use_deterministic_algorithms, warn-only where an op has none)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast (default: on for cuda); weights stay fp32")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="data-generation processes")
    ap.add_argument("--exclude-generated", nargs="*", default=["42:10000", "43:1024"], metavar="SEED:N",
                    help="keep generate_problems(N, seed=SEED) out of the training data (default: countdown.load's "
                         "generated train and test sets)")
    ap.add_argument("--exclude-file", action="append", default=[], metavar="JSONL",
                    help="keep these nums/target rows out of the training data (e.g. the test split); repeatable")
    ap.add_argument("--data-cache", default=None, help="folder: reuse problems made with the same seed and count")
    ap.add_argument("--data-only", action="store_true", help="make (and cache) the problems, then stop")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-data", default=None, help="jsonl with nums/target: measure accuracy at the end")
    ap.add_argument("--eval-every", type=int, default=0, help="greedy accuracy on 256 eval problems every N steps")
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--save-at", default="", metavar="STEP,STEP",
                    help="also save the policy as it is after these steps, in OUT/step_N (weaker start policies: "
                         "each with its greedy accuracy on the first 256 --eval-data problems in training.json)")
    args = ap.parse_args(argv)
    for key, value in SIZES[args.size].items():  # what the command line leaves unset comes from --size
        if getattr(args, key) is None:
            setattr(args, key, value)

    from bapo_vl.tiny import build_qwen2

    t_start = time.time()
    if args.deterministic:  # before the first CUDA call: cuBLAS reads its workspace setting once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    bf16 = args.bf16 if args.bf16 is not None else device.type == "cuda"

    if not args.data_only:  # built first (it seeds torch itself), so an --out inside the wheel fails at once
        model, tok = build_qwen2(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                                 intermediate=args.intermediate, seed=args.seed, max_position_embeddings=256)
        n_params = sum(p.numel() for p in model.parameters())
        if n_params > MAX_PACKAGED_PARAMS and Path(args.out).resolve().is_relative_to(PACKAGED):
            raise SystemExit(f"--out {args.out} is inside {PACKAGED}, which the wheel packages, and this model has "
                             f"{n_params:,} parameters: build it outside (e.g. --out runs/policies/{args.size})")

    exclude = exclusion_set(args.exclude_generated, args.exclude_file)
    tag = hashlib.sha1(json.dumps(sorted(exclude)).encode()).hexdigest()[:10]
    cache = Path(args.data_cache) / f"countdown_seed{args.seed}_n{args.problems}_x{tag}.json" if args.data_cache else None
    if cache is not None and cache.exists():
        problems = [tuple(p) for p in json.loads(cache.read_text())]
    else:
        problems = make_problems(args.problems, args.seed, args.workers, exclude)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(problems))
            tmp.replace(cache)
    if args.data_only:
        print(f"{len(problems)} problems in {time.time() - t_start:.1f}s", flush=True)
        return None
    ids, labels = encode(problems, tok)
    print(f"problems {len(problems)} (made in {time.time() - t_start:.1f}s), width {ids.shape[1]}, "
          f"params {n_params:,}, device {device}, bf16 {bf16}", flush=True)
    ids, labels = ids.to(device), labels.to(device)
    model.to(device).train()

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator().manual_seed(args.seed)
    eval_problems = evalmod.load_problems(args.eval_data) if args.eval_data else None
    verify = evalmod.get_verify()

    save_at = sorted({int(x) for x in args.save_at.split(",") if x.strip()})
    if any(not 0 < x < args.steps for x in save_at):
        raise SystemExit(f"--save-at {args.save_at}: each step must be in 1..{args.steps - 1} (the last is --out)")
    perm, pos = torch.randperm(len(ids), generator=gen), 0
    ema, curve, log = None, [], []
    t0 = time.time()
    for step in range(args.steps):
        if pos + args.batch > len(perm):
            perm, pos = torch.randperm(len(ids), generator=gen), 0
        idx = perm[pos:pos + args.batch].to(device)
        pos += args.batch
        x, y = ids[idx], labels[idx]
        w = int((y != -100).nonzero()[:, 1].max()) + 1  # trim padding columns
        x, y = x[:, :w], y[:, :w]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup, args.min_lr_ratio)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 y[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            lv = loss.item()
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            line = f"step {step + 1}/{args.steps} loss {lv:.4f} lr {opt.param_groups[0]['lr']:.2e} " \
                   f"{time.time() - t0:.0f}s"
            log.append({"step": step + 1, "loss": round(lv, 5)})
            if eval_problems and args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                model.eval()
                r = evalmod.evaluate(model, tok, eval_problems[:256], samples=0, batch=256, verify=verify)
                model.train()
                curve.append({"step": step + 1, "greedy_acc_256": r["greedy_acc"]})
                line += f" greedy@256 {r['greedy_acc']:.3f}"
            print(line, flush=True)
        if step + 1 in save_at:
            save_snapshot(model, tok, Path(args.out) / f"step_{step + 1}", step + 1, eval_problems, verify, device)
    train_s = time.time() - t0
    final_loss = sum(d["loss"] for d in log[-3:]) / max(1, len(log[-3:]))

    model.eval()
    model.to("cpu").float()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)

    result = None
    if eval_problems:
        model.to(device)
        result = evalmod.evaluate(model, tok, eval_problems, samples=args.eval_samples, batch=1024
                                  if device.type == "cuda" else 256, seed=args.seed, verify=verify)
        model.to("cpu")
        print(json.dumps({k: v for k, v in result.items() if k != "greedy_examples"}), flush=True)

    command = "PYTHONPATH=. python scripts/train_default_policy.py " + " ".join(shlex.quote(a) for a in (
        argv if argv is not None else sys.argv[1:]))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    meta = {
        "command": command, "size": args.size, "name": out.name, "seed": args.seed, "steps": args.steps,
        "batch": args.batch,
        "problems": len(problems), "excluded": {"generated": args.exclude_generated, "files": args.exclude_file,
                                                 "problems": len(exclude)},
        "epochs": round(args.steps * args.batch / len(problems), 2),
        "shape": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "intermediate": args.intermediate, "vocab": len(tok)},
        "params": n_params, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "bf16_autocast": bf16, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "train_seconds": round(train_s, 1), "final_loss": round(final_loss, 5), "loss_log": log,
        "eval_curve": curve, "eval_data": args.eval_data, "eval": result,
    }
    (out / "training.json").write_text(json.dumps(meta, indent=1))
    (out / "TRAINING.md").write_text(training_md(meta, size))
    print(f"saved {out} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f}s", flush=True)
    return meta


def save_snapshot(model, tok, folder: Path, step: int, eval_problems, verify, device) -> None:
    """The policy after `step` steps as a policy folder of its own (fp32, as the final one), with its greedy
    accuracy on the first 256 eval problems; training continues on the same weights and optimizer."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    tok.save_pretrained(folder)
    meta = {"step": step}
    if eval_problems:
        model.eval()
        meta["greedy_acc_256"] = evalmod.evaluate(model, tok, eval_problems[:256], samples=0, batch=256,
                                                  verify=verify)["greedy_acc"]
        model.train()
    (folder / "training.json").write_text(json.dumps(meta, indent=1))
    print(f"saved {folder}: {meta}", flush=True)


def training_md(m: dict, size: int) -> str:
    s = m["shape"]
    lines = [
        f"# {m['name']}: a countdown policy (--size {m['size']})",
        "",
        "A small Qwen2-architecture causal LM (byte-level tokenizer with Qwen special tokens, `bapo_vl.tiny`) "
        "fine-tuned (SFT) on countdown problems made forward by `tasks/countdown/task.py:generate_problems` "
        "(no solver). Prompt: the user message `\"44 19 35 -> 98\"` (chat-rendered `44 19 35 -> 98\\n`); "
        "response `<answer>(44+19)+35</answer><|im_end|>`. It solves some problems, not most: room for RL.",
        "",
        "```",
        m["command"],
        "```",
        "",
        f"- seed {m['seed']}, {m['steps']} steps of batch {m['batch']} over {m['problems']:,} problems "
        f"({m['epochs']} epochs), none of them among the {m['excluded']['problems']:,} excluded problems "
        f"(same numbers and target: generated {', '.join(m['excluded']['generated']) or '-'}; files "
        f"{', '.join(Path(f).name for f in m['excluded']['files']) or '-'}); AdamW lr {m['lr']} (warm-up {m['warmup']}, cosine), weight decay "
        f"{m['weight_decay']}; loss on response tokens only",
        f"- shape: hidden {s['hidden']}, layers {s['layers']}, heads {s['heads']} (kv {s['kv_heads']}), "
        f"intermediate {s['intermediate']}, vocab {s['vocab']}, tied embeddings; {m['params']:,} parameters, "
        f"fp32 safetensors; folder {size / 1e6:.2f} MB",
        f"- trained on {m['device']}, bf16 autocast {m['bf16_autocast']}, torch {m['torch']}, transformers "
        f"{m['transformers']}, {m['train_seconds']} s",
        f"- final training loss (per response token) {m['final_loss']}",
    ]
    e = m.get("eval")
    if e:
        lines += [
            "",
            f"## Accuracy on `{Path(m['eval_data']).name}` ({e['n']} problems, compact prompt, "
            "verifier `bapo_vl.verifiers.countdown.verify`)",
            "",
            f"- greedy: {e['greedy_acc']:.1%} (3 numbers {e.get('greedy_acc_3nums', 0):.1%}, "
            f"4 numbers {e.get('greedy_acc_4nums', 0):.1%})",
        ]
        if e.get("samples"):
            k = e["samples"]
            lines += [
                f"- temperature 1, {k} samples: mean {e['sampled_mean_acc']:.1%}, pass@{k} {e[f'pass@{k}']:.1%}, "
                f"prompts with 1..{k - 1} correct {e['mixed_frac']:.1%}",
                f"- prompts by correct count 0..{k}: {e['correct_count_hist']}",
            ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
