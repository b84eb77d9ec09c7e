"""Offline tiny models: tokenizer, Qwen2 and Qwen2.5-VL build, generate and round-trip through save_pretrained."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bapo_vl.tiny import SPECIAL_TOKENS, build_qwen2, build_qwen2_5_vl, build_tokenizer  # noqa: E402

TEXT = "héllo wörld — 日本語 😀 (44+19)*3/7 \t\n"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_tokenizer_bytes_and_specials(tok):
    ids = tok(TEXT)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))  # id == byte value
    assert tok.decode(ids) == TEXT
    assert len(tok) == 256 + len(SPECIAL_TOKENS)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == 256 + i
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    ids = tok("a<|im_end|>")["input_ids"]
    assert ids == [97, tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "a"


def test_chat_template_text_and_image(tok):
    msgs = [{"role": "user", "content": "44 19 35 -> 98"}, {"role": "assistant", "content": "<answer>(44+19)+35</answer>"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "44 19 35 -> 98\n<answer>(44+19)+35</answer><|im_end|>"
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True) == "44 19 35 -> 98\n"
    img = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]}]
    assert (tok.apply_chat_template(img, tokenize=False, add_generation_prompt=True)
            == "<|vision_start|><|image_pad|><|vision_end|>What color?\n")


def test_tokenizer_round_trip(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    t2 = AutoTokenizer.from_pretrained(tmp_path)
    assert t2(TEXT + "<|im_end|>")["input_ids"] == tok(TEXT + "<|im_end|>")["input_ids"]
    assert t2.decode(tok(TEXT)["input_ids"]) == TEXT
    assert t2.pad_token_id == tok.pad_token_id and t2.eos_token_id == tok.eos_token_id
    msgs = [{"role": "user", "content": "1 2 -> 3"}]
    assert t2.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)


def test_qwen2_generate_and_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = build_qwen2(seed=0)
    assert model.config.vocab_size == len(tok) and model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    t2 = AutoTokenizer.from_pretrained(tmp_path)
    enc = t2(["12 3 -> 15\n", "7 -> 7\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, m2(**enc).logits)
    out1 = model.generate(**enc, max_new_tokens=8, do_sample=False)
    out2 = m2.generate(**enc, max_new_tokens=8, do_sample=False)
    assert torch.equal(out1, out2) and out1.shape[1] <= enc["input_ids"].shape[1] + 8
    torch.manual_seed(1)
    out = m2.generate(**enc, max_new_tokens=8, do_sample=True, temperature=1.0, num_return_sequences=3)
    assert out.shape[0] == 6


def test_qwen2_seed_reproducible():
    a, _ = build_qwen2(seed=3)
    b, _ = build_qwen2(seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_qwen2_5_vl_generate_and_round_trip(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, proc = build_qwen2_5_vl(seed=0)
    img = Image.new("RGB", (224, 224), (200, 30, 40))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color?"}]}]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = proc(text=[text], images=[img], return_tensors="pt")
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 64
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]

    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    m2 = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    p2 = AutoProcessor.from_pretrained(tmp_path)
    enc2 = p2(text=[text], images=[img], return_tensors="pt")
    assert all(torch.equal(enc[k], enc2[k]) for k in enc)
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, m2(**enc2).logits)
    assert torch.equal(out, m2.generate(**enc2, max_new_tokens=6, do_sample=False))


def test_qwen2_5_vl_max_pixels():
    from PIL import Image

    _, proc = build_qwen2_5_vl(max_pixels=112 * 112)
    enc = proc(text=["<|vision_start|><|image_pad|><|vision_end|>x\n"], images=[Image.new("RGB", (224, 224))],
               return_tensors="pt")
    assert int((enc["input_ids"] == proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()) == 16


def test_default_policy_loads_and_solves_some():
    """The shipped countdown-tiny policy: small, loads offline, greedy-solves some forward-made problems."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bapo_vl
    from bapo_vl.tasks.countdown import task
    from bapo_vl.verifiers.countdown import verify

    path = Path(bapo_vl.__file__).parent / "policy" / "countdown-tiny"
    assert sum(f.stat().st_size for f in path.iterdir()) < 6_000_000
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) < 1_500_000
    problems = task.generate_problems(64, seed=12345)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{' '.join(map(str, n))} -> {t}"}], tokenize=False,
                                     add_generation_prompt=True) for n, t, _ in problems]
    assert texts[0].endswith(f" -> {problems[0][1]}\n")
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=40)
    dec = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    acc = sum(verify(d, {"nums": n, "target": t}).reward for d, (n, t, _) in zip(dec, problems)) / len(problems)
    assert 0.1 <= acc <= 0.8, acc  # 0.36 when shipped: it solves some, not most


@pytest.mark.parametrize("hidden, heads, want", [(64, 4, [2, 3, 3]), (256, 2, [16, 24, 24])])
def test_qwen2_5_vl_mrope_sections_fit_any_head_dim(hidden, heads, want):
    # Could fail if the sections were hard-coded: vLLM asserts they sum to half the head dimension (the 3B model's
    # head_dim 128 needs [16, 24, 24]), and transformers would silently rotate the wrong dimensions.
    from PIL import Image

    model, processor = build_qwen2_5_vl(hidden=hidden, heads=heads, kv_heads=1, layers=1, intermediate=64)
    sections = model.config.get_text_config().rope_parameters["mrope_section"]
    assert sections == want and sum(sections) == hidden // heads // 2
    image = Image.new("RGB", (56, 56), "white")
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                         add_generation_prompt=True, tokenize=False)
    out = model(**processor(text=[text], images=[image], return_tensors="pt"))
    assert torch.isfinite(out.logits).all()
