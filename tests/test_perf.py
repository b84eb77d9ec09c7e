"""bapo_vl.perf: EasyR1's throughput and MFU definitions."""
import pytest

from bapo_vl.perf import actor_mfu, model_flops, peak_flops, tokens_per_gpu_second

TINY = dict(hidden_size=4, num_hidden_layers=1, vocab_size=10, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=8)


def test_model_flops_by_hand():
    # per layer 3*4*8 + 4*(4 + 2 + 2 + 4) = 144; dense 144 + 2*10*4 = 224; 6*224*8 + 12*(9 + 25)*2*2*1
    assert model_flops(TINY, [3, 5]) == 6 * 224 * 8 + 12 * 34 * 2 * 2


def test_dense_count_is_the_layers_weight_matrices():
    # Could fail if the per-layer count missed a projection or miscounted grouped-query K/V: N must be the
    # decoder layer's weight matrices exactly, as a real Qwen2 layer holds them.
    from bapo_vl.tiny import build_qwen2

    model, _ = build_qwen2(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    cfg = model.config
    layer = model.model.layers[0]
    matrices = sum(p.numel() for p in layer.parameters() if p.ndim == 2)
    one_token = model_flops(cfg, [1]) - 12 * 1 * (64 // 4) * 4 * 2  # minus the attention term of s = 1
    assert one_token == 6 * (matrices * cfg.num_hidden_layers + 2 * cfg.vocab_size * cfg.hidden_size)


def test_vl_config_counts_its_language_model():
    from bapo_vl.tiny import build_qwen2_5_vl

    model, _ = build_qwen2_5_vl(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    text = model.config.text_config
    plain = {k: getattr(text, k) for k in TINY}
    assert model_flops(model.config, [7, 9]) == model_flops(plain, [7, 9]) > 0


def test_mfu_and_throughput():
    flops = model_flops(TINY, [3, 5])
    assert actor_mfu(TINY, [3, 5], seconds=2.0, gpus=4, peak=1e3, epochs=2) == pytest.approx(flops * 2 / (2 * 4 * 1e3))
    assert actor_mfu(TINY, [3, 5], seconds=2.0, gpus=1, peak=None) is None  # an unknown card: no figure
    assert tokens_per_gpu_second(1800 * 8 * 120, 120.0, 8) == 1800


def test_peaks():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None
