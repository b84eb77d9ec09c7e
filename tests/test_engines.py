"""The embedded backend's rollout engines (bapo_vl/backends/engines.py): which one `rollout_engine` picks, the
delayed-sync / X2 protocol (sample with pi_theta, keep alpha), and that the stored behaviour log-probs are those of
the tokens sampled, against an unbatched teacher-forced forward of the same weights. vLLM cannot run here: only its
selection and its missing-package error are tested."""
import importlib.util

import pytest
import torch

from bapo_vl.train import make_backend as make_embedded
from bapo_vl.backends.engines import choose_engine
from bapo_vl.config import ConfigError, load_config
from bapo_vl.plugins import get_task

HAS_VLLM = importlib.util.find_spec("vllm") is not None
TOL = 1e-5  # fp32 on CPU: batched (padded) scoring vs one unpadded sequence at a time


def make_backend(**kw):
    values = dict(task="countdown", task_options="{template: compact}", max_prompt_length=96, model="countdown-tiny",
                  device="cpu", dtype="float32", max_response_length=40, delay=3, kl_coef=0.0, seed=3,
                  generate_batch_size=4, micro_batch_size=3) | kw
    return make_embedded(load_config(overrides=[f"{k}={v}" for k, v in values.items()]))


@pytest.fixture(scope="module")
def backend():
    return make_backend()


@pytest.fixture(scope="module")
def prompts(backend):
    problems = get_task("countdown").load(split="train", template="compact")[:3]
    return [backend.encode(p) for p in problems]


def unbatched_logprobs(model, prompt_ids, tokens, temperature):
    """Log-probs of `tokens` after `prompt_ids` from one plain forward: no padding, default positions."""
    ids = torch.cat([prompt_ids, torch.tensor(tokens)])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1), torch.log_softmax(logits, -1)[range(len(tokens)), tokens]


def perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_auto_picks_transformers_without_vllm_or_gpu(backend):
    # Could fail if auto chose vllm on a CPU or where vllm is not installed, or overrode an explicit choice.
    assert choose_engine("auto", torch.device("cpu")) == "transformers"
    assert choose_engine("auto", torch.device("cuda")) == ("vllm" if HAS_VLLM else "transformers")
    assert choose_engine("transformers", torch.device("cuda")) == "transformers"
    assert choose_engine("vllm", torch.device("cpu")) == "vllm"  # VllmEngine then says it needs CUDA
    assert backend.engine.name == "transformers"


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_vllm_without_the_package_is_one_clear_line():
    # Could fail if asking for vllm fell back silently, or failed deep inside an import with a traceback-only message.
    with pytest.raises(ImportError) as err:
        make_backend(rollout_engine="vllm")
    message = str(err.value)
    assert "\n" not in message and "[vllm]" in message and "rollout_engine" in message


def test_config_refuses_an_unknown_engine():
    with pytest.raises(ConfigError, match="rollout_engine"):
        load_config(overrides=["rollout_engine=sglang"])


def test_vllm_options_that_the_config_decides_are_refused_and_others_warn_on_transformers(caplog):
    # Could fail if vllm_options could override the model or lengths the trainer scores with, or were dropped silently.
    with pytest.raises(ValueError, match=r"vllm_options may not set \['max_model_len', 'model'\]"):
        make_backend(rollout_engine="vllm", vllm_options="{model: other, max_model_len: 9, enforce_eager: true}")
    with caplog.at_level("WARNING", logger="bapo_vl.backends.engines"):
        backend = make_backend(vllm_options="{gpu_memory_utilization: 0.5}")
    assert backend.engine.name == "transformers" and "vllm_options are ignored" in caplog.text


def test_stored_logprobs_are_those_of_the_sampled_tokens(backend, prompts):
    # Could fail if the batched scorer's padding / positions disagreed with a plain forward, if the response were cut
    # off the wrong EOS, or if the sampler drew from another distribution than the one scored (greedy: the argmax).
    T = backend.sampling.temperature
    ended = 0
    for greedy, n in ((False, 2), (True, 1)):
        groups = backend.generate(prompts, n, greedy=greedy)
        for prompt, group in zip(prompts, groups):
            for r in group:
                full, ref = unbatched_logprobs(backend.rollout, prompt["input_ids"], list(r.tokens), T)
                assert torch.allclose(torch.tensor(r.logprobs), ref, atol=TOL), (greedy, r.tokens)
                eos = [i for i, t in enumerate(r.tokens) if t in backend.eos_ids]
                assert eos in ([], [len(r.tokens) - 1])  # cut right after the first EOS
                ended += bool(eos)
                if greedy:
                    assert list(r.tokens) == full.argmax(-1).tolist()
    assert ended  # the tiny policy ends its answers within 40 tokens: the EOS cut is exercised


def test_x2_samples_with_pi_theta_and_sync_loads_it_into_alpha(prompts):
    # Could fail if "current" sampled or scored with alpha, if X2's re-evaluation left pi_theta's weights in alpha,
    # or if sync did not reach what the engine samples from.
    b = make_backend()
    perturb(b.policy)  # pi_theta moves away from alpha, as after an update
    T = b.sampling.temperature
    probe = prompts[0]["input_ids"]
    alpha_before = unbatched_logprobs(b.rollout, probe, [5, 6, 7], T)[1]
    theta = unbatched_logprobs(b.policy, probe, [5, 6, 7], T)[1]
    assert not torch.allclose(alpha_before, theta, atol=1e-3)

    (current,), = b.generate(prompts[:1], 1, "current", greedy=True)
    full, ref = unbatched_logprobs(b.policy, probe, list(current.tokens), T)
    assert list(current.tokens) == full.argmax(-1).tolist()  # sampled by pi_theta
    assert torch.allclose(torch.tensor(current.logprobs), ref, atol=TOL)  # and scored by it
    assert torch.equal(unbatched_logprobs(b.rollout, probe, [5, 6, 7], T)[1], alpha_before)  # alpha restored
    (rollout,), = b.generate(prompts[:1], 1, "rollout", greedy=True)
    full = unbatched_logprobs(b.rollout, probe, list(rollout.tokens), T)[0]
    assert list(rollout.tokens) == full.argmax(-1).tolist()

    b.sync()
    (synced,), = b.generate(prompts[:1], 1, "rollout", greedy=True)
    assert synced == current  # alpha now samples and scores as pi_theta did
    assert torch.equal(unbatched_logprobs(b.rollout, probe, [5, 6, 7], T)[1], theta)


def test_vl_prompts_keep_the_text_and_images_a_vllm_engine_processes(tmp_path, geometry3k_source):
    # Could fail if encode changed the text or images after processing them, or a VL prompt lost its images: vLLM
    # (given `raw`, with the config's min/max pixels as mm_processor_kwargs) must see the tokens the trainer scores.
    from transformers import AutoProcessor

    from bapo_vl.tiny import build_qwen2_5_vl

    model, processor = build_qwen2_5_vl(max_pixels=56 * 56)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    backend = make_backend(model=str(tmp_path / "vl"), task="geometry3k", task_options="{}", max_prompt_length=512,
                           max_pixels=56 * 56)
    problems = get_task("geometry3k").load(split="train", source=geometry3k_source, limit=2)
    fresh = AutoProcessor.from_pretrained(tmp_path / "vl", min_pixels=backend.sampling.min_pixels,
                                          max_pixels=backend.sampling.max_pixels)
    for problem in problems:
        enc = backend.encode(problem)
        raw = enc["raw"]
        assert raw["multi_modal_data"]["image"] == list(problem.images) and len(problem.images) == 1
        again = fresh(text=[raw["prompt"]], images=raw["multi_modal_data"]["image"], return_tensors="pt")
        assert torch.equal(again["input_ids"][0], enc["input_ids"])
        assert torch.equal(again["pixel_values"], enc["pixel_values"])


def test_decode_attention_without_kv_copies_changes_no_answer(backend, monkeypatch):
    # Could fail if gqa_decode's view of the query heads paired a query head with the wrong key/value head, dropped
    # the padding mask (these prompts have different lengths, so rows are left-padded), were not what the engine's
    # decode steps ran, or changed training's attention (it must leave prefill and q_len > 1 to transformers).
    import copy

    from bapo_vl.backends import gqa_decode

    model = backend.rollout
    assert model.config._attn_implementation == gqa_decode.NAME
    assert backend.policy.config._attn_implementation == gqa_decode.NAME
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("sdpa")
    encoded = [backend.encode(p) for p in get_task("countdown").load(split="train", template="compact")[:40]]
    prompts = list({len(p["input_ids"]): p for p in encoded}.values())[:4]  # of different lengths: left padding
    assert len(prompts) > 1
    batch = backend._collate(prompts)
    batch.pop("P")
    batch.pop("position_ids", None)
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: shapes.append(tuple(q.shape)) or sdpa(q, *a, **kw))
    greedy = dict(generation_config=backend.greedy, output_scores=True, return_dict_in_generate=True)
    ours = model.generate(**batch, **greedy)
    H, H_kv = model.config.num_attention_heads, model.config.num_key_value_heads
    assert (len(prompts), H_kv, H // H_kv, model.config.hidden_size // H) in shapes  # a decode step, packed
    shapes.clear()
    theirs = plain.generate(**batch, **greedy)
    assert all(s[1] == H for s in shapes)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.scores, theirs.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
