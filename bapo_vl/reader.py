"""The one reader of a run record (bapo_vl/record.py), used by `bapo runs show` and the dashboard (bapo_vl.app).

`Run(run_dir)` reads through read-only connections, each batch of queries inside one read transaction
(`snapshot`): it sees one committed state and never blocks the trainer (WAL mode). Nothing here writes. What it
read is cached until the record changes, so a dashboard polling a live run pays only for what is new:
  - the small tables (meta, config, steps, evals) are read again when a step, an evaluation or the status changes;
  - every generated group (record.GENERATED: x3 replays say nothing about the policy at their step) is kept as
    numpy columns (`Generated`), read incrementally: an update scans only the steps committed since the last one
    (a primary-key range) and starts over only if older steps were rewritten (a resumed run).
The hard-problem ledger, accuracy bins and migration matrices are computed from those columns, with one bin rule
(`accuracy_bin`) and one rule for a prompt generated twice at one step: it counts once, by its fresh group. So a
prompt that was 0/G fresh and then >= 1/G when re-evaluated from B_bad at that same step is a hard prompt, retried
and solved at that step.
`read_run` is the run as plain JSON (`bapo runs show --json`); `summary` is the run in a few numbers.
A record of an older schema that it still reads (record.OLDEST_READABLE) is read as it is, its metrics under this
version's names (record.current_metrics: a version 2 record's t_score is t_verify).

Costs at 40,000 prompts x 500 steps (about 160,000 prompt_steps rows): the per-step table is 500 rows; the first
read of the generated groups takes about a second, each later step a few milliseconds; the ledger, histograms and
matrices are then numpy over those columns (milliseconds).
"""
from __future__ import annotations

import json
import math
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from bapo_vl.record import (DB_NAME, FRESH, GENERATED, SCHEMA_VERSION, STEP_COLUMNS, connect_ro, current_metrics,
                            shown_status, sql_in)

# per-step numbers the trainer logs only inside the metrics JSON, which the per-step table also carries
JSON_METRICS = ("c1", "rollouts_fresh", "rollouts_reevaluated", "trained_groups")
STEP_TABLE = ("step", "time", "bins", *STEP_COLUMNS, *JSON_METRICS)


@contextmanager
def snapshot(run_dir):
    """A read-only connection holding one read transaction: every query inside sees the same committed state."""
    conn = connect_ro(run_dir)
    try:
        conn.execute("BEGIN")
        yield conn
    finally:
        conn.close()  # ends the read transaction (nothing to commit)


# ----------------------------------------------------------------------------- accuracy bins


def accuracy_bin(correct, g, G: int) -> np.ndarray:
    """The bin 0..G of `correct` right out of `g` responses on the run's 0/G..G/G scale (the identity for groups
    of G responses). numpy, elementwise."""
    return np.clip(np.round(np.asarray(correct) * G / np.maximum(g, 1)), 0, G).astype(np.int64)


def histogram(bins: np.ndarray, G: int) -> list[int]:
    """Prompts per bin 0..G; `bins` is one bin per prompt, -1 where it was not generated for (Generated.bins)."""
    return np.bincount(bins[bins >= 0], minlength=G + 1).tolist()


def migration(rows: np.ndarray, cols: np.ndarray, G: int) -> list[list[int]]:
    """m[i][j] = prompts in bin i by `rows` and in bin j by `cols` (prompts missing from either are left out)."""
    both = (rows >= 0) & (cols >= 0)
    m = np.zeros((G + 1, G + 1), dtype=np.int64)
    np.add.at(m, (rows[both], cols[both]), 1)
    return m.tolist()


# ----------------------------------------------------------------------------- generated groups, incrementally


class Generated:
    """Every generated group of a run as numpy columns step, code (the uid's index in `uids`), correct, G, sorted
    by step and, within a step, re-evaluated before fresh groups: the last row of a uid at a step is the one it
    counts by. Read incrementally (see the module docstring)."""

    COLUMNS = ("step", "code", "correct", "G")

    def __init__(self):
        self.uids: list[str] = []
        self.index: dict[str, int] = {}
        self.cols = {c: np.zeros(0, dtype=np.int64) for c in self.COLUMNS}
        self.upto = 0  # steps <= upto are read
        self.signature: tuple = (0, 0.0)  # (count, total time) of the steps <= upto: changes if one is rewritten

    def __len__(self):
        return len(self.cols["step"])

    @staticmethod
    def _signature(conn, upto: int) -> tuple:
        return tuple(conn.execute("SELECT COUNT(*), TOTAL(time) FROM steps WHERE step <= ?", (upto,)).fetchone())

    def update(self, conn) -> None:
        if self._signature(conn, self.upto) != self.signature:
            self.__init__()
        last = conn.execute("SELECT MAX(step) FROM steps").fetchone()[0]
        if last is not None and last > self.upto:
            cur = conn.cursor()
            cur.row_factory = None  # plain tuples: much cheaper than sqlite3.Row for 10^5 rows
            rows = cur.execute(f"SELECT uid, step, correct, G, {sql_in(FRESH)} FROM prompt_steps "
                               f"WHERE step > ? AND step <= ? AND {sql_in(GENERATED)}", (self.upto, last)).fetchall()
            if rows:
                table = np.array(rows, dtype=object)  # (rows, 5): columns in C loops from here on
                step, correct, g, fresh = table[:, 1:].astype(np.int64).T
                local, uniques = pd.factorize(table[:, 0])  # hashing in C, not a Python loop
                index, uids = self.index, self.uids
                for u in uniques:  # at most one new code per prompt
                    if u not in index:
                        index[u] = len(uids)
                        uids.append(u)
                to_global = np.array([index[u] for u in uniques], dtype=np.int64)
                new = {"step": step, "code": to_global[local], "correct": correct, "G": g}
                order = np.lexsort((fresh, step))  # by step, then re-evaluated before fresh
                for c in self.COLUMNS:
                    self.cols[c] = np.concatenate([self.cols[c], new[c][order]])
            self.upto = last
        self.signature = self._signature(conn, self.upto)

    def frame(self) -> pd.DataFrame:
        """As a DataFrame (step, uid, correct, G), for reading and tests."""
        uids = np.array(self.uids, dtype=object)[self.cols["code"]] if len(self) else np.array([], dtype=object)
        return pd.DataFrame({"step": self.cols["step"], "uid": uids, "correct": self.cols["correct"],
                             "G": self.cols["G"]})

    def bins(self, lo: int | None, hi: int, G: int) -> np.ndarray:
        """Per uid code, the bin of the prompt's latest generated group at steps lo < step <= hi (lo None: from the
        start; lo = hi - 1: at step hi exactly); -1 where it was not generated for in that window."""
        step = self.cols["step"]
        sel = np.flatnonzero((step <= hi) if lo is None else (step > lo) & (step <= hi))
        code = self.cols["code"][sel][::-1]  # the last row per uid = its first in reverse
        _, first = np.unique(code, return_index=True)
        rows = sel[::-1][first]
        out = np.full(len(self.uids), -1, dtype=np.int64)
        out[self.cols["code"][rows]] = accuracy_bin(self.cols["correct"][rows], self.cols["G"][rows], G)
        return out

    def _first_groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first_seen per uid code, the row each prompt counts by at that step, the other rows): a prompt generated
        twice at its first step (fresh, then re-evaluated from B_bad at the same step) counts by its fresh group
        there (the step's last row); the re-evaluation is a later try like any other."""
        step, code = self.cols["step"], self.cols["code"]
        n = len(self.uids)
        first_seen = np.full(n, np.iinfo(np.int64).max)
        np.minimum.at(first_seen, code, step)
        at_first = np.flatnonzero(step == first_seen[code])
        _, last = np.unique(code[at_first][::-1], return_index=True)  # the last row per uid = its first in reverse
        counted = at_first[::-1][last]  # in uid-code order
        others = np.ones(len(step), dtype=bool)
        others[counted] = False
        return first_seen, counted, others

    def ledger(self) -> pd.DataFrame:
        """The hard-problem ledger: uid, first_seen, first_solved (<NA> while unsolved) of the prompts whose group
        at their first generated step was 0/G (by the fresh group, if it was also re-evaluated at that step);
        first_solved = the lowest step of any other generated group with >= 1 correct (the first step itself when
        its re-evaluation already solved it)."""
        step, code, correct = self.cols["step"], self.cols["code"], self.cols["correct"]
        n = len(self.uids)
        first_seen, counted, others = self._first_groups()
        hard = np.zeros(n, dtype=bool)
        hard[code[counted]] = correct[counted] == 0
        later = others & (correct >= 1)
        solved = np.full(n, -1)
        lc, li = np.unique(code[later], return_index=True)  # rows are in step order: first occurrence = lowest
        solved[lc] = step[later][li]
        hard = np.flatnonzero(hard)
        out = pd.DataFrame({"uid": np.array(self.uids, dtype=object)[hard] if n else np.array([], dtype=object),
                            "first_seen": first_seen[hard],
                            "first_solved": pd.array(np.where(solved[hard] >= 0, solved[hard], 0), dtype="Int64")})
        out.loc[solved[hard] < 0, "first_solved"] = pd.NA
        return out.sort_values(["first_seen", "uid"], kind="stable").reset_index(drop=True)

    def retries(self) -> np.ndarray:
        """Per uid code, how many more times the prompt was generated for after the group it counts by at its first
        step: a re-evaluation at that same step counts, and so does each later step (a prompt generated twice at
        one later step counts once)."""
        step, code = self.cols["step"], self.cols["code"]
        n = len(self.uids)
        _, _, others = self._first_groups()
        span = int(step.max()) + 1 if len(step) else 1
        pairs = np.unique(code[others] * span + step[others])  # one key per (prompt, step)
        return np.bincount(pairs // span, minlength=n)

    def first_retries(self) -> np.ndarray:
        """Per uid code, the step at which the prompt was first generated for again after the group it counts by
        at its first step (that step itself for a re-evaluation there); -1 if never."""
        step, code = self.cols["step"], self.cols["code"]
        _, _, others = self._first_groups()
        out = np.full(len(self.uids), -1)
        c, i = np.unique(code[others], return_index=True)  # rows are in step order: first occurrence = lowest
        out[c] = step[others][i]
        return out

    def regenerated_pair(self) -> tuple[int, int, int] | None:
        """(a, b, n): the pair of steps a < b with the most prompts generated for at a and next generated for at
        b (e.g. a re-evaluation step and the step its prompts came from), None if no prompt was generated twice."""
        step, code = self.cols["step"], self.cols["code"]
        if not len(step):
            return None
        order = np.lexsort((step, code))  # by prompt, then step
        c, s = code[order], step[order]
        nxt = (c[1:] == c[:-1]) & (s[1:] > s[:-1])
        if not nxt.any():
            return None
        span = int(s.max()) + 1
        keys, counts = np.unique(s[:-1][nxt] * span + s[1:][nxt], return_counts=True)  # one key per (a, b)
        best = int(np.argmax(counts))  # ties: the earliest pair
        return int(keys[best] // span), int(keys[best] % span), int(counts[best])

    def uids_in_bins(self, rows: np.ndarray, cols: np.ndarray | None, i: int, j: int | None) -> list[str]:
        """The uids whose bin is i by `rows` (and j by `cols`, if given): the prompts behind a histogram bar or
        a migration cell (rows, cols from `bins`)."""
        mask = rows == i
        if cols is not None:
            mask &= cols == j
        return [self.uids[k] for k in np.flatnonzero(mask)]


def retry_counts(ledger: pd.DataFrame) -> tuple[int, int, float]:
    """(hard prompts generated again later, how many of those reached >= 1/G, that fraction), from a ledger with
    retries (Run.ledger_retries). Only a prompt tried again can be solved later: this fraction compares runs,
    ledger_counts' does not (a run that never re-generates a prompt has 0 there by construction)."""
    retried = ledger["retries"] > 0
    n, k = int(retried.sum()), int((retried & ledger["first_solved"].notna()).sum())
    return n, k, (k / n if n else 0.0)


def ledger_counts(ledger: pd.DataFrame) -> tuple[int, int, float]:
    """(prompts 0/G when first generated for, how many of them later reached >= 1/G, that fraction)."""
    n = len(ledger)
    k = int(ledger["first_solved"].notna().sum())
    return n, k, (k / n if n else 0.0)


# ----------------------------------------------------------------------------- summary


def _mean(x: pd.Series) -> float | None:
    m = pd.to_numeric(x, errors="coerce").mean()
    return None if pd.isna(m) else float(m)


def step_summary(steps: pd.DataFrame) -> dict:
    """The part of `summary` read from the per-step table alone."""
    n = len(steps)
    k = max(1, math.ceil(0.2 * n))  # first / last 20 % of the steps, at least one
    return {"n_steps": n, "last_step": int(steps["step"].iloc[-1]) if n else None,
            "rollouts": int(steps["rollouts"].fillna(0).sum()),
            "fresh_reward_first": _mean(steps["fresh_reward"].head(k)),
            "fresh_reward_last": _mean(steps["fresh_reward"].tail(k)),
            "steps_with_x2": int((steps["x2"].fillna(0) > 0).sum()),
            "steps_with_x3": int((steps["x3"].fillna(0) > 0).sum())}


def summary(steps: pd.DataFrame, ledger: pd.DataFrame) -> dict:
    """The run in a few numbers (read_run's `summary`, the dashboard's texts and comparison table): n_steps,
    last_step, rollouts (total), fresh_reward_first / fresh_reward_last (mean fresh reward over the first / last
    20 % of the steps), steps_with_x2, steps_with_x3, and the ledger's first_unsolved, later_solved,
    later_solved_fraction."""
    hard, solved, fraction = ledger_counts(ledger)
    return {**step_summary(steps), "first_unsolved": hard, "later_solved": solved, "later_solved_fraction": fraction}


# ----------------------------------------------------------------------------- one run


def _step_table(records: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(records, columns=list(STEP_TABLE))  # a metric a step did not log is NaN
    for c in STEP_TABLE[3:]:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


class Run:
    """One run directory, with what was read from it cached until the record changes. Thread-safe."""

    def __init__(self, path, label: str | None = None, check: bool = True):
        """check=False: a record that cannot be read (yet: empty, corrupt, old schema) fails when it is read, not
        here (the dashboard says so in place and keeps showing the other runs)."""
        self.path = Path(path)
        if not (self.path / DB_NAME).is_file():
            raise FileNotFoundError(f"no run record at {self.path / DB_NAME}")
        if check:
            connect_ro(self.path).close()  # a schema too old fails here, saying how to upgrade it
        self.label = label or self.path.name
        self._lock = threading.Lock()
        self._version = None
        self._meta: dict = {}
        self._config: dict = {}
        self._records: list[dict] = []
        self._steps = self._evals = None
        self._generated = Generated()
        self._generated_version = None
        self._ledger = None
        self._metrics: tuple = (None, None)
        self._derived: dict = {}  # what is computed from the generated groups, until they change
        self._verdicts = None

    # --- change detection ---

    @staticmethod
    def _version_of(conn) -> tuple:
        steps = tuple(conn.execute("SELECT COUNT(*), MAX(step), MAX(time) FROM steps").fetchone())
        evals = tuple(conn.execute("SELECT COUNT(*), TOTAL(value) FROM evals").fetchone())
        status = conn.execute("SELECT value FROM meta WHERE key = 'status'").fetchone()
        return steps + evals + (status[0] if status else None,)

    def version(self) -> tuple:
        """Changes whenever a step or evaluation is committed (or rewritten), or the run's status changes."""
        with snapshot(self.path) as conn:
            return self._version_of(conn)

    # --- the small tables ---

    def _refresh(self) -> None:
        """Read the small tables again if the record changed (the caller holds the lock)."""
        with snapshot(self.path) as conn:
            version = self._version_of(conn)
            if version == self._version:
                return
            self._meta = {k: v for k, v in conn.execute("SELECT key, value FROM meta")}
            config = conn.execute("SELECT json FROM config").fetchone()
            self._config = json.loads(config[0]) if config else {}
            rows = conn.execute("SELECT step, time, metrics, bins FROM steps ORDER BY step")
            written = int(self._meta.get("schema_version", SCHEMA_VERSION))  # an older one reads as it is
            self._records = [{"step": s, "time": t, **current_metrics(json.loads(m), written),
                              "bins": json.loads(b) if b else None} for s, t, m, b in rows]
            self._steps = _step_table(self._records)
            self._evals = pd.read_sql_query("SELECT step, name, metric, value FROM evals ORDER BY step", conn)
            self._verdicts = pd.read_sql_query("SELECT step, verdict, SUM(count) AS count FROM verdicts "
                                               "GROUP BY step, verdict ORDER BY step", conn)
            self._version = version

    def _cached(self, name):
        with self._lock:
            self._refresh()
            return getattr(self, name)

    def step_records(self) -> list[dict]:
        """One dict per step, in step order: {"step", "time", "bins", **every metric logged} (absent = no key).
        Shared: callers only read it."""
        return self._cached("_records")

    def steps(self) -> pd.DataFrame:
        """The per-step table: columns STEP_TABLE (step, time, bins as lists, STEP_COLUMNS, JSON_METRICS)."""
        return self._cached("_steps")

    def evals(self) -> pd.DataFrame:
        """step, name, metric, value of every held-out evaluation."""
        return self._cached("_evals")

    def meta(self) -> dict:
        return dict(self._cached("_meta"))

    def config(self) -> dict:
        return dict(self._cached("_config"))

    def status(self) -> str:
        """The status to show: the recorded one, but "stopped (killed?)" when no trainer holds a run recorded as
        running (record.shown_status)."""
        return shown_status(self.path, self.meta().get("status", "?"))

    def group_size(self) -> int:
        """G: the config's group size, else the largest G recorded."""
        g = self.config().get("group_size")
        if g:
            return int(g)
        with snapshot(self.path) as conn:
            return int(conn.execute("SELECT COALESCE(MAX(G), 0) FROM prompt_steps").fetchone()[0])

    # --- the generated groups and what comes from them ---

    def generated(self) -> Generated:
        """Every generated group so far (see `Generated`), read incrementally. Callers only read it."""
        with self._lock:
            self._update_generated()
            return self._generated

    def _update_generated(self) -> None:
        with snapshot(self.path) as conn:
            version = self._version_of(conn)
            if version != self._generated_version:
                self._generated.update(conn)
                self._generated_version, self._ledger = version, None
                self._derived = {}

    def ledger(self) -> pd.DataFrame:
        """The hard-problem ledger (see `Generated.ledger`), cached until the record changes."""
        with self._lock:
            self._update_generated()
            if self._ledger is None:
                self._ledger = self._generated.ledger()
            return self._ledger

    def ledger_retries(self) -> pd.DataFrame:
        """The ledger with a `retries` column (how many more times each hard prompt was generated for, see
        Generated.retries) and `first_retry` (the step of the first of them, <NA> if none)."""
        with self._lock:
            self._update_generated()
            if self._ledger is None:
                self._ledger = self._generated.ledger()
            ledger = self._ledger
            if "ledger_retries" not in self._derived:
                gen = self._generated
                codes = np.array([gen.index[u] for u in ledger["uid"]], dtype=np.int64)
                first = gen.first_retries()[codes] if len(codes) else np.zeros(0, dtype=np.int64)
                self._derived["ledger_retries"] = ledger.assign(
                    retries=gen.retries()[codes] if len(codes) else 0,
                    first_retry=pd.array([int(f) if f >= 0 else pd.NA for f in first], dtype="Int64"))
            return self._derived["ledger_retries"]

    def regenerated_pair(self) -> tuple[int, int, int] | None:
        """See Generated.regenerated_pair; cached until the record changes."""
        with self._lock:
            self._update_generated()
            if "pair" not in self._derived:
                self._derived["pair"] = self._generated.regenerated_pair()
            return self._derived["pair"]

    def metrics(self) -> pd.DataFrame:
        """Every numeric per-step metric the trainer logged (step_records' keys, a backend's own included), one
        column each, NaN where a step did not log it; steps in order."""
        records = self.step_records()
        with self._lock:
            if self._metrics[0] is not records:
                df = pd.DataFrame.from_records(records).drop(columns=["bins"], errors="ignore")
                df = df.apply(pd.to_numeric, errors="coerce").dropna(axis=1, how="all")
                self._metrics = (records, df)
            return self._metrics[1]

    def verdicts(self) -> pd.DataFrame:
        """step, verdict, count: the verifier's verdicts over every response scored at each step."""
        return self._cached("_verdicts")

    def accuracy_bins(self, step: int) -> list[int]:
        """Prompts generated for at `step` (GENERATED subsets, not x3) per accuracy bin 0/G..G/G."""
        G = self.group_size()
        return histogram(self.generated().bins(step - 1, step, G), G)

    def migration(self, step_a: int, step_b: int, window: bool = False):
        """(histogram A, histogram B, migration matrix m), m[i][j] = prompts in bin i at A and bin j at B.
        window=False: the prompts generated for at exactly step_a, at exactly step_b, and at both.
        window=True: the latest result of every prompt generated for up to step_a, the same up to step_b; the
        matrix pairs the prompts generated for up to step_a and again in (step_a, step_b]: row = latest result
        <= step_a, column = latest result in (step_a, step_b]."""
        gen, G = self.generated(), self.group_size()
        if window:
            a, b, after_a = gen.bins(None, step_a, G), gen.bins(None, step_b, G), gen.bins(step_a, step_b, G)
        else:
            a, b = gen.bins(step_a - 1, step_a, G), gen.bins(step_b - 1, step_b, G)
            after_a = b
        return histogram(a, G), histogram(b, G), migration(a, after_a, G)

    def summary(self) -> dict:
        """See `summary`."""
        return summary(self.steps(), self.ledger())


def read_run(run_dir) -> dict:
    """Everything about a run as plain JSON-able data: {"run_dir", "meta", "config", "steps", "summary"}.
    steps: Run.step_records(); summary: see `summary`. The shape is a stable interface (bapo runs show --json)."""
    run = Run(run_dir)
    return {"run_dir": str(Path(run_dir)), "meta": run.meta(), "config": run.config(), "steps": run.step_records(),
            "summary": run.summary()}
