"""The algorithm-neutral study (issue 13): algorithms x seeds on one task and model, every run stopped at the same
rollout budget (Config.max_rollouts), every checkpoint judged by the same held-out evaluation (`bapo eval`'s code).

    python scripts/study.py --algos grpo,dapo,bapo --seeds 0,1,2 --budget 30720 --k 16 device=cuda

Hard set. Before training, the start policy answers every prompt of the held-out split k times (temperature 1,
sampling seed `eval_seed`); the prompts it got 0/k right form the hard set H. Every later evaluation samples k
fresh answers (seed eval_seed + 1, the same for every method and checkpoint) and reports

    unlocked = |{p in H : correct(p) >= 1}| / |H|

for every method alike. The start policy evaluated again with that later seed gives the floor that resampling
alone reaches: a prompt solved with probability 1/50 is 0/16 about 72 % of the time, so H holds prompts that fresh
samples solve without any training. Migration: each prompt's bin (correct count 0..k) at the start against its bin
after training (bapo_vl.reader.migration, the run record's rule).

Checkpoints. A run trains in segments: to max_rollouts = budget * i / n, then resumed (resume=RUN, which
reproduces an uninterrupted run: tests/test_crash_resume.py) to the next one, its newest checkpoint evaluated
after each. So an evaluation sees the policy at the first step whose rollouts reach the checkpoint, the same rule
that ends the run. Finished evaluations are kept in RUNS/study.jsonl: the same command run again continues where
it stopped (a machine that allows 10 minutes a command runs it several times). Each is also written into its run's
record at that step (evals "hard_set" and "heldout"), where the dashboard shows it next to the run's own ledger.

Parallel runs. `--jobs N` (N > 1): the start policy is evaluated here, then every (entry, seed) with evaluations
missing runs as its own process (`python -m bapo_vl.study` with the same settings, `--algos ENTRY --seeds SEED
--jobs 1 --no-report`), at most N at once, each appending its rows to the same ledger and its output to
RUNS/logs/ENTRY-sSEED.log; the report is written here from the ledger once all have ended. Children take turns on
the visible GPUs when there are several, and share the CPU cores (OMP_NUM_THREADS = cores // N, at most this
process's torch threads).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from bapo_vl.config import Config, load_config
from bapo_vl.evaluate import EvalOptions, evaluate, load_backend, setup
from bapo_vl.reader import migration as bin_migration
from bapo_vl.record import RunRecord, query_ro
from bapo_vl.train import checkpoint_steps, resume_config, train

# Grid entries: name -> config overrides. The first are the algorithms (config.ALGOS presets) ...
ALGORITHMS = ("grpo", "grpo_v5", "dapo", "bapo", "bapo_no_x2", "bapo_no_x3", "mini_test")
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
START, RESAMPLED = "start", "start_resampled"  # the start policy at eval_seed (defines H) and at eval_seed + 1


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


def within_noise(a: list[float], b: list[float]) -> bool | None:
    """The difference of means is within seed noise: |mean a - mean b| <= 2 standard errors of the difference
    (a rough rule, not a test). None when either side has one seed (no noise estimate).
    >>> within_noise([0.1, 0.2, 0.3], [0.2, 0.3, 0.4]), within_noise([0.1, 0.11, 0.12], [0.3, 0.31, 0.32])
    (True, False)"""
    if len(a) < 2 or len(b) < 2:
        return None
    se = math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
    return bool(abs(np.mean(a) - np.mean(b)) <= 2 * se)


# ----------------------------------------------------------------------------- options


@dataclass
class StudyOptions:
    algos: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    """grid entries (ENTRIES, and KNOBS by name)"""
    knobs: bool = False
    """also every KNOBS entry"""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    budget: int = 30_720
    """rollouts per run (max_rollouts); 30,720 = 120 GRPO steps of B=32, G=8"""
    checkpoints: int = 4
    """evaluations at budget * i / checkpoints, i = 1..checkpoints"""
    k: int = 16
    """samples per held-out prompt (temperature 1)"""
    split: str = "test"
    """held-out split (the task's load(split=...)); never the training data"""
    source: str | None = None
    """held-out data file, passed to load(source=...)"""
    limit: int | None = None
    """first N held-out prompts"""
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
    """sequences per generate call in evaluations (default Config.generate_batch_size)"""
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

    def __post_init__(self):
        known = {**ENTRIES, **KNOBS}
        self.algos = list(dict.fromkeys([*self.algos, *(KNOBS if self.knobs else [])]))
        checks = [
            (not (bad := [a for a in self.algos if a not in known]),
             f"unknown grid entries {bad}; known: {', '.join(known)}"),
            (bool(self.seeds), "give at least one seed"),
            (self.budget >= 1, f"budget={self.budget} must be >= 1 rollout"),
            (1 <= self.checkpoints <= self.budget, f"checkpoints={self.checkpoints} must be in 1..budget"),
            (self.k >= 1, f"k={self.k} must be >= 1 (the study's hard set wants k >= 16)"),
            (self.jobs >= 1, f"jobs={self.jobs} must be >= 1"),
            (not (own := [o for o in self.overrides if o.partition("=")[0].strip() in STUDY_SETS]),
             f"the study sets {', '.join(sorted(STUDY_SETS))} itself; drop {own}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def budgets(self) -> list[int]:
        return sorted({self.budget * i // self.checkpoints for i in range(1, self.checkpoints + 1)})


# ----------------------------------------------------------------------------- training and evaluation


def base_config(opts: StudyOptions):
    return load_config(opts.preset, None, opts.overrides)


def train_segment(opts: StudyOptions, entry: str, seed: int, budget: int) -> tuple[Path, float]:
    """Train run `entry`-s`seed` until `budget` rollouts (a new run, or resumed from its newest checkpoint).
    Returns the run directory and the seconds it took."""
    run_dir = Path(opts.runs) / f"{entry}-s{seed}"
    if run_dir.is_dir() and checkpoint_steps(run_dir):
        cfg = resume_config(run_dir, [f"max_rollouts={budget}"])
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # a run killed before its first checkpoint starts over
        # steps = the whole budget never binds first: every step generates at least one rollout
        cfg = load_config(opts.preset, None, [*opts.overrides, *{**ENTRIES, **KNOBS}[entry], f"seed={seed}",
                                              f"steps={opts.budget}", f"max_rollouts={budget}",
                                              f"run_dir={opts.runs}", f"name={run_dir.name}"])
    t0 = time.perf_counter()
    train(cfg, quiet=True)
    seconds = time.perf_counter() - t0
    gc.collect()
    return run_dir, seconds


def evaluate_policy(opts: StudyOptions, cfg, model: str, checkpoint: int | None, seed: int) -> dict:
    """k samples (temperature 1) and one greedy answer per held-out prompt, through `bapo eval`'s code."""
    common = dict(model=model, checkpoint=checkpoint, task=cfg.task, splits=[opts.split], source=opts.source,
                  template=cfg.task_options.get("template"), limit=opts.limit, options={},
                  max_new_tokens=cfg.max_response_length, batch_size=opts.eval_batch_size, device=cfg.device,
                  seed=seed, tasks_dirs=list(cfg.tasks_dirs), quiet=True)
    s = setup(EvalOptions(**common, k=opts.k, temperature=1.0))
    backend = load_backend(s.cfg, s.checkpoint_dir)  # once for both passes
    per_call = s.cfg.generate_batch_size
    sampled = evaluate(backend, s.task, s.sets, opts.k, quiet=True, per_call=max(1, per_call // opts.k))[opts.split]
    greedy = evaluate(backend, s.task, s.sets, 1, quiet=True, greedy=True, per_call=per_call)[opts.split]
    del backend
    gc.collect()
    return {"greedy": greedy["mean@k"], "mean@k": sampled["mean@k"], "pass@k": sampled["pass@k"],
            "n": sampled["n"], "counts": sampled["problems"]}


def newest_checkpoint(run_dir: Path) -> tuple[int, int, float]:
    """(step, rollouts, training seconds) of a run up to its newest checkpoint, from its record (truncated to that
    checkpoint on every resume). The seconds are the steps' own timings (generate, score, train, sync): a run
    restarted on another machine, or resumed, counts each step once, and model loading not at all."""
    step = checkpoint_steps(run_dir)[-1]
    rollouts, seconds = query_ro(run_dir, "SELECT COALESCE(SUM(rollouts), 0), COALESCE(SUM(t_generate + t_score + "
                                          "t_train + t_sync), 0) FROM steps WHERE step <= ?", (step,))[0]
    return step, rollouts, seconds


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


class Ledger:
    """The evaluations done, one JSON line each in RUNS/study.jsonl, keyed (entry, seed, budget); its first line
    holds the settings they were made with, and a later command with other settings is refused."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.rows = path, {}
        text = path.read_text() if path.exists() else ""
        lines = text.splitlines()
        if text and not text.endswith("\n"):  # a --jobs child is appending it right now: not ours to read yet
            lines = lines[:-1]
        if lines and with_new_defaults(json.loads(lines[0])) != settings:
            raise ValueError(f"{path} was made with other settings ({lines[0][:300]}...): give another --runs, "
                             f"or remove {path.parent} to start over")
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


def run_study(opts: StudyOptions, say=print) -> dict:
    """Evaluate the start policy, train and evaluate every (entry, seed) at every budget; returns the ledger rows
    as {"start": row, "resampled": row, "runs": [rows]} (rows without per-prompt counts but with migration)."""
    cfg = base_config(opts)
    settings = {"config": cfg.to_dict(), "k": opts.k, "split": opts.split, "source": opts.source, "limit": opts.limit,
                "eval_seed": opts.eval_seed, "budget": opts.budget, "budgets": opts.budgets}
    settings = json.loads(json.dumps(settings))  # as the ledger file holds it (tuples -> lists)
    ledger = Ledger(Path(opts.runs) / "study.jsonl", settings)
    for name, seed in ((START, opts.eval_seed), (RESAMPLED, opts.eval_seed + 1)):
        if ledger.get(name, None, 0) is None:
            say(f"evaluating the start policy {cfg.model} (seed {seed}, k={opts.k})")
            ledger.add({"entry": name, "seed": None, "budget": 0, "step": 0, "rollouts": 0, "train_seconds": 0.0,
                        "device": device(cfg.device), **evaluate_policy(opts, cfg, cfg.model, None, seed)})
    start = ledger.get(START, None, 0)
    hard = hard_set(start["counts"])
    if opts.jobs > 1:  # every run in its own process; then the loop below finds everything in the ledger
        run_parallel(opts, [(e, s) for e in opts.algos for s in opts.seeds
                            if any(ledger.get(e, s, b) is None for b in opts.budgets)], say)
        ledger = Ledger(ledger.path, settings)  # with the children's rows
    for entry in opts.algos:
        for seed in opts.seeds:
            for budget in opts.budgets:
                if ledger.get(entry, seed, budget) is not None:
                    continue
                run_dir, seconds = train_segment(opts, entry, seed, budget)
                step, rollouts, train_seconds = newest_checkpoint(run_dir)
                if rollouts < budget:
                    raise RuntimeError(f"{run_dir} stopped at {rollouts} rollouts (step {step}), under the budget "
                                       f"{budget}: its steps={opts.budget} cap should never bind")
                say(f"{entry} seed {seed}: {rollouts} rollouts at step {step} (budget {budget}), {seconds:.1f} s")
                row = evaluate_policy(opts, cfg, str(run_dir), step, opts.eval_seed + 1)
                record_evals(run_dir, step, row, hard, opts.k)  # first: a kill before the ledger line redoes both
                ledger.add({"entry": entry, "seed": seed, "budget": budget, "step": step, "rollouts": rollouts,
                            "train_seconds": train_seconds, "device": device(cfg.device), **row})
                if not opts.keep_checkpoints:
                    for old in [s for s in checkpoint_steps(run_dir) if s != step]:
                        shutil.rmtree(run_dir / "checkpoints" / f"step_{old}")

    def brief(row):
        out = {k: v for k, v in row.items() if k != "counts"}
        return out | {"unlocked": unlocked(hard, row["counts"]), "bins": np.bincount(
            list(row["counts"].values()), minlength=opts.k + 1).tolist(),
            "migration": migration(start["counts"], row["counts"], opts.k)}

    runs = [brief(ledger.get(e, s, b)) for e in opts.algos for s in opts.seeds for b in opts.budgets]
    return {"settings": settings, "hard_set": len(hard), "start": brief(start),
            "resampled": brief(ledger.get(RESAMPLED, None, 0)), "runs": runs}


def run_parallel(opts: StudyOptions, pairs: list[tuple[str, int]], say=print) -> None:
    """Train and evaluate each (entry, seed) in its own process (child_argv), at most opts.jobs at once, in grid
    order; each writes its rows to the ledger and its output to RUNS/logs/ENTRY-sSEED.log. Waits for all; raises
    naming every one that failed (the rows written stay: the same command again continues)."""
    logs = Path(opts.runs) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    gpus = child_gpus(base_config(opts).device)
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


def child_argv(opts: StudyOptions, entry: str, seed: int) -> list[str]:
    """The command of one (entry, seed) of a --jobs study: the same settings, that run only, no report."""
    argv = [sys.executable, "-m", "bapo_vl.study", "--algos", entry, "--seeds", str(seed), "--jobs", "1",
            "--no-report", "--budget", str(opts.budget), "--checkpoints", str(opts.checkpoints), "--k", str(opts.k),
            "--split", opts.split, "--runs", opts.runs, "--eval-seed", str(opts.eval_seed)]
    for flag, value in (("--source", opts.source), ("--limit", opts.limit), ("--preset", opts.preset),
                        ("--eval-batch-size", opts.eval_batch_size)):
        argv += [flag, str(value)] if value is not None else []
    return argv + (["--keep-checkpoints"] if opts.keep_checkpoints else []) + opts.overrides


def child_gpus(setting: str) -> list[str]:
    """The GPUs --jobs children take turns on (CUDA_VISIBLE_DEVICES values): every visible one when the runs use
    CUDA and there are several; none (children see what this process sees) otherwise."""
    if setting == "cpu" or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return []
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[:torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]


# ----------------------------------------------------------------------------- the report


def final_rows(result: dict, entry: str) -> list[dict]:
    budget = result["settings"]["budget"]
    return [r for r in result["runs"] if r["entry"] == entry and r["budget"] == budget]


def _ms(xs: list[float], fmt: str = "{:.3f}") -> str:
    m, sd = mean_sd(xs)
    return f"{fmt.format(m)} ± {fmt.replace('+', '').format(sd)}" if len(xs) > 1 else fmt.format(m)


def report(result: dict, opts: StudyOptions, machine: dict, plots: bool = True) -> str:
    s, k, start = result["settings"], opts.k, result["start"]
    metrics = ["greedy", "mean@k", "pass@k", "unlocked"]
    heads = ["greedy", f"mean@{k}", f"pass@{k}", "hard set unlocked"]
    lines = [f"# Study: {', '.join(opts.algos)} on {s['config']['task']} with {s['config']['model']}", "",
             "```", opts.command, "```", "",
             f"- trained and evaluated on {machine['device']}; report written {machine['date']} with torch "
             f"{machine['torch']}, commit {machine['commit']}",
             f"- budget {opts.budget:,} rollouts per run (fresh + re-evaluation), evaluated at "
             f"{', '.join(f'{b:,}' for b in opts.budgets)}; seeds {', '.join(map(str, opts.seeds))} "
             "(mean ± sd over seeds)",
             f"- held-out: split `{opts.split}`{f' of {opts.source}' if opts.source else ''}, {start['n']} prompts, "
             f"k={k} samples at temperature 1 and one greedy answer each",
             f"- hard set: {result['hard_set']} prompts ({result['hard_set'] / max(start['n'], 1):.1%}) that the start "
             f"policy got 0/{k} right; unlocked = the fraction of them solved >= 1/{k} by fresh samples. The start "
             f"policy itself, resampled, unlocks {result['resampled']['unlocked']:.3f}: the floor from sampling alone",
             "", f"## At the budget ({opts.budget:,} rollouts)", "",
             "| | " + " | ".join(heads) + f" | rollouts | steps | train s | Δ mean@{k} per 1k rollouts |",
             "| --- " * (len(heads) + 5) + "|"]
    for name, row in (("start policy", start), ("start policy, resampled", result["resampled"])):
        lines.append(f"| {name} | " + " | ".join(f"{row[m]:.3f}" for m in metrics) + " | – | – | – | – |")
    for entry in opts.algos:
        rows = final_rows(result, entry)
        gain = [(r["mean@k"] - start["mean@k"]) / (r["rollouts"] / 1000) for r in rows]
        cells = [*(_ms([r[m] for r in rows]) for m in metrics), _ms([r["rollouts"] for r in rows], "{:,.0f}"),
                 _ms([r["step"] for r in rows], "{:.0f}"), _ms([r["train_seconds"] for r in rows], "{:.1f}"),
                 _ms(gain, "{:+.4f}")]
        lines.append(f"| {entry} | " + " | ".join(cells) + " |")
    lines += ["", f"Δ mean@{k} per 1k rollouts = (mean@{k} - the start policy's) / (rollouts / 1000). "
              "Steps: training steps (policy updates) taken to spend the budget: equal rollouts are not equal updates "
              "(DAPO's dynamic sampling and BAPO's re-evaluations spend rollouts without an update). "
              "Train s: the steps' recorded generate + score + train + sync seconds (no model loading, checkpoints or "
              "evaluations); compare them only between runs on the same device."]
    lines += comparison(result, opts, metrics, heads) + targets(result, opts)
    lines += checkpoint_table(result, opts) + budget_check(result, opts) + bin_table(result, opts)
    lines += migration_tables(result, opts)
    lines += ["", "Plots: `accuracy.png` (greedy, mean@k, pass@k vs rollouts; band = ± sd over seeds), "
              "`unlocked.png` (hard set unlocked vs rollouts)." if plots else "No plots: matplotlib was missing.",
              "Numbers: `results.json`; every evaluation, with per-prompt counts: the ledger `study.jsonl`.", ""]
    return "\n".join(lines)


def comparison(result, opts, metrics, heads) -> list[str]:
    base = final_rows(result, opts.baseline)
    if not base:
        return []
    out = ["", f"## Against {opts.baseline} (difference of seed means; \"noise\" = within 2 standard errors of the "
           "difference, a rough rule for few seeds)", "",
           "| | " + " | ".join(heads) + " |", "| --- " * (len(heads) + 1) + "|"]
    for entry in [e for e in opts.algos if e != opts.baseline]:
        cells = []
        for m in metrics:
            a, b = [r[m] for r in final_rows(result, entry)], [r[m] for r in base]
            noise = within_noise(a, b)
            cells.append(f"{np.mean(a) - np.mean(b):+.3f}" + {True: " (noise)", False: "", None: " (1 seed)"}[noise])
        out.append(f"| {entry} | " + " | ".join(cells) + " |")
    return out


def targets(result, opts) -> list[str]:
    """Issue 13's targets, each said met or not (those whose entries ran)."""
    mean = lambda entry, m: float(np.mean([r[m] for r in final_rows(result, entry)]))
    have = set(opts.algos)
    out = ["", "## Issue 13's targets at this budget", ""]
    if {"bapo", "grpo"} <= have:
        d = mean("bapo", "mean@k") - mean("grpo", "mean@k")
        out.append(f"- BAPO mean@{opts.k} >= GRPO's + 0.02: {d:+.3f} -> {'met' if d >= 0.02 else 'not met'}")
        b, g, floor = mean("bapo", "unlocked"), mean("grpo", "unlocked"), result["resampled"]["unlocked"]
        ratio = lambda x, y: f"{x / y:.2f}x" if y > 0 else "n/a"
        # a ratio of two figures under the floor that resampling the start policy reaches is no evidence
        verdict = ("not met" if not (b >= 1.5 * g and b > 0) else "met" if b > floor else
                   "met on paper, but no evidence: BAPO unlocks less than resampling the start policy does")
        out.append(f"- BAPO hard set unlocked >= 1.5x GRPO's: {b:.3f} vs {g:.3f} ({ratio(b, g)}) -> {verdict}; "
                   f"above the resampling floor {floor:.3f}: {b - floor:+.3f} vs {g - floor:+.3f} "
                   f"({ratio(b - floor, g - floor)})")
    if {"bapo", "dapo"} <= have:
        d = mean("bapo", "mean@k") - mean("dapo", "mean@k")
        out.append(f"- BAPO mean@{opts.k} >= DAPO's: {d:+.3f} -> {'met' if d >= 0 else 'not met'}")
        goal, spent = mean("bapo", "mean@k"), mean("bapo", "rollouts")
        dapo = [[r for r in result["runs"] if r["entry"] == "dapo" and r["budget"] == b] for b in opts.budgets]
        reached = [float(np.mean([r["rollouts"] for r in rows])) for rows in dapo
                   if np.mean([r["mean@k"] for r in rows]) >= goal]
        out.append(f"- DAPO needs >= 2x BAPO's rollouts to reach BAPO's final mean@{opts.k} ({goal:.3f} at "
                   f"{spent:,.0f} rollouts): " + (
                       f"DAPO reaches it at its checkpoint of {reached[0]:,.0f} rollouts ({reached[0] / spent:.2f}x) "
                       f"-> {'met' if reached[0] >= 2 * spent else 'not met'}" if reached else
                       "DAPO does not reach it within the budget; >= 2x needs a DAPO run at twice the budget "
                       "(--budget, another --runs folder) -> untested"))
    return out if len(out) > 3 else []


def checkpoint_table(result, opts) -> list[str]:
    k = opts.k
    out = ["", f"## mean@{k} and hard set unlocked at each rollout checkpoint", "",
           "| | " + " | ".join(f"{b:,}" for b in opts.budgets) + " |", "| --- " * (len(opts.budgets) + 1) + "|"]
    for entry in opts.algos:
        cells = []
        for b in opts.budgets:
            rows = [r for r in result["runs"] if r["entry"] == entry and r["budget"] == b]
            cells.append(f"{_ms([r['mean@k'] for r in rows])} / {_ms([r['unlocked'] for r in rows])}")
        out.append(f"| {entry} | " + " | ".join(cells) + " |")
    return out


def budget_check(result, opts) -> list[str]:
    final = [r for r in result["runs"] if r["budget"] == opts.budget]
    spent = [r["rollouts"] for r in final]
    return ["", f"Every run stops after the first step whose rollouts reach the budget: final counts "
            f"{min(spent):,}..{max(spent):,} for a budget of {opts.budget:,} (overshoot under one step: "
            f"at most {max(spent) - opts.budget:,})."]


def bin_table(result, opts) -> list[str]:
    """Mean accuracy change by start bin, per entry (mean ± sd over seeds), with the start policy resampled as the
    floor: prompts at 0/k can only rise and at k/k only fall by resampling alone."""
    labels, start_bins = coarse(result["start"]["migration"])
    sizes = [int(sum(row)) for row in start_bins]
    out = ["", f"## Where accuracy moved: mean change of correct/{opts.k} by the start policy's bin (end - start)", "",
           "| | " + " | ".join(f"{b} ({n} prompts)" for b, n in zip(labels, sizes)) + " |", "| --- " * 5 + "|"]

    def cells(rows):
        per_bin = list(zip(*[bin_changes(r["migration"]) for r in rows]))
        return [_ms(list(xs), "{:+.3f}") if xs and None not in xs else "–" for xs in per_bin]

    out.append("| start policy, resampled | " + " | ".join(cells([result["resampled"]])) + " |")
    out += [f"| {entry} | " + " | ".join(cells(final_rows(result, entry))) + " |" for entry in opts.algos]
    return out


def migration_tables(result, opts) -> list[str]:
    out = ["", f"## Migration of the held-out prompts, start -> end (bins of correct/{opts.k}; summed over seeds)", ""]
    for entry in opts.algos:
        total = np.sum([r["migration"] for r in final_rows(result, entry)], axis=0).tolist()
        labels, m = coarse(total)
        out += [f"{entry}:", "", "| start \\ end | " + " | ".join(labels) + " |", "| --- " * 5 + "|"]
        out += [f"| {label} | " + " | ".join(map(str, row)) + " |" for label, row in zip(labels, m)] + [""]
    return out


def plot(result: dict, opts: StudyOptions, out: Path) -> list[Path]:
    """accuracy.png (greedy, mean@k, pass@k vs rollouts) and unlocked.png: one line per entry (mean over seeds at
    each checkpoint, x = mean rollouts), a band of ± sd; the start policy at 0 rollouts."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the study's plots need matplotlib: pip install 'bapo-vl[study]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curves(ax, metric, title, floor=None):
        for entry in opts.algos:
            xs, ms, sds = [0.0], [result["start"][metric]], [0.0]
            for b in opts.budgets:
                rows = [r for r in result["runs"] if r["entry"] == entry and r["budget"] == b]
                xs.append(float(np.mean([r["rollouts"] for r in rows])))
                m, sd = mean_sd([r[metric] for r in rows])
                ms.append(m)
                sds.append(sd)
            line, = ax.plot(xs, ms, marker="o", label=entry)
            ax.fill_between(xs, np.subtract(ms, sds), np.add(ms, sds), color=line.get_color(), alpha=0.2)
        if floor is not None:
            ax.axhline(floor, color="grey", linestyle="--", label="start policy, resampled")
        ax.set(title=title, xlabel="rollouts")
        ax.grid(alpha=0.3)

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in zip(axes, ["greedy", "mean@k", "pass@k"], ["greedy", f"mean@{opts.k}", f"pass@{opts.k}"]):
        curves(ax, metric, title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "accuracy.png")
    fig.savefig(paths[-1], dpi=110)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    curves(ax, "unlocked", f"hard set ({result['hard_set']} prompts 0/{opts.k} at start) solved >= 1/{opts.k}",
           floor=result["resampled"]["unlocked"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "unlocked.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return paths


def device(setting: str = "auto") -> str:
    """What Config.device=`setting` runs on, in words: the GPU's name, or the CPU."""
    if setting != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def machine(result: dict) -> dict:
    """Where the numbers were made (each ledger row records its device) and where this report was written."""
    rows = [result["start"], result["resampled"], *result["runs"]]
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": ", ".join(sorted({r["device"] for r in rows})),
            "torch": torch.__version__, "python": platform.python_version(), "commit": commit}


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> StudyOptions:
    d = StudyOptions()
    ap = argparse.ArgumentParser(prog="scripts/study.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run, e.g. device=cuda")
    ap.add_argument("--algos", default=",".join(d.algos), help=f"grid entries (default all); knobs: {', '.join(KNOBS)}")
    ap.add_argument("--knobs", action="store_true", help="add every knob entry: " + ", ".join(KNOBS))
    ap.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="default %(default)s")
    ap.add_argument("--budget", type=int, default=d.budget, help="rollouts per run (max_rollouts), default %(default)s")
    ap.add_argument("--checkpoints", type=int, default=d.checkpoints,
                    help="evaluations per run, evenly in rollouts (default %(default)s)")
    ap.add_argument("--k", type=int, default=d.k, help="samples per held-out prompt (default %(default)s)")
    ap.add_argument("--split", default=d.split, help="held-out split (default %(default)s)")
    ap.add_argument("--source", help="held-out data file (load(source=...))")
    ap.add_argument("--limit", type=int, help="first N held-out prompts")
    ap.add_argument("--preset", help="config preset (default tiny)")
    ap.add_argument("--runs", default=d.runs, help="run directories and the ledger study.jsonl (default %(default)s)")
    ap.add_argument("--out", help="output folder (default docs/study/<model name>)")
    ap.add_argument("--eval-seed", type=int, default=d.eval_seed)
    ap.add_argument("--eval-batch-size", type=int, help="sequences per generate call in evaluations")
    ap.add_argument("--baseline", default=d.baseline, help="the entry compared with (default %(default)s)")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--jobs", type=int, default=d.jobs,
                    help="(entry, seed) runs at once, each its own process (default %(default)s: one after another)")
    ap.add_argument("--no-report", action="store_true", help="train and evaluate into the ledger only (--jobs children)")
    a = ap.parse_args(argv)
    return StudyOptions(algos=[x.strip() for x in a.algos.split(",") if x.strip()], knobs=a.knobs,
                        seeds=[int(x) for x in a.seeds.split(",") if x.strip()], budget=a.budget,
                        checkpoints=a.checkpoints, k=a.k, split=a.split, source=a.source, limit=a.limit,
                        preset=a.preset, overrides=a.overrides, runs=a.runs, out=a.out, eval_seed=a.eval_seed,
                        eval_batch_size=a.eval_batch_size, baseline=a.baseline, keep_checkpoints=a.keep_checkpoints,
                        jobs=a.jobs, report=not a.no_report, command="python scripts/study.py " + shlex.join(argv))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    result = run_study(opts, say=lambda line: print(line, file=sys.stderr, flush=True))
    if not opts.report:
        return 0
    out = Path(opts.out or Path("docs/study") / Path(result["settings"]["config"]["model"]).name)
    out.mkdir(parents=True, exist_ok=True)
    info = machine(result)
    (out / "results.json").write_text(json.dumps({"command": opts.command, "machine": info, **result}, indent=1))
    try:
        written = plot(result, opts, out)
    except ImportError as e:  # e.g. a GPU machine without it: the same command elsewhere plots from the ledger
        written = []
        print(f"study: no plots ({e}); the same command where matplotlib is installed makes them from "
              f"{Path(opts.runs) / 'study.jsonl'} without training again", file=sys.stderr)
    (out / "results.md").write_text(report(result, opts, info, plots=bool(written)))
    print("study: " + ", ".join(str(p) for p in [out / "results.md", *written, out / "results.json"]))
    return 0


if __name__ == "__main__":  # how --jobs starts its children
    sys.exit(main())
