"""The backend contract: everything the Trainer and `bapo eval` may ask of a backend, and what crosses it.

A backend only encodes prompts, generates, scores log-probs, updates and syncs weights. What to train on (X1, X2,
X3), advantages and versions are the trainer's (bapo_vl/trainer.py): it holds the one policy-version counter and
tells the backend what it needs. Two backends implement this: `embedded` (transformers, one process) and `verl`
(Ray + FSDP + vLLM). tests/test_backend_contract.py runs both against it.

Sequence layout shared by both: [left pad][prompt][response][right pad], every response starting at column P.
"""
from __future__ import annotations

import itertools
import pickle
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping, Protocol, runtime_checkable

import numpy as np
import torch

from bapo_vl.losses import truncated_is_weights
from bapo_vl.problem import Problem

Policy = Literal["rollout", "current"]
"""rollout: alpha = pi_theta as of the last sync (lags by up to v steps); current: pi_theta."""

UPDATE_METRICS: dict[str, str] = {
    "loss": "the loss that was minimised (policy + KL + entropy terms), mean over mini-batches",
    "pg_loss": "the policy-gradient term",
    "kl": "k3 KL to the reference policy (0.0 when kl_coef == 0: no reference is kept)",
    "entropy": "mean token entropy of pi_theta on the batch",
    "clip_frac": "share of valid tokens whose gradient the ratio clip removed",
    "grad_norm": "gradient norm before clipping, mean over optimizer steps",
    "optimizer_steps": "optimizer steps taken on this batch (mini-batches x epochs, less any skipped)",
    "lr": "the learning rate of this step's optimizer steps",
    "trained_tokens": ("prompt + response tokens of the sequences trained on, each counted once (EasyR1's "
                       "global_token_num): over a step's seconds and GPUs, tokens/s per GPU (bapo_vl.perf)"),
}
"""The metrics of every update that changed the policy (python floats; optimizer_steps and trained_tokens ints),
named as the run record's columns. A backend may return more (its own names); these are checked by UpdateResult."""


@dataclass(frozen=True)
class UpdateResult:
    """What one `update` did. `changed`: pi_theta took at least one optimizer step (the trainer counts a new policy
    version); `metrics` (read-only): UPDATE_METRICS and the backend's own when it changed, possibly only the backend's
    own (e.g. verl's trimmed_groups) when it did not."""

    changed: bool
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))
        missing = [k for k in UPDATE_METRICS if k not in self.metrics] if self.changed else []
        if missing:
            raise ValueError(f"an update that changed the policy must report {', '.join(missing)}")
        if self.changed != (self.metrics.get("optimizer_steps", 0) > 0):
            raise ValueError(f"changed={self.changed} but optimizer_steps={self.metrics.get('optimizer_steps', 0)}")


@dataclass(frozen=True)
class Response:
    """One sampled response: token ids and, per token, the behaviour log-prob under the policy that sampled it
    (at the sampling temperature). `logprobs` is None when the caller asked for none (evaluation)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None

    def __post_init__(self):
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.logprobs)} log-probs")


@dataclass(frozen=True)
class UpdateBatch:
    """The training batch of one step, group by group (X1 + X2 + X3 in that order).

    prompts[i]     the backend's own encoding of group i's prompt (from `encode`)
    responses[i]   its G responses, with the stored behaviour log-probs of whichever policy sampled them
    rewards[i]     one 0/1 reward per response
    advantages[i]  one advantage per response (GRPO's group baseline); None: the backend derives its own (critic)
    step           the training step this update belongs to (verl logs it as global_steps)
    sources[i]     where group i came from ("x1", "x2", "x3"), for metrics by source; None: not said
    """

    prompts: tuple[Any, ...]
    responses: tuple[tuple[Response, ...], ...]
    rewards: tuple[tuple[float, ...], ...]
    advantages: tuple[tuple[float, ...], ...] | None = None
    step: int = 0
    sources: tuple[str, ...] | None = None

    def __post_init__(self):
        n = len(self.prompts)
        if len(self.responses) != n or len(self.rewards) != n or (self.advantages is not None
                                                                  and len(self.advantages) != n):
            raise ValueError("UpdateBatch: prompts, responses, rewards (and advantages) need one entry per group")
        if self.sources is not None and len(self.sources) != n:
            raise ValueError(f"UpdateBatch: {len(self.sources)} sources for {n} groups")
        for i, rs in enumerate(self.responses):
            if len(self.rewards[i]) != len(rs) or (self.advantages is not None and len(self.advantages[i]) != len(rs)):
                raise ValueError(f"UpdateBatch: group {i} has {len(rs)} responses but not as many rewards/advantages")
            if any(r.logprobs is None for r in rs):
                raise ValueError(f"UpdateBatch: group {i} has a response without behaviour log-probs")

    def __len__(self) -> int:
        return len(self.prompts)

    def sequences(self) -> list[tuple[int, Any, Response, float, float | None]]:
        """Flat view, one row per response: (group index, prompt, response, reward, advantage or None)."""
        return [(i, p, r, self.rewards[i][j], None if self.advantages is None else self.advantages[i][j])
                for i, (p, rs) in enumerate(zip(self.prompts, self.responses)) for j, r in enumerate(rs)]

    def select(self, groups: list[int]) -> "UpdateBatch":
        """The batch restricted to the given groups (in that order)."""
        pick = lambda xs: tuple(xs[i] for i in groups)  # noqa: E731
        return UpdateBatch(pick(self.prompts), pick(self.responses), pick(self.rewards),
                           None if self.advantages is None else pick(self.advantages), self.step,
                           None if self.sources is None else pick(self.sources))


@runtime_checkable
class Backend(Protocol):
    """What the trainer and `bapo eval` call. Versions are counted by the trainer, never here."""

    name: str
    # seconds spent inside generate since the trainer last cleared it (once a step), by part: "sample" (the rollout
    # engine, X2's weight swaps included) and "logprobs" (the embedded backend's own scoring of the behaviour log-probs);
    # the record's t_generate_sample and t_generate_logprobs
    timings: Counter
    # GB of the card's memory in use at the peak of each phase since the trainer last cleared it (once a step):
    # "generate" and "train", the record's gpu_memory_*_gb. Empty where the backend holds no GPU in this process (a CPU
    # run; verl, whose actor reports its own peak: gpu_memory_train_gb)
    memory: dict

    def encode(self, problem: Problem) -> Any:
        """The prompt as this backend feeds it to its model (token ids, images); opaque to the trainer."""

    def decode(self, tokens: tuple[int, ...]) -> str: ...

    def generate(self, prompts: list, n: int, policy: Policy = "rollout", *, greedy: bool = False,
                 logprobs: bool = True) -> list[list[Response]]:
        """n responses per prompt from alpha or pi_theta; `greedy` decodes greedily (evaluation, n == 1);
        `logprobs=False` skips the behaviour log-probs (Response.logprobs is None)."""

    def sync(self) -> None:
        """alpha <- pi_theta (the trainer calls it when t % v == 0)."""

    def update(self, batch: UpdateBatch) -> UpdateResult:
        """One clipped policy update on the batch, against its stored behaviour log-probs: whether pi_theta changed
        (it may train on none of the batch: verl trims to whole mini-batches) and the update's metrics."""

    def save_checkpoint(self, path: Path, step: int) -> None:
        """Everything this backend needs to go on exactly as it was after step `step` (weights, optimizer, random
        state, its bookkeeping) into the (new, empty) folder `path`."""

    def load_checkpoint(self, path: Path, policy_only: bool = False) -> None:
        """Everything `save_checkpoint` wrote; policy_only: pi_theta's weights alone, which the rollout engine then
        generates with (evaluation of a checkpoint)."""

    def save_pretrained(self, path: Path) -> None:
        """pi_theta in Hugging Face format (from_pretrained loads it)."""


# --- shared by both backends --------------------------------------------------------------------------------------


class CheckpointError(ValueError):
    """A checkpoint file that does not load: missing, damaged, or holding more than tensors and plain data."""


def load_checkpoint_file(path, required: tuple[str, ...] = ()) -> dict:
    """The dict a checkpoint file holds, loaded with torch.load(weights_only=True): tensors and plain data only
    (dicts, lists, tuples, numbers, strings). Unpickling any other object could run code (a tampered checkpoint is
    a program), so such a file is refused, never run. Every failure is one CheckpointError line naming the file;
    `required`: keys the dict must have, or it is some other program's file."""
    path = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns of a foreign pickle protocol: the error below says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing (the checkpoint folder is incomplete)") from e
    except Exception as e:  # noqa: BLE001 - torch reports a cut or foreign file as RuntimeError, EOFError, ...
        found = re.search(r"GLOBAL (\S+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
        if found:  # what the file asked to build, as torch's message names it
            why = ("a checkpoint of an earlier bapo-vl, which pickled its state: use that version for it"
                   if found.group(1).startswith("bapo_vl.") else "a tampered or foreign file")
            raise CheckpointError(f"{path}: refused: it holds {found.group(1)} besides tensors and plain data, and "
                                  f"loading that could run code ({why})") from e
        raise CheckpointError(f"{path}: damaged or not a checkpoint ({_first_sentence(e)})") from e
    missing = [k for k in required if not (isinstance(state, dict) and k in state)]
    if missing:
        raise CheckpointError(f"{path}: not a bapo-vl checkpoint (no {', '.join(missing)})")
    return state


def _first_sentence(e: Exception) -> str:
    if isinstance(e, pickle.UnpicklingError):  # torch's text is advice about weights_only, not about this file
        return "not readable as tensors and plain data"
    text = " ".join(str(e).split()).split(". ")[0][:160]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass
class Packed:
    """A batch laid out as [left pad][prompt][response][right pad]; responses start at column P."""

    input_ids: torch.Tensor  # (N, P + R)
    attention_mask: torch.Tensor  # (N, P + R)
    response_mask: torch.Tensor  # (N, R)
    P: int
    R: int


def pack(prompt_ids: list, responses: list | None, pad_id: int, min_response: int = 0) -> Packed:
    """Left-pad the prompts to the longest, right-pad the responses (if any) to the longest (at least
    `min_response` columns)."""
    N = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    R = max([min_response, *(len(r) for r in responses)]) if responses is not None else 0
    ids = torch.full((N, P + R), pad_id, dtype=torch.long)
    mask = torch.zeros(N, P + R, dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # prompts arrive as tensors: no conversion
        ids[i, P - len(p):P], mask[i, P - len(p):P] = torch.as_tensor(p, dtype=torch.long), 1
    if responses is not None:
        kept = filled([len(r) for r in responses], R)
        ids[:, P:].masked_scatter_(kept, flat(responses, torch.long))
        mask[:, P:] = kept
    return Packed(ids, mask, mask[:, P:], P, R)


def right_pad(rows: list, width: int, value: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """(N, width) tensor of per-token values, each row right-padded with `value`."""
    lengths = [len(r) for r in rows]
    if max(lengths, default=0) > width:
        raise ValueError(f"right_pad: a row of {max(lengths)} values is wider than {width} columns")
    out = torch.full((len(rows), width), value, dtype=dtype)
    return out.masked_scatter_(filled(lengths, width), flat(rows, dtype))


def filled(lengths: list[int], width: int) -> torch.Tensor:
    """(N, width) bool: True on the first lengths[i] columns of row i."""
    return torch.arange(width) < torch.tensor(lengths, dtype=torch.long)[:, None]


def flat(rows: list, dtype) -> torch.Tensor:
    """The rows' values end to end, as one tensor: numpy reads them in one pass, where a tensor per row would cost
    a call into torch for each row (the update builds its inputs on the host before its first kernel can run)."""
    read = np.float64 if dtype == torch.float64 else np.float32 if dtype.is_floating_point else np.int64
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype=read, count=sum(len(r) for r in rows))
    return torch.from_numpy(values).to(dtype)


def old_logprobs(behaviour: torch.Tensor, tis_threshold: float | None,
                 proximal: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs the ratio is taken against, and truncated-IS weights. Off by default (paper): the stored
    behaviour log-probs, no weights. With tis_threshold ([code]): the ratio against the proximal policy
    (`proximal()`, pi_theta before this update) and min(prox / behaviour, threshold) as token weights."""
    if tis_threshold is None:
        return behaviour, None
    prox = proximal()
    return prox, truncated_is_weights(prox, behaviour, tis_threshold)
