"""`bapo eval` end to end on CPU: the bundled countdown-tiny policy (a real trained model) on 20-problem slices of
countdown's cd34 and cd4 sets, and a real 1-step run whose record receives the results. Nothing is mocked."""
import json
import shutil
from pathlib import Path

import pytest

from bapo_vl.cli import main
from bapo_vl.models import POLICY_DIR
from bapo_vl.evaluate import fit_lengths, pass_at_k
from bapo_vl.reader import read_run
from bapo_vl.record import query_ro, read_meta

VERDICTS = ("correct", "wrong", "unparsable", "timeout")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 1-step run of the default (tiny countdown) preset: final/, checkpoints/step_1, run.db."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", "--quiet", f"run_dir={root}", "name=r", "steps=1", "batch_size=4", "group_size=4",
                 "max_response_length=40"]) == 0
    return root / "r"


def check_set(m: dict, n: int, k: int):
    assert m["n"] == n and m["k"] == k
    assert 0.0 <= m["mean@k"] <= m["pass@k"] <= 1.0  # a problem with any correct sample counts fully in pass@k
    assert sum(m[v] for v in VERDICTS) == n * k  # every sample got one verdict
    assert m["mean@k"] == pytest.approx(m["correct"] / (n * k))
    assert len(m["problems"]) == n and sum(m["problems"].values()) == m["correct"]
    assert m["pass@k"] == pytest.approx(sum(c > 0 for c in m["problems"].values()) / n)


def test_pass_at_k_estimator():
    # n == k: any correct sample -> 1; n > k: the unbiased estimator 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(2, 0, 2) == 0.0 and pass_at_k(2, 1, 2) == 1.0 and pass_at_k(2, 2, 2) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 2, 1) == pytest.approx(0.25)  # pass@1 = mean accuracy


def test_eval_bundled_policy_table_json_and_run_record(tmp_path, capsys, run_dir):
    # Could fail if the prompts were rendered differently than in training (then the trained policy would score 0),
    # if mean@k/pass@k were mixed up or miscounted, or if the results did not reach the run's evals table.
    out = tmp_path / "eval.json"
    assert main(["eval", "countdown-tiny", "--task", "countdown", "--template", "compact", "--splits", "cd34,cd4",
                 "--limit", "20", "--k", "2", "--max-new-tokens", "40", "--device", "cpu", "--out", str(out),
                 "--run", str(run_dir)]) == 0
    printed = capsys.readouterr().out
    for word in ("cd34", "cd4", "average", "mean@2", "pass@2", "unparsable", "recorded in"):
        assert word in printed, word
    result = json.loads(out.read_text())
    assert result["task"] == "countdown" and result["k"] == 2 and result["splits"] == ["cd34", "cd4"]
    assert result["options"]["template"] == "compact"
    for split in ("cd34", "cd4"):
        check_set(result["sets"][split], 20, 2)
    assert result["sets"]["cd34"]["correct"] > 0  # the policy solves ~40 % of 3-number problems: the pipeline works
    avg = result["average"]
    assert avg["mean@k"] == pytest.approx((result["sets"]["cd34"]["mean@k"] + result["sets"]["cd4"]["mean@k"]) / 2)
    assert avg["n"] == 40 and 0 <= avg["mean@k"] <= avg["pass@k"] <= 1

    last = read_run(run_dir)["summary"]["last_step"]
    assert result["run"] == str(run_dir) and result["step"] == last == 1
    rows = query_ro(run_dir, "SELECT name, metric, value FROM evals WHERE step = ?", (last,))
    recorded = {(r["name"], r["metric"]): r["value"] for r in rows}
    for name, m in [("countdown/cd34", result["sets"]["cd34"]), ("countdown/cd4", result["sets"]["cd4"]),
                    ("countdown/average", avg)]:
        assert recorded[(name, "mean@k")] == pytest.approx(m["mean@k"])
        assert recorded[(name, "pass@k")] == pytest.approx(m["pass@k"])
        assert recorded[(name, "correct")] == m["correct"]
    assert read_meta(run_dir)["status"] == "finished"  # recording an evaluation does not mark the run as running
    assert "resumed_at" not in read_meta(run_dir)


def test_eval_run_checkpoint_greedy_json(capsys, run_dir):
    # Could fail if a run directory did not give its task and template (countdown, compact), if the checkpoint's
    # weights were not loaded, if greedy decoding (temperature 0) failed, or --json printed anything but JSON.
    args = ["eval", str(run_dir), "--checkpoint", "1", "--splits", "cd4", "--limit", "4", "--k", "1",
            "--temperature", "0", "--json", "--quiet", "--device", "cpu", "--run", str(run_dir), "--step", "7"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "countdown" and result["options"] == {"template": "compact"}
    assert result["checkpoint"] == 1 and result["policy"].endswith("checkpoints/step_1")
    check_set(result["sets"]["cd4"], 4, 1)
    assert result["step"] == 7
    assert {r["name"] for r in query_ro(run_dir, "SELECT name FROM evals WHERE step = 7")} == {
        "countdown/cd4", "countdown/average"}


def test_eval_errors_say_what_to_change(capsys, tmp_path):
    assert main(["eval", "countdown-tiny"]) == 2  # a bare model has no task
    assert "--task" in capsys.readouterr().err
    assert main(["eval", "countdown-tiny", "--task", "countdown", "--temperature", "0", "--k", "2"]) == 2
    assert "k=1" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--checkpoint", "3"]) == 2  # not a run directory
    assert "run directory" in capsys.readouterr().err


def test_eval_defaults_come_from_the_preset_and_the_models_positions(tmp_path, capsys):
    # Could fail if a bare model were asked with the task's default (chat) prompt and Config's 8,192 new tokens:
    # the tiny policy has 256 positions and was trained on compact prompts (`bapo eval countdown-tiny --task
    # countdown` ran for an hour) instead of with the preset that trains it (tiny: compact, 40 new tokens).
    args = ["--task", "countdown", "--splits", "cd4", "--limit", "2", "--k", "1", "--json", "--quiet", "--device", "cpu"]
    assert main(["eval", "countdown-tiny", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["options"] == {"template": "compact"} and result["max_new_tokens"] == 40
    # the same weights at another path: no preset trains them, so Config's lengths (2,048 + 8,192), fitted to the
    # model's 256 positions; the task's default template unless one is given
    copy = shutil.copytree(POLICY_DIR / "countdown-tiny", tmp_path / "tiny")
    assert main(["eval", str(copy), *args, "--template", "compact"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["options"] == {"template": "compact"} and result["max_new_tokens"] == 128
    assert main(["eval", str(copy), *args, "--template", "compact", "--max-new-tokens", "300"]) == 2
    assert "300 leaves no room for a prompt" in capsys.readouterr().err
    assert fit_lengths(64, 40, 256, False) == (64, 40)  # fits: as given
    assert fit_lengths(2048, 8192, 4096, False) == (2048, 2048)  # the response gets what the prompt bound leaves
    assert fit_lengths(2048, 8192, 256, False) == (128, 128)  # ... and at least half the positions
    assert fit_lengths(2048, 200, 256, True) == (56, 200)  # a given length stays; the prompt bound shrinks


def test_against_an_earlier_evaluation_pairs_by_problem(tmp_path, capsys):
    # Could fail if the difference were not paired by uid (a reordered or shorter base would shift it), if the
    # interval did not come from the per-problem differences, or if a bad file cost the evaluation one clear line.
    args = ["eval", "countdown-tiny", "--task", "countdown", "--template", "compact", "--splits", "cd34",
            "--k", "1", "--temperature", "0", "--max-new-tokens", "40", "--device", "cpu", "--quiet"]
    before = tmp_path / "before.json"
    assert main([*args, "--limit", "20", "--out", str(before)]) == 0
    base = json.loads(before.read_text())
    mean = base["sets"]["cd34"]["mean@k"]
    assert 0 < mean < 1, "the test needs a policy that solves some problems and not all"

    # the same greedy policy against itself: exactly no difference
    same = tmp_path / "same.json"
    assert main([*args, "--limit", "20", "--against", str(before), "--out", str(same)]) == 0
    d = json.loads(same.read_text())["against"]["sets"]["cd34"]
    assert (d["diff"], d["low"], d["high"], d["problems"]) == (0.0, 0.0, 0.0, 20)
    assert "cd34 against" in capsys.readouterr().out

    # a base that got nothing right, its problems in reverse order and the last five missing
    problems = list(base["sets"]["cd34"]["problems"])
    zero = dict(base, sets={"cd34": dict(base["sets"]["cd34"], problems={u: 0 for u in reversed(problems[:15])})})
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    out = tmp_path / "vs-zero.json"
    assert main([*args, "--limit", "20", "--against", str(tmp_path / "zero.json"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    d = result["against"]["sets"]["cd34"]
    paired = [result["sets"]["cd34"]["problems"][u] for u in problems[:15]]
    assert d["problems"] == 15 and d["only_here"] == 5 and d["only_there"] == 0
    assert d["diff"] == pytest.approx(sum(paired) / 15)
    assert 0 <= d["low"] <= d["diff"] <= d["high"] <= 1 and d["low"] < d["high"]

    # the same counts stored in reverse order: paired by uid they cancel exactly, by position they would not
    counts = base["sets"]["cd34"]["problems"]
    assert [counts[u] for u in problems[:15]] != [counts[u] for u in reversed(problems[:15])]
    reordered = {u: counts[u] for u in reversed(problems[:15])}
    shuffled = dict(base, sets={"cd34": dict(base["sets"]["cd34"], problems=reordered)})
    (tmp_path / "shuffled.json").write_text(json.dumps(shuffled))
    assert main([*args, "--limit", "20", "--against", str(tmp_path / "shuffled.json"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["against"]["sets"]["cd34"]["diff"] == 0.0

    # bad files: one line naming the file, before any evaluation
    (tmp_path / "bad.json").write_text("{not json")
    other = dict(base, sets={"cd4": base["sets"]["cd34"]})
    (tmp_path / "other.json").write_text(json.dumps(other))
    capsys.readouterr()
    for name, words in (("bad.json", ["bad.json", "not a readable evaluation JSON"]),
                        ("other.json", ["other.json", "no set in common", "cd4"]),
                        ("missing.json", ["missing.json"])):
        assert main([*args, "--limit", "2", "--against", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_against_pools_several_sets_into_one_paired_difference(tmp_path, capsys):
    # Could fail if the pooled difference left out a set's problems, paired them by position rather than by set and
    # uid, or were given for a single set (where the set's own line is the answer).
    args = ["eval", "countdown-tiny", "--task", "countdown", "--template", "compact", "--k", "1", "--temperature",
            "0", "--max-new-tokens", "40", "--device", "cpu", "--quiet", "--limit", "6"]
    before = tmp_path / "before.json"
    assert main([*args, "--splits", "cd34,cd4", "--out", str(before)]) == 0
    base = json.loads(before.read_text())
    zero = dict(base, sets={name: dict(m, problems={u: 0 for u in m["problems"]}) for name, m in base["sets"].items()})
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    out = tmp_path / "out.json"
    assert main([*args, "--splits", "cd34,cd4", "--against", str(tmp_path / "zero.json"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    pooled = result["against"]["pooled"]
    every = [c for m in result["sets"].values() for c in m["problems"].values()]
    assert pooled["sets"] == ["cd34", "cd4"] and pooled["problems"] == len(every) == 12
    assert pooled["diff"] == pytest.approx(sum(every) / 12) and pooled["low"] <= pooled["diff"] <= pooled["high"]
    assert "cd34 + cd4 pooled against" in capsys.readouterr().out
    assert main([*args, "--splits", "cd34", "--against", str(before), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["against"]["pooled"] is None


def test_against_a_base_of_other_problems_keeps_the_evaluation(tmp_path, capsys):
    # Could fail if a base sharing the set but no problem made the evaluation itself fail or go unwritten.
    args = ["eval", "countdown-tiny", "--task", "countdown", "--template", "compact", "--splits", "cd34",
            "--k", "1", "--temperature", "0", "--max-new-tokens", "40", "--device", "cpu", "--quiet", "--limit", "3"]
    base = {"task": "countdown", "k": 1, "sets": {"cd34": {"problems": {"not-a-uid": 1}}}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    out = tmp_path / "out.json"
    assert main([*args, "--against", str(tmp_path / "base.json"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["sets"]["cd34"]["problems"]) == 3
    assert result["against"]["sets"]["cd34"] == {"problems": 0, "error": f"no problem uid in common with "
                                                                           f"{tmp_path / 'base.json'}"}
    assert "no problem uid in common" in capsys.readouterr().err
