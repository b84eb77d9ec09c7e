"""Fuzz of the three verifiers: >= 20,000 seeded hostile responses each (tests/hostile.py: values near
the gold, hedges, relation chains, unit words, smuggled golds, LaTeX injection, unicode lookalikes, power towers,
deep nesting, 100 kB strings, reused / missing / extra countdown numbers, division by zero ...), every one judged by
an oracle that shares no code with the verifier. Each verifier is called without its last-resort guard, so an
exception is counted, not hidden. Asserted: 0 exceptions, 0 overruns of the verifier's stated TIME_BUDGET, 0 false
positives; the counts are printed (pytest -s).

Then the batches: a batch of pathological responses through the API the trainer uses (verify_batch for math,
verify one by one for the others) stays within its time bound (for math: each response within its own CPU-time
limit, no batch deadline), and a sandbox worker stalled inside C code or sympy is killed at its limit and
replaced, so that the next batch is judged normally. The families of hostile answers found in review (negations, unicode roots,
subscripts, degrees in trig, complex forms, decimal golds...) are fuzzed in tests/test_math_fuzz_families.py.
"""
import gc
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest

import hostile
from bapo_vl.plugins import load_folder
from bapo_vl.problem import Verdict
from bapo_vl.verifiers import choice, countdown, sandbox
from bapo_vl.verifiers import math as mv

N = 20_000
SEED = 12
WALL_SLACK = 1.0  # seconds over the budget a call may take in wall time (scheduling on a loaded machine)
ROOT = Path(__file__).resolve().parents[1]
SHARED = None if os.environ.get("BAPO_TEST_NO_SHARED") == "1" else ROOT.parent / "shared" / "data"
FIXTURES = ROOT / "tests" / "fixtures"


def _shared(*parts) -> Path | None:
    path = SHARED.joinpath(*parts) if SHARED else None
    return path if path is not None and path.exists() else None


def _countdown_rows() -> list[dict]:
    path = _shared("countdown", "countdown_3to4_raw_rows_0-11023.jsonl") or FIXTURES / "countdown_rows.jsonl"
    with open(path) as f:
        return [json.loads(line) for _, line in zip(range(2000), f)]


def _math_golds() -> list[str]:
    folder = _shared("math", "qwen_eval") or FIXTURES / "math" / "qwen_eval"
    golds = []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path) as f:
            golds += [str(json.loads(line).get("answer", "")) for line in f if line.strip()]
    return golds


def _geometry3k_answers() -> list[dict]:
    task = load_folder(ROOT / "tasks" / "geometry3k").module
    source = _shared("geometry3k")
    if source is None:  # the bundled problems have only the train split
        return [p.answer for p in task.load(split="train", source=str(FIXTURES / "geometry3k"))]
    return [p.answer for p in task.load(split="val", source=str(source))]


def _fuzz(name: str, cases, judge, budget: float, wall_budget: float) -> dict:
    """Run judge(case) on every case; count exceptions, overruns (CPU time of this thread over `budget`, or wall
    time over `wall_budget`), false positives and rejected controls; print and return the counts. The garbage
    collector waits outside the timed calls: a collection of the test process's heap is not the verifier's time."""
    counts = Counter()
    exceptions, overruns, false_positives, rejected = [], [], [], Counter()
    max_cpu = max_wall = 0.0
    t0 = time.perf_counter()
    for case in cases:
        counts[case.label] += 1
        counts[case.form] += case.form == "control"
        gc.disable()
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            verdict = judge(case)
        except Exception as e:  # noqa: BLE001 - counted
            exceptions.append((case.form, case.response[:120], f"{type(e).__name__}: {e}"))
            continue
        finally:
            cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
            gc.enable()
        max_cpu, max_wall = max(max_cpu, cpu), max(max_wall, wall)
        if cpu > budget or wall > wall_budget:
            overruns.append((case.form, case.response[:120], round(cpu, 3), round(wall, 3)))
        if not isinstance(verdict, Verdict):
            exceptions.append((case.form, case.response[:120], f"returned {verdict!r}"))
        elif verdict is Verdict.CORRECT and case.label == "wrong":
            false_positives.append((case.form, case.response[-160:], case.answer))
        elif verdict is not Verdict.CORRECT and case.label == "right" and case.form == "control":
            rejected[verdict.name] += 1
    elapsed = time.perf_counter() - t0
    total = counts["wrong"] + counts["right"]
    controls = counts["control"]
    print(f"\n{name} fuzz: {total - controls} hostile responses + {controls} controls ({counts['wrong']} wrong by "
          f"construction, {counts['right']} right) in {elapsed:.1f} s: {len(exceptions)} exceptions, "
          f"{len(overruns)} overruns (max {max_cpu * 1e3:.1f} ms CPU, {max_wall * 1e3:.0f} ms wall; budget "
          f"{budget * 1e3:.0f} ms CPU), {len(false_positives)} false positives; "
          f"controls rejected: {dict(rejected) or 0}")
    return {"hostile": total - controls, "exceptions": exceptions, "overruns": overruns,
            "false_positives": false_positives, "rejected": sum(rejected.values()), "controls": controls}


def _assert_clean(result: dict, control_accuracy: float) -> None:
    assert result["hostile"] >= N
    assert not result["exceptions"], result["exceptions"][:10]
    assert not result["overruns"], result["overruns"][:10]
    assert not result["false_positives"], result["false_positives"][:10]
    assert result["rejected"] <= (1 - control_accuracy) * result["controls"], "the fuzz is vacuous: controls rejected"


def test_countdown_fuzz():
    cases = hostile.countdown_cases(random.Random(SEED), N, _countdown_rows())

    def judge(case):
        verdict = countdown._verify(case.response, case.answer)
        if verdict is Verdict.CORRECT:  # the oracle's own reading, whatever the construction meant
            assert hostile.countdown_truth(case.response, case.answer["nums"], case.answer["target"]), case.response
        return verdict

    result = _fuzz("countdown", cases, judge, countdown.TIME_BUDGET, countdown.TIME_BUDGET + WALL_SLACK)
    _assert_clean(result, control_accuracy=0.99)


def test_math_fuzz():
    mv.warm_up()
    golds = hostile.real_rational_golds(_math_golds())
    cases = hostile.math_cases(random.Random(SEED), N, golds)
    result = _fuzz("math", cases, lambda c: mv._verify(c.response, c.answer), mv.TIME_BUDGET,
                   mv.TIME_BUDGET + mv.SYMBOLIC_TIMEOUT + WALL_SLACK)
    _assert_clean(result, control_accuracy=0.95)


def test_geometry3k_fuzz():
    cases = hostile.choice_cases(random.Random(SEED), N, _geometry3k_answers())
    result = _fuzz("geometry3k", cases, lambda c: choice._verify(c.response, c.answer, choice.LETTERS),
                   choice.TIME_BUDGET, choice.TIME_BUDGET + WALL_SLACK)
    _assert_clean(result, control_accuracy=0.99)


# --- batches -----------------------------------------------------------------------------------------------

def _pathological(cases, n: int) -> list:
    """The n largest hostile responses of a generator's first 5,000."""
    wrong = [c for _, c in zip(range(5000), cases) if c.label == "wrong"]
    return sorted(wrong, key=lambda c: -len(c.response))[:n]


@pytest.mark.parametrize("name", ["countdown", "geometry3k"])
def test_batch_of_pathological_responses_in_process(name):
    """Countdown and Geometry3K verify in-process, one response at a time (the trainer's verify_all): a batch of
    the largest hostile responses takes at most its size times the per-response budget, and none passes."""
    from bapo_vl.trainer import verify_all

    task = load_folder(ROOT / "tasks" / name).module
    budget = {"countdown": countdown.TIME_BUDGET, "geometry3k": choice.TIME_BUDGET}[name]
    gen = hostile.countdown_cases(random.Random(SEED + 1), 5000) if name == "countdown" else \
        hostile.choice_cases(random.Random(SEED + 1), 5000)
    batch = _pathological(gen, 512)
    t0, c0 = time.perf_counter(), time.thread_time()
    verdicts = verify_all(task, [c.response for c in batch], [c.answer for c in batch])
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    print(f"\n{name}: {len(batch)} pathological responses ({sum(len(c.response) for c in batch) // 1000} kB) "
          f"in {wall:.2f} s wall, {cpu:.2f} s CPU (budget {len(batch) * budget:.1f} s)")
    assert Verdict.CORRECT not in verdicts
    assert cpu <= len(batch) * budget and wall <= len(batch) * budget + WALL_SLACK


HANGS = r"\Gamma(10^{10}+\frac{1}{2})"  # sympy computes it for minutes: only the kill of its worker stops it


def test_math_batch_limits_each_response_and_replaces_stalled_workers():
    """verify_batch (what the math task gives the trainer) over pathological responses, some of which stall sympy:
    there is no batch deadline; each stall is ended at its own CPU-time limit (TIMEOUT) and its worker
    replaced in the background, the other responses get their own verdicts, and the next batch is judged normally."""
    mv.warm_up()
    pool = mv._get_pool()
    before = {w.proc.pid for w in pool._idle}
    per = 1.0
    gen = hostile.math_cases(random.Random(SEED + 1), 5000)
    hostile_batch = [(c.response, c.answer) for c in _pathological(gen, 16)]
    stalls = [(f"\\boxed{{{HANGS} + {k}}}", "5") for k in range(2 * pool.size)]
    batch = hostile_batch + stalls
    t0 = time.monotonic()
    verdicts = mv.verify_batch([r for r, _ in batch], [a for _, a in batch], timeout=per)
    took = time.monotonic() - t0
    print(f"\nmath verify_batch: {len(batch)} pathological responses ({len(stalls)} stalling sympy, {per:g} s of CPU "
          f"each, {pool.size} workers) in {took:.2f} s: {Counter(v.name for v in verdicts)}")
    assert Verdict.CORRECT not in verdicts
    assert verdicts[len(hostile_batch):] == [Verdict.TIMEOUT] * len(stalls)
    # ended by their CPU limit (a stall per worker at a time, plus the starts of replacements), far before the wall
    # clock backstop that only a hung worker meets
    assert took < len(stalls) * per + 30 < mv.SYMBOLIC_WALL_LIMIT
    assert any(_gone(pid) for pid in before)  # stalled workers were killed (and reaped)

    t0 = time.monotonic()
    normal = mv.verify_batch([r"\boxed{(x+2)(x+5)}", r"\boxed{\sin^2 x + \cos^2 x}", r"\boxed{x^2+7x+11}"],
                             ["x^2+7x+10", "1", "x^2+7x+10"])
    assert normal == [Verdict.CORRECT, Verdict.CORRECT, Verdict.WRONG]
    assert pool._count <= pool.size and not any(_gone(w.proc.pid) for w in pool._idle)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_worker_stalled_in_c_code_is_killed_and_replaced():
    """A call stuck inside C code (a backtracking regex: no Python-level signal handler or exception can stop it in
    the worker) is ended at its limit, SIGKILLed by the caller at its wall-clock backstop or ended by the kernel at
    its CPU-time limit (SIGPROF's default action), and a fresh worker takes the next call."""
    pool = sandbox.Pool(size=1)
    try:
        first = pool.run(os.getpid, timeout=60)
        t0 = time.monotonic()
        with pytest.raises(sandbox.SandboxTimeout):  # the wall-clock backstop
            pool.run(re.fullmatch, r"(a+)+$", "a" * 64 + "b", timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + WALL_SLACK
        with pytest.raises(sandbox.SandboxTimeout, match="CPU time"):  # the CPU-time limit, ended by the kernel
            pool.run(re.fullmatch, r"(a+)+$", "a" * 64 + "b", cpu_time=0.3, timeout=60)
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        second = pool.run(os.getpid, timeout=60)
        assert second != first and pool.run(pow, 2, 10, timeout=60) == 1024
    finally:
        pool.close()
