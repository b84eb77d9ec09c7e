"""Train a geodraw start policy from scratch: a small Qwen2.5-VL-architecture model (bapo_vl.tiny.build_qwen2_5_vl,
byte-level tokenizer) that answers geodraw problems (tasks/geodraw/task.py: drawn geometry diagrams, the numbers
only in the image, four choices A-D). `--size geodraw-tiny` is for tests (a few hundred K parameters);
`--size geodraw-30m` (~32 M parameters) is the start policy for vision-language RL, trained on one GPU into a folder
outside bapo_vl/ and passed as model=. Shape and recipe flags override the size's values.

Supervised fine-tuning (seeded; --deterministic, on by default, asks torch for deterministic kernels, as CUDA's
fastest ones make two runs of one command drift apart) on the geodraw train split. `--data fresh` (the default)
draws every example anew (FreshProblems: chunks of `load(split="train", seed=...)` drawn and encoded by
--data-workers processes while the GPU trains), so the model cannot learn the training diagrams by heart;
`--data fixed` encodes --problems problems once and cycles them. The prompt is rendered exactly as the embedded
backend renders it at RL time (EmbeddedBackend.encode: processor.apply_chat_template(messages,
add_generation_prompt=True) then processor(text, images)); the response (--target read) first copies the numbers
written in the diagram, then the value, then the letter the choice verifier grades:

    prompt    <|vision_start|><|image_pad|>x64<|vision_end|>Find x.\\nChoices:\\nA. 35 ... e.g. <answer>A</answer>.\\n
    response  40 65 -> 75 <answer>C</answer><|im_end|>

The loss is on response tokens only (eos included), plus --glyph-loss times the glyph loss: a linear probe on the
image tokens (GlyphHead, training only, not saved) names the character drawn in each image patch, so every digit in
the diagram is supervised where it lies, not only through the response; AdamW, linear warm-up then cosine decay, grad-clip 1, bf16
autocast on CUDA (weights fp32); the vision tower attends through bapo_vl.vision_attention (one attention call per
layer for the whole batch of images). --max-seconds stops training when the wall time passes it; the model is
then still saved and evaluated. At the end: greedy accuracy (through the real verifier, by kind) on the first
--eval-problems of the held-out test split, and on the same problems with blank images (the image-blind control,
~25 %). Saves model + processor (save_pretrained, fp32) to --out with TRAINING.md and training.json. RL then runs with

    bapo train task=geodraw model=OUT max_pixels=50176      # 224*224: the processor keeps the 224 px image

    PYTHONPATH=. python scripts/train_vl_policy.py --size geodraw-30m --out runs/policies/geodraw-30m-stage1 \\
        --data-workers 14 --no-deterministic                  # one GPU

The start policy of the RL studies is two such runs, the second trained further from the first at a restarted
learning rate: `bash scripts/build_geodraw_policy.sh FOLDER` (its card: docs/study/geodraw-30m/policy-e).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bapo_vl.backends.embedded import compile_blocks  # noqa: E402
from bapo_vl.mrope import PromptPositions, VisionInputs, batch_positions  # noqa: E402

# --size: shape and recipe (text: hidden/layers/heads/kv_heads/intermediate; vision tower: vision_*)
SIZES = {
    "geodraw-tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256, vision_depth=2,
                         vision_hidden=64, vision_heads=2, vision_intermediate=128,
                         vision_full_attention=False, steps=200, batch=16, problems=2000, lr=2e-3, warmup=20,
                         glyph_loss=1.0),
    "geodraw-30m": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536, vision_depth=6,
                        vision_hidden=256, vision_heads=4, vision_intermediate=1024,
                        vision_full_attention=True, steps=2400, batch=192, problems=24_000, lr=1.5e-3, warmup=100,
                        glyph_loss=0.3),
}
SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vision_depth", "vision_hidden",
              "vision_heads", "vision_intermediate")
PACKAGED = ROOT / "bapo_vl"  # everything under it goes into the wheel
MAX_PACKAGED_PARAMS = 2_000_000
EVAL_DURING = 128  # --eval-every: greedy accuracy on the first 128 test problems
TEST_SEED = 0  # the test set `bapo eval` / RL evaluation loads (task seed 0)


def get_task():
    from bapo_vl.plugins import get_task as _get

    return _get("geodraw")


TARGETS = ("read", "letter")


@functools.lru_cache(maxsize=512)
def _layout(spec_json: str, image_size: int) -> dict:
    return get_task().module.layout(json.loads(spec_json), image_size)


def layout(spec: dict, image_size: int) -> dict:
    """geodraw's layout() of a diagram, drawn once for the response and the glyph labels of one problem."""
    return _layout(json.dumps(spec, sort_keys=True), image_size)


def written_numbers(spec: dict, image_size: int = 224) -> list[str]:
    """The numbers written in a geodraw diagram, left to right (what a reader of the image must find, in an order
    the image itself shows)."""
    labels = sorted(layout(spec, image_size)["labels"], key=lambda lab: (lab[1], lab[2]))
    return [t.rstrip("°") for t, _, _ in labels if t.rstrip("°").isdigit()]


# --glyph-loss: every image patch's class, predicted from the image tokens the language model reads
GLYPHS = "0123456789x°"  # class 1 + i; 0: no character's ink centre in the patch; the last: any other character
GLYPH_CLASSES = len(GLYPHS) + 2


def glyph_labels(problem, grid: torch.Tensor, merge: int) -> torch.Tensor:
    """One class per image patch, in the processor's patch order (merge x merge blocks, row by row; inside a block
    row by row): the character whose ink centre lies in the patch (GLYPHS), else 0."""
    _, h, w = (int(x) for x in grid.reshape(-1)[:3])
    side = problem.meta["image_size"]
    labels = torch.zeros(h * w, dtype=torch.long)
    for ch, x, y in layout(problem.meta["spec"], side)["glyphs"]:
        py, px = min(h - 1, int(y * h / side)), min(w - 1, int(x * w / side))
        at = ((py // merge) * (w // merge) + px // merge) * merge * merge + (py % merge) * merge + px % merge
        if ch != "°" or labels[at] == 0:  # a degree sign sharing a patch (beside x, mostly) leaves it to the other
            labels[at] = 1 + GLYPHS.index(ch) if ch in GLYPHS else GLYPH_CLASSES - 1
    return labels


class GlyphHead(torch.nn.Module):
    """A linear probe on the vision tower's output (the image tokens the language model reads), trained beside the
    policy and not saved with it: each image token predicts the class of each of the merge x merge patches it
    covers. Every character in the diagram becomes a supervised label at its place, which teaches the tower to read
    far sooner than the few digits of a response do."""

    def __init__(self, model, merge: int):
        super().__init__()
        self.proj = torch.nn.Linear(model.config.text_config.hidden_size, merge * merge * GLYPH_CLASSES)
        self.tokens = None
        model.model.visual.register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        self.tokens = output.pooler_output if hasattr(output, "pooler_output") else output

    def loss(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy of the last forward's image patches, the mean over patches with a character plus the mean
        over those without (a few in a hundred have one: a plain mean is learned by answering "none" everywhere),
        and the accuracy on patches with a character."""
        logits = self.proj(self.tokens.float()).reshape(-1, GLYPH_CLASSES)
        self.tokens = None
        each = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        ink = labels > 0
        loss = each[ink].mean() + each[~ink].mean() if ink.any() else each.mean()
        return loss, (logits.argmax(-1)[ink] == labels[ink]).float().mean()


def target_text(problem, target: str = "read") -> str:
    """The response trained on (before eos): what the prompt asks for and the choice verifier grades. "read" first
    copies the numbers from the diagram, then the value, then the letter (`40 65 -> 75 <answer>C</answer>`): every
    digit read is supervised, which a letter alone (two bits an example) hardly teaches a vision tower from scratch."""
    letter = problem.answer["letter"]
    if target == "letter":
        return f"<answer>{letter}</answer>"
    numbers = written_numbers(problem.meta["spec"], problem.meta["image_size"])
    return f"{' '.join(numbers)} -> {problem.answer['value']} <answer>{letter}</answer>"


def prompt_text(processor, problem) -> str:
    # as EmbeddedBackend.encode renders a VL prompt
    return processor.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(processor, problem) -> dict:
    """The prompt as EmbeddedBackend.encode makes it: input_ids, mm_token_type_ids (1-D), pixel_values,
    image_grid_thw."""
    out = processor(text=[prompt_text(processor, problem)], images=problem.images or None, return_tensors="pt")
    enc = {k: v[0] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v for k, v in out.items()}
    enc.pop("attention_mask", None)
    return enc


class PromptBytes:
    """encode_prompt for a problem whose one image is already at the size the processor keeps, with the pixel
    values as PixelCodec's bytes: the image cut into patches straight from its bytes, in the processor's patch
    layout, and the prompt tokenized with its image tokens spelled out, instead of the processor's float image
    pipeline (most of a data worker's time). The first problem is checked against the processor itself; an image
    the processor would resize, or a processor that encodes otherwise, makes it say so once and hand every problem
    to the processor (the same rows, at the processor's speed)."""

    def __init__(self, processor):
        ip = processor.image_processor
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.patch, self.merge, self.temporal = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        self.image_token = processor.image_token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.checked, self.fallback = False, False
        self.codec = None

    def __call__(self, problem) -> dict:
        if self.fallback:
            return self.processor_bytes(problem)
        if len(problem.images or ()) != 1:
            return self.give_up(problem, f"it has {len(problem.images or ())} images, not one")
        (image,) = problem.images
        a = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)  # C, H, W
        C, H, W = a.shape
        p, m, t = self.patch, self.merge, self.temporal
        if H % (p * m) or W % (p * m):
            return self.give_up(problem, f"its {W} x {H} px image is not a multiple of {p * m} px (the processor "
                                         "resizes it)")
        # (temporal copies, C, gh/m, m, p, gw/m, m, p) -> rows (gh/m, gw/m, m, m), columns (C, temporal, p, p)
        gh, gw = H // p, W // p
        x = a.unsqueeze(0).expand(t, C, H, W).reshape(t, C, gh // m, m, p, gw // m, m, p)
        pix = x.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(gh * gw, C * t * p * p).contiguous()
        text = prompt_text(self.processor, problem).replace(self.image_token,
                                                            self.image_token * (gh * gw // (m * m)), 1)
        ids = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        enc = {"input_ids": ids, "mm_token_type_ids": (ids == self.image_token_id).long(),
               "image_grid_thw": torch.tensor([[1, gh, gw]]), "pixel_bytes": pix}
        if not self.checked:
            ref = self.processor_bytes(problem)
            differ = [k for k in enc if not (enc[k].shape == ref[k].shape and torch.equal(enc[k], ref[k]))]
            if differ:
                return self.give_up(problem, f"the processor encodes it otherwise ({', '.join(differ)})", ref)
            self.checked = True
        return enc

    def processor_bytes(self, problem) -> dict:
        enc = encode_prompt(self.processor, problem)
        pv = enc.pop("pixel_values")
        self.codec = self.codec or PixelCodec(self.processor, pv.shape[1])
        return {**enc, "mm_token_type_ids": enc["mm_token_type_ids"].long(), "pixel_bytes": self.codec.to_bytes(pv)}

    def give_up(self, problem, why: str, ref: dict | None = None) -> dict:
        print(f"problem {problem.uid}: {why}; the data workers encode with the processor instead", flush=True)
        self.fallback = True
        return ref if ref is not None else self.processor_bytes(problem)


class PixelCodec:
    """Pixel values kept as exact uint8 in the processor's patch layout (a quarter of fp32's memory; the processor
    only rescales and normalises, so `values` undoes the storage exactly)."""

    def __init__(self, processor, dim: int):
        ip = processor.image_processor
        self.scale = float(ip.rescale_factor)
        chan = torch.arange(dim) // (dim // 3)  # patch layout (channel, temporal, h, w): channel = column // (dim/3)
        self.mean = torch.tensor(ip.image_mean, dtype=torch.float32)[chan]
        self.std = torch.tensor(ip.image_std, dtype=torch.float32)[chan]

    def to_bytes(self, pv: torch.Tensor) -> torch.Tensor:
        raw = (pv * self.std + self.mean) / self.scale
        u8 = raw.round().clamp(0, 255).to(torch.uint8)
        err = (raw - u8.float()).abs().max().item()
        assert err < 1e-2, f"pixel values are not rescaled bytes (max error {err})"
        return u8

    def values(self, u8: torch.Tensor, device) -> torch.Tensor:
        pv = (u8.to(device, non_blocking=True).float() * self.scale - self.mean.to(device)) / self.std.to(device)
        return pv.reshape(-1, pv.shape[-1])


def encode_row(processor, problem, target: str | None, positions: PromptPositions | None = None,
               glyphs: bool = False, prompt_bytes: PromptBytes | None = None) -> dict:
    """One problem: prompt (+ response and eos unless target is None) ids, image-token markers, where the response
    starts, the image's grid and its pixel values (fp32, [patches, dim]; with `prompt_bytes`, as PixelCodec's bytes,
    made by it); with `positions`, the prompt's M-RoPE positions too (bapo_vl.mrope: computed here, on the CPU,
    instead of in every forward); with `glyphs`, each patch's glyph class (glyph_labels)."""
    tok = processor.tokenizer
    enc = prompt_bytes(problem) if prompt_bytes is not None else encode_prompt(processor, problem)
    ids = enc["input_ids"].tolist()
    start = len(ids)
    if target is not None:
        ids = ids + tok(target_text(problem, target), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    types = enc["mm_token_type_ids"].tolist() if "mm_token_type_ids" in enc else [0] * start
    row = {"ids": ids, "types": types + [0] * (len(ids) - len(types)), "start": start,
           "grid": enc["image_grid_thw"], "pixel_values": enc.get("pixel_bytes", enc.get("pixel_values"))}
    if positions is not None:
        row["positions"] = positions(enc["input_ids"], torch.tensor(types), enc["image_grid_thw"])
    if glyphs:
        row["glyphs"] = glyph_labels(problem, enc["image_grid_thw"], processor.image_processor.merge_size)
    return row


def pad_rows(rows: list[dict], pad_id: int) -> dict:
    """Right-padded ids, markers and labels (-100 outside the response) of encoded rows (and their M-RoPE positions
    when the rows have them)."""
    width = max(len(r["ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    types = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for k, r in enumerate(rows):
        n = len(r["ids"])
        ids[k, :n] = torch.tensor(r["ids"])
        types[k, :n] = torch.tensor(r["types"])
        labels[k, r["start"]:n] = ids[k, r["start"]:n]
    lengths = torch.tensor([len(r["ids"]) for r in rows])
    out = {"ids": ids, "types": types, "labels": labels, "lengths": lengths,
           "starts": torch.tensor([r["start"] for r in rows])}
    if "positions" in rows[0]:
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        out["positions"] = batch_positions([r["positions"] for r in rows], [0] * len(rows), mask)
    if "glyphs" in rows[0]:
        out["glyphs"] = torch.stack([r["glyphs"] for r in rows])
    return out


def model_inputs(ids, types, lengths, grid, pixel_values, device, positions=None,
                 vision: VisionInputs | None = None) -> dict:
    """A right-padded batch as the model takes it (trimmed to its longest row), with the precomputed M-RoPE
    positions and vision-tower inputs when given (bapo_vl.mrope)."""
    w = int(lengths.max())
    mask = (torch.arange(w)[None] < lengths[:, None]).long()
    inputs = {"input_ids": ids[:, :w], "attention_mask": mask, "mm_token_type_ids": types[:, :w],
              "image_grid_thw": grid.repeat(len(ids), 1)}
    if positions is not None:
        inputs["position_ids"] = positions[:, :, :w]
    if vision is not None:
        inputs |= vision(inputs["image_grid_thw"])
    return {**{k: v.to(device) for k, v in inputs.items()}, "pixel_values": pixel_values}


class Encoded:
    """Problems encoded once, on CPU: right-padded prompt+response ids, labels (-100 outside the response),
    image-token markers, and pixel values as exact uint8 (PixelCodec)."""

    def __init__(self, problems, processor, with_response: bool = True, target: str = "read",
                 positions: PromptPositions | None = None, vision: VisionInputs | None = None, glyphs: bool = False):
        tok = processor.tokenizer
        rows, pix = [], []
        self.codec = None
        for i, p in enumerate(problems):
            row = encode_row(processor, p, target if with_response else None, positions, glyphs)
            if self.codec is None:
                self.codec = PixelCodec(processor, row["pixel_values"].shape[1])
            pix.append(self.codec.to_bytes(row.pop("pixel_values")))
            rows.append(row)
            if i < 4 and with_response:  # the response appended to the prompt = the processor on the whole text
                whole = processor(text=[prompt_text(processor, p) + target_text(p, target) + tok.eos_token],
                                  images=p.images, return_tensors="pt")["input_ids"][0].tolist()
                assert whole == row["ids"], "prompt + response encoding mismatch"
        if len({tuple(r["grid"].flatten().tolist()) for r in rows}) != 1:
            raise ValueError("all images must have the same size (one --image-size)")
        self.grid = rows[0]["grid"]  # [1, 3]
        self.pix = torch.stack(pix)  # [N, patches, dim] uint8
        padded = pad_rows(rows, tok.pad_token_id)
        self.ids, self.types, self.labels = padded["ids"], padded["types"], padded["labels"]
        self.lengths, self.starts = padded["lengths"], padded["starts"]
        self.positions, self.vision = padded.get("positions"), vision
        self.glyphs = padded.get("glyphs")  # [N, patches] or None
        self.problems = problems

    def __len__(self):
        return len(self.ids)

    def pixels(self, idx, device) -> torch.Tensor:
        return self.codec.values(self.pix[idx], device)

    def batch(self, idx: torch.Tensor, device) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
        """Model inputs for rows idx (right padded, trimmed to the longest), their labels and glyph labels."""
        inputs = model_inputs(self.ids[idx], self.types[idx], self.lengths[idx], self.grid,
                              self.pixels(idx, device), device,
                              None if self.positions is None else self.positions[:, idx], self.vision)
        glyphs = None if self.glyphs is None else self.glyphs[idx].reshape(-1).to(device)
        return inputs, self.labels[idx, :int(self.lengths[idx].max())].to(device), glyphs


CHUNK = 256  # problems a stream worker draws at once


class FreshProblems(torch.utils.data.IterableDataset):
    """Endless batches of train-split problems, each drawn once: worker w of W takes chunks w, w + W, w + 2W, ...,
    chunk c being `load(split="train", n=CHUNK, seed=data_seed * 1_000_000 + c)` (its own seeded stream), encoded
    in the worker (PromptBytes: the processor's rows, without its float image pipeline). With a fixed number of
    workers the order is fixed too (DataLoader takes the workers' batches in turn), so a run repeats. Memory stays
    that of a few batches, however many problems training sees."""

    def __init__(self, processor, target: str, batch: int, data_seed: int, image_size: int,
                 positions: PromptPositions | None = None, glyphs: bool = False):
        self.processor, self.target, self.batch, self.positions = processor, target, batch, positions
        self.glyphs = glyphs
        self.data_seed, self.image_size = data_seed, image_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        task, rows, c = get_task(), [], w
        prompt_bytes = PromptBytes(self.processor)
        while True:
            for p in task.load(split="train", n=CHUNK, seed=self.data_seed * 1_000_000 + c,
                               image_size=self.image_size):
                rows.append(encode_row(self.processor, p, self.target, self.positions, self.glyphs, prompt_bytes))
                if len(rows) == self.batch:
                    yield {**pad_rows(rows, self.processor.tokenizer.pad_token_id), "grid": rows[0]["grid"],
                           "pix": torch.stack([r["pixel_values"] for r in rows])}
                    rows = []
            c += n_workers


def fresh_batches(processor, args, positions: PromptPositions):
    """An iterator over FreshProblems' batches, made by --data-workers processes (none: in this process)."""
    data = FreshProblems(processor, args.target, args.batch, args.data_seed, args.image_size, positions,
                         glyphs=args.glyph_loss > 0)

    def one_thread(_):
        torch.set_num_threads(1)

    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=args.data_workers,
                                         worker_init_fn=one_thread, prefetch_factor=4 if args.data_workers else None,
                                         persistent_workers=args.data_workers > 0)
    return iter(loader)


@torch.no_grad()
def greedy_answers(model, processor, enc: Encoded, device, bf16: bool, batch: int = 64, max_new_tokens: int = 64):
    """Greedy responses to enc's prompts (left padded, as the backend generates)."""
    tok = processor.tokenizer
    pad, eos = tok.pad_token_id, tok.eos_token_id
    suppress = [model.config.image_token_id, model.config.video_token_id]
    out = []
    for i in range(0, len(enc), batch):
        idx = torch.arange(i, min(i + batch, len(enc)))
        starts = enc.starts[idx]
        P = int(starts.max())
        ids = torch.full((len(idx), P), pad, dtype=torch.long)
        types = torch.zeros((len(idx), P), dtype=torch.long)
        mask = torch.zeros((len(idx), P), dtype=torch.long)
        for k, (j, s) in enumerate(zip(idx.tolist(), starts.tolist())):
            ids[k, P - s:] = enc.ids[j, :s]
            types[k, P - s:] = enc.types[j, :s]
            mask[k, P - s:] = 1
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "mm_token_type_ids": types.to(device),
                  "image_grid_thw": enc.grid.repeat(len(idx), 1).to(device), "pixel_values": enc.pixels(idx, device)}
        # --compile compiled the blocks for training's shapes; decoding one token at a time stays eager
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), torch.compiler.set_stance("force_eager"):
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 eos_token_id=eos, suppress_tokens=suppress)
        out.extend(tok.batch_decode(gen[:, P:], skip_special_tokens=True))
    return out


def accuracy(model, processor, enc: Encoded, device, bf16: bool, batch: int = 64) -> dict:
    """Greedy accuracy through the task's verifier: overall and by kind, plus a few examples."""
    from bapo_vl.problem import Verdict

    task = get_task()
    was_training = model.training
    model.eval()
    responses = greedy_answers(model, processor, enc, device, bf16, batch)
    model.train(was_training)
    right, read, by_kind = [], [], defaultdict(list)
    for p, r in zip(enc.problems, responses):
        ok = task.verify(r, p.answer) == Verdict.CORRECT
        right.append(ok)
        read.append(sorted(r.split(" -> ")[0].split()) == sorted(written_numbers(p.meta["spec"], p.meta["image_size"])))
        by_kind[p.meta["kind"]].append(ok)
    return {"n": len(right), "acc": sum(right) / max(1, len(right)), "read": sum(read) / max(1, len(read)),
            "by_kind": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_kind.items())},
            "examples": [{"uid": p.uid, "answer": p.answer["letter"], "response": r}
                         for p, r in zip(enc.problems[:4], responses[:4])]}


def evaluate(args) -> dict:
    """--evaluate: a saved policy's greedy accuracy, by kind, numbers read and blank-image control."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    device = torch.device(args.device)
    bf16 = args.bf16 if args.bf16 is not None else device.type == "cuda"
    model = AutoModelForImageTextToText.from_pretrained(args.evaluate).to(device).eval()
    processor = AutoProcessor.from_pretrained(args.evaluate)
    task, batch = get_task(), args.eval_batch or (128 if device.type == "cuda" else 32)
    found = {}
    for name, blank in (("diagrams", False), ("blank", True)):
        problems = task.load(split="test", n=args.eval_problems, seed=TEST_SEED, image_size=args.image_size,
                             blank_images=blank)
        found[name] = accuracy(model, processor, Encoded(problems, processor, with_response=False), device, bf16, batch)
    r, b = found["diagrams"], found["blank"]
    result = {"policy": args.evaluate, "split": "test", "seed": TEST_SEED, "n": r["n"], "greedy_acc": r["acc"],
              "greedy_acc_by_kind": r["by_kind"], "numbers_read": r["read"], "blank_images_greedy_acc": b["acc"],
              "blank_images_by_kind": b["by_kind"], "examples": r["examples"]}
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def build(args):
    from bapo_vl.tiny import build_qwen2_5_vl
    from bapo_vl.vision_attention import use_segment_attention

    side = args.image_size
    vision = dict(depth=args.vision_depth, hidden_size=args.vision_hidden, num_heads=args.vision_heads,
                  intermediate_size=args.vision_intermediate,
                  # full attention in every third block (and the last); windowed (112 px) elsewhere
                  fullatt_block_indexes=sorted({i for i in range(args.vision_depth)
                                                if i % 3 == 2 or args.vision_full_attention}
                                               | {args.vision_depth - 1}))
    model, processor = build_qwen2_5_vl(seed=args.seed, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                        kv_heads=args.kv_heads, intermediate=args.intermediate,
                                        max_pixels=side * side, vision=vision)
    use_segment_attention(model)  # one attention call per vision layer, not one per image and window
    return model, processor


def init_from(model, folder: str):
    """Start from a saved policy of the same shape (e.g. to train one further): its weights into `model`."""
    from transformers import AutoModelForImageTextToText

    saved = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).state_dict()
    try:
        model.load_state_dict(saved)
    except RuntimeError as e:
        raise SystemExit(f"--init-from {folder}: not a policy of this shape (--size and the shape flags): "
                         f"{str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else e}") from None


def save_policy(model, processor, folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    processor.save_pretrained(folder)


def main(argv=None):
    from bapo_vl.optim import lr_factor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the policy folder to write (with --evaluate: the JSON file, optional)")
    ap.add_argument("--evaluate", metavar="FOLDER",
                    help="train nothing: evaluate this saved policy (an RL run's final/ too) as a training run's end "
                         "does (greedy by kind, numbers read, blank images; --eval-problems, --image-size, --device) "
                         "and print the result as JSON")
    ap.add_argument("--size", choices=list(SIZES), default="geodraw-30m",
                    help="shape and recipe (the flags below override its values): " + "; ".join(
                        f"{name}: {', '.join(f'{k}={v}' for k, v in d.items())}" for name, d in SIZES.items()))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--data", choices=("fresh", "fixed"), default="fresh",
                    help="fresh: every example a newly drawn problem, made by --data-workers processes while the "
                         "GPU trains; fixed: --problems problems encoded once and cycled in epochs")
    ap.add_argument("--data-workers", type=int, default=8, help="processes drawing fresh problems (0: this one)")
    ap.add_argument("--problems", type=int, help="--data fixed: training problems (geodraw train split)")
    for key in SHAPE_KEYS:
        ap.add_argument("--" + key.replace("_", "-"), type=int)
    ap.add_argument("--target", choices=TARGETS, default="read",
                    help="response trained on: read (the diagram's numbers, the value, the letter) or letter only")
    ap.add_argument("--vision-full-attention", action=argparse.BooleanOptionalAction, default=None,
                    help="full attention in every vision block (else every third and the last, 112 px windows "
                         "elsewhere, as Qwen2.5-VL)")
    ap.add_argument("--glyph-loss", type=float,
                    help="weight of the glyph loss (GlyphHead: each image patch's character, predicted from the "
                         "image tokens; 0: off)")
    ap.add_argument("--image-size", type=int, default=224, help="side of the drawn image, px (max_pixels = its square)")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--min-lr-ratio", type=float, default=0.0)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0, help="model init and batch order")
    ap.add_argument("--init-from", metavar="FOLDER",
                    help="start from this saved policy (same shape) instead of random weights: train it further")
    ap.add_argument("--data-seed", type=int, default=0, help="geodraw train-split seed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cpu-threads", type=int, default=8,
                    help="torch CPU threads (encoding the images; beyond a few they only contend with each other)")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="deterministic kernels (torch.use_deterministic_algorithms, warn-only where an op has none)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast (default: on for cuda); weights stay fp32")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="torch.compile each repeated block (decoder layers, vision blocks) for training; "
                         "evaluation decodes eager")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop training once the training wall time passes this (then save and evaluate)")
    ap.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="stop after N of the --steps planned (the learning-rate schedule still spans --steps): "
                         "the step-exact form of a --max-seconds stop, so a stopped run can be rebuilt")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=0, help=f"greedy accuracy on {EVAL_DURING} test problems every N steps")
    ap.add_argument("--eval-problems", type=int, default=500, help="final evaluation: first N test problems")
    ap.add_argument("--eval-batch", type=int, default=None)
    ap.add_argument("--save-at", default="", metavar="STEP,STEP",
                    help="also save the policy as it is after these steps, in OUT/step_N (with its greedy accuracy "
                         f"on {EVAL_DURING} test problems)")
    args = ap.parse_args(argv)
    if args.evaluate:
        return evaluate(args)
    if not args.out:
        ap.error("--out is required (unless --evaluate)")
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    t_start = time.time()
    if args.deterministic:  # before the first CUDA call: cuBLAS reads its workspace setting once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(max(1, min(args.cpu_threads, torch.get_num_threads())))
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    bf16 = args.bf16 if args.bf16 is not None else device.type == "cuda"
    eval_batch = args.eval_batch or (128 if device.type == "cuda" else 32)

    model, processor = build(args)  # first, so an --out inside the wheel fails at once
    if args.init_from:
        init_from(model, args.init_from)
    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    out = Path(args.out)
    if n_params > MAX_PACKAGED_PARAMS and out.resolve().is_relative_to(PACKAGED):
        raise SystemExit(f"--out {args.out} is inside {PACKAGED}, which the wheel packages, and this model has "
                         f"{n_params:,} parameters: build it outside (e.g. --out runs/policies/{args.size})")
    save_at = sorted({int(x) for x in args.save_at.split(",") if x.strip()})
    if args.stop_after is not None and not 0 < args.stop_after <= args.steps:
        raise SystemExit(f"--stop-after {args.stop_after}: must be in 1..--steps ({args.steps})")
    if any(not 0 < x < args.steps for x in save_at):
        raise SystemExit(f"--save-at {args.save_at}: each step must be in 1..{args.steps - 1} (the last is --out)")

    task = get_task()
    fresh = args.data == "fresh"
    train_problems = task.load(split="train", n=64 if fresh else args.problems, seed=args.data_seed,
                               image_size=args.image_size)
    n_eval = max(args.eval_problems, EVAL_DURING if (args.eval_every or save_at) else 0)
    test_problems = task.load(split="test", n=n_eval, seed=TEST_SEED, image_size=args.image_size)
    blank_problems = task.load(split="test", n=args.eval_problems, seed=TEST_SEED, image_size=args.image_size,
                               blank_images=True)
    from bapo_vl.problem import Verdict
    bad = [p.uid for p in train_problems[:64] if task.verify(target_text(p, args.target), p.answer) != Verdict.CORRECT]
    assert not bad, f"the verifier does not grade the target correct: {bad}"
    positions, vision = PromptPositions(model.config), VisionInputs(model.config.vision_config)
    glyphs = args.glyph_loss > 0
    data = Encoded(train_problems, processor, target=args.target, positions=positions, vision=vision,
                   glyphs=glyphs)  # with fresh data: only the encoding checks
    test = Encoded(test_problems, processor, with_response=False)
    batches = fresh_batches(processor, args, positions) if fresh else None
    print(f"problems {'fresh every step' if fresh else len(data)} train, {len(test)} test (encoded in "
          f"{time.time() - t_start:.1f}s), image {args.image_size}px = {int(data.grid.prod()) // 4} image tokens, "
          f"params {n_params:,} (vision {n_vision:,}), device {device}, bf16 {bf16}", flush=True)
    during = Encoded(test_problems[:EVAL_DURING], processor, with_response=False) if (args.eval_every or save_at) else None

    head = GlyphHead(model, processor.image_processor.merge_size) if glyphs else None
    model.to(device).train()
    if args.compile:
        print(f"--compile: {compile_blocks(model)} blocks compiled", flush=True)
    trained = list(model.named_parameters()) + (list(head.to(device).named_parameters()) if head else [])
    decay = [p for n, p in trained if p.ndim >= 2]
    no_decay = [p for n, p in trained if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator().manual_seed(args.seed)
    perm, pos = torch.randperm(len(data), generator=gen), 0
    log, curve, snapshots = [], [], {}
    stopped_early = False
    t0 = time.time()
    steps_done = 0
    mark, mark_step = t0, 0  # the step time is taken over the steps since the last log line, evaluation left out
    data_wait = 0.0  # seconds spent waiting for the data workers' next batch since the last log line
    for step in range(args.steps if args.stop_after is None else args.stop_after):
        if step and args.max_seconds is not None and time.time() - t0 > args.max_seconds:
            stopped_early = True
            print(f"--max-seconds {args.max_seconds}: stopping after {step} steps", flush=True)
            break
        if fresh:
            t_data = time.time()
            b = next(batches)
            data_wait += time.time() - t_data
            inputs = model_inputs(b["ids"], b["types"], b["lengths"], b["grid"], data.codec.values(b["pix"], device),
                                  device, b["positions"], vision)
            y = b["labels"][:, :int(b["lengths"].max())].to(device)
            glyph_y = b["glyphs"].reshape(-1).to(device) if glyphs else None
        else:
            if pos + args.batch > len(perm):
                perm, pos = torch.randperm(len(data), generator=gen), 0
            idx = perm[pos:pos + args.batch]
            pos += args.batch
            inputs, y, glyph_y = data.batch(idx, device)
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step + 1, args.steps, "cosine", args.warmup, args.min_lr_ratio)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(**inputs).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                     y[:, 1:].reshape(-1), ignore_index=-100)
            if head is not None:
                glyph_loss, glyph_acc = head.loss(glyph_y)
        total = loss + args.glyph_loss * glyph_loss if head is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        opt.step()
        steps_done = step + 1
        logged = steps_done % args.log_every == 0 or step == 0 or steps_done == args.steps
        if logged:
            lv = loss.item()  # waits for the step: the time below is the device's too
            step_s = (time.time() - mark) / (steps_done - mark_step)
            # the host runs ahead of the device until it waits for data or for the loss above, so a data wait
            # near the step time means the data workers bound the step (more --data-workers), near 0 the device
            wait_s = data_wait / (steps_done - mark_step)
            log.append({"step": steps_done, "loss": round(lv, 5), "seconds": round(time.time() - t0, 1),
                        "step_seconds": round(step_s, 4), "data_wait_seconds": round(wait_s, 4)})
            line = f"step {steps_done}/{args.steps} loss {lv:.4f}"
            if head is not None:
                log[-1] |= {"glyph_loss": round(glyph_loss.item(), 5), "glyph_acc": round(glyph_acc.item(), 4)}
                line += f" glyph loss {log[-1]['glyph_loss']:.4f} acc {log[-1]['glyph_acc']:.3f}"
            line += (f" lr {opt.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s {step_s * 1000:.0f} ms/step"
                     f" ({wait_s * 1000:.0f} waiting for data)")
            if args.eval_every and (steps_done % args.eval_every == 0 or steps_done == args.steps):
                r = accuracy(model, processor, during, device, bf16, eval_batch)
                curve.append({"step": steps_done, f"greedy_acc_{EVAL_DURING}": r["acc"], "numbers_read": r["read"]})
                line += f" greedy@{EVAL_DURING} {r['acc']:.3f} read {r['read']:.3f}"
            print(line, flush=True)
        if steps_done in save_at:
            folder = out / f"step_{steps_done}"
            save_policy(model, processor, folder)
            r = accuracy(model, processor, during, device, bf16, eval_batch)
            snapshots[steps_done] = {"folder": folder.name, f"greedy_acc_{EVAL_DURING}": r["acc"],
                                    "numbers_read": r["read"]}
            (folder / "training.json").write_text(json.dumps({"step": steps_done, **snapshots[steps_done]}, indent=1))
            print(f"saved {folder}: {snapshots[steps_done]}", flush=True)
        if logged or steps_done in save_at:
            mark, mark_step, data_wait = time.time(), steps_done, 0.0
    train_s = time.time() - t0
    if log and log[-1]["step"] != steps_done:
        log.append({"step": steps_done, "loss": round(loss.item(), 5), "seconds": round(train_s, 1)})

    model.eval()
    save_policy(model, processor, out)
    final_loss = sum(d["loss"] for d in log[-3:]) / max(1, len(log[-3:]))
    t_eval = time.time()
    final = Encoded(test_problems[:args.eval_problems], processor, with_response=False)
    result = accuracy(model, processor, final, device, bf16, eval_batch)
    blank = accuracy(model, processor, Encoded(blank_problems, processor, with_response=False), device, bf16,
                     eval_batch)
    eval_s = time.time() - t_eval
    print(f"test greedy acc {result['acc']:.3f} {result['by_kind']}, numbers read {result['read']:.3f}; "
          f"blank images {blank['acc']:.3f} "
          f"({eval_s:.0f}s)", flush=True)

    command = "PYTHONPATH=. python scripts/train_vl_policy.py " + " ".join(shlex.quote(a) for a in (
        argv if argv is not None else sys.argv[1:]))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    meta = {
        "command": command, "size": args.size, "name": out.name, "seed": args.seed, "data_seed": args.data_seed,
        "init_from": args.init_from,
        "steps": steps_done, "steps_planned": args.steps, "stopped_by_max_seconds": stopped_early,
        "max_seconds": args.max_seconds, "batch": args.batch, "data": args.data,
        "problems": steps_done * args.batch if fresh else len(data),
        "epochs": 1.0 if fresh else round(steps_done * args.batch / len(data), 2), "image_size": args.image_size,
        "max_pixels": args.image_size ** 2, "image_tokens": int(data.grid.prod()) // 4,
        "target": args.target, "glyph_loss": args.glyph_loss, "target_example": target_text(train_problems[0], args.target) + processor.tokenizer.eos_token,
        "shape": {k: getattr(args, k) for k in SHAPE_KEYS} | {"vocab": len(processor.tokenizer),
                                                               "vision_full_attention": args.vision_full_attention},
        "params": n_params, "vision_params": n_vision, "lr": args.lr, "warmup": args.warmup,
        "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay,
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "bf16_autocast": bf16, "compile": args.compile, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "train_seconds": round(train_s, 1), "eval_seconds": round(eval_s, 1), "final_loss": round(final_loss, 5),
        "loss_log": log, "eval_curve": curve, "snapshots": snapshots,
        "eval": {"split": "test", "seed": TEST_SEED, "n": result["n"], "greedy_acc": result["acc"],
                 "greedy_acc_by_kind": result["by_kind"], "numbers_read": result["read"],
                 "blank_images_greedy_acc": blank["acc"],
                 "blank_images_by_kind": blank["by_kind"], "examples": result["examples"]},
    }
    (out / "training.json").write_text(json.dumps(meta, indent=1))
    (out / "TRAINING.md").write_text(training_md(meta, size))
    print(f"saved {out} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f}s", flush=True)
    return meta


def training_md(m: dict, size: int) -> str:
    s, e = m["shape"], m["eval"]
    stop = (f", stopped by --max-seconds {m['max_seconds']} after {m['steps']} of {m['steps_planned']} planned steps"
            if m["stopped_by_max_seconds"] else
            f", stopped after {m['steps']} of {m['steps_planned']} planned steps (--stop-after)"
            if m["steps"] < m["steps_planned"] else "")
    lines = [
        f"# {m['name']}: a geodraw policy (--size {m['size']})",
        "",
        "A small Qwen2.5-VL-architecture model (byte-level tokenizer with Qwen special tokens, `bapo_vl.tiny`), "
        + ("trained further (SFT) " if m.get("init_from") else "trained from scratch (SFT) ")
        + "on the geodraw train split (`tasks/geodraw/task.py`: drawn geometry diagrams, "
        "the numbers only in the image, four choices). Prompt: the task's messages rendered as the embedded backend "
        f"renders them (image of {m['image_size']} px = {m['image_tokens']} image tokens); response "
        f"`{m['target_example']}` (--target {m['target']}; graded by `bapo_vl.verifiers.choice`). Use with max_pixels={m['max_pixels']} or more.",
        "",
        "```",
        m["command"],
        "```",
        "",
        (f"- trained further from `{m['init_from']}`\n" if m.get("init_from") else "")
        + f"- seed {m['seed']} (data seed {m['data_seed']}), {m['steps']} steps of batch {m['batch']} over "
        + (f"{m['problems']:,} problems, each drawn once (--data fresh)" if m.get("data") == "fresh" else
           f"{m['problems']:,} problems ({m['epochs']} epochs)")
        + f"{stop}; AdamW lr {m['lr']} (warm-up {m['warmup']}, "
        f"cosine over {m['steps_planned']} steps), weight decay {m['weight_decay']}; loss on response tokens only"
        + (f", plus {m['glyph_loss']} x the glyph loss (a linear probe on the image tokens names the character in "
           "each image patch; the probe is not saved)" if m.get("glyph_loss") else ""),
        f"- shape: text hidden {s['hidden']}, layers {s['layers']}, heads {s['heads']} (kv {s['kv_heads']}), "
        f"intermediate {s['intermediate']}, vocab {s['vocab']}, tied embeddings; vision depth {s['vision_depth']}, "
        f"hidden {s['vision_hidden']}, heads {s['vision_heads']}, intermediate {s['vision_intermediate']}; "
        f"{m['params']:,} parameters ({m['vision_params']:,} vision), fp32 safetensors; folder {size / 1e6:.2f} MB",
        f"- trained on {m['device']}, bf16 autocast {m['bf16_autocast']}"
        + (", repeated blocks compiled (--compile)" if m.get("compile") else "")
        + f", torch {m['torch']}, transformers {m['transformers']}, {m['train_seconds']} s",
        f"- final training loss (per response token) {m['final_loss']}",
        "",
        f"## Greedy accuracy on the test split ({e['n']} problems, seed {e['seed']}, verifier "
        "`bapo_vl.verifiers.choice`)",
        "",
        f"- diagrams: {e['greedy_acc']:.1%} (" + ", ".join(f"{k} {v:.1%}" for k, v in e["greedy_acc_by_kind"].items())
        + ")",
        f"- blank images (the same problems, image-blind control; chance 25 %): {e['blank_images_greedy_acc']:.1%}",
        f"- responses whose numbers are exactly those written in the diagram: {e['numbers_read']:.1%}",
    ]
    if m["eval_curve"]:
        lines += ["", f"During training (first {EVAL_DURING} test problems): " + ", ".join(
            f"step {c['step']} {c[f'greedy_acc_{EVAL_DURING}']:.1%}" for c in m["eval_curve"])]
    if m["snapshots"]:
        lines += ["", "Snapshots: " + ", ".join(f"{v['folder']} {v[f'greedy_acc_{EVAL_DURING}']:.1%}"
                                                for v in m["snapshots"].values())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
