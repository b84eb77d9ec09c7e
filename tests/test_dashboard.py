"""The web dashboard (`bapo dashboard`, app/) on the record of a real tiny training run.

The reader (bapo_vl.reader, shared with `bapo runs show`) is checked on that run and on a synthetic record against
an SQL oracle of the hard-problem ledger and against plain loops for the accuracy bins and migration; then the real
server is started on a free localhost port and driven in headless Chromium with Playwright: every tab draws its
plots, the numbers on the page match SQL on the same database, the migration matrix sums to the prompts seen at
both steps, and a step written after the page loaded appears without a reload. Then dark mode, a search with no
match, a hostile prompt text, unreadable records, one palette, tick labels, smoothing as typed and the login limit
(each failed on the dashboard before it, but the palette test: one palette was already in use), and the
Training-health tab with its ETA, the ledger's retries, the migration defaults and row %, Compare's interactions,
colours and CSV, and click-through to prompts. Then what the line charts draw (a same-step rescue in the ledger,
gaps where nothing was measured, single points, tooltips without "null", min/max envelopes), charts that keep
their zoom and legend choice across polls, tabs and smoothing, the small things that read wrong (row %, an empty
cell, axis titles, console warnings, a synthetic record being written), the responses at a step, and Compare's
groups of runs, settings table and runs that appear under a served folder; each of these failed before its fix.

Browser tests need Debian's chromium (`apt-get install -y chromium`) and `pip install playwright` (never
`playwright install`); they skip without them. BAPO_DASHBOARD_SCREENSHOTS=DIR saves a 1280x800 PNG of each tab.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sqlite3
import sys
from pathlib import Path

import pytest

pytest.importorskip("gradio")
# gradio's own DataFrame handling under pandas 3, not ours
pytestmark = [pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),
              pytest.mark.filterwarnings("ignore:The copy keyword is deprecated")]

import pandas as pd  # noqa: E402

from bapo_vl import record as R  # noqa: E402
from bapo_vl.app import data, views  # noqa: E402
from bapo_vl.reader import Run, ledger_counts  # noqa: E402
from bapo_vl.record import FILTERED, FRESH, GENERATED, X1, X2, X3, sql_in  # noqa: E402
from bapo_vl.app.cli import add_parser, cmd_dashboard  # noqa: E402
from bapo_vl.app.dashboard import BIN_MODES, MODE_AT, TAB_TITLES  # noqa: E402
from bapo_vl.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# 6 steps with re-evaluation every 2nd step so that X2 and X3 appear; B=6, G=4 and short responses keep it to
# about a minute on 2 idle cores
TRAIN = ["steps=6", "batch_size=6", "group_size=4", "reeval_every=2", "delay=2", "max_response_length=36"]
G = 4
READABLE = ["tiny", "tiny-live", "tiny-running", "grpo-synth"]  # the module server's runs that can be read


# a prompt text that tries to leave its code block and load an outside image (tasks' data is hostile input)
HOSTILE = ("What is 2 + 2?\n```\n</pre></code><img id=\"evil\" src=\"http://evil.invalid/x.png\">\n```\n"
           "**not bold** <script>window.__pwned = 1</script>")
# tiny-live's held-out hard-set evaluation (as scripts/study.py records it); tiny has none
STUDY_EVAL = {"unlocked_fraction": 0.375, "hard_set_size": 8, "k": 16}
# tiny-live's one held-out evaluation as `bapo eval --run` records it (a series of a single point)
ONE_EVAL = ("countdown/test", {"n": 16, "k": 4, "mean@k": 0.3125, "pass@k": 0.5})
# tiny-running: the trained run's record cut back to step 3, as if it were at step 3 of 40 with its trainer alive
RUNNING_AT, RUNNING_STEPS = 3, 40


def _copy_run(run, dst, name, **meta):
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("final", "checkpoints", R.LOCK_NAME))
    with sqlite3.connect(dst / R.DB_NAME) as conn:
        for k, v in {"name": name, **meta}.items():
            conn.execute("UPDATE meta SET value = ? WHERE key = ?", (v, k))
    conn.close()
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(trained run, a copy of it named tiny-live that the live test appends to and whose sampled prompt has the
    HOSTILE text, a copy tiny-running at step RUNNING_AT of RUNNING_STEPS whose trainer lock this module holds).
    Beside
    tiny-live: broken-empty (an empty run.db), broken-corrupt (not SQLite) and grpo-synth (a synthetic GRPO record:
    no prompt is ever generated twice)."""
    root = tmp_path_factory.mktemp("dashboard")
    assert main(["train", "--quiet", f"run_dir={root}", "name=tiny", *TRAIN]) == 0
    run, live = root / "tiny", _copy_run(root / "tiny", root / "live" / "tiny-live", "tiny-live")
    with sqlite3.connect(live / R.DB_NAME) as conn:
        conn.execute("UPDATE problems SET text = ? WHERE uid = (SELECT uid FROM samples ORDER BY step DESC LIMIT 1)",
                     (HOSTILE,))
    conn.close()
    record = R.RunRecord.open(live, resume=False)  # the study's evaluation, through the writer scripts/study.py uses
    record.log_eval(sql(live, "SELECT MAX(step) FROM steps")[0][0], "hard_set", STUDY_EVAL)
    record.log_eval(sql(live, "SELECT MAX(step) FROM steps")[0][0], *ONE_EVAL)
    record.close()
    running = _copy_run(run, root / "live" / "tiny-running", "tiny-running", status="running")
    R.RunRecord.open(running, truncate_after=RUNNING_AT).close()  # the record's own rewind (as on resume)
    with sqlite3.connect(running / R.DB_NAME) as conn:
        conn.execute("UPDATE config SET json = json_set(json, '$.steps', ?)", (RUNNING_STEPS,))
        conn.execute("UPDATE meta SET value = 'running' WHERE key = 'status'")
        # what a step on a GPU adds (bapo_vl.backends.gpu_memory.PhaseMemory; a CPU run has no GPU memory to record)
        conn.execute("UPDATE steps SET metrics = json_set(metrics, '$.gpu_memory_generate_gb', 20.0 + step, "
                     "'$.gpu_memory_train_gb', 30.0 + step)")
    conn.close()
    for name, content in (("broken-empty", b""), ("broken-corrupt", b"not a database " * 100)):
        (root / "live" / name).mkdir()
        (root / "live" / name / R.DB_NAME).write_bytes(content)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from synth_run import synth
    finally:
        sys.path.pop(0)
    # a diagram per sampled prompt makes it a geometry3k record: a run of another task beside the countdown ones
    synth(root / "live" / "grpo-synth", prompts=400, steps=10, B=16, G=4, algo="grpo", images=True, quiet=True)
    lock = R.lock_run_dir(running)  # a live trainer, as far as the dashboard can tell
    yield run, live, running
    lock.close()


def sql(run_dir, q, args=()):
    return R.query_ro(run_dir, q, args)


def gen_rows(run_dir):
    return [tuple(r) for r in sql(run_dir, "SELECT step, uid, correct, G, subset FROM prompt_steps "
                                           f"WHERE {sql_in(GENERATED)} ORDER BY step")]


def overlap_pair(run_dir) -> tuple[int, int, int]:
    """The pair of steps a < b with the most prompts generated for at both: (a, b, count)."""
    row = sql(run_dir, f"""
        WITH g AS (SELECT DISTINCT step, uid FROM prompt_steps WHERE {sql_in(GENERATED)})
        SELECT a.step, b.step, COUNT(*) AS n FROM g a JOIN g b ON a.uid = b.uid AND a.step < b.step
        GROUP BY a.step, b.step ORDER BY n DESC, a.step LIMIT 1""")[0]
    return row[0], row[1], row[2]


# the generated groups, each with the one it counts by at its prompt's first step (the fresh one where the prompt
# was also re-evaluated at that step) marked `counted`
SQL_GENERATED = f"""
    gen AS (SELECT step, uid, correct, subset, {sql_in(FRESH)} AS fresh FROM prompt_steps
            WHERE {sql_in(GENERATED)}),
    first AS (SELECT uid, MIN(step) AS first_seen FROM gen GROUP BY uid),
    marked AS (SELECT g.*, f.first_seen, g.step = f.first_seen AND g.fresh = (
                   SELECT MAX(h.fresh) FROM gen h WHERE h.uid = g.uid AND h.step = f.first_seen) AS counted
               FROM gen g JOIN first f ON f.uid = g.uid)"""


def sql_ledger(run_dir) -> list[tuple]:
    """The hard-problem ledger in plain SQL, the oracle for the reader's numpy one: (uid, first_seen, first_solved)
    of the prompts whose group at their first generated step was 0/G, by its fresh group where it was also
    re-evaluated at that step; first_solved = the lowest step of any other generated group >= 1/G (that same step
    for a re-evaluation that solved it), None while unsolved. x3 replays are no generation."""
    return [tuple(r) for r in sql(run_dir, f"""
        WITH {SQL_GENERATED}
        SELECT m.uid, m.first_seen,
               (SELECT MIN(o.step) FROM marked o WHERE o.uid = m.uid AND NOT o.counted AND o.correct >= 1)
        FROM marked m WHERE m.counted AND m.correct = 0 ORDER BY m.first_seen, m.uid""")]


def sql_same_step_rescues(run_dir) -> list[tuple]:
    """(uid, step) of the prompts that were 0/G fresh at their first step and >= 1/G re-evaluated at that step."""
    return [tuple(r) for r in sql(run_dir, f"""
        WITH {SQL_GENERATED}
        SELECT m.uid, m.step FROM marked m JOIN marked r ON r.uid = m.uid AND r.step = m.step AND NOT r.fresh
        WHERE m.counted AND m.fresh AND m.correct = 0 AND r.correct >= 1 ORDER BY m.step, m.uid""")]


# ----------------------------------------------------------------------------- the reader (no browser)


def test_training_produced_all_three_subsets(runs):
    counts = dict(sql(runs[0], "SELECT subset, COUNT(*) FROM prompt_steps GROUP BY subset"))
    assert counts.get(X2, 0) > 0 and counts.get(X3, 0) > 0 and counts.get(X1, 0) > 0, counts
    assert set(counts) <= set(R.SUBSETS)
    assert set(dict(sql(runs[0], "SELECT subset, COUNT(*) FROM samples GROUP BY subset"))) <= set(R.SUBSETS)


def _synthetic(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from synth_run import synth
    finally:
        sys.path.pop(0)
    return synth(tmp_path / "synth", prompts=600, steps=40, B=32, G=8, m=5, quiet=True)


def reader_ledger(run_dir) -> list[tuple]:
    ledger = Run(run_dir).ledger()
    return [(u, int(a), None if pd.isna(b) else int(b)) for u, a, b in ledger.itertuples(index=False)]


def test_ledger_matches_the_sql_oracle(runs, tmp_path):
    for run_dir in (runs[0], _synthetic(tmp_path)):  # the synthetic run has prompts solved after several tries
        want = sql_ledger(run_dir)
        assert want and reader_ledger(run_dir) == want
        s = Run(run_dir).summary()
        assert (s["first_unsolved"], s["later_solved"]) == (len(want), sum(1 for *_, b in want if b is not None))


def test_a_same_step_rescue_counts_once_by_its_fresh_group(runs):
    # Could fail (and did) where the ledger judged a prompt by its best group at its first step: a prompt 0/G fresh
    # and >= 1/G when re-evaluated from B_bad at that same step was left out of the ledger altogether.
    rescued = sql_same_step_rescues(runs[0])
    assert rescued  # this trained run re-evaluates its own fresh failures at the step they failed
    ledger = Run(runs[0]).ledger_retries().set_index("uid")
    for uid, step in rescued:
        assert uid in ledger.index, uid
        assert (ledger.loc[uid, "first_seen"], ledger.loc[uid, "first_solved"]) == (step, step)
        assert ledger.loc[uid, "retries"] >= 1  # the re-evaluation was a try
    n, k, _ = ledger_counts(Run(runs[0]).ledger())
    want = sql_ledger(runs[0])
    assert (n, k) == (len(want), sum(1 for *_, b in want if b is not None))


def test_retries_and_the_regenerated_pair_match_sql(runs, tmp_path):
    for run_dir in (runs[0], _synthetic(tmp_path)):
        run, want = Run(run_dir), sql_retries(run_dir)
        ledger = run.ledger_retries()
        assert dict(zip(ledger["uid"], ledger["retries"])) == {u: want[u] for u in ledger["uid"]}
        assert run.regenerated_pair() == sql_regenerated_pair(run_dir)


def test_eta_and_overview_count_to_the_rollout_budget_before_the_step_cap():
    # Could fail if a run with a rollout budget (every study run: steps = budget) showed the step cap's ETA (30,000
    # steps left when 5 are), if the budget were ignored in the overview, or if a run without one changed.
    steps = pd.DataFrame({"step": [1, 2, 3, 4, 5], "time": [100.0, 102.0, 104.0, 106.0, 108.0],
                          "rollouts": [100] * 5, "fresh_reward": [0.5] * 5, "x2": [0] * 5, "x3": [0] * 5,
                          **{t: [0.5] * 5 for t in views.PHASES}})
    with_budget = views.eta(steps, 30_720, "running", budget=1_000)
    assert "5 steps left at 2.0 s/step" in with_budget and ">10 s<" in with_budget
    assert "30715 steps left" in views.eta(steps, 30_720, "running")
    assert "5 steps left" in views.eta(steps, 10, "running", budget=10**6)  # the step cap binds first
    text = views.overview_text("r", {"status": "running"}, {"steps": 30_720, "max_rollouts": 1_000}, steps,
                               pd.DataFrame())
    assert "of a 1,000 budget" in text and "5 steps left" in text
    assert "budget" not in views.overview_text("r", {"status": "running"}, {"steps": 10}, steps, pd.DataFrame())


def test_ema_is_debiased_and_keeps_gaps():
    x = pd.Series([1.0, 3.0, float("nan"), 5.0])
    w = 0.5
    # s_t = sum w^i x_(t-i) / sum w^i over the values so far (a NaN is skipped and stays NaN)
    want = [1.0, (3 + 0.5) / 1.5, float("nan"), (5 + 0.5 * 3 + 0.25 * 1) / 1.75]
    got = views.ema(x, w).tolist()
    assert got[2] != got[2] and [round(v, 9) for i, v in enumerate(got) if i != 2] == \
        [round(v, 9) for i, v in enumerate(want) if i != 2]
    assert views.ema(x, 0).equals(x)


def test_hover_table_interpolates_runs_at_each_others_x():
    df = pd.DataFrame({"x": [0.0, 10.0, 5.0, 15.0], "value": [0.0, 1.0, 2.0, 4.0], "run": ["a", "a", "b", "b"]})
    h = views.hover_table(df, "x", "value", "run", ["a", "b"]).set_index("x")
    assert h.loc[5.0, "s0"] == 0.5 and h.loc[10.0, "s1"] == 3.0  # each run's value where the other has a point
    assert pd.isna(h.loc[0.0, "s1"]) and pd.isna(h.loc[15.0, "s0"])  # none outside a run's own range


def test_a_long_series_keeps_its_extremes_at_whole_steps():
    # Could fail (and did): a long series was thinned by averaging neighbours, so a grad-norm spike of 0.997 was
    # drawn as 0.750 at "step 261.5".
    import numpy as np

    n = 8 * views.MAX_POINTS + 3
    values = 0.5 + 0.01 * np.sin(np.arange(n))
    spike, dip = n // 2 + 1, 3 * n // 4 + 2  # steps that no bucket of consecutive steps starts or ends with
    values[spike - 1], values[dip - 1] = 0.997, 0.003
    df = pd.DataFrame({"step": np.arange(1, n + 1), "value": values, "series": "grad norm"})
    spec = views.line_spec(df, "step", "value", "series", "Gradient norm", 200)
    line = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "line")["data"]["values"]
    assert len(line) <= views.MAX_POINTS + 2
    top, bottom = max(line, key=lambda r: r["value"]), min(line, key=lambda r: r["value"])
    assert (top["step"], top["value"]) == (spike, 0.997) and (bottom["step"], bottom["value"]) == (dip, 0.003)
    assert all(float(r["step"]).is_integer() for r in line)
    crosshair = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "rule")["data"]["values"]
    assert all(float(r["step"]).is_integer() and r["tip"]["step"].isdigit() for r in crosshair)


def naive_migration(rows, a, b, G, window):
    """Histograms and migration matrix by a plain loop (see Run.migration); a prompt generated twice at one step
    counts by its fresh group."""
    def latest(lo, hi):
        out = {}
        for step, uid, c, g, subset in sorted(rows, key=lambda r: (r[0], r[4] in FRESH)):
            if (lo is None or step > lo) and step <= hi:
                out[uid] = round(c * G / g)
        return out
    if window:
        hist_a, hist_b, cols = latest(None, a), latest(None, b), latest(a, b)
    else:
        hist_a, hist_b = latest(a - 1, a), latest(b - 1, b)
        cols = hist_b
    m = [[0] * (G + 1) for _ in range(G + 1)]
    for uid in hist_a.keys() & cols.keys():
        m[hist_a[uid]][cols[uid]] += 1
    hist = lambda d: [sum(1 for v in d.values() if v == i) for i in range(G + 1)]
    return hist(hist_a), hist(hist_b), m


def test_migration_matches_a_plain_loop(runs, tmp_path):
    for run_dir in (runs[0], _synthetic(tmp_path)):
        run, rows = Run(run_dir), gen_rows(run_dir)
        last = sql(run_dir, "SELECT MAX(step) FROM steps")[0][0]
        for a, b in ((1, last), (2, 4), (last // 2, last), (3, 3)):
            for window in (True, False):
                want = naive_migration(rows, a, b, run.group_size(), window)
                assert run.migration(a, b, window) == want, (a, b, window)


def test_exact_step_matrix_sums_to_prompts_generated_at_both_steps(runs):
    a, b, n = overlap_pair(runs[0])
    assert n > 0
    hist_a, _, m = Run(runs[0]).migration(a, b)
    assert sum(map(sum, m)) == n
    assert sum(hist_a) == sql(runs[0], f"SELECT COUNT(DISTINCT uid) FROM prompt_steps WHERE step = ? AND "
                                       f"{sql_in(GENERATED)}", (a,))[0][0]


def _log_extra_step(run_dir, step, x1=3):
    """Append a step the way the trainer does (RunRecord.log_step), with one new hard prompt solved later."""
    record = R.RunRecord.open(run_dir)
    try:
        record.log_step(step, {"x1": x1, "x2": 1, "x3": 0, "batch_size": 8, "bad_size": 2, "high_size": 1,
                               "c2": 0.2, "c3": 0.3, "rollouts": 16, "fresh_reward": 0.5, "reward": 0.5,
                               "t_generate": 1.0, "t_verify": 0.1, "t_train": 0.5, "t_sync": 0.0},
                        groups=[("live-new", 0, G, FILTERED), ("live-solved", 2, G, X1)])
    finally:
        record.close()


def test_readers_follow_appended_and_rewritten_steps(runs, tmp_path):
    run_dir = tmp_path / "r"
    shutil.copytree(runs[0], run_dir, ignore=shutil.ignore_patterns("final", "checkpoints"))
    run = Run(run_dir)
    before = run.ledger()
    last = int(run.steps()["step"].max())
    _log_extra_step(run_dir, last + 1)
    assert int(run.steps()["step"].max()) == last + 1
    assert len(run.ledger()) == len(before) + 1  # live-new was 0/G when first seen
    assert reader_ledger(run_dir) == sql_ledger(run_dir)
    R.RunRecord.open(run_dir, truncate_after=2).close()  # a resume rewinds: the readers start over
    assert int(run.steps()["step"].max()) == 2
    assert len(run.ledger()) == len(sql_ledger(run_dir))


def test_search_finds_uid_and_text_and_treats_wildcards_literally(runs):
    run = Run(runs[0])
    uid, text = sql(runs[0], "SELECT uid, text FROM problems WHERE uid IN (SELECT uid FROM prompt_steps) LIMIT 1")[0]
    assert data.search_prompts(run, uid)[0][0] == uid
    assert uid in [u for u, _ in data.search_prompts(run, text[:12])]
    assert data.search_prompts(run, "%") == [] and data.search_prompts(run, "_") == []


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_needs_a_password_to_listen_beyond_localhost(runs, capsys):
    assert cmd_dashboard(_parse(["dashboard", str(runs[0]), "--host", "0.0.0.0"])) == 2
    assert "--password" in capsys.readouterr().err
    args = _parse(["dashboard", str(runs[0])])
    assert args.host == "127.0.0.1" and args.password is None
    assert cmd_dashboard(_parse(["dashboard", str(runs[0].parent / "nope")])) == 2


def test_update_speed_is_tokens_trained_over_the_update_time():
    # Could fail if the derived speed divided other columns, or drew a point for a step that trained nothing.
    metrics = pd.DataFrame({"step": [1, 2, 3], "trained_tokens": [1000, 0, 3000], "t_train": [2.0, 0.5, 0.0]})
    frames = {title: df for title, _, df in views.health_frames(metrics)}
    (speed,) = [df for title, df in frames.items() if title.startswith("Update speed")]
    assert speed[["step", "value"]].values.tolist() == [[1, 500.0]]


def test_an_answer_reads_as_one_line_and_stays_escaped():
    # Could fail if a structured answer (geodraw's dict, countdown's numbers) were shown as a Python dict, or if
    # formatting it let markup through.
    assert views.answer_text({"letter": "C", "value": "78", "choices": ["68", "73", "78", "83"]}) == \
        "letter C · value 78 · choices 68, 73, 78, 83"
    assert views.answer_text({"nums": [17, 87], "target": 10}) == "nums 17, 87 · target 10"
    assert views.answer_text("12") == "12" and views.answer_text([1, 2]) == "1, 2"
    shown = views.prompt_text({"found": True, "uid": "u", "text": "t", "history": pd.DataFrame(
        columns=["step", "subset"]), "answer": {"value": "<img src=x>"}})
    assert "value &lt;img src=x&gt;" in shown and "<img" not in shown


def test_views_label_bins_in_order():
    assert views.bin_labels(8) == [f"{i}/8" for i in range(9)]
    assert views.bin_labels(16)[:3] == ["00/16", "01/16", "02/16"]  # text order = bin order


# ----------------------------------------------------------------------------- the real server in Chromium


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(runs):
    from bapo_vl.app.dashboard import launch

    port = _free_port()
    demo = launch([str(runs[0]), str(runs[1].parent)], port=port, block=False, poll_seconds=1.0)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (never `playwright install`)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    from playwright.sync_api import expect

    expect.set_options(timeout=30_000)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    expect(page.locator("#overview-text")).to_contain_text("last step", timeout=60_000)
    yield page
    page.close()


def open_tab(page, tab_id):
    page.get_by_role("tab", name=TAB_TITLES[tab_id]).click()


def marks(page, elem_id, mark) -> int:
    """Drawn marks of a Vega plot (rendered as SVG) inside the element `elem_id`."""
    return page.locator(f"#{elem_id} svg g.mark-{mark} path").count()


def wait_marks(page, elem_id, mark):
    """Until the Vega chart in `elem_id` is drawn, at a visible width, with some `mark` (line, rect, symbol)."""
    page.wait_for_function(
        "([id, mark]) => { const svg = document.querySelector(`#${id} svg.marks`);"
        " return !!svg && svg.getBoundingClientRect().width > 0"
        " && svg.querySelectorAll(`g.mark-${mark} path`).length > 0; }",
        arg=[elem_id, mark], timeout=30_000)


def table_rows(page, elem_id) -> list[list[str]]:
    """The cell texts of a gr.Dataframe's body rows (it renders only rows in view: scroll to it first)."""
    table = page.locator(f"#{elem_id}")
    table.scroll_into_view_if_needed()
    rows = table.locator("[role='row']").evaluate_all(
        "rows => rows.map(r => [...r.querySelectorAll('[role=gridcell]')].map(td => td.innerText.trim()))")
    return [r for r in rows if r]


def table_records(page, elem_id) -> list[dict[str, str]]:
    """A gr.Dataframe's body rows as {header: cell text}."""
    head = [h.strip() for h in page.locator(f"#{elem_id} thead").inner_text().split("\n") if h.strip()]
    return [dict(zip(head, row)) for row in table_rows(page, elem_id)]


def wait_rows(page, elem_id, n):
    page.locator(f"#{elem_id}").scroll_into_view_if_needed()
    page.wait_for_function(
        "([id, n]) => [...document.querySelectorAll(`#${id} [role=row]`)]"
        ".filter(r => r.querySelector('[role=gridcell]')).length === n", arg=[elem_id, n], timeout=30_000)


def number_after(text, label) -> int:
    m = re.search(re.escape(label) + r"\s*(\d+)", text)
    assert m, f"{label!r} not in {text!r}"
    return int(m.group(1))


def shoot(page, name):
    out = os.environ.get("BAPO_DASHBOARD_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        page.wait_for_timeout(800)  # let the plots finish their transitions
        page.screenshot(path=str(Path(out) / f"{name}.png"))



def test_overview_and_batch_tabs_show_the_records_numbers(page, runs):
    from playwright.sync_api import expect

    run = runs[0]
    last, rollouts = sql(run, "SELECT MAX(step), SUM(rollouts) FROM steps")[0]
    text = page.locator("#overview-text").inner_text()
    assert number_after(text, "last step:") == last
    assert number_after(text, "rollouts:") == rollouts
    for elem, mark in (("overview-reward", "line"), ("overview-rollouts", "line"), ("overview-time", "rect")):
        wait_marks(page, elem, mark)
    shoot(page, "overview")

    open_tab(page, "batch")
    expect(page.locator("#batch-text")).to_contain_text(f"step {last}")
    x1, x2, x3, B = sql(run, "SELECT x1, x2, x3, batch_size FROM steps WHERE step = ?", (last,))[0]
    text = page.locator("#batch-text").inner_text()
    assert (number_after(text, "|X1| ="), number_after(text, "|X2| ="), number_after(text, "|X3| =")) == (x1, x2, x3)
    assert number_after(text, "of B =") == B
    for elem, mark in (("batch-composition", "rect"), ("batch-bins", "rect"), ("batch-buffers", "line"),
                       ("batch-thresholds", "line")):
        wait_marks(page, elem, mark)
    # one bar segment per non-empty subset and step, and the dashed B level
    segments = sql(run, "SELECT (x1 > 0) + (x2 > 0) + (x3 > 0) FROM steps")
    assert marks(page, "batch-composition", "rect") == sum(r[0] for r in segments)
    assert marks(page, "batch-composition", "line") >= 1
    shoot(page, "batch")


def test_ledger_tab_matches_sql_and_opens_a_prompt(page, runs):
    from playwright.sync_api import expect

    run = runs[0]
    ledger = sql_ledger(run)
    solved = [(uid, b) for uid, _, b in ledger if b is not None]
    open_tab(page, "ledger")
    expect(page.locator("#ledger-text")).to_contain_text("later reached")
    text = page.locator("#ledger-text").inner_text()
    assert number_after(text, "time they were generated for:") == len(ledger)
    assert number_after(text, f"later reached ≥ 1/{G}:") == len(solved)
    wait_marks(page, "ledger-curve", "line")
    expect(page.locator("#ledger-note")).to_contain_text(f"{len(solved)} prompt(s) solved later")
    shoot(page, "ledger")
    if solved:  # a click on a row opens the prompt
        uid = max(solved, key=lambda r: r[1])[0]
        cell = page.locator("#ledger-table [role='gridcell']").get_by_text(uid, exact=True).first
        cell.scroll_into_view_if_needed()
        cell.click()
        expect(page.locator("#prompt-text")).to_contain_text(uid)


def test_bins_tab_histograms_and_matrix_match_sql(page, runs):
    from playwright.sync_api import expect

    run = runs[0]
    a, b, n = overlap_pair(run)
    open_tab(page, "bins")
    expect(page.locator("#bins-text")).to_contain_text("Migration matrix")
    wait_marks(page, "bins-hist-a", "rect")
    wait_marks(page, "bins-hist-b", "rect")
    shoot(page, "bins")
    page.locator("#bins-mode").get_by_text(MODE_AT).click()
    expect(page.locator("#bins-text")).to_contain_text("generated for at both step")
    for elem, value, shown in (("step-a", a, f"generated for at step {a} "), ("step-b", b, f"and step {b};")):
        box = page.locator(f"#{elem} input[type='number']")
        box.fill(str(value))
        box.press("Enter")
        box.blur()
        expect(page.locator("#bins-text")).to_contain_text(shown)
    text = page.locator("#bins-text").inner_text()
    assert number_after(text, "columns: bin at B):") == n
    wait_rows(page, "bins-matrix", G + 1)
    cells = [row[1:] for row in table_rows(page, "bins-matrix")]
    assert [len(row) for row in cells] == [G + 1] * (G + 1)
    assert sum(int(c) for row in cells for c in row) == n  # the matrix sums to the prompts seen at both steps
    count_a = sql(run, f"SELECT COUNT(DISTINCT uid) FROM prompt_steps WHERE step = ? AND {sql_in(GENERATED)}",
                  (a,))[0][0]
    assert f"at step {a} ({count_a})" in text
    assert BIN_MODES[0] != MODE_AT  # the window mode is the default (steps rarely share prompts in big runs)


def test_prompt_and_compare_tabs(page, runs):
    from playwright.sync_api import expect

    run = runs[0]
    uid = sql(run, "SELECT uid FROM samples ORDER BY step DESC LIMIT 1")[0][0]
    open_tab(page, "prompt")
    expect(page.locator("#prompt-text")).to_contain_text("uid")
    page.locator("#prompt-query textarea, #prompt-query input").first.fill(uid)
    page.locator("#prompt-query textarea, #prompt-query input").first.press("Enter")
    expect(page.locator("#prompt-text")).to_contain_text(uid)
    wait_marks(page, "prompt-history", "symbol")
    n_rows = sql(run, "SELECT COUNT(*) FROM prompt_steps WHERE uid = ?", (uid,))[0][0]
    wait_rows(page, "prompt-rows", n_rows)
    verdict = sql(run, "SELECT verdict FROM samples WHERE uid = ? LIMIT 1", (uid,))[0][0]
    expect(page.locator("#prompt-samples")).to_contain_text(verdict)
    shoot(page, "prompt")

    open_tab(page, "compare")
    wait_rows(page, "compare-table", len(READABLE))
    wait_marks(page, "compare-plot", "line")
    wait_marks(page, "compare-solved", "line")
    assert sorted(row[0] for row in table_rows(page, "compare-table")) == sorted(READABLE)
    assert marks(page, "compare-plot", "line") == len(READABLE)  # one line per run
    shoot(page, "compare")
    open_tab(page, "overview")  # a tab shown again is drawn again at its width (hidden, charts shrink to 0)
    wait_marks(page, "overview-reward", "line")


def test_a_step_written_after_the_page_loaded_appears_without_reload(page, runs):
    from playwright.sync_api import expect

    live = runs[1]
    page.locator("#run input").first.click()
    page.get_by_role("option", name="tiny-live").click()
    last = sql(live, "SELECT MAX(step) FROM steps")[0][0]
    expect(page.locator("#overview-text")).to_contain_text("tiny-live")
    expect(page.locator("#overview-text")).to_contain_text(f"last step: {last} ")
    _log_extra_step(live, last + 1, x1=5)
    expect(page.locator("#overview-text")).to_contain_text(f"last step: {last + 1} ", timeout=20_000)
    open_tab(page, "batch")
    expect(page.locator("#batch-text")).to_contain_text(f"step {last + 1}: |X1| = 5")
    _log_extra_step(live, last + 2, x1=6)  # and while this tab is open
    expect(page.locator("#batch-text")).to_contain_text(f"step {last + 2}: |X1| = 6", timeout=20_000)


def test_no_filesystem_path_reaches_the_browser(server, runs):
    import urllib.request

    config = urllib.request.urlopen(server + "config", timeout=30).read().decode()
    assert str(runs[0]) not in config and str(runs[1]) not in config


def test_a_password_closes_the_api_to_anyone_not_logged_in(runs):
    import urllib.error
    import urllib.parse
    import urllib.request

    from bapo_vl.app.dashboard import launch

    port = _free_port()
    demo = launch([str(runs[0])], port=port, block=False, password="s3cret", warm=False)
    try:
        url = f"http://127.0.0.1:{port}/"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "config", timeout=30)
        assert e.value.code == 401
        form = urllib.parse.urlencode({"username": "bapo", "password": "s3cret"}).encode()
        assert urllib.request.urlopen(url + "login", data=form, timeout=30).status == 200
    finally:
        demo.close()


def test_a_geometry3k_prompt_shows_its_diagram(browser, tmp_path):
    """A real (1-step) Qwen2.5-VL run on the bundled Geometry3K fixture: the drill-down shows the prompt's diagram,
    the image stored in the record, at its own size."""
    import io

    from PIL import Image
    from playwright.sync_api import expect

    from bapo_vl.app.dashboard import launch
    from bapo_vl.tiny import build_qwen2_5_vl

    model, processor = build_qwen2_5_vl(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                                        max_pixels=112 * 112)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    source = ROOT / "tests" / "fixtures" / "geometry3k"
    assert main(["train", "--quiet", "task=geometry3k", f"task_options={{source: '{source}', limit: 4}}",
                 f"model={tmp_path / 'vl'}", f"run_dir={tmp_path / 'runs'}", "name=geo", "steps=1", "batch_size=2",
                 "group_size=2", "max_response_length=4", "max_prompt_length=512", "max_pixels=12544",
                 "mini_batch_size=2", "micro_batch_size=4"]) == 0
    run = tmp_path / "runs" / "geo"
    uid, png = sql(run, "SELECT uid, image FROM problems WHERE image IS NOT NULL LIMIT 1")[0]
    size = list(Image.open(io.BytesIO(png)).size)
    port = _free_port()
    demo = launch([str(run)], port=port, block=False, poll_seconds=1.0)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        page.goto(f"http://127.0.0.1:{port}/")
        expect(page.locator("#overview-text")).to_contain_text("last step", timeout=60_000)
        open_tab(page, "prompt")
        query = page.locator("#prompt-query textarea, #prompt-query input").first
        query.fill(uid)
        query.press("Enter")
        expect(page.locator("#prompt-text")).to_contain_text(uid)
        img = page.locator("#prompt-image img").first
        expect(img).to_be_visible()
        page.wait_for_function("el => el.complete && el.naturalWidth > 0", arg=img.element_handle())
        assert img.evaluate("el => [el.naturalWidth, el.naturalHeight]") == size
        # the pixels themselves, not a lossy re-encoding of them (Gradio's default is webp)
        served = page.request.get(img.evaluate("el => el.src")).body()
        shown = Image.open(io.BytesIO(served))
        assert shown.format == "PNG"
        assert shown.convert("RGB").tobytes() == Image.open(io.BytesIO(png)).convert("RGB").tobytes()
    finally:
        page.close()
        demo.close()


# ----------------------------------------------------------------------------- bugs (each test failed before its fix)


def pick_run(page, label):
    """Show run `label` (from the Overview tab, which then names it)."""
    from playwright.sync_api import expect

    page.locator("#run input").first.click()
    page.get_by_role("option", name=label, exact=True).click()
    expect(page.locator("#overview-text")).to_contain_text(label)


def search(page, text):
    box = page.locator("#prompt-query textarea, #prompt-query input").first
    box.fill(text)
    box.press("Enter")


AXES_JS = """id => [...document.querySelectorAll(`#${id} svg.marks g.role-axis`)].map(ax =>
    [...ax.querySelectorAll('.role-axis-label text')].map(t => t.textContent))"""
LEGEND_JS = """id => { const q = s => [...document.querySelectorAll(`#${id} svg.marks ${s}`)];
    const labels = q('g.role-legend-label text').map(t => t.textContent);
    const fills = q('g.role-legend-symbol path').map(p => p.getAttribute('fill'));
    return Object.fromEntries(labels.map((l, i) => [l, fills[i]])); }"""


def luminance(css: str, under=(255, 255, 255)) -> float:
    """Relative luminance (WCAG) of a CSS rgb()/rgba() colour, blended over `under`."""
    parts = [float(v) for v in re.findall(r"[\d.]+", css)]
    alpha = parts[3] if len(parts) > 3 else 1.0
    rgb = [alpha * c + (1 - alpha) * u for c, u in zip(parts[:3], under)]
    lin = [(c / 255) / 12.92 if c / 255 <= 0.03928 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: float, b: float) -> float:
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)


def test_dark_mode_charts_and_tables_are_readable(browser, server):
    """Gradio follows the OS's dark setting: the charts must not stay white, their text must read on the dark
    page, and the migration matrix's shaded cells must keep their text readable."""
    import io

    from PIL import Image
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    try:
        page.goto(server)
        expect(page.locator("#overview-text")).to_contain_text("last step", timeout=60_000)
        assert "dark" in page.evaluate("document.body.className")
        wait_marks(page, "overview-reward", "line")
        page.wait_for_timeout(500)
        img = Image.open(io.BytesIO(page.locator("#overview-reward svg.marks").screenshot())).convert("L")
        pixels = img.tobytes()
        assert sum(pixels) / len(pixels) / 255 < 0.35  # a dark chart, not a white one
        page_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        bg = luminance(page_bg)
        texts = page.evaluate("[...document.querySelectorAll('#overview-reward svg.marks text')]"
                              ".map(t => getComputedStyle(t).fill)")
        assert texts and all(contrast(luminance(t), bg) > 4.5 for t in texts), (texts, page_bg)
        open_tab(page, "bins")
        wait_rows(page, "bins-matrix", G + 1)
        cells = page.locator("#bins-matrix [role='gridcell']").evaluate_all(
            "cs => cs.filter(c => c.innerText.trim() && c.innerText.trim() !== '0' && !/\\//.test(c.innerText))"
            ".map(c => { const s = getComputedStyle(c.querySelector('*') || c); const t = getComputedStyle(c);"
            " return [t.backgroundColor, s.color]; })")
        assert cells
        for background, color in cells:
            under = luminance(background, under=[int(v) for v in re.findall(r"\d+", page_bg)[:3]])
            assert contrast(luminance(color), under) > 4.5, (background, color)
    finally:
        page.close()


def test_a_search_with_no_match_says_so(page):
    from playwright.sync_api import expect

    open_tab(page, "prompt")
    expect(page.locator("#prompt-text")).to_contain_text("uid")
    search(page, "no-such-prompt-zzz")
    expect(page.locator("#prompt-text")).to_contain_text("no prompt matches no-such-prompt-zzz")
    assert page.locator("#prompt-text pre").count() == 0  # no other prompt shown as if it matched


def test_a_prompt_with_a_code_fence_and_an_img_tag_stays_text(page, runs):
    from playwright.sync_api import expect

    requests = []
    page.on("request", lambda r: requests.append(r.url))
    uid = sql(runs[1], "SELECT uid FROM problems WHERE text = ?", (HOSTILE,))[0][0]
    pick_run(page, "tiny-live")
    open_tab(page, "prompt")
    search(page, uid)
    expect(page.locator("#prompt-text")).to_contain_text(uid)
    assert page.locator("#prompt-text pre").inner_text().strip() == HOSTILE.strip()  # all of it, as text
    assert page.locator("#evil").count() == 0 and page.locator("#prompt-text img, #prompt-text script").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert not [u for u in requests if "evil.invalid" in u]


def test_an_unreadable_record_is_said_once_in_place(page):
    from playwright.sync_api import expect

    expect(page.locator("#live")).to_contain_text("tiny · step")
    for label, reason in (("broken-empty", "run.db holds no run record"), ("broken-corrupt", "file is not a database")):
        pick_run(page, label)
        expect(page.locator("#overview-text")).to_contain_text(reason)
        expect(page.locator("#live")).to_contain_text(reason)
        assert page.locator("#live-error").inner_text().startswith(f"{label}: run.db")
        assert page.locator("#live-step").count() == 0  # the previous run's header is gone
        assert marks(page, "overview-reward", "line") == 0
    open_tab(page, "batch")
    expect(page.locator("#batch-text")).to_contain_text("broken-corrupt: run.db")
    page.wait_for_timeout(3500)  # three polls: nothing piles up
    assert page.locator(".toast-body").count() == 0
    assert page.locator("#batch-text").inner_text().count("run.db") == 1


def test_subset_colours_are_the_same_in_every_tab(page, runs):
    from playwright.sync_api import expect

    run = runs[0]
    uid = sql(run, "SELECT uid FROM prompt_steps WHERE subset = ? ORDER BY step LIMIT 1", (X2,))[0][0]
    open_tab(page, "batch")
    wait_marks(page, "batch-composition", "rect")
    batch = page.evaluate(LEGEND_JS, "batch-composition")
    open_tab(page, "prompt")
    search(page, uid)
    expect(page.locator("#prompt-text")).to_contain_text(uid)
    wait_marks(page, "prompt-history", "symbol")
    prompt = page.evaluate(LEGEND_JS, "prompt-history")
    x2 = views.SUBSET_LABELS[X2]
    assert batch[x2] == prompt[x2] == views.SUBSET_COLORS[X2]
    for label, fill in prompt.items():
        assert fill == views.SUBSET_COLORS[next(s for s, lab in views.SUBSET_LABELS.items() if lab == label)]


def test_no_repeated_tick_labels_on_a_short_run(page):
    pick_run(page, "tiny-running")  # 3 steps: a '1.5' tick was labelled '2' beside the '2' of step 2
    for tab, charts in (("overview", ("overview-reward", "overview-rollouts", "overview-time")),
                        ("batch", ("batch-composition", "batch-buffers", "batch-thresholds")),
                        ("ledger", ("ledger-curve",))):
        open_tab(page, tab)
        for chart in charts:
            wait_marks(page, chart, "rect" if chart in ("overview-time", "batch-composition") else "line")
            axes = page.evaluate(AXES_JS, chart)
            assert axes and all(len(ax) == len(set(ax)) for ax in axes), (chart, axes)


def smooth_and_wait(page, plot_id: str, weight: str):
    """Type an EMA weight and press Enter; wait until every line of `plot_id` has its faint raw twin."""
    lines = marks(page, plot_id, "line")
    box = page.locator("#smooth input[type='number']")
    box.fill(weight)
    box.press("Enter")
    page.wait_for_function("([id, n]) => document.querySelectorAll(`#${id} svg g.mark-line path`).length === n",
                           arg=[plot_id, 2 * lines], timeout=30_000)


def test_smoothing_applies_as_it_is_typed(page):
    """Typing a weight and pressing Enter redraws at once (before, only leaving the box did)."""
    wait_marks(page, "overview-reward", "line")
    wait_marks(page, "overview-rollouts", "line")
    page.evaluate("document.querySelector('#overview-rollouts svg.marks').dataset.kept = 'yes'")
    # each smoothed line gets its raw line, drawn faint beside it
    smooth_and_wait(page, "overview-reward", "0.8")
    assert page.evaluate("document.activeElement.closest('#smooth') !== null")  # the box never lost focus
    # only the smoothed chart is drawn again: the rollouts chart (never smoothed) is the same SVG as before
    assert page.evaluate("document.querySelector('#overview-rollouts svg.marks')?.dataset.kept") == "yes"


def test_wrong_passwords_are_limited(runs):
    import urllib.error
    import urllib.parse
    import urllib.request

    from bapo_vl.app.dashboard import LOGIN_FAILURES, launch

    port = _free_port()
    demo = launch([str(runs[0])], port=port, block=False, password="s3cret", warm=False)
    login = lambda pw: urllib.request.urlopen(f"http://127.0.0.1:{port}/login", timeout=30, data=urllib.parse.urlencode(
        {"username": "bapo", "password": pw}).encode())
    try:
        for _ in range(LOGIN_FAILURES):
            with pytest.raises(urllib.error.HTTPError) as e:
                login("guess")
            assert e.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as e:  # now even the right password waits
            login("s3cret")
        assert e.value.code == 429 and "too many wrong passwords" in e.value.read().decode()
    finally:
        demo.close()


# ----------------------------------------------------------------------------- the views and their controls


def test_training_health_plots_every_recorded_scalar_with_an_eta(page, runs):
    import statistics

    from playwright.sync_api import expect

    running = runs[2]
    pick_run(page, "tiny-running")
    open_tab(page, "health")
    times = [r[0] for r in sql(running, "SELECT time FROM steps ORDER BY step")]
    per_step = statistics.median([b - a for a, b in zip(times, times[1:])][-10:])
    expect(page.locator("#health-text")).to_contain_text(
        f"{RUNNING_STEPS - RUNNING_AT} steps left at {per_step:.1f} s/step")
    metrics = views.measured(Run(running).metrics(), Run(running).config())
    for i, (title, _, cols) in enumerate(views.HEALTH):  # one line per scalar measured, in its group
        present = [c for c in cols if c in metrics or c in (views.STALENESS, views.UPDATE_SPEED)]
        assert present, title
        wait_marks(page, f"health-{i}", "line")
        assert marks(page, f"health-{i}", "line") == len(present), title
    # verifier verdicts: a stacked share per step and verdict, and the run's totals as the record has them
    chart = f"health-{len(views.HEALTH)}"
    wait_marks(page, chart, "rect")
    kinds = sql(running, "SELECT COUNT(*) FROM (SELECT step, verdict FROM verdicts GROUP BY step, verdict "
                         "HAVING SUM(count) > 0)")[0][0]
    assert marks(page, chart, "rect") == kinds
    text = page.locator("#health-text").inner_text()
    for verdict, n in sql(running, "SELECT verdict, SUM(count) FROM verdicts GROUP BY verdict"):
        assert number_after(text, f"{verdict}") == n
    # every other recorded scalar can be picked
    others = views.other_metrics(metrics)
    assert "x1" in others and "loss" not in others
    page.locator("#health-other-pick input").first.click()
    page.get_by_role("option", name="t_train", exact=True).click()
    expect(page.locator("#health-other svg.marks")).to_contain_text("t_train")


def sql_retries(run_dir) -> dict[str, int]:
    """uid -> how many more times each prompt was generated for after the group it counts by at its first step:
    a re-evaluation at that step, and each later step once, in plain SQL."""
    return dict(sql(run_dir, f"""
        WITH {SQL_GENERATED}
        SELECT uid, COUNT(DISTINCT CASE WHEN NOT counted THEN step END) FROM marked GROUP BY uid"""))


def test_ledger_counts_retries_and_compare_says_when_a_run_never_retries(page, runs):
    from playwright.sync_api import expect

    run = runs[0]
    ledger, retries = sql_ledger(run), sql_retries(run)
    retried = [(uid, b) for uid, _, b in ledger if retries[uid] > 0]
    solved_retried = sum(1 for _, b in retried if b is not None)
    open_tab(page, "ledger")
    expect(page.locator("#ledger-text")).to_contain_text("retried")
    text = page.locator("#ledger-text").inner_text()
    assert number_after(text, "generated again later (retried):") == len(retried)
    share = f"{100 * solved_retried / len(retried):.1f}" if retried else "–"
    assert f"solved % of retried: {share} %" in text
    page.locator("#ledger-which").get_by_text(views.LEDGER_NEVER).click()
    expect(page.locator("#ledger-note")).to_contain_text(f"{len(ledger) - len(retried)} prompt(s) never retried")

    open_tab(page, "compare")
    wait_rows(page, "compare-table", len(READABLE))
    rows = {r["run"]: r for r in table_records(page, "compare-table")}
    assert "solved % of retried" in rows["tiny"]
    assert rows["tiny"][views.RETRIED_COLUMN] == str(len(retried))
    assert rows["grpo-synth"][views.RETRIED_COLUMN] == "0"
    expect(page.locator("#compare-note")).to_contain_text("grpo-synth never generated a hard prompt again")


def test_ledger_and_compare_show_the_held_out_hard_set_where_a_run_has_it(page, runs):
    # Could fail if the study's evals rows were not read, were shown for a run without them, or the run without
    # them showed a number instead of saying it was not evaluated.
    from playwright.sync_api import expect

    open_tab(page, "ledger")  # tiny: no study evaluation
    expect(page.locator("#hard-set-none")).to_have_text("not evaluated (scripts/study.py)")
    assert page.locator("#hard-set-unlocked").count() == 0
    open_tab(page, "overview")
    pick_run(page, "tiny-live")
    open_tab(page, "ledger")
    expect(page.locator("#hard-set-unlocked")).to_have_text("0.375")
    assert page.locator("#hard-set-size").inner_text() == "8" and page.locator("#hard-set-k").inner_text() == "16"
    assert "algorithm-neutral" in page.locator("#ledger-text").inner_text()

    open_tab(page, "compare")
    wait_rows(page, "compare-table", len(READABLE))
    head = [h.strip() for h in page.locator("#compare-table thead").inner_text().split("\n") if h.strip()]
    col = head.index(views.HARD_SET_COLUMN)
    rows = {r[0]: r for r in table_rows(page, "compare-table")}
    assert rows["tiny-live"][col].startswith("0.375 of 8 (k = 16, step ")
    assert rows["tiny"][col] == "not evaluated (scripts/study.py)"


def sql_regenerated_pair(run_dir) -> tuple[int, int, int]:
    """The pair of steps (a, b) with the most prompts generated at a and next generated at b, in plain SQL."""
    return tuple(sql(run_dir, f"""
        WITH gen AS (SELECT DISTINCT step, uid FROM prompt_steps WHERE {sql_in(GENERATED)}),
        nxt AS (SELECT g.step AS a, (SELECT MIN(h.step) FROM gen h WHERE h.uid = g.uid AND h.step > g.step) AS b
                FROM gen g)
        SELECT a, b, COUNT(*) AS n FROM nxt WHERE b IS NOT NULL GROUP BY a, b ORDER BY n DESC, a, b LIMIT 1""")[0])


def test_migration_opens_on_steps_that_share_prompts_with_counts_or_row_percent(page, runs):
    from playwright.sync_api import expect

    a, b, n = sql_regenerated_pair(runs[0])
    open_tab(page, "bins")
    expect(page.locator("#bins-text")).to_contain_text(f"seen up to step {a} and generated for again in ({a}, {b}]")
    assert number_after(page.locator("#bins-text").inner_text(), "columns: bin at B):") >= n > 0
    page.locator("#bins-mode").get_by_text(MODE_AT).click()
    expect(page.locator("#bins-text")).to_contain_text(f"generated for at both step {a} and step {b}")
    assert number_after(page.locator("#bins-text").inner_text(), "columns: bin at B):") == n
    wait_rows(page, "bins-matrix", G + 1)
    counts = [[int(c) for c in row[1:]] for row in table_rows(page, "bins-matrix")]
    page.locator("#bins-cells").get_by_text(views.CELLS_ROW).click()
    page.wait_for_function("id => [...document.querySelectorAll(`#${id} [role=gridcell]`)]"
                           ".some(c => /\\./.test(c.innerText))", arg="bins-matrix", timeout=30_000)
    shares = [[float(c) for c in row[1:]] for row in table_rows(page, "bins-matrix")]
    for count_row, share_row in zip(counts, shares):
        assert abs(sum(share_row) - (100 if sum(count_row) else 0)) < 0.5
        assert [round(100 * c / sum(count_row), 1) if sum(count_row) else 0 for c in count_row] == share_row


def test_compare_is_interactive_with_fixed_colours_and_csv(page, runs, tmp_path):
    from playwright.sync_api import expect

    open_tab(page, "compare")
    wait_rows(page, "compare-table", len(READABLE))
    wait_marks(page, "compare-plot", "line")
    # the unreadable runs are named in place; every readable one is still drawn
    expect(page.locator("#compare-note")).to_contain_text("broken-empty")
    expect(page.locator("#compare-note")).to_contain_text("broken-corrupt")
    colours = page.evaluate(LEGEND_JS, "compare-plot")
    assert sorted(colours) == sorted(READABLE) and len(set(colours.values())) == len(READABLE)
    assert set(colours.values()) <= set(views.RUN_COLORS)
    # any recorded metric, on any x-axis
    page.locator("#compare-metric input").first.click()
    page.get_by_role("option", name="ppo_kl", exact=True).click()
    expect(page.locator("#compare-plot svg.marks")).to_contain_text("ppo_kl vs step")
    page.locator("#compare-x").get_by_text(views.X_WALL).click()
    expect(page.locator("#compare-plot svg.marks")).to_contain_text(f"ppo_kl vs {views.X_WALL}")
    page.locator("#compare-x").get_by_text(views.X_STEP).click()
    expect(page.locator("#compare-plot svg.marks")).to_contain_text("ppo_kl vs step")
    wait_marks(page, "compare-plot", "line")
    with_grad = sorted(page.evaluate(LEGEND_JS, "compare-plot"))
    assert "grpo-synth" not in with_grad and "tiny" in with_grad  # the synthetic record has no ppo_kl
    # hover: a crosshair whose tooltip lists every run's value at that step
    box = page.locator("#compare-plot svg.marks").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.55, box["y"] + box["height"] * 0.4)
    tooltip = page.locator("#vg-tooltip-element")
    expect(tooltip).to_be_visible()
    for label in ("tiny", "tiny-live"):
        expect(tooltip).to_contain_text(label)
    # the mouse wheel zooms the x-axis
    before = page.evaluate(AXES_JS, "compare-plot")[0]
    page.mouse.wheel(0, -400)
    page.wait_for_function("([id, before]) => JSON.stringify([...document.querySelectorAll(`#${id} svg.marks "
                           "g.role-axis`)][0] && [...document.querySelectorAll(`#${id} svg.marks g.role-axis`)][0]"
                           ".querySelectorAll('.role-axis-label text').length && [...document.querySelectorAll("
                           "`#${id} svg.marks g.role-axis`)][0].textContent) !== JSON.stringify(before.join(''))",
                           arg=["compare-plot", before], timeout=10_000)
    # a click on a legend entry highlights that run, the others fade
    page.locator("#compare-plot g.role-legend-label text", has_text="tiny-live").click()
    page.wait_for_function("id => [...document.querySelectorAll(`#${id} svg.marks g.mark-line path`)]"
                           ".some(p => +(p.getAttribute('opacity') ?? p.getAttribute('stroke-opacity') ?? 1) < 0.5)",
                           arg="compare-plot", timeout=10_000)
    # EMA smoothing: the raw line stays, faint, beside each smoothed one
    smooth_and_wait(page, "compare-plot", "0.6")
    # the plotted data as CSV: every run drawn, smoothed and raw
    with page.expect_download() as download:
        page.locator("#compare-csv").click()
    csv = pd.read_csv(download.value.path())
    assert list(csv.columns) == ["step", "ppo_kl", "ppo_kl (raw)", "run"]
    assert pd.api.types.is_integer_dtype(csv["step"])  # steps written as 3, never 3.0
    assert sorted(csv["run"].unique()) == with_grad
    raw = sql(runs[0], "SELECT json_extract(metrics, '$.ppo_kl') FROM steps ORDER BY step")
    assert csv[csv["run"] == "tiny"]["ppo_kl (raw)"].round(6).tolist() == [round(r[0], 6) for r in raw]
    # one colour per run, whatever else is ticked
    page.locator("#compare-runs").get_by_text("tiny", exact=True).click()
    page.locator("#compare-runs").get_by_text("tiny-running", exact=True).click()
    page.wait_for_function("id => document.querySelectorAll(`#${id} svg.marks g.role-legend-label text`).length === 1",
                           arg="compare-plot", timeout=30_000)
    assert page.evaluate(LEGEND_JS, "compare-plot") == {"tiny-live": colours["tiny-live"]}
    for label in ("tiny-live", "grpo-synth", "broken-empty", "broken-corrupt"):  # none ticked: said so, real headers
        page.locator("#compare-runs").get_by_text(label, exact=True).click()
    expect(page.locator("#compare-note")).to_contain_text("choose runs to compare")
    assert page.locator("#compare-table thead").inner_text().split("\n")[0].strip() == "run"


def test_click_through_opens_the_prompts_behind_a_bar_a_bin_or_a_cell(page, runs):
    from playwright.sync_api import expect

    run = runs[0]
    step, n = sql(run, "SELECT step, COUNT(*) FROM prompt_steps WHERE subset = ? GROUP BY step ORDER BY step DESC "
                       "LIMIT 1", (X2,))[0]
    open_tab(page, "batch")
    wait_marks(page, "batch-composition", "rect")
    page.locator(f"#batch-composition path[aria-label='{X2}@{step}-{step}']").click()
    expect(page.locator("#prompt-list")).to_contain_text(f"{views.SUBSET_LABELS[X2]} at step {step}: {n} prompt")
    uids = {r[0] for r in sql(run, "SELECT uid FROM prompt_steps WHERE subset = ? AND step = ?", (X2, step))}
    assert page.locator("#prompt-pick input").first.input_value().split(" — ")[0] in uids
    expect(page.locator("#prompt-text")).to_contain_text("uid")

    last = sql(run, "SELECT MAX(step) FROM steps")[0][0]
    zero = sql(run, f"SELECT COUNT(*) FROM prompt_steps WHERE step = ? AND correct = 0 AND {sql_in(FRESH)}",
               (last,))[0][0]
    open_tab(page, "batch")
    wait_marks(page, "batch-bins", "rect")
    page.locator(f"#batch-bins path[aria-label='bin0@{last}-{last}']").click()
    expect(page.locator("#prompt-list")).to_contain_text(f"fresh groups at 0/{G} at step {last}: {zero} prompt")

    a, b, _ = sql_regenerated_pair(run)
    hist_a, _, m = Run(run).migration(a, b, window=True)
    open_tab(page, "bins")
    wait_marks(page, "bins-hist-a", "rect")
    page.locator("#bins-hist-a path[aria-label='bin0']").click()
    expect(page.locator("#prompt-list")).to_contain_text(f"in histogram A (step {a}): {hist_a[0]} prompt")
    open_tab(page, "bins")
    wait_rows(page, "bins-matrix", G + 1)
    i, j = next((i, j) for i in range(G + 1) for j in range(G + 1) if m[i][j])
    page.locator("#bins-matrix [role='row']").nth(i + 1).locator("[role='gridcell']").nth(j + 1).click()
    expect(page.locator("#prompt-list")).to_contain_text(f"migration cell {views.bin_labels(G)[i]} at A (step {a})"
                                                         f" → {views.bin_labels(G)[j]} at B (step {b}): {m[i][j]}")


# ----------------------------------------------------------------------------- what the line charts draw


POINTS_JS = """id => [...document.querySelectorAll(`#${id} svg.marks g.mark-symbol.role-mark path[aria-label]`)]
    .map(p => p.getAttribute('aria-label'))"""


def points(page, elem_id, series) -> dict[int, float]:
    """{step: value} of the points drawn for `series` in the chart `elem_id` (read from each mark's aria-label)."""
    out = {}
    for label in page.evaluate(POINTS_JS, elem_id):
        (_, x), (_, y), *rest = (f.split(": ", 1) for f in label.split("; "))  # x, y, then the series
        if dict(rest).get("series") == series:
            out[int(x)] = float(y)
    return out


def hover_at_step(page, elem_id, step) -> dict[str, str]:
    """Move the pointer over the chart's x-axis label `step`, a third down the plot; returns the tooltip's rows
    {title: value}."""
    from playwright.sync_api import expect

    svg = page.locator(f"#{elem_id} svg.marks")
    svg.scroll_into_view_if_needed()
    label = svg.locator("g.role-axis .role-axis-label text", has_text=re.compile(f"^{step}$")).first
    x = label.bounding_box()["x"] + label.bounding_box()["width"] / 2
    box = svg.bounding_box()
    page.mouse.move(x, box["y"] + box["height"] * 0.35)
    tooltip = page.locator("#vg-tooltip-element")
    expect(tooltip).to_be_visible()
    return dict(tooltip.locator("tr").evaluate_all(
        "rows => rows.map(r => [...r.querySelectorAll('td')].map(td => td.innerText.trim()))"))


def test_what_was_not_measured_is_a_gap_not_a_zero(page, runs):
    # Could fail (and did): the re-evaluated reward was drawn as 0 at every step that re-evaluated nothing, and the
    # KL to the reference as a flat 0 in a run without the KL term (both are stored as 0.0).
    run = runs[0]
    rows = sql(run, "SELECT step, json_extract(metrics, '$.rollouts_reevaluated'), "
                    "json_extract(metrics, '$.reevaluated_reward') FROM steps ORDER BY step")
    measured = {s: r for s, n, r in rows if n}
    assert 0 < len(measured) < len(rows)
    open_tab(page, "health")
    wait_marks(page, "health-0", "line")
    drawn = points(page, "health-0", "re-evaluated")  # measured every few steps: drawn as points
    assert drawn.keys() == measured.keys()
    assert all(abs(drawn[s] - measured[s]) < 1e-6 for s in measured)
    assert sql(run, "SELECT json_extract(json, '$.kl_coef') FROM config")[0][0] == 0
    kl = page.evaluate(LEGEND_JS, "health-2")
    assert "KL to the reference (k3)" not in kl and "KL to the rollout policy" in kl
    assert "kl_coef = 0" in page.locator("#health-2 svg.marks").text_content()


def test_a_single_evaluation_is_drawn_and_tooltips_name_only_what_is_there(page, runs):
    # Could fail (and did): a series of one point (one `bapo eval --run`, or any series of a live run at its first
    # step) had a legend entry and no mark; the crosshair printed "null" for a run that had ended before that step,
    # and thinned lines hovered at half steps.
    name, metrics = ONE_EVAL
    step = sql(runs[1], "SELECT step FROM evals WHERE name = ? LIMIT 1", (name,))[0][0]
    pick_run(page, "tiny-live")
    wait_marks(page, "overview-reward", "line")
    assert points(page, "overview-reward", f"{views.EVAL_PREFIX}{name} mean@k") == {step: metrics["mean@k"]}

    open_tab(page, "compare")  # grpo-synth has 10 steps, every other run fewer
    wait_marks(page, "compare-plot", "line")
    last = sql(runs[0], "SELECT MAX(step) FROM steps")[0][0]
    rows = hover_at_step(page, "compare-plot", 10)
    assert rows.keys() == {"step", "grpo-synth"}, rows  # the runs that ended before step 10 are left out
    assert rows["step"] == "10" and re.fullmatch(r"[-\d.e]+", rows["grpo-synth"]), rows
    rows = hover_at_step(page, "compare-plot", last)
    assert {"step", "tiny", "grpo-synth"} <= rows.keys() and rows["step"] == str(last), rows


LINES_JS = """id => [...document.querySelectorAll(`#${id} svg.marks g.mark-line.role-mark path[aria-label]`)].map(p =>
    [p.getAttribute('aria-label'), +(p.getAttribute('opacity') ?? p.getAttribute('stroke-opacity') ?? 1),
     +p.getAttribute('stroke-width')])"""


def line_opacity(page, elem_id, raw: bool = False) -> dict[str, float]:
    """{series: opacity} of the lines of `elem_id` (raw=True: of the faint raw lines under smoothed ones, the
    thinner ones)."""
    lines = page.evaluate(LINES_JS, elem_id)
    widths = sorted({w for *_, w in lines})
    out = {}
    for label, opacity, width in lines:
        if (width == widths[0]) == raw or len(widths) == 1 and not raw:
            out[dict(f.split(": ", 1) for f in label.split("; "))["series"]] = opacity
    return out


def redrawn(page, elem_id):
    """Mark the chart now shown in `elem_id`; returns a function that waits until it was drawn again."""
    page.evaluate("id => document.querySelector(`#${id} svg.marks`).dataset.old = 'yes'", elem_id)

    def wait():
        page.wait_for_function("id => { const svg = document.querySelector(`#${id} svg.marks`);"
                               " return !!svg && !svg.dataset.old && svg.getBoundingClientRect().width > 0 &&"
                               " svg.querySelectorAll('g.mark-line path').length > 0; }", arg=elem_id, timeout=30_000)
    return wait


def x_labels(page, elem_id) -> list[str]:
    """The x-axis tick labels of a chart (its first axis with labels: grid-only axes come first, y after x)."""
    return next(ax for ax in page.evaluate(AXES_JS, elem_id) if ax)


def until(page, check, timeout_s: float = 10):
    """Wait until check() is true (polled every 100 ms); assert it finally is."""
    import time

    end = time.monotonic() + timeout_s
    while not check() and time.monotonic() < end:
        page.wait_for_timeout(100)
    assert check()


def highlighted(page, elem_id, raw: bool = False) -> set[str]:
    """The series of `elem_id` drawn in full (the others faded): none while nothing is highlighted."""
    opacity = line_opacity(page, elem_id, raw)
    return {s for s, o in opacity.items() if o == max(opacity.values())} if len(set(opacity.values())) > 1 else set()


def test_charts_keep_zoom_and_legend_across_polls_tabs_and_smoothing(page, runs):
    # Could fail (and did): every poll of a live run and every tab switch drew the charts anew, at their full range
    # and with no series highlighted; with smoothing on, a legend click highlighted nothing.
    from playwright.sync_api import expect

    live, chart = runs[1], "overview-reward"
    pick_run(page, "tiny-live")
    wait_marks(page, chart, "line")
    full = x_labels(page, chart)
    box = page.locator(f"#{chart} svg.marks").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.4)
    page.mouse.wheel(0, -400)
    until(page, lambda: x_labels(page, chart) != full)
    zoomed = x_labels(page, chart)
    page.locator(f"#{chart} g.role-legend-label text", has_text=views.BATCH_REWARD).click()
    until(page, lambda: highlighted(page, chart) == {views.BATCH_REWARD})

    last = sql(live, "SELECT MAX(step) FROM steps")[0][0]
    wait = redrawn(page, chart)
    _log_extra_step(live, last + 1)  # a poll draws the chart again, with the new step
    expect(page.locator("#overview-text")).to_contain_text(f"last step: {last + 1} ", timeout=20_000)
    wait()
    assert x_labels(page, chart) == zoomed
    assert highlighted(page, chart) == {views.BATCH_REWARD}

    wait = redrawn(page, chart)
    open_tab(page, "batch")
    wait_marks(page, "batch-composition", "rect")
    open_tab(page, "overview")
    wait()
    assert x_labels(page, chart) == zoomed
    assert highlighted(page, chart) == {views.BATCH_REWARD}

    smooth_and_wait(page, chart, "0.6")  # smoothed lines over faint raw ones: the same zoom and highlight
    assert x_labels(page, chart) == zoomed
    assert highlighted(page, chart) == highlighted(page, chart, raw=True) == {views.BATCH_REWARD}
    page.locator(f"#{chart} g.role-legend-label text", has_text=views.FRESH_REWARD).click()  # and a second one
    until(page, lambda: highlighted(page, chart) == {views.BATCH_REWARD, views.FRESH_REWARD})


# ----------------------------------------------------------------------------- small things that read wrong


def test_matrix_row_percent_and_an_empty_cell_read_right(page, runs):
    # Could fail (and did): row-% cells printed "81.400000"; an empty migration cell opened the drill-down with
    # placeholder column headers "1 2 3" and the previous search still in the search box.
    from playwright.sync_api import expect

    open_tab(page, "prompt")
    expect(page.locator("#prompt-text")).to_contain_text("uid")
    search(page, sql(runs[0], "SELECT uid FROM problems LIMIT 1")[0][0])
    expect(page.locator("#prompt-text")).to_contain_text("answer")
    open_tab(page, "bins")
    wait_rows(page, "bins-matrix", G + 1)
    page.locator("#bins-cells").get_by_text(views.CELLS_ROW).click()
    page.wait_for_function("id => [...document.querySelectorAll(`#${id} [role=gridcell]`)]"
                           ".some(c => /\\./.test(c.innerText))", arg="bins-matrix", timeout=30_000)
    cells = [c for row in table_rows(page, "bins-matrix") for c in row[1:]]
    assert all(re.fullmatch(r"\d+\.\d", c) for c in cells), cells
    i, j = next((i, j) for i, row in enumerate(table_rows(page, "bins-matrix")) for j, c in enumerate(row[1:])
                if float(c) == 0)
    page.locator("#bins-matrix [role='row']").nth(i + 1).locator("[role='gridcell']").nth(j + 1).click()
    expect(page.locator("#prompt-list")).to_contain_text("0 prompt(s)")
    assert page.locator("#prompt-query textarea, #prompt-query input").first.input_value() == ""
    head = page.locator("#prompt-samples thead").inner_text().split()
    assert head[:3] == ["step", "subset", "idx"], head


def test_compare_names_algorithm_and_task_and_offers_only_eval_accuracies(page, runs):
    # Could fail (and did): the summary had no algorithm or task column, runs of different tasks shared an axis
    # without a word, and one evaluation added every count it records (problems, k, verdicts) as a metric.
    from playwright.sync_api import expect

    open_tab(page, "compare")
    wait_rows(page, "compare-table", len(READABLE))
    rows = {r["run"]: r for r in table_records(page, "compare-table")}
    assert (rows["tiny"]["algo"], rows["tiny"]["task"]) == ("bapo", "countdown")
    assert (rows["grpo-synth"]["algo"], rows["grpo-synth"]["task"]) == ("grpo", "geometry3k")
    expect(page.locator("#compare-note")).to_contain_text("different tasks (countdown, geometry3k)")
    page.locator("#compare-metric input").first.click()
    options = page.get_by_role("option").all_inner_texts()
    evals = [o for o in options if o.startswith(views.EVAL_PREFIX)]
    name = ONE_EVAL[0]
    assert f"{views.EVAL_PREFIX}{name} mean@k" in evals and f"{views.EVAL_PREFIX}{name} pass@k" in evals
    assert all(o.rsplit(" ", 1)[1] in views.EVAL_MEASURES for o in evals), evals


def test_axes_are_named_terms_are_explained_and_the_console_stays_quiet(browser, server):
    # Could fail (and did): the Training-health y axes all said "value", the batch and migration views used B_bad,
    # c1..c3, r_tot and "latest result in (A, B]" without a word of explanation, and every chart logged
    # "Infinite extent" warnings to the browser console as it was drawn.
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 800})
    warnings = []
    page.on("console", lambda m: warnings.append(m.text) if m.type in ("warning", "error") else None)
    try:
        page.goto(server)
        expect(page.locator("#overview-text")).to_contain_text("last step", timeout=60_000)
        for tab, chart, mark in (("overview", "overview-reward", "line"), ("health", "health-0", "line"),
                                 ("batch", "batch-composition", "rect"), ("ledger", "ledger-curve", "line"),
                                 ("bins", "bins-hist-a", "rect"), ("prompt", "prompt-history", "symbol"),
                                 ("compare", "compare-plot", "line")):
            open_tab(page, tab)
            wait_marks(page, chart, mark)
        open_tab(page, "health")
        wait_marks(page, "health-0", "line")
        for i, (_, y_title, _) in enumerate(views.HEALTH):
            if marks(page, f"health-{i}", "line"):  # a chart of metrics this run did not record has no axes
                titles = page.locator(f"#health-{i} svg.marks g.role-axis-title text").evaluate_all(
                    "ts => ts.map(t => t.textContent)")
                assert y_title in titles and "value" not in titles, (i, titles)
        open_tab(page, "batch")
        terms = page.locator("#batch-terms").inner_text()
        for term in ("B_bad", "B_high", "c1", "c2", "c3", "r_tot"):
            assert term in terms
        open_tab(page, "bins")
        expect(page.locator("#bins-terms")).to_contain_text("last result after A")
        assert not [w for w in warnings if "Infinite extent" in w], warnings[:3]
    finally:
        page.close()


def test_a_synthetic_record_being_written_shows_as_running(tmp_path):
    # Could fail (and did): scripts/synth_run.py --sleep held no trainer lock, so its record showed as
    # "stopped (killed?)" while it was being written.
    import subprocess
    import time

    run_dir = tmp_path / "live-synth"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "synth_run.py"), str(run_dir), "--prompts", "64",
                             "--steps", "40", "--batch-size", "4", "--sleep", "0.2"], stderr=subprocess.DEVNULL)
    def written() -> bool:
        try:
            return len(Run(run_dir).steps()) > 0
        except (FileNotFoundError, ValueError, sqlite3.Error):  # not created, or not whole, yet
            return False

    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and not written():
            time.sleep(0.2)
        assert Run(run_dir).status() == "running"
    finally:
        proc.kill()
        proc.wait()
    assert Run(run_dir).status() == "stopped (killed?)"  # and once its writer is gone, it says so


# ----------------------------------------------------------------------------- responses at a step


def test_responses_at_a_step_filter_by_verdict_and_subset_search_text_and_open_their_prompt(page, runs):
    # Could fail (and did: there was no such table): responses could be read one prompt at a time only.
    from playwright.sync_api import expect

    run = runs[0]
    step = sql(run, "SELECT MAX(step) FROM samples")[0][0]
    count = lambda where="1", args=(): sql(run, f"SELECT COUNT(*) FROM samples WHERE step = ? AND {where}",
                                           (step, *args))[0][0]
    open_tab(page, "responses")
    expect(page.locator("#responses-note")).to_contain_text(f"step {step}:")
    n = lambda: number_after(page.locator("#responses-note").inner_text(), f"step {step}:")
    assert n() == count()
    page.locator("#responses-verdict").get_by_text("correct", exact=True).click()  # every verdict but correct
    expect(page.locator("#responses-n")).to_have_text(str(count("verdict != 'correct'")))
    filtered = views.SUBSET_LABELS[FILTERED]
    page.locator("#responses-subset").get_by_text(filtered, exact=True).click()
    want = count("verdict != 'correct' AND subset != ?", (FILTERED,))
    expect(page.locator("#responses-n")).to_have_text(str(want))
    assert all(r[1] != filtered and r[2] != "correct" for r in table_rows(page, "responses-table")[:20])
    # the text search: a piece of one of the listed responses
    piece = sql(run, "SELECT substr(response, 1, 6) FROM samples WHERE step = ? AND verdict != 'correct' AND "
                     "subset != ? LIMIT 1", (step, FILTERED))[0][0]
    box = page.locator("#responses-query textarea, #responses-query input").first
    box.fill(piece)
    box.press("Enter")
    want = count("verdict != 'correct' AND subset != ? AND instr(lower(response), lower(?)) > 0", (FILTERED, piece))
    expect(page.locator("#responses-note")).to_contain_text("containing")
    expect(page.locator("#responses-n")).to_have_text(str(want))
    uid = table_rows(page, "responses-table")[0][0]
    page.locator("#responses-table [role='gridcell']").get_by_text(uid, exact=True).first.click()
    expect(page.locator("#prompt-text")).to_contain_text(uid)


def test_the_prompt_picker_takes_a_uid_its_listed_choices_do_not_hold(runs):
    # Could fail (it did, in CI under load) if a clicked response's uid reached the server while the picker's last
    # choices, sent by a live refresh in flight, did not list it: Gradio refused the event ("not in the list of
    # choices") and the drill-down showed "Error" instead of the prompt.
    from bapo_vl.app import data
    from bapo_vl.app.dashboard import build

    demo = build(data.RunSet([str(runs[0])]), poll_seconds=60.0)
    picker = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "prompt-pick")
    uid = sql(runs[0], "SELECT uid FROM problems LIMIT 1")[0][0]
    assert picker.preprocess(uid) == uid


# ----------------------------------------------------------------------------- Compare: groups of runs


def pick_metric(page, name):
    page.locator("#compare-metric input").first.click()
    page.get_by_role("option", name=name, exact=True).click()


def download_csv(page) -> pd.DataFrame:
    with page.expect_download() as download:
        page.locator("#compare-csv").click()
    return pd.read_csv(download.value.path())


def test_compare_groups_runs_shades_differing_settings_and_finds_new_runs(browser, tmp_path):
    # Could fail (and did: none of it existed): runs could not be grouped by algorithm or seed into mean ± sd
    # bands at equal rollouts, no table showed their settings side by side, the ledger's solved % of retried was
    # not plotted, and a run started under a served folder never appeared until the server restarted.
    import numpy as np
    from playwright.sync_api import expect

    from bapo_vl.app.dashboard import FIND_SECONDS, launch

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from synth_run import synth
    finally:
        sys.path.pop(0)
    folder = tmp_path / "served"
    for algo in ("bapo", "grpo"):
        for seed in (0, 1):
            synth(folder / f"{algo}-s{seed}", prompts=160, steps=12, B=8, G=4, m=2, algo=algo, seed=seed,
                  quiet=True)
    port = _free_port()
    demo = launch([str(folder)], port=port, block=False, poll_seconds=1.0, warm=False)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        page.goto(f"http://127.0.0.1:{port}/")
        expect(page.locator("#overview-text")).to_contain_text("last step", timeout=60_000)
        open_tab(page, "compare")
        wait_marks(page, "compare-plot", "line")
        page.locator("#compare-x").get_by_text(views.X_ROLLOUTS).click()
        page.locator("#compare-group").get_by_text(views.GROUP_ALGO, exact=True).click()
        expect(page.locator("#compare-note")).to_contain_text("grouped by algorithm")
        page.wait_for_function("id => document.querySelectorAll(`#${id} svg.marks g.mark-area path`).length === 2",
                               arg="compare-plot", timeout=30_000)
        assert sorted(page.evaluate(LEGEND_JS, "compare-plot")) == ["bapo (2 runs)", "grpo (2 runs)"]
        # each group's line is the mean of its runs at equal rollouts, the band ± one sd
        csv = download_csv(page)
        mean, lo, hi = "fresh_reward", "fresh_reward mean - sd", "fresh_reward mean + sd"
        for algo in ("bapo", "grpo"):
            curves = []
            for seed in (0, 1):
                rows = sql(folder / f"{algo}-s{seed}", "SELECT rollouts, fresh_reward FROM steps ORDER BY step")
                curves.append((np.cumsum([r[0] for r in rows]), [r[1] for r in rows]))
            group = csv[csv["group"] == f"{algo} (2 runs)"]
            assert len(group) and group[views.X_ROLLOUTS].max() == min(c[0][-1] for c in curves)
            values = np.array([np.interp(group[views.X_ROLLOUTS], x, y) for x, y in curves])
            assert np.allclose(group[mean], values.mean(axis=0), atol=1e-6)
            assert np.allclose(group[hi] - group[mean], values.std(axis=0, ddof=1), atol=1e-6)
            assert np.allclose(group[mean] - group[lo], values.std(axis=0, ddof=1), atol=1e-6)
        # the ledger's solved % of retried against rollouts, as the ledger counts it
        page.locator("#compare-group").get_by_text(views.GROUP_NONE, exact=True).click()
        pick_metric(page, views.SOLVED_SHARE)
        expect(page.locator("#compare-plot svg.marks")).to_contain_text(views.SOLVED_SHARE)
        csv = download_csv(page)
        for run in ("bapo-s0", "bapo-s1"):
            ledger, retries = sql_ledger(folder / run), sql_retries(folder / run)
            retried = [b for uid, _, b in ledger if retries[uid] > 0]
            last = csv[csv["run"] == run].iloc[-1]
            assert last[views.X_ROLLOUTS] == sql(folder / run, "SELECT SUM(rollouts) FROM steps")[0][0]
            assert abs(last[views.SOLVED_SHARE] - 100 * sum(b is not None for b in retried) / len(retried)) < 1e-6
        assert "grpo-s0" not in set(csv["run"])  # never retries: no share to draw
        # the runs' settings side by side, what differs shaded
        rows = {r["run"]: r for r in table_records(page, "compare-configs")}
        assert (rows["bapo-s1"]["algo"], rows["bapo-s1"]["seed"], rows["grpo-s0"]["v"]) == ("bapo", "1", "1")
        head = [h.strip() for h in page.locator("#compare-configs thead").inner_text().split("\n") if h.strip()]
        shaded = page.locator("#compare-configs [role='row']").nth(1).locator("[role='gridcell']").evaluate_all(
            "cells => cells.map(c => getComputedStyle(c).backgroundColor)")
        background = dict(zip(head, shaded))
        assert background["algo"] == background["seed"] == background["v"] != background["G"], background
        # a run started under the served folder appears, ticked, without a restart
        synth(folder / "bapo-s2", prompts=160, steps=12, B=8, G=4, m=2, seed=2, quiet=True)
        expect(page.locator("#compare-runs")).to_contain_text("bapo-s2", timeout=(FIND_SECONDS + 20) * 1000)
        assert page.locator("#compare-runs").get_by_label("bapo-s2").is_checked()
        page.locator("#run input").first.click()
        expect(page.get_by_role("option", name="bapo-s2", exact=True)).to_be_visible()
    finally:
        page.close()
        demo.close()
