"""`bapo eval`: accuracy of a policy on a task's evaluation sets, k samples per problem.

    bapo eval countdown-tiny --task countdown --k 8                       # hub id, local path or bundled policy
    bapo eval runs/bapo-countdown-x                                       # a run: its final/ policy, task, template
    bapo eval runs/bapo-countdown-x --checkpoint 30 --run runs/bapo-countdown-x   # checkpoints/step_30, recorded

Per evaluation set (a split of the task, by default its EVAL_SPLITS):
    mean@k   mean accuracy over all k samples of all problems
    pass@k   fraction of problems with at least one correct sample among its k (the unbiased estimator of
             Chen et al. 2021 with n = k samples, which is exactly that)
    correct / wrong / unparsable / timeout   verdict counts over all samples (verifier health)
and the average over the sets (each set weighs the same; verdict counts are summed).

Generation goes through the backend contract (bapo_vl/backends/base.py) of the embedded backend, as in training
(chat template, images via Problem.images), with one model copy (delay=1, kl_coef=0) and no log-probs. It samples
at `temperature`; temperature 0 is greedy decoding (k must be 1).

Defaults, so that a policy is asked what it was trained to answer: a run gives its task, prompt template,
lengths and image sizes; a bare model takes them from the training preset (bapo_vl/presets) that trains that model
on that task (countdown-tiny on countdown: `tiny`, compact prompts, 40 new tokens), else from Config. Prompt and
response then have to fit the model's positions (max_position_embeddings): a default response length is cut to
what the prompt bound leaves, and at least half the positions stay for the response (the prompt bound shrinks).

With --run the record is checked for writability before anything is computed; a write that fails anyway leaves
the results printed and says they were not recorded (exit status 1).

With --against BEFORE.json (an earlier `--out` file, e.g. of the start policy) each set shared by both also gets
the paired difference of mean@k, this evaluation minus that one, over the problems both evaluated, with a 95 %
bootstrap interval over problems and its two-sided p (bapo_vl.stats): "did training change this policy?" on the
same held-out problems; with several sets, also over all of their problems as one pool. The file is read before
anything is computed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sqlite3
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bapo_vl.backends.base import Backend
from bapo_vl.config import FIELDS as CONFIG_FIELDS
from bapo_vl.config import PRESET_DIR, Config, load_config
from bapo_vl.plugins import Task, accepts, check_load_options, get_task
from bapo_vl.problem import Problem, Verdict
from bapo_vl.record import DB_NAME, SCHEMA_VERSION, RunRecord, not_writable, query_ro, read_meta

# Fields a run's (or preset's) config passes on to the evaluation of its policy (unless given).
INHERITED = ("max_prompt_length", "max_response_length", "min_pixels", "max_pixels")
VERDICTS = [v.value for v in Verdict]


@dataclass
class EvalOptions:
    model: str
    """hub id, local path, bundled policy name, a run directory (its final/ policy) or RUN/checkpoints/step_N"""
    task: str | None = None
    """task plugin name; default: the run's task when `model` is a run"""
    splits: list[str] | None = None
    """evaluation sets (split names the task's load() accepts); default: the task's EVAL_SPLITS"""
    checkpoint: int | None = None
    """with a run directory: evaluate checkpoints/step_N instead of final/"""
    source: str | None = None
    """passed to load(source=...) when given"""
    template: str | None = None
    """passed to load(template=...); default: the run's (or the model's preset's) task_options.template"""
    limit: int | None = None
    """first N problems of each set (also passed to load() when it takes `limit`)"""
    options: dict = field(default_factory=dict)
    """other load() options"""
    k: int = 8
    """samples per problem"""
    temperature: float = 1.0
    """sampling temperature; 0 = greedy (then k must be 1)"""
    max_new_tokens: int | None = None
    """response length limit; default: the run's (or preset's) max_response_length, within the model's positions"""
    batch_size: int | None = None
    """sequences per generate call; default: generate_batch_size (EmbeddedOptions)"""
    device: str = "auto"
    seed: int = 0
    tasks_dirs: list = field(default_factory=list)
    """extra folders searched for task plugins (added to the run's tasks_dirs)"""
    run: str | None = None
    """also record the results in this run's record (evals table)"""
    step: int | None = None
    """step the recorded results belong to; default: the checkpoint's step, else the run's last step"""
    quiet: bool = False
    """no progress bar"""
    against: str | None = None
    """a previous evaluation's JSON (--out) of the same problems: also report this one minus it, paired by problem"""

    def __post_init__(self):
        checks = [
            (self.k >= 1, f"k={self.k}: need at least one sample per problem"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy)"),
            (self.temperature > 0 or self.k == 1, "temperature 0 (greedy) gives one answer per problem: use k=1"),
            (self.limit is None or self.limit >= 1, f"limit={self.limit} must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# ----------------------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k). With n == k it is 1 when
    any sample is correct, else 0.
    >>> pass_at_k(2, 1, 2), pass_at_k(2, 0, 2), pass_at_k(4, 1, 2)
    (1.0, 0.0, 0.5)"""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def set_metrics(correct: list[int], k: int, verdicts: Counter) -> dict:
    """mean@k, pass@k and verdict counts of one set; `correct[i]` = correct samples of problem i (out of k)."""
    n = len(correct)
    return {"n": n, "k": k,
            "mean@k": sum(correct) / (n * k) if n else 0.0,
            "pass@k": sum(pass_at_k(k, c, k) for c in correct) / n if n else 0.0,
            **{v: verdicts.get(v, 0) for v in VERDICTS}}


def average(sets: dict[str, dict]) -> dict:
    """Mean of the sets' mean@k and pass@k (each set weighs the same); problems and verdicts summed."""
    m = len(sets) or 1
    return {"n": sum(s["n"] for s in sets.values()),
            "mean@k": sum(s["mean@k"] for s in sets.values()) / m,
            "pass@k": sum(s["pass@k"] for s in sets.values()) / m,
            **{v: sum(s[v] for s in sets.values()) for v in VERDICTS}}


# ----------------------------------------------------------------------------- the policy


def resolve_policy(model: str, checkpoint: int | None = None) -> tuple[str, Path | None, dict, Path | None]:
    """(what from_pretrained loads, checkpoint folder or None, the run's config or {}, the run dir or None).
    A run directory gives its final/ policy, or with `checkpoint` its checkpoints/step_N weights on top of the
    run's base model; RUN/checkpoints/step_N names a checkpoint directly."""
    path = Path(model)
    if path.parent.name == "checkpoints" and path.name.removeprefix("step_").isdigit() and path.is_dir():
        path, checkpoint = path.parent.parent, int(path.name.removeprefix("step_"))
    is_run = (path / DB_NAME).is_file() or (path / "final").is_dir() or (path / "checkpoints").is_dir()
    if not is_run:
        if checkpoint is not None:
            raise ValueError(f"checkpoint={checkpoint} needs a run directory as the model, not {model!r}")
        return model, None, {}, None
    rows = query_ro(path, "SELECT json FROM config") if (path / DB_NAME).is_file() else []
    config = json.loads(rows[0]["json"]) if rows else {}
    if checkpoint is None:
        if not (path / "final").is_dir():
            raise FileNotFoundError(f"{path} has no final/ policy (did the run finish?); evaluate a checkpoint "
                                    f"instead with --checkpoint N ({_checkpoints(path)})")
        return str(path / "final"), None, config, path
    folder = path / "checkpoints" / f"step_{checkpoint}"
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint {folder} ({_checkpoints(path)})")
    if "model" not in config:
        raise FileNotFoundError(f"{path}: the run record holds no config, so the base model of {folder} is unknown")
    return config["model"], folder, config, path


def _checkpoints(run_dir: Path) -> str:
    steps = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
                   if p.name.removeprefix("step_").isdigit())
    return f"checkpoints: {', '.join(map(str, steps))}" if steps else "the run has no checkpoints"


def preset_config(model: str, task: str) -> dict:
    """The config of the training preset (bapo_vl/presets/<name>.yaml) that trains `model` on `task`, or {}: the
    lengths and prompt template a bare model is evaluated with. A preset built on another (`preset:`, the verl_*.yaml)
    is passed over: the one it builds on states the model."""
    from bapo_vl.models import resolve_model

    wanted = _same_model(resolve_model(model))
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        if not set(yaml.safe_load(path.read_text()) or {}) <= set(CONFIG_FIELDS):
            continue
        cfg = load_config(path.stem)
        if cfg.run.task == task and _same_model(resolve_model(cfg.run.model)) == wanted:
            return cfg.to_dict()
    return {}


def _same_model(name: str) -> str:
    return str(Path(name).resolve()) if Path(name).exists() else name


def model_positions(model: str) -> int | None:
    """max_position_embeddings of `model` (its text model's, for a VL model), read from its config alone."""
    from transformers import AutoConfig

    from bapo_vl.models import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(model))
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def fit_lengths(prompt: int, response: int, positions: int | None, response_given: bool) -> tuple[int, int]:
    """(max_prompt_length, max_response_length) with prompt + response <= positions: a default response length is
    cut to what the prompt bound leaves but keeps at least half the positions (the prompt bound shrinks to make
    room); a given one stays and the prompt bound shrinks.
    >>> fit_lengths(64, 40, 256, False), fit_lengths(2048, 8192, 4096, False), fit_lengths(2048, 8192, 256, False)
    ((64, 40), (2048, 2048), (128, 128))"""
    if positions is None or prompt + response <= positions:
        return prompt, response
    if not response_given:
        response = max(positions - prompt, positions // 2)
    if response >= positions:
        raise ValueError(f"--max-new-tokens {response} leaves no room for a prompt: the model reads at most "
                         f"{positions} positions")
    return min(prompt, positions - response), response


def eval_config(opts: EvalOptions, model: str, defaults: dict) -> Config:
    """The backend's config: one model copy; the lengths and image sizes of `defaults` (the run's or preset's
    config) unless given, fitted to the model's positions."""
    fields = {k: defaults[k] for k in INHERITED if k in defaults}
    fields.update(model=model, device=opts.device, seed=opts.seed, delay=1, kl_coef=0.0,
                  temperature=opts.temperature or 1.0)  # greedy decoding ignores the temperature
    if opts.max_new_tokens is not None:
        fields["max_response_length"] = opts.max_new_tokens
    if opts.batch_size is not None:
        fields["generate_batch_size"] = opts.batch_size
    cfg = Config.from_dict(fields)
    prompt, response = fit_lengths(cfg.sampling.max_prompt_length, cfg.sampling.max_response_length,
                                   model_positions(model), opts.max_new_tokens is not None)
    return dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, max_prompt_length=prompt,
                                                                 max_response_length=response))


def load_backend(cfg: Config, checkpoint: Path | None) -> Backend:
    """The embedded backend holding one copy of the policy (a checkpoint's weights when given)."""
    from bapo_vl.train import make_backend

    backend = make_backend(cfg)
    if checkpoint is not None:
        backend.load_checkpoint(checkpoint, policy_only=True)
    return backend


# ----------------------------------------------------------------------------- the sets


def load_sets(task: Task, splits: list[str], options: dict, limit: int | None) -> dict[str, list[Problem]]:
    """{split: problems}; `limit` keeps the first N of each (and goes to load() when it takes `limit`)."""
    if limit is not None and accepts(task.load, split="x", limit=limit):
        options = {**options, "limit": limit}
    check_load_options(task, options, "--option")
    sets = {}
    for split in splits:
        problems = task.load(split=split, **options)
        sets[split] = problems[:limit] if limit is not None else problems
        if not sets[split]:
            raise ValueError(f"task {task.name}: split {split!r} has no problems")
    return sets


def _progress(quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]eval {task.description}"), MofNCompleteColumn(), BarColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), disable=quiet)


def evaluate(backend: Backend, task: Task, sets: dict[str, list[Problem]], k: int, quiet: bool = False,
             greedy: bool = False, per_call: int = 32) -> dict[str, dict]:
    """Sample k responses per problem (`per_call` problems per generate call), verify them, and return the
    metrics of each set, plus "problems": {uid: correct count} and "seconds"."""
    from bapo_vl.trainer import verify_all

    results = {}
    with _progress(quiet) as progress:
        for split, problems in sets.items():
            bar = progress.add_task(split, total=len(problems))
            t0, correct, verdicts = time.perf_counter(), [], Counter()
            for i in range(0, len(problems), per_call):
                chunk = problems[i:i + per_call]
                outputs = backend.generate([backend.encode(p) for p in chunk], k, policy="current", greedy=greedy,
                                           logprobs=False)
                flat = verify_all(task, [backend.decode(r.tokens) for responses in outputs for r in responses],
                                  [p.answer for p, responses in zip(chunk, outputs) for _ in responses])
                verdicts.update(v.value for v in flat)
                start = 0
                for responses in outputs:
                    correct.append(sum(v is Verdict.CORRECT for v in flat[start:start + len(responses)]))
                    start += len(responses)
                progress.update(bar, advance=len(chunk))
            results[split] = set_metrics(correct, k, verdicts) | {
                "seconds": time.perf_counter() - t0,
                "problems": {p.uid: c for p, c in zip(problems, correct)}}
    return results


# ----------------------------------------------------------------------------- the run record


def check_recordable(run_dir) -> None:
    """Refuse --run RUN_DIR before anything is computed when the results could not be written there."""
    if not (Path(run_dir) / DB_NAME).is_file():
        raise FileNotFoundError(f"--run {run_dir}: no run record there ({Path(run_dir) / DB_NAME})")
    version = int(read_meta(run_dir)["schema_version"])  # a damaged file raises UnreadableRecordError, naming it
    if version > SCHEMA_VERSION:  # an older one is upgraded when written to
        raise ValueError(f"--run {run_dir}: its record has schema version {version}, newer than this bapo-vl's "
                         f"({SCHEMA_VERSION}): upgrade bapo-vl")
    reason = not_writable(run_dir)
    if reason:
        raise ValueError(f"--run {run_dir}: the results cannot be recorded there ({reason}); drop --run, or "
                         f"evaluate a writable copy of the run")


def log_to_run(run_dir, task_name: str, result: dict, step: int | None = None) -> int:
    """Write each set's metrics (and the average) into the run's evals table as `<task>/<set>` and
    `<task>/average` at `step` (default: the run's last step). Returns the step used."""
    run_dir = Path(run_dir)
    if step is None:
        step = query_ro(run_dir, "SELECT COALESCE(MAX(step), 0) FROM steps")[0][0]
    record = RunRecord.open(run_dir, resume=False)  # an evaluation resumes nothing: status stays as it is
    try:
        named = {f"{task_name}/{s}": m for s, m in result["sets"].items()} | {f"{task_name}/average": result["average"]}
        for name, metrics in named.items():
            record.log_eval(step, name, {k: v for k, v in metrics.items() if k not in ("problems", "seconds")})
    finally:
        record.close()
    return step


# ----------------------------------------------------------------------------- `bapo eval`


@dataclass
class Setup:
    """What an evaluation runs on: the task, its sets, the config and the policy to load."""
    task: Task
    sets: dict[str, list[Problem]]
    options: dict
    cfg: Config
    model: str
    checkpoint_dir: Path | None
    run_dir: Path | None


def setup(opts: EvalOptions) -> Setup:
    """Resolve the policy, the task and its sets, and the config, as `bapo eval` does (nothing loaded yet)."""
    model, checkpoint_dir, run_config, run_dir = resolve_policy(opts.model, opts.checkpoint)
    if run_dir is None:  # a run's own model was checked when it trained
        from bapo_vl.train import check_model

        check_model(model, key="")
    task_name = opts.task or run_config.get("task")
    if not task_name:
        raise ValueError(f"{opts.model} is not a run directory: name the task with --task")
    task = get_task(task_name, [*run_config.get("tasks_dirs", []), *opts.tasks_dirs])
    splits = opts.splits or task.eval_splits
    if not splits:
        raise ValueError(f"task {task.name} ({task.origin}) declares no EVAL_SPLITS: name the sets with --splits")
    if opts.run:
        check_recordable(opts.run)
    defaults = run_config or preset_config(opts.model, task.name)
    template = opts.template or (defaults.get("task_options") or {}).get("template")
    options = {**opts.options, **{k: v for k, v in (("source", opts.source), ("template", template)) if v is not None}}
    sets = load_sets(task, splits, options, opts.limit)
    return Setup(task, sets, options, eval_config(opts, model, defaults), model, checkpoint_dir, run_dir)


def read_against(file: str, label: str | None = None) -> dict:
    """An earlier `bapo eval --out` result, or one ValueError line naming it (`label`, default "--against FILE") and
    what is wrong with it."""
    label = label or f"--against {file}"
    try:
        base = json.loads(Path(file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: not a readable evaluation JSON ({type(e).__name__}: {e})") from e
    sets = base.get("sets") if isinstance(base, dict) else None
    if not isinstance(sets, dict) or not isinstance(base.get("k"), int) or not all(
            isinstance(m, dict) and isinstance(m.get("problems"), dict) for m in sets.values()):
        raise ValueError(f"{label}: not a `bapo eval --out` result (needs k and sets with per-problem counts)")
    return base


def check_against(base: dict, file: str, task: str, sets) -> list[str]:
    """The sets this evaluation shares with `base` (checked before anything is generated), or one ValueError line."""
    if base.get("task") not in (None, task):
        raise ValueError(f"--against {file}: it evaluated task {base['task']}, this evaluation {task}")
    shared = [name for name in sets if name in base["sets"]]
    if not shared:
        raise ValueError(f"--against {file}: no set in common (it has {', '.join(base['sets']) or 'none'}; this "
                         f"evaluation has {', '.join(sets)})")
    return shared


def paired_against(result: dict, base: dict, file: str, shared: list[str], n_resamples: int = 10_000) -> dict:
    """This evaluation minus `base`, per shared set (check_against's): mean@k paired by problem uid, with a
    bootstrap interval; with several sets paired, also over all their problems as one pool ("pooled")."""
    from bapo_vl.stats import hierarchical_bootstrap_diff

    out, pool_a, pool_b = {}, [], []
    for name in shared:
        mine, theirs = result["sets"][name]["problems"], base["sets"][name]["problems"]
        uids = [u for u in mine if u in theirs]
        if not uids:  # found only now, so the evaluation is kept and says so
            out[name] = {"problems": 0, "error": f"no problem uid in common with {file}"}
            continue
        a = [[mine[u] / result["k"] for u in uids]]
        b = [[theirs[u] / base["k"] for u in uids]]
        pool_a += a[0]
        pool_b += b[0]
        d = hierarchical_bootstrap_diff(a, b, n_resamples=n_resamples)
        out[name] = {"diff": d["diff"], "low": d["low"], "high": d["high"], "p": d["p"], "problems": len(uids),
                     "only_here": len(mine) - len(uids), "only_there": len(theirs) - len(uids)}
    paired = [name for name in out if "diff" in out[name]]
    pooled = None
    if len(paired) > 1:  # the sets as one pool of problems: one interval over all of them
        d = hierarchical_bootstrap_diff([pool_a], [pool_b], n_resamples=n_resamples)
        pooled = {"sets": paired, "diff": d["diff"], "low": d["low"], "high": d["high"], "p": d["p"],
                  "problems": len(pool_a)}
    return {"file": file, "k": base["k"], "temperature": base.get("temperature"), "sets": out, "pooled": pooled}


def run_eval(opts: EvalOptions) -> dict:
    """The whole of `bapo eval` but the printing: returns the result as one JSON-able object."""
    t0 = time.perf_counter()
    base = read_against(opts.against) if opts.against else None
    s = setup(opts)
    shared = check_against(base, opts.against, s.task.name, s.sets) if base is not None else []
    backend = load_backend(s.cfg, s.checkpoint_dir)
    per_set = evaluate(backend, s.task, s.sets, opts.k, quiet=opts.quiet, greedy=opts.temperature == 0,
                       per_call=max(1, s.cfg.embedded.generate_batch_size // opts.k))
    checkpoint = int(s.checkpoint_dir.name.removeprefix("step_")) if s.checkpoint_dir is not None else None
    result = {
        "model": opts.model, "policy": s.model if s.checkpoint_dir is None else str(s.checkpoint_dir),
        "checkpoint": checkpoint, "task": s.task.name, "task_origin": s.task.origin,
        "verifier_version": s.task.version, "splits": list(s.sets), "options": s.options,
        "k": opts.k, "temperature": opts.temperature, "max_new_tokens": s.cfg.sampling.max_response_length,
        "seed": opts.seed, "sets": per_set, "average": average(per_set),
        "run": None, "step": None, "not_recorded": None, "seconds": None, "against": None,
    }
    if base is not None:
        result["against"] = paired_against(result, base, opts.against, shared)
    if opts.run:
        same_run = s.run_dir is not None and Path(opts.run).resolve() == s.run_dir.resolve()
        step = opts.step if opts.step is not None else checkpoint if same_run else None
        try:
            result["run"], result["step"] = str(opts.run), log_to_run(opts.run, s.task.name, result, step)
        except (sqlite3.Error, OSError, ValueError) as e:  # checked before, but a disk can fill or be remounted
            result["run"], result["not_recorded"] = None, f"{opts.run}: {type(e).__name__}: {e}"
    result["seconds"] = time.perf_counter() - t0
    return result


def print_result(result: dict) -> None:
    from bapo_vl.runs_cli import _print_table

    k = result["k"]
    rows = [[name, str(m["n"]), f"{m['mean@k']:.3f}", f"{m['pass@k']:.3f}", *(str(m[v]) for v in VERDICTS)]
            for name, m in [*result["sets"].items(), ("average", result["average"])]]
    where = f" checkpoint {result['checkpoint']}" if result["checkpoint"] is not None else ""
    _print_table(f"{result['task']}: {result['model']}{where}, k={k}, temperature={result['temperature']}",
                 ["set", "problems", f"mean@{k}", f"pass@{k}", *VERDICTS], rows)
    against = result.get("against")
    for name, d in (against["sets"] if against else {}).items():
        if d.get("error"):
            print(f"{name} against {against['file']}: {d['error']}", file=sys.stderr)
            continue
        unpaired = (f"; unpaired: {d['only_here']} here, {d['only_there']} there"
                    if d["only_here"] or d["only_there"] else "")
        print(f"{name} against {against['file']} (k={against['k']}): \u0394 mean@k {d['diff']:+.3f} "
              f"[{d['low']:+.3f}, {d['high']:+.3f}], p {d['p']:.4f}, {d['problems']} problems paired{unpaired}")
    if against and (d := against.get("pooled")):
        print(f"{' + '.join(d['sets'])} pooled against {against['file']} (k={against['k']}): \u0394 mean@k "
              f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}], p {d['p']:.4f}, {d['problems']} problems paired")
    if result["run"]:
        print(f"recorded in {result['run']} (evals table) at step {result['step']}")
    if result["not_recorded"]:
        print(f"NOT recorded: {result['not_recorded']}", file=sys.stderr)


def cmd_eval(opts: EvalOptions, as_json: bool = False, out: str | None = None) -> int:
    result = run_eval(opts)
    text = json.dumps(result, allow_nan=False)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if as_json:
        print(text)
    else:
        print_result(result)
        if out:
            print(f"results: {out}")
    if result["not_recorded"] and as_json:
        print(f"NOT recorded: {result['not_recorded']}", file=sys.stderr)
    return 1 if result["not_recorded"] else 0


FIELDS = {f.name for f in dataclasses.fields(EvalOptions)}
