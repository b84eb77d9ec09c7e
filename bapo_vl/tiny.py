"""Tiny models built offline (no model hub): a byte-level tokenizer with Qwen special tokens, a tiny
Qwen2 causal LM and a tiny Qwen2.5-VL. Used by tests and by scripts/train_default_policy.py.

Imports only torch, tokenizers and transformers (the VL builders import their transformers classes
lazily, so the text-only builders work where the image/video processors' extras are missing).
"""
from __future__ import annotations

import torch

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# user/system -> content + "\n"; assistant -> content + "<|im_end|>"; the generation prompt adds nothing.
# Content may be a string or a list of parts ({"type": "image"} / {"type": "video"} / {"type": "text", ...}).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_end|>' -}}"
    "{%- else -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer():
    """Byte-level tokenizer: ids 0..255 are the 256 ByteLevel symbols (BPE with no merges), then the Qwen
    special tokens (ids 256..262). pad = <|endoftext|>, eos = <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # order by byte value so that id == byte for every byte
    byte_to_sym = _bytes_to_unicode()
    vocab = {byte_to_sym[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _special_ids(tok) -> dict:
    return {
        "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
    }


def _text_kwargs(hidden, layers, heads, kv_heads, intermediate, vocab_size, max_position_embeddings=2048,
                 tie_word_embeddings=True):
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


def _set_generation_config(model, ids: dict) -> None:
    gc = model.generation_config
    gc.eos_token_id = ids["eos_token_id"]
    gc.pad_token_id = ids["pad_token_id"]
    gc.bos_token_id = ids["bos_token_id"]


def build_qwen2(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                seed: int = 0, tokenizer=None, max_position_embeddings: int = 2048, vocab_size: int | None = None,
                tie_word_embeddings: bool = True):
    """A tiny randomly initialised Qwen2ForCausalLM (fp32, tied embeddings unless told) and its tokenizer.
    `vocab_size` pads the embedding and LM head beyond the tokenizer's ids, as in build_qwen2_5_vl (a real model's
    LM-head work)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    ids = _special_ids(tok)
    cfg = Qwen2Config(**_text_kwargs(hidden, layers, heads, kv_heads, intermediate, max(vocab_size or 0, len(tok)),
                                     max_position_embeddings, tie_word_embeddings), **ids)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float().eval()
    _set_generation_config(model, ids)
    return model, tok


VISION_CONFIG = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])


# Qwen2.5-VL-3B-Instruct's vision tower (its config.json), for realistic shapes on a GPU
VISION_3B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                 fullatt_block_indexes=[7, 15, 23, 31])


def build_processor(tokenizer=None, min_pixels: int = 56 * 56, max_pixels: int = 224 * 224):
    """Qwen2.5-VL processor over the byte-level tokenizer. With the defaults a 224x224 image gives 64
    <|image_pad|> tokens (16x16 patches of 14 px, merged 2x2); larger images are shrunk to max_pixels."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=tok.chat_template,
    )


def mrope_sections(head_dim: int) -> list[int]:
    """M-RoPE (temporal, height, width) sections in Qwen2.5-VL's 2:3:3 proportion, summing to head_dim / 2 as vLLM
    asserts: [2, 3, 3] for head_dim 16, [16, 24, 24] for the 3B model's 128."""
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


def build_qwen2_5_vl(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 128, min_pixels: int = 56 * 56, max_pixels: int = 224 * 224,
                     tokenizer=None, vision: dict | None = None, vocab_size: int | None = None):
    """A tiny randomly initialised Qwen2_5_VLForConditionalGeneration (fp32) and its processor. `vision` replaces
    the tiny vision tower's settings (e.g. VISION_3B, the real 3B model's tower); `vocab_size` pads the embedding and
    LM head beyond the tokenizer's ids (as Qwen's 151,936 rows pad its tokenizer), for a real model's memory and
    FLOPs: ids past the tokenizer can be sampled, and decode to nothing."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    processor = build_processor(tokenizer, min_pixels=min_pixels, max_pixels=max_pixels)
    tok = processor.tokenizer
    ids = _special_ids(tok)
    tid = tok.convert_tokens_to_ids
    text_config = dict(
        **_text_kwargs(hidden, layers, heads, kv_heads, intermediate, max(vocab_size or 0, len(tok)), 4096),
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_sections(hidden // heads)},
        **ids,
    )
    vision_config = dict(VISION_CONFIG, **(vision or {}), out_hidden_size=hidden)
    cfg = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=True,
        **ids,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    _set_generation_config(model, ids)
    return model, processor
