"""Math word problems with a single final answer (DeepScaleR training data; AIME24, AMC23, MATH500, Minerva
and OlympiadBench for evaluation). The reward is whether the response's final answer equals the gold one.

Data layouts read by `load`:
  train   `source` = a DeepScaleR-style file: a .json array, .jsonl, or .parquet of rows with `problem` and
          `answer` (`question` / `final_answer` / a `solution` holding \\boxed{...} are accepted instead),
          or a folder of .parquet shards (HF datasets layout: train-*.parquet preferred when present).
  eval    `eval_dir` (else `source`) = a folder holding the published files, in either layout
            Qwen2.5-Math / simpleRL: aime24.jsonl amc23.jsonl math500.jsonl minerva_math.jsonl
                                      olympiadbench.jsonl   (or <name>/test.jsonl)
            DeepScaleR:               aime.json amc.json math.json minerva.json olympiad_bench.json
          or one such file (any file through `eval_dir`: a training file in `source` is refused, so one
          task_options {source: train file, eval_dir: folder} serves both training and `bapo eval`).
          When a folder holds both layouts the Qwen file wins.
          Sizes: aime24 30, amc23 40 (DeepScaleR's amc.json: 83 = AMC 2022 + 2023), math500 500,
          minerva 272, olympiadbench 675.

Gold answers are normalised to strings (see `normalise_answer`): numbers lose a zero fraction (27.0 -> "27"),
unescaped `$` math delimiters are dropped ("$\\frac{1}{2}$" -> "\\frac{1}{2}"; "\\$18.90" keeps its escaped
dollar; Minerva idx 72's \\boxed{} holds a stray "$ $"), a list (OlympiadBench's `final_answer`) becomes its
distinct items joined with ", "; meta["raw_answer"] keeps the original when it changed. Minerva's gold is the
last \\boxed{} of its `solution` in both layouts, as Qwen2.5-Math grades it: DeepScaleR's minerva.json also
has an `answer` list, but in some rows it holds the answer of a neighbouring subproblem (e.g. idx 57), so it
is kept only in meta["listed_answers"].
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from bapo_vl.datafiles import parse_rows, read_rows
from bapo_vl.problem import Problem
from bapo_vl.verifiers import math as verifiers_math
from bapo_vl.verifiers.latex import last_boxed  # also a gold answer's source: a solution's last \boxed{}
from bapo_vl.verifiers.math import VERIFIER_VERSION as VERSION  # noqa: F401  (recorded with each run)

NAME = "math"
log = logging.getLogger("bapo_vl.tasks.math")

R1_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
QWEN_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = {
    # DeepSeek-R1-Distill / DeepScaleR: the instruction follows the problem in the user turn, no system turn.
    "r1": lambda problem: [{"role": "user", "content": f"{problem} {R1_INSTRUCTION}"}],
    # Qwen2.5-Math's "qwen-boxed" prompt: the instruction is the system turn.
    "qwen_boxed": lambda problem: [{"role": "system", "content": QWEN_SYSTEM}, {"role": "user", "content": problem}],
    "plain": lambda problem: [{"role": "user", "content": problem}],
}

EVAL_SPLITS = ["aime24", "amc23", "math500", "minerva", "olympiadbench"]
# split -> file names tried in the eval folder, in order (Qwen2.5-Math/simpleRL first, then DeepScaleR)
EVAL_FILES = {
    "aime24": ["aime24.jsonl", "aime24/test.jsonl", "aime.json"],
    "amc23": ["amc23.jsonl", "amc23/test.jsonl", "amc.json"],
    "math500": ["math500.jsonl", "math500/test.jsonl", "math.json"],
    "minerva": ["minerva_math.jsonl", "minerva_math/test.jsonl", "minerva.jsonl", "minerva/test.jsonl",
                "minerva.json"],
    "olympiadbench": ["olympiadbench.jsonl", "olympiadbench/test.jsonl", "olympiad_bench.json"],
}
# the sizes of the published files; another size only logs a warning
EVAL_SIZES = {"aime24": {30}, "amc23": {40, 83}, "math500": {500}, "minerva": {272}, "olympiadbench": {674, 675}}

PROBLEM_FIELDS = ("problem", "question")
ANSWER_FIELDS = ("answer", "final_answer")
ID_FIELDS = ("id", "unique_id", "idx")  # the first one present names the row in its uid
META_FIELDS = ("level", "subject", "type", "subfield", "difficulty", "url", "year", "unit", "answer_type",
               "is_multiple_answer")


_DOLLAR = re.compile(r"(?<!\\)\$")


def normalise_answer(value, field: str = "answer") -> str:
    """A gold answer as a non-empty string; ValueError if it is not a string, finite number or list of them."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a string or number, got a bool")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"{field} is not finite: {value!r}")
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    if isinstance(value, str):
        text = _DOLLAR.sub("", value).strip()
        if not text:
            raise ValueError(f"{field} is empty")
        return text
    if isinstance(value, (list, tuple)):
        parts = []
        for item in value:
            if isinstance(item, (list, tuple)):
                raise ValueError(f"{field} must be a flat list, got a nested list")
            part = normalise_answer(item, field)
            if part not in parts:
                parts.append(part)
        if not parts:
            raise ValueError(f"{field} is an empty list")
        return ", ".join(parts)
    raise ValueError(f"{field} must be a string, number or list, got {type(value).__name__}")


def _missing(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _fields(row, split: str) -> tuple[str, str, dict]:
    """(problem text, gold answer, meta) of one row; ValueError if it is malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    problem = None
    for key in PROBLEM_FIELDS:
        value = row.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {type(value).__name__}")
        if not value.strip():
            raise ValueError(f"{key} is empty")
        problem = value.strip()
        break
    if problem is None:
        raise ValueError(f"no problem text (want a {' or '.join(map(repr, PROBLEM_FIELDS))} field)")

    meta, answer, raw = {}, None, None
    solution = row.get("solution")
    boxed = last_boxed(solution)
    if split == "minerva" and boxed:  # see the module docstring
        raw, meta["answer_field"] = boxed, "solution"
        if isinstance(row.get("answer"), list):
            meta["listed_answers"] = [str(a).strip() for a in row["answer"]]
    else:
        for key in ANSWER_FIELDS:
            if not _missing(row.get(key)) and row.get(key) != []:
                raw, meta["answer_field"] = row[key], key
                break
        else:
            if boxed:
                raw, meta["answer_field"] = boxed, "solution"
            elif solution is not None and not isinstance(solution, (str, list)):
                raise ValueError(f"solution must be a string, got {type(solution).__name__}")
    if raw is not None:
        answer = normalise_answer(raw, meta["answer_field"])
        if raw != answer:
            meta["raw_answer"] = raw
    if not answer:
        raise ValueError("no answer (want 'answer', 'final_answer' or a \\boxed{...} in 'solution')")

    for key in META_FIELDS:
        value = row.get(key)
        if value is not None and isinstance(value, (str, int, float, bool)):
            meta[key] = value
    if isinstance(row.get("error"), (str, int, float)):  # OlympiadBench: the numeric tolerance of the answer
        meta["tolerance"] = row["error"]
    return problem, answer, meta


def _row_id(row, index: int) -> str:
    if isinstance(row, dict):
        for key in ID_FIELDS:
            value = row.get(key)
            if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.strip()):
                return str(value).strip()
    return str(index)


def _shards(folder: Path, split: str) -> list[Path]:
    """The .parquet files of a folder (HF datasets layout), those named `<split>-*` / `<split>.parquet` /
    under a `<split>/` folder when there are any."""
    files = sorted(folder.rglob("*.parquet"))
    mine = [f for f in files if f.name.startswith((f"{split}-", f"{split}.", f"{split}_")) or f.parent.name == split]
    if not files:
        raise FileNotFoundError(f"math: no .parquet files in {folder}")
    return mine or files


def eval_file(split: str, source, any_name: bool = True) -> Path:
    """The file of eval `split` in folder `source` (either layout), or `source` itself if it is a file (with
    `any_name=False`, only a file named as published, so that a training file is never taken for eval data)."""
    path = Path(source)
    if path.is_file():
        name = path.name if path.name in EVAL_FILES[split] else f"{path.parent.name}/{path.name}"
        if not any_name and name not in EVAL_FILES[split]:
            raise ValueError(f"math: {path} is not named like a {split} file ({', '.join(EVAL_FILES[split])}); "
                             f"pass it as eval_dir= to evaluate on it anyway")
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"math: {split}: no file or folder {path}")
    for name in EVAL_FILES[split]:
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"math: {split}: none of {', '.join(EVAL_FILES[split])} in {path}")


def _records(files: list[Path], split: str, skip_bad: bool) -> list[tuple[str, str, dict, str]]:
    """(problem, answer, meta, uid key) of every well-formed row of `files`, in order; uid keys count rows
    across files, skipped ones included, so a skipped row never moves another's uid."""
    out, offset = [], 0
    for path in files:
        rows = read_rows(path)
        for i, row, (problem, answer, meta) in parse_rows(path, lambda r: _fields(r, split), skip_bad, "math", rows):
            out.append((problem, answer, {"split": split, "source": str(path), "row": i, **meta},
                        _row_id(row, offset + i)))
        offset += len(rows)
    return out


def load(split: str = "train", source: str | None = None, template: str = "r1", limit: int | None = None,
         skip_bad: bool = False, eval_dir: str | None = None, **_) -> list[Problem]:
    """Math problems of `split`: "train" from the DeepScaleR-style file (or folder of parquet shards) `source`,
    or one of EVAL_SPLITS from the folder `eval_dir` (else `source`) in either published layout, or from one
    file (see the module docstring). `template`: a key of TEMPLATES. `limit`: the first `limit` problems.
    `skip_bad`: skip malformed rows (logging how many) instead of raising ValueError naming file and row.
    uid: `math-{split}-{id}`, the row's `id` / `unique_id` / `idx` when it has one, else its 0-based position in
    the file (across shards, in file order; skipped rows keep theirs, so the others' uids do not move);
    repeats within a load get `#2`, `#3`, ... in file order."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; have {', '.join(TEMPLATES)}")
    if split != "train" and split not in EVAL_SPLITS:
        raise ValueError(f"unknown split {split!r}; have train, {', '.join(EVAL_SPLITS)}")
    if split == "train":
        if source is None:
            raise ValueError("math needs a training file: pass task_options.source=path/to/deepscaler.json "
                             "(a .json array, .jsonl or .parquet with problem/answer fields, or a folder of "
                             ".parquet shards)")
        path = Path(source)
        if path.is_dir():
            files = _shards(path, split)
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"math: no file or folder {path}")
    else:
        where = eval_dir if eval_dir is not None else source
        if where is None:
            raise ValueError(f"math: split {split!r} needs the eval data: pass task_options.eval_dir (or source)="
                             f"a folder with {EVAL_FILES[split][0]} (Qwen2.5-Math layout) or "
                             f"{EVAL_FILES[split][-1]} (DeepScaleR layout)")
        files = [eval_file(split, where, any_name=eval_dir is not None)]

    records = _records(files, split, skip_bad)
    if split in EVAL_SIZES and len(records) not in EVAL_SIZES[split]:
        log.warning("math: %s has %d problems (the published files have %s)", split, len(records),
                    " or ".join(map(str, sorted(EVAL_SIZES[split]))))
    problems, seen = [], {}
    for problem, answer, meta, row_id in records:
        uid = f"math-{split}-{row_id}"
        seen[uid] = seen.get(uid, 0) + 1
        if seen[uid] > 1:
            uid = f"{uid}#{seen[uid]}"
        problems.append(Problem(uid=uid, messages=TEMPLATES[template](problem), answer=answer, meta=meta))
    return problems[:limit] if limit is not None else problems


def verify(response: str, answer):
    """The math verifier's verdict."""
    return verifiers_math.verify(response, answer)


def verify_batch(responses: list[str], answers: list):
    """Many verdicts: the symbolic checks run in parallel over the sandbox workers."""
    return verifiers_math.verify_batch(responses, answers)
