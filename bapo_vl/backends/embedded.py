"""Embedded backend: one process, CPU or one CUDA GPU, Hugging Face transformers models.

It holds three copies of the policy: the trainer policy pi_theta (updated every step), the rollout policy alpha
(a copy refreshed only by `sync()`, i.e. every v steps) and a frozen reference for the KL term. It only
generates, scores log-probs, updates and syncs; what to train on is decided in bapo_vl/algorithm.py.

Sequence layout used everywhere: [left pad][prompt][response][right pad]; prompts are left-padded to the
batch's longest, so every response starts at the same column P and `logits_to_keep` skips the prompt logits.
"""
from __future__ import annotations

import copy
import logging
import random
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import GenerationConfig, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from bapo_vl.backends.critic import ValueModel
from bapo_vl.losses import entropy_from_logits, gae_advantages, total_loss, truncated_is_weights, value_loss
from bapo_vl.problem import Problem

log = logging.getLogger(__name__)
POLICY_DIR = Path(__file__).resolve().parent.parent / "policy"


def resolve_model(name: str) -> str:
    """A local path, a policy bundled in bapo_vl/policy/, or a hub id (left to from_pretrained)."""
    if Path(name).exists():
        return str(name)
    if (POLICY_DIR / name).is_dir():
        return str(POLICY_DIR / name)
    return name


ADDITIVE = ("loss", "pg_loss", "kl", "entropy")  # micro-batch terms that add up to the mini-batch's


def _combine(micro_metrics: list[dict]) -> dict:
    """Mini-batch metrics: additive loss terms summed, per-token means (clip_frac, ...) token-weighted."""
    n = sum(m["n_valid_tokens"] for m in micro_metrics) or 1
    out = {k: sum(m[k] for m in micro_metrics) for k in ADDITIVE}
    for k in micro_metrics[0]:
        if k not in ADDITIVE and k != "n_valid_tokens":
            out[k] = sum(m[k] * m["n_valid_tokens"] for m in micro_metrics) / n
    return out


def _chunks(items, size):
    for i in range(0, len(items), size):
        yield items[i:i + size]


class EmbeddedBackend:
    name = "embedded"

    def __init__(self, cfg):
        self.cfg = cfg
        self.device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                                   else "cpu" if cfg.device == "auto" else cfg.device)
        on_gpu = self.device.type == "cuda"
        # Trainer weights stay fp32 (bf16 updates underflow at lr 1e-6); compute runs under bf16 autocast on GPU.
        self.autocast_dtype = {"auto": torch.bfloat16 if on_gpu else None, "float32": None,
                               "bfloat16": torch.bfloat16}[cfg.dtype]
        torch.manual_seed(cfg.seed)
        path = resolve_model(cfg.model)
        self.is_vl = hasattr(AutoConfig.from_pretrained(path), "vision_config")
        if self.is_vl:
            self.processor = AutoProcessor.from_pretrained(path, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
            self.tokenizer = self.processor.tokenizer
            self.policy = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        else:
            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.policy.to(self.device).eval()  # eval(): no dropout; gradients still flow
        frozen_dtype = self.autocast_dtype or torch.float32
        self.rollout = self._frozen_copy(frozen_dtype) if cfg.delay > 1 else self.policy
        self.ref = self._frozen_copy(frozen_dtype) if cfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.critic = ValueModel(self.policy).to(self.device) if cfg.critic else None
        self.critic_optimizer = (torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr,
                                                   weight_decay=cfg.weight_decay) if self.critic else None)
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
        self.sampling = GenerationConfig(
            do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=max(cfg.top_k, 0),
            max_new_tokens=cfg.max_response_length, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
            suppress_tokens=self.suppress)
        # generate() fills fields left at their global default from model.generation_config, so the model's
        # own config is swapped out while training (and restored when saving).
        self.model_generation_config = self.policy.generation_config
        for model in {id(m): m for m in (self.policy, self.rollout, self.ref) if m is not None}.values():
            model.generation_config = self.sampling
        if cfg.top_p < 1 or cfg.top_k > 0:
            log.warning("top_p/top_k truncate sampling, but behaviour log-probs are those of the full "
                        "temperature-scaled distribution (the paper uses top_p=1, top_k=-1)")
        self.loss_cfg = cfg.loss_config()
        self.rng = random.Random(cfg.seed)

    def _frozen_copy(self, dtype):
        model = copy.deepcopy(self.policy).to(dtype).eval()
        model.requires_grad_(False)
        return model

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # --- prompts ---------------------------------------------------------------------------------------------

    def encode(self, problem: Problem) -> dict:
        """Token ids (and pixel values for images) of the chat-formatted prompt, on CPU."""
        if self.is_vl:
            text = self.processor.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
            out = self.processor(text=[text], images=problem.images or None, return_tensors="pt")
            enc = {k: v[0] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                   for k, v in out.items()}
            enc.pop("attention_mask", None)
        else:
            text = self.tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
            enc = {"input_ids": torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"])}
        if len(enc["input_ids"]) > self.cfg.max_prompt_length:
            raise ValueError(f"prompt {problem.uid} has {len(enc['input_ids'])} tokens (images included), more than "
                             f"max_prompt_length={self.cfg.max_prompt_length}; raise it or lower max_pixels")
        return enc

    def _collate(self, prompts: list[dict], responses: list[list[int]] | None = None) -> dict:
        """Batch of [left pad][prompt][response][right pad] on the device; `P` is where responses start."""
        P = max(len(p["input_ids"]) for p in prompts)
        R = max((len(r) for r in responses), default=0) if responses is not None else 0
        ids = torch.full((len(prompts), P + R), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        mm_types = torch.zeros_like(ids) if "mm_token_type_ids" in prompts[0] else None
        for i, p in enumerate(prompts):
            n = len(p["input_ids"])
            ids[i, P - n:P], mask[i, P - n:P] = p["input_ids"], 1
            if mm_types is not None:
                mm_types[i, P - n:P] = p["mm_token_type_ids"]
            if responses is not None:
                r = responses[i]
                ids[i, P:P + len(r)], mask[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long), 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if self.is_vl:
            for key in ("pixel_values", "image_grid_thw"):
                if any(key in p for p in prompts):
                    batch[key] = torch.cat([p[key] for p in prompts if key in p])
            if mm_types is not None:
                batch["mm_token_type_ids"] = mm_types
        else:  # text models take positions from the mask so left padding does not shift them
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return {k: v.to(self.device) for k, v in batch.items()} | {"P": P}

    # --- generation and scoring ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[dict], n: int, policy: str = "rollout") -> list[list[tuple[list[int], list[float]]]]:
        """n responses per prompt from the rollout policy alpha ("rollout") or the trainer policy ("current"),
        each as (token ids, behaviour log-probs per token)."""
        model = self.rollout if policy == "rollout" else self.policy
        flat = [p for p in prompts for _ in range(n)]
        tokens: list[list[int]] = []
        for chunk in _chunks(flat, self.cfg.generate_batch_size):
            batch = self._collate(chunk)
            P = batch.pop("P")
            batch.pop("position_ids", None)  # generate derives positions from the mask
            with self._autocast():
                out = model.generate(**batch, generation_config=self.sampling)
            for row in out[:, P:].tolist():
                end = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), len(row))
                tokens.append(row[:max(end, 1)])
        logprobs = self.score(model, flat, tokens)
        return [list(zip(tokens[i * n:(i + 1) * n], logprobs[i * n:(i + 1) * n])) for i in range(len(prompts))]

    def _token_logprobs(self, model, batch, n_response: int, with_entropy: bool = False):
        """Log-probs (B, R) of the response tokens under `model` at the sampling temperature."""
        P = batch.pop("P")
        with self._autocast():
            logits = model(**batch, logits_to_keep=n_response + 1).logits[:, :-1].float()  # (B, R, V)
        logits = logits / self.cfg.temperature
        targets = batch["input_ids"][:, P:]  # (B, R)
        logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = entropy_from_logits(logits) if with_entropy else None
        return logp, entropy

    @torch.no_grad()
    def score(self, model, prompts: list[dict], responses: list[list[int]]) -> list[list[float]]:
        out = []
        for idx in _chunks(list(range(len(prompts))), self.cfg.micro_batch_size):
            batch = self._collate([prompts[i] for i in idx], [responses[i] for i in idx])
            R = max(len(responses[i]) for i in idx)
            logp, _ = self._token_logprobs(model, batch, R)
            out += [logp[k, :len(responses[i])].tolist() for k, i in enumerate(idx)]
        return out

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def sync(self):
        """alpha <- pi_theta."""
        if self.rollout is not self.policy:
            self.rollout.load_state_dict(self.policy.state_dict())

    # --- update ----------------------------------------------------------------------------------------------

    def update(self, sequences: list[dict]) -> dict:
        """PPO-style update on `sequences` (dicts with prompt, tokens, logprobs, advantage, group), in
        mini-batches of `mini_batch_size` groups with gradient accumulation over micro-batches."""
        cfg = self.cfg
        prompts = [s["prompt"] for s in sequences]
        responses = [s["tokens"] for s in sequences]
        ref = self.score(self.ref, prompts, responses) if self.ref is not None else None
        behaviour = [s["logprobs"] for s in sequences]
        old = behaviour
        if cfg.tis_threshold is not None:  # [code]: ratio against the proximal policy, truncated IS to alpha
            old = self.score(self.policy, prompts, responses)
        values = returns = None
        if self.critic is not None:  # BA-PPO: token-level GAE advantages from the critic, fixed for the epochs
            values, returns = self._gae(prompts, responses, sequences)
        groups = sorted({s["group"] for s in sequences})
        per_mini: list[dict] = []
        for _ in range(cfg.epochs):
            self.rng.shuffle(groups)
            for mini in _chunks(groups, cfg.mini_batch_size):
                members = set(mini)
                idx = [i for i, s in enumerate(sequences) if s["group"] in members]
                n_tokens = sum(len(responses[i]) for i in idx)
                self.optimizer.zero_grad(set_to_none=True)
                micro_metrics = [self._backward(micro, prompts, responses, old, behaviour, ref, sequences,
                                                n_tokens, len(idx))
                                 for micro in _chunks(idx, cfg.micro_batch_size)]
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
                self.optimizer.step()
                per_mini.append(_combine(micro_metrics) | {"grad_norm": float(grad_norm)})
                if self.critic is not None:
                    per_mini[-1] |= self._critic_step(idx, prompts, responses, values, returns, n_tokens)
        return {k: sum(m[k] for m in per_mini) / len(per_mini) for k in per_mini[0]} if per_mini else {}

    def _backward(self, micro, prompts, responses, old, behaviour, ref, sequences, n_tokens, n_seqs) -> dict:
        R = max(len(responses[i]) for i in micro)
        pad = lambda rows: torch.tensor([r + [0.0] * (R - len(r)) for r in rows], device=self.device)
        batch = self._collate([prompts[i] for i in micro], [responses[i] for i in micro])
        logp, entropy = self._token_logprobs(self.policy, batch, R, with_entropy=self.cfg.entropy_coef > 0)
        mask = pad([[1.0] * len(responses[i]) for i in micro])
        adv = pad([sequences[i]["advantage"] if isinstance(sequences[i]["advantage"], list)
                   else [sequences[i]["advantage"]] * len(responses[i]) for i in micro])
        old_logp = pad([old[i] for i in micro])
        ref_logp = pad([ref[i] for i in micro]) if ref is not None else None
        is_w = None
        if self.cfg.tis_threshold is not None:
            is_w = truncated_is_weights(old_logp, pad([behaviour[i] for i in micro]), self.cfg.tis_threshold)
        loss, metrics = total_loss(logp, old_logp, adv, mask, self.loss_cfg, ref_logp=ref_logp, entropy=entropy,
                                   is_weights=is_w, n_tokens=n_tokens, n_seqs=n_seqs)
        loss.backward()
        return metrics

    # --- critic (BA-PPO) -------------------------------------------------------------------------------------

    def _values(self, prompts, responses, idx) -> torch.Tensor:
        batch = self._collate([prompts[i] for i in idx], [responses[i] for i in idx])
        with self._autocast():
            return self.critic(batch, max(len(responses[i]) for i in idx))  # (b, R)

    @torch.no_grad()
    def _gae(self, prompts, responses, sequences) -> tuple[list[list[float]], list[list[float]]]:
        """Old values V(s_t) and GAE returns per sequence; each sequence's "advantage" becomes its token list."""
        R = max(len(r) for r in responses)
        values = torch.zeros(len(responses), R, device=self.device)
        for idx in _chunks(list(range(len(responses))), self.cfg.micro_batch_size):
            v = self._values(prompts, responses, idx).float()
            values[idx, :v.shape[1]] = v
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (R - len(r)) for r in responses], device=self.device)
        rewards = torch.tensor([s["reward"] for s in sequences], dtype=torch.float32, device=self.device)
        adv, ret = gae_advantages(rewards, values * mask, mask)
        for i, s in enumerate(sequences):
            s["advantage"] = adv[i, :len(responses[i])].tolist()
        return ([values[i, :len(r)].tolist() for i, r in enumerate(responses)],
                [ret[i, :len(r)].tolist() for i, r in enumerate(responses)])

    def _critic_step(self, idx, prompts, responses, values, returns, n_tokens) -> dict:
        """One optimizer step of the critic on the mini-batch `idx`: clipped value loss against the GAE returns."""
        self.critic_optimizer.zero_grad(set_to_none=True)
        parts = []
        for micro in _chunks(idx, self.cfg.micro_batch_size):
            R = max(len(responses[i]) for i in micro)
            pad = lambda rows: torch.tensor([r + [0.0] * (R - len(r)) for r in rows], device=self.device)  # noqa: E731
            loss, m = value_loss(self._values(prompts, responses, micro).float(), pad([values[i] for i in micro]),
                                 pad([returns[i] for i in micro]), pad([[1.0] * len(responses[i]) for i in micro]),
                                 self.cfg.value_clip, "token-mean", n_tokens=n_tokens)
            loss.backward()
            parts.append((m, sum(len(responses[i]) for i in micro)))
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.grad_clip)
        self.critic_optimizer.step()
        return {"vf_loss": sum(m["vf_loss"] for m, _ in parts),
                "vf_clipfrac": sum(m["vf_clipfrac"] * n for m, n in parts) / max(1, sum(n for _, n in parts))}

    # --- checkpoints -----------------------------------------------------------------------------------------

    def save_pretrained(self, path):
        """The trainer policy in Hugging Face format (loadable by transformers and vLLM)."""
        self.policy.generation_config = self.model_generation_config
        try:
            self.policy.save_pretrained(path)
        finally:
            self.policy.generation_config = self.sampling
        (self.processor or self.tokenizer).save_pretrained(path)

    def save_checkpoint(self, path, step: int):
        """Nothing beyond state_dict(): this backend's weights travel in the trainer's state.pt."""

    def load_checkpoint(self, path):
        """Nothing beyond load_state_dict() (see save_checkpoint)."""

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rollout": None if self.rollout is self.policy else self.rollout.state_dict(),
                "rng": self.rng.getstate(),
                "critic": None if self.critic is None else (self.critic.state_dict(),
                                                            self.critic_optimizer.state_dict())}

    def load_state_dict(self, state: dict):
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["rollout"] is not None and self.rollout is not self.policy:
            self.rollout.load_state_dict(state["rollout"])
        self.rng.setstate(state["rng"])
        if self.critic is not None:
            if state.get("critic") is None:
                raise ValueError("this checkpoint has no critic: it was not trained with critic=True (BA-PPO)")
            self.critic.load_state_dict(state["critic"][0])
            self.critic_optimizer.load_state_dict(state["critic"][1])
