"""The BAPO training loop: one step is Algorithm 1 of the paper, as a short list of named calls.

The backend (embedded or verl) only generates, scores, updates and syncs; buffers, filters and thresholds come
from bapo_vl/algorithm.py, advantages and losses from bapo_vl/losses.py.
"""
from __future__ import annotations

import logging
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from bapo_vl.algorithm import (BadBuffer, BapoState, Group, HighBuffer, Sample, Thresholds, get_filter,
                               is_promoted, sample_replay)
from bapo_vl.backends.base import Backend, Policy, Response, UpdateBatch
from bapo_vl.losses import grpo_advantages
from bapo_vl.problem import Problem, Verdict

log = logging.getLogger(__name__)
# state_dict's layout. 2: tensors and plain data only (loads with weights_only=True); 1 (bapo-vl 0.1.0 before it)
# pickled BapoState, which only an unpickler that may run code can read.
STATE_FORMAT = 3


class PromptSampler:
    """Shuffled passes over the training problems (a new seeded permutation each epoch)."""

    def __init__(self, problems: list[Problem], seed: int):
        if not problems:
            raise ValueError("the task loaded no training problems")
        self.problems, self.seed = problems, seed
        self.epoch, self.pos = 0, 0
        self._order = self._permutation()

    def _permutation(self):
        order = list(range(len(self.problems)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[Problem]:
        """k distinct problems (fewer if the data set is smaller)."""
        taken: list[int] = []
        while len(taken) < min(k, len(self.problems)):
            if self.pos == len(self._order):  # new epoch; what this batch already has goes last
                self.epoch, self.pos = self.epoch + 1, 0
                order = self._permutation()
                self._order = [i for i in order if i not in taken] + [i for i in order if i in taken]
            taken.append(self._order[self.pos])
            self.pos += 1
        return [self.problems[i] for i in taken]

    def state_dict(self):
        # order: see next() at an epoch end; a tensor, since a long list loads slowly without pickle (state_dict)
        return {"epoch": self.epoch, "pos": self.pos, "order": torch.tensor(self._order, dtype=torch.int64)}

    def load_state_dict(self, state):
        self.epoch, self.pos, self._order = state["epoch"], state["pos"], state["order"].tolist()


def pack_groups(groups) -> dict:
    """Buffered groups as tensors and plain data (Trainer.state_dict): each sample's tokens and behaviour log-probs
    go into one flat tensor each (float64 holds a Python float exactly), since loading them as lists of Python
    numbers without pickle takes about a microsecond a number. Problems are kept by uid; prompt encodings, which
    buffers do not hold between steps, not at all."""
    groups = list(groups)
    samples = [s for g in groups for s in g.samples]
    return {
        "uids": [g.uid for g in groups], "steps": [g.step for g in groups], "versions": [g.version for g in groups],
        "sources": [g.source for g in groups], "sizes": [len(g.samples) for g in groups],
        "texts": [s.text for s in samples], "rewards": [s.reward for s in samples],
        "verdicts": [s.verdict for s in samples],
        "token_counts": [len(s.tokens) for s in samples],
        "tokens": torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int64),
        "logprob_counts": [len(s.logprobs) for s in samples],
        "logprobs": torch.tensor([x for s in samples for x in s.logprobs], dtype=torch.float64),
    }


def unpack_groups(packed: dict, problems: dict[str, Problem]) -> list[Group]:
    """pack_groups' inverse; `problems` by uid (the task's training problems, as the run loads them again)."""
    def split(flat: list, counts: list[int]) -> list[list]:
        return [flat[end - n:end] for n, end in zip(counts, accumulate(counts))]

    tokens = split(packed["tokens"].tolist(), packed["token_counts"])
    logprobs = split(packed["logprobs"].tolist(), packed["logprob_counts"])
    samples = [Sample(t, lp, text, reward, verdict) for t, lp, text, reward, verdict
               in zip(tokens, logprobs, packed["texts"], packed["rewards"], packed["verdicts"])]
    missing = [uid for uid in packed["uids"] if uid not in problems]
    if missing:
        raise ValueError(f"the checkpoint's buffers hold problem {missing[0]!r}, which the task no longer loads "
                         "(its data changed since the checkpoint was written)")
    groups, start = [], 0
    for uid, step, version, source, size in zip(packed["uids"], packed["steps"], packed["versions"],
                                                packed["sources"], packed["sizes"]):
        groups.append(Group(problems[uid], samples[start:start + size], step, version, source))
        start += size
    return groups


def verify_all(task, texts: list[str], answers: list) -> list[Verdict]:
    """Verdicts for many responses: the task's verify_batch when it has one (falling back to one at a time if it
    raises or returns the wrong number), else verify_safely on each."""
    batch = getattr(task, "verify_batch", None)
    if batch is not None and texts:
        try:
            verdicts = list(batch(texts, answers))
            if len(verdicts) == len(texts):
                return [Verdict.of(v) for v in verdicts]
            log.warning("verify_batch of %s returned %d verdicts for %d responses", task.name, len(verdicts), len(texts))
        except Exception as e:  # noqa: BLE001 - model output is hostile input
            log.warning("verify_batch of %s raised %s: %s; verifying one at a time", task.name, type(e).__name__, e)
    return [verify_safely(task, t, a) for t, a in zip(texts, answers)]


def verify_safely(task, text: str, answer) -> Verdict:
    """A verifier must never crash the trainer: an exception counts as unparsable (and is logged)."""
    try:
        return Verdict.of(task.verify(text, answer))
    except Exception as e:  # noqa: BLE001 - model output is hostile input
        log.warning("verifier %s raised %s: %s", task.name, type(e).__name__, e)
        return Verdict.UNPARSABLE


@dataclass
class StepResult:
    """What one step produced, for the run record."""

    fresh: list[Group]
    x1: list[Group]
    reevaluated: list[Group]
    x2: list[Group]
    x3: list[Group]
    metrics: dict = field(default_factory=dict)


class Trainer:
    """BAPO over a backend: `bapo` (config.BapoSettings) says how batches are adapted; B prompts of G responses each
    (`batch_size`, `group_size`) are sampled per step; `seed` seeds the data order and BAPO's random choices; with
    `critic` (BA-PPO) the backend computes the advantages, else GRPO's group baseline with `adv_eps` does."""

    def __init__(self, bapo, backend: Backend, task, problems: list[Problem], *, batch_size: int, group_size: int,
                 seed: int, critic: bool, adv_eps: float):
        self.bapo, self.backend, self.task = bapo, backend, task
        self.batch_size, self.group_size, self.critic, self.adv_eps = batch_size, group_size, critic, adv_eps
        self.sampler = PromptSampler(problems, seed)
        self.state = BapoState(
            bad=BadBuffer(capacity=batch_size),
            high=HighBuffer(max_age=bapo.high_max_age, max_uids=bapo.high_max_uids),
            thresholds=Thresholds(c1=bapo.c1, c2_range=bapo.c2_range, c3_range=bapo.c3_range),
            rng=random.Random(seed),
        )
        self.online_filter = get_filter(bapo.online_filter)
        # The one policy-version counter (backends count nothing): pi_theta's version = updates applied so far,
        # and the version alpha held at its last sync.
        self.updates = 0
        self.rollout_version = 0
        self.verdicts: Counter = Counter()
        self.timings: Counter = Counter()  # seconds this step: generate, verify, train, sync (record.STEP_COLUMNS)

    # --- pieces of a step ------------------------------------------------------------------------------------

    def rollout(self, problems: list[Problem], step: int, policy: Policy, source: str) -> list[Group]:
        """G responses per problem from alpha (policy="rollout") or pi_theta (policy="current"), verified.
        `source` says why they were generated: "fresh" or "reevaluated". Prompts are encoded here, not cached:
        image tensors are large (see `step`)."""
        prompts = [self.backend.encode(p) for p in problems]
        t0 = time.perf_counter()
        outputs = self.backend.generate(prompts, self.group_size, policy=policy)
        t1 = time.perf_counter()
        version = self.rollout_version if policy == "rollout" else self.updates
        texts = [[self.backend.decode(r.tokens) for r in responses] for responses in outputs]
        flat = verify_all(self.task, [t for ts in texts for t in ts],
                          [p.answer for p, ts in zip(problems, texts) for _ in ts])
        self.verdicts.update(v.value for v in flat)
        verdicts = iter(flat)
        groups = [Group(problem, [Sample(list(r.tokens), list(r.logprobs), text, (v := next(verdicts)).reward, v.value)
                                  for r, text in zip(responses, group_texts)], step, version, source, prompt)
                  for problem, prompt, responses, group_texts in zip(problems, prompts, outputs, texts)]
        self.timings["generate"] += t1 - t0
        self.timings["verify"] += time.perf_counter() - t1  # decoding and the verifier
        return groups

    def fresh_groups(self, step: int) -> tuple[list[Group], list[Group]]:
        """Steps 2-4: sample B prompts, generate with alpha, filter into X1. With DAPO's dynamic sampling,
        keep generating (at most `dynamic_sampling_rounds` rounds) until B groups pass the filter."""
        fresh, x1 = [], []
        for _ in range(max(1, self.bapo.dynamic_sampling_rounds)):
            groups = self.rollout(self.sampler.next(self.batch_size), step, "rollout", "fresh")
            fresh += groups
            x1 += self.online_filter(groups, self.bapo, self.state.rng)
            if len(x1) >= self.batch_size:
                break
        return fresh, x1[:self.batch_size]

    def store(self, fresh: list[Group], step: int):
        """Step 3: mu <= c1 into B_bad; c2 <= mu <= c3 into B_high (which keeps only recent steps)."""
        th = self.state.thresholds
        for g in fresh:
            if g.mu <= th.c1 and self.bapo.use_x2:
                self.state.bad.add(g)
            if th.c2 <= g.mu <= th.c3 and self.bapo.use_x3:
                self.state.high.add(g)
        self.state.high.evict_older_than(step)

    def revisit(self, step: int, exclude: set, room: int) -> tuple[list[Group], list[Group]]:
        """Step 5 (X2): every m steps, re-generate up to `reeval_max` B_bad prompts with the current policy
        and promote those now partly solved, at most `room` of them so the batch never exceeds B (the others
        stay in B_bad). Returns (all re-evaluated, promoted)."""
        bapo = self.bapo
        if not bapo.use_x2 or step % bapo.reeval_every != 0 or not len(self.state.bad):
            return [], []
        old = self.state.bad.oldest(bapo.reeval_max, exclude=exclude)
        if not old:
            return [], []
        # right after a sync alpha is pi_theta: generating with it spares a backend its temporary sync (verl)
        policy = "rollout" if self.rollout_version == self.updates else "current"
        new = self.rollout([g.problem for g in old], step, policy, "reevaluated")
        promoted = [n for n, o in zip(new, old) if is_promoted(n, o, self.state.thresholds.c1, bapo.promote)]
        promoted = promoted[:max(room, 0)]
        self.state.bad.remove(g.uid for g in promoted)
        return new, promoted

    def replay(self, room: int, exclude: set) -> list[Group]:
        """Step 6 (X3): fill the batch up to B from B_high; no uid twice in a batch."""
        if not self.bapo.use_x3:
            return []
        th = self.state.thresholds
        return sample_replay(self.state.high, room, th.c2, th.c3, exclude, self.state.rng)

    def train_on(self, batch: list[Group], step: int, sources: tuple[str, ...] | None = None) -> dict:
        """Steps 8-9: GRPO advantages per group, then the clipped update against stored log-probs. With a critic
        (BA-PPO) the advantage is left to the backend, which computes GAE from its value model and the rewards.
        `sources` names each group's source ("x1", "x2", "x3") for the backend's metrics by source."""
        if not batch:
            return {}
        for g in batch:  # replayed groups were stored without their encoding
            g.prompt = g.prompt if g.prompt is not None else self.backend.encode(g.problem)
        rewards = torch.tensor([g.rewards for g in batch], dtype=torch.float32)  # (n_groups, G)
        adv = None if self.critic else grpo_advantages(rewards, eps=self.adv_eps)  # (n_groups, G)
        update = UpdateBatch(
            prompts=tuple(g.prompt for g in batch),
            responses=tuple(tuple(Response(tuple(s.tokens), tuple(s.logprobs)) for s in g.samples) for g in batch),
            rewards=tuple(tuple(g.rewards) for g in batch),
            advantages=None if adv is None else tuple(tuple(row) for row in adv.tolist()), step=step, sources=sources)
        t0 = time.perf_counter()
        result = self.backend.update(update)
        self.timings["train"] += time.perf_counter() - t0
        if result.changed:  # not always: the backend may train on none of the batch (verl trims)
            self.updates += 1
        return dict(result.metrics)

    # --- one step (Algorithm 1) --------------------------------------------------------------------------------

    def step(self, t: int) -> StepResult:
        th = self.state.thresholds
        self.verdicts.clear()
        self.timings.clear()
        self.backend.timings.clear()
        self.backend.memory.clear()
        if t % self.bapo.delay == 0:  # 1. delayed rollout policy
            t0 = time.perf_counter()
            self.backend.sync()
            self.rollout_version = self.updates
            self.timings["sync"] += time.perf_counter() - t0
        fresh, x1 = self.fresh_groups(t)  # 2, 4
        self.store(fresh, t)  # 3
        in_batch = {g.uid for g in x1}
        reevaluated, x2 = self.revisit(t, exclude=in_batch, room=self.batch_size - len(x1))  # 5
        in_batch |= {g.uid for g in x2}
        x3 = self.replay(self.batch_size - len(x1) - len(x2), exclude=in_batch)  # 6
        batch = x1 + x2 + x3  # 7
        c2, c3 = th.c2, th.c3  # the thresholds this step used
        sources = ("x1",) * len(x1) + ("x2",) * len(x2) + ("x3",) * len(x3)
        train_metrics = self.train_on(batch, t, sources)  # 8, 9
        th.observe([r for g in fresh for r in g.rewards])  # 10
        for g in fresh + reevaluated + x3:  # buffers keep responses and log-probs, not the (large) prompt encodings
            g.prompt = None
        return StepResult(fresh, x1, reevaluated, x2, x3, self._metrics(t, fresh, x1, reevaluated, x2, x3, batch,
                                                                         c2, c3, train_metrics))

    def _metrics(self, t, fresh, x1, reevaluated, x2, x3, batch, c2, c3, train_metrics) -> dict:
        G = self.group_size
        bins = [0] * (G + 1)
        for g in fresh:
            bins[min(g.correct, G)] += 1
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        return {
            "step": t, "x1": len(x1), "x2": len(x2), "x3": len(x3), "batch_size": self.batch_size,
            "trained_groups": len(batch), "bad_size": len(self.state.bad), "high_size": len(self.state.high),
            "c1": self.state.thresholds.c1, "c2": c2, "c3": c3, "r_tot": self.state.thresholds.r_tot,
            "rollouts": G * (len(fresh) + len(reevaluated)), "rollouts_fresh": G * len(fresh),
            "rollouts_reevaluated": G * len(reevaluated),
            "fresh_reward": mean([r for g in fresh for r in g.rewards]),
            "reward": mean([r for g in batch for r in g.rewards]),
            "reevaluated_reward": mean([r for g in reevaluated for r in g.rewards]),
            "bins": bins, "policy_version": self.updates, "rollout_version": self.rollout_version,
            "response_length": mean([len(s.tokens) for g in fresh for s in g.samples]),
            **{f"t_{k}": self.timings.get(k, 0.0) for k in ("generate", "verify", "train", "sync")},
            **{f"t_generate_{k}": v for k, v in self.backend.timings.items()},  # where generate's time went
            **{f"gpu_memory_{k}_gb": v for k, v in self.backend.memory.items()},  # what the step held on the GPU
            "optimizer_steps": 0, "trained_tokens": 0,  # a step that trained nothing
            **{k: v for k, v in train_metrics.items()},
            "verdicts": dict(self.verdicts),
        }

    # --- checkpoint state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What the trainer carries between steps (buffers, thresholds, random and data state, versions) as tensors
        and plain data only, so that a checkpoint loads with torch.load(weights_only=True), which runs no code."""
        th = self.state.thresholds
        return {"format": STATE_FORMAT, "bad": pack_groups(self.state.bad.groups.values()),
                "high": pack_groups(self.state.high.groups.values()),
                "thresholds": {"reward_sum": th.reward_sum, "reward_count": th.reward_count},
                "rng": self.state.rng.getstate(), "sampler": self.sampler.state_dict(), "updates": self.updates,
                "rollout_version": self.rollout_version}

    def load_state_dict(self, state: dict):
        """state_dict's inverse. Buffer capacities and thresholds' ranges come from the config, which a resumed run
        shares with the one that wrote the state."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"trainer state of format {state.get('format')!r}; this bapo-vl reads format "
                             f"{STATE_FORMAT}")
        problems = {p.uid: p for p in self.sampler.problems}
        self.state.bad.groups = OrderedDict((g.uid, g) for g in unpack_groups(state["bad"], problems))
        self.state.high.groups = OrderedDict((g.uid, g) for g in unpack_groups(state["high"], problems))
        self.state.thresholds.reward_sum = state["thresholds"]["reward_sum"]
        self.state.thresholds.reward_count = state["thresholds"]["reward_count"]
        self.state.rng.setstate(state["rng"])
        self.sampler.load_state_dict(state["sampler"])
        self.updates, self.rollout_version = state["updates"], state["rollout_version"]
