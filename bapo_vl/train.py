"""`bapo train`: load the task and the backend, run the steps, write the run record and checkpoints."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from bapo_vl.config import Config
from bapo_vl.plugins import get_task
from bapo_vl.record import RunRecord, make_sinks
from bapo_vl.trainer import StepResult, Trainer

log = logging.getLogger(__name__)


def make_backend(cfg: Config):
    from bapo_vl.backends.embedded import EmbeddedBackend  # the only backend in this module's reach

    return EmbeddedBackend(cfg)


def record_rows(result: StepResult, log_samples: int):
    """Per-prompt rows (uid, correct, G, subset) and a few sampled responses, for the run record."""
    kept = {g.uid for g in result.x1}
    promoted = {g.uid for g in result.x2}
    rows = [(g.uid, g.correct, len(g.samples), "fresh" if g.uid in kept else "filtered") for g in result.fresh]
    rows += [(g.uid, g.correct, len(g.samples), "x2" if g.uid in promoted else "reeval") for g in result.reevaluated]
    rows += [(g.uid, g.correct, len(g.samples), "x3") for g in result.x3]
    samples = [(g.uid, "fresh", j, s.text, s.reward, s.verdict)
               for g in result.fresh[:log_samples] for j, s in enumerate(g.samples)]
    samples += [(g.uid, "x2", j, s.text, s.reward, s.verdict) for g in result.x2[:log_samples]
                for j, s in enumerate(g.samples)]
    return rows, samples


def _progress(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"))


def save_checkpoint(trainer: Trainer, run_dir: Path, step: int):
    """BAPO state (buffers, thresholds, data position, backend bookkeeping) in state.pt, plus whatever the
    backend keeps in its own format (verl: actor and optimizer checkpoints)."""
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True, exist_ok=True)
    trainer.backend.save_checkpoint(path, step)
    torch.save(trainer.state_dict(), path / "state.pt")
    (run_dir / "checkpoints" / "latest").write_text(str(step))
    return path


def open_run(cfg: Config, trainer: Trainer, problems) -> tuple[Path, RunRecord, int]:
    """A new run directory and record, or (resume=RUN_DIR) the old one restored to its latest checkpoint;
    steps recorded after that checkpoint are dropped, since they are trained again."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        latest = run_dir / "checkpoints" / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"resume={run_dir}: no checkpoint there ({latest} is missing)")
        start = int(latest.read_text())
        path = run_dir / "checkpoints" / f"step_{start}"
        trainer.load_state_dict(torch.load(path / "state.pt", weights_only=False))
        trainer.backend.load_checkpoint(path)
        record = RunRecord.open(run_dir, truncate_after=start, sinks=make_sinks(cfg.report_to, run_dir, cfg.to_dict()))
        record.set_verifier(getattr(trainer.task, "version", ""), start + 1)
        return run_dir, record, start
    name = cfg.name or f"{cfg.algo}-{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.run_dir) / name
    record = RunRecord.create(run_dir, cfg.to_dict(), name=name, backend=trainer.backend.name,
                              sinks=make_sinks(cfg.report_to, run_dir, cfg.to_dict()))
    record.set_verifier(getattr(trainer.task, "version", ""), 1)
    record.log_problems(problems)
    return run_dir, record, 0


def train(cfg: Config, quiet: bool = False, backend=None) -> Path:
    """Run (or resume) training; `backend` defaults to the embedded one (verl_main passes a VerlBackend)."""
    task = get_task(cfg.task, cfg.tasks_dirs)
    problems = task.load(split="train", **cfg.task_options)
    backend = backend or make_backend(cfg)
    trainer = Trainer(cfg, backend, task, problems)
    run_dir, record, start = open_run(cfg, trainer, problems)
    status = "failed"
    try:
        with _progress(cfg.steps) as progress:
            bar = progress.add_task("train", total=cfg.steps, completed=start, info="", visible=not quiet)
            for t in range(start + 1, cfg.steps + 1):
                result = trainer.step(t)
                m = result.metrics
                rows, samples = record_rows(result, cfg.log_samples)
                record.log_step(t, {k: v for k, v in m.items() if k != "verdicts"}, groups=rows, samples=samples,
                                verdicts=m["verdicts"])
                progress.update(bar, advance=1, info=(
                    f"reward {m['fresh_reward']:.3f} |X1| {m['x1']} |X2| {m['x2']} |X3| {m['x3']} "
                    f"B_bad {m['bad_size']} B_high {m['high_size']}"))
                if cfg.save_every and t % cfg.save_every == 0:
                    save_checkpoint(trainer, run_dir, t)
        if start < cfg.steps:
            save_checkpoint(trainer, run_dir, cfg.steps)
        backend.save_pretrained(run_dir / "final")
        status = "finished"
    finally:
        record.finish(status)
        record.close()
    return run_dir
