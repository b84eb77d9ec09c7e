"""Our Problems <-> verl 0.9.1's RLHFDataset row schema, and our verifiers behind verl's custom reward hook.

A verl row (what `examples/data_preprocess/*.py` write and `verl.utils.dataset.rl_dataset.RLHFDataset` reads):

    data_source   "bapo_vl/<task>"  (compute_score finds our task plugin from it)
    prompt        chat messages; string contents, one `<image>` placeholder per image, in order
    images        [{"bytes": PNG, "path": None}, ...] in parquet, PIL images in memory (geometry3k only)
    ability       "math" | "countdown" | "geometry"
    reward_model  {"style": "rule", "ground_truth": JSON of Problem.answer}
    extra_info    {"uid", "index", "split", "task", "answer": JSON, "question"}

The answer is stored as JSON text, so dict answers (geometry3k: letter, value, choices) survive parquet unchanged.

`compute_score(data_source, solution_str, ground_truth, extra_info)` is the function to name in
`reward.custom_reward_function.{path,name}`: it calls OUR task's verifier and returns
{"score": 0/1 accuracy, "acc": 0/1, "verdict": str}. BAPO reads the 0/1 accuracy only, never a shaped score
(verl's own geo3k score gives 0.1 for a well-formatted wrong answer).
"""
from __future__ import annotations

import io
import json
from functools import lru_cache
from pathlib import Path

from bapo_vl.problem import Problem, Verdict

SOURCE_PREFIX = "bapo_vl/"
ABILITY = {"countdown": "countdown", "math": "math", "geometry3k": "geometry"}


def _content_to_text(content) -> str:
    """A message's content as text, each image part replaced by `<image>` (RLHFDataset turns it back)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type")
        if kind in ("image", "image_url"):
            parts.append("<image>")
        elif kind == "video":
            parts.append("<video>")
        elif kind == "text":
            parts.append(part["text"])
        else:
            raise ValueError(f"message part of type {kind!r} has no verl placeholder")
    return "".join(parts)


def _image_bytes(image) -> dict:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def problem_to_row(problem: Problem, task: str, index: int, images_as_bytes: bool = False) -> dict:
    """One verl row. `images_as_bytes`: PNG dicts for parquet; otherwise the PIL images themselves."""
    messages = [{"role": m["role"], "content": _content_to_text(m["content"])} for m in problem.messages]
    n_placeholders = sum(m["content"].count("<image>") for m in messages)
    if n_placeholders != len(problem.images):
        raise ValueError(f"{problem.uid}: {n_placeholders} <image> placeholders for {len(problem.images)} images")
    answer = json.dumps(problem.answer, sort_keys=True)
    row = {
        "data_source": SOURCE_PREFIX + task,
        "prompt": messages,
        "ability": ABILITY.get(task, task),
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"uid": problem.uid, "index": index, "split": str(problem.meta.get("split", "train")),
                       "task": task, "answer": answer, "question": problem.text},
    }
    if problem.images:
        row["images"] = [_image_bytes(im) if images_as_bytes else im for im in problem.images]
    return row


def row_to_problem(row: dict) -> Problem:
    """Back from a verl row (as written by problem_to_row, or as RLHFDataset returns it with `raw_prompt`)."""
    from PIL import Image

    extra = row["extra_info"]
    messages = row.get("raw_prompt", row.get("prompt"))
    images = []
    out_messages = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            import re
            segments = [s for s in re.split("(<image>)", content) if s]
            if "<image>" not in segments:
                out_messages.append({"role": m["role"], "content": content})
                continue
            content = [{"type": "image"} if s == "<image>" else {"type": "text", "text": s} for s in segments]
        else:  # RLHFDataset's structured parts: {"type": "image", "image": PIL}
            parts = []
            for part in content:
                if part.get("type") == "image":
                    if "image" in part and not isinstance(part["image"], (str, bytes)):
                        images.append(part["image"])
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            content = parts
        out_messages.append({"role": m["role"], "content": content})
    for im in row.get("images") or []:
        images.append(Image.open(io.BytesIO(im["bytes"])).convert("RGB") if isinstance(im, dict) else im)
    return Problem(extra["uid"], out_messages, json.loads(extra["answer"]), images,
                   {"split": extra.get("split", "train")})


def problems_to_rows(problems: list[Problem], task: str, images_as_bytes: bool = False) -> list[dict]:
    return [problem_to_row(p, task, i, images_as_bytes) for i, p in enumerate(problems)]


def write_parquet(problems: list[Problem], path, task: str) -> Path:
    """verl parquet (data.train_files / data.val_files) for `problems` of `task`."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = problems_to_rows(problems, task, images_as_bytes=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


# --- verl's custom reward function hook ----------------------------------------------------------------------

@lru_cache(maxsize=None)
def _task(name: str, tasks_dirs: tuple = ()):
    from bapo_vl.plugins import get_task

    return get_task(name, list(tasks_dirs))


def compute_score(data_source, solution_str, ground_truth, extra_info=None, tasks_dirs=(), **kwargs) -> dict:
    """verl `reward.custom_reward_function` entry: our verifier's verdict as a 0/1 accuracy.
    `score` is the accuracy itself (no format bonus), `acc` the same for verl's metrics, `verdict` its name."""
    name = (extra_info or {}).get("task") or str(data_source).removeprefix(SOURCE_PREFIX)
    task = _task(name, tuple(tasks_dirs or ()))
    answer = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    try:
        verdict = task.verify(solution_str, answer)
        verdict = Verdict.of(verdict)
    except Exception:  # noqa: BLE001 - model output is hostile input; same rule as trainer.verify_safely
        verdict = Verdict.UNPARSABLE
    acc = verdict.reward
    return {"score": acc, "acc": acc, "verdict": verdict.value}


def main(argv=None):
    """`python -m bapo_vl.backends.verl_data TASK OUT.parquet [key=value task options]`: convert a task's split."""
    import argparse

    from bapo_vl.plugins import get_task

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("task")
    ap.add_argument("out")
    ap.add_argument("--split", default="train")
    ap.add_argument("options", nargs="*", help="task options, key=value (e.g. source=path limit=1000)")
    args = ap.parse_args(argv)
    import yaml
    options = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in args.options)}
    problems = get_task(args.task).load(split=args.split, **options)
    print(write_parquet(problems, args.out, args.task), len(problems), "rows")


if __name__ == "__main__":
    main()
