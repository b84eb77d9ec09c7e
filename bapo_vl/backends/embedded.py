"""Embedded backend: one process, CPU or one CUDA GPU, Hugging Face transformers models.

It holds three copies of the policy: the trainer policy pi_theta (updated every step), the rollout policy alpha
(a copy refreshed only by `sync()`, i.e. every v steps) and a frozen reference for the KL term. It only
generates, scores log-probs, updates and syncs; what to train on is decided in bapo_vl/algorithm.py.

Sequence layout (bapo_vl/backends/base.py::pack): [left pad][prompt][response][right pad]; every response starts at
the same column P, so the LM head is applied to the response positions only (see `_token_logprobs`).

The update keeps the host off the GPU's critical path: batches go to the device from pinned memory without waiting,
response tokens are picked by index tensors built on the host (no boolean-mask indexing, which waits for the device
to count), the loss terms move to the device once per update, and the metrics stay tensors until one transfer at
the end; what still waits is the gradient norm, once per optimizer step (a non-finite one skips the step).
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import random
import time
import types
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import GenerationConfig, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from bapo_vl.backends.base import (CheckpointError, Policy, Response, UpdateBatch, UpdateResult, load_checkpoint_file,
                                   filled, old_logprobs, pack, right_pad)
from bapo_vl.backends.critic import ValueModel
from bapo_vl.backends.mixed_precision import ComputeCopy, autocast_copy
from bapo_vl.backends.engines import make_engine, resolve_device
from bapo_vl.backends.gpu_memory import PhaseMemory, named
from bapo_vl.lm_head import token_logprobs
from bapo_vl.losses import (MICRO_BATCH_STATISTICS, gae_advantages, largest_ratio_per_row, to_host, total_loss,
                             value_loss)
from bapo_vl.models import resolve_model
from bapo_vl import mrope
from bapo_vl.mrope import PromptPositions, VisionInputs, batch_positions
from bapo_vl.optim import lr_factor, mini_batches
from bapo_vl.problem import Problem
from bapo_vl.shared_images import IMAGE_KEYS, last_hidden_state, shared_image_inputs
from bapo_vl.vision_attention import use_segment_attention
from bapo_vl.workarounds import update_attention

log = logging.getLogger(__name__)
CHECKPOINT = "backend.pt"  # what save_checkpoint writes into a checkpoint folder
CHECKPOINT_KEYS = ("policy", "optimizer", "rollout", "critic", "rng", "torch_rng", "cuda_rng")
# float32 logits materialised at once: 512 response tokens of a 151,936-word vocabulary (Qwen's); a smaller
# vocabulary takes more tokens at a time (fewer, larger chunks: less host time per update)
LOGIT_FLOATS = 512 * 151_936


ADDITIVE = ("loss", "pg_loss", "kl", "entropy")  # micro-batch terms that add up to the mini-batch's
LARGEST = ("ratio_max",)  # taken as the largest over micro-batches, mini-batches and epochs


def _combine(micro_metrics: list[dict]) -> dict:
    """Mini-batch metrics: additive loss terms summed, maxima (LARGEST) the largest, per-token means (clip_frac,
    ...) token-weighted. The values are 0-d tensors (total_loss's, on the device) or numbers; so is the result,
    computed without a device sync."""
    n = sum(m["n_valid_tokens"] for m in micro_metrics)
    n = n.clamp(min=1) if isinstance(n, torch.Tensor) else (n or 1)
    out = {k: sum(m[k] for m in micro_metrics) for k in ADDITIVE}
    out |= {k: _largest([m[k] for m in micro_metrics]) for k in LARGEST if k in micro_metrics[0]}
    for k in micro_metrics[0]:
        if k not in ADDITIVE and k not in LARGEST and k != "n_valid_tokens":
            out[k] = sum(m[k] * m["n_valid_tokens"] for m in micro_metrics) / n
    return out


def _largest(values: list):
    """The largest of 0-d tensors (on the device, no sync) or numbers."""
    if isinstance(values[0], torch.Tensor):
        return torch.stack([torch.as_tensor(v, device=values[0].device) for v in values]).amax()
    return max(values)


def response_positions(lengths: list[int], P: int, L: int) -> torch.Tensor:
    """(2, n) flat indices of the n = sum(lengths) response tokens of a [left pad][prompt][response][right pad] batch
    of rows of L columns whose responses start at column P: row 0 into the (B * L) hidden states, of the state that
    predicts each token (its target is the next column); row 1 into the (B * R) right-padded response layout,
    R = max(lengths). Built on the host from the lengths alone, so picking the tokens on the device waits for nothing.
    In numpy: this is the host's last work before a micro-batch's forward, where a stall idles the GPU, and torch's
    CPU operators here (repeat_interleave runs a parallel region per call) stalled on a loaded host."""
    R = max(lengths, default=0)
    counts = np.asarray(lengths, dtype=np.int64)
    row = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # (n,) the sequence
    col = np.arange(len(row), dtype=np.int64) - (np.cumsum(counts) - counts)[row]  # (n,) the position in its response
    return torch.from_numpy(np.stack([row * L + P - 1 + col, row * R + col]))


def clipped_step(optimizer, model: torch.nn.Module, max_norm: float, step: int) -> float:
    """Clip the gradient norm and step, unless the norm is not finite: then the step is skipped (as verl's actor
    does), since clipping by a NaN/inf norm would turn every weight into NaN. Returns the norm before clipping."""
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    norm = float(total)
    if math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
        optimizer.step()
    else:
        where: dict[str, list[int]] = {}  # module prefix -> [tensors with non-finite gradients, tensors]
        for n, p in model.named_parameters():
            if p.grad is not None:
                counts = where.setdefault(".".join(n.split(".")[:2]), [0, 0])
                counts[0] += int(not torch.isfinite(p.grad).all())
                counts[1] += 1
        log.warning("step %d: gradient norm %s; optimizer step skipped. Tensors with non-finite gradients: %s", step,
                    norm, ", ".join(f"{k} {b}/{t}" for k, (b, t) in where.items() if b) or "none")
    optimizer.zero_grad(set_to_none=True)
    return norm


def repeated_blocks(model: torch.nn.Module, setting: str) -> list[torch.nn.Module]:
    """The blocks the model repeats: the classes its `_no_split_modules` names (decoder layers, vision blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{setting}: {type(model).__name__} names no repeated blocks (its _no_split_modules)")
    return blocks


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile, in place, each block the model repeats, as regional compilation does: the blocks share one
    compiled graph, so compiling takes one block's time, and the attention masks and loss outside them stay eager
    (the LM head's chunks compile on their own: bapo_vl/lm_head.py). Returns how many."""
    blocks = repeated_blocks(model, "compile=true")
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def checkpoint_blocks(model: torch.nn.Module) -> int:
    """Activation checkpointing of each block the model repeats, in place: with gradients enabled a block keeps
    only its inputs and runs its forward again in the backward (torch.utils.checkpoint, non-reentrant); without
    them (scoring, sampling with a KV cache) it runs as it was. Unlike transformers' own switch this does not
    need train() mode, which the policy never enters (no dropout). Returns how many."""
    blocks = repeated_blocks(model, "gradient_checkpointing=true")
    for block in blocks:  # a bound method, so that a deep copy of the model (the critic's body) runs its own weights
        block.forward = types.MethodType(_checkpointed_forward, block)
    return len(blocks)


def _checkpointed_forward(block, *args, **kwargs):
    forward = functools.partial(type(block).forward, block)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _by_length(idx: list[int], prompts: list[dict], responses: list) -> list[int]:
    """idx ordered by sequence length (prompt + response): micro-batches of neighbours are padded little."""
    return sorted(idx, key=lambda i: len(prompts[i]["input_ids"]) + len(responses[i]))


def _chunks(items, size):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def load_into(target, state: dict, file: Path, what: str) -> None:
    """target.load_state_dict(state) for a model or optimizer; state of another model (other shapes or names) is
    one CheckpointError line naming the file, not torch's listing of every key."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, TypeError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{file}: its {what} does not fit this run's model ({type(e).__name__}: {reason})") from e


class PromptEncoder:
    """The embedded backend's `encode` without the model: the model folder's tokenizer (and processor, for a
    vision-language model) render a problem's chat-formatted prompt, so prompt lengths can be checked before the
    weights load."""

    def __init__(self, path, sampling):
        self.max_prompt_length = sampling.max_prompt_length
        config = AutoConfig.from_pretrained(path)
        self.is_vl = hasattr(config, "vision_config")
        # M-RoPE positions once per prompt and the vision tower's inputs once per list of image sizes, so scoring
        # and updates do not recompute them in every forward
        fast = self.is_vl and mrope.supported(config)
        self.positions = PromptPositions(config) if fast else None
        self.vision_inputs = VisionInputs(config.vision_config) if fast else None
        if self.is_vl:
            self.processor = AutoProcessor.from_pretrained(path, min_pixels=sampling.min_pixels,
                                                           max_pixels=sampling.max_pixels)
            self.tokenizer = self.processor.tokenizer
        else:
            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(path)

    def __call__(self, problem: Problem) -> dict:
        """Token ids (and pixel values for images) of the chat-formatted prompt, on CPU."""
        if self.is_vl:
            text = self.processor.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
            out = self.processor(text=[text], images=problem.images or None, return_tensors="pt")
            enc = {k: v[0] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                   for k, v in out.items()}
            enc.pop("attention_mask", None)
            if self.positions is not None and "mm_token_type_ids" in enc:
                enc["positions"] = self.positions(enc["input_ids"], enc["mm_token_type_ids"], enc.get("image_grid_thw"))
            # what a vLLM engine is given instead: the same text and images, processed by vLLM itself
            enc["raw"] = {"prompt": text, **({"multi_modal_data": {"image": list(problem.images)}}
                                              if problem.images else {})}
        else:
            text = self.tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
            enc = {"input_ids": torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"])}
        if len(enc["input_ids"]) > self.max_prompt_length:
            raise ValueError(f"prompt {problem.uid} has {len(enc['input_ids'])} tokens (images included), more than "
                             f"max_prompt_length={self.max_prompt_length}; raise it or lower max_pixels")
        return enc


class EmbeddedBackend:
    """`model` sampled and trained as the config's groups say (config.SamplingSettings, OptimSettings, LossConfig
    and this backend's EmbeddedOptions) on `device`; `steps` is the run's length (the learning-rate schedule's), and
    alpha gets a copy of its own when it lags pi_theta (`delay` > 1)."""
    name = "embedded"

    def __init__(self, model: str, sampling, optim, loss, options, *, device: str, seed: int, steps: int, delay: int):
        self.sampling, self.optim, self.loss, self.options = sampling, optim, loss, options
        self.seed, self.steps = seed, steps
        self.device = resolve_device(device)
        on_gpu = self.device.type == "cuda"
        # Trainer weights stay fp32 (bf16 updates underflow at lr 1e-6); compute runs under bf16 autocast on GPU.
        self.autocast_dtype = {"auto": torch.bfloat16 if on_gpu else None, "float32": None,
                               "bfloat16": torch.bfloat16}[options.dtype]
        torch.manual_seed(seed)
        self.path = path = resolve_model(model)
        self.encoder = PromptEncoder(path, sampling)
        self.is_vl, self.processor, self.tokenizer = self.encoder.is_vl, self.encoder.processor, self.encoder.tokenizer
        model_class = AutoModelForImageTextToText if self.is_vl else AutoModelForCausalLM
        self.policy = model_class.from_pretrained(path, dtype=torch.float32)
        if self.is_vl:
            use_segment_attention(self.policy)  # the rollout and reference copies below inherit it
        self.policy.to(self.device).eval()  # eval(): no dropout; gradients still flow
        fused = {"fused": True} if self.device.type == "cuda" else {}  # one kernel per step, not a pass per op
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=optim.lr, weight_decay=optim.weight_decay,
                                           **fused)
        # what the update's forward and backward run on: pi_theta itself, or its bf16 ComputeCopy
        self.compute = (ComputeCopy(self.policy, self.autocast_dtype)
                        if options.mixed_precision == "compute_copy" and self.autocast_dtype is not None else None)
        self.trained = self.compute.model if self.compute is not None else self.policy
        self.rollout = self._frozen_copy() if delay > 1 else self.policy
        self.ref = self._frozen_copy() if loss.kl_coef > 0 else None
        if options.gradient_checkpointing:
            log.info("gradient_checkpointing=true: %d blocks of the updated model recompute their activations in the "
                     "backward", checkpoint_blocks(self.trained))
        if options.compile:
            log.info("compile=true: %d blocks of the updated model under torch.compile", compile_blocks(self.trained))
        self.critic = ValueModel(self.policy).to(self.device) if optim.critic else None
        self.critic_optimizer = (torch.optim.AdamW(self.critic.parameters(), lr=optim.critic_lr,
                                                   weight_decay=optim.weight_decay, **fused) if self.critic else None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        gen_cfg = getattr(self.policy, "generation_config", None)
        eos = gen_cfg.eos_token_id if gen_cfg is not None and gen_cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        # A sampled image/video placeholder in a response would break re-scoring (image tokens vs features).
        model_cfg = self.policy.config
        self.suppress = [i for i in (getattr(model_cfg, "image_token_id", None), getattr(model_cfg, "video_token_id", None))
                         if i is not None] or None
        # A complete sampling config, so nothing from the model's generation_config.json (repetition_penalty,
        # ...) changes the distribution: the stored log-probs must be those of what was sampled.
        self.generation = GenerationConfig(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0),
            max_new_tokens=sampling.max_response_length, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
            suppress_tokens=self.suppress)
        self.greedy = GenerationConfig(do_sample=False, max_new_tokens=sampling.max_response_length,
                                       pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
                                       suppress_tokens=self.suppress)
        # generate() fills fields left at their global default from model.generation_config, so the model's
        # own config is swapped out while training (and restored when saving).
        self.model_generation_config = self.policy.generation_config
        for model in {id(m): m for m in (self.policy, self.rollout, self.ref) if m is not None}.values():
            model.generation_config = self.generation
        if sampling.top_p < 1 or sampling.top_k > 0:
            log.warning("top_p/top_k truncate sampling, but behaviour log-probs are those of the full "
                        "temperature-scaled distribution (the paper uses top_p=1, top_k=-1)")
        self.rng = random.Random(seed)
        self.timings: Counter = Counter()  # seconds inside generate (base.Backend.timings)
        self.memory = PhaseMemory(self.device)  # GB by phase (base.Backend.memory)
        self.engine = make_engine(self)  # what samples rollouts; logged by `bapo train` in its first lines

    def _frozen_copy(self):
        """alpha's or the reference's copy of pi_theta. Its log-probs are compared with the update's, so it computes
        as the update's forward does (bapo_vl.backends.mixed_precision): right after a sync pi_theta / alpha is 1
        up to the order of the kernels' sums, not up to bf16 rounding."""
        if self.compute is not None:  # the update computes on the bf16 copy: so does alpha
            return copy.deepcopy(self.compute.model).eval().requires_grad_(False)
        if self.autocast_dtype is not None:
            return autocast_copy(self.policy, self.autocast_dtype)
        return copy.deepcopy(self.policy).eval().requires_grad_(False)

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device. On CUDA through pinned memory and without blocking: a plain copy from
        pageable memory waits until the GPU has finished all queued work, so the next kernels start late."""
        if self.device.type != "cuda" or t.device.type != "cpu":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    # --- prompts ---------------------------------------------------------------------------------------------

    def encode(self, problem: Problem) -> dict:
        """Token ids (and pixel values for images) of the chat-formatted prompt, on CPU (PromptEncoder)."""
        return self.encoder(problem)

    def _collate(self, prompts: list[dict], responses: list | None = None) -> dict:
        """Batch of [left pad][prompt][response][right pad] on the device; `P` is where responses start."""
        packed = pack([p["input_ids"] for p in prompts], responses, self.pad_id)
        batch = {"input_ids": packed.input_ids, "attention_mask": packed.attention_mask}
        scored = (self.is_vl and responses is not None and self.encoder.vision_inputs is not None
                  and all("positions" in p for p in prompts))
        if scored:  # scoring and updates: the vision tower once per distinct prompt (bapo_vl.shared_images)
            batch |= shared_image_inputs(prompts, packed.input_ids, self.policy.config)
            batch["position_ids"] = batch_positions([p["positions"] for p in prompts],
                                                    [packed.P - len(p["input_ids"]) for p in prompts],
                                                    packed.attention_mask)
            if "image_grid_thw" in batch:
                batch |= self.encoder.vision_inputs(batch["image_grid_thw"])
        elif self.is_vl:  # generation (it finds its own positions) and prompts without precomputed positions
            for key in IMAGE_KEYS:
                if any(key in p for p in prompts):
                    batch[key] = torch.cat([p[key] for p in prompts if key in p])
            if "mm_token_type_ids" in prompts[0]:  # image-token markers over the prompt, zero elsewhere
                types = pack([p["mm_token_type_ids"] for p in prompts], None, 0).input_ids
                batch["mm_token_type_ids"] = torch.cat([types, torch.zeros(len(prompts), packed.R, dtype=torch.long)], 1)
            if responses is not None and "image_grid_thw" in batch and self.encoder.vision_inputs is not None:
                batch |= self.encoder.vision_inputs(batch["image_grid_thw"])
        else:  # text models take positions from the mask so left padding does not shift them
            batch["position_ids"] = (packed.attention_mask.cumsum(-1) - 1).clamp(min=0)
        return {k: self._to_device(v) for k, v in batch.items()} | {"P": packed.P}

    # --- generation and scoring ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[dict], n: int, policy: Policy = "rollout", *, greedy: bool = False,
                 logprobs: bool = True) -> list[list[Response]]:
        """n responses per prompt from the rollout policy alpha ("rollout") or the trainer policy ("current"),
        each with its behaviour log-probs per token (unless logprobs=False)."""
        if greedy and n != 1:
            raise ValueError(f"greedy decoding gives one response per prompt, not n={n}")
        model = self.rollout if policy == "rollout" else self.policy
        flat = [p for p in prompts for _ in range(n)]
        with self.memory.phase("generate"):
            t0 = time.perf_counter()
            tokens = self.engine.sample(prompts, n, policy, greedy)  # lists of ids: the device is done
            t1 = time.perf_counter()
            # scored as the update computes pi_theta (on the ComputeCopy where there is one), so that the ratio of its
            # first mini-batch is 1
            scorer = self.trained if model is self.policy else model
            scores = self.score(scorer, flat, tokens) if logprobs else None
        out = [Response(tuple(t), None if scores is None else tuple(scores[i, :len(t)].tolist()))
               for i, t in enumerate(tokens)]
        self.timings["sample"] += t1 - t0
        self.timings["logprobs"] += time.perf_counter() - t1
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _token_logprobs(self, model, batch, lengths: list[int], with_entropy: bool = False):
        """Log-probs (B, R) of the response tokens (`lengths[b]` of row b, R = max(lengths)) under `model` at the
        sampling temperature, and the entropy (B, R) when asked: with a graph only if it enters the loss
        (entropy_coef != 0), else only measured. Both are 0 on right padding.

        The LM head runs only on the hidden states that predict a response token (not on the prompt, the left or
        right padding, or the last position), in chunks of at most `LOGIT_FLOATS` logits forward and backward
        (bapo_vl/lm_head.py), so at most one chunk's (rows, V) float32 logits exist at once."""
        P = batch.pop("P")
        B, L = batch["input_ids"].shape
        R = max(lengths)
        states_at, tokens_at = self._to_device(response_positions(lengths, P, L))  # (n,), (n,)
        with self._autocast():
            hidden = last_hidden_state(model, batch)  # (B, L, H)
        states = hidden.flatten(0, 1).index_select(0, states_at)  # (n, H): the state before each response token
        targets = batch["input_ids"].flatten().index_select(0, states_at + 1)  # (n,)
        dtype = self.autocast_dtype or model.lm_head.weight.dtype  # what autocast would run the head in
        rows = max(1, LOGIT_FLOATS // model.lm_head.out_features)
        logp, entropy = token_logprobs(states, model.lm_head, targets, self.sampling.temperature, rows, dtype,
                                       with_entropy, compiled=self.options.compile)
        padded = lambda x: x.new_zeros(B * R).index_copy(0, tokens_at, x).view(B, R)  # noqa: E731
        if entropy is not None:
            grad_entropy = torch.is_grad_enabled() and self.loss.entropy_coef != 0
            entropy = padded(entropy if grad_entropy else entropy.detach())
        return padded(logp), entropy

    @torch.no_grad()
    def score(self, model, prompts: list[dict], responses: list) -> torch.Tensor:
        """(N, R) log-probs of each response's tokens under `model`, right-padded with 0 (on CPU). Sequences are
        batched in order of length, `score_batch_size` at a time, so each batch is padded little."""
        return self._scores(model, prompts, responses).cpu()

    @torch.no_grad()
    def _scores(self, model, prompts: list[dict], responses: list) -> torch.Tensor:
        """`score` left on the device (the update indexes it there)."""
        out = torch.zeros(len(responses), max(len(r) for r in responses), device=self.device)
        n = self.options.score_batch_size
        for idx in _chunks(_by_length(list(range(len(prompts))), prompts, responses), n):
            lengths = [len(responses[i]) for i in idx]
            with named(f"scoring log-probs of {len(idx)} sequences (responses up to {max(lengths)} tokens)",
                       f"lower score_batch_size (now {n})"):
                batch = self._collate([prompts[i] for i in idx], [responses[i] for i in idx])
                logp, _ = self._token_logprobs(model, batch, lengths)
            out[self._to_device(torch.tensor(idx)), :max(lengths)] = logp
        return out

    def decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _policy_loaded(self):
        if self.compute is not None:
            self.compute.refresh()
        self.sync()

    def sync(self):
        """alpha <- pi_theta, in the backend's alpha copy (which scores behaviour log-probs) and in the engine."""
        if self.rollout is not self.policy:
            self.rollout.load_state_dict(self.policy.state_dict())
        self.engine.load_weights(self.rollout.state_dict())

    # --- update ----------------------------------------------------------------------------------------------

    def update(self, batch: UpdateBatch) -> UpdateResult:
        self.engine.sleep()  # a colocated engine hands its memory to the update
        try:
            with update_attention(self.device), self.memory.phase("train"):  # workarounds: cuDNN's attention backward
                metrics = self._update(batch)
        except BaseException:
            # the update's error is the one to report: after running out of memory, the failed update's tensors
            # (held by the error's frames) can leave the engine no room to wake, and its error would hide the cause
            try:
                self.engine.wake()
            except Exception as e:  # noqa: BLE001
                log.warning("the rollout engine did not wake after the failed update: %s", e)
            raise
        self.engine.wake()
        return UpdateResult(changed=metrics.get("optimizer_steps", 0) > 0, metrics=metrics)

    def _update(self, batch: UpdateBatch) -> dict:
        """PPO-style update in ceil(n / mini_batch_size) near-equal mini-batches of the n groups (optim.mini_batches),
        at this step's learning rate (optim.lr_factor), with gradient accumulation over
        micro-batches of `micro_batch_size` sequences of similar length (each is padded to its longest; the loss is
        normalised by the mini-batch's token and sequence counts, so the split does not change it). The loss's
        per-token terms are (N, R) on the device, moved or scored there once; micro-batches index them there."""
        optim = self.optim
        rows = batch.sequences()
        group = [g for g, *_ in rows]
        prompts = [p for _, p, *_ in rows]
        responses = [list(r.tokens) for _, _, r, *_ in rows]
        R = max(len(r) for r in responses)
        mask = filled([len(r) for r in responses], R).float()
        behaviour = self._to_device(right_pad([r.logprobs for _, _, r, *_ in rows], R))
        ref = self._scores(self.ref, prompts, responses) if self.ref is not None else None
        # [code]'s truncated IS: ratio against the proximal policy (pi_theta before this update)
        old, is_w = old_logprobs(behaviour, optim.tis_threshold, lambda: self._scores(self.trained, prompts, responses))
        values = returns = None
        if self.critic is not None:  # BA-PPO: token-level GAE advantages from the critic, fixed for the epochs
            adv, values, returns = self._gae(prompts, responses, [w for *_, w, _ in rows], mask)
        else:
            adv = torch.tensor([a for *_, a in rows])[:, None] * mask
        terms = dict(mask=self._to_device(mask), adv=self._to_device(adv), old=old, ref=ref, is_w=is_w)
        if batch.sources is not None:  # each row's largest ratio over the epochs, for ratio_max by source
            terms["row_ratio_max"] = self._to_device(torch.zeros(len(rows)))
        groups = sorted(set(group))
        lr = optim.lr * lr_factor(batch.step, self.steps, optim.lr_schedule, optim.lr_warmup_steps, optim.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        per_mini: list[dict] = []
        for _ in range(optim.epochs):
            self.rng.shuffle(groups)
            for mini in mini_batches(groups, optim.mini_batch_size):
                members = set(mini)
                idx = [i for i, g in enumerate(group) if g in members]
                if self.loss.name not in MICRO_BATCH_STATISTICS:  # similar lengths share a micro-batch: little padding
                    idx = _by_length(idx, prompts, responses)
                n_tokens = sum(len(responses[i]) for i in idx)
                self.optimizer.zero_grad(set_to_none=True)
                with named(f"the update (micro-batches of {self.options.micro_batch_size} sequences, responses up "
                           f"to {R} tokens)", "lower micro_batch_size, set gradient_checkpointing=true (each "
                           "block's activations recomputed in the backward, about a third more compute), or train on "
                           "several GPUs with backend=verl (FSDP shards the weights and AdamW's state)"):
                    micro_metrics = [self._backward(micro, prompts, responses, terms, n_tokens, len(idx))
                                     for micro in _chunks(idx, self.options.micro_batch_size)]
                    grad_norm = clipped_step(self.optimizer, self.policy, optim.grad_clip, batch.step)
                if self.compute is not None:
                    self.compute.refresh()
                per_mini.append(_combine(micro_metrics) | {"grad_norm": grad_norm})
                if self.critic is not None:
                    per_mini[-1] |= self._critic_step(idx, prompts, responses, values, returns, mask, n_tokens,
                                                      batch.step)
        if not per_mini:
            return {}
        out = {k: _largest([m[k] for m in per_mini]) if k in LARGEST else sum(m[k] for m in per_mini) /
               len(per_mini) for k in per_mini[0]}
        if batch.sources is not None:
            source = [batch.sources[g] for g in group]
            for s in sorted(set(source)):
                mine = self._to_device(torch.tensor([i for i, x in enumerate(source) if x == s]))
                out[f"ratio_max_{s}"] = terms["row_ratio_max"].index_select(0, mine).amax()
        out = to_host(out)  # the one transfer
        out["skipped_steps"] = sum(not math.isfinite(m["grad_norm"]) for m in per_mini)  # clipped_step skipped them
        out["optimizer_steps"] = len(per_mini) - out["skipped_steps"]
        out["lr"] = lr
        out["trained_tokens"] = sum(len(p["input_ids"]) + len(r) for p, r in zip(prompts, responses))
        return out

    def _backward(self, micro, prompts, responses, terms: dict, n_tokens, n_seqs) -> dict:
        """Forward and backward of one micro-batch; `terms` holds the (N, R) per-token tensors. Returns its metrics
        as 0-d tensors on the device (the update moves them to the host once)."""
        lengths = [len(responses[i]) for i in micro]
        R = max(lengths)
        rows = self._to_device(torch.tensor(micro))
        cut = lambda t: None if t is None else t.index_select(0, rows)[:, :R]  # noqa: E731 - terms are on the device
        batch = self._collate([prompts[i] for i in micro], [responses[i] for i in micro])
        logp, entropy = self._token_logprobs(self.trained, batch, lengths, with_entropy=True)
        old, mask = cut(terms["old"]), cut(terms["mask"])
        loss, metrics = total_loss(logp, old, cut(terms["adv"]), mask, self.loss,
                                   ref_logp=cut(terms["ref"]), entropy=entropy, is_weights=cut(terms["is_w"]),
                                   n_tokens=n_tokens, n_seqs=n_seqs, host_metrics=False)
        if "row_ratio_max" in terms:
            top = terms["row_ratio_max"]
            top.index_copy_(0, rows, torch.maximum(top.index_select(0, rows),
                                                   largest_ratio_per_row(logp, old, mask).float()))
        loss.backward()
        if self.compute is not None:
            self.compute.accumulate_grads()
        return metrics

    # --- critic (BA-PPO) -------------------------------------------------------------------------------------

    def _values(self, prompts, responses, idx) -> torch.Tensor:
        batch = self._collate([prompts[i] for i in idx], [responses[i] for i in idx])
        with self._autocast():
            return self.critic(batch, max(len(responses[i]) for i in idx))  # (b, R)

    @torch.no_grad()
    def _gae(self, prompts, responses, rewards, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages, old values V(s_t), returns), each (N, R) on CPU: GAE over the critic's values."""
        values = torch.zeros_like(mask)
        for idx in _chunks(list(range(len(responses))), self.options.micro_batch_size):
            v = self._values(prompts, responses, idx).float().cpu()
            values[idx, :v.shape[1]] = v
        adv, ret = gae_advantages(torch.tensor(rewards, dtype=torch.float32), values * mask, mask)
        return adv * mask, values * mask, ret * mask

    def _critic_step(self, idx, prompts, responses, values, returns, mask, n_tokens, step: int) -> dict:
        """One optimizer step of the critic on the mini-batch `idx`: clipped value loss against the GAE returns."""
        self.critic_optimizer.zero_grad(set_to_none=True)
        parts = []
        for micro in _chunks(idx, self.options.micro_batch_size):
            R = max(len(responses[i]) for i in micro)
            cut = lambda t: self._to_device(t[micro, :R])  # noqa: E731
            loss, m = value_loss(self._values(prompts, responses, micro).float(), cut(values), cut(returns),
                                 cut(mask), self.optim.value_clip, "token-mean", n_tokens=n_tokens)
            loss.backward()
            parts.append((m, sum(len(responses[i]) for i in micro)))
        clipped_step(self.critic_optimizer, self.critic, self.optim.grad_clip, step)
        return {"vf_loss": sum(m["vf_loss"] for m, _ in parts),
                "vf_clipfrac": sum(m["vf_clipfrac"] * n for m, n in parts) / max(1, sum(n for _, n in parts))}

    # --- checkpoints -----------------------------------------------------------------------------------------

    def save_pretrained(self, path):
        """The trainer policy in Hugging Face format (loadable by transformers and vLLM)."""
        self.policy.generation_config = self.model_generation_config
        try:
            self.policy.save_pretrained(path)
        finally:
            self.policy.generation_config = self.generation
        (self.processor or self.tokenizer).save_pretrained(path)

    def save_checkpoint(self, path, step: int):
        """pi_theta, its optimizer, alpha, the critic and every random state this backend draws from, in
        path/backend.pt: tensors and plain data only (random.Random's state is a tuple of ints), so that it loads
        with weights_only=True."""
        torch.save({"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "rollout": None if self.rollout is self.policy else self.rollout.state_dict(),
                    "critic": None if self.critic is None else (self.critic.state_dict(),
                                                                self.critic_optimizer.state_dict()),
                    "rng": self.rng.getstate(), "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   Path(path) / CHECKPOINT)

    def load_checkpoint(self, path, policy_only: bool = False):
        file = Path(path) / CHECKPOINT
        if policy_only:  # alpha follows when it is the same model
            load_into(self.policy, load_checkpoint_file(file, ("policy",))["policy"], file, "policy")
            self._policy_loaded()
            return
        state = load_checkpoint_file(file, CHECKPOINT_KEYS)
        load_into(self.policy, state["policy"], file, "policy")
        if self.compute is not None:
            self.compute.refresh()
        load_into(self.optimizer, state["optimizer"], file, "optimizer")
        if state["rollout"] is not None and self.rollout is not self.policy:
            load_into(self.rollout, state["rollout"], file, "rollout policy")
        self.engine.load_weights(self.rollout.state_dict())
        if self.critic is not None:
            if state["critic"] is None:
                raise ValueError(f"{path}: this checkpoint has no critic: it was not trained with critic=True (BA-PPO)")
            load_into(self.critic, state["critic"][0], file, "critic")
            load_into(self.critic_optimizer, state["critic"][1], file, "critic optimizer")
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

