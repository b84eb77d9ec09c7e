"""Math verifier: every hostile case found in review graded as it should be, and verdicts that depend on the
response alone: each symbolic check is limited by the CPU time of its own worker (no batch deadline), so the same
batch gets the same verdicts on an idle and on a busy machine, and slow responses cannot starve right answers."""
import os
import re
import subprocess
import sys
import time

import pytest

from bapo_vl.problem import Verdict
from bapo_vl.verifiers import math as mv
from bapo_vl.verifiers import sandbox
from bapo_vl.verifiers.math import extract_answer, verify, verify_batch

C, W, U, T = Verdict.CORRECT, Verdict.WRONG, Verdict.UNPARSABLE, Verdict.TIMEOUT


def B(x: str) -> str:
    return f"Reasoning...\n\nThe answer is $\\boxed{{{x}}}$."


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    mv.warm_up()
    yield


# ---------------------------------------------------------------- the cases

# (response, gold): each of these must never be CORRECT
WRONG_GRADED_CORRECT = [
    # prose negations and one-line self-corrections
    ("The answer is not $5$.", "5"),
    ("Answer: $5$ is incorrect; the correct answer is $6$.", "5"),
    ("The answer is $17$? No. The answer is $16$.", "17"),
    ("The answer is at least $5$.", "5"),
    ("The answer is anything but $5$.", "5"),
    ("The answer is at least 5.", "5"),
    ("The answer is anything but 5.", "5"),
    ("The answer isn't $5$.", "5"),
    ("The answer is not $\\boxed{5}$.", "5"),
    ("So the answer is at most \\boxed{5}.", "5"),
    ("$x \\neq \\boxed{5}$", "5"),
    ("Answer: $5$ is incorrect.", "5"),
    ("The answer is $5$? No.", "5"),
    ("The answer is $5$ or more.", "5"),
    ("The answer is $\\boxed{5}$. Wait, that's wrong.", "5"),
    ("\\boxed{5} is incorrect.", "5"),
    ("The answer is $5$. Actually, it is $6$.", "5"),
    ("Answer: ~~$5$~~", "5"),
    ("<answer>The answer is not $5$</answer>", "5"),
    # unicode root: √196 is 14, not √1 x 96
    (B("√196"), "96"),
    # a numeral with a subscript is compared as written, not without its subscript
    (B("86_{87+0}"), "86"),
    (B("86_{10}"), "86"),
    (B("8_6"), "86"),
    # nested boxes: the outer box holds a hedge
    (r"\boxed{\boxed{5} \text{ or } \boxed{6}}", "6"),
    (r"\boxed{\boxed{5} \text{ or } \boxed{6}}", "5"),
    (r"The answer is $\boxed{5}$ or $\boxed{6}$.", "6"),
    # near misses of the fixed readings stay wrong
    (B("1.41421"), "1.414214"),
    (B("1.4142"), "1.414214"),
    (B(r"\sin 30^\circ"), r"\frac{\sqrt{3}}{2}"),
    (B(r"\sin 30"), r"\frac{1}{2}"),
    (B(r"\sqrt[3]{-8}"), "2"),
    (B(r"\sqrt[4]{-16}"), "-2"),
    (B(r"\sqrt[3]{-2}"), r"\sqrt[3]{2}"),
    (B(r"e^{i\pi}"), "1"),
    (B(r"\cos\frac{\pi}{2}+i\sin\frac{\pi}{2}"), "-i"),
    (B(r"{5 \choose 3}"), "11"),
    (B(r"\tbinom52"), "20"),
    (B(r"\log_2 3\cdot\log_3 4"), "3"),
    (B(r"\log_e 2"), r"\log 2 + 1"),
    (B(r"3\text{ km/h}"), "4"),
    (B(r"(-\infty,0)"), r"\mathbb{R}"),
    (B(r"(x,y)=(13,2)"), "(2, 13)"),
    (B(r"(x,y)=(2,13)=(3,13)"), "(2, 13)"),
    ("The answer is $\\$37$.", "36"),
]


@pytest.mark.parametrize("response,gold", WRONG_GRADED_CORRECT)
def test_wrong_is_never_correct(response, gold):
    assert verify(response, gold) in (W, U)


# (response, gold): each of these is right
RIGHT_GRADED_WRONG = [
    (B("√196"), "14"),
    (B(r"(x,y)=(2,13)"), "(2, 13)"),
    (B(r"(x, y) = \left(2, 13\right)"), "(2, 13)"),
    ("The answer is $\\$36$.", "36"),
    (B(r"\$36"), "36"),
    (B("1.4142136"), "1.414214"),  # a decimal gold's tolerance holds for rational responses too
    (B(r"\frac{14142136}{10000000}"), "1.414214"),
    (B(r"\sin 30^\circ"), r"\frac{1}{2}"),
    (B(r"\cos 60°"), "0.5"),
    (B(r"\sqrt[3]{-8}"), "-2"),
    (B(r"\sqrt[3]{-2}"), r"-\sqrt[3]{2}"),  # the real root in sympy too
    (B(r"e^{i\pi}"), "-1"),
    (B(r"\cos\frac{\pi}{2}+i\sin\frac{\pi}{2}"), "i"),
    (B(r"{5 \choose 2}"), "10"),
    (B(r"\tbinom52"), "10"),
    (B(r"\log_e 2"), r"\ln 2"),
    (B(r"\log_2 3\cdot\log_3 4"), "2"),
    (B(r"3\text{ km/h}"), "3"),
    (B(r"(-\infty,\infty)"), r"\mathbb{R}"),
    (B(r"\mathbb{R}"), r"(-\infty, \infty)"),
    # the self-corrections count for the value they end with
    ("Answer: $5$ is incorrect; the correct answer is $6$.", "6"),
    ("The answer is $17$? No. The answer is $16$.", "16"),
    ("The answer is $5$, not $6$.", "5"),
    ("Since no other root is real, the answer is $\\boxed{5}$.", "5"),
    (r"\boxed{\boxed{5}}", "5"),
    # slow-but-right closed forms and identities
    (B(r"\cos\frac{\pi}{5}"), r"\frac{1+\sqrt{5}}{4}"),
    (B(r"\sqrt[3]{20+14\sqrt{2}}+\sqrt[3]{20-14\sqrt{2}}"), "4"),
    (B(r"\sum_{k=0}^{30}\binom{30}{k}x^k"), "(1+x)^{30}"),
]


@pytest.mark.parametrize("response,gold", RIGHT_GRADED_WRONG)
def test_right_is_correct(response, gold):
    assert verify(response, gold) is C


def test_negated_answers_are_no_answer():
    assert extract_answer("The answer is not $5$.") is None
    assert extract_answer("Answer: $5$ is incorrect; the correct answer is $6$.") == "6"
    assert extract_answer(r"\boxed{\boxed{5} \text{ or } \boxed{6}}") == r"\boxed{5} \text{ or } \boxed{6}"
    assert extract_answer("Final Answer: The final answer is $5$. I hope it is correct.") == "5"


# ---------------------------------------------------------------- time limits: CPU time of the call, per response

@pytest.fixture(scope="module")
def pool():
    p = sandbox.Pool(size=1, memory_mb=1024)
    yield p
    p.close()


def test_sandbox_limit_is_the_calls_cpu_time(pool):
    # waiting costs no CPU: a call that sleeps 0.6 s is within a 0.2 s CPU limit
    assert pool.run(time.sleep, 0.6, cpu_time=0.2, timeout=30) is None
    # computing stuck in C code (a backtracking regex holds the GIL) is ended by the kernel at the CPU limit
    t0 = time.process_time()
    with pytest.raises(sandbox.SandboxTimeout, match="CPU time"):
        pool.run(re.fullmatch, r"(a+)+$", "a" * 64 + "b", cpu_time=0.3, timeout=60)
    assert time.process_time() - t0 < 0.3  # the caller waits without computing
    # the limit is per call: many calls of the worker together may use far more than one limit
    for _ in range(8):
        pool.run(sum, range(4 * 10**6), cpu_time=0.25, timeout=60)
    assert pool.run(pow, 2, 10, timeout=30) == 1024


def test_sandbox_wall_backstop_ends_a_hung_worker(pool):
    t0 = time.monotonic()
    with pytest.raises(sandbox.SandboxTimeout, match="wall clock"):
        pool.run(time.sleep, 30, cpu_time=10, timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert pool.run(pow, 3, 3, timeout=30) == 27  # replaced


HANGS = r"\Gamma(10^{10}+\frac{1}{2})"  # sympy computes it for minutes: only its CPU limit ends it
SLOW_THEN_RIGHT = [  # (response, gold, verdict): slow and hostile responses first, then right answers
    (B(HANGS), "5", T),
    (B(r"\sum_{k=0}^{30}\binom{30}{k}x^k"), "x^2-1", W),
    (B(r"\sqrt[3]{20+14\sqrt{2}}+\sqrt[3]{20-14\sqrt{2}}"), "x^2-1", W),
    (B(r"\sum_{k=0}^{30}\binom{30}{k}x^k"), "(1+x)^{30}", C),
    (B(r"\sqrt[3]{20+14\sqrt{2}}+\sqrt[3]{20-14\sqrt{2}}"), "4", C),
    (B(r"\cos\frac{\pi}{5}"), r"\frac{1+\sqrt{5}}{4}", C),
    (B(r"\sin^2 x + \cos^2 x"), "1", C),
    (B(r"\sin 30^\circ"), r"\frac{1}{2}", C),
    (B("x^2+7x+11"), "x^2+7x+10", W),
    (B(r"\frac{1}{2}"), "0.5", C),
    (B("(x-1)(x+1)"), "x^2-1", C),
    (B("(x+2)(x+5)"), "x^2+7x+10", C),
]


def _busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_same_verdicts_idle_and_under_load():
    """Before the per-response CPU limit, a batch whose slow responses came first turned the right answers after them into TIMEOUT, and a
    busy machine did the same. Now the batch gets the same verdicts idle and with a busy process per core, the
    stall gets TIMEOUT at its own CPU limit, and every right answer after it is CORRECT."""
    responses, golds, expected = zip(*SLOW_THEN_RIGHT)
    limit = 1.0  # CPU seconds per response: the stall uses it all; each right answer needs a quarter of it at most
    t0 = time.monotonic()
    idle = verify_batch(list(responses), list(golds), timeout=limit)
    idle_s = time.monotonic() - t0
    busy = _busy_processes(max(2, min(os.cpu_count() or 1, 4)))  # every core busy: the workers share them
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        loaded = verify_batch(list(responses), list(golds), timeout=limit)
        loaded_s = time.monotonic() - t0
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"\nidle {idle_s:.1f} s, under load ({len(busy)} busy processes) {loaded_s:.1f} s")
    assert idle == loaded
    assert idle == list(expected)
