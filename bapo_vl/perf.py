"""Throughput and MFU as EasyR1 defines them (its verl/utils/flops_counter.py and fsdp_workers.py), so a run's figures
compare with its published per-GPU baselines.

    tokens/s per GPU   the prompt + response tokens of a step's batch / (seconds of the step x GPUs)
    actor MFU          the update's model FLOPs x PPO epochs / (seconds of the update x GPUs x the card's peak)
    model FLOPs        6 N T + 12 (sum of s^2) d_head n_heads L, over the language model only: N counts every
                       layer's MLP (3 h i) and attention projections (h (q + k + v + o)) plus embedding and LM head
                       (2 V h, tied or not); T the tokens, s each sequence's length, d_head = h / n_heads

The vision tower's FLOPs are not counted (nor are they by EasyR1), so a VL model's MFU is a lower bound. Peaks are
the dense bf16 figures EasyR1 uses (H100 989 TFLOP/s); a card it does not list has none here either, and its MFU is
left out rather than guessed.
"""
from __future__ import annotations

# dense bf16 peak FLOP/s by a substring of torch.cuda.get_device_name(), EasyR1's table (H200: the H100's chip)
PEAK_BF16 = {"H100": 989e12, "H800": 989e12, "H200": 989e12, "A100": 312e12, "A800": 312e12, "L40": 181.05e12,
             "L20": 119.5e12, "H20": 148e12}


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def _text(config):
    """The language model's settings: a VL config's text_config, or the config itself; mapping or object."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text = get("text_config")
    return _text(text) if text is not None else get


def model_flops(config, seqlens: list[int]) -> float:
    """Forward + backward FLOPs of one pass over sequences of these lengths (EasyR1's count)."""
    get = _text(config)
    h, layers, vocab = get("hidden_size"), get("num_hidden_layers"), get("vocab_size")
    heads, kv_heads, inter = get("num_attention_heads"), get("num_key_value_heads"), get("intermediate_size")
    d_head = h // heads
    per_layer = 3 * h * inter + h * (heads * d_head + 2 * kv_heads * d_head + heads * d_head)
    dense = per_layer * layers + 2 * vocab * h
    attention = 12 * sum(s * s for s in seqlens) * d_head * heads * layers
    return 6 * dense * sum(seqlens) + attention


def actor_mfu(config, seqlens: list[int], seconds: float, gpus: int, peak: float | None, epochs: int = 1) -> float | None:
    """The update's MFU: seqlens are the trained sequences' prompt + response lengths, seconds the update's wall time."""
    if not peak or seconds <= 0:
        return None
    return model_flops(config, seqlens) * epochs / (seconds * gpus * peak)


def tokens_per_gpu_second(tokens: int, seconds: float, gpus: int) -> float:
    return tokens / (seconds * gpus)
