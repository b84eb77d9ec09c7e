"""Countdown: verifier (hostile input), solver, generator, loader, plugin."""
import json
import logging
import time
from fractions import Fraction
from pathlib import Path

import pytest

from bapo_vl.plugins import get_task, load_folder
from bapo_vl.problem import Verdict
from bapo_vl.verifiers.countdown import CountdownParseError, evaluate, extract_answer, solve, verify

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "countdown"
RAW = SHARED / "countdown_3to4_raw_rows_0-11023.jsonl"
BASE = SHARED / "tinyzero_test_1024_base.jsonl"
QWEN = SHARED / "tinyzero_test_1024_qwen-instruct.jsonl"
FIXTURE = ROOT / "tests" / "fixtures" / "countdown_rows.jsonl"
task = load_folder(ROOT / "tasks" / "countdown").module

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} absent")


def rows_of(path, n=None):
    with open(path) as f:
        return [json.loads(line) for _, line in zip(range(n or 10**9), f)]


def timed_verify(response, answer):
    t = time.perf_counter()
    verdict = verify(response, answer)
    assert time.perf_counter() - t < 0.05, f"verify took too long on {response[:60]!r}"
    return verdict


A = {"nums": [44, 19, 35], "target": 98}

CORRECT = [
    ("<answer>(44+19)+35</answer>", A),  # the compact policy's target response
    ("<answer>44+(19+35)</answer>", A),  # other parenthesisation, same value
    ("<answer>35+44+19</answer>", A),  # any order of the numbers
    ("<answer> ( 44 +\t19 ) + 35 </answer>", A),  # spaces and tabs are ignored
    ("<think>try 44+19</think>\n<answer>((44)+(19+35))</answer>", A),  # redundant parentheses
    ("<answer>1+2</answer> on second thought <answer>44+19+35</answer>", A),  # the last answer counts
    ("<answer>(96-63)/(3)</answer>", {"nums": [96, 63, 3], "target": 11}),  # exact division 33/3
    ("<answer>4/(1-2/3)</answer>", {"nums": [4, 1, 2, 3], "target": 12}),  # non-integer intermediate 1/3
    ("<answer>6/(1-3/4)</answer>", {"nums": [1, 3, 4, 6], "target": 24}),  # 6/(1/4), exact fractions
    ("<answer>oops <answer>44+19+35</answer>", A),  # a stray open tag: the last complete pair counts
    ("<answer>2*3*7</answer>", {"nums": [7, 3, 2], "target": 42}),  # multiplication chain
    ("<answer>94-94+89</answer>", {"nums": [94, 89, 94], "target": 89}),  # repeated number used twice as given
]

WRONG = [
    ("<answer>44+19-35</answer>", A),  # value 28, not 98
    ("<answer>44+44+10</answer>", A),  # 44 reused, 19 and 35 not given like that
    ("<answer>44+19</answer>", A),  # 35 missing
    ("<answer>44+19+35+0</answer>", A),  # extra number 0
    ("<answer>44+19+35*1</answer>", A),  # extra number 1
    ("<answer>44+19+35</answer> then <answer>44+19</answer>", A),  # the last answer misses 35
    ("<answer>3/(5-5)</answer>", {"nums": [5, 5, 3], "target": 1}),  # division by zero: no value
    ("<answer>999999*999999*999999</answer>", {"nums": [999999] * 3, "target": 1}),  # intermediate > 1e12
]

UNSAFE = [
    "2**999999999",  # power: not an allowed operator (and never computed)
    "9**9**9**9",  # tower of powers
    "__import__('os').system('ls')",  # names, calls, strings
    "().__class__",  # attribute access
    "x+1",  # a name
    "nums[0]",  # subscript
    "lambda: 1",  # lambda
    "1e308*10",  # float literal ('e' and '.' are outside the whitelist)
    "44.0+19+35",  # float literal
    "'a'*10",  # string literal
    "(" * 1000 + "1" + ")" * 1000,  # 1000 levels of nesting
    "(" * 33 + "44+19+35" + ")" * 33,  # nesting just past the cap, yet short
    "1+" * 500_000 + "1",  # 1 MB expression (far over the length cap)
    "(44+19+35",  # unbalanced parentheses
    "44+19)+35(",  # closes before it opens
    "",  # empty answer
    "   ",  # blank answer
    "٤٤+١٩+٣٥",  # Arabic-Indic digits: Python would parse them, the whitelist does not
    "４４+１９+３５",  # fullwidth digits
    "-44+19+35+88",  # unary minus: rejected by design
    "+44+19+35",  # unary plus
    "44//1+19+35",  # floor division
    "44%45+19+35",  # modulo
    "0x2C+19+35",  # hex literal
    "4_4+19+35",  # digit separator
    "044+19+35",  # leading zero: a SyntaxError in Python 3
    "44+19+35=98",  # an equation, not an expression
    "44 19 35",  # no operators
    "44+19+35;1",  # statement separator
    "[44+19+35]",  # list
    "44+19+35 if 1 else 0",  # conditional
    "44+\x0019+35",  # NUL byte
    "9" * 199,  # within the length cap, but a literal over 1e12
    "<answer>44+19+35</answer>",  # nested tags: the inner close tag ends up inside the last pair
]


@pytest.mark.parametrize("response,answer", CORRECT)
def test_verify_correct(response, answer):
    assert timed_verify(response, answer) is Verdict.CORRECT


@pytest.mark.parametrize("response,answer", WRONG)
def test_verify_wrong(response, answer):
    assert timed_verify(response, answer) is Verdict.WRONG


@pytest.mark.parametrize("expr", UNSAFE, ids=lambda e: repr(e[:20]))
def test_verify_rejects_unsafe_and_malformed(expr):
    assert timed_verify(f"<answer>{expr}</answer>", A) is Verdict.UNPARSABLE
    with pytest.raises(CountdownParseError):
        evaluate(expr)


HOSTILE_RESPONSES = [
    "",  # nothing
    "44+19+35",  # no tags
    "<answer>44+19+35",  # no closing tag
    "44+19+35</answer>",  # no opening tag
    "</answer>44+19+35<answer>",  # tags in the wrong order
    "<answer></answer>",  # empty tags
    "<answer><answer>44+19+35</answer></answer>",  # nested tags: the last pair wraps '...</answer>'
    "<answer>" * 200_000,  # 1.6 MB of open tags
    "</answer>" * 200_000,  # 1.8 MB of close tags
    "<answer>" + "1+" * 500_000 + "1</answer>",  # 1 MB answer: the opening tag is beyond the searched tail
    "<answer>" + "(" * 100_000 + "1" + ")" * 100_000 + "</answer>",  # deep nesting, 200 KB
    "x" * 1_000_000 + "<answer>" + "(" * 5000 + "1" + ")" * 5000 + "</answer>",  # nesting within the tail
    "\ud800<answer>44+19+35\udfff</answer>",  # lone surrogates
]


@pytest.mark.parametrize("response", HOSTILE_RESPONSES, ids=lambda r: repr(r[:20]))
def test_verify_hostile_responses(response):
    assert timed_verify(response, A) is Verdict.UNPARSABLE


def test_verify_never_raises_on_garbage():
    assert verify(None, A) is Verdict.UNPARSABLE  # not a str at all
    assert verify("<answer>44+19+35</answer>", None) is Verdict.UNPARSABLE  # broken ground truth
    assert verify("<answer>44+19+35</answer>", {"nums": [44, 19, 35]}) is Verdict.UNPARSABLE  # no target


def test_extract_and_evaluate():
    assert extract_answer("a <answer> 1+2 </answer> b <answer>3</answer> c") == "3"  # last pair
    assert extract_answer("no tags") is None
    assert extract_answer("x" * 100_000 + "<answer>5</answer>") == "5"  # the tail of a long response is read
    assert evaluate("4/(1-2/3)") == 12 and evaluate("1/3") == Fraction(1, 3)
    with pytest.raises(CountdownParseError):
        evaluate("1/(2-2)")  # division by zero has no value
    with pytest.raises(CountdownParseError):
        evaluate("1+2", max_len=2)  # over the caller's length cap


@needs_shared
def test_solver_on_tinyzero_test_rows():
    for row in rows_of(BASE, 200):  # all solvable
        expr = solve(row["nums"], row["target"])
        assert expr is not None, row
        assert verify(f"<answer>{expr}</answer>", {"nums": row["nums"], "target": row["target"]}) is Verdict.CORRECT


@pytest.mark.parametrize("nums,target", [
    ([1, 1, 1], 100),  # at most 3 from three ones
    ([97, 89, 83, 79], 1000000007),  # out of reach
    ([], 5),  # nothing to combine
])
def test_solver_impossible(nums, target):
    assert solve(nums, target) is None


def test_generator():
    problems = task.generate_problems(300, seed=0)
    assert problems == task.generate_problems(300, seed=0)  # deterministic for a seed
    assert problems != task.generate_problems(300, seed=1)
    assert task.generate_problems(100, seed=0) == problems[:100]  # prefix-stable, so load(limit=) is cheap
    for nums, target, text in problems:
        assert len(nums) in (3, 4) and all(1 <= n <= 99 for n in nums)
        assert 10 <= target <= 100
        answer = {"nums": nums, "target": target}
        assert verify(f"<answer>{text}</answer>", answer) is Verdict.CORRECT  # the known solution checks out
        assert verify(f"<answer>{solve(nums, target)}</answer>", answer) is Verdict.CORRECT


def test_templates():
    assert task.TEMPLATES["compact"]([44, 19, 35], 98) == [{"role": "user", "content": "44 19 35 -> 98"}]
    chat = task.TEMPLATES["chat"]([44, 19, 35], 98)
    assert [m["role"] for m in chat] == ["system", "user"]


@needs_shared
def test_templates_reproduce_tinyzero_prompts():
    for row in rows_of(BASE):
        assert task.TEMPLATES["tinyzero"](row["nums"], row["target"]) == row["prompt"]
    for row in rows_of(QWEN):  # chat messages rendered with Qwen's template + TinyZero's assistant prefix
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                       for m in task.TEMPLATES["chat"](row["nums"], row["target"]))
        assert text + "<|im_start|>assistant\n" + task.CHAT_ASSISTANT_PREFIX == row["prompt"][0]["content"]


def test_load_generated():
    train = task.load(limit=50)
    assert len(train) == 50 and train == task.load(limit=50)  # seeded
    assert [p.uid for p in train] == [p.uid for p in task.load(limit=50)]
    test = task.load("test", template="compact")
    assert len(test) == 1024 and len({p.uid for p in test}) == 1024
    assert test[0].answer != train[0].answer  # test uses seed+1
    p = test[0]
    assert p.uid == f"countdown-{'_'.join(map(str, p.answer['nums']))}-{p.answer['target']}"
    assert verify(f"<answer>{p.meta['solution']}</answer>", p.answer) is Verdict.CORRECT


@needs_shared
def test_load_published_jsonl():
    raw = task.load(source=str(RAW), template="compact")
    assert len(raw) == 11024 and raw[0].uid == "countdown-0" and raw[0].answer == {"nums": [44, 19, 35], "target": 98}
    assert len({p.uid for p in raw}) == len(raw)
    base = task.load("test", source=BASE, template="tinyzero")
    rows = rows_of(BASE)
    assert len(base) == 1024 and [p.uid for p in base] == [f"countdown-{r['extra_info']['index']}" for r in rows]
    assert all(p.answer == {"nums": r["reward_model"]["ground_truth"]["numbers"], "target": r["target"]}
               for p, r in zip(base, rows))
    assert all(p.messages == r["prompt"] for p, r in zip(base, rows))
    qwen = task.load("test", source=QWEN)
    assert [p.answer for p in qwen] == [p.answer for p in base]
    assert [p.uid for p in base] == [p.uid for p in task.load("test", source=BASE)]  # stable across loads


def test_load_fixture():
    problems = task.load(source=FIXTURE, template="compact")
    assert len(problems) == 10
    assert problems[0].uid == "countdown-44_19_35-98" and problems[-1].uid == "countdown-44_19_35-98#2"  # repeat row
    assert len({p.uid for p in problems}) == 10
    assert problems[0].messages == [{"role": "user", "content": "44 19 35 -> 98"}]
    assert all(solve(**p.answer) is not None for p in problems)
    assert len(task.load("cd34", source=FIXTURE)) == 10  # fewer rows than 200: all of them
    assert len(task.load(source=FIXTURE, limit=3)) == 3


def test_load_parquet_and_json(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    tinyzero = [{"target": 98, "nums": [44, 19, 35], "data_source": "countdown",
                 "prompt": [{"content": "...", "role": "user"}], "ability": "math",
                 "reward_model": {"ground_truth": {"numbers": [44, 19, 35], "target": 98}, "style": "rule"},
                 "extra_info": {"index": 7, "split": "train"}},
                {"target": 11, "nums": [96, 63, 3], "data_source": "countdown",
                 "prompt": [{"content": "...", "role": "user"}], "ability": "math",
                 "reward_model": {"ground_truth": {"numbers": [96, 63, 3], "target": 11}, "style": "rule"},
                 "extra_info": {"index": 8, "split": "train"}}]
    pq.write_table(pa.Table.from_pylist(tinyzero), tmp_path / "tz.parquet")
    problems = task.load(source=tmp_path / "tz.parquet")
    assert [p.uid for p in problems] == ["countdown-7", "countdown-8"]
    assert problems[1].answer == {"nums": [96, 63, 3], "target": 11}

    raw = [{"target": 98, "nums": [44, 19, 35]}, {"target": 11, "nums": [96, 63, 3]}]  # HF raw schema
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "raw.parquet")
    assert [p.uid for p in task.load(source=tmp_path / "raw.parquet")] == ["countdown-44_19_35-98",
                                                                         "countdown-96_63_3-11"]
    (tmp_path / "rows.json").write_text(json.dumps(raw))  # a JSON list
    assert [p.answer for p in task.load(source=tmp_path / "rows.json")] == [p.answer for p in problems]


GOOD_ROW = {"target": 98, "nums": [44, 19, 35]}
BAD_ROWS = [
    {"nums": [44, 19, 35]},  # no target
    {"target": 98},  # no nums
    {"target": "98", "nums": [44, 19, 35]},  # target a string
    {"target": 98.0, "nums": [44, 19, 35]},  # target a float
    {"target": True, "nums": [44, 19, 35]},  # a bool is not a number here
    {"target": 98, "nums": [44, 19.5, 35]},  # non-integer number
    {"target": 98, "nums": "44 19 35"},  # nums a string
    {"target": 98, "nums": []},  # nothing to combine
    {"target": 98, "nums": [-44, 19, 35]},  # negative numbers cannot be written without unary minus
    {"target": 98, "nums": [44, 19, 35], "reward_model": {"ground_truth": {"numbers": [1, 2], "target": 98}}},  # disagree
    {"target": 98, "nums": [44, 19, 35], "reward_model": "rule"},  # reward_model not an object
    {"target": 98, "nums": [44, 19, 35], "row": "a"},  # index not an integer
    [98, [44, 19, 35]],  # not an object
]


@pytest.mark.parametrize("bad", BAD_ROWS, ids=lambda b: json.dumps(b)[:40])
def test_load_malformed_row_names_file_and_row(tmp_path, bad):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (GOOD_ROW, GOOD_ROW, bad)) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2\b"):
        task.load(source=path)


def test_load_skip_bad_warns_with_count(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(GOOD_ROW), "{not json", *map(json.dumps, BAD_ROWS), json.dumps({"target": 11, "nums": [96, 63, 3]})]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"mixed\.jsonl: row 1\b"):  # the invalid JSON line
        task.load(source=path)
    with caplog.at_level(logging.WARNING):
        problems = task.load(source=path, skip_bad=True)
    assert [p.answer["target"] for p in problems] == [98, 11]
    assert f"skipped {len(BAD_ROWS) + 1} malformed row(s) of {path}" in caplog.text


def test_load_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="template"):
        task.load(template="nope")
    with pytest.raises(ValueError, match="split"):
        task.load(split="validation")
    (tmp_path / "rows.csv").write_text("target,nums\n")
    with pytest.raises(ValueError, match=r"rows\.csv"):
        task.load(source=tmp_path / "rows.csv")


@pytest.mark.parametrize("source", [None, pytest.param(RAW, marks=needs_shared)], ids=["generated", "raw"])
def test_eval_splits(source):
    for split, sizes in (("cd34", {3, 4}), ("cd4", {4})):
        problems = task.load(split, source=source)
        assert len(problems) == 200 and len({p.uid for p in problems}) == 200
        assert {len(p.answer["nums"]) for p in problems} == sizes  # cd34 mixes both sizes
        assert [p.uid for p in problems] == [p.uid for p in task.load(split, source=source)]  # deterministic
        assert [p.uid for p in problems] != [p.uid for p in task.load(split, source=source, seed=0)]


def test_plugin_discovery():
    countdown = get_task("countdown")
    problems = countdown.load(limit=5, template="compact")
    assert len(problems) == 5
    p = problems[0]
    assert countdown.verify(f"<answer>{p.meta['solution']}</answer>", p.answer) is Verdict.CORRECT
    assert countdown.verify("<answer>__import__('os')</answer>", p.answer) is Verdict.UNPARSABLE
