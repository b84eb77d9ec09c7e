"""Decode attention for grouped-query models without copying the KV cache.

transformers' SDPA path repeats every layer's K and V from the key/value heads to all query heads whenever an
attention mask is given (`repeat_kv`), which a batch of left-padded prompts always has: a full copy of the cache
written per layer per decode step, which the attention then reads H / H_kv times over. For one new token per row the same attention is a plain one over the key/value heads: the query heads that
share a key/value head become that head's query rows (the padding mask is the same for all of them), so
(B, H, 1, D) queries are read as (B, H_kv, H / H_kv, D) and the cache is not copied. Prefill, training and models
without grouped heads go through transformers' own SDPA function unchanged.

`use(model)` switches a text model to it; it changes no result beyond float summation order
(tests/test_engines.py: greedy answers identical, every decode step's scores to 1e-5)."""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa_decode"


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              **kwargs):
    B, H, q_len, D = query.shape
    H_kv = key.shape[1]
    if q_len != 1 or H_kv == H or attention_mask is None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(  # (B, H_kv, H / H_kv, D): query head k * g + j -> [k, j]
        query.reshape(B, H_kv, H // H_kv, D), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, 1, H, D), None  # transformers' layout: (B, q_len, H, D)


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use(model) -> bool:
    """Switch a text model with grouped key/value heads from SDPA to this attention; False when it does not apply."""
    cfg = model.config
    grouped = getattr(cfg, "num_key_value_heads", None) not in (None, getattr(cfg, "num_attention_heads", None))
    if not grouped or hasattr(cfg, "vision_config") or cfg._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True
