"""`bapo eval` on CPU with tiny saved models over a 20-problem slice of the math and Geometry3K evaluation sets
(the countdown case, with the bundled trained policy, is in test_eval.py). Random tiny models score ~0: these
tests check that every set loads, every sample gets a verdict and the table and JSON are written. Without
../shared they run on the bundled fixtures (fewer problems a set; see conftest.py)."""
import json

from bapo_vl.cli import main
from bapo_vl.plugins import get_task
from bapo_vl.tiny import build_qwen2, build_qwen2_5_vl

VERDICTS = ("correct", "wrong", "unparsable", "timeout")


def run_eval(args, out, capsys) -> dict:
    assert main(["eval", *args, "--limit", "20", "--k", "2", "--max-new-tokens", "12", "--device", "cpu",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean@2" in printed and "pass@2" in printed and "average" in printed  # the table
    return json.loads(out.read_text())


def expected_n(task: str, split: str, source: str) -> int:
    """Problems `run_eval` evaluates in a set: 20, or all of a smaller (bundled) one."""
    return len(get_task(task).load(split=split, source=source, limit=20))


def test_eval_math_sets_with_a_tiny_saved_model(tmp_path, capsys, math_eval_source):
    model, tok = build_qwen2()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    splits = ["aime24", "amc23", "math500", "minerva", "olympiadbench"]
    result = run_eval([str(tmp_path / "m"), "--task", "math", "--source", math_eval_source,
                       "--splits", ",".join(splits)], tmp_path / "math.json", capsys)
    assert list(result["sets"]) == splits
    for name in splits:
        m = result["sets"][name]
        assert m["n"] == expected_n("math", name, math_eval_source) and sum(m[v] for v in VERDICTS) == 2 * m["n"]
        assert 0 <= m["mean@k"] <= m["pass@k"] <= 1


def test_eval_geometry3k_with_a_tiny_saved_vl_model(tmp_path, capsys, geometry3k_source):
    model, processor = build_qwen2_5_vl(max_pixels=112 * 112)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    # "train": the bundled fixture has only that split (the loader reads every split the same way)
    result = run_eval([str(tmp_path / "vl"), "--task", "geometry3k", "--source", geometry3k_source,
                       "--splits", "train"], tmp_path / "geo.json", capsys)
    m = result["sets"]["train"]
    assert m["n"] == expected_n("geometry3k", "train", geometry3k_source)
    assert sum(m[v] for v in VERDICTS) == 2 * m["n"]
