"""The algorithm-neutral study: a grid of entries x seeds on one task and model, every run stopped at the same
rollout budget (max_rollouts), every checkpoint judged by the same held-out evaluation (`bapo eval`'s code).

    python scripts/study.py --algos grpo,dapo,bapo --seeds 0,1,2 --budget 30720 --k 8 --final-k 32 device=cuda

Checkpoints. A run trains in segments to each checkpoint budget, then is resumed (resume=RUN, which reproduces an
uninterrupted run: tests/test_crash_resume.py) to the next, its newest checkpoint evaluated after each. So an
evaluation sees the policy at the first step whose rollouts reach the checkpoint, the same rule that ends the run.
Checkpoints are log-spaced by default (budget / 2^(n-1), ..., budget / 2, budget: learning is fastest early, and a
log axis shows it), or even (`--spacing linear`: budget * i / n). `--extend ENTRY=F` trains that entry on past the
budget to F x budget (budget x 2, x 4, ...; linear: on in steps of budget / n), so "how many rollouts does it need to
reach another's final accuracy" can be answered past the common budget; its rows at the budget still compare at
equal rollouts.

Evaluations. Each prompt of the held-out split (or of several, `--split test,val`: one pool of prompts) is answered
once greedily and k times at temperature 1. Every checkpoint samples k = `--k` answers with one seed (eval_seed + 1)
for every method, so the curves are paired by prompt and sampling seed; the final evaluations (the common budget, and
an extended entry's last checkpoint) sample `--final-k` answers, with their own seed (eval_seed + 2; the checkpoint's
when final_k = k): more samples where the methods are compared. The start policy is evaluated three times: "start"
(k, the checkpoint seed: the curves' x = 0), "start_final" (final_k, the final seed: what every final evaluation is
paired with) and "start_hard" (hard_k, an independent seed eval_seed + 1000), which alone defines the hard set H, the
prompts it got 0/hard_k right. Then

    unlocked = |{p in H : correct(p) >= 1}| / |H|

for every evaluation alike, and start_final's unlocked is the floor that resampling alone reaches: a prompt solved
with probability 1/50 is 0/16 about 72 % of the time, so H holds prompts that fresh samples solve without any
training. Defining H on a sample independent of the ones it is scored on keeps that floor honest (the same samples
would unlock nothing by construction). Migration: each prompt's bin (correct count 0..k) at the start against its
bin after training (bapo_vl.reader.migration, the run record's rule).

Ledger. Finished evaluations are kept in RUNS/study.jsonl, keyed (entry, seed, budget), each with its step, rollouts,
optimizer steps (equal rollouts are not equal updates) and where the rollouts went (fresh or re-evaluation, and the
trained groups by source: the report's "Where the rollouts went"): the same command run again continues where it
stopped (an interrupted study loses at most the evaluations in flight). Each row names its run (the record's
created_at) and the code's commit: where a run's checkpoints are gone, the next segment trains a new run of the same
seed from the start policy, and the report says which rows came from which run (and from which code, where that
differs). Each is also written into its run's record
at that step (evals "hard_set" and "heldout"), where the dashboard shows it next to the run's own ledger. `--entry
NAME="key=value ..."` adds a grid entry of one's own (a learning-rate pilot: `--entry lr1e-5="algo=grpo lr=1e-5"`).

Parallel runs. `--jobs N` (N > 1): the start policy is evaluated in a process of its own (`--start-only`,
RUNS/logs/start.log: no model or vLLM engine stays in this one while the runs share the cards), then every (entry,
seed) with evaluations missing runs as its own process (`python -m bapo_vl.study` with the same settings, `--algos
ENTRY --seeds SEED --jobs 1 --no-report`), at most N at once, each appending its rows to the same ledger and its
output to RUNS/logs/ENTRY-sSEED.log; the report is written here from the ledger once all have ended. Children take
turns on the visible GPUs when there are several, and share the CPU cores (OMP_NUM_THREADS = cores // N, at most
this process's torch threads).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from bapo_vl.backends.engines import choose_engine, resolve_device, sleeps
from bapo_vl.config import Config, load_config, resume_config
from bapo_vl.evaluate import EvalOptions, evaluate, load_backend, load_sets, setup
from bapo_vl.plugins import get_task
from bapo_vl.provenance import commit
from bapo_vl.reader import migration as bin_migration
from bapo_vl.record import RunRecord, query_ro, read_meta
from bapo_vl.stats import (hierarchical_bootstrap_diff, hierarchical_bootstrap_mean, holm,
                           rollouts_ratio_bootstrap)
from bapo_vl.train import checkpoint_steps, train

# Grid entries: name -> config overrides. The first are the algorithms (config.ALGOS presets) ...
ALGORITHMS = ("grpo", "grpo_v5", "dapo", "bapo", "bapo_no_x2", "bapo_no_x3", "mini_test", "grpo_replay")
ENTRIES: dict[str, list[str]] = {name: [f"algo={name}"] for name in ALGORITHMS}
# ... then the knobs the paper tunes, each varied once from BAPO's defaults (v=5, m=5, range filter, B_high age 3;
# tests/test_study.py checks those defaults): `--knobs` adds them to the grid.
KNOBS: dict[str, list[str]] = {
    "bapo_v1": ["algo=bapo", "delay=1"],
    "bapo_v2": ["algo=bapo", "delay=2"],
    "bapo_m1": ["algo=bapo", "reeval_every=1"],
    "bapo_gaussian": ["algo=bapo", "online_filter=gaussian"],
    "bapo_age1": ["algo=bapo", "high_max_age=1"],
    "bapo_age6": ["algo=bapo", "high_max_age=6"],
}
STUDY_SETS = {"algo", "seed", "steps", "max_rollouts", "run_dir", "name", "resume"}  # overrides the study owns
# The start policy's three evaluations: the curves' x = 0 (k, checkpoint seed), the final comparison's start
# (final_k, final seed) and the hard set's definition (hard_k, a seed of its own).
START, START_FINAL, START_HARD = "start", "start_final", "start_hard"
HARD_SEED_OFFSET = 1000


# ----------------------------------------------------------------------------- the hard set (pure functions)


def hard_set(counts: dict[str, int]) -> list[str]:
    """The prompts never solved: correct count 0 of k.
    >>> hard_set({"a": 0, "b": 3, "c": 0})
    ['a', 'c']"""
    return sorted(uid for uid, c in counts.items() if c == 0)


def unlocked(hard: list[str], counts: dict[str, int]) -> float:
    """Fraction of the hard set now solved at least once (>= 1/k); 0.0 for an empty hard set.
    >>> unlocked(["a", "c"], {"a": 1, "b": 0, "c": 0})
    0.5"""
    missing = [uid for uid in hard if uid not in counts]
    if missing:
        raise ValueError(f"hard-set prompt {missing[0]!r} was not evaluated ({len(missing)} missing)")
    return sum(counts[uid] >= 1 for uid in hard) / len(hard) if hard else 0.0


def migration(start: dict[str, int], end: dict[str, int], k: int) -> list[list[int]]:
    """m[i][j] = held-out prompts with i/k correct at the start and j/k at the end (both evaluations k samples)."""
    uids = sorted(start.keys() & end.keys())
    return bin_migration(np.array([start[u] for u in uids]), np.array([end[u] for u in uids]), k)


COARSE_BINS = ["0/k", "<1/2", ">=1/2", "k/k"]  # never, under half, half or more, always


def coarse_edges(k: int) -> list[tuple[int, int]]:
    """The correct-count ranges [lo, hi) of COARSE_BINS for k samples."""
    return [(0, 1), (1, math.ceil(k / 2)), (math.ceil(k / 2), k), (k, k + 1)]


def coarse(m: list[list[int]]) -> tuple[list[str], list[list[int]]]:
    """A (k+1)x(k+1) migration matrix summed into the 4 COARSE_BINS."""
    edges, a = coarse_edges(len(m) - 1), np.array(m)
    return COARSE_BINS, [[int(a[r0:r1, c0:c1].sum()) for c0, c1 in edges] for r0, r1 in edges]


def bin_changes(m: list[list[int]]) -> list[float | None]:
    """Mean change of accuracy (correct/k, end - start) of the prompts in each coarse start bin (0/k, under half,
    half or more, k/k) of a (k+1)x(k+1) migration matrix; None for an empty bin. Where a method gains and loses."""
    k = len(m) - 1
    a = np.array(m, dtype=float)
    edges = coarse_edges(k)
    delta = np.arange(k + 1)[None, :] - np.arange(k + 1)[:, None]  # end count - start count
    return [float((a[r0:r1] * delta[r0:r1]).sum() / (k * a[r0:r1].sum())) if a[r0:r1].sum() else None
            for r0, r1 in edges]


# ----------------------------------------------------------------------------- seed statistics


def mean_sd(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


# ----------------------------------------------------------------------------- options


def checkpoint_budgets(budget: int, n: int, spacing: str = "log") -> list[int]:
    """The n rollout budgets a run is evaluated at, the last the budget itself. Log: geometric from
    budget / 2^(n-1) (rounded, each >= 1, duplicates merged); linear: budget * i / n.
    >>> checkpoint_budgets(320, 6), checkpoint_budgets(40, 4, "linear"), checkpoint_budgets(3, 4)
    ([10, 20, 40, 80, 160, 320], [10, 20, 30, 40], [1, 2, 3])"""
    if spacing == "log":
        return sorted({max(1, math.floor(budget / 2 ** (n - 1 - i) + 0.5)) for i in range(n)})
    return sorted({max(1, budget * i // n) for i in range(1, n + 1)})


def extended_budgets(budget: int, n: int, spacing: str, factor: float) -> list[int]:
    """The checkpoints of an entry trained on past the budget to factor x budget, continuing its spacing
    (log: budget x 2, x 4, ...; linear: steps of budget / n), the last one factor x budget itself.
    >>> extended_budgets(100, 4, "log", 4), extended_budgets(100, 4, "log", 3), extended_budgets(100, 4, "linear", 1.5)
    ([200, 400], [200, 300], [125, 150])"""
    top = math.floor(factor * budget + 0.5)
    if spacing == "log":
        steps = [budget * 2 ** j for j in range(1, math.ceil(math.log2(factor)) + 1)]
    else:
        steps = [math.floor(budget + i * budget / n + 0.5) for i in range(1, math.ceil((factor - 1) * n) + 1)]
    return sorted({b for b in steps if budget < b < top} | ({top} if top > budget else set()))


def parse_entry(text: str) -> tuple[str, list[str]]:
    """--entry NAME="key=value key=value" -> (NAME, [key=value, ...]); values may be quoted as in a shell.
    >>> parse_entry("lr1e-5=algo=grpo lr=1e-5 kl_coef=0")
    ('lr1e-5', ['algo=grpo', 'lr=1e-5', 'kl_coef=0'])"""
    name, eq, overrides = text.partition("=")
    if not eq or not name.strip():
        raise ValueError(f"--entry {text!r}: write NAME=\"key=value key=value\"")
    return name.strip(), shlex.split(overrides)


def parse_extend(text: str) -> tuple[str, float]:
    """--extend ENTRY=FACTOR -> (ENTRY, FACTOR).
    >>> parse_extend("dapo=2")
    ('dapo', 2.0)"""
    name, eq, factor = text.partition("=")
    try:
        return name.strip(), float(factor) if eq else math.nan
    except ValueError:
        raise ValueError(f"--extend {text!r}: write ENTRY=FACTOR, e.g. dapo=2") from None


@dataclass
class StudyOptions:
    algos: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    """grid entries (ENTRIES, KNOBS and `entries` by name)"""
    knobs: bool = False
    """also every KNOBS entry"""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    budget: int = 30_720
    """rollouts per run (max_rollouts); 30,720 = 120 GRPO steps of B=32, G=8"""
    checkpoints: int = 4
    """evaluations per run up to the budget"""
    spacing: str = "log"
    """checkpoint budgets: "log" (budget / 2^(n-1), ..., budget) or "linear" (budget * i / n)"""
    k: int = 8
    """samples per held-out prompt (temperature 1) at every checkpoint"""
    final_k: int | None = None
    """samples per held-out prompt at each run's final budget (default k)"""
    hard_k: int | None = None
    """samples of the start policy that define the hard set (default final_k)"""
    extend: dict[str, float] = field(default_factory=dict)
    """entry -> factor: that entry trains on to factor x budget"""
    entries: dict[str, list[str]] = field(default_factory=dict)
    """grid entries of one's own: name -> config overrides"""
    split: str = "test"
    """held-out split (the task's load(split=...)), or several joined by commas, evaluated as one pool of prompts
    (more prompts, narrower intervals); never the training data"""
    source: str | None = None
    """held-out data file, passed to load(source=...)"""
    limit: int | None = None
    """first N held-out prompts (of each split)"""
    preset: str | None = None
    """config preset of every run (default tiny)"""
    overrides: list[str] = field(default_factory=list)
    """key=value for every run (model=, device=, batch_size=, ...)"""
    runs: str = "runs/study"
    """run directories and the evaluations done (study.jsonl)"""
    out: str | None = None
    """table, plots, results.json; default docs/study/<model name>"""
    eval_seed: int = 0
    eval_batch_size: int | None = None
    """sequences per generate call in evaluations (default: generate_batch_size, EmbeddedOptions)"""
    baseline: str = "grpo"
    """the entry every other is compared with"""
    keep_checkpoints: bool = False
    """keep every evaluated checkpoint (default: only each run's newest, which the next segment resumes from)"""
    command: str = ""
    """the command line, for the report"""
    jobs: int = 1
    """(entry, seed) runs at once, each its own process (run_parallel); 1: one after another in this process"""
    report: bool = True
    """write results.md, plots and results.json (--no-report: the ledger only, as --jobs children do)"""
    start_only: bool = False
    """evaluate the start policy into the ledger and stop (--jobs does it in a process of its own)"""
    by: str | None = None
    """a held-out problem's meta field (e.g. kind) to break the report's gains over the start down by"""

    def __post_init__(self):
        self.final_k = self.k if self.final_k is None else self.final_k
        self.hard_k = self.final_k if self.hard_k is None else self.hard_k
        builtin = {**ENTRIES, **KNOBS}
        known = {**builtin, **self.entries}
        self.algos = list(dict.fromkeys([*self.algos, *(KNOBS if self.knobs else [])]))
        reserved = {START, START_FINAL, START_HARD}
        custom_sets = {name: own for name, overrides in self.entries.items()
                       if (own := [o for o in overrides if o.partition("=")[0].strip() in STUDY_SETS - {"algo"}])}
        checks = [
            (not (clash := [e for e in self.entries if e in builtin or e in reserved]),
             f"--entry {clash} would replace a built-in entry of that name; choose another name"),
            (all(re.fullmatch(r"[A-Za-z0-9_.+-]+", e) for e in self.entries),
             f"entry names {list(self.entries)} may hold only letters, digits and _.+- (they name run folders)"),
            (all(all("=" in o for o in overrides) for overrides in self.entries.values()),
             f"every --entry override is key=value: {self.entries}"),
            (not custom_sets, f"the study sets seed, steps, max_rollouts, run_dir, name and resume itself; "
                              f"drop them from --entry {custom_sets}"),
            (not (bad := [a for a in self.algos if a not in known]),
             f"unknown grid entries {bad}; known: {', '.join(known)}"),
            (not (bad := [e for e in self.extend if e not in known]), f"--extend names unknown entries {bad}"),
            (all(f > 1 for f in self.extend.values()), f"--extend factors must be > 1: {self.extend}"),
            (bool(self.seeds), "give at least one seed"),
            (self.budget >= 1, f"budget={self.budget} must be >= 1 rollout"),
            (1 <= self.checkpoints <= self.budget, f"checkpoints={self.checkpoints} must be in 1..budget"),
            (self.spacing in ("log", "linear"), f"spacing={self.spacing!r}: log or linear"),
            (min(self.k, self.final_k, self.hard_k) >= 1, f"k={self.k}, final_k={self.final_k} and "
                                                          f"hard_k={self.hard_k} must be >= 1"),
            (self.jobs >= 1, f"jobs={self.jobs} must be >= 1"),
            (all(splits := self.split.split(",")) and len(set(splits)) == len(splits),
             f"--split {self.split!r}: split names joined by commas, each once (e.g. test,val)"),
            (not (own := [o for o in self.overrides if o.partition("=")[0].strip() in STUDY_SETS]),
             f"the study sets {', '.join(sorted(STUDY_SETS))} itself; drop {own}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def budgets(self) -> list[int]:
        """The checkpoints every entry is evaluated at, the last the budget."""
        return checkpoint_budgets(self.budget, self.checkpoints, self.spacing)

    def entry_budgets(self, entry: str) -> list[int]:
        """An entry's checkpoints: the common ones, then its --extend ones."""
        extra = (extended_budgets(self.budget, self.checkpoints, self.spacing, self.extend[entry])
                 if entry in self.extend else [])
        return [*self.budgets, *extra]

    def is_final(self, entry: str, budget: int) -> bool:
        """Evaluated with final_k samples: the common budget, and an extended entry's last checkpoint."""
        return budget in (self.budget, self.entry_budgets(entry)[-1])

    def overrides_of(self, entry: str) -> list[str]:
        return {**ENTRIES, **KNOBS, **self.entries}[entry]

    @property
    def checkpoint_seed(self) -> int:
        """The sampling seed of every evaluation at k: the start's and every checkpoint's, so they pair."""
        return self.eval_seed + 1

    @property
    def final_seed(self) -> int:
        """The sampling seed of every evaluation at final_k (the checkpoint seed when final_k = k: one evaluation
        serves both)."""
        return self.checkpoint_seed if self.final_k == self.k else self.eval_seed + 2

    @property
    def hard_seed(self) -> int:
        return self.eval_seed + HARD_SEED_OFFSET


# ----------------------------------------------------------------------------- training and evaluation


def base_config(opts: StudyOptions):
    return load_config(opts.preset, None, opts.overrides)


def run_dir_of(opts: StudyOptions, entry: str, seed: int) -> Path:
    return Path(opts.runs) / f"{entry}-s{seed}"


def resumable(run_dir: Path) -> bool:
    """Whether the run has a checkpoint to continue from (else its next segment trains a new run)."""
    return run_dir.is_dir() and bool(checkpoint_steps(run_dir))


def train_segment(opts: StudyOptions, entry: str, seed: int, budget: int) -> tuple[Path, float]:
    """Train run `entry`-s`seed` until `budget` rollouts (a new run, or resumed from its newest checkpoint).
    Returns the run directory and the seconds it took."""
    run_dir = run_dir_of(opts, entry, seed)
    # steps = the entry's last budget never binds first: every step generates at least one rollout
    steps = opts.entry_budgets(entry)[-1]
    keep = ["keep_checkpoints=0"] if opts.keep_checkpoints else []  # the trainer would prune evaluated ones
    if resumable(run_dir):
        cfg = resume_config(run_dir, [f"max_rollouts={budget}", f"steps={steps}", *keep])
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # a run killed before its first checkpoint starts over
        cfg = load_config(opts.preset, None, [*opts.overrides, *opts.overrides_of(entry), f"seed={seed}",
                                              f"steps={steps}", f"max_rollouts={budget}",
                                              f"run_dir={opts.runs}", f"name={run_dir.name}", *keep])
    t0 = time.perf_counter()
    train(cfg, quiet=True)
    seconds = time.perf_counter() - t0
    gc.collect()
    return run_dir, seconds


def eval_setup(cfg, options: EvalOptions):
    """`bapo eval`'s setup with the study's rollout engine and its options: in one process the evaluations share
    vLLM's one engine with the training segments (bapo_vl.backends.engines.process_engine), so they build it alike."""
    s = setup(options)
    s.cfg.embedded = replace(s.cfg.embedded, rollout_engine=cfg.embedded.rollout_engine,
                             vllm_options=dict(cfg.embedded.vllm_options))
    return s


def evaluate_policy(opts: StudyOptions, cfg, model: str, checkpoint: int | None, seed: int, k: int | None = None,
                    greedy: bool = True) -> dict:
    """k samples (temperature 1, default opts.k) and one greedy answer per held-out prompt, through `bapo eval`'s
    code: the same numbers as `bapo eval --k K --seed SEED` (and `--temperature 0`), so two evaluations with one
    (k, seed) are paired by prompt and sampling seed whatever else was evaluated before them."""
    k = opts.k if k is None else k
    run = cfg.run
    common = dict(model=model, checkpoint=checkpoint, task=run.task, splits=opts.split.split(","), source=opts.source,
                  template=run.task_options.get("template"), limit=opts.limit, options={},
                  max_new_tokens=cfg.sampling.max_response_length, batch_size=opts.eval_batch_size,
                  device=run.device, seed=seed, tasks_dirs=list(run.tasks_dirs), quiet=True)
    s = eval_setup(cfg, EvalOptions(**common, k=k, temperature=1.0))
    pool = {opts.split: [p for problems in s.sets.values() for p in problems]}  # the held-out splits as one set
    backend = load_backend(s.cfg, s.checkpoint_dir)  # once for both passes
    per_call = s.cfg.embedded.generate_batch_size
    sampled = evaluate(backend, s.task, pool, k, quiet=True, per_call=max(1, per_call // k))[opts.split]
    row = {"mean@k": sampled["mean@k"], "pass@k": sampled["pass@k"], "n": sampled["n"],
           "counts": sampled["problems"]}
    if greedy:  # per prompt too (0 or 1), for intervals over prompts
        answered = evaluate(backend, s.task, pool, 1, quiet=True, greedy=True, per_call=per_call)[opts.split]
        row = {"greedy": answered["mean@k"], "greedy_counts": answered["problems"], **row}
    del backend
    gc.collect()
    return row


def evaluate_row(opts: StudyOptions, cfg, model: str, checkpoint: int | None, final: bool) -> dict:
    """A ledger row's evaluations: at a final budget final_k samples with the final seed, and (final_k != k) also
    k samples with the checkpoint seed under "curve", so every checkpoint's curve point is one measure; elsewhere k
    samples with the checkpoint seed. "k" and "sample_seed" say which."""
    k, seed = (opts.final_k, opts.final_seed) if final else (opts.k, opts.checkpoint_seed)
    row = {"k": k, "sample_seed": seed, **evaluate_policy(opts, cfg, model, checkpoint, seed, k)}
    if (k, seed) != (opts.k, opts.checkpoint_seed):
        row["curve"] = {"k": opts.k, "sample_seed": opts.checkpoint_seed,
                        **evaluate_policy(opts, cfg, model, checkpoint, opts.checkpoint_seed, greedy=False)}
    return row


def curve_point(row: dict) -> dict:
    """A row's evaluation at k with the checkpoint seed (mean@k, pass@k, counts): the curves' one measure."""
    return row.get("curve", row)


def newest_checkpoint(run_dir: Path) -> tuple[int, int, int, float]:
    """(step, rollouts, optimizer steps, training seconds) of a run up to its newest checkpoint, from its record
    (truncated to that checkpoint on every resume). Optimizer steps sum the steps' own count (a step may take
    several mini-batch updates, or none). The seconds are the steps' own timings (generate, verify, train, sync): a
    run restarted on another machine, or resumed, counts each step once, and model loading not at all."""
    step = checkpoint_steps(run_dir)[-1]
    rollouts, updates, seconds = query_ro(
        run_dir, "SELECT COALESCE(SUM(rollouts), 0), COALESCE(SUM(json_extract(metrics, '$.optimizer_steps')), 0), "
                 "COALESCE(SUM(t_generate + t_verify + t_train + t_sync), 0) FROM steps WHERE step <= ?", (step,))[0]
    return step, rollouts, int(updates), seconds


SPENT = {"fresh": "rollouts_fresh", "reevaluated": "rollouts_reevaluated", "x1": "x1", "x2": "x2", "x3": "x3"}


def spent(run_dir: Path, step: int) -> dict[str, int]:
    """Where a run's rollouts went up to `step`, from its record: fresh and re-evaluation rollouts, and the groups
    its updates trained by source (X1 fresh, X2 re-evaluated, X3 replayed)."""
    sums = query_ro(run_dir, "SELECT " + ", ".join(f"COALESCE(SUM(json_extract(metrics, '$.{m}')), 0)"
                                                   for m in SPENT.values()) + " FROM steps WHERE step <= ?", (step,))
    return {name: int(v) for name, v in zip(SPENT, sums[0])}


def record_evals(run_dir: Path, step: int, row: dict, hard: list[str], k: int) -> None:
    """Write an evaluation into the run's own record (evals table, the writer `bapo eval --run` uses) at the step
    it saw, so a run carries the study's measure with it: "hard_set" (unlocked_fraction, hard_set_size, k) and
    "heldout" (greedy, mean@k, pass@k: the metric names `bapo eval --run` records)."""
    record = RunRecord.open(run_dir, resume=False)  # an evaluation resumes nothing: the run's status stays
    try:
        record.log_eval(step, "hard_set", {"unlocked_fraction": unlocked(hard, row["counts"]),
                                           "hard_set_size": len(hard), "k": k})
        record.log_eval(step, "heldout", {"greedy": row["greedy"], "mean@k": row["mean@k"], "pass@k": row["pass@k"],
                                          "k": k})
    finally:
        record.close()


def with_new_defaults(settings: dict) -> dict:
    """A ledger's settings with the Config fields added since it was written, at their defaults: a field that did
    not exist then changed nothing, so its default must not make the ledger's evaluations look foreign."""
    defaults = json.loads(json.dumps(Config().to_dict()))
    config = settings.get("config", {})
    return {**settings, "config": {**{k: v for k, v in defaults.items() if k not in config}, **config}}


GROWING = ("entries", "extend")  # settings a later command may add names to, leaving the earlier ones as they are


def grown(recorded: dict, settings: dict) -> dict | None:
    """The ledger's settings with the entries and extensions `settings` adds, or None where the two disagree: any
    other setting, or an entry or extension both name with other overrides or budgets."""
    if {k: v for k, v in recorded.items() if k not in GROWING} != {k: v for k, v in settings.items()
                                                                   if k not in GROWING}:
        return None
    out = dict(recorded)
    for key in GROWING:
        old, new = recorded.get(key, {}), settings.get(key, {})
        if any(old[name] != new[name] for name in old.keys() & new.keys()):
            return None
        out[key] = dict(sorted({**old, **new}.items()))
    return out


class Ledger:
    """The evaluations done, one JSON line each in RUNS/study.jsonl, keyed (entry, seed, budget); its first line
    holds the settings they were made with. A later command may add entries and extensions (the first line grows to
    name them); one with other settings is refused."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.rows = path, {}
        text = path.read_text() if path.exists() else ""
        lines = text.splitlines()
        if text and not text.endswith("\n"):  # a --jobs child is appending it right now: not ours to read yet
            lines = lines[:-1]
        if lines:
            recorded = with_new_defaults(json.loads(lines[0]))
            both = grown(recorded, settings)
            if both is None:
                raise ValueError(f"{path} was made with other settings ({lines[0][:300]}...): give another --runs, "
                                 f"or remove {path.parent} to start over (a study may gain entries and extensions, "
                                 f"not change them)")
            if both != recorded:  # before any --jobs child exists: the parent opens the ledger first
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(both) + "\n" + "".join(line + "\n" for line in lines[1:]))
                os.replace(tmp, path)
        for line in lines[1:]:
            row = json.loads(line)
            self.rows[(row["entry"], row["seed"], row["budget"])] = row
        if not lines:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings) + "\n")

    def get(self, entry: str, seed, budget: int) -> dict | None:
        return self.rows.get((entry, seed, budget))

    def add(self, row: dict):
        self.rows[(row["entry"], row["seed"], row["budget"])] = row
        # one write on an O_APPEND descriptor: lines appended by --jobs children at the same time never interleave
        line = (json.dumps(row) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            if os.write(fd, line) != len(line):
                raise OSError(f"{self.path}: a ledger line was written only in part")
        finally:
            os.close(fd)


def study_settings(opts: StudyOptions, cfg) -> dict:
    """What the ledger's rows depend on, as its first line holds it: a ledger with other settings is refused."""
    settings = {"config": cfg.to_dict(), "k": opts.k, "final_k": opts.final_k, "hard_k": opts.hard_k,
                "split": opts.split, "source": opts.source, "limit": opts.limit, "eval_seed": opts.eval_seed,
                "budget": opts.budget, "spacing": opts.spacing, "budgets": opts.budgets,
                "extend": {e: opts.entry_budgets(e)[len(opts.budgets):] for e in sorted(opts.extend)},
                "entries": {e: opts.entries[e] for e in sorted(opts.entries)}}
    return json.loads(json.dumps(settings))  # as the ledger file holds it (tuples -> lists)


def run_study(opts: StudyOptions, say=print) -> dict:
    """Evaluate the start policy, train and evaluate every (entry, seed) at every budget; returns the ledger rows
    as {"start", "start_final", "start_hard": row, "runs": [rows]}, each row with its hard set unlocked, its bins
    and its migration from the start evaluation of the same k."""
    cfg = base_config(opts)
    refuse_sleeping_engines_sharing_a_card(opts, cfg)
    settings = study_settings(opts, cfg)
    ledger = Ledger(Path(opts.runs) / "study.jsonl", settings)
    start_evals = ((START, opts.k, opts.checkpoint_seed), (START_FINAL, opts.final_k, opts.final_seed),
                   (START_HARD, opts.hard_k, opts.hard_seed))
    if opts.jobs > 1 and any(ledger.get(name, None, 0) is None for name, *_ in start_evals):
        run_start_child(opts, say)  # then the loop below finds every start row in the ledger
        ledger = Ledger(ledger.path, settings)
    for name, k, seed in start_evals:
        if ledger.get(name, None, 0) is not None:
            continue
        done = [r for other, *_ in start_evals if (r := ledger.get(other, None, 0)) is not None]
        same = [r for r in done if (r["k"], r["sample_seed"]) == (k, seed)]  # final_k = k: start_final is start
        if not same:
            say(f"evaluating the start policy {cfg.run.model} ({name}: k={k}, seed {seed})")
        found = ({key: same[0][key] for key in ("k", "sample_seed", "mean@k", "pass@k", "n", "counts")} if same else
                 {"k": k, "sample_seed": seed, **evaluate_policy(opts, cfg, cfg.run.model, None, seed, k,
                                                                 greedy=name == START)})
        if name != START:  # greedy is deterministic: the start's
            found |= {key: ledger.get(START, None, 0)[key] for key in ("greedy", "greedy_counts")}
        ledger.add({"entry": name, "seed": None, "budget": 0, "step": 0, "rollouts": 0, "optimizer_steps": 0,
                    "train_seconds": 0.0, "device": device(cfg.run.device), **found})
    if opts.start_only:
        return {}
    hard = hard_set(ledger.get(START_HARD, None, 0)["counts"])
    if opts.jobs > 1:  # every run in its own process; then the loop below finds everything in the ledger
        run_parallel(opts, [(e, s) for e in opts.algos for s in opts.seeds
                            if any(ledger.get(e, s, b) is None for b in opts.entry_budgets(e))], say)
        ledger = Ledger(ledger.path, settings)  # with the children's rows
    for entry in opts.algos:
        for seed in opts.seeds:
            for budget in opts.entry_budgets(entry):
                if ledger.get(entry, seed, budget) is not None:
                    continue
                earlier = [f"{b:,}" for b in opts.entry_budgets(entry) if b < budget and ledger.get(entry, seed, b)]
                run_dir = run_dir_of(opts, entry, seed)
                if earlier and not resumable(run_dir):
                    say(f"{entry} seed {seed}: no checkpoint in {run_dir} to continue from: a new run trains from the "
                        f"start policy to {budget:,} (the rows at {', '.join(earlier)} came from an earlier run)")
                run_dir, seconds = train_segment(opts, entry, seed, budget)
                step, rollouts, updates, train_seconds = newest_checkpoint(run_dir)
                if rollouts < budget:
                    raise RuntimeError(f"{run_dir} stopped at {rollouts} rollouts (step {step}), under the budget "
                                       f"{budget}: its steps cap should never bind")
                say(f"{entry} seed {seed}: {rollouts} rollouts at step {step} (budget {budget}), {seconds:.1f} s")
                row = evaluate_row(opts, cfg, str(run_dir), step, opts.is_final(entry, budget))
                record_evals(run_dir, step, row, hard, row["k"])  # first: a kill before the ledger line redoes both
                ledger.add({"entry": entry, "seed": seed, "budget": budget, "step": step, "rollouts": rollouts,
                            "optimizer_steps": updates, "train_seconds": train_seconds,
                            "spent": spent(run_dir, step), "device": device(cfg.run.device),
                            **run_of(run_dir), **row})
                if not opts.keep_checkpoints:
                    for old in [s for s in checkpoint_steps(run_dir) if s != step]:
                        shutil.rmtree(run_dir / "checkpoints" / f"step_{old}")

    starts = {name: ledger.get(name, None, 0) for name in (START, START_FINAL, START_HARD)}
    runs = [brief(ledger.get(e, s, b), hard, starts.values())
            for e in opts.algos for s in opts.seeds for b in opts.entry_budgets(e)]
    return {"settings": settings, "hard_set": len(hard),
            **{name: brief(r, hard, starts.values()) for name, r in starts.items()}, "runs": runs}


def brief(row: dict, hard: list[str], starts) -> dict:
    """The row with its hard set unlocked, its bins and its migration from the start evaluation of the same k and
    sampling seed (one of `starts`); its curve point (if any) likewise."""
    reference = {(r["k"], r["sample_seed"]): r for r in starts}[row["k"], row["sample_seed"]]
    out = {**row, "unlocked": unlocked(hard, row["counts"]),
           "bins": np.bincount(list(row["counts"].values()), minlength=row["k"] + 1).tolist(),
           "migration": migration(reference["counts"], row["counts"], row["k"])}
    if "curve" in row:
        out["curve"] = brief({**row["curve"], "greedy": row["greedy"], "greedy_counts": row["greedy_counts"]}, hard,
                             starts)
    return out


def run_parallel(opts: StudyOptions, pairs: list[tuple[str, int]], say=print) -> None:
    """Train and evaluate each (entry, seed) in its own process (child_argv), at most opts.jobs at once, in grid
    order; each writes its rows to the ledger and its output to RUNS/logs/ENTRY-sSEED.log. Waits for all; raises
    naming every one that failed (the rows written stay: the same command again continues)."""
    logs = Path(opts.runs) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    gpus = child_gpus(base_config(opts).run.device)
    # never more threads than this process has: tests pin it to 1, and a child's numbers then match this one's
    threads = str(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // opts.jobs)))
    waiting, running, failed = list(enumerate(pairs)), {}, []
    try:
        while waiting or running:
            while waiting and len(running) < opts.jobs:
                i, (entry, seed) = waiting.pop(0)
                env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
                if gpus:
                    env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
                argv, log = child_argv(opts, entry, seed), logs / f"{entry}-s{seed}.log"
                with open(log, "a") as f:  # a rerun keeps the log of an earlier failure
                    f.write(shlex.join(argv) + "\n")
                    f.flush()
                    child = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
                running[child] = (entry, seed, log, time.perf_counter())
            time.sleep(0.2)
            for child in [c for c in running if c.poll() is not None]:
                entry, seed, log, t0 = running.pop(child)
                say(f"{entry} seed {seed}: rc {child.returncode}, {time.perf_counter() - t0:.1f} s ({log})")
                if child.returncode != 0:
                    failed.append(f"{entry} seed {seed} (log {log})")
    finally:  # interrupted: no run goes on writing the ledger behind our back
        for child in running:
            child.terminate()
            child.wait()
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(pairs)} study runs failed: {'; '.join(failed)}. The evaluations "
                           f"they finished are in the ledger: the same command again continues")


def run_start_child(opts: StudyOptions, say=print) -> None:
    """--jobs: the start policy's evaluations in a process of their own (RUNS/logs/start.log) on the first visible
    card, so that this process never holds a model or a vLLM engine while the runs share the cards. Raises naming
    the log if it failed."""
    logs = Path(opts.runs) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    threads = str(torch.get_num_threads())  # this process's own: the numbers it would have computed itself
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if gpus := child_gpus(base_config(opts).run.device):
        env["CUDA_VISIBLE_DEVICES"] = gpus[0]
    argv, log = child_argv(opts, opts.algos[0], opts.seeds[0]) + ["--start-only"], logs / "start.log"
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(shlex.join(argv) + "\n")
        f.flush()
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    say(f"start policy: rc {rc}, {time.perf_counter() - t0:.1f} s ({log})")
    if rc != 0:
        raise RuntimeError(f"the start policy's evaluation failed (rc {rc}, log {log}); the evaluations it finished "
                           f"are in the ledger: the same command again continues")


def refuse_sleeping_engines_sharing_a_card(opts: StudyOptions, cfg: Config) -> None:
    """--jobs above the cards puts several vLLM engines on a card; vLLM checks each sleep by the card's free memory,
    which another run changes meanwhile ("Memory usage increased after sleeping"), so those runs need
    enable_sleep_mode false. Refused before anything is evaluated."""
    cards = max(1, len(child_gpus(cfg.run.device)))
    engine = (choose_engine(cfg.embedded.rollout_engine, resolve_device(cfg.run.device))
              if cfg.run.backend == "embedded" else None)
    if opts.jobs > cards and engine == "vllm" and sleeps(cfg.embedded.vllm_options):
        n = -(-opts.jobs // cards)
        raise ValueError(f"--jobs {opts.jobs} on {cards} card(s) puts {n} vLLM engines on a card, and vLLM's sleep "
                         f"through each update fails when another run on the card allocates meanwhile: pass --jobs "
                         f"{cards}, or vllm_options={{enable_sleep_mode: false, gpu_memory_utilization: U}} with "
                         f"{n} x U below what the trainers leave free")


def child_argv(opts: StudyOptions, entry: str, seed: int) -> list[str]:
    """The command of one (entry, seed) of a --jobs study: the same settings, that run only, no report. Every
    --entry and --extend goes along (the ledger's settings hold them all), but only `entry` is in its grid."""
    argv = [sys.executable, "-m", "bapo_vl.study", "--algos", entry, "--seeds", str(seed), "--jobs", "1",
            "--no-report", "--budget", str(opts.budget), "--checkpoints", str(opts.checkpoints),
            "--spacing", opts.spacing, "--k", str(opts.k), "--final-k", str(opts.final_k),
            "--hard-k", str(opts.hard_k), "--split", opts.split, "--runs", opts.runs,
            "--eval-seed", str(opts.eval_seed)]
    for flag, value in (("--source", opts.source), ("--limit", opts.limit), ("--preset", opts.preset),
                        ("--eval-batch-size", opts.eval_batch_size)):
        argv += [flag, str(value)] if value is not None else []
    for name, overrides in opts.entries.items():
        argv += ["--entry", f"{name}={shlex.join(overrides)}"]
    for name, factor in opts.extend.items():
        argv += ["--extend", f"{name}={factor!r}"]
    return argv + (["--keep-checkpoints"] if opts.keep_checkpoints else []) + opts.overrides


def child_gpus(setting: str) -> list[str]:
    """The GPUs --jobs children take turns on (CUDA_VISIBLE_DEVICES values): every visible one when the runs use
    CUDA and there are several; none (children see what this process sees) otherwise."""
    if setting == "cpu" or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return []
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[:torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]


# ----------------------------------------------------------------------------- the report's statistics

RESAMPLES = 10_000  # hierarchical bootstrap resamples of every interval and test at the budget
BAND_RESAMPLES = 2_000  # per checkpoint, for the plots' bands
RATIO_RESAMPLES = 2_000  # seed resamples of a rollouts-to-target ratio
METRICS = ("mean@k", "greedy")  # the two measures tested at the budget


def entry_rows(result: dict, entry: str, budget: int) -> list[dict]:
    """An entry's rows at `budget`, by seed."""
    return sorted((r for r in result["runs"] if r["entry"] == entry and r["budget"] == budget),
                  key=lambda r: r["seed"])


def final_rows(result: dict, entry: str) -> list[dict]:
    """An entry's rows at the common budget, by seed."""
    return entry_rows(result, entry, result["settings"]["budget"])


def accuracy(rows: list[dict], uids: list[str], metric: str = "mean@k") -> np.ndarray:
    """(rows, prompts) per-prompt accuracy: correct / k of the sampled answers, or 0/1 of the greedy one."""
    if metric == "greedy":
        return np.array([[r["greedy_counts"][u] for u in uids] for r in rows], dtype=float)
    return np.array([[r["counts"][u] / r["k"] for u in uids] for r in rows], dtype=float)


def paired(result: dict, a: str, b: str, budget: int | None = None) -> tuple[list[dict], list[dict]]:
    """The rows of a and b at `budget` (default the common one) for the seeds both ran, in the same order (row s of
    each from seed s)."""
    budget = result["settings"]["budget"] if budget is None else budget
    rows_a, rows_b = ({r["seed"]: r for r in entry_rows(result, e, budget)} for e in (a, b))
    seeds = sorted(rows_a.keys() & rows_b.keys())
    return [rows_a[s] for s in seeds], [rows_b[s] for s in seeds]


def start_for(result: dict, rows: list[dict]) -> dict:
    """The start policy's evaluation sampled as `rows` were (the same k and sampling seed: start at a checkpoint,
    start_final at a final budget), which they are paired with by prompt."""
    sampled = {(r["k"], r["sample_seed"]) for r in rows}
    if not rows:
        raise ValueError("no evaluations to pair with the start policy's")
    if len(sampled) != 1:
        raise ValueError(f"rows evaluated with different k and sampling seeds: {sorted(sampled)}")
    found = [result[name] for name in (START_FINAL, START, START_HARD)
             if name in result and (result[name]["k"], result[name]["sample_seed"]) in sampled]
    if not found:
        raise ValueError(f"no evaluation of the start policy with (k, sampling seed) {sampled.pop()}")
    return found[0]


def versus(result: dict, a: str, b: str, metric: str, resamples: int = RESAMPLES, budget: int | None = None) -> dict:
    """a - b at `budget` (default the common one), paired by seed and prompt: the hierarchical bootstrap's
    difference, interval and p."""
    rows_a, rows_b = paired(result, a, b, budget)
    uids = sorted(start_for(result, rows_a + rows_b)["counts"])
    return hierarchical_bootstrap_diff(accuracy(rows_a, uids, metric), accuracy(rows_b, uids, metric), resamples)


def gain(result: dict, entry: str, metric: str, resamples: int = RESAMPLES, budget: int | None = None,
         uids: list[str] | None = None) -> dict:
    """entry - the start at `budget` (default the common one), paired by prompt: the start policy is one policy, so
    it is the same row for every seed. `uids`: those prompts only (default all)."""
    rows = entry_rows(result, entry, result["settings"]["budget"] if budget is None else budget)
    start = start_for(result, rows)
    uids = sorted(start["counts"]) if uids is None else uids
    start = accuracy([start], uids, metric)
    return hierarchical_bootstrap_diff(accuracy(rows, uids, metric), np.repeat(start, len(rows), axis=0), resamples)


def gains_by_seed(result: dict, opts: StudyOptions, entries: list[str], resamples: int = RESAMPLES) -> list[dict]:
    """Each run's gain over the start at the budget (and an extended entry's at its last checkpoint), paired by
    prompt, its interval from resampling that run's prompts alone; then the entry's over seeds and prompts (seed
    "all"). A target "in every seed" is judged on these: one seed's interval is the measurement's spread."""
    out = []
    for entry in entries:
        for budget in dict.fromkeys([opts.budget, *([opts.entry_budgets(entry)[-1]] if entry in opts.extend else [])]):
            rows = entry_rows(result, entry, budget)
            if not rows:
                continue
            first = start_for(result, rows)
            uids = sorted(first["counts"])
            start = {m: accuracy([first], uids, m) for m in METRICS}
            out += [{"entry": entry, "budget": budget, "seed": r["seed"], "rollouts": r["rollouts"],
                     **{m: hierarchical_bootstrap_diff(accuracy([r], uids, m), start[m], resamples) for m in METRICS}}
                    for r in rows]
            out.append({"entry": entry, "budget": budget, "seed": "all",
                        "rollouts": float(np.mean([r["rollouts"] for r in rows])),
                        **{m: gain(result, entry, m, resamples, budget) for m in METRICS}})
    return out


def curves(result: dict, entry: str, upto: int | None = None) -> dict[int, list[tuple[float, float]]]:
    """seed -> [(rollouts, mean@k at k)], from the start (0 rollouts) through the entry's checkpoints (up to
    budget `upto`): one measure along the whole curve."""
    start = (0.0, result["start"]["mean@k"])
    by_seed: dict[int, list] = {}
    for r in sorted(result["runs"], key=lambda r: r["budget"]):
        if r["entry"] == entry and (upto is None or r["budget"] <= upto):
            by_seed.setdefault(r["seed"], [start]).append((float(r["rollouts"]), curve_point(r)["mean@k"]))
    return by_seed


def rollouts_ratio(result: dict, a: str, b: str, resamples: int = RATIO_RESAMPLES) -> dict:
    """How many rollouts a needs to reach b's final mean@k (b at the common budget), as a fraction of b's rollouts:
    a's curve runs through all its checkpoints, extended ones too."""
    a_curves, b_curves = curves(result, a), curves(result, b, upto=result["settings"]["budget"])
    seeds = sorted(a_curves.keys() & b_curves.keys())
    out = rollouts_ratio_bootstrap({s: a_curves[s] for s in seeds}, {s: b_curves[s] for s in seeds}, resamples)
    # a's reach, as a multiple of b's rollouts: an unreached target says only "more than this"
    reach = float(np.mean([a_curves[s][-1][0] for s in seeds]) / np.mean([b_curves[s][-1][0] for s in seeds]))
    return {"entry": a, "reference": b, **out, "reach": reach}


def at_optimizer_steps(rows: list[dict], steps: float, uids: list[str]) -> np.ndarray | None:
    """(prompts,) accuracy at k of one run after `steps` optimizer steps, interpolated per prompt in log optimizer
    steps between the two checkpoints that bracket it (`rows`: the run's checkpoint rows); None outside them."""
    points = sorted(((r["optimizer_steps"], accuracy([curve_point(r)], uids)[0]) for r in rows), key=lambda p: p[0])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= steps <= x1 and x0 > 0:
            w = 0.0 if x1 == x0 else (math.log(steps) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return (1 - w) * y0 + w * y1
    exact = [y for x, y in points if x == steps]
    return exact[0] if exact else None


def versus_at_updates(result: dict, a: str, b: str, resamples: int = RESAMPLES) -> dict | None:
    """a - b at equal optimizer steps: a's mean@k at the budget against b's curve at as many optimizer steps as a
    made (same seed; b interpolated per prompt between its checkpoints), paired by seed and prompt. Seeds where b's
    checkpoints do not reach a's count are left out; None when none is left."""
    uids = sorted(result["start_final"]["counts"])
    finals = {r["seed"]: r for r in final_rows(result, a)}
    diffs_a, diffs_b, steps = [], [], []
    for seed, row in sorted(finals.items()):
        b_rows = [r for r in result["runs"] if r["entry"] == b and r["seed"] == seed]
        interpolated = at_optimizer_steps(b_rows, row["optimizer_steps"], uids)
        if interpolated is not None:
            diffs_a.append(accuracy([curve_point(row)], uids)[0])
            diffs_b.append(interpolated)
            steps.append(row["optimizer_steps"])
    if not steps:
        return None
    return {**hierarchical_bootstrap_diff(np.array(diffs_a), np.array(diffs_b), resamples),
            "optimizer_steps": float(np.mean(steps))}


def bins_of(result: dict) -> tuple[list[str], list[list[str]]]:
    """The coarse bins of the start policy's final_k evaluation and the prompts in each."""
    start, k = result["start_final"]["counts"], result["start_final"]["k"]
    members = [sorted(u for u, c in start.items() if lo <= c < hi) for lo, hi in coarse_edges(k)]
    return COARSE_BINS, members


def held_out_groups(opts: StudyOptions) -> dict[str, str]:
    """uid -> the held-out problem's meta[opts.by], the problems loaded as the evaluations load them (task, splits,
    source, template, limit); one ValueError line naming the field where no problem has it."""
    run = base_config(opts).run
    task = get_task(run.task, list(run.tasks_dirs))
    options = {k: v for k, v in (("source", opts.source), ("template", run.task_options.get("template")))
               if v is not None}
    problems = [p for ps in load_sets(task, opts.split.split(","), options, opts.limit).values() for p in ps]
    if not any(opts.by in p.meta for p in problems):
        keys = sorted({k for p in problems for k in p.meta})
        raise ValueError(f"--by {opts.by}: no held-out problem of task {run.task} has that meta field (theirs: "
                         f"{', '.join(keys) or 'none'})")
    return {p.uid: str(p.meta.get(opts.by, "(none)")) for p in problems}


def by_group(result: dict, present: list[str], groups: dict[str, str], resamples: int) -> list[dict]:
    """Per value of the grouping field: its prompts' count, the start's greedy and mean@k on them, and each entry's
    gain over the start on them (paired by prompt, as gain())."""
    sf, uids = result["start_final"], sorted(result["start_final"]["counts"])
    out = []
    for value in sorted({groups[u] for u in uids if u in groups}):
        members = [u for u in uids if groups.get(u) == value]
        out.append({"value": value, "n": len(members),
                    "start": {m: float(accuracy([sf], members, m).mean()) for m in METRICS},
                    "gain": {e: {m: gain(result, e, m, resamples, uids=members) for m in METRICS} for e in present}})
    return out


def analyse(result: dict, opts: StudyOptions, resamples: int = RESAMPLES, groups: dict[str, str] | None = None) -> dict:
    """Every number the report states beyond the ledger's: intervals, paired tests with Holm's correction, gains
    over the start policy (also by `groups`, uid -> value of the --by field), rollouts-to-target ratios, the
    differences by start bin, the curves' bands and the targets. Deterministic (fixed bootstrap seeds)."""
    uids = sorted(result["start_final"]["counts"])
    present = [e for e in opts.algos if final_rows(result, e)]
    sf = result["start_final"]

    def summary(rows):
        return {"seeds": [r["seed"] for r in rows],
                **{m: hierarchical_bootstrap_mean(accuracy(rows, uids, m), resamples) for m in METRICS},
                **{m: mean_sd([r[m] for r in rows]) for m in ("pass@k", "unlocked", "rollouts", "optimizer_steps",
                                                              "step", "train_seconds")}}

    out = {"resamples": resamples, "final": {e: summary(final_rows(result, e)) for e in present},
           "start": {**{m: hierarchical_bootstrap_mean(accuracy([sf], uids, m), resamples) for m in METRICS},
                     "pass@k": sf["pass@k"], "unlocked": sf["unlocked"]}}
    out["versus"] = {}
    if opts.baseline in present:
        for m in METRICS:  # one family per measure: every entry against the baseline
            tests = {e: versus(result, e, opts.baseline, m, resamples) for e in present if e != opts.baseline}
            corrected = holm({e: t["p"] for e, t in tests.items()}) if tests else {}
            for e, t in tests.items():
                out["versus"].setdefault(e, {})[m] = {**t, "p_holm": corrected[e]["p_holm"],
                                                      "reject": corrected[e]["reject"], "family": len(tests)}
    out["gain"] = {e: {m: gain(result, e, m, resamples) for m in METRICS} for e in present}
    out["gain_by_seed"] = gains_by_seed(result, opts, present, resamples)
    if groups:
        out["by"] = {"field": opts.by, "groups": by_group(result, present, groups, resamples)}
    pairs = [(e, opts.baseline) for e in present if e != opts.baseline and opts.baseline in present]
    pairs += [(a, b) for a, b in [("bapo", "grpo"), *((e, "bapo") for e in opts.extend), ("dapo", "bapo")]
              if a != b and {a, b} <= set(present) and (a, b) not in pairs]
    out["ratios"] = [rollouts_ratio(result, a, b) for a, b in dict.fromkeys(pairs)]
    out["at_updates"] = {e: versus_at_updates(result, e, opts.baseline, resamples) for e in present
                         if e != opts.baseline and opts.baseline in present}
    labels, members = bins_of(result)
    out["bins"] = {"labels": labels, "sizes": [len(m) for m in members], "versus": {}}
    if opts.baseline in present:
        for e in [e for e in present if e != opts.baseline]:
            rows_a, rows_b = paired(result, e, opts.baseline)
            out["bins"]["versus"][e] = [hierarchical_bootstrap_diff(accuracy(rows_a, m), accuracy(rows_b, m),
                                                                    resamples) if m else None for m in members]
    out["curves"] = {e: curve_bands(result, opts, e, uids) for e in present}
    out["targets"] = targets(result, opts, out)
    return out


def curve_bands(result: dict, opts: StudyOptions, entry: str, uids: list[str]) -> list[dict]:
    """The entry's curve at k, the start first: per checkpoint the mean over seeds of rollouts and optimizer steps,
    and mean@k and greedy with hierarchical bootstrap intervals (BAND_RESAMPLES), pass@k and unlocked ± sd."""
    points = [[result["start"]]] + [entry_rows(result, entry, b) for b in opts.entry_budgets(entry)]
    out = []
    for budget, rows in zip([0, *opts.entry_budgets(entry)], points):
        if not rows:
            continue
        at_k = [curve_point(r) | {"greedy_counts": r["greedy_counts"]} for r in rows]
        out.append({"budget": budget, "rollouts": float(np.mean([r["rollouts"] for r in rows])),
                    "optimizer_steps": float(np.mean([r["optimizer_steps"] for r in rows])),
                    **{m: hierarchical_bootstrap_mean(accuracy(at_k, uids, m), BAND_RESAMPLES) for m in METRICS},
                    **{m: mean_sd([p[m] for p in at_k]) for m in ("pass@k", "unlocked")}})
    return out


def targets(result: dict, opts: StudyOptions, stats: dict) -> list[dict]:
    """The study's targets, each {"target", "status": met | not met | not decided | not in this grid, "detail"}."""
    fk, have = opts.final_k, set(stats["final"])
    out = []

    def add(target, needs, judge):
        out.append({"target": target, **(judge() if set(needs) <= have else
                                          {"status": "not in this grid", "detail": f"needs {', '.join(needs)}"})})

    def interval(d, key="diff"):
        return f"{d[key]:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"

    def ratio_of(a, b):
        return next(r for r in stats["ratios"] if (r["entry"], r["reference"]) == (a, b))

    def ratio_text(r):
        return (f"{_x(r['ratio'])} [{_x(r['low'])}, {_x(r['high'])}], reached in {r['reached_fraction']:.0%} of "
                f"resamples")

    def grpo_gains():
        start = result["start_final"]
        per_seed = [(r["seed"], r["mean@k"] - start["mean@k"], r["greedy"] - start["greedy"])
                    for r in final_rows(result, "grpo")]
        ok = all(dm >= 0.05 and dg >= 0 for _, dm, dg in per_seed)
        seeds = "; ".join(f"seed {s}: {dm:+.3f} / {dg:+.3f}" for s, dm, dg in per_seed)
        g = stats["gain"]["grpo"]
        return {"status": "met" if ok else "not met",
                "detail": f"Δ mean@{fk} {interval(g['mean@k'])}, Δ greedy {interval(g['greedy'])}; "
                          f"per seed (Δ mean@{fk} / Δ greedy): {seeds}"}

    def bapo_beats_grpo():
        d = stats["versus"].get("bapo", {}).get("mean@k") if opts.baseline == "grpo" else None
        d = d or versus(result, "bapo", "grpo", "mean@k", stats["resamples"])
        return {"status": "met" if d["diff"] >= 0.02 and d["low"] > 0 else "not met",
                "detail": f"Δ mean@{fk} {interval(d)}"}

    def unimproved(r):  # a target the start policy may already reach says nothing about speed
        if r["ratio"] == 0:
            return {"status": "not decided", "detail": f"{r['reference']}'s final mean@{opts.k} is not above the "
                                                       f"start policy's, which reaches it at 0 rollouts"}
        if r["low"] == 0:
            return {"status": "not decided", "detail": ratio_text(r) + f"; {r['reference']}'s final mean@{opts.k} is "
                    "not told apart from the start policy's, which reaches it at 0 rollouts in the interval"}
        return None

    def bapo_faster():
        r = ratio_of("bapo", "grpo")
        if found := unimproved(r):
            return found
        return {"status": "met" if r["ratio"] <= 0.75 and r["high"] < 1 else "not met", "detail": ratio_text(r)}

    def dapo_slower():
        r = ratio_of("dapo", "bapo")
        if found := unimproved(r):
            return found
        if math.isfinite(r["ratio"]):
            status = "met" if r["ratio"] >= 1.5 else "not met"
        else:  # not reached: all that is known is "more than its last checkpoint"
            status = "met" if r["reach"] >= 1.5 else "not decided"
        more = "" if status != "not decided" else (
            f"; DAPO's checkpoints end at {r['reach']:.2f}x BAPO's rollouts without reaching it: "
            "train it on with --extend dapo=2")
        return {"status": status, "detail": ratio_text(r) + more}

    def hard_set_ratio():
        b, g = stats["final"]["bapo"]["unlocked"][0], stats["final"]["grpo"]["unlocked"][0]
        floor = result["start_final"]["unlocked"]
        ratio = lambda x, y: f"{x / y:.2f}x" if y > 0 else "n/a"  # noqa: E731
        # a ratio of two figures under the floor that resampling the start policy reaches is no evidence
        status = ("not met" if not (b >= 1.5 * g and b > 0) else "met" if b > floor else
                  "met on paper, but no evidence: BAPO unlocks less than resampling the start policy does")
        return {"status": status, "detail": f"{b:.3f} vs {g:.3f} ({ratio(b, g)}); above the resampling floor "
                                            f"{floor:.3f}: {b - floor:+.3f} vs {g - floor:+.3f} "
                                            f"({ratio(b - floor, g - floor)})"}

    add(f"GRPO raises mean@{fk} by >= 0.05 over the start policy, greedy not lower, in every seed", ["grpo"],
        grpo_gains)
    add(f"BAPO - GRPO mean@{fk} >= +0.02, the interval above 0", ["bapo", "grpo"], bapo_beats_grpo)
    add(f"BAPO reaches GRPO's final mean@{opts.k} with <= 0.75x GRPO's rollouts (the interval's upper end below 1)",
        ["bapo", "grpo"], bapo_faster)
    add(f"DAPO needs >= 1.5x BAPO's rollouts to reach BAPO's final mean@{opts.k}", ["dapo", "bapo"], dapo_slower)
    add("BAPO's hard set unlocked >= 1.5x GRPO's, above the resampling floor", ["bapo", "grpo"], hard_set_ratio)
    return out


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "∞"


def _ms(xs: list[float], fmt: str = "{:.3f}") -> str:
    m, sd = mean_sd(xs)
    return f"{fmt.format(m)} ± {fmt.replace('+', '').format(sd)}" if len(xs) > 1 else fmt.format(m)


def _ci(d: dict, key: str = "mean", fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(d[key])} [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"


def _p(p: float) -> str:
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


# ----------------------------------------------------------------------------- the report


def report(result: dict, opts: StudyOptions, machine: dict, stats: dict, plots: bool = True) -> str:
    s, k, fk = result["settings"], opts.k, opts.final_k
    n, hard, floor = result["start_final"]["n"], result["hard_set"], result["start_final"]["unlocked"]
    extended = "; ".join(f"{e} trained on to {opts.entry_budgets(e)[-1]:,} (checkpoints "
                         f"{', '.join(f'{b:,}' for b in opts.entry_budgets(e)[len(opts.budgets):])})"
                         for e in opts.extend)
    lines = [f"# Study: {', '.join(opts.algos)} on {s['config']['task']} with {s['config']['model']}", "",
             "```", opts.command, "```", "",
             f"- trained and evaluated on {machine['device']}; report written {machine['date']} with torch "
             f"{machine['torch']}, commit {machine['commit']}",
             f"- budget {opts.budget:,} rollouts per run (fresh + re-evaluation), evaluated at "
             f"{', '.join(f'{b:,}' for b in opts.budgets)} ({opts.spacing} spacing)"
             + (f"; {extended}" if extended else "") + f"; seeds {', '.join(map(str, opts.seeds))}",
             f"- held-out: split `{opts.split}`{f' of {opts.source}' if opts.source else ''}, {n} prompts, one "
             f"greedy answer each and k samples at temperature 1: k = {k} at every checkpoint (sampling seed "
             f"{opts.checkpoint_seed}), k = {fk} at the final budget (seed {opts.final_seed}); every method and the "
             "start policy with the same seeds, so the rows are paired by prompt and sampling seed",
             f"- hard set: {hard} prompts ({hard / max(n, 1):.1%}) that the start policy got 0/{opts.hard_k} right "
             f"in samples of their own (seed {opts.hard_seed}); unlocked = the fraction of them solved >= 1/{fk} at "
             f"the budget. The start policy's own final evaluation unlocks {floor:.3f}: the floor from sampling alone",
             f"- intervals: 95 %, hierarchical bootstrap over training seeds and then prompts within each "
             f"({stats['resamples']:,} resamples); differences paired by seed and prompt",
             *restarted_runs(result), *codes_of_runs(result),
             "", f"## At the budget ({opts.budget:,} rollouts)", "",
             f"| | mean@{fk} [95 % interval] | greedy [95 % interval] | pass@{fk} | hard set unlocked | rollouts | "
             "optimizer steps | steps | train s |", "| --- " * 9 + "|"]
    st = stats["start"]
    lines.append(f"| start policy | {_ci(st['mean@k'])} | {_ci(st['greedy'])} | {st['pass@k']:.3f} | "
                 f"{st['unlocked']:.3f} (floor) | – | – | – | – |")
    for entry, f in stats["final"].items():
        cells = [_ci(f["mean@k"]), _ci(f["greedy"]), _ms([r["pass@k"] for r in final_rows(result, entry)]),
                 *(_ms([r[m] for r in final_rows(result, entry)], fmt) for m, fmt in (
                     ("unlocked", "{:.3f}"), ("rollouts", "{:,.0f}"), ("optimizer_steps", "{:,.0f}"),
                     ("step", "{:.0f}"), ("train_seconds", "{:.1f}")))]
        lines.append(f"| {entry} | " + " | ".join(cells) + " |")
    lines += ["", "pass@k, hard set unlocked, rollouts, steps: mean ± sd over seeds. Steps: training steps taken to "
              "spend the budget; optimizer steps: the updates they made (mini-batches x epochs). Equal rollouts are "
              "not equal updates: DAPO's dynamic sampling and BAPO's re-evaluations spend rollouts without one. "
              "Train s: the steps' recorded generate + score + train + sync seconds (no model loading, checkpoints or "
              "evaluations); compare them only between runs on the same device."]
    lines += (comparison(stats, opts) + gains(stats, opts) + seed_gains(stats, opts) + gains_by(stats, opts)
              + ratio_table(stats, opts) + updates_table(stats, opts))
    lines += spending_table(result, opts)
    lines += targets_section(stats)
    lines += checkpoint_table(result, opts) + budget_check(result, opts) + bin_table(result, opts)
    lines += bin_versus_table(stats, opts) + migration_tables(result, opts)
    lines += ["", "Figures: `accuracy.png` (mean@k, greedy and pass@k at k against rollouts, log axis, the start "
              f"policy drawn left of the first checkpoint; bands: 95 % hierarchical bootstrap intervals, "
              f"{BAND_RESAMPLES:,} resamples per checkpoint, for mean@k and greedy, ± sd over seeds for pass@k), "
              "`updates.png` (mean@k against optimizer steps, the same bands), `unlocked.png` (hard set unlocked "
              "against rollouts, with the resampling floor), `forest.png` (the paired differences against "
              f"{opts.baseline} with their intervals, overall and by the start policy's bin)."
              if plots else "No figures: matplotlib was missing.",
              "Numbers: `results.json`; every evaluation, with per-prompt counts: the ledger `study.jsonl`.", ""]
    return "\n".join(lines)


def comparison(stats: dict, opts: StudyOptions) -> list[str]:
    if not stats["versus"]:
        return []
    fk = opts.final_k
    m = next(iter(stats["versus"].values()))["mean@k"]["family"]
    out = ["", f"## Against {opts.baseline}: paired differences at the budget", "",
           f"Each entry minus {opts.baseline}, paired by seed and prompt (hierarchical bootstrap, two-sided p). Holm's "
           f"correction over the {m} comparison{'s' * (m > 1)} of each measure (family-wise error 0.05); "
           "\"differs\": the corrected test rejects no difference.", "",
           f"| | Δ mean@{fk} [95 % interval] | p | p (Holm) | differs | Δ greedy [95 % interval] | p | p (Holm) | "
           "differs |", "| --- " * 9 + "|"]
    for entry, tests in stats["versus"].items():
        cells = [c for t in (tests["mean@k"], tests["greedy"]) for c in (
            _ci(t, "diff", "{:+.3f}"), _p(t["p"]), _p(t["p_holm"]), "yes" if t["reject"] else "no")]
        out.append(f"| {entry} | " + " | ".join(cells) + " |")
    return out


def gains(stats: dict, opts: StudyOptions) -> list[str]:
    fk = opts.final_k
    out = ["", "## Gain over the start policy at the budget", "",
           "Each entry minus the start policy's final evaluation, paired by prompt (the start policy is the same row "
           "for every seed).", "", f"| | Δ mean@{fk} [95 % interval] | Δ greedy [95 % interval] |",
           "| --- " * 3 + "|"]
    out += [f"| {e} | {_ci(g['mean@k'], 'diff', '{:+.3f}')} | {_ci(g['greedy'], 'diff', '{:+.3f}')} |"
            for e, g in stats["gain"].items()]
    return out


def seed_gains(stats: dict, opts: StudyOptions) -> list[str]:
    fk = opts.final_k
    out = ["", "## Gain over the start policy by seed", "",
           "Each run's final evaluation minus the start policy's, paired by prompt (an extended entry's also at its "
           "last checkpoint). A seed's interval resamples its prompts alone: how far the measurement on these "
           "prompts could move that run's gain; `all`: over seeds and prompts, as above.", "",
           f"| | budget | seed | Δ mean@{fk} [95 % interval] | Δ greedy [95 % interval] |", "| --- " * 5 + "|"]
    out += [f"| {g['entry']} | {g['budget']:,} | {g['seed']} | {_ci(g['mean@k'], 'diff', '{:+.3f}')} | "
            f"{_ci(g['greedy'], 'diff', '{:+.3f}')} |" for g in stats["gain_by_seed"]]
    return out


def gains_by(stats: dict, opts: StudyOptions) -> list[str]:
    if "by" not in stats:
        return []
    fk, field, rows = opts.final_k, stats["by"]["field"], stats["by"]["groups"]
    entries = list(rows[0]["gain"]) if rows else []
    out = ["", f"## Gain over the start policy by {field}", "",
           f"The held-out prompts grouped by their problem's `{field}`; each entry minus the start policy's final "
           "evaluation on that group's prompts only, paired by prompt (95 % intervals, as above).", "",
           f"| {field} | prompts | start greedy | start mean@{fk} | "
           + " | ".join(f"{e}: Δ greedy | {e}: Δ mean@{fk}" for e in entries) + " |",
           "| --- " * (4 + 2 * len(entries)) + "|"]
    for g in rows:
        cells = [c for e in entries for c in (_ci(g["gain"][e]["greedy"], "diff", "{:+.3f}"),
                                              _ci(g["gain"][e]["mean@k"], "diff", "{:+.3f}"))]
        out.append(f"| {g['value']} | {g['n']:,} | {g['start']['greedy']:.3f} | {g['start']['mean@k']:.3f} | "
                   + " | ".join(cells) + " |")
    return out


def ratio_table(stats: dict, opts: StudyOptions) -> list[str]:
    if not stats["ratios"]:
        return []
    out = ["", f"## Rollouts to reach another entry's final mean@{opts.k}", "",
           f"The rollouts an entry needs to reach the reference's mean@{opts.k} at the budget, as a multiple of the "
           f"reference's rollouts: both curves at k = {opts.k} from the start policy (0 rollouts) through every "
           "checkpoint (an extended entry's too), interpolated in log rollouts between checkpoints. Interval: "
           f"{RATIO_RESAMPLES:,} resamples of the seeds, paired (the curves are already means over prompts); ∞: not "
           "reached within the entry's checkpoints; 0x: the start policy already reaches it (the reference did not "
           "improve on the start).", "",
           "| entry | reference | rollouts ratio [95 % interval] | reached in | entry's last checkpoint |",
           "| --- " * 5 + "|"]
    out += [f"| {r['entry']} | {r['reference']} | {_x(r['ratio'])} [{_x(r['low'])}, {_x(r['high'])}] | "
            f"{r['reached_fraction']:.0%} of resamples | {r['reach']:.2f}x |" for r in stats["ratios"]]
    return out


def updates_table(stats: dict, opts: StudyOptions) -> list[str]:
    rows = {e: d for e, d in stats.get("at_updates", {}).items() if d is not None}
    if not rows:
        return []
    out = ["", f"## Against {opts.baseline} at equal optimizer steps", "",
           f"Each entry's mean@{opts.k} at the budget minus {opts.baseline}'s after as many optimizer steps (same "
           f"seed; {opts.baseline}'s per-prompt accuracy interpolated in log optimizer steps between its checkpoints), "
           "paired by seed and prompt (hierarchical bootstrap): whether an entry gets more from each update, apart "
           "from how many updates its rollouts buy. Seeds whose entry made more updates than the reference's last "
           "checkpoint are left out.", "",
           f"| | optimizer steps | Δ mean@{opts.k} [95 % interval] | seeds |", "| --- " * 4 + "|"]
    out += [f"| {e} | {d['optimizer_steps']:.0f} | {_ci(d, 'diff', '{:+.3f}')} | {d['n_seeds']} |"
            for e, d in rows.items()]
    return out


def targets_section(stats: dict) -> list[str]:
    return ["", "## Targets", "", *(f"- {t['target']}: **{t['status']}** ({t['detail']})" for t in stats["targets"])]


def checkpoint_table(result, opts) -> list[str]:
    """mean@k and unlocked at every checkpoint, all at k (a final row's curve point)."""
    k = opts.k
    budgets = sorted({b for e in opts.algos for b in opts.entry_budgets(e)})
    out = ["", f"## mean@{k} and hard set unlocked at each rollout checkpoint (k = {k})", "",
           "| | " + " | ".join(f"{b:,}" for b in budgets) + " |", "| --- " * (len(budgets) + 1) + "|"]
    for entry in opts.algos:
        cells = []
        for b in budgets:
            rows = [curve_point(r) for r in entry_rows(result, entry, b)]
            cells.append(f"{_ms([r['mean@k'] for r in rows])} / {_ms([r['unlocked'] for r in rows])}" if rows
                         else "–")
        out.append(f"| {entry} | " + " | ".join(cells) + " |")
    return out


def spending_table(result: dict, opts: StudyOptions) -> list[str]:
    """Where each entry's rollouts went by the budget (mean over seeds), from the rows' `spent` (ledgers written
    before it was recorded have none: no table)."""
    entries = {e: [r.get("spent") for r in final_rows(result, e)] for e in opts.algos}
    if not all(rows and all(rows) for rows in entries.values()):
        return []
    out = ["", f"## Where the rollouts went ({opts.budget:,} rollouts)", "",
           "Rollouts by what they were spent on, and the groups in the updates' batches by source, summed over each "
           "run's steps (mean over seeds; a group whose rewards are all equal has advantage 0 and moves nothing, but "
           "counts where an entry keeps it, as GRPO does). A re-evaluation spends rollouts on once-failed prompts and "
           "yields an X2 group only where the current policy now partly solves one.",
           "", "| | fresh rollouts | re-evaluation rollouts | trained groups X1 / X2 / X3 | "
           "rollouts per trained group |", "| --- " * 5 + "|"]
    for e, rows in entries.items():
        mean = {k: float(np.mean([r[k] for r in rows])) for k in SPENT}
        groups = mean["x1"] + mean["x2"] + mean["x3"]
        per = f"{(mean['fresh'] + mean['reevaluated']) / groups:.1f}" if groups else "–"
        out.append(f"| {e} | {mean['fresh']:,.0f} | {mean['reevaluated']:,.0f} | "
                   f"{mean['x1']:,.0f} / {mean['x2']:,.0f} / {mean['x3']:,.0f} | {per} |")
    return out


def run_of(run_dir) -> dict:
    """What a ledger row keeps of the run it came from: the record's created_at (which run) and the code's commit
    (which code; "" where it was not known)."""
    meta = read_meta(run_dir)
    return {"run": meta["created_at"], "commit": meta.get("commit", "")}


def codes_of_runs(result) -> list[str]:
    """A line when the runs' rows were trained by more than one version of the code (the commit in each row; rows
    from before rows kept it count as "not recorded"): a study continued after an upgrade mixes them."""
    budgets: dict[str, set[int]] = {}
    for r in result["runs"]:
        budgets.setdefault(r.get("commit") or "not recorded", set()).add(r["budget"])
    if len(budgets) < 2:
        return []
    return ["- the runs were trained by more than one version of the code: "
            + "; ".join(f"commit {c} at {', '.join(f'{b:,}' for b in sorted(bs))}" for c, bs in budgets.items())]


def restarted_runs(result) -> list[str]:
    """A line for each (entry, seed) whose rows came from more than one run (its run record's created_at, kept in
    every ledger row): a study continued where a run's checkpoints were gone trains a new run of the same settings
    and seed from the start policy, and on a GPU two such runs are not the same trajectory. Rows of a ledger written
    before rows named their run count as one earlier run."""
    runs: dict[tuple, dict[str, list[int]]] = {}
    for r in result["runs"]:
        runs.setdefault((r["entry"], r["seed"]), {}).setdefault(r.get("run", ""), []).append(r["budget"])
    return [f"- {entry} seed {seed}: its rows come from {len(by_run)} runs of the same settings and seed, each "
            "trained from the start policy (a later one where the earlier one's checkpoints were gone): "
            + "; ".join(f"run {i} at {', '.join(f'{b:,}' for b in sorted(budgets))}"
                        for i, (_, budgets) in enumerate(sorted(by_run.items()), 1))
            + ". Each row is a policy trained to its budget; the curve through them is not one run's"
            for (entry, seed), by_run in runs.items() if len(by_run) > 1]


def budget_check(result, opts) -> list[str]:
    final = [r for r in result["runs"] if r["budget"] == opts.budget]
    spent = [r["rollouts"] for r in final]
    return ["", f"Every run stops after the first step whose rollouts reach the budget: final counts "
            f"{min(spent):,}..{max(spent):,} for a budget of {opts.budget:,} (overshoot under one step: "
            f"at most {max(spent) - opts.budget:,})."]


def bin_table(result, opts) -> list[str]:
    """Mean accuracy change by start bin, per entry (mean ± sd over seeds), with the start policy resampled as the
    floor (when hard_k = final_k: start_hard against start_final): prompts at 0/k can only rise and at k/k only fall
    by resampling alone."""
    labels, start_bins = coarse(result["start_final"]["migration"])
    sizes = [int(sum(row)) for row in start_bins]
    fk = opts.final_k
    out = ["", f"## Where accuracy moved: mean change of correct/{fk} by the start policy's bin (end - start)", "",
           "| | " + " | ".join(f"{b} ({n} prompts)" for b, n in zip(labels, sizes)) + " |", "| --- " * 5 + "|"]

    def cells(rows):
        per_bin = list(zip(*[bin_changes(r["migration"]) for r in rows]))
        return [_ms(list(xs), "{:+.3f}") if xs and None not in xs else "–" for xs in per_bin]

    hard = result.get("start_hard")
    if hard is not None and hard["k"] == fk:
        resampled = migration(result["start_final"]["counts"], hard["counts"], fk)
        out.append("| start policy, resampled | " + " | ".join(cells([{"migration": resampled}])) + " |")
    out += [f"| {entry} | " + " | ".join(cells(final_rows(result, entry))) + " |" for entry in opts.algos]
    return out


def bin_versus_table(stats: dict, opts: StudyOptions) -> list[str]:
    if not stats["bins"]["versus"]:
        return []
    b = stats["bins"]
    out = ["", f"## Against {opts.baseline} by the start policy's bin (Δ mean@{opts.final_k}, paired, the prompts of "
           "that bin only)", "",
           "| | " + " | ".join(f"{label} ({n} prompts)" for label, n in zip(b["labels"], b["sizes"])) + " |",
           "| --- " * (len(b["labels"]) + 1) + "|"]
    out += [f"| {e} | " + " | ".join(_ci(d, "diff", "{:+.3f}") if d else "–" for d in per_bin) + " |"
            for e, per_bin in b["versus"].items()]
    return out


def migration_tables(result, opts) -> list[str]:
    out = ["", f"## Migration of the held-out prompts, start -> end (bins of correct/{opts.final_k}; summed over "
           "seeds)", ""]
    for entry in opts.algos:
        total = np.sum([r["migration"] for r in final_rows(result, entry)], axis=0).tolist()
        labels, m = coarse(total)
        out += [f"{entry}:", "", "| start \\ end | " + " | ".join(labels) + " |", "| --- " * 5 + "|"]
        out += [f"| {label} | " + " | ".join(map(str, row)) + " |" for label, row in zip(labels, m)] + [""]
    return out


def plot(result: dict, opts: StudyOptions, out: Path, stats: dict) -> list[Path]:
    """accuracy.png (mean@k, greedy, pass@k at k against rollouts), updates.png (mean@k against optimizer steps),
    unlocked.png and forest.png. Curves: one line per entry on a log axis, the start policy drawn a factor 4 left of
    the first checkpoint (a log axis has no 0) and marked "start"."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the study's plots need matplotlib: pip install 'bapo-vl[study]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    def curves_on(ax, metric, title, x="rollouts", floor=None):
        positive = [p[x] for c in stats["curves"].values() for p in c[1:] if p[x] > 0]
        if not positive:
            ax.set(title=f"{title}: no {x.replace('_', ' ')} recorded")
            return
        x0 = min(positive) / 4
        for entry, full in stats["curves"].items():
            c = [full[0], *(p for p in full[1:] if p[x] > 0)]  # a checkpoint before the first update has no place
            xs = [x0, *(p[x] for p in c[1:])]
            if metric in METRICS:
                ms, lo, hi = ([p[metric][key] for p in c] for key in ("mean", "low", "high"))
            else:
                ms, sds = zip(*(p[metric] for p in c))
                lo, hi = np.subtract(ms, sds), np.add(ms, sds)
            line, = ax.plot(xs, ms, marker="o", label=entry)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        start = next(iter(stats["curves"].values()))[0]
        value = start[metric]["mean"] if metric in METRICS else start[metric][0]
        ax.annotate("start", (x0, value), textcoords="offset points", xytext=(4, -12), fontsize=8)
        if floor is not None:
            ax.axhline(floor, color="grey", linestyle="--", label="start policy, final evaluation")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.4g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set(title=title, xlabel=x.replace("_", " "))
        ax.grid(alpha=0.3)

    def save(fig, name):
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)

    paths: list[Path] = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in zip(axes, ["mean@k", "greedy", "pass@k"], [f"mean@{opts.k}", "greedy", f"pass@{opts.k}"]):
        curves_on(ax, metric, title)
    axes[0].legend(fontsize=8)
    save(fig, "accuracy.png")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    curves_on(ax, "mean@k", f"mean@{opts.k} against updates", x="optimizer_steps")
    ax.legend(fontsize=8)
    save(fig, "updates.png")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    curves_on(ax, "unlocked", f"hard set ({result['hard_set']} prompts 0/{opts.hard_k} at start) solved "
                              f">= 1/{opts.k}", floor=result["start"]["unlocked"])
    ax.legend(fontsize=8)
    save(fig, "unlocked.png")
    rows = []  # (label, test) top to bottom
    for entry, tests in stats["versus"].items():
        rows += [(f"{entry}: mean@{opts.final_k}", tests["mean@k"]), (f"{entry}: greedy", tests["greedy"])]
        rows += [(f"{entry}: mean@{opts.final_k}, {label}", d)
                 for label, d in zip(stats["bins"]["labels"], stats["bins"]["versus"][entry]) if d]
    fig, ax = plt.subplots(figsize=(7, 1 + 0.3 * max(len(rows), 1)))
    for i, (label, d) in enumerate(rows):
        y = len(rows) - 1 - i
        ax.errorbar(d["diff"], y, xerr=[[d["diff"] - d["low"]], [d["high"] - d["diff"]]], fmt="o", capsize=3,
                    color="black" if ", " not in label else "grey")
    ax.axvline(0, color="red", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)], fontsize=8)
    ax.set(title=f"paired difference against {opts.baseline} (95 % interval)", xlabel="difference")
    ax.grid(alpha=0.3, axis="x")
    save(fig, "forest.png")
    plt.close("all")
    return paths


def device(setting: str = "auto") -> str:
    """What device=`setting` runs on, in words: the GPU's name, or the CPU."""
    if setting != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def machine(result: dict) -> dict:
    """Where the numbers were made (each ledger row records its device) and where this report was written."""
    rows = [result["start"], result["start_final"], result["start_hard"], *result["runs"]]
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": ", ".join(sorted({r["device"] for r in rows})),
            "torch": torch.__version__, "python": platform.python_version(), "commit": commit() or "unknown"}


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> StudyOptions:
    d = StudyOptions()
    ap = argparse.ArgumentParser(prog="scripts/study.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run, e.g. device=cuda")
    ap.add_argument("--algos", help="grid entries (default: every algorithm and every --entry); knobs: "
                                    + ", ".join(KNOBS))
    ap.add_argument("--knobs", action="store_true", help="add every knob entry: " + ", ".join(KNOBS))
    ap.add_argument("--entry", action="append", default=[], metavar='NAME="key=value ..."',
                    help="a grid entry of one's own with these config overrides (repeatable; with --algos, name it "
                         "there too), e.g. --entry lr1e-5=\"algo=grpo lr=1e-5 kl_coef=0\"")
    ap.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="default %(default)s")
    ap.add_argument("--budget", type=int, default=d.budget, help="rollouts per run (max_rollouts), default %(default)s")
    ap.add_argument("--checkpoints", type=int, default=d.checkpoints,
                    help="evaluations per run up to the budget (default %(default)s)")
    ap.add_argument("--spacing", choices=("log", "linear"), default=d.spacing,
                    help="checkpoints at budget / 2^(n-1), ..., budget (log, the default) or budget * i / n")
    ap.add_argument("--extend", action="append", default=[], metavar="ENTRY=FACTOR",
                    help="train ENTRY on to FACTOR x budget, evaluated on the way (repeatable), e.g. dapo=2")
    ap.add_argument("--k", type=int, default=d.k, help="samples per held-out prompt at every checkpoint "
                                                       "(default %(default)s)")
    ap.add_argument("--final-k", type=int, help="samples per held-out prompt at the final budget (default --k)")
    ap.add_argument("--hard-k", type=int, help="start policy samples that define the hard set (default --final-k)")
    ap.add_argument("--split", default=d.split, help="held-out split, or several joined by commas, evaluated as one "
                                                      "pool of prompts (default %(default)s)")
    ap.add_argument("--source", help="held-out data file (load(source=...))")
    ap.add_argument("--limit", type=int, help="first N held-out prompts of each split")
    ap.add_argument("--preset", help="config preset (default tiny)")
    ap.add_argument("--runs", default=d.runs, help="run directories and the ledger study.jsonl (default %(default)s)")
    ap.add_argument("--out", help="output folder (default docs/study/<model name>)")
    ap.add_argument("--eval-seed", type=int, default=d.eval_seed)
    ap.add_argument("--eval-batch-size", type=int, help="sequences per generate call in evaluations")
    ap.add_argument("--baseline", default=d.baseline, help="the entry compared with (default %(default)s)")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--jobs", type=int, default=d.jobs,
                    help="(entry, seed) runs at once, each its own process (default %(default)s: one after another)")
    ap.add_argument("--no-report", action="store_true",
                    help="train and evaluate into the ledger only (--jobs children)")
    ap.add_argument("--by", metavar="FIELD", help="break the gains over the start down by this meta field of the "
                                                  "held-out problems (e.g. kind)")
    ap.add_argument("--start-only", action="store_true",
                    help="evaluate the start policy into the ledger and stop (what --jobs runs in its own process)")
    a = ap.parse_intermixed_args(argv)  # overrides before and after options alike
    entries = dict(parse_entry(x) for x in a.entry)
    if len(entries) < len(a.entry):
        raise ValueError(f"--entry defines a name twice: {a.entry}")
    algos = ([x.strip() for x in a.algos.split(",") if x.strip()] if a.algos is not None
             else [*ALGORITHMS, *entries])
    return StudyOptions(algos=algos, knobs=a.knobs, seeds=[int(x) for x in a.seeds.split(",") if x.strip()],
                        budget=a.budget, checkpoints=a.checkpoints, spacing=a.spacing, k=a.k, final_k=a.final_k,
                        hard_k=a.hard_k, extend=dict(parse_extend(x) for x in a.extend), entries=entries,
                        split=a.split, source=a.source, limit=a.limit, preset=a.preset, overrides=a.overrides,
                        runs=a.runs, out=a.out, eval_seed=a.eval_seed, eval_batch_size=a.eval_batch_size,
                        baseline=a.baseline, keep_checkpoints=a.keep_checkpoints, jobs=a.jobs,
                        report=not a.no_report, start_only=a.start_only, by=a.by,
                        command="python scripts/study.py " + shlex.join(argv))


def without_counts(result: dict) -> dict:
    """The result without per-prompt counts (the ledger holds them)."""
    def strip(row):
        return {k: strip(v) if k == "curve" else v for k, v in row.items() if k not in ("counts", "greedy_counts")}
    return {k: strip(v) if k.startswith("start") else [strip(r) for r in v] if k == "runs" else v
            for k, v in result.items()}


def plain(x):
    """JSON without Infinity: an unreached target's ratio (inf) is written as null."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    reports = opts.report and not opts.start_only
    groups = held_out_groups(opts) if opts.by and reports else None  # a wrong field fails before any training
    result = run_study(opts, say=lambda line: print(line, file=sys.stderr, flush=True))
    if not reports:
        return 0
    out = Path(opts.out or Path("docs/study") / Path(result["settings"]["config"]["model"]).name)
    out.mkdir(parents=True, exist_ok=True)
    info = machine(result)
    stats = analyse(result, opts, groups=groups)
    (out / "results.json").write_text(json.dumps(plain({"command": opts.command, "machine": info,
                                                        **without_counts(result), "statistics": stats}), indent=1))
    try:
        written = plot(result, opts, out, stats)
    except ImportError as e:  # e.g. a GPU machine without it: the same command elsewhere plots from the ledger
        written = []
        print(f"study: no plots ({e}); the same command where matplotlib is installed makes them from "
              f"{Path(opts.runs) / 'study.jsonl'} without training again", file=sys.stderr)
    (out / "results.md").write_text(report(result, opts, info, stats, plots=bool(written)))
    print("study: " + ", ".join(str(p) for p in [out / "results.md", *written, out / "results.json"]))
    return 0


def cli(argv: list[str] | None = None) -> int:
    """main() on the command line: bad input (a ValueError: a ledger of other settings, an unknown --by field, ...)
    is one line and exit status 2, as `bapo` says it."""
    try:
        return main(argv)
    except ValueError as e:
        print(f"study: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # how --jobs starts its children
    sys.exit(cli())
