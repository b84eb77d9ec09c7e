"""Accuracy of a causal-LM policy on countdown with the compact prompt (`"44 19 35 -> 98"` as the user message).

Greedy accuracy (batched `model.generate(do_sample=False)`), and with --samples K: K samples at temperature 1
(no top-k/top-p), mean accuracy, pass@K and the number of prompts by correct count 0..K.

    PYTHONPATH=. python scripts/eval_countdown_policy.py bapo_vl/policy/countdown-tiny \
        --data tinyzero_test_1024_base.jsonl --samples 8

--data is a JSONL of nums/target rows, e.g. TinyZero's countdown test split (`tinyzero_test_1024_base.jsonl`).

Correctness is the project's verifier `bapo_vl.verifiers.countdown.verify` (last <answer>...</answer>, each
number exactly once, exact value == target; nothing is evaluated by Python).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# The source tree keeps tasks/ and verifiers/ beside the package; installed, they are bapo_vl.tasks and
# bapo_vl.verifiers. With only PYTHONPATH=. (no install) map them by hand.
_ALIASES = {"bapo_vl.tasks": "tasks", "bapo_vl.verifiers": "verifiers", "bapo_vl.app": "app"}


def ensure_source_packages() -> None:
    import bapo_vl  # noqa: F401

    for name, folder in _ALIASES.items():
        if name in sys.modules:
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                continue
        except ImportError:
            pass
        init = ROOT / folder / "__init__.py"
        if not init.exists():
            continue
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(ROOT / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(sys.modules["bapo_vl"], name.rsplit(".", 1)[1], mod)


def get_verify():
    ensure_source_packages()
    from bapo_vl.verifiers.countdown import verify

    return verify


def compact_messages(nums, target) -> list[dict]:
    return [{"role": "user", "content": f"{' '.join(map(str, nums))} -> {target}"}]


def load_problems(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append({"nums": list(r["nums"]), "target": int(r["target"])})
    return rows[:limit] if limit else rows


@torch.no_grad()
def generate(model, tok, problems, *, samples: int = 1, do_sample: bool = False, batch: int = 256,
             max_new_tokens: int = 32, temperature: float = 1.0) -> list[list[str]]:
    """Responses (decoded new tokens) per problem: `samples` of them each. `batch` counts sequences."""
    device = next(model.parameters()).device
    texts = [tok.apply_chat_template(compact_messages(p["nums"], p["target"]), tokenize=False,
                                     add_generation_prompt=True) for p in problems]
    per = max(1, batch // samples)
    out: list[list[str]] = []
    old_side = tok.padding_side
    tok.padding_side = "left"
    try:
        for i in range(0, len(texts), per):
            enc = tok(texts[i:i + per], return_tensors="pt", padding=True).to(device)
            kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else \
                dict(do_sample=False, temperature=None, top_k=None, top_p=None)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, num_return_sequences=samples,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw)
            dec = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            for j in range(len(dec) // samples):
                out.append(dec[j * samples:(j + 1) * samples])
    finally:
        tok.padding_side = old_side
    return out


def evaluate(model, tok, problems, *, samples: int = 8, batch: int = 256, max_new_tokens: int = 32,
             seed: int = 0, verify=None) -> dict:
    """Greedy accuracy (overall and by count of numbers) and, with samples > 0, sampled statistics."""
    verify = verify or get_verify()
    model.eval()
    t0 = time.time()
    greedy = generate(model, tok, problems, batch=batch, max_new_tokens=max_new_tokens)
    ok = [verify(g[0], p).reward for g, p in zip(greedy, problems)]
    res = {"n": len(problems), "greedy_acc": sum(ok) / len(ok), "greedy_s": round(time.time() - t0, 2)}
    for k in (3, 4):
        sel = [o for o, p in zip(ok, problems) if len(p["nums"]) == k]
        if sel:
            res[f"greedy_acc_{k}nums"] = sum(sel) / len(sel)
    res["greedy_examples"] = [{"prompt": compact_messages(p["nums"], p["target"])[0]["content"], "response": g[0]}
                              for g, p in list(zip(greedy, problems))[:5]]
    if samples:
        t0 = time.time()
        torch.manual_seed(seed)
        sampled = generate(model, tok, problems, samples=samples, do_sample=True, batch=batch,
                           max_new_tokens=max_new_tokens)
        counts = [int(sum(verify(r, p).reward for r in rs)) for rs, p in zip(sampled, problems)]
        hist = [0] * (samples + 1)
        for c in counts:
            hist[c] += 1
        res.update({
            "samples": samples,
            "sampled_mean_acc": sum(counts) / (samples * len(counts)),
            f"pass@{samples}": sum(c > 0 for c in counts) / len(counts),
            "correct_count_hist": hist,
            "mixed_frac": sum(0 < c < samples for c in counts) / len(counts),
            "sampled_s": round(time.time() - t0, 2),
        })
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="folder saved with save_pretrained (model + tokenizer)")
    ap.add_argument("--data", required=True, help="JSONL of nums/target rows (e.g. TinyZero's countdown test split)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256, help="sequences per generate call")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    res = evaluate(model, tok, load_problems(args.data, args.limit), samples=args.samples, batch=args.batch,
                   max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
