"""Task plugins (bapo_vl/plugins.py) with real folders, a real entry point and a real training run; nothing mocked.

A plugin written to tmp_path - outside the repository - is found through tasks_dirs and trained on for two steps;
broken plugins are reported by folder without hiding the others; duplicate names are an error naming both.
"""
import sys
import textwrap
from pathlib import Path

import pytest

from bapo_vl.cli import main
from bapo_vl.config import load_config
from bapo_vl.plugins import BUNDLED, PluginError, discover, get_task, load_folder
from bapo_vl.problem import Verdict
from bapo_vl.reader import read_run
from bapo_vl.tiny import build_qwen2
from bapo_vl.train import train

REPO = Path(__file__).resolve().parents[1]

# Correct when the response starts with a character of even code point: a random tiny model gets mixed groups.
EVEN = '''
from bapo_vl.problem import Problem, Verdict

NAME = "{name}"
EVAL_SPLITS = ["test"]


def load(split="train", source=None, n=16, **options):
    return [Problem(f"{name}-{{split}}-{{i}}", [{{"role": "user", "content": f"q{{i}}"}}], None) for i in range(n)]


def verify(response, answer):
    if not response:
        return Verdict.UNPARSABLE
    return Verdict.CORRECT if ord(response[0]) % 2 == 0 else Verdict.WRONG
'''


def mine(errors, root: Path) -> list[PluginError]:
    """The errors of plugins under `root` (the bundled tasks/ may be mid-edit elsewhere)."""
    return [e for e in errors if str(root) in e.origin]


def write_plugin(root: Path, folder: str, source: str) -> Path:
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / "task.py").write_text(textwrap.dedent(source))
    return root / folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    model, tok = build_qwen2()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_plugin_outside_the_repo_is_found_and_trained_on(tmp_path, tiny_model):
    # Could fail if tasks_dirs were not searched, if the folder's module could not be imported from outside the
    # package, or if the trainer could not run a plugin's load/verify end to end.
    plugins = tmp_path / "my_tasks"
    folder = write_plugin(plugins, "even_first", EVEN.format(name="even_first"))
    task = get_task("even_first", [str(plugins)])
    assert Path(task.origin) == folder and task.eval_splits == ["test"]
    cfg = load_config(overrides=[
        "task=even_first", f"tasks_dirs=['{plugins}']", "task_options={}", f"model={tiny_model}",
        f"run_dir={tmp_path / 'runs'}", "name=even", "device=cpu", "dtype=float32", "steps=2", "batch_size=4",
        "group_size=4", "max_response_length=4", "mini_batch_size=4", "micro_batch_size=16", "delay=1", "lr=1e-3"])
    run = read_run(train(cfg, quiet=True))
    assert [s["step"] for s in run["steps"]] == [1, 2]
    assert run["meta"]["status"] == "finished" and run["config"]["task"] == "even_first"
    assert all(s["rollouts_fresh"] == 16 for s in run["steps"])  # 4 prompts x 4 responses were verified


def test_a_plugin_folder_itself_can_be_named(tmp_path):
    # Could fail if only folders *of* plugin folders were searched.
    folder = write_plugin(tmp_path, "solo", EVEN.format(name="solo"))
    assert get_task("solo", [str(folder)]).origin == str(folder)


BROKEN = {
    # folder: (task.py, what the error must say)
    "syntax": ("NAME = 'syntax'\ndef load(split='train', source=None:\n    pass\n", "SyntaxError"),
    "no_verify": ("NAME = 'no_verify'\ndef load(split='train', source=None):\n    return []\n", "verify()"),
    "name_not_str": (EVEN.format(name="x").replace('NAME = "x"', "NAME = 3"), "NAME must be a non-empty str"),
    "load_no_split": (EVEN.format(name="load_no_split").replace('def load(split="train", source=None, n=16, **options)',
                                                               "def load(source=None, n=16)"), "split="),
    "load_no_source": (EVEN.format(name="load_no_source").replace(
        'def load(split="train", source=None, n=16, **options)', 'def load(split="train", n=16)'), "source="),
    "bad_eval_splits": (EVEN.format(name="bad_eval_splits").replace('EVAL_SPLITS = ["test"]', 'EVAL_SPLITS = "test"'),
                        "EVAL_SPLITS"),
    "bad_version": (EVEN.format(name="bad_version") + "VERSION = 2\n", "VERSION must be a str"),
    "bad_verify_batch": (EVEN.format(name="bad_verify_batch") + "def verify_batch(responses):\n    return []\n",
                         "verify_batch() must take (responses, answers)"),
    "raises": ("raise RuntimeError('no data here')\n", "RuntimeError: no data here"),
    "exits": ("import sys\nsys.exit(3)\n", "SystemExit"),
}


@pytest.mark.parametrize("folder", sorted(BROKEN))
def test_broken_plugin_is_named_and_hides_no_other(tmp_path, folder):
    # Could fail if a broken plugin crashed discovery, hid the good plugin beside it, was only caught at first
    # call, or if the error did not say which folder (and what) is broken.
    source, says = BROKEN[folder]
    write_plugin(tmp_path, "good", EVEN.format(name="good"))
    broken = write_plugin(tmp_path, folder, source)
    with pytest.raises(PluginError) as info:
        load_folder(broken)
    assert info.value.origin == str(broken) and str(broken) in str(info.value) and says in str(info.value)
    tasks, errors = discover([str(tmp_path)])
    assert "good" in tasks and "countdown" in tasks  # neither the other extra plugin nor the bundled ones hidden
    assert [e.origin for e in mine(errors, tmp_path)] == [str(broken)]
    assert get_task("good", [str(tmp_path)]).verify("b", None) is Verdict.CORRECT


def test_missing_tasks_dir_is_an_error_not_a_crash(tmp_path):
    tasks, errors = discover([str(tmp_path / "nope")])
    errors = mine(errors, tmp_path)
    assert "countdown" in tasks
    assert [e.origin for e in errors] == [str(tmp_path / "nope")] and "no such folder" in str(errors[0])


def test_duplicate_names_are_an_error_naming_both(tmp_path):
    # Could fail if the second plugin silently replaced the first (or the other way round).
    first = write_plugin(tmp_path / "a", "dup", EVEN.format(name="dup"))
    second = write_plugin(tmp_path / "b", "other_folder", EVEN.format(name="dup"))
    tasks, errors = discover([str(tmp_path / "a"), str(tmp_path / "b")])
    errors = mine(errors, tmp_path)
    assert tasks["dup"].origin == str(first)  # still listed, from where it was found first
    assert len(errors) == 1 and str(first) in str(errors[0]) and str(second) in str(errors[0])
    with pytest.raises(PluginError, match="rename one"):
        get_task("dup", [str(tmp_path / "a"), str(tmp_path / "b")])
    # a user plugin reusing a bundled name is a duplicate too
    shadow = write_plugin(tmp_path / "c", "countdown", EVEN.format(name="countdown"))
    _, errors = discover([str(tmp_path / "c")])
    errors = mine(errors, tmp_path)
    assert len(errors) == 1 and str(shadow) in str(errors[0]) and str(BUNDLED / "countdown") in str(errors[0])
    # ...but the same folder named twice is one plugin
    tasks, errors = discover([str(tmp_path / "a"), str(tmp_path / "a")])
    assert "dup" in tasks and mine(errors, tmp_path) == []


def test_get_task_finds_a_plugin_written_later(tmp_path):
    # Could fail if the discovery cache, keyed by folders, hid a plugin folder added after the first lookup.
    assert get_task("countdown", [str(tmp_path)]).name == "countdown"
    write_plugin(tmp_path, "late", EVEN.format(name="late"))
    assert get_task("late", [str(tmp_path)]).name == "late"
    with pytest.raises(KeyError, match="late"):  # an unknown name lists what was found
        get_task("nope", [str(tmp_path)])


def test_bundled_countdown_declares_its_eval_splits():
    assert {"cd34", "cd4"} <= set(get_task("countdown").eval_splits)


def test_bapo_tasks_lists_plugins_and_errors(tmp_path, capsys):
    # Could fail if `bapo tasks` dropped the eval splits or origins, hid the broken plugin, or exited 0 anyway.
    good = write_plugin(tmp_path, "good", EVEN.format(name="good"))
    broken = write_plugin(tmp_path, "broken", BROKEN["no_verify"][0])
    assert main(["tasks", "--tasks-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "test" in lines["good"] and str(good) in lines["good"]
    assert "cd34, cd4" in lines["countdown"] and "geometry3k" in lines
    assert str(broken) in err and "verify()" in err and "1 broken" in err
    bundled_ok = not discover()[1]
    assert main(["--tasks-dir", str(good), "tasks"]) == (0 if bundled_ok else 1)  # the global option; clean: 0
    assert "good" in capsys.readouterr().out


def test_entry_point_plugin_is_discovered(tmp_path, monkeypatch):
    # Could fail if the `bapo_vl.tasks` entry-point group were not read, or a failing entry point hid the others.
    site = tmp_path / "site"
    site.mkdir()
    (site / "bapo_test_ep_task.py").write_text(textwrap.dedent(EVEN.format(name="from_entry_point")))
    dist = site / "bapo_test_ep-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bapo-test-ep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[bapo_vl.tasks]\nfrom_entry_point = bapo_test_ep_task\nmissing = bapo_test_ep_no_such_module\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        tasks, errors = discover()
        task = tasks["from_entry_point"]
        assert "entry point from_entry_point = bapo_test_ep_task" in task.origin and "bapo-test-ep" in task.origin
        assert task.eval_splits == ["test"] and task.verify("b", None) is Verdict.CORRECT
        errors = [e for e in errors if "bapo_test_ep" in e.origin]
        assert [e.origin.split()[2] for e in errors] == ["missing"] and "ModuleNotFoundError" in str(errors[0])
        assert "countdown" in tasks
    finally:
        sys.modules.pop("bapo_test_ep_task", None)


def test_example_plugin_loads(capsys):
    # Could fail if the documented example broke the contract, or `bapo tasks` did not find it where the README says.
    examples = REPO / "examples" / "task_plugin"
    task = get_task("echo_digits", [str(examples)])
    assert task.eval_splits == ["test"] and task.origin == str(examples / "echo_digits")
    problems = task.load(split="test", limit=3)
    assert len(problems) == 3 and all(p.answer.isdigit() for p in problems)
    answer = problems[0].answer
    assert task.verify(" ".join(answer), answer) is Verdict.CORRECT  # digits with spaces between
    assert task.verify(f"<answer>{answer[::-1]}9</answer>", answer) is Verdict.WRONG
    assert task.verify("no digits", answer) is Verdict.UNPARSABLE
    main(["tasks", "--tasks-dir", str(examples)])
    assert "echo_digits" in capsys.readouterr().out


BATCHED = EVEN + '''
VERSION = "even-2"
CALLS = []


def verify_batch(responses, answers):
    CALLS.append(len(responses))
    if any(r.startswith("\\x00") for r in responses):
        raise ValueError("hostile batch")
    return [verify(r, a) for r, a in zip(responses, answers)]
'''


def test_verify_batch_and_version_reach_the_trainer_and_the_record(tmp_path, tiny_model):
    # Could fail if the trainer verified one response at a time despite verify_batch, if a raising verify_batch
    # crashed the step instead of falling back, or if the verifier version were not recorded with the run.
    from bapo_vl.trainer import verify_all

    plugins = tmp_path / "my_tasks"
    write_plugin(plugins, "batched", BATCHED.format(name="batched"))
    task = get_task("batched", [str(plugins)])
    assert task.version == "even-2" and task.verify_batch is not None
    texts = ["b", "a", "\x00x"]
    assert verify_all(task, texts, [None] * 3) == [Verdict.CORRECT, Verdict.WRONG, Verdict.CORRECT]
    assert task.module.CALLS == [3]  # raised, then one at a time through verify()
    cfg = load_config(overrides=[
        "task=batched", f"tasks_dirs=['{plugins}']", "task_options={}", f"model={tiny_model}",
        f"run_dir={tmp_path / 'runs'}", "name=b", "device=cpu", "dtype=float32", "steps=1", "batch_size=4",
        "group_size=4", "max_response_length=4", "mini_batch_size=4", "micro_batch_size=16", "delay=1"])
    task.module.CALLS.clear()
    run = read_run(train(cfg, quiet=True))
    assert task.module.CALLS == [16]  # all 4 x 4 fresh responses in one call
    assert run["meta"]["verifier_version"] == "even-2"


def test_bundled_tasks_are_versioned():
    for name in ("countdown", "math", "geometry3k"):
        assert get_task(name).version, name
    assert get_task("math").verify_batch is not None
