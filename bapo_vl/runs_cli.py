"""`bapo runs list`, `bapo runs show` and `bapo runs upgrade`: read run records (bapo_vl.reader) and print them.

Argument parsing lives in bapo_vl/cli.py; these functions take plain values and return an exit code.
list and show only read (read-only SQLite connections that write nothing, bapo_vl.record.connect_ro), so they are
safe to run while a run is training and work on a read-only disk; a record that cannot be read is reported with its
path (in the listing, on its own row, the others still listed). upgrade rewrites an old record in place
(bapo_vl.record.upgrade).
"""
from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from bapo_vl.reader import read_run
from bapo_vl.record import (DB_NAME, OLDEST_READABLE, SCHEMA_VERSION, RunLockedError, UnreadableRecordError,
                            find_runs, query_ro, read_meta, shown_status, trainer_alive, upgrade)

# per-step columns shown by `runs show` (header, key, format)
SHOW_COLUMNS = [
    ("step", "step", "{}"), ("|X1|", "x1", "{}"), ("|X2|", "x2", "{}"), ("|X3|", "x3", "{}"),
    ("B", "batch_size", "{}"), ("|B_bad|", "bad_size", "{}"), ("|B_high|", "high_size", "{}"),
    ("c2", "c2", "{:.3f}"), ("c3", "c3", "{:.3f}"), ("rollouts", "rollouts", "{}"),
    ("fresh r", "fresh_reward", "{:.3f}"), ("batch r", "reward", "{:.3f}"), ("loss", "loss", "{:.4g}"),
    ("kl", "kl", "{:.3g}"), ("gen s", "t_generate", "{:.1f}"), ("verify s", "t_verify", "{:.1f}"),
    ("train s", "t_train", "{:.1f}"), ("gen GB", "gpu_memory_generate_gb", "{:.1f}"),
    ("train GB", "gpu_memory_train_gb", "{:.1f}"),  # the card's memory at each phase's peak (a GPU run)
]


def _fmt(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        print(title)
        widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
        for r in [headers, *rows]:
            print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
        return
    # never crop columns: when the terminal (or a pipe, 80 by default) is narrower, widen the console instead
    width = sum(max(len(str(c)) for c in col) + 3 for col in zip(headers, *rows)) + 1
    console = Console()
    console = Console(width=max(console.width, width))
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    console.print(table)


def _brief(run_dir: Path) -> list[str]:
    """name, status, steps, last fresh reward, created: cheap, without reading every step."""
    meta = read_meta(run_dir)
    if int(meta.get("schema_version", 0)) < OLDEST_READABLE:  # listed, but its steps are read after an upgrade
        return [meta.get("name", run_dir.name), f"old record: bapo runs upgrade {run_dir}", "-", "-",
                meta.get("created_at", "")[:19].replace("T", " "), str(run_dir)]
    n, last = query_ro(run_dir, "SELECT COUNT(*), MAX(step) FROM steps")[0]
    reward = query_ro(run_dir, "SELECT fresh_reward FROM steps WHERE step = ?", (last,))
    return [meta.get("name", run_dir.name), shown_status(run_dir, meta.get("status", "?")), str(n),
            _fmt(reward[0][0] if reward else None, "{:.3f}"), meta.get("created_at", "")[:19].replace("T", " "),
            str(run_dir)]


def _brief_or_error(run_dir: Path) -> tuple[list[str], str | None]:
    """_brief's row, or a row saying why the record cannot be read (and that reason)."""
    try:
        return _brief(run_dir), None
    except (sqlite3.Error, ValueError, OSError) as e:  # damaged, foreign, newer schema, unreadable file
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        return [run_dir.name, "unreadable", "-", "-", "-", str(run_dir)], reason


def cmd_runs_list(root: str = "runs") -> int:
    """Print a table of the runs under `root`, newest first. A record that cannot be read gets its own row
    ("unreadable") and a line on stderr saying why; the others are listed all the same (exit status 1)."""
    runs = find_runs(root) if Path(root).exists() else []
    if not runs:
        print(f"no runs under {root}/")
        return 0
    rows = [_brief_or_error(d) for d in runs]
    _print_table(f"runs under {root}/", ["name", "status", "steps", "last fresh reward", "created (UTC)", "path"],
                 [row for row, _ in rows])
    errors = [reason for _, reason in rows if reason]
    for reason in errors:
        print(f"unreadable: {reason}", file=sys.stderr)
    return 1 if errors else 0


def resolve_run(run: str, root: str = "runs") -> Path | None:
    """A run given as a directory path, a directory name under root, or a run name stored in meta (a name that
    several runs under root carry is refused, listing their paths)."""
    for d in (Path(run), Path(root) / run):
        if (d / DB_NAME).exists():
            return d
    if not Path(root).exists():
        return None
    named = []
    for d in find_runs(root):
        try:
            if read_meta(d).get("name") == run:
                named.append(d)
        except (sqlite3.Error, ValueError):  # an unreadable record is no match (bapo runs list reports it)
            continue
    if len(named) > 1:
        raise ValueError(f"{len(named)} runs under {root}/ are named {run!r}: name one by its path "
                         f"({', '.join(map(str, named))})")
    return named[0] if named else None


def _not_found(run: str, root: str) -> int:
    print(f"no run '{run}': not a run directory, nor a run under {root}/ (see `bapo runs list`)", file=sys.stderr)
    return 2


def cmd_runs_show(run: str, root: str = "runs", as_json: bool = False) -> int:
    """Show one run: its config and a per-step table, or with as_json=True one JSON object on stdout.

    The JSON object is read_run(run_dir), a stable interface:
      run_dir  path of the run directory
      meta     {schema_version, created_at, name, status, backend, bapo_vl_version,
                [commit, finished_at, resumed_at, upgraded_at, verifier_version, verifier_versions]}
      config   the full config as logged at creation
      steps    [{step, time, bins, x1, x2, x3, batch_size, bad_size, high_size, c2, c3, r_tot, rollouts,
                 fresh_reward, reward, loss, kl, entropy, clip_frac, t_generate, t_generate_sample,
                 t_generate_logprobs, t_verify, t_train, t_sync, [gpu_memory_generate_gb, gpu_memory_train_gb],
                 ...any other metric the trainer logged}, ...] in step order; absent metrics are absent keys;
                 names are this version's whatever version wrote the record (a v2 record's t_score is t_verify)
      summary  {n_steps, last_step, rollouts, fresh_reward_first, fresh_reward_last, steps_with_x2,
                steps_with_x3, first_unsolved, later_solved, later_solved_fraction}
    Returns 0, or 2 when the run is not found. A record of a schema version this bapo-vl does not read raises
    RecordVersionError, a ValueError whose message says how to upgrade it (bapo's main prints it)."""
    run_dir = resolve_run(run, root)
    if run_dir is None:
        return _not_found(run, root)
    try:
        rec = read_run(run_dir)
    except sqlite3.DatabaseError as e:  # damaged past the pages connect_ro reads first
        raise UnreadableRecordError(f"{run_dir / DB_NAME} is not a readable run record "
                                    f"({type(e).__name__}: {e})") from None
    if as_json:
        print(json.dumps(rec, allow_nan=False))
        return 0
    meta, summary = rec["meta"], rec["summary"]
    print(f"{meta.get('name')}  [{shown_status(run_dir, meta.get('status'))}]  {run_dir}  backend={meta.get('backend')}  "
          f"bapo-vl {meta.get('bapo_vl_version')}" + (f" ({meta['commit']})" if meta.get("commit") else ""))
    print("config:", json.dumps(rec["config"], indent=2))
    _print_table("steps", [h for h, _, _ in SHOW_COLUMNS],
                 [[_fmt(s.get(k), f) for _, k, f in SHOW_COLUMNS] for s in rec["steps"]])
    print("summary:", ", ".join(f"{k}={_fmt(v, '{:.3f}' if isinstance(v, float) else '{}')}"
                                for k, v in summary.items()))
    return 0


def cmd_runs_upgrade(run: str, root: str = "runs") -> int:
    """Upgrade an old run record in place to this bapo-vl's schema (bapo_vl.record.upgrade); a current one is
    left alone. Returns 0, or 2 when the run is not found; a record newer than this bapo-vl raises
    RecordVersionError, an old one that a trainer is writing RunLockedError (ValueErrors: bapo's main prints them)."""
    run_dir = resolve_run(run, root)
    if run_dir is None:
        return _not_found(run, root)
    old = read_meta(run_dir).get("schema_version")
    if int(old) < SCHEMA_VERSION and trainer_alive(run_dir):  # an older bapo-vl's: it would write the old columns
        raise RunLockedError(f"{run_dir} is being written by a trainer: upgrade it once that trainer stops")
    changed = upgrade(run_dir)
    print(f"{run_dir}: upgraded from schema version {old} to {SCHEMA_VERSION}" if changed
          else f"{run_dir}: already schema version {SCHEMA_VERSION}, nothing to do")
    return 0
