"""Both backends against the one contract, bapo_vl/backends/base.py: the embedded backend for real, the verl backend
over its stand-ins for verl's GPU workers (tests/test_verl.py). A backend that drops a method or a metric, renames a
parameter, or hands back another type than the contract's fails here."""
import dataclasses
import inspect
import math

import pytest
import torch

from bapo_vl.backends.base import UPDATE_METRICS, Backend, Response, UpdateBatch, UpdateResult
from bapo_vl.train import make_backend
from bapo_vl.config import load_config
from bapo_vl.plugins import get_task
from bapo_vl.reader import read_run
from bapo_vl.train import train

# the stand-ins for verl's rollout manager, FSDP actor and checkpoint engine, and the tiny saved Qwen2 they run
from test_verl import make_verl, model_dir  # noqa: F401 (model_dir is a fixture)

G = 4
PROTOCOL_METHODS = [name for name, _ in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")]


def make_cfg(model_dir, tmp_path, **kw):
    values = dict(task="countdown", task_options="{template: compact}", model=model_dir, device="cpu",
                  dtype="float32", batch_size=4, group_size=G, max_prompt_length=96, max_response_length=6,
                  mini_batch_size=4, micro_batch_size=64, lr=1e-3, delay=2, reeval_every=1, c1=0.25,
                  kl_coef=0.001, steps=3, run_dir=tmp_path, seed=5, online_filter="none")  # a random model solves
    # no countdown problem: without the filter every group is still trained on
    values.update(kw)
    return load_config(overrides=[f"{k}={v}" for k, v in values.items()])


BACKENDS = {"embedded": make_backend, "verl": lambda cfg: make_verl(cfg, dp_size=1, num_workers=1)}


@pytest.fixture(params=sorted(BACKENDS))
def kind(request):
    return request.param


def test_each_backend_declares_the_whole_contract(kind, model_dir, tmp_path):
    # Could fail if a backend lacked a method or named / ordered its parameters otherwise than the Protocol.
    backend = BACKENDS[kind](make_cfg(model_dir, tmp_path))
    assert isinstance(backend, Backend)
    assert {"encode", "generate", "update", "sync", "save_checkpoint", "load_checkpoint"} <= set(PROTOCOL_METHODS)
    # persistence is one pair (plus the Hugging Face export): no state to thread through the trainer's checkpoint
    assert not {"state_dict", "load_state_dict", "load_policy"} & set(PROTOCOL_METHODS)
    for name in PROTOCOL_METHODS:
        want = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
        got = list(inspect.signature(getattr(backend, name)).parameters)
        assert got == want, f"{kind}.{name}{got} != Backend.{name}{want}"
    assert isinstance(backend.name, str) and backend.name == kind


def test_generate_hands_back_responses_with_behaviour_logprobs(kind, model_dir, tmp_path):
    # Could fail if a backend returned tuples, lists, tensors or numpy scalars instead of Response(tuple[int],
    # tuple[float]), a wrong number of responses, log-probs of another length, or log-probs when asked for none.
    cfg = make_cfg(model_dir, tmp_path)
    backend = BACKENDS[kind](cfg)
    problems = get_task("countdown").load(split="train", template="compact")[:3]
    prompts = [backend.encode(p) for p in problems]
    assert not backend.timings
    for policy in ("rollout", "current"):
        out = backend.generate(prompts, G, policy=policy)
        assert type(out) is list and len(out) == 3 and all(type(g) is list and len(g) == G for g in out)
        for r in (r for g in out for r in g):
            assert type(r) is Response and type(r.tokens) is tuple and type(r.logprobs) is tuple
            assert 1 <= len(r.tokens) <= cfg.sampling.max_response_length
            assert len(r.logprobs) == len(r.tokens)
            assert all(type(t) is int for t in r.tokens) and all(type(x) is float and x <= 0 for x in r.logprobs)
            assert isinstance(backend.decode(r.tokens), str)
    # where generate's time went: the engine; the embedded backend also scores the behaviour log-probs itself
    assert set(backend.timings) == ({"sample", "logprobs"} if kind == "embedded" else {"sample"})
    assert all(seconds > 0 for seconds in backend.timings.values())
    assert backend.memory == {}  # no GPU in this process: nothing to record (a GPU run: test_gpu_memory_...)
    if kind == "embedded":  # evaluation's options (the verl backend refuses greedy decoding with a clear error)
        bare = backend.generate(prompts, 1, policy="current", greedy=True, logprobs=False)
        assert all(r.logprobs is None for g in bare for r in g)
        assert bare == backend.generate(prompts, 1, policy="current", greedy=True, logprobs=False)


def test_update_returns_every_metric_as_a_float(kind, model_dir, tmp_path):
    # Could fail if a backend dropped or renamed one of UPDATE_METRICS, or returned tensors / lists / None.
    cfg = make_cfg(model_dir, tmp_path)
    backend = BACKENDS[kind](cfg)
    problems = get_task("countdown").load(split="train", template="compact")[:4]
    prompts = [backend.encode(p) for p in problems]
    responses = backend.generate(prompts, G)
    rewards = tuple(tuple(float(j % 2) for j in range(G)) for _ in problems)
    advantages = tuple(tuple(1.0 if w else -1.0 for w in ws) for ws in rewards)
    batch = UpdateBatch(tuple(prompts), tuple(tuple(g) for g in responses), rewards, advantages, step=1)
    result = backend.update(batch)
    assert isinstance(result, UpdateResult) and result.changed
    metrics = result.metrics
    missing = set(UPDATE_METRICS) - set(metrics)
    assert not missing, f"{kind} dropped {sorted(missing)}"
    for name in UPDATE_METRICS:
        kind_of = int if name in ("optimizer_steps", "trained_tokens") else float
        assert type(metrics[name]) is kind_of and math.isfinite(metrics[name]), (name, metrics[name])
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0 and metrics["kl"] >= 0
    assert metrics["optimizer_steps"] == 1 and metrics["lr"] == cfg.optim.lr  # 4 groups <= mini_batch_size, no schedule
    # every sequence's prompt and response once: 4 prompts x G responses
    assert metrics["trained_tokens"] == sum(len(p["input_ids"]) + len(r.tokens)
                                            for p, group in zip(prompts, responses) for r in group)


def test_the_update_result_is_checked_and_frozen():
    # Could fail if a backend could say the policy changed without its metrics (the record would miss them), say
    # "changed" without an optimizer step (the trainer would count a policy version that does not exist), or a
    # caller could alter a result after the fact.
    full = {k: 1 if k == "optimizer_steps" else 0.5 for k in UPDATE_METRICS}
    result = UpdateResult(changed=True, metrics=full)
    with pytest.raises(TypeError):
        result.metrics["loss"] = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.changed = False
    with pytest.raises(ValueError, match="must report grad_norm"):
        UpdateResult(changed=True, metrics={k: v for k, v in full.items() if k != "grad_norm"})
    with pytest.raises(ValueError, match="optimizer_steps=0"):
        UpdateResult(changed=True, metrics=full | {"optimizer_steps": 0})
    with pytest.raises(ValueError, match="changed=False"):
        UpdateResult(changed=False, metrics=full)
    assert not UpdateResult(changed=False, metrics={"trimmed_groups": 3}).changed


def test_the_update_batch_is_checked_and_frozen():
    # Could fail if a malformed batch reached a backend (it would train on misaligned rewards) or could be mutated.
    r = Response((1, 2), (-0.1, -0.2))
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        Response((1, 2), (-0.1,))
    with pytest.raises(ValueError, match="group 0"):
        UpdateBatch(({},), ((r, r),), ((1.0,),))
    with pytest.raises(ValueError, match="without behaviour log-probs"):
        UpdateBatch(({},), ((Response((1,), None),),), ((1.0,),))
    batch = UpdateBatch(({"a": 1}, {"b": 2}), ((r,), (r,)), ((1.0,), (0.0,)), ((0.5,), (-0.5,)), step=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.step = 4
    assert batch.select([1]).rewards == ((0.0,),) and batch.select([1]).step == 3
    assert [(g, w, a) for g, _, _, w, a in batch.sequences()] == [(0, 1.0, 0.5), (1, 0.0, -0.5)]


def test_metric_names_reach_the_run_record(kind, model_dir, tmp_path):
    # Could fail if a backend's names did not match the record's (a verl run once left loss/KL/entropy/clip-fraction
    # columns empty because verl's actor/* names passed through).
    cfg = make_cfg(model_dir, tmp_path, name=kind)
    backend = BACKENDS[kind](cfg)
    run_dir = train(cfg, quiet=True, backend=backend)
    steps = read_run(run_dir)["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    trained = [s for s in steps if s["trained_groups"]]
    assert trained, "no step trained a group: the test proves nothing"
    for s in trained:
        for name in UPDATE_METRICS:
            kind_of = int if name in ("optimizer_steps", "trained_tokens") else float
            assert isinstance(s.get(name), kind_of) and math.isfinite(s[name]), (s["step"], name, s.get(name))
    # final/ is a Hugging Face model holding the trained weights (verl: merged by verl's own model merger)
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    trained = (backend.policy if kind == "embedded" else backend.actor.policy).state_dict()
    assert all(torch.equal(v, trained[k].to(v.dtype)) for k, v in final.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_of_each_step_reaches_the_run_record(model_dir, tmp_path):
    # Could fail if the embedded backend on a GPU left the record's gpu_memory_* empty, missed what a phase added to
    # the card, or did not clear it between steps (each step's figure is its own, not the run's peak so far).
    cfg = make_cfg(model_dir, tmp_path, name="gpu", device="cuda", rollout_engine="transformers")  # vLLM's: the presets
    backend = make_backend(cfg)
    run_dir = train(cfg, quiet=True, backend=backend)
    steps = read_run(run_dir)["steps"]
    resident = sum(p.numel() * p.element_size() for p in backend.policy.parameters()) / 1e9  # fp32 weights
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    for s in steps:
        generate, train_gb = s["gpu_memory_generate_gb"], s["gpu_memory_train_gb"]
        # the card holds this process's tensors and more (CUDA's context); the update adds gradients and AdamW's moments
        assert resident < generate <= total / 1e9 and resident * 3 < train_gb <= total / 1e9, s
    # a phase that takes 2 GB more of the card records 2 GB more; the next step records its own figure again
    backend.memory.clear()
    with backend.memory.phase("generate"):
        extra = torch.empty(2 * 10**9, dtype=torch.uint8, device="cuda")
    before = backend.memory["generate"]
    assert before >= (total - free) / 1e9 + 2.0
    del extra
    torch.cuda.empty_cache()
    backend.memory.clear()
    with backend.memory.phase("generate"):
        pass
    assert backend.memory["generate"] < before - 1.9
