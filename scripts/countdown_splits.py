"""The countdown data of the study: a report set and a dev set cut from the TinyZero test split, and training rows of
the same distribution with every problem of either set removed.

    python scripts/countdown_splits.py --test tinyzero_test_1024_base.jsonl \
        --train countdown_3to4_raw_rows_0-11023.jsonl --report 768 --out data/countdown-study

writes OUT/report.jsonl (the first --report test rows: the study's held-out set), OUT/dev.jsonl (the rest: the
learning-rate pilot's set, never reported) and OUT/train.jsonl (the training rows whose numbers and target match no
test row), and prints the counts. Rows are copied as they are, so the task's loader reads them as before.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def key(row: dict) -> tuple:
    return tuple(sorted(row["nums"])), int(row["target"])


def split(test_rows: list[str], train_rows: list[str], report: int) -> dict[str, list[str]]:
    """{"report", "dev", "train"}: lines of the first `report` test rows, of the rest, and of the training rows
    whose problem is in neither."""
    if not 0 < report < len(test_rows):
        raise ValueError(f"--report {report} must leave both sets non-empty (the test file has {len(test_rows)} rows)")
    held_out = {key(json.loads(line)) for line in test_rows}
    return {"report": test_rows[:report], "dev": test_rows[report:],
            "train": [line for line in train_rows if key(json.loads(line)) not in held_out]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--test", required=True, help="TinyZero-format test rows (jsonl with nums and target)")
    ap.add_argument("--train", required=True, help="training rows (jsonl with nums and target)")
    ap.add_argument("--report", type=int, default=768, help="test rows in the report set (default %(default)s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    read = lambda p: [line for line in Path(p).read_text().splitlines() if line.strip()]  # noqa: E731
    test, train = read(args.test), read(args.train)
    parts = split(test, train, args.report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, lines in parts.items():
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    print(f"report {len(parts['report'])}, dev {len(parts['dev'])}, train {len(parts['train'])} "
          f"({len(train) - len(parts['train'])} training rows dropped: their problem is a test row)")


if __name__ == "__main__":
    main()
