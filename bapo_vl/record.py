"""The run record: one SQLite file `run.db` per run directory (stdlib sqlite3, no ORM).

Training writes it; the dashboard and `bapo runs show` read it *while* training runs. That is why the
database is in WAL mode: readers open read-only connections (`file:...?mode=ro`) that see the last
committed step and never block the writer, and the writer commits one short transaction per step.

Schema (SCHEMA_VERSION = 1; JSON columns are text):

    meta(key PRIMARY KEY, value)       schema_version, created_at, name, status (running/finished/failed),
                                       backend, bapo_vl_version, finished_at, resumed_at,
                                       verifier_version, verifier_versions ([[version, first step], ...])
    config(json)                       the full config, one row
    steps(step PRIMARY KEY, time,      one row per training step; `metrics` holds every key the trainer
          metrics JSON, bins JSON,     logged (known or not), the other columns copy the most queried ones
          x1, x2, x3, batch_size, ...) (see STEP_COLUMNS). `bins` = fresh groups per accuracy bin 0/G..G/G.
    prompt_steps(step, uid, correct,   one row per group seen at a step. subset is one of SUBSETS:
          G, subset)                   fresh    fresh group kept by the X1 filter
                                       filtered fresh group dropped by the X1 filter
                                       x2       re-evaluated B_bad group, promoted into the batch
                                       reeval   re-evaluated B_bad group, not promoted
                                       x3       replay of stored B_high responses (no new generation)
    problems(uid PRIMARY KEY, text,    written once per uid; image = PNG bytes of the first image (VL tasks)
          answer JSON, meta JSON, image)
    samples(step, uid, subset, idx,    a sample of responses, for reading what the model wrote
          response, reward, verdict)
    verdicts(step, verdict, count)     verifier health: correct / wrong / unparsable / timeout per step
    evals(step, name, metric, value)   held-out evaluations

Everything that asks "was this prompt generated for at step t" (accuracy bins, migration matrix,
hard-problem ledger) uses the GENERATED subsets only: x3 rows replay old responses, so their
correct count says nothing about the policy at step t.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import bapo_vl

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "run.db"

# Metric keys that also get their own column in `steps` (all keys still go into `steps.metrics`).
STEP_COLUMNS = {
    "x1": "INTEGER",  # |X1|, filtered fresh groups in the batch
    "x2": "INTEGER",  # |X2|, promoted re-evaluated groups
    "x3": "INTEGER",  # |X3|, replayed B_high groups
    "batch_size": "INTEGER",  # configured B (the batch may be smaller)
    "bad_size": "INTEGER",  # |B_bad| after the step
    "high_size": "INTEGER",  # |B_high| after the step
    "c2": "REAL",
    "c3": "REAL",
    "r_tot": "REAL",  # global running average reward (drives c2, c3)
    "rollouts": "INTEGER",  # responses generated this step: fresh + re-evaluation
    "fresh_reward": "REAL",  # mean reward of all fresh rollouts, before filtering
    "reward": "REAL",  # mean reward of the training batch
    "loss": "REAL",
    "kl": "REAL",
    "entropy": "REAL",
    "clip_frac": "REAL",
    "t_generate": "REAL",
    "t_score": "REAL",
    "t_train": "REAL",
    "t_sync": "REAL",
}
GENERATED = ("fresh", "filtered", "x2", "reeval")  # subsets with their own new generation at that step
SUBSETS = GENERATED + ("x3",)

_step_cols = ",\n    ".join(f"{k} {t}" for k, t in STEP_COLUMNS.items())
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS config (json TEXT);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    time REAL,
    metrics TEXT,
    bins TEXT,
    {_step_cols}
);
CREATE TABLE IF NOT EXISTS prompt_steps (
    step INTEGER, uid TEXT, correct INTEGER, G INTEGER, subset TEXT,
    PRIMARY KEY (step, uid, subset)
);
CREATE INDEX IF NOT EXISTS prompt_steps_uid ON prompt_steps (uid);
CREATE TABLE IF NOT EXISTS problems (uid TEXT PRIMARY KEY, text TEXT, answer TEXT, meta TEXT, image BLOB);
CREATE TABLE IF NOT EXISTS samples (
    step INTEGER, uid TEXT, subset TEXT, idx INTEGER, response TEXT, reward REAL, verdict TEXT
);
CREATE INDEX IF NOT EXISTS samples_step ON samples (step);
CREATE TABLE IF NOT EXISTS verdicts (step INTEGER, verdict TEXT, count INTEGER);
CREATE INDEX IF NOT EXISTS verdicts_step ON verdicts (step);
CREATE TABLE IF NOT EXISTS evals (step INTEGER, name TEXT, metric TEXT, value REAL);
CREATE INDEX IF NOT EXISTS evals_step ON evals (step);
"""
PER_STEP_TABLES = ("steps", "prompt_steps", "samples", "verdicts", "evals")


def _now() -> str:
    # ISO 8601 with microseconds: sorts as text, so runs created a moment apart still order correctly
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _plain(x):
    """Make a metric value JSON-safe: numpy/torch scalars -> Python numbers, NaN/inf -> None (strict
    JSON, so a JavaScript dashboard can parse it), anything else unknown -> str."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "tolist") and callable(x.tolist):  # numpy / torch scalar or array -> Python
        return _plain(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _dumps(x) -> str:
    return json.dumps(_plain(x), allow_nan=False)


def _number(x):
    return x if isinstance(x, (int, float)) else None  # a stray string or list stays in the JSON only


def _png(image) -> bytes | None:
    if image is None or isinstance(image, (bytes, bytearray)):
        return image
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # PIL image
    return buf.getvalue()


def _fresh_bins(groups) -> list[int] | None:
    """Fresh groups (kept or filtered) per correct count 0..G; None if this step logged no fresh groups."""
    fresh = [(c, g) for _, c, g, s in groups if s in ("fresh", "filtered")]
    if not fresh:
        return None
    bins = [0] * (max(g for _, g in fresh) + 1)
    for c, g in fresh:
        bins[c] += 1
    return bins


# ----------------------------------------------------------------------------- scalar mirroring


class ScalarSink:
    """Somewhere else to send numeric metrics (the run record stays the source of truth)."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardSink(ScalarSink):
    def __init__(self, run_dir, config):
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package
        except ImportError as e:
            raise ImportError("the tensorboard sink needs tensorboard: pip install 'bapo-vl[tensorboard]'") from e
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step, scalars):
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # one flush per step: lets TensorBoard follow a live run

    def close(self):
        self.writer.close()


class WandbSink(ScalarSink):
    def __init__(self, run_dir, config):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("the wandb sink needs wandb: pip install 'bapo-vl[wandb]'") from e
        # project from the usual wandb environment variable, so the config needs no wandb section
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "bapo-vl"), name=Path(run_dir).name,
                              dir=str(run_dir), config=config)

    def log(self, step, scalars):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


def make_sinks(kinds: list[str], run_dir, config) -> list[ScalarSink]:
    unknown = [k for k in kinds if k not in SINKS]
    if unknown:
        raise ValueError(f"unknown scalar sink(s) {unknown}; known: {sorted(SINKS)}")
    return [SINKS[k](run_dir, config) for k in kinds]


def _scalars(metrics: dict) -> dict[str, float]:
    # _plain turns tensors into Python numbers (or lists, which are no scalars) and NaN into None
    return {k: float(v) for k, v in _plain(metrics).items() if isinstance(v, (int, float))}


# ----------------------------------------------------------------------------- writer


class RunRecord:
    """Writer side of the record. One per run; all writes go through one connection."""

    def __init__(self, run_dir: Path, conn: sqlite3.Connection, sinks=()):
        self.run_dir, self.conn, self.sinks = run_dir, conn, list(sinks)

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")  # readers see committed steps without blocking us
        conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; a crash loses at most the last step
        return conn

    @classmethod
    def create(cls, run_dir, config: dict, name: str | None = None, backend: str = "embedded", *,
               resume: bool = False, sinks=()) -> "RunRecord":
        """Start the record of a new run in `run_dir` (created if needed). With resume=True an existing
        record is opened for appending instead (see `open`)."""
        run_dir = Path(run_dir)
        path = run_dir / DB_NAME
        if path.exists():
            if resume:
                return cls.open(run_dir, sinks=sinks)
            raise FileExistsError(f"{path} already exists: pick another run directory, or resume the run "
                                  f"(resume=True) to append to its record")
        run_dir.mkdir(parents=True, exist_ok=True)
        if dataclasses.is_dataclass(config):
            config = dataclasses.asdict(config)
        conn = cls._connect(path)
        with conn:
            conn.executescript(SCHEMA)
            meta = {"schema_version": SCHEMA_VERSION, "created_at": _now(), "name": name or run_dir.name,
                    "status": "running", "backend": backend, "bapo_vl_version": bapo_vl.__version__}
            conn.executemany("INSERT INTO meta VALUES (?, ?)", [(k, str(v)) for k, v in meta.items()])
            conn.execute("INSERT INTO config VALUES (?)", (json.dumps(config, default=str),))
        return cls(run_dir, conn, sinks)

    @classmethod
    def open(cls, run_dir, *, truncate_after: int | None = None, sinks=(), resume: bool = True) -> "RunRecord":
        """Reopen an existing record to append. With `resume` (training goes on) the run is marked running
        again; without it (e.g. adding evaluations) its status is left alone. `truncate_after=k` drops what
        was logged for steps > k, i.e. the steps after the checkpoint that will be trained again."""
        run_dir = Path(run_dir)
        path = run_dir / DB_NAME
        if not path.exists():
            raise FileNotFoundError(f"no run record at {path}: start the run with RunRecord.create")
        conn = cls._connect(path)
        version = int(conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
        if version > SCHEMA_VERSION:
            conn.close()
            raise RuntimeError(f"{path} has schema version {version}, newer than this bapo-vl understands "
                               f"({SCHEMA_VERSION}): upgrade bapo-vl")
        with conn:
            if truncate_after is not None:
                for table in PER_STEP_TABLES:
                    conn.execute(f"DELETE FROM {table} WHERE step > ?", (truncate_after,))
            if resume:
                conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                 [("status", "running"), ("resumed_at", _now())])
        return cls(run_dir, conn, sinks)

    def set_verifier(self, version: str, from_step: int) -> None:
        """The task verifier's version judging the steps from `from_step` on. A resumed run whose verifier
        changed keeps the history: meta verifier_versions = [[version, first step], ...]."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'verifier_versions'").fetchone()
        history = [h for h in (json.loads(row[0]) if row else []) if h[1] < from_step]
        if history and history[-1][0] != version:
            log.warning("%s: verifier %s judged the steps before %d, %s judges the rest", self.run_dir,
                        history[-1][0] or "(unversioned)", from_step, version or "(unversioned)")
        if not history or history[-1][0] != version:
            history.append([version, from_step])
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                  [("verifier_version", version), ("verifier_versions", json.dumps(history))])

    def log_problems(self, problems: Iterable) -> None:
        """Store each problem once (by uid). Already stored uids are skipped before any PNG encoding."""
        problems = list(problems)
        uids = [p.uid for p in problems]
        known = set()
        for i in range(0, len(uids), 500):  # stay under SQLite's bound-variable limit
            chunk = uids[i:i + 500]
            q = f"SELECT uid FROM problems WHERE uid IN ({','.join('?' * len(chunk))})"
            known.update(r[0] for r in self.conn.execute(q, chunk))
        rows = []
        for p in problems:
            if p.uid in known:
                continue
            known.add(p.uid)
            images = getattr(p, "images", None) or []
            rows.append((p.uid, p.text, json.dumps(_plain(p.answer)), json.dumps(_plain(getattr(p, "meta", {}))),
                         _png(images[0]) if images else None))
        with self.conn:
            self.conn.executemany("INSERT OR IGNORE INTO problems VALUES (?, ?, ?, ?, ?)", rows)

    def log_step(self, step: int, metrics: dict, groups=(), samples=(), verdicts: dict[str, int] | None = None):
        """Record one training step in one transaction.

        metrics: flat dict; STEP_COLUMNS keys also fill their columns, every key is kept in the JSON.
          If it has no "bins" key, bins are counted from the fresh/filtered groups.
        groups: (uid, correct, G, subset) per group seen this step, subset in SUBSETS.
        samples: (uid, subset, idx, response, reward, verdict) for a sample of responses.
        verdicts: {verdict: count} over all responses scored this step.
        Logging a step again replaces it (a resumed run may redo steps)."""
        groups = [(str(u), int(c), int(g), s) for u, c, g, s in groups]
        bad = sorted({s for *_, s in groups if s not in SUBSETS})
        if bad:
            raise ValueError(f"unknown subset(s) {bad} in groups of step {step}; known: {list(SUBSETS)}")
        metrics = _plain(dict(metrics))
        if "bins" not in metrics and (bins := _fresh_bins(groups)) is not None:
            metrics["bins"] = bins
        cols = ["step", "time", "metrics", "bins", *STEP_COLUMNS]
        row = [step, time.time(), _dumps(metrics), _dumps(metrics.get("bins")),
               *(_number(metrics.get(k)) for k in STEP_COLUMNS)]
        with self.conn:
            for table in ("steps", "prompt_steps", "samples", "verdicts"):
                self.conn.execute(f"DELETE FROM {table} WHERE step = ?", (step,))
            self.conn.execute(f"INSERT INTO steps ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})", row)
            self.conn.executemany("INSERT INTO prompt_steps VALUES (?, ?, ?, ?, ?)",
                                  [(step, u, c, g, s) for u, c, g, s in groups])
            self.conn.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)",
                                  [(step, u, s, int(i), r, float(w), str(getattr(v, "value", v)))
                                   for u, s, i, r, w, v in samples])
            self.conn.executemany("INSERT INTO verdicts VALUES (?, ?, ?)",
                                  [(step, str(getattr(v, "value", v)), int(n)) for v, n in (verdicts or {}).items()])
        self._mirror(step, metrics)

    def log_eval(self, step: int, name: str, metrics: dict) -> None:
        rows = [(step, name, k, v) for k, v in _scalars(metrics).items()]
        with self.conn:
            self.conn.execute("DELETE FROM evals WHERE step = ? AND name = ?", (step, name))
            self.conn.executemany("INSERT INTO evals VALUES (?, ?, ?, ?)", rows)
        self._mirror(step, {f"eval/{name}/{k}": v for _, _, k, v in rows})

    def _mirror(self, step, metrics):
        scalars = _scalars(metrics)
        for sink in self.sinks:
            sink.log(step, scalars)

    def finish(self, status: str = "finished") -> None:
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                  [("status", status), ("finished_at", _now())])

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.finish("failed")  # a crash inside `with` leaves a record that says so
        self.close()


# ----------------------------------------------------------------------------- readers


def connect_ro(run_dir) -> sqlite3.Connection:
    """Read-only connection; in WAL mode it sees committed steps and never blocks the writer."""
    path = Path(run_dir) / DB_NAME
    if not path.exists():
        raise FileNotFoundError(f"no run record at {path}")
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=30)
    conn.row_factory = sqlite3.Row
    return conn


def query_ro(run_dir, sql: str, args=()) -> list[sqlite3.Row]:
    conn = connect_ro(run_dir)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def read_meta(run_dir) -> dict:
    return {r["key"]: r["value"] for r in query_ro(run_dir, "SELECT key, value FROM meta")}


def find_runs(root) -> list[Path]:
    """Run directories under root (root itself included) that hold a run.db, newest created first."""
    dirs = [p.parent for p in Path(root).rglob(DB_NAME)]

    def created(d):
        try:
            return read_meta(d).get("created_at", "")
        except sqlite3.Error:  # half-written or foreign file: fall back to the file's age
            return datetime.fromtimestamp((d / DB_NAME).stat().st_mtime, timezone.utc).isoformat()

    return sorted(dirs, key=created, reverse=True)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def read_steps(run_dir) -> list[dict]:
    rows = query_ro(run_dir, "SELECT step, time, metrics, bins FROM steps ORDER BY step")
    return [{"step": r["step"], "time": r["time"], **json.loads(r["metrics"]), "bins": json.loads(r["bins"])}
            for r in rows]


def _summary(steps: list[dict], ledger: dict) -> dict:
    n = len(steps)
    k = max(1, math.ceil(0.2 * n))  # first / last 20 % of steps, at least one
    return {
        "n_steps": n,
        "last_step": steps[-1]["step"] if steps else None,
        "rollouts": sum(s.get("rollouts") or 0 for s in steps),
        "fresh_reward_first": _mean(s.get("fresh_reward") for s in steps[:k]),
        "fresh_reward_last": _mean(s.get("fresh_reward") for s in steps[-k:]),
        "steps_with_x2": sum(1 for s in steps if (s.get("x2") or 0) > 0),
        "steps_with_x3": sum(1 for s in steps if (s.get("x3") or 0) > 0),
        "first_unsolved": ledger["first_unsolved"],
        "later_solved": ledger["later_solved"],
        "later_solved_fraction": ledger["fraction"],
    }


def read_run(run_dir) -> dict:
    """Everything about a run as plain JSON-able data: {"run_dir", "meta", "config", "steps", "summary"}.
    steps: one dict per step, {"step", "time", "bins", **every metric logged}, in step order.
    summary: n_steps, last_step, rollouts (total), fresh_reward_first / fresh_reward_last (mean fresh reward
    over the first / last 20 % of steps), steps_with_x2, steps_with_x3, first_unsolved, later_solved,
    later_solved_fraction (the hard-problem ledger counts)."""
    run_dir = Path(run_dir)
    config = query_ro(run_dir, "SELECT json FROM config")
    steps = read_steps(run_dir)
    ledger = hard_problem_ledger(run_dir)
    return {"run_dir": str(run_dir), "meta": read_meta(run_dir),
            "config": json.loads(config[0]["json"]) if config else {},
            "steps": steps, "summary": _summary(steps, ledger)}


_GEN = f"subset IN ({','.join(repr(s) for s in GENERATED)})"


def hard_problem_ledger(run_dir) -> dict:
    """Of the prompts that were 0/G the first time they were generated for, how many later reached >= 1/G.
    First time = lowest step with a generated row (x3 replays excluded); a uid with several generated rows
    at that step counts as unsolved only if all were 0/G. first_solved = lowest later step with correct >= 1."""
    rows = query_ro(run_dir, f"""
        WITH gen AS (SELECT step, uid, correct FROM prompt_steps WHERE {_GEN}),
        first AS (SELECT uid, MIN(step) AS first_seen FROM gen GROUP BY uid),
        unsolved AS (
            SELECT f.uid, f.first_seen FROM first f JOIN gen g ON g.uid = f.uid AND g.step = f.first_seen
            GROUP BY f.uid HAVING MAX(g.correct) = 0)
        SELECT u.uid, u.first_seen,
               (SELECT MIN(g.step) FROM gen g WHERE g.uid = u.uid AND g.step > u.first_seen AND g.correct >= 1)
               AS first_solved
        FROM unsolved u ORDER BY u.first_seen, u.uid""")
    rows = [dict(r) for r in rows]
    n, k = len(rows), sum(1 for r in rows if r["first_solved"] is not None)
    return {"first_unsolved": n, "later_solved": k, "fraction": k / n if n else 0.0, "rows": rows}


def _bins_by_uid(run_dir, step) -> tuple[dict[str, tuple[int, int]], int]:
    """{uid: (correct, G)} for groups generated at `step`, and the largest G. A uid generated twice in one
    step (fresh and re-evaluated) counts once, by its fresh group: bins count prompts, not groups."""
    rows = query_ro(run_dir, f"""
        SELECT uid, correct, G FROM prompt_steps WHERE step = ? AND {_GEN}
        ORDER BY CASE WHEN subset IN ('fresh', 'filtered') THEN 1 ELSE 0 END""", (step,))
    by_uid = {r["uid"]: (r["correct"], r["G"]) for r in rows}  # later (fresh) rows overwrite re-evaluated ones
    return by_uid, max((g for _, g in by_uid.values()), default=0)


def _bin(correct: int, g: int, G: int) -> int:
    return round(correct * G / max(g, 1))  # identity when every group has the same G


def accuracy_bins(run_dir, step: int) -> list[int]:
    """Prompts generated for at `step` (fresh, filtered, x2, reeval; not x3) per correct count 0..G."""
    by_uid, G = _bins_by_uid(run_dir, step)
    if not by_uid:
        return []
    bins = [0] * (G + 1)
    for c, g in by_uid.values():
        bins[_bin(c, g, G)] += 1
    return bins


def migration_matrix(run_dir, step_a: int, step_b: int) -> list[list[int]]:
    """m[i][j] = prompts generated for at both steps with i correct at step_a and j correct at step_b."""
    a, ga = _bins_by_uid(run_dir, step_a)
    b, gb = _bins_by_uid(run_dir, step_b)
    G = max(ga, gb)
    if G == 0:
        return []
    m = [[0] * (G + 1) for _ in range(G + 1)]
    for uid in a.keys() & b.keys():
        m[_bin(*a[uid], G)][_bin(*b[uid], G)] += 1
    return m
