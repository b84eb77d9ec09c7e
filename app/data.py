"""What the dashboard reads from a run record: read-only SQL over `run.db`, cached per run until it changes.

Every query goes through a read-only connection (`bapo_vl.record.connect_ro`) inside one short read
transaction, so it sees a consistent snapshot of the committed steps and never blocks the trainer (WAL mode).
Nothing here writes, and no path comes from the browser: `Run` objects are made from the command line.

Costs at 40,000 prompts x 500 steps (about 160,000 prompt_steps rows): the per-step table is 500 rows; the
hard-problem ledger is kept incrementally (only steps newer than the last read are scanned); histograms and the
migration matrix at given steps use the (step, uid, subset) primary key; a prompt's history uses the uid index.
"""
from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from bapo_vl.record import DB_NAME, GENERATED, STEP_COLUMNS, accuracy_bins, connect_ro, find_runs, migration_matrix

GEN_SQL = f"subset IN ({','.join(repr(s) for s in GENERATED)})"  # subsets with a new generation at that step
FRESH_FIRST = "(subset IN ('fresh', 'filtered'))"  # a uid generated twice in one step counts by its fresh group
# per-step numbers the trainer logs only inside the `metrics` JSON
JSON_METRICS = ("c1", "rollouts_fresh", "rollouts_reeval", "trained_groups")


@contextmanager
def snapshot(run_dir):
    """A read-only connection holding one read transaction: every query inside sees the same committed state."""
    conn = connect_ro(run_dir)
    try:
        conn.execute("BEGIN")
        yield conn
    finally:
        conn.close()  # ends the read transaction (nothing to commit)


# ----------------------------------------------------------------------------- generated groups, incrementally


class Generated:
    """Every generated group of a run (x3 replays excluded) as numpy columns step, code (the uid's index in
    `uids`), correct, G, sorted by step and, within a step, re-evaluated before fresh groups. Read incrementally:
    each update scans only the steps committed since the last one (a primary-key range), unless older steps were
    rewritten (a resumed run), which starts over. The ledger and the migration windows are computed from it in
    memory (numpy), not by re-scanning the table."""

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

    def update(self, conn: sqlite3.Connection) -> None:
        if self._signature(conn, self.upto) != self.signature:
            self.__init__()
        last = conn.execute("SELECT MAX(step) FROM steps").fetchone()[0]
        if last is not None and last > self.upto:
            rows = conn.execute(f"SELECT uid, step, correct, G, {FRESH_FIRST} FROM prompt_steps "
                                f"WHERE step > ? AND step <= ? AND {GEN_SQL}", (self.upto, last)).fetchall()
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
                    self.cols[c] = np.concatenate([self.cols[c], new[c][order].astype(np.int64)])
            self.upto = last
        self.signature = self._signature(conn, self.upto)

    def frame(self) -> pd.DataFrame:
        """As a DataFrame (step, uid, correct, G), for reading and tests."""
        return pd.DataFrame({"step": self.cols["step"], "uid": np.array(self.uids, dtype=object)[self.cols["code"]]
                             if len(self) else np.array([], dtype=object),
                             "correct": self.cols["correct"], "G": self.cols["G"]})

    def latest(self, lo: int | None, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, correct, G) of each prompt's latest generated group at steps lo < step <= hi (lo None: all up
        to hi); a uid generated twice at its latest step counts by its fresh group, as in bapo_vl.record."""
        step = self.cols["step"]
        sel = np.flatnonzero((step <= hi) if lo is None else (step > lo) & (step <= hi))
        code = self.cols["code"][sel][::-1]  # last row per uid = first in reverse
        _, first = np.unique(code, return_index=True)
        rows = sel[::-1][first]
        return self.cols["code"][rows], self.cols["correct"][rows], self.cols["G"][rows]

    def ledger(self) -> pd.DataFrame:
        """The hard-problem ledger: uid, first_seen, first_solved (<NA> while unsolved) of the prompts whose every
        group at their first generated step was 0/G; first_solved = the lowest later step with >= 1 correct.
        The same definition as bapo_vl.record.hard_problem_ledger (a test checks they agree)."""
        step, code, correct = self.cols["step"], self.cols["code"], self.cols["correct"]
        n = len(self.uids)
        first_seen = np.full(n, np.iinfo(np.int64).max)
        np.minimum.at(first_seen, code, step)
        fs = first_seen[code]
        at_first = np.full(n, -1)
        np.maximum.at(at_first, code[step == fs], correct[step == fs])
        later = (step > fs) & (correct >= 1)
        solved = np.full(n, -1)
        lc, li = np.unique(code[later], return_index=True)  # rows are in step order: first occurrence = lowest
        solved[lc] = step[later][li]
        hard = np.flatnonzero(at_first == 0)
        out = pd.DataFrame({"uid": np.array(self.uids, dtype=object)[hard] if n else np.array([], dtype=object),
                            "first_seen": first_seen[hard],
                            "first_solved": pd.array(np.where(solved[hard] >= 0, solved[hard], 0), dtype="Int64")})
        out.loc[solved[hard] < 0, "first_solved"] = pd.NA
        return out.sort_values(["first_seen", "uid"], kind="stable").reset_index(drop=True)


# ----------------------------------------------------------------------------- one run


class Run:
    """One run directory given on the command line, with what was read from it cached until the record changes."""

    def __init__(self, path, label: str | None = None):
        self.path = Path(path)
        if not (self.path / DB_NAME).is_file():
            raise FileNotFoundError(f"no run record at {self.path / DB_NAME}")
        self.label = label or self.path.name
        self._lock = threading.Lock()
        self._version = None
        self._steps = None
        self._evals = None
        self._meta: dict = {}
        self._config: dict = {}
        self._generated = Generated()
        self._generated_version = None
        self._ledger = None

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

    def _refresh(self) -> None:
        """Re-read the small tables if the record changed (caller holds the lock)."""
        with snapshot(self.path) as conn:
            version = self._version_of(conn)
            if version == self._version:
                return
            self._meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            config = conn.execute("SELECT json FROM config").fetchone()
            self._config = json.loads(config[0]) if config else {}
            self._steps = read_steps(conn)
            self._evals = pd.read_sql_query("SELECT step, name, metric, value FROM evals ORDER BY step", conn)
            self._version = version

    def steps(self) -> pd.DataFrame:
        with self._lock:
            self._refresh()
            return self._steps

    def evals(self) -> pd.DataFrame:
        with self._lock:
            self._refresh()
            return self._evals

    def meta(self) -> dict:
        with self._lock:
            self._refresh()
            return dict(self._meta)

    def config(self) -> dict:
        with self._lock:
            self._refresh()
            return dict(self._config)

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

    def ledger(self) -> pd.DataFrame:
        """The hard-problem ledger (see `Generated.ledger`), cached until the record changes."""
        with self._lock:
            self._update_generated()
            if self._ledger is None:
                self._ledger = self._generated.ledger()
            return self._ledger

    def group_size(self) -> int:
        """G: the config's group size, else the largest G recorded."""
        g = self.config().get("group_size")
        if g:
            return int(g)
        with snapshot(self.path) as conn:
            return int(conn.execute("SELECT COALESCE(MAX(G), 0) FROM prompt_steps").fetchone()[0])


def read_steps(conn) -> pd.DataFrame:
    """The per-step table: its own columns, a few numbers from the metrics JSON, and `bins` as lists."""
    cols = ", ".join(["step", "time", *STEP_COLUMNS, "bins",
                      *(f"json_extract(metrics, '$.{k}') AS {k}" for k in JSON_METRICS)])
    df = pd.read_sql_query(f"SELECT {cols} FROM steps ORDER BY step", conn)
    df["bins"] = [json.loads(b) if b else None for b in df["bins"]]
    return df


def load_runs(paths) -> list[Run]:
    """Runs from command-line paths: a run directory, or a folder of runs (each run.db under it, newest first).
    Labels are the run names, made unique with their parent folder when two runs share a name."""
    dirs: list[Path] = []
    for p in map(Path, paths):
        if (p / DB_NAME).is_file():
            dirs.append(p)
        elif p.is_dir() and (found := find_runs(p)):
            dirs += found
        else:
            raise FileNotFoundError(f"{p}: no run record (run.db) there or below it")
    dirs = list(dict.fromkeys(d.resolve() for d in dirs))
    names = []
    for d in dirs:
        try:
            with snapshot(d) as conn:
                row = conn.execute("SELECT value FROM meta WHERE key = 'name'").fetchone()
            names.append(row[0] if row else d.name)
        except sqlite3.Error:
            names.append(d.name)
    labels = [n if names.count(n) == 1 else f"{n} ({d.parent.name}/{d.name})" for n, d in zip(names, dirs)]
    labels = [lab if labels.count(lab) == 1 else f"{lab} #{i + 1}" for i, lab in enumerate(labels)]
    return [Run(d, lab) for d, lab in zip(dirs, labels)]


# ----------------------------------------------------------------------------- accuracy bins and migration


def bins_and_matrix_at(run: Run, step_a: int, step_b: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Exact steps: prompts generated for at step_a, at step_b (histograms), and at both (matrix) — the
    record's own readers (bapo_vl.record.accuracy_bins, migration_matrix)."""
    return accuracy_bins(run.path, step_a), accuracy_bins(run.path, step_b), migration_matrix(run.path, step_a, step_b)


def bins_and_matrix_window(run: Run, step_a: int, step_b: int, G: int):
    """Windows: histogram A = latest result of every prompt generated up to step_a, histogram B = the same up to
    step_b; matrix = prompts generated up to step_a and again in (step_a, step_b], row = latest result <= step_a,
    column = latest result in (step_a, step_b]."""
    gen = run.generated()
    n = len(gen.uids)

    def bins(lo, hi):  # bin per uid code, -1 where not generated in the window
        code, correct, g = gen.latest(lo, hi)
        out = np.full(n, -1)
        out[code] = np.clip(np.round(correct * G / np.maximum(g, 1)), 0, G).astype(int)  # as bapo_vl.record._bin
        return out

    a, after, b = bins(None, step_a), bins(step_a, step_b), bins(None, step_b)
    both = (a >= 0) & (after >= 0)
    m = np.zeros((G + 1, G + 1), dtype=int)
    np.add.at(m, (a[both], after[both]), 1)
    hist = lambda x: np.bincount(x[x >= 0], minlength=G + 1).tolist()
    return hist(a), hist(b), m.tolist()


# ----------------------------------------------------------------------------- prompt drill-down


def _like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def search_prompts(run: Run, query: str, limit: int = 50) -> list[tuple[str, str]]:
    """(uid, start of the text) of prompts whose uid starts with `query` or whose text contains it; an exact
    uid comes first. Prompts seen in training but missing from `problems` are found by uid."""
    q = (query or "").strip()
    with snapshot(run.path) as conn:
        if not q:
            rows = conn.execute("SELECT uid, substr(text, 1, 100) FROM problems ORDER BY rowid LIMIT ?", (limit,))
            return [tuple(r) for r in rows]
        exact = conn.execute("SELECT uid, substr(text, 1, 100) FROM problems WHERE uid = ?", (q,)).fetchall()
        if not exact and conn.execute("SELECT 1 FROM prompt_steps WHERE uid = ? LIMIT 1", (q,)).fetchone():
            exact = [(q, "")]
        pattern = _like(q)
        rows = conn.execute(
            "SELECT uid, substr(text, 1, 100) FROM problems WHERE uid != ? AND "
            "(uid LIKE ? || '%' ESCAPE '\\' OR text LIKE '%' || ? || '%' ESCAPE '\\') LIMIT ?",
            (q, pattern, pattern, limit)).fetchall()
    return [tuple(r) for r in exact] + [tuple(r) for r in rows][:limit - len(exact)]


def prompt_detail(run: Run, uid: str) -> dict:
    """A prompt's text, answer, meta, image (PNG bytes or None), its rows per step and its sampled responses."""
    with snapshot(run.path) as conn:
        prob = conn.execute("SELECT text, answer, meta, image FROM problems WHERE uid = ?", (uid,)).fetchone()
        history = pd.read_sql_query("SELECT step, subset, correct, G FROM prompt_steps WHERE uid = ? "
                                    "ORDER BY step, subset", conn, params=(uid,))
        samples = pd.read_sql_query("SELECT step, subset, idx, verdict, reward, response FROM samples "
                                    "WHERE uid = ? ORDER BY step, subset, idx", conn, params=(uid,))
    return {"uid": uid, "found": prob is not None or not history.empty,
            "text": prob["text"] if prob else None, "answer": json.loads(prob["answer"]) if prob else None,
            "meta": json.loads(prob["meta"]) if prob and prob["meta"] else {}, "image": prob["image"] if prob else None,
            "history": history, "samples": samples}


def texts(run: Run, uids: list[str], chars: int = 80) -> dict[str, str]:
    """{uid: the first `chars` characters of its text} for the given uids (those in `problems`)."""
    out: dict[str, str] = {}
    with snapshot(run.path) as conn:
        for i in range(0, len(uids), 500):  # stay under SQLite's bound-variable limit
            chunk = uids[i:i + 500]
            out.update(conn.execute(f"SELECT uid, substr(text, 1, ?) FROM problems WHERE uid IN "
                                    f"({','.join('?' * len(chunk))})", (chars, *chunk)).fetchall())
    return out


def last_sampled(run: Run, subset: str | None = None) -> str | None:
    """The uid of the most recent sampled response (of `subset`, if given), if any."""
    with snapshot(run.path) as conn:
        row = conn.execute("SELECT uid FROM samples WHERE (? IS NULL OR subset = ?) ORDER BY step DESC LIMIT 1",
                           (subset, subset)).fetchone()
    return row[0] if row else None
