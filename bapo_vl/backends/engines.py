"""Rollout engines of the embedded backend: what samples the response tokens (`rollout_engine=auto|transformers|vllm`).

An engine only samples token ids and holds the rollout policy alpha's weights. The behaviour log-probs are always
computed by the backend afterwards, with a teacher-forced forward of the same weights in the trainer's own model
code (EmbeddedBackend.score): so what is stored is exactly the log-prob, under alpha (or pi_theta for X2), of the
tokens that were sampled, whichever engine sampled them.

    transformers  `model.generate` with a dynamic cache on the backend's own alpha / pi_theta models; always there.
    vllm          a colocated vLLM engine holding alpha ([vllm] extra, CUDA), text and Qwen2.5-VL models; checked
                  on a GPU by scripts/gpu/engine_checks.py (its speed against `model.generate`: docs/results.md).
    auto          vllm when it is installed and the device is cuda; else transformers.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from bapo_vl.backends.base import Policy
from bapo_vl.backends.gpu_memory import named

log = logging.getLogger(__name__)


class RolloutEngine(Protocol):
    name: str

    def sample(self, prompts: list[dict], n: int, policy: Policy, greedy: bool) -> list[list[int]]:
        """Token ids of n responses per prompt (prompt i's at [i*n, (i+1)*n)), each cut after its first EOS."""

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """alpha <- these weights (the delayed sync)."""

    def sleep(self) -> None:
        """Free the engine's memory for the update (weights kept)."""

    def wake(self) -> None: ...


def resolve_device(setting: str) -> torch.device:
    """What device=`setting` (auto | cpu | cuda) runs on here: auto is cuda when a GPU is visible."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def choose_engine(name: str, device: torch.device) -> str:
    """The engine `rollout_engine=name` means here: auto picks the fastest one that can run (vLLM, text and VL alike:
    docs/results.md has both measured against model.generate, and both passed scripts/gpu/engine_checks.py)."""
    if name != "auto":
        return name
    fast = device.type == "cuda" and importlib.util.find_spec("vllm") is not None
    return "vllm" if fast else "transformers"


def make_engine(backend) -> RolloutEngine:
    name = choose_engine(backend.options.rollout_engine, backend.device)
    if name != "vllm" and backend.options.vllm_options:
        log.warning("vllm_options are ignored: the rollout engine is %s", name)
    return {"transformers": TransformersEngine, "vllm": VllmEngine}[name](backend)


def cut_at_eos(row: list[int], eos_ids: set[int]) -> list[int]:
    """The response up to and including its first EOS (at least one token)."""
    end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
    return row[:max(end, 1)]


class TransformersEngine:
    """`model.generate` on the backend's alpha (`backend.rollout`) or pi_theta (`backend.policy`): X2's
    re-evaluation needs no weight swap since both models are resident. Rows that finished early still ride along
    until the chunk's longest row ends. transformers' continuous batching (`generate_batch`) was measured as the
    alternative and is not used: it was slower and held far more memory (scripts/bench_gpu.py, docs/results.md). Text models with grouped key/value heads decode with
    `gqa_decode`'s attention (no copy of the KV cache per step; prefill and training are unchanged)."""

    name = "transformers"

    def __init__(self, backend):
        from bapo_vl.backends import gqa_decode

        self.backend = backend
        for model in {id(m): m for m in (backend.rollout, backend.policy)}.values():
            gqa_decode.use(model)

    def sample(self, prompts, n, policy, greedy):
        b = self.backend
        model = b.rollout if policy == "rollout" else b.policy
        generation = b.greedy if greedy else b.generation
        flat = [p for p in prompts for _ in range(n)]
        tokens: list[list[int]] = []
        for i in range(0, len(flat), b.options.generate_batch_size):
            batch = b._collate(flat[i:i + b.options.generate_batch_size])
            P = batch.pop("P")
            batch.pop("position_ids", None)  # generate derives positions from the mask
            # compile=true compiled the blocks for the update's shapes; decoding one token at a time stays eager
            with b._autocast(), torch.compiler.set_stance("force_eager"), named(
                    f"sampling {len(batch['input_ids'])} responses of up to {generation.max_new_tokens} tokens",
                    f"lower generate_batch_size (now {b.options.generate_batch_size}), or sample with "
                    "rollout_engine=vllm (its KV cache is paged, and sized to the card)"):
                out = model.generate(**batch, generation_config=generation)
            tokens += [cut_at_eos(row, b.eos_ids) for row in out[:, P:].tolist()]
        return tokens

    def load_weights(self, state_dict):
        pass  # it samples from the backend's own alpha copy, which the backend's sync has already updated

    def sleep(self):
        pass

    def wake(self):
        pass


FIXED_BY_CONFIG = {"model", "dtype", "seed", "max_model_len", "skip_tokenizer_init", "mm_processor_kwargs"}
DEFAULT_OPTIONS = {"gpu_memory_utilization": 0.3, "max_num_seqs": 1024, "enable_sleep_mode": True}


def kv_bytes_per_token(config: dict) -> int | None:
    """Bytes of keys and values one token holds in vLLM's bf16 cache over all layers (a VL model's text config),
    or None where config.json does not say."""
    text = config.get("text_config") or config
    try:
        heads, layers, hidden = text["num_attention_heads"], text["num_hidden_layers"], text["hidden_size"]
    except KeyError:
        return None
    head_dim = text.get("head_dim") or hidden // heads
    return 2 * layers * text.get("num_key_value_heads", heads) * head_dim * 2


def memory_options(vllm_options: dict, config: dict, max_model_len: int, weight_bytes: int,
                   card_memory: int) -> dict:
    """vLLM's options with its memory settled. The user's gpu_memory_utilization or kv_cache_memory_bytes stand.
    Otherwise, where max_num_seqs sequences of full length fit in the default share of the card, the KV cache is
    sized to them: vLLM then skips its start-up memory profile, which counts what other processes on the card
    allocate meanwhile as its own (evaluations and runs sharing a card fail with a negative cache), and takes no more
    than the work needs. Its utilization then only gates the start-up check of free memory: cache, bf16 weights and
    2 GiB for activations."""
    options = {**DEFAULT_OPTIONS, **vllm_options}
    per_token = kv_bytes_per_token(config)
    if {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(vllm_options) or per_token is None:
        return options
    cache = per_token * options["max_num_seqs"] * max_model_len
    needed = cache + weight_bytes + 2 * 2 ** 30
    if needed > DEFAULT_OPTIONS["gpu_memory_utilization"] * card_memory:
        return options
    utilization = math.ceil(1000 * needed / card_memory) / 1000
    return {**options, "kv_cache_memory_bytes": cache, "gpu_memory_utilization": utilization}


def card_bytes(device: torch.device) -> int:
    """The card's memory in bytes."""
    return torch.cuda.get_device_properties(device).total_memory


def sleeps(vllm_options: dict) -> bool:
    """Whether the engine sleeps through each update (vllm_options' enable_sleep_mode, on unless set false)."""
    return bool({**DEFAULT_OPTIONS, **vllm_options}["enable_sleep_mode"])


@dataclass
class ProcessEngine:
    """The one vLLM `LLM` this process holds: vLLM's sleep-mode (CuMem) allocator serves one engine per process."""
    llm: object
    settings: dict  # what a later VllmEngine must match to take it over (VllmEngine.__init__)
    asleep: bool = False
    user: object = None  # the VllmEngine using it now; earlier ones are superseded


process_engine: ProcessEngine | None = None


def model_config(path: str) -> dict:
    """The model's config.json (a folder's, or the hub cache's for a hub id): the architecture vLLM builds."""
    from transformers.utils import cached_file

    return json.loads(Path(cached_file(path, "config.json")).read_text())


class VllmEngine:
    """A colocated vLLM engine holding alpha, as TRL's colocate mode does (vLLM 0.24). Its protocol is checked on a
    GPU by scripts/gpu/engine_checks.py (behaviour log-probs, stale alpha, X2 and restore, sleep/wake, sync, for text
    and Qwen2.5-VL models); on CPU its selection, the missing-package error and the engine's reuse (against a
    stand-in vllm package, tests/test_vllm_engine_reuse.py) are tested.

    - sync (every v steps): alpha's new weights are loaded in place through `collective_rpc` into the worker's model
      (`load_weights`), which needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine runs in this process); then the
      prefix and encoder caches are reset, as vLLM's own weight reload does.
    - X2 (policy="current"): pi_theta's weights are pushed, the responses sampled, then alpha's weights (the backend's
      own alpha copy, which also scores the behaviour log-probs) are pushed back.
    - update: the engine sleeps (level 1: weights offloaded to CPU, KV cache freed) so the trainer gets the memory.
      With vllm_options {enable_sleep_mode: false} it keeps its memory instead: vLLM checks a sleep by the card's
      free memory, which another process on the card changes meanwhile (several runs sharing a card).
    - VL: vLLM gets the chat text and the PIL
      images `encode` kept (`raw`) and processes them itself with the trainer's min/max pixels, so it sees the image
      grid the trainer scores with; it then needs the tokenizer (text models skip it).
    - one per process: vLLM's sleep mode allows one engine per process, so a later VllmEngine (the study's next
      backend) with the same settings takes over `process_engine`, woken if asleep and given its backend's weights;
      the earlier VllmEngine then refuses use. Other settings are a ValueError."""

    name = "vllm"

    def __init__(self, backend):
        global process_engine
        if clash := sorted(set(backend.options.vllm_options) & FIXED_BY_CONFIG):
            raise ValueError(f"vllm_options may not set {clash}: the engine derives them from the config")
        if importlib.util.find_spec("vllm") is None:
            raise ImportError("rollout_engine=vllm needs vLLM: pip install 'bapo-vl[vllm]' (or rollout_engine=auto)")
        if backend.device.type != "cuda":
            raise ValueError("rollout_engine=vllm runs on device=cuda only; use rollout_engine=transformers")
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc reaches the in-process worker
        from vllm import LLM, SamplingParams

        self.backend, sampling = backend, backend.sampling
        fixed = dict(model=backend.path, dtype="bfloat16", seed=backend.seed,
                     max_model_len=sampling.max_prompt_length + sampling.max_response_length,
                     skip_tokenizer_init=not backend.is_vl,  # token ids in and out for text: ours may not load there
                     mm_processor_kwargs={"min_pixels": sampling.min_pixels, "max_pixels": sampling.max_pixels}
                     if backend.is_vl else None)
        assert set(fixed) == FIXED_BY_CONFIG
        # Not compared: the path (config.json's content stands for the model; the tokenizer and processor a VL
        # engine loaded from the first path are those of every checkpoint of one run) and the seed (sampling draws
        # one per request from torch's generator, which each backend seeds; greedy draws none).
        settings = {"config.json": model_config(backend.path), "vllm_options": dict(backend.options.vllm_options),
                    **{k: v for k, v in fixed.items() if k not in ("model", "seed")}}
        if process_engine is None:
            # decode is bandwidth-bound: wide batches; the trainer needs the rest of the card
            weight_bytes = 2 * sum(p.numel() for p in backend.rollout.parameters())  # served in bf16
            llm = LLM(**fixed, **memory_options(backend.options.vllm_options, settings["config.json"],
                                                fixed["max_model_len"], weight_bytes, card_bytes(backend.device)))
            process_engine = ProcessEngine(llm, settings)
        elif differ := sorted(k for k in settings if settings[k] != process_engine.settings[k]):
            raise ValueError(f"rollout_engine=vllm: this process already holds a vLLM engine built with other "
                             f"{', '.join(differ)}, and vLLM allows one sleep-mode engine per process; run this "
                             f"backend in a process of its own")
        else:
            log.info("vLLM engine: the one this process already holds, given this backend's weights")
        process_engine.user = self
        self.process_engine = process_engine
        if process_engine.asleep:  # the previous backend left it asleep
            self.wake()
        stop = sorted(backend.eos_ids)
        common = dict(max_tokens=sampling.max_response_length, stop_token_ids=stop, detokenize=False,
                      # as the transformers engine's suppress_tokens: an image placeholder in a response breaks scoring
                      logit_bias={t: -100.0 for t in backend.suppress} if backend.suppress else None)
        # logprobs are not asked for: the backend scores alpha's with the trainer's model code.
        self.sampling = lambda n: SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                                                 top_k=sampling.top_k, seed=int(torch.randint(2 ** 31, ())), **common)
        self.greedy = SamplingParams(n=1, temperature=0.0, **common)
        self.load_weights(backend.rollout.state_dict())

    @property
    def llm(self):
        if self.process_engine.user is not self:
            raise RuntimeError("this vLLM engine now belongs to a newer backend in this process (vLLM allows one "
                               "sleep-mode engine per process): use that backend's engine")
        return self.process_engine.llm

    def sample(self, prompts, n, policy, greedy):
        b = self.backend
        if policy == "current" and b.rollout is not b.policy:
            self.load_weights(b.policy.state_dict())
        try:
            outs = self.llm.generate(self.inputs(prompts), self.greedy if greedy else self.sampling(n), use_tqdm=False)
        finally:
            if policy == "current" and b.rollout is not b.policy:
                self.load_weights(b.rollout.state_dict())  # back to alpha
        return [cut_at_eos(list(o.token_ids), b.eos_ids) for out in outs for o in out.outputs]

    def inputs(self, prompts: list[dict]) -> list:
        """vLLM's prompts: our token ids (text), or the chat text and images for vLLM's own processor (VL)."""
        from vllm.inputs import TokensPrompt

        if self.backend.is_vl:
            return [p["raw"] for p in prompts]
        return [TokensPrompt(prompt_token_ids=p["input_ids"].tolist()) for p in prompts]

    def load_weights(self, state_dict):
        weights = list(state_dict.items())

        def load(worker):
            worker.model_runner.model.load_weights(weights=weights)

        llm = self.llm
        llm.collective_rpc(load)
        # what was computed under the previous weights must not serve the next generate: the prompts' KV, and
        # (VL) the vision tower's embeddings, which vLLM keeps by image across requests (vLLM's own weight reload
        # resets both; loading through the worker's model does not)
        llm.reset_prefix_cache()
        llm.llm_engine.reset_encoder_cache()

    def sleep(self):
        if not sleeps(self.backend.options.vllm_options):
            return
        self.llm.sleep(level=1)
        self.process_engine.asleep = True

    def wake(self):
        llm = self.llm
        if not self.process_engine.asleep:
            return
        # hand the update's freed blocks back from torch's cache before vLLM maps its memory again: the 2 B VL
        # shape's wake ran out of memory on an 80 GB card while torch still held them (rerun on a 141 GB card only)
        torch.cuda.empty_cache()
        llm.wake_up()
        self.process_engine.asleep = False
