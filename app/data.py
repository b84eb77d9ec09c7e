"""What only the dashboard reads from run records: the runs named on the command line and the prompt drill-down.

Everything else (steps, evaluations, the hard-problem ledger, accuracy bins and migration) comes from the one
reader, `bapo_vl.reader.Run`, which `bapo runs show` uses too. Every query here goes through its `snapshot`: a
read-only connection inside one read transaction, so it never blocks the trainer (WAL mode). Nothing here writes,
and no path comes from the browser: `Run` objects are made from the command line.
"""
from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pandas as pd

from bapo_vl.reader import Run, accuracy_bin, snapshot
from bapo_vl.record import DB_NAME, read_meta, sql_in


class RunSet:
    """The runs named on the command line: run directories, and folders of runs (each run.db under them, newest
    first). Labels are the run names, made unique with their parent folder when two runs share a name. A record
    that cannot be read (empty, corrupt, old schema) is still listed: the dashboard says why on its tabs.
    `refresh` looks in the folders again, so that a run started under one after the dashboard appears; a run's
    label never changes once given. Thread-safe."""

    def __init__(self, paths):
        self.paths = [Path(p) for p in paths]
        self.runs: dict[str, Run] = {}  # label -> run, in the order found
        self._dirs: set[Path] = set()
        self._lock = threading.Lock()
        for p in self.paths:
            if not (p / DB_NAME).is_file() and not (p.is_dir() and any(p.rglob(DB_NAME))):
                raise FileNotFoundError(f"{p}: no run record (run.db) there or below it")
        self.refresh()

    def _found(self) -> list[Path]:
        dirs: list[Path] = []
        for p in self.paths:
            if (p / DB_NAME).is_file():
                dirs.append(p.resolve())
            elif p.is_dir():
                new = [d.parent.resolve() for d in p.rglob(DB_NAME) if d.parent.resolve() not in self._dirs]
                dirs += find_runs_among(new)
        return list(dict.fromkeys(d for d in dirs if d not in self._dirs))

    def refresh(self) -> list[Run]:
        """Add the runs that appeared under the folders since; returns them."""
        with self._lock:
            dirs = self._found()
            names = []
            for d in dirs:
                try:
                    names.append(read_meta(d).get("name", d.name))
                except (sqlite3.Error, ValueError):  # not readable (yet): record.UnreadableRecordError is a ValueError
                    names.append(d.name)
            labels = [n if names.count(n) == 1 and n not in self.runs else f"{n} ({d.parent.name}/{d.name})"
                      for n, d in zip(names, dirs)]
            new = []
            for d, lab in zip(dirs, labels):
                label, k = lab, 1
                while label in self.runs:
                    k += 1
                    label = f"{lab} #{k}"
                self.runs[label] = Run(d, label, check=False)  # an unreadable one is said so on its tab
                self._dirs.add(d)
                new.append(self.runs[label])
            return new


def find_runs_among(dirs: list[Path]) -> list[Path]:
    """Run directories, newest created first (as record.find_runs orders a folder's runs)."""
    def created(d):
        try:
            return read_meta(d).get("created_at", "")
        except (sqlite3.Error, ValueError):  # not readable (yet): last
            return ""

    return sorted(dirs, key=created, reverse=True)


def load_runs(paths) -> list[Run]:
    """The runs under command-line paths (see RunSet), as a list."""
    return list(RunSet(paths).runs.values())


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


def prompts_at(run: Run, subsets, first: int, last: int, bin_: int | None = None, G: int | None = None) -> list[str]:
    """The uids of the groups of `subsets` at steps first..last (with bin_: only those whose accuracy bin on the
    0/G..G/G scale is bin_): the prompts behind a bar of the batch charts."""
    with snapshot(run.path) as conn:
        rows = conn.execute(f"SELECT uid, correct, G FROM prompt_steps WHERE step BETWEEN ? AND ? AND "
                            f"{sql_in(subsets)}", (first, last)).fetchall()
    if bin_ is not None:
        rows = [r for r in rows if int(accuracy_bin(r[1], r[2], G)) == bin_]
    return list(dict.fromkeys(r[0] for r in rows))


# ----------------------------------------------------------------------------- responses at a step


def sampled_steps(run: Run) -> list[int]:
    """The steps with sampled responses, in order."""
    with snapshot(run.path) as conn:
        return [r[0] for r in conn.execute("SELECT DISTINCT step FROM samples ORDER BY step")]


def responses_at(run: Run, step: int, verdicts, subsets, text: str = "",
                 limit: int = 500) -> tuple[pd.DataFrame, int, int]:
    """The responses sampled at `step` whose verdict is one of `verdicts` and subset one of `subsets` (None: any)
    and whose text contains `text` (any case): (uid, subset, idx, verdict, reward, response, at most `limit` rows,
    in uid order), how many matched, and how many were sampled at that step in all."""
    where, args = ["step = ?"], [int(step)]
    for column, values in (("verdict", verdicts), ("subset", subsets)):
        if values is not None:
            where.append(f"{column} IN ({','.join('?' * len(values))})" if values else "0")
            args += list(values)
    if (text or "").strip():
        where.append("response LIKE '%' || ? || '%' ESCAPE '\\'")
        args.append(_like(text.strip()))
    cond = " AND ".join(where)
    with snapshot(run.path) as conn:
        total = conn.execute("SELECT COUNT(*) FROM samples WHERE step = ?", (int(step),)).fetchone()[0]
        n = conn.execute(f"SELECT COUNT(*) FROM samples WHERE {cond}", args).fetchone()[0]
        rows = pd.read_sql_query(f"SELECT uid, subset, idx, verdict, reward, response FROM samples WHERE {cond} "
                                 f"ORDER BY uid, subset, idx LIMIT ?", conn, params=(*args, limit))
    return rows, n, total
