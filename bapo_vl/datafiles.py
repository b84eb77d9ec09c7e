"""Reading the public row formats users have (JSON array, JSON lines, parquet) with errors that name the file
and the row. Task plugins use these; each only says how to turn one row into its fields."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


def read_rows(path: Path) -> list:
    """Rows of a .jsonl, .json (an array, or JSON lines) or .parquet file; an unreadable line becomes an Exception
    in its place, so row numbers stay those of the file. A file without rows is an error naming it."""
    rows = _read_rows(Path(path))
    if not rows:
        raise ValueError(f"{path}: the file holds no rows; give a data file with one problem per row")
    return rows


def _read_rows(path: Path) -> list:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors do not always name the file
            raise ValueError(f"{path}: unreadable parquet: {e}") from None
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported file type (want .json, .jsonl or .parquet)")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON: {e}") from None
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line) if line.strip() else None)
        except json.JSONDecodeError as e:
            rows.append(e)
    while rows and rows[-1] is None:  # trailing blank lines
        rows.pop()
    return rows


def parse_rows(path: Path, parse: Callable, skip_bad: bool, task: str, rows: list | None = None
               ) -> list[tuple[int, object, object]]:
    """(row number, raw row, parse(row)) for every row of `path` (or of `rows`, already read from it). A malformed row (parse raises ValueError,
    TypeError or AttributeError) raises a ValueError naming the file and row, or with `skip_bad` is skipped
    and the count logged."""
    out, bad = [], 0
    for i, row in enumerate(read_rows(path) if rows is None else rows):
        try:
            if isinstance(row, Exception):
                raise ValueError(f"invalid JSON: {row}")
            out.append((i, row, parse(row)))
        except (ValueError, TypeError, AttributeError) as e:
            if not skip_bad:
                raise ValueError(f"{path}: row {i} (0-based): {e}") from None
            bad += 1
    if bad:
        log.warning("%s: skipped %d malformed row(s) of %s", task, bad, path)
    return out
