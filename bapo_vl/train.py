"""`bapo train`: load the task and the backend, run the steps, write the run record and checkpoints."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from bapo_vl.config import Config
from bapo_vl.plugins import get_task
from bapo_vl.record import FILTERED, NOT_PROMOTED, X1, X2, X3, RunRecord, lock_run_dir, make_sinks, query_ro
from bapo_vl.trainer import StepResult, Trainer

log = logging.getLogger(__name__)
STATE = "state.pt"  # the trainer's part of a checkpoint folder (the backend writes its own files beside it)
# What a resumed run may change; everything else must be as recorded, or it would not be the same run.
RESUME_MAY_CHANGE = {"resume", "steps", "save_every", "log_samples", "report_to", "device", "run_dir"}


def make_backend(cfg: Config):
    from bapo_vl.backends.embedded import EmbeddedBackend  # the only backend in this module's reach

    return EmbeddedBackend(cfg)


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
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
        elif not self.quiet and (time.monotonic() - self.last >= self.every or t == self.total):
            self.last = time.monotonic()
            print(f"step {t}/{self.total}  {info}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint folder (folders appear whole: see save_checkpoint), oldest first."""
    names = [p.name.removeprefix("step_") for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()]
    return sorted(int(n) for n in names if n.isdigit())


def save_checkpoint(trainer: Trainer, run_dir: Path, step: int) -> Path:
    """The backend's weights/optimizer/random state and the trainer's BAPO state (buffers, thresholds, data
    position, versions) in checkpoints/step_N. Written into a hidden folder, synced to disk, then renamed: a
    crash at any point leaves either the whole checkpoint or none."""
    root = run_dir / "checkpoints"
    path, tmp = root / f"step_{step}", root / f".step_{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.backend.save_checkpoint(tmp, step)
    torch.save(trainer.state_dict(), tmp / STATE)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if path.exists():  # a step trained again after a resume from an earlier checkpoint
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def recorded_config(run_dir) -> dict:
    """The config a run was started with, as its record holds it."""
    rows = query_ro(run_dir, "SELECT json FROM config")
    if not rows:
        raise ValueError(f"{Path(run_dir) / 'run.db'} holds no config: not a training run")
    return json.loads(rows[0]["json"])


def resume_config(run_dir, overrides: list[str] = ()) -> Config:
    """`bapo train resume=RUN_DIR [key=value ...]`: the run's recorded config with the (allowed) changes."""
    from bapo_vl.config import parse_overrides

    return Config(**{**recorded_config(run_dir), **dict(parse_overrides(overrides)), "resume": str(run_dir)})


def check_resumable(cfg: Config, run_dir: Path):
    """A resumed run continues with the config it was started with: only RESUME_MAY_CHANGE may differ."""
    recorded = Config(**recorded_config(run_dir)).to_dict()
    given = cfg.to_dict()
    diff = [f"{k}: recorded {recorded[k]!r}, given {given[k]!r}" for k in recorded
            if k not in RESUME_MAY_CHANGE and recorded[k] != given.get(k)]
    if diff:
        raise ValueError(f"resume={run_dir} continues that run with its recorded config; these differ: "
                         + "; ".join(diff) + f" (only {', '.join(sorted(RESUME_MAY_CHANGE - {'resume'}))} "
                         "may change on resume)")


def open_run(cfg: Config, trainer: Trainer, problems) -> tuple[Path, RunRecord, int]:
    """A new run directory and record, or (resume=RUN_DIR) the old one restored to its latest complete checkpoint;
    steps recorded after that checkpoint are dropped, since they are trained again. The caller holds the lock."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        start = load_newest_checkpoint(trainer, run_dir)
        record = RunRecord.open(run_dir, truncate_after=start, sinks=make_sinks(cfg.report_to, run_dir, cfg.to_dict()))
        record.set_verifier(getattr(trainer.task, "version", ""), start + 1)
        return run_dir, record, start
    run_dir = run_path(cfg)
    record = RunRecord.create(run_dir, cfg.to_dict(), name=run_dir.name, backend=trainer.backend.name,
                              sinks=make_sinks(cfg.report_to, run_dir, cfg.to_dict()))
    record.set_verifier(getattr(trainer.task, "version", ""), 1)
    record.log_problems(problems)
    return run_dir, record, 0


def load_newest_checkpoint(trainer: Trainer, run_dir: Path) -> int:
    """Restore the newest checkpoint that loads; one that does not (a file damaged after it was written) is
    reported and the one before it tried. Returns its step."""
    steps = checkpoint_steps(run_dir)
    for step in reversed(steps):
        path = run_dir / "checkpoints" / f"step_{step}"
        try:
            trainer.load_state_dict(torch.load(path / STATE, weights_only=False))
            trainer.backend.load_checkpoint(path)
            return step
        except Exception as e:  # noqa: BLE001 - any damage: fall back to the previous checkpoint
            log.warning("resume: %s does not load (%s: %s); trying the checkpoint before it", path,
                        type(e).__name__, e)
    raise FileNotFoundError(f"resume={run_dir}: no checkpoint in {run_dir / 'checkpoints'} loads"
                            + (f" (tried steps {', '.join(map(str, reversed(steps)))})" if steps else ""))


def run_path(cfg: Config) -> Path:
    if cfg.resume:
        return Path(cfg.resume)
    return Path(cfg.run_dir) / (cfg.name or f"{cfg.algo}-{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}")


def train(cfg: Config, quiet: bool = False, backend=None) -> Path:
    """Run (or resume) training; `backend` defaults to the embedded one (verl_main passes a VerlBackend)."""
    if quiet:  # transformers' own loading / saving bars too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if cfg.resume:
        check_resumable(cfg, Path(cfg.resume))
    cfg = dataclasses.replace(cfg, name=cfg.name or run_path(cfg).name)  # one timestamp for the whole run
    task = get_task(cfg.task, cfg.tasks_dirs)
    problems = task.load(split="train", **cfg.task_options)
    backend = backend or make_backend(cfg)
    trainer = Trainer(cfg, backend, task, problems)
    lock = lock_run_dir(run_path(cfg))  # held from here until the record is closed, released on every path
    try:
        run_dir, record, start = open_run(cfg, trainer, problems)
    except BaseException:
        lock.close()
        raise
    status = "failed"
    try:
        progress = Progress(cfg.steps, start, quiet)
        try:
            for t in range(start + 1, cfg.steps + 1):
                result = trainer.step(t)
                m = result.metrics
                rows, samples = record_rows(result, cfg.log_samples)
                record.log_step(t, {k: v for k, v in m.items() if k != "verdicts"}, groups=rows, samples=samples,
                                verdicts=m["verdicts"])
                progress.update(t, m)
                if cfg.save_every and t % cfg.save_every == 0:
                    save_checkpoint(trainer, run_dir, t)
        finally:
            progress.close()
        if start < cfg.steps:
            save_checkpoint(trainer, run_dir, cfg.steps)
        backend.save_pretrained(run_dir / "final")
        status = "finished"
    finally:
        record.finish(status)
        record.close()
        lock.close()
    return run_dir
