"""scripts/countdown_splits.py: the study's report, dev and training rows, with no test problem left in training."""
import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("countdown_splits", Path(__file__).parents[1] / "scripts" / "countdown_splits.py")
splits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(splits)


def rows(problems):
    return [json.dumps({"nums": n, "target": t}) for n, t in problems]


def test_report_dev_and_train_are_disjoint(tmp_path):
    # Could fail if a training row kept a held-out problem (numbers in another order still count) or the cut moved.
    test = rows([([1, 2, 3], 6), ([4, 5, 6], 15), ([7, 8, 9], 24), ([1, 1, 2], 4)])
    train = rows([([3, 2, 1], 6), ([9, 9, 9], 27), ([1, 2, 1], 4), ([4, 5, 6], 14)])
    (tmp_path / "test.jsonl").write_text("\n".join(test) + "\n")
    (tmp_path / "train.jsonl").write_text("\n".join(train) + "\n")
    splits.main(["--test", str(tmp_path / "test.jsonl"), "--train", str(tmp_path / "train.jsonl"), "--report", "3",
                 "--out", str(tmp_path / "out")])
    read = lambda name: (tmp_path / "out" / f"{name}.jsonl").read_text().splitlines()  # noqa: E731
    assert read("report") == test[:3] and read("dev") == test[3:]
    assert read("train") == [train[1], train[3]]  # [3,2,1]->6 is a report problem, [1,2,1]->4 the dev one
    with pytest.raises(ValueError, match="non-empty"):
        splits.split(test, train, 4)
