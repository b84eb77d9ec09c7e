"""`bapo train` on the embedded backend (and the loop every backend's launcher runs): load the task and the backend,
run the steps, write the run record and checkpoints."""
from __future__ import annotations

import dataclasses
import errno
import importlib
import logging
import os
import shutil
import sqlite3
import sys
import time
import traceback
from pathlib import Path

import torch

from bapo_vl.backends.base import CheckpointError, load_checkpoint_file
from bapo_vl.config import Config, ConfigError, RunSettings, as_override, one_line, recorded_config
from bapo_vl.plugins import check_load_options, get_task
from bapo_vl.record import (DB_NAME, FILTERED, NOT_PROMOTED, X1, X2, X3, RunRecord, lock_run_dir, make_sinks,
                            query_ro)
from bapo_vl.trainer import StepResult, Trainer

log = logging.getLogger(__name__)
DISK_FULL = 1 << 20  # bytes: less room than this left after a failed write means the disk is full
STATE = "state.pt"  # the trainer's part of a checkpoint folder (the backend writes its own files beside it)
# What a resumed run may change; everything else must be as recorded, or it would not be the same run.
RESUME_MAY_CHANGE = {"resume", "steps", "max_rollouts", "save_every", "keep_checkpoints", "log_samples", "report_to",
                     "verl", "device", "run_dir"}
# The changes a resume writes into the record, so that a later plain resume=RUN goes on with them (an extended run
# killed before its new end still trains to it); where it runs (device, run_dir) belongs to the machine, not the run.
RESUME_RECORDS = RESUME_MAY_CHANGE - {"resume", "device", "run_dir"}
IDLE_STEPS = 10  # steps in a row with nothing to train on before the run says so


class RunFailed(RuntimeError):
    """Training stopped by an error after the run began; the message says what failed and where the run stands."""


def make_backend(cfg: Config):
    """The embedded backend, given the groups it reads. Another backend's workers are built by its launcher
    (config.launcher), which passes the backend to train()."""
    if cfg.run.backend != "embedded":
        raise ConfigError(f"backend={cfg.run.backend}: train() builds the embedded backend; start this run with "
                          f"bapo_vl.config.launcher({cfg.run.backend!r}), as `bapo train` does", "backend")
    from bapo_vl.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(cfg.run.model, cfg.sampling, cfg.optim, cfg.loss, cfg.embedded, device=cfg.run.device,
                           seed=cfg.run.seed, steps=cfg.run.steps, delay=cfg.bapo.delay)


def make_trainer(cfg: Config, backend, task, problems) -> Trainer:
    """The Trainer over `backend`, given the BAPO settings and what else of the config it reads."""
    return Trainer(cfg.bapo, backend, task, problems, batch_size=cfg.sampling.batch_size,
                   group_size=cfg.sampling.group_size, seed=cfg.run.seed, critic=cfg.optim.critic,
                   adv_eps=cfg.optim.adv_eps)


def record_rows(result: StepResult, log_samples: int):
    """Per-prompt rows (uid, correct, G, subset) and a few sampled responses, in the record's subset vocabulary."""
    kept = {g.uid for g in result.x1}
    promoted = {g.uid for g in result.x2}
    tagged = [(g, X1 if g.uid in kept else FILTERED) for g in result.fresh]
    tagged += [(g, X2 if g.uid in promoted else NOT_PROMOTED) for g in result.reevaluated]
    tagged += [(g, X3) for g in result.x3]
    rows = [(g.uid, g.correct, len(g.samples), subset) for g, subset in tagged]
    sampled = tagged[:log_samples] + [(g, X2) for g in result.x2[:log_samples]]
    samples = [(g.uid, subset, j, s.text, s.reward, s.verdict) for g, subset in sampled for j, s in enumerate(g.samples)]
    return rows, samples


class Progress:
    """Progress as the user can see it: a bar on a terminal; elsewhere (a log file, CI) one plain line per step at
    most every `every` seconds, and always the first and the last step; nothing with quiet."""

    def __init__(self, total: int, start: int, quiet: bool, every: float = 10.0):
        self.total, self.quiet, self.every, self.last = total, quiet, every, -float("inf")
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                    TextColumn("{task.fields[info]}"))
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, t: int, m: dict):
        info = (f"reward {m['fresh_reward']:.3f} |X1| {m['x1']} |X2| {m['x2']} |X3| {m['x3']} "
                f"B_bad {m['bad_size']} B_high {m['high_size']}")
        if gpu := [m[k] for k in ("gpu_memory_generate_gb", "gpu_memory_train_gb") if k in m]:  # a GPU run
            info += f" GPU {max(gpu):.1f} GB"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
        elif not self.quiet and (time.monotonic() - self.last >= self.every or t == self.total):
            self.last = time.monotonic()
            print(f"step {t}/{self.total}  {info}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def release_frames(error: BaseException) -> None:
    """Drop the local variables of the frames an error (and the errors it arose from) passed through, so that
    the files they held open are closed now, not when the error is."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__context__


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint folder (folders appear whole: see save_checkpoint), oldest first."""
    names = [p.name.removeprefix("step_") for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()]
    return sorted(int(n) for n in names if n.isdigit())


def save_checkpoint(trainer: Trainer, run_dir: Path, step: int, keep: int) -> Path:
    """The backend's weights/optimizer/random state and the trainer's BAPO state (buffers, thresholds, data
    position, versions) in checkpoints/step_N. Written into a hidden folder, synced to disk, then renamed: a
    crash at any point leaves either the whole checkpoint or none. Then the older ones beyond the `keep` newest
    (keep_checkpoints) are removed."""
    root = run_dir / "checkpoints"
    path, tmp = root / f"step_{step}", root / f".step_{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        trainer.backend.save_checkpoint(tmp, step)
        torch.save(trainer.state_dict(), tmp / STATE)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    except BaseException as e:
        full = shutil.disk_usage(root).free < DISK_FULL  # torch reports a full disk as "unexpected pos ..."
        release_frames(e)  # the failed writer's frames hold its files open: removed, they would free no room
        shutil.rmtree(tmp, ignore_errors=True)  # on a full disk this frees the room the record needs to say "failed"
        if full and isinstance(e, Exception):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from e
        raise
    if path.exists():  # a step trained again after a resume from an earlier checkpoint
        shutil.rmtree(path)
    os.replace(tmp, path)
    sync_folder(root)  # the new checkpoint's name is on disk before an older one's removal can be
    prune_checkpoints(run_dir, step, keep)
    return path


def sync_folder(folder: Path) -> None:
    """fsync a folder: renames and removals in it are on disk when this returns."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_checkpoints(run_dir: Path, newest: int, keep: int) -> None:
    """Remove the checkpoints older than the `keep` newest up to step `newest`, which was just written whole
    (keep=0: remove none). Later ones, left from before a resume, are replaced when their steps are trained again.
    Each goes by a rename to a hidden name first, so that a crash mid-removal leaves no half checkpoint that
    looks whole; leftovers of such a crash go now."""
    root = run_dir / "checkpoints"
    for leftover in root.glob(".step_*.removed"):
        shutil.rmtree(leftover, ignore_errors=True)
    if not keep:
        return
    for step in [s for s in checkpoint_steps(run_dir) if s <= newest][:-keep]:
        gone = root / f".step_{step}.removed"
        os.replace(root / f"step_{step}", gone)
        shutil.rmtree(gone, ignore_errors=True)


def check_resumable(cfg: Config, run_dir: Path):
    """A resumed run continues with the config it was started with: only RESUME_MAY_CHANGE may differ."""
    recorded = Config.from_dict(recorded_config(run_dir)).to_dict()
    given = cfg.to_dict()
    diff = [f"{k}: recorded {recorded[k]!r}, given {given[k]!r}" for k in recorded
            if k not in RESUME_MAY_CHANGE and recorded[k] != given.get(k)]
    if diff:
        raise ValueError(f"resume={run_dir} continues that run with its recorded config; these differ: "
                         + "; ".join(diff) + f" (only {', '.join(sorted(RESUME_MAY_CHANGE - {'resume'}))} "
                         "may change on resume)")


def open_run(cfg: Config, trainer: Trainer, problems) -> tuple[Path, RunRecord, int]:
    """A new run directory and record, or (resume=RUN_DIR) the old one restored to its latest complete checkpoint;
    steps recorded after that checkpoint are dropped, since they are trained again, and the resume's changes
    (RESUME_RECORDS) are written into the recorded config. A run with no checkpoint starts again from step 0 with
    its record emptied of steps. The caller holds the lock."""
    run = cfg.run
    if run.resume:
        run_dir = Path(run.resume)
        start = load_newest_checkpoint(trainer, run_dir)
        if run.steps < start:  # refused before the record would say steps=N of a run trained further
            raise ConfigError(f"steps={run.steps}: {run_dir} is trained to step {start} already (checkpoint "
                              f"step_{start}); give steps >= {start}", "steps")
        given = cfg.to_dict()
        record = RunRecord.open(run_dir, truncate_after=start, config_changes={k: given[k] for k in RESUME_RECORDS},
                                sinks=make_sinks(run.report_to, run_dir, given))
        if start == 0:  # a run killed right after its record was created may lack its problems
            record.log_problems(problems)
        record.set_verifier(getattr(trainer.task, "version", ""), start + 1)
        return run_dir, record, start
    run_dir = run_path(run)
    record = RunRecord.create(run_dir, cfg.to_dict(), name=run_dir.name, backend=trainer.backend.name,
                              sinks=make_sinks(run.report_to, run_dir, cfg.to_dict()))
    record.set_verifier(getattr(trainer.task, "version", ""), 1)
    record.log_problems(problems)
    return run_dir, record, 0


def load_newest_checkpoint(trainer: Trainer, run_dir: Path) -> int:
    """Restore the newest checkpoint that loads; one that does not (a file damaged after it was written, or one
    holding more than tensors and plain data: see load_checkpoint_file) is reported and the one before it tried.
    Returns its step; 0 for a run stopped before its first checkpoint, which the fresh trainer starts again (as
    a new run of its config, the same)."""
    steps = checkpoint_steps(run_dir)
    if not steps:
        log.warning("resume=%s: the run stopped before its first checkpoint; starting it again from step 0", run_dir)
        return 0
    for step in reversed(steps):
        path = run_dir / "checkpoints" / f"step_{step}"
        try:
            trainer.load_state_dict(load_checkpoint_file(path / STATE, ("format",)))
            trainer.backend.load_checkpoint(path)
            return step
        except Exception as e:  # noqa: BLE001 - any damage: fall back to the previous checkpoint
            why = one_line(e, with_type=not isinstance(e, CheckpointError))  # a CheckpointError names the file
            log.warning("resume: %s does not load (%s); trying the checkpoint before it", path, why)
    raise FileNotFoundError(f"resume={run_dir}: no checkpoint in {run_dir / 'checkpoints'} loads (tried steps "
                            f"{', '.join(map(str, reversed(steps)))}); to train the run again from step 0, remove "
                            f"{run_dir / 'checkpoints'} and resume")


def rollouts_spent(run_dir: Path) -> int:
    """Responses generated (fresh and re-evaluation) by the steps in the record: the count max_rollouts budgets.
    The record is its one ledger: on resume it holds exactly the steps up to the restored checkpoint."""
    return query_ro(run_dir, "SELECT COALESCE(SUM(rollouts), 0) FROM steps")[0][0]


def check_model(model: str, key: str = "model=") -> None:
    """`model` names a model folder, a bundled policy, or a hub id that is cached or can be downloaded; if not, one
    error naming it (`key` shows where it was given), before the task and the weights load (only its config.json is
    read here)."""
    import huggingface_hub
    from transformers import AutoConfig

    from bapo_vl.models import resolve_model

    path = resolve_model(model)
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        if Path(path).exists():
            raise ConfigError(f"{key}{model}: {path} is not a model folder ({one_line(e)})", "model") from e
        # a path, not a hub id (owner/name): runs/x, where runs/ is a folder here, is a path too
        if model.startswith(("/", ".", "~")) or model.count("/") != 1 or Path(model).parent.is_dir():
            raise ConfigError(f"{key}{model}: no such folder: {model} does not exist; give a model folder "
                              "(config.json and weights), a bundled policy (countdown-tiny) or a hub id",
                              "model") from e
        why = ("HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE
               else f"the hub did not provide it ({one_line(e).split('. ')[0]})")
        raise ConfigError(f"{key}{model}: no such folder, and this hub model is not in the local cache and {why}; "
                          f"download it where there is network (`{HUB_DOWNLOAD} {model} --local-dir /local/path`) "
                          f"and pass {key or 'the folder: bapo eval '}/local/path", "model") from e


HUB_DOWNLOAD = "hf download"  # huggingface_hub >= 1.0 (transformers 5 needs it) has `hf`; huggingface-cli is gone


def check_start(run: RunSettings, load_model: bool) -> None:
    """What can be checked before anything heavy loads (the task's data, the weights): the run directory, the
    task folders, the device and (`load_model`: the embedded backend will load it) the model."""
    run_dir = run_path(run)
    if not run.resume and (run_dir / DB_NAME).exists():
        raise ConfigError(f"name={run.name}: {run_dir} already holds a run; choose another name=, or continue it "
                          f"with resume={run_dir}", "name")
    for folder in run.tasks_dirs:
        if not Path(folder).is_dir():
            raise ConfigError(f"tasks_dirs: {folder} is not a folder (of task plugins); fix the path or drop it",
                              "tasks_dirs")
    for sink in run.report_to:  # each sink is named after the package it writes with
        try:
            importlib.import_module(sink)
        except ImportError:
            raise ConfigError(f"report_to={sink}: the {sink} package is not installed; pip install "
                              f"'bapo-vl[{sink}]', or drop {sink} from report_to", "report_to") from None
    if run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: torch sees no CUDA GPU here; use device=cpu or device=auto", "device")
    if load_model:
        check_model(run.model)


def load_problems(run: RunSettings):
    """The task and its training problems; an option the task refuses names the task and task_options."""
    where = f"task={run.task} task_options={as_override(run.task_options)}"
    task = get_task(run.task, run.tasks_dirs)
    check_load_options(task, run.task_options, where)
    try:
        problems = task.load(split="train", **run.task_options)
    except (TypeError, ValueError, KeyError, FileNotFoundError) as e:
        raise ConfigError(f"{where}: {one_line(e)}", "task_options") from e
    if not problems:
        source = run.task_options.get("source")
        raise ConfigError(f"{where}: {source or 'the task'} gives no training problems"
                          + ("; give a data file with rows" if source else ""), "task_options")
    return task, problems


def check_prompt_lengths(cfg: Config, problems, n: int = 8) -> None:
    """The n prompts longest in text and the n with the most image pixels, encoded as the embedded backend will
    encode them, from the model folder's tokenizer / processor alone: a prompt longer than max_prompt_length is
    reported here, naming it, before the weights load and before the run starts."""
    from bapo_vl.backends.embedded import PromptEncoder
    from bapo_vl.models import resolve_model

    encode = PromptEncoder(resolve_model(cfg.run.model), cfg.sampling)
    by_text = sorted(problems, key=lambda p: len(str(p.messages)), reverse=True)[:n]
    by_pixels = sorted(problems, key=lambda p: sum(i.width * i.height for i in p.images or ()), reverse=True)[:n]
    for problem in {p.uid: p for p in by_text + by_pixels}.values():
        try:
            encode(problem)
        except ValueError as e:
            raise ConfigError(f"task={cfg.run.task}: {one_line(e)}", "max_prompt_length") from None


def close_run(record: RunRecord, lock, status: str) -> bool:
    """Record the end status, then let go of the record and the lock, whatever fails. False: the status could not
    be written (a full disk); `bapo runs` then shows the run as stopped, since its trainer is gone."""
    try:
        record.finish(status)
        return True
    except (sqlite3.Error, OSError) as e:
        log.warning("could not mark the run %s: %s", status, one_line(e))
        return False
    finally:
        try:
            record.close()
        finally:
            lock.close()


def failure_message(run_dir: Path, error: Exception, marked: bool) -> str:
    steps = checkpoint_steps(run_dir)
    where = (f"`bapo train resume={run_dir}` continues it from checkpoint step_{steps[-1]}" if steps
             else f"it has no checkpoint yet: `bapo train resume={run_dir}` starts it again from step 0")
    state = "is marked failed" if marked else "could not be marked failed (its record is not writable)"
    return f"training failed: {type(error).__name__}: {one_line(error)}; {run_dir} {state}; {where}"


def learning_summary(run_dir: Path) -> str:
    """What a run learned, from its record: fresh reward over its first and last 20 % of steps, X2 promotions,
    and the hard-problem ledger's count (prompts 0/G when first generated that a later generation, or a
    re-evaluation in the same step, answered right; bapo_vl.reader)."""
    from bapo_vl.reader import Run, ledger_counts

    rewards = [r for (r,) in query_ro(run_dir, "SELECT fresh_reward FROM steps ORDER BY step")]
    if not rewards:
        return "learned: no steps recorded"
    n = max(1, len(rewards) // 5)
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    promoted = query_ro(run_dir, "SELECT COALESCE(SUM(x2), 0) FROM steps")[0][0]
    hard, solved, _ = ledger_counts(Run(run_dir).ledger())
    return (f"learned: fresh reward {first:.3f} (first {n} steps) -> {last:.3f} (last {n}); {promoted} X2 "
            f"promotions; {solved} of {hard} hard prompts (all wrong when first drawn) answered right later")


def run_path(run: RunSettings) -> Path:
    if run.resume:
        return Path(run.resume)
    return Path(run.run_dir) / (run.name or f"{run.algo}-{run.task}-{time.strftime('%Y%m%d-%H%M%S')}")


def train(cfg: Config, quiet: bool = False, backend=None) -> Path:
    """Run (or resume) training: the embedded backend's launcher (config.BACKENDS), and the loop other launchers
    run over their own `backend` (bapo_vl.verl_launch.run passes a VerlBackend)."""
    if quiet:  # transformers' own loading / saving bars too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if cfg.run.resume:
        check_resumable(cfg, Path(cfg.run.resume))
    run = dataclasses.replace(cfg.run, name=cfg.run.name or run_path(cfg.run).name)  # one timestamp for the whole run
    cfg = dataclasses.replace(cfg, run=run)
    check_start(run, load_model=backend is None)
    task, problems = load_problems(run)
    if backend is None:
        check_prompt_lengths(cfg, problems)
    backend = backend or make_backend(cfg)
    if not quiet and hasattr(backend, "engine"):  # auto picks the engine: say which one samples the rollouts
        print(f"rollout engine: {backend.engine.name} (rollout_engine={cfg.embedded.rollout_engine})",
              file=sys.stderr, flush=True)
    trainer = make_trainer(cfg, backend, task, problems)
    lock = lock_run_dir(run_path(run))  # held from here until the record is closed, released on every path
    try:
        run_dir, record, start = open_run(cfg, trainer, problems)
    except BaseException:
        lock.close()
        raise
    status, failure = "failed", None
    try:
        progress = Progress(run.steps, start, quiet)
        spent, last, idle = rollouts_spent(run_dir), start, 0
        try:
            for t in range(start + 1, run.steps + 1):
                if 0 < run.max_rollouts <= spent:  # the budget is spent: stop after the step that reached it
                    log.info("max_rollouts=%d reached: %d rollouts after step %d", run.max_rollouts, spent, last)
                    break
                result = trainer.step(t)
                m = result.metrics
                rows, samples = record_rows(result, run.log_samples)
                record.log_step(t, {k: v for k, v in m.items() if k != "verdicts"}, groups=rows, samples=samples,
                                verdicts=m["verdicts"])
                progress.update(t, m)
                idle = idle + 1 if m["x1"] + m["x2"] + m["x3"] == 0 else 0
                if idle == IDLE_STEPS:
                    log.warning("steps %d-%d trained on nothing: every group's responses were all right or all "
                                "wrong (fresh reward %.2f) and X1, X2, X3 stayed empty; the policy likely cannot "
                                "answer this task's prompts, or its verifier never pays (check model=, the prompt "
                                "template and `bapo runs show %s`)", t - IDLE_STEPS + 1, t, m["fresh_reward"], run_dir)
                spent, last = spent + m["rollouts"], t
                if run.save_every > 0 and t % run.save_every == 0:
                    save_checkpoint(trainer, run_dir, t, run.keep_checkpoints)
        finally:
            progress.close()
        if run.save_every >= 0:
            if last > start:
                save_checkpoint(trainer, run_dir, last, run.keep_checkpoints)
            backend.save_pretrained(run_dir / "final")
        status = "finished"
    except Exception as e:  # noqa: BLE001 - reported as RunFailed once the record says so; Ctrl-C passes as it is
        failure = e
    finally:
        marked = close_run(record, lock, status)
    if failure is not None:
        raise RunFailed(failure_message(run_dir, failure, marked)) from failure
    return run_dir
