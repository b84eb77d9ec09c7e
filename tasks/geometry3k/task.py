"""Geometry3K (Inter-GPS): a diagram, a question and four choices; the reward is the right letter."""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from bapo_vl.problem import Problem
from bapo_vl.verifiers.choice import verify as verify_choice

NAME = "geometry3k"
LETTERS = "ABCD"
INSTRUCTION = ("Answer with the letter of the correct choice. Think step by step, then give the final "
               "letter inside <answer> </answer> tags, e.g. <answer>A</answer>.")


def make_messages(question: str, choices: list[str]) -> list[dict]:
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices))
    text = f"{question}\nChoices:\n{options}\n{INSTRUCTION}"
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def load(split: str = "train", source: str | None = None, limit: int | None = None) -> list[Problem]:
    """Inter-GPS layout: `source/<split>/<id>/data.json` with `img_diagram.png` beside it."""
    if source is None:
        raise ValueError("geometry3k needs task_options.source: a folder with train/ val/ test/ subfolders "
                         "in the Inter-GPS layout (<split>/<id>/data.json + img_diagram.png)")
    root = Path(source) / split
    if not root.is_dir():
        raise FileNotFoundError(f"geometry3k: no folder {root}")
    folders = sorted((d for d in root.iterdir() if (d / "data.json").is_file()), key=lambda d: int(d.name))
    problems = []
    for folder in folders[:limit]:
        try:
            row = json.loads((folder / "data.json").read_text())
            image = Image.open(folder / "img_diagram.png").convert("RGB")
            question, choices, answer = row["problem_text"], row["choices"], row["answer"]
        except Exception as e:
            raise ValueError(f"geometry3k: bad problem {folder}: {type(e).__name__}: {e}") from e
        if answer not in LETTERS[:len(choices)]:
            raise ValueError(f"geometry3k: {folder / 'data.json'}: answer {answer!r} is not a choice letter")
        problems.append(Problem(uid=f"geometry3k-{split}-{folder.name}", messages=make_messages(question, choices),
                                answer=answer, images=[image], meta={"choices": choices, "split": split}))
    return problems


def verify(response: str, answer: str):
    return verify_choice(response, answer)
