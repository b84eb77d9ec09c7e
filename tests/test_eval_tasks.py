"""`bapo eval` on CPU with tiny saved models over a 20-problem slice of the math and Geometry3K evaluation sets
(the countdown case, with the bundled trained policy, is in test_eval.py). Random tiny models score ~0: these
tests check that every set loads, every sample gets a verdict and the table and JSON are written."""
import json

from bapo_vl.cli import main
from bapo_vl.tiny import build_qwen2, build_qwen2_5_vl

VERDICTS = ("correct", "wrong", "unparsable", "timeout")


def run_eval(args, out, capsys) -> dict:
    assert main(["eval", *args, "--limit", "20", "--k", "2", "--max-new-tokens", "12", "--device", "cpu",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean@2" in printed and "pass@2" in printed and "average" in printed  # the table
    return json.loads(out.read_text())


def test_eval_math_sets_with_a_tiny_saved_model(tmp_path, capsys, shared_data):
    model, tok = build_qwen2()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    splits = ["aime24", "amc23", "math500", "minerva", "olympiadbench"]
    result = run_eval([str(tmp_path / "m"), "--task", "math", "--source", str(shared_data / "math" / "qwen_eval"),
                       "--splits", ",".join(splits)], tmp_path / "math.json", capsys)
    assert list(result["sets"]) == splits
    for name in splits:
        m = result["sets"][name]
        assert m["n"] == 20 and sum(m[v] for v in VERDICTS) == 40
        assert 0 <= m["mean@k"] <= m["pass@k"] <= 1


def test_eval_geometry3k_with_a_tiny_saved_vl_model(tmp_path, capsys, shared_data):
    model, processor = build_qwen2_5_vl(max_pixels=112 * 112)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    result = run_eval([str(tmp_path / "vl"), "--task", "geometry3k", "--source", str(shared_data / "geometry3k"),
                       "--splits", "test"], tmp_path / "geo.json", capsys)
    m = result["sets"]["test"]
    assert m["n"] == 20 and sum(m[v] for v in VERDICTS) == 40
