"""One vLLM engine per process (bapo_vl/backends/engines.py, VllmEngine): vLLM's sleep-mode allocator refuses a
second `LLM` in a process, so backends built one after another (the study's evaluations and training segments) share
the first one's engine. vLLM cannot run here: a stand-in `vllm` package, put on sys.path for each test, records what
the engine asks of it and, like vLLM's allocator, fails a second `LLM` in the process."""
import importlib
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from bapo_vl.backends import engines
from bapo_vl.backends.engines import VllmEngine, kv_bytes_per_token, memory_options
from bapo_vl.config import load_config

STAND_IN = '''
"""A stand-in for vLLM: records the calls of the one LLM a process may build."""
from types import SimpleNamespace

built = []


class Model:
    def __init__(self):
        self.weights, self.loads = {}, 0

    def load_weights(self, weights):
        self.weights, self.loads = dict(weights), self.loads + 1


class LLM:
    def __init__(self, **kwargs):
        if built:  # as vLLM's CuMem allocator, which serves one engine per process
            raise AssertionError("CuMem allocator can only be used for one instance per process.")
        built.append(self)
        self.kwargs, self.calls, self.model = kwargs, [], Model()
        # as vLLM's: the vision tower's output for an image, kept across requests until reset_encoder_cache
        self.encoder_cache = {}
        self.llm_engine = SimpleNamespace(reset_encoder_cache=self.reset_encoder_cache)

    def reset_encoder_cache(self):
        self.calls.append("reset_encoder_cache")
        self.encoder_cache.clear()

    def collective_rpc(self, method):
        self.calls.append("collective_rpc")
        return [method(SimpleNamespace(model_runner=SimpleNamespace(model=self.model)))]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append("wake_up")

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append("generate")
        outputs = []
        for prompt in prompts:
            answer = [7, 2, 9]  # 2 is the end of sequence: the engine cuts after it
            if "multi_modal_data" in prompt:  # VL: the answer says which weight load made the image's embedding
                image = prompt["multi_modal_data"]["image"]
                answer = [10 + self.encoder_cache.setdefault(image, self.model.loads), 2]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=answer)] * sampling_params.n))
        return outputs


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
'''
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}


@pytest.fixture
def vllm(tmp_path, monkeypatch):
    """The stand-in vllm package, importable during this test only; no engine held by the process before or after."""
    package = tmp_path / "stand_in" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    (package / "inputs.py").write_text("TokensPrompt = dict\n")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # what VllmEngine sets; restored after the test
    monkeypatch.setattr(engines, "process_engine", None)
    monkeypatch.setattr(engines, "card_bytes", lambda device: 80 * 2 ** 30)  # no card here: an 80 GiB one
    yield importlib.import_module("vllm")
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def backend_like(tmp_path, folder="model", config=CONFIG, seed=3, **overrides):
    """What VllmEngine reads of an EmbeddedBackend on a GPU, with a model folder holding only config.json and alpha
    (= pi_theta, delay 1) a small torch module whose weights depend on the seed."""
    path = tmp_path / folder
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    cfg = load_config(overrides=[f"{k}={v}" for k, v in ({"max_response_length": 40} | overrides).items()])
    torch.manual_seed(seed)
    policy = torch.nn.Linear(3, 2)
    return SimpleNamespace(path=str(path), sampling=cfg.sampling, options=cfg.embedded, device=torch.device("cuda"),
                           seed=seed, is_vl=False, eos_ids={2}, suppress=None, rollout=policy, policy=policy)


def prompts():
    return [{"input_ids": torch.tensor([5, 6])}]


def test_a_second_backend_takes_over_the_engine_and_the_first_refuses_use(vllm, tmp_path):
    # Could fail if the second backend built a second LLM (vLLM's assertion, as in the study), if it kept the first
    # backend's weights or a prefix cache of them, or if the first backend could still drive the engine it lost.
    first_backend, second_backend = backend_like(tmp_path, seed=1), backend_like(tmp_path, seed=2)
    first = VllmEngine(first_backend)
    second = VllmEngine(second_backend)
    (llm,) = vllm.built
    assert llm.calls == ["collective_rpc", "reset_prefix_cache", "reset_encoder_cache"] * 2  # no wake_up: it was awake
    assert torch.equal(llm.model.weights["weight"], second_backend.rollout.weight)
    assert not torch.equal(second_backend.rollout.weight, first_backend.rollout.weight)
    assert second.sample(prompts(), 2, "rollout", greedy=False) == [[7, 2], [7, 2]]

    for use in (lambda: first.sample(prompts(), 1, "rollout", greedy=True), first.sleep, first.wake,
                lambda: first.load_weights(first_backend.rollout.state_dict())):
        with pytest.raises(RuntimeError) as err:
            use()
        message = str(err.value)
        assert "newer backend in this process" in message and "\n" not in message
    assert llm.calls[-1] == "generate"  # the refused calls reached nothing
    assert torch.equal(llm.model.weights["weight"], second_backend.rollout.weight)
    with pytest.raises(AssertionError, match="one instance per process"):
        vllm.LLM(model="another")  # the stand-in fails a second engine as vLLM does


def test_a_sleeping_engine_is_woken_for_the_next_backend_and_its_sleep_followed(vllm, tmp_path):
    # Could fail if a backend took over an engine asleep (its weights pushed into offloaded memory, the next sample
    # on a sleeping engine), or if the process engine's sleep state did not follow the new backend's sleep and wake.
    first = VllmEngine(backend_like(tmp_path))
    first.sleep()  # as during an update
    assert engines.process_engine.asleep
    second = VllmEngine(backend_like(tmp_path))
    (llm,) = vllm.built
    assert llm.calls[3:] == ["sleep(1)", "wake_up", "collective_rpc", "reset_prefix_cache",
                             "reset_encoder_cache"]
    assert not engines.process_engine.asleep
    second.sleep()
    assert engines.process_engine.asleep
    second.wake()
    assert not engines.process_engine.asleep and llm.calls[-2:] == ["sleep(1)", "wake_up"]


def test_other_settings_are_refused_naming_what_differs(vllm, tmp_path):
    # Could fail if a backend of other lengths, vLLM options or model silently used an engine built for another
    # (sequences cut at the old max_model_len, another architecture's weights), or if the refusal took the engine
    # from the backend that holds it.
    first = VllmEngine(backend_like(tmp_path))
    others = {"max_model_len": backend_like(tmp_path, "longer", max_response_length=80),
              "vllm_options": backend_like(tmp_path, "eager", vllm_options="{enforce_eager: true}"),
              "config.json": backend_like(tmp_path, "wider", config=CONFIG | {"hidden_size": 128})}
    for key, backend in others.items():
        with pytest.raises(ValueError) as err:
            VllmEngine(backend)
        message = str(err.value)
        assert f"other {key}," in message and "one sleep-mode engine per process" in message
        assert "own" in message and "\n" not in message
    assert len(vllm.built) == 1
    first.sleep()  # still the first backend's
    first.wake()


def test_another_checkpoint_folder_with_the_same_config_is_compatible(vllm, tmp_path):
    # Could fail if compatibility compared the model's path (each checkpoint has its own folder) or the seed (each
    # evaluation of the study has its own) rather than what vLLM built.
    VllmEngine(backend_like(tmp_path, "model", seed=1))
    checkpoint = backend_like(tmp_path, "checkpoints/step_2", seed=7)
    (tmp_path / "checkpoints" / "step_2" / "config.json").write_text(json.dumps(CONFIG))  # the same, written otherwise
    VllmEngine(checkpoint)
    (llm,) = vllm.built
    assert llm.kwargs["model"] == str(tmp_path / "model")  # vLLM's model (and a VL engine's processor) stay the first
    assert torch.equal(llm.model.weights["weight"], checkpoint.rollout.weight)


def test_an_engine_without_sleep_mode_keeps_its_memory_through_the_update(vllm, tmp_path):
    # Could fail if enable_sleep_mode stayed fixed by the config (runs sharing a card then fail vLLM's check of a sleep
    # by the card's free memory), if the engine still called sleep or wake_up without it, or if the default changed.
    engine = VllmEngine(backend_like(tmp_path, vllm_options="{enable_sleep_mode: false, gpu_memory_utilization: 0.1}"))
    (llm,) = vllm.built
    assert llm.kwargs["enable_sleep_mode"] is False and llm.kwargs["gpu_memory_utilization"] == 0.1
    engine.sleep()
    engine.wake()
    assert not engines.process_engine.asleep
    assert engine.sample(prompts(), 1, "rollout", greedy=True) == [[7, 2]]
    assert llm.calls == ["collective_rpc", "reset_prefix_cache", "reset_encoder_cache", "generate"]
    engines.process_engine = None
    vllm.built.clear()
    VllmEngine(backend_like(tmp_path, "default"))
    assert vllm.built[0].kwargs["enable_sleep_mode"] is True and vllm.built[0].kwargs["max_num_seqs"] == 1024


def test_no_image_is_answered_with_vision_embeddings_of_weights_no_longer_loaded(vllm, tmp_path):
    # Could fail if a weight load kept vLLM's encoder cache, which holds each image's vision embeddings across
    # requests: X2's greedy answers under pi_theta would then see alpha's embeddings of an image already sampled,
    # and after a sync every recently seen image would keep the old alpha's (on a GPU: engine_checks.py's x2 and sync).
    backend = backend_like(tmp_path)
    backend.is_vl, backend.policy = True, torch.nn.Linear(3, 2)  # pi_theta apart from alpha (delay > 1)
    engine = VllmEngine(backend)  # load 1: alpha
    (llm,) = vllm.built
    diagram = [{"raw": {"prompt": "Find x.", "multi_modal_data": {"image": "diagram-1"}}}]
    assert engine.sample(diagram, 2, "rollout", greedy=False) == [[11, 2], [11, 2]]
    assert engine.sample(diagram, 1, "current", greedy=True) == [[12, 2]]  # load 2: pi_theta; load 3: alpha again
    assert torch.equal(llm.model.weights["weight"], backend.rollout.weight)
    assert engine.sample(diagram, 1, "rollout", greedy=True) == [[13, 2]]
    engine.load_weights(backend.policy.state_dict())  # a sync: alpha <- pi_theta
    assert engine.sample(diagram, 1, "rollout", greedy=True) == [[14, 2]]


QWEN2_SMALL = CONFIG | {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN25_VL_3B = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": {"depth": 32},
                "text_config": {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
                                "num_key_value_heads": 2}}


def test_the_kv_cache_is_sized_to_the_work_unless_that_takes_more_than_the_default_share():
    # Could fail if the cache were counted with query heads instead of key/value heads, or missed the VL model's
    # text config, if a large model's cache were sized past the default share, or if the user's setting were
    # overridden.
    assert kv_bytes_per_token(QWEN2_SMALL) == 2 * 2 * 2 * 16 * 2  # K and V, layers, kv heads, head dim, bf16
    assert kv_bytes_per_token(QWEN25_VL_3B) == 2 * 36 * 2 * 128 * 2
    assert kv_bytes_per_token(CONFIG) is None  # config.json does not say: vLLM's default share
    card = 80 * 2 ** 30
    small = memory_options({}, QWEN2_SMALL, 576, 10 ** 8, card)
    assert small["kv_cache_memory_bytes"] == 256 * 1024 * 576
    assert small["max_num_seqs"] == 1024 and small["enable_sleep_mode"] is True
    needed = small["kv_cache_memory_bytes"] + 10 ** 8 + 2 * 2 ** 30
    assert needed <= small["gpu_memory_utilization"] * card < needed + card / 1000  # the start-up check, no more
    # the 3B VL model at 1,024 + 2,048 tokens: 1,024 sequences would need 108 GiB, over 0.3 of the card
    assert memory_options({}, QWEN25_VL_3B, 3072, 7 * 10 ** 9, card) == engines.DEFAULT_OPTIONS
    assert memory_options({"max_num_seqs": 64}, QWEN25_VL_3B, 3072, 7 * 10 ** 9, card)["kv_cache_memory_bytes"] \
        == 36864 * 64 * 3072
    for user in ({"gpu_memory_utilization": 0.5}, {"kv_cache_memory_bytes": 2 ** 32}):
        options = memory_options(user, QWEN2_SMALL, 576, 10 ** 8, card)
        assert options == {**engines.DEFAULT_OPTIONS, **user}


def test_the_engine_is_built_with_the_sized_cache(vllm, tmp_path):
    # Could fail if VllmEngine still passed the default share (several evaluations on one card then fail vLLM's
    # start-up profile with a negative cache) or sized the cache for another length than max_model_len.
    backend = backend_like(tmp_path, config=QWEN2_SMALL)
    VllmEngine(backend)
    (llm,) = vllm.built
    max_model_len = backend.sampling.max_prompt_length + 40
    assert llm.kwargs["max_model_len"] == max_model_len
    assert llm.kwargs["kv_cache_memory_bytes"] == 256 * 1024 * max_model_len
    assert llm.kwargs["gpu_memory_utilization"] < 0.3
