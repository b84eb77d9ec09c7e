"""Geometry3K (Inter-GPS, Lu et al. 2021): a diagram, a question and four choices A-D.

`load(split, source)` reads any of these layouts (detected from `source`):

  Inter-GPS  <source>/<split>/<id>/data.json + img_diagram.png: the official train/val/test.zip.
  jsonl      <source>/<split>.jsonl, or a .jsonl file: one data.json per line, plus `id` and `image` (a path
             relative to the file's folder).
  parquet    a .parquet file, <source>/<split>.parquet or <source>/data/<split>-*.parquet: the Hugging Face
             layout of hiyouga/geometry3k, which verl's and EasyR1's geo3k examples use. Its dataset card lists
             the columns images (a list of images, each a {bytes, path} dict or raw bytes), problem (the
             question with an `<image>` placeholder), answer (the right choice's VALUE, e.g. "3", not a letter)
             and, in the current version, id, choices and ground_truth (the letter). Copies of the older version
             (images/problem/answer only) have no choices: those problems are asked for a value (template
             "value"), and a letter in the response is UNPARSABLE. A letter A-D in `answer` or `ground_truth`
             is used as the letter; verl-preprocessed rows (prompt, reward_model.ground_truth, extra_info.index
             /question) load too. When a directory holds both Inter-GPS folders and <split>.jsonl, the folders
             are read. Split "val" also finds files named "validation" (Hugging Face's name) and back.

Each Problem: uid `geometry3k-{split}-{id}` (a repeated id gets #2, #3... in file order); images = [the diagram as
a PIL RGB image]; answer = {"letter": "C", "value": "15", "choices": [...], "precise_values": [...]} where value is
the right choice's text and precise_values the dataset's numeric value of each choice (None where absent or not a
number), except where the choice's TEXT reads as a number and the two disagree: there the text's value (4 of the
3,002 problems, listed in TEXT_OVER_PRECISE; the mixed numbers of test 2885 among them); meta = {split, id,
choices, template, origin}. Choices are kept as the dataset writes them (Inter-GPS: "2 \\sqrt { 3 }"). A problem
with no known choices has letter None or value None as its row gives.

Malformed rows (no question, no or bad answer, answer not among the choices, missing or unreadable image, wrong
types) raise ValueError naming the data.json or the file and 0-based row; with skip_bad=True they are skipped and
their number logged as a warning.

Prompt length: images become many tokens (EasyR1 #267). `check_prompt_fits(problem, processor, max_prompt_length)`
counts a prompt's tokens, images included, and names the problem when it is too long.
"""
from __future__ import annotations

import io
import itertools
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from bapo_vl.problem import Problem
from bapo_vl.verifiers.choice import choice_values, normalize, parse_number
from bapo_vl.verifiers.choice import verify as verify_choice

NAME = "geometry3k"
# letter-or-value verdicts over bapo_vl.verifiers.choice; bump when they can change
VERSION = "geometry3k-1.3"  # 1.1: exact values, single nearest choice, hedged letters; 1.2: unit words only;
# 1.3: mixed numbers (choices and responses), chains "12 = 10" right in every side, nested boxes, "9.80^\circ"
EVAL_SPLITS = ["test"]  # the 601 test problems the Inter-GPS paper and BAPO report on
LETTERS = "ABCD"
TEMPLATES = ("letter", "value")
INSTRUCTION = ("Answer with the letter of the correct choice. Think step by step, then give the final "
               "letter inside <answer> </answer> tags, e.g. <answer>A</answer>.")
VALUE_INSTRUCTION = ("Think step by step, then give the final answer (a number or expression, without units) "
                     "inside \\boxed{}, e.g. \\boxed{12}.")
DECODE_THREADS = min(8, os.cpu_count() or 1)
CHUNK = 64  # rows read (and diagrams decoded) at a time
SPLIT_ALIASES = {"val": ("val", "validation"), "validation": ("validation", "val")}
log = logging.getLogger("bapo_vl.tasks.geometry3k")


def make_messages(question: str, choices: list[str] | None, template: str = "letter", n_images: int = 1) -> list[dict]:
    """One user turn: the image part(s), then the question, the choices A-D and the instruction ("letter"), or
    the question and a request for the value in \\boxed{} ("value")."""
    if template == "letter":
        text = question
        if choices:
            text += "\nChoices:\n" + "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices))
        text += "\n" + INSTRUCTION
    else:
        text = f"{question}\n{VALUE_INSTRUCTION}"
    return [{"role": "user", "content": [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]}]


# --- rows -> fields -------------------------------------------------------------------------------------------

def _is_letter(x) -> bool:
    return isinstance(x, str) and len(x.strip()) == 1 and x.strip() in LETTERS


def _match_value(value, choices: list[str]) -> int:
    """Index of the (first) choice whose text or number is `value`; ValueError if there is none."""
    key = normalize(value)
    hits = [i for i, c in enumerate(choices) if normalize(c) == key]
    if not hits:
        x = parse_number(str(value))
        numbers = choice_values(choices)
        hits = [i for i, v in enumerate(numbers) if x is not None and v is not None and abs(v - x) <= 1e-6 * max(1, abs(x))]
    if not hits:
        raise ValueError(f"answer {value!r} is none of the choices {choices}")
    return hits[0]


# Where Geometry3K's precise_value disagrees with its choice's text (all splits, checked against the Inter-GPS
# data by tests/test_geometry3k.py): the text is what the model reads, so the text's value wins.
TEXT_OVER_PRECISE = {
    "test/2885": "mixed numbers read as products: 1 5/6, 4 4/11, 14 2/3 have 5/6, 16/11, 28/3 (not 11/6, 48/11, "
                 "44/3)",
    "train/798": '"- 3" has -2',
    "train/1743": '"- 8" has -7',
    "val/2315": '"- 3" and "- 1" have -2 and 0',
}


def _precise_values(choices: list[str] | None, precise: list[float | None]) -> list[float | None]:
    """The dataset's precise value of each choice, replaced by the value of the choice's text where that text
    reads as a number of another value (TEXT_OVER_PRECISE: "4 \\frac { 4 } { 11 }" has 16/11, the text 48/11)."""
    if not choices:
        return precise
    out = []
    for text, p in zip(choices, precise):
        v = parse_number(text)
        out.append(v if v is not None and p is not None and abs(v - p) > 1e-6 * max(1.0, abs(v)) else p)
    return out


def _image_sources(row: dict) -> list:
    images = row.get("images", row.get("image"))
    if images is None:
        raise ValueError("no image (want `images` or `image`)")
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ValueError("empty image list")
    return list(images)


def _fields(row, fallback_id) -> dict:
    """The parts of a raw Inter-GPS, jsonl, hiyouga or verl row; ValueError if malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    reward = row.get("reward_model") if isinstance(row.get("reward_model"), dict) else {}
    question = row.get("problem_text", row.get("problem", extra.get("question")))
    if question is None and isinstance(row.get("prompt"), list) and row["prompt"]:
        question = (row["prompt"][-1] or {}).get("content") if isinstance(row["prompt"][-1], dict) else None
    if not isinstance(question, str) or not question.replace("<image>", "").strip():
        raise ValueError(f"question (problem_text / problem) must be a non-empty string, got {question!r}")
    question = re.sub(r"\s*<image>\s*", " ", question).strip()

    choices = row.get("choices")
    if choices is not None:
        if (not isinstance(choices, (list, tuple)) or not 2 <= len(choices) <= len(LETTERS)
                or not all(isinstance(c, str) and c.strip() for c in choices)):
            raise ValueError(f"choices must be a list of 2-{len(LETTERS)} non-empty strings, got {choices!r}")
        choices = list(choices)

    given = [row.get("ground_truth"), row.get("answer"), reward.get("ground_truth"), extra.get("answer")]
    given = [g for g in given if g is not None]
    if not given:
        raise ValueError("no answer (want `answer`, `ground_truth` or reward_model.ground_truth)")
    for g in given:
        if not isinstance(g, (str, int, float)) or isinstance(g, bool) or (isinstance(g, str) and not g.strip()):
            raise ValueError(f"answer must be a non-empty string or a number, got {g!r}")
    letter = next((g.strip() for g in given if _is_letter(g)), None)
    value = next((str(g).strip() for g in given if not _is_letter(g)), None)
    if choices:
        if letter is not None:
            if LETTERS.index(letter) >= len(choices):
                raise ValueError(f"answer {letter!r} is not one of the {len(choices)} choices")
        else:
            letter = LETTERS[_match_value(value, choices)]
        value = choices[LETTERS.index(letter)]

    precise = row.get("precise_value")
    if precise is not None:
        if not isinstance(precise, (list, tuple)) or (choices and len(precise) != len(choices)):
            raise ValueError(f"precise_value must be a list with one entry per choice, got {precise!r}")
        precise = [float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else None for p in precise]
        precise = _precise_values(choices, precise)

    qid = row.get("id", extra.get("index", fallback_id))
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or not re.fullmatch(r"[\w.-]+", str(qid)):
        raise ValueError(f"id must be an integer or a simple name, got {qid!r}")
    return {"id": str(qid), "question": question, "choices": choices, "letter": letter, "value": value,
            "precise_values": precise, "images": _image_sources(row)}


def _to_rgb(im: Image.Image) -> Image.Image:
    """RGB, with transparent parts on white (as transformers' convert_rgb does): almost every Geometry3K diagram
    is an opaque RGBA PNG, for which this is a plain conversion."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        if rgba.getchannel("A").getextrema()[0] < 255:
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            white.alpha_composite(rgba)
            rgba = white
        return rgba.convert("RGB")
    return im.convert("RGB")


def _open_image(src, base: Path) -> Image.Image:
    """A {bytes, path} dict, raw bytes, or a path (relative to `base`) -> a decoded PIL RGB image."""
    if isinstance(src, dict):
        data, path = src.get("bytes"), src.get("path")
        src = data if data else path
    if isinstance(src, (bytes, bytearray, memoryview)):
        what, fp = f"image bytes ({len(src)} B)", io.BytesIO(bytes(src))
    elif isinstance(src, (str, Path)) and str(src):
        path = base / src
        if not path.is_file():
            raise ValueError(f"image {path} is missing")
        what, fp = f"image {path}", path
    else:
        raise ValueError(f"image must be bytes, a path or a {{bytes, path}} dict, got {type(src).__name__}")
    try:
        with Image.open(fp) as im:
            image = _to_rgb(im)
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError (truncated), SyntaxError, ...
        raise ValueError(f"{what} is unreadable: {type(e).__name__}: {e}") from None
    if image.width < 1 or image.height < 1:
        raise ValueError(f"{what} is empty")
    return image


# --- layouts --------------------------------------------------------------------------------------------------

def _split_names(split: str) -> tuple[str, ...]:
    return SPLIT_ALIASES.get(split, (split,))


def _intergps_rows(root: Path):
    """(origin, row or Exception, image base, fallback id) of each <root>/<id>/data.json, by numeric id."""
    folders = [d for d in root.iterdir() if d.is_dir() and (d / "data.json").is_file()]
    folders.sort(key=lambda d: (0, int(d.name), "") if d.name.isdigit() else (1, 0, d.name))
    for folder in folders:
        path = folder / "data.json"
        try:
            row = json.loads(path.read_text())
            if isinstance(row, dict):
                # the image path is relative to the folder (the image base): a path with the folder in it
                # would be joined twice when `source` is relative
                row = {**row, "id": row.get("id", folder.name), "image": "img_diagram.png"}
                if str(row["id"]) != folder.name:
                    raise ValueError(f"id {row['id']!r} differs from its folder name {folder.name!r}")
        except (ValueError, OSError) as e:
            row = ValueError(f"{type(e).__name__}: {e}")
        yield str(path), row, folder, folder.name


def _jsonl_rows(path: Path):
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row = ValueError(f"invalid JSON: {e}")
            yield f"{path}: row {i} (0-based)", row, path.parent, i


def _parquet_rows(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is a dependency of the trainer's data loaders
        raise ImportError("reading geometry3k parquet files needs pyarrow (pip install pyarrow)") from e
    i = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
        for row in batch.to_pylist():
            yield f"{path}: row {i} (0-based)", row, path.parent, i
            i += 1


def _rows(source, split: str):
    """The rows of `split` in `source` (a folder in any layout, a .jsonl or a .parquet file)."""
    src = Path(source)
    if src.is_file():
        if src.suffix == ".parquet":
            return _parquet_rows(src)
        if src.suffix in (".jsonl", ".json"):
            return _jsonl_rows(src)
        raise ValueError(f"geometry3k: {src}: unsupported file type (want .jsonl or .parquet, or a folder)")
    if not src.is_dir():
        raise FileNotFoundError(f"geometry3k: source {src} does not exist")
    names = _split_names(split)
    for name in names:
        if (src / name).is_dir() and any((d / "data.json").is_file() for d in (src / name).iterdir()):
            return _intergps_rows(src / name)
    for name in names:
        if (src / f"{name}.jsonl").is_file():
            return _jsonl_rows(src / f"{name}.jsonl")
    for name in names:
        if (src / f"{name}.parquet").is_file():
            return _parquet_rows(src / f"{name}.parquet")
        shards = sorted((src / "data").glob(f"{name}-*.parquet")) if (src / "data").is_dir() else []
        if shards:
            return (r for shard in shards for r in _parquet_rows(shard))
    raise FileNotFoundError(
        f"geometry3k: no split {split!r} in {src}: want {split}/<id>/data.json (Inter-GPS), {split}.jsonl, "
        f"{split}.parquet or data/{split}-*.parquet (Hugging Face)")


def load(split: str = "train", source: str | None = None, limit: int | None = None, skip_bad: bool = False,
         template: str = "letter", **_) -> list[Problem]:
    """The problems of `split` from `source` (see the module doc), the first `limit` well-formed ones if set."""
    if template not in TEMPLATES:
        raise ValueError(f"geometry3k: unknown template {template!r}; have {', '.join(TEMPLATES)}")
    if source is None:
        raise ValueError("geometry3k needs task_options.source: a folder with train/ val/ test/ subfolders "
                         "in the Inter-GPS layout (<split>/<id>/data.json + img_diagram.png), <split>.jsonl files, "
                         "or a .parquet file in the hiyouga/geometry3k layout")
    problems, seen, bad, switched = [], {}, 0, 0
    rows = _rows(source, split)
    # PNG decoding runs in threads: PIL releases the GIL while it decodes
    with ThreadPoolExecutor(max_workers=DECODE_THREADS) as pool:
        while limit is None or len(problems) < limit:
            chunk = list(itertools.islice(rows, CHUNK if limit is None else min(CHUNK, limit - len(problems))))
            if not chunk:
                break
            jobs = []
            for origin, row, base, fallback_id in chunk:
                try:
                    if isinstance(row, Exception):
                        raise row
                    f = _fields(row, fallback_id)
                    jobs.append((origin, f, [pool.submit(_open_image, src, base) for src in f["images"]]))
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    jobs.append((origin, e, []))
            for origin, f, futures in jobs:
                try:
                    if isinstance(f, Exception):
                        raise f
                    images = [future.result() for future in futures]
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    if not skip_bad:
                        for _, _, later in jobs:
                            for future in later:
                                future.cancel()
                        raise ValueError(f"geometry3k: {origin}: {e}") from None
                    bad += 1
                    continue
                # a letter prompt needs a letter; a value prompt needs a value
                use = template
                if use == "letter" and f["letter"] is None:
                    use = "value"
                elif use == "value" and f["value"] is None:
                    use = "letter"
                switched += use != template
                uid = f"geometry3k-{split}-{f['id']}"
                seen[uid] = seen.get(uid, 0) + 1
                if seen[uid] > 1:
                    uid = f"{uid}#{seen[uid]}"
                answer = {"letter": f["letter"], "value": f["value"], "choices": f["choices"],
                          "precise_values": f["precise_values"]}
                problems.append(Problem(
                    uid=uid, messages=make_messages(f["question"], f["choices"], use, len(images)), answer=answer,
                    images=images, meta={"split": split, "id": f["id"], "choices": f["choices"], "template": use,
                                         "origin": origin}))
    if bad:
        log.warning("geometry3k: skipped %d malformed problem(s) of %s (split %s)", bad, source, split)
    if switched:
        log.warning("geometry3k: %d problem(s) lack a %s, so they use the other template", switched,
                    "letter" if template == "letter" else "value")
    return problems


def verify(response: str, answer):
    return verify_choice(response, answer)


def check_prompt_fits(problem: Problem, processor, max_prompt_length: int) -> int:
    """The number of tokens of `problem`'s chat-formatted prompt, its image tokens included (what the embedded
    backend's encode() makes of it); ValueError naming the problem when that is more than max_prompt_length."""
    images = problem.images or None
    if hasattr(processor, "image_processor"):
        text = processor.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
        ids = processor(text=[text], images=images, return_tensors="np")["input_ids"][0]
        image_token = getattr(processor, "image_token", None)
        tokenizer = processor.tokenizer
    else:  # a text tokenizer: the images are not seen
        text = processor.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
        ids = processor(text, add_special_tokens=False)["input_ids"]
        image_token, tokenizer = None, processor
    n = len(ids)
    if n > max_prompt_length:
        n_image = 0
        if image_token is not None:
            image_id = tokenizer.convert_tokens_to_ids(image_token)
            n_image = sum(1 for t in ids if t == image_id)
        raise ValueError(f"prompt {problem.uid} has {n} tokens ({n_image} of them image tokens), more than "
                         f"max_prompt_length={max_prompt_length}: lower max_pixels (fewer image tokens) or raise "
                         f"max_prompt_length")
    return n
