"""How long each dashboard tab takes to load its data, on given run records (e.g. the synthetic 40,000 x 500 one).

    python scripts/synth_run.py /tmp/synth --prompts 40000 --steps 500
    python scripts/bench_dashboard.py /tmp/synth                      # data loading per tab
    python scripts/bench_dashboard.py /tmp/synth --browser            # also end to end in headless Chromium
    python scripts/bench_dashboard.py /tmp/synth /tmp/synth-grpo --browser --screenshots docs/dashboard

Per tab, the time of the function the server runs for it (SQL through read-only connections, caches, frames):
  cold   first load after the server started (nothing cached; the hard-problem ledger and migration tabs read
         every generated group once),
  warm   the same tab again with the record unchanged (e.g. switching back to it),
  +step  after one more step was appended (what a live poll pays), measured on a temporary copy.
Also `bapo runs show --json` (read_run and the JSON text), which reads the record once from scratch.
With --browser: seconds from clicking the tab until its plots are drawn in headless Chromium (/usr/bin/chromium
via Playwright) on a server that has done its start-up read, and the first page load. Each number is the median of
--repeat runs. Then the controls (smoothing, metric and x-axis pickers, row %, click-through): the
server's time for each, and with --browser the time from changing it until its chart is drawn again. It prints the
machine (with its load, before and after) and the records' sizes with the tables; no pass/fail.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bapo_vl import record as R
from bapo_vl.app import dashboard as D
from bapo_vl.app import data, views
from bapo_vl.reader import Run, read_run

def _compare(runs, **kw):
    args = {"metric": None, "x_axis": views.X_STEP, "weight": 0.0, "grouping": views.GROUP_NONE, **kw}
    return D.render_compare({r.label: r for r in runs}, [r.label for r in runs], args["metric"], args["x_axis"],
                            args["weight"], {r.label: views.RUN_COLORS[i] for i, r in enumerate(runs)}, OUT,
                            args["grouping"])


def _click_x2(run, runs):
    """A click on the last X2 bar of the batch chart: the prompts behind it listed in the drill-down."""
    steps = run.steps()
    step = int(steps.loc[steps["x2"].fillna(0) > 0, "step"].max())
    return D.render_prompt(run, None, "", D.drill(run, f"batch-composition|x2@{step}-{step}", D.BIN_MODES[0], None,
                                                  None))


OUT = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
# tab -> (what the server runs, given (run, all runs)); controls at their defaults
TABS = {
    D.TAB_OVERVIEW: lambda run, runs: D.render_overview(run, 0.0),
    D.TAB_HEALTH: lambda run, runs: D.render_health(run, 0.0, None),
    D.TAB_BATCH: lambda run, runs: D.render_batch(run),
    D.TAB_LEDGER: lambda run, runs: D.render_ledger(run, views.LEDGER_FILTERS[0]),
    D.TAB_BINS: lambda run, runs: D.render_bins(run, D.BIN_MODES[0], None, None, views.CELLS[0]),
    D.TAB_PROMPT: lambda run, runs: D.render_prompt(run, None),
    D.TAB_RESPONSES: lambda run, runs: D.render_responses(run, None, None, None, ""),
    D.TAB_COMPARE: lambda run, runs: _compare(runs),
}
# the controls: what the server runs when one is changed, the tab it is on open
CONTROLS = {
    "smoothing 0.9 (Overview)": lambda run, runs: D.render_overview(run, 0.9),
    "smoothing 0.9 (Training health)": lambda run, runs: D.render_health(run, 0.9, None),
    "other metric t_train (Training health)": lambda run, runs: D.render_health(run, 0.0, "t_train"),
    "ledger: never retried": lambda run, runs: D.render_ledger(run, views.LEDGER_NEVER),
    "migration: row %": lambda run, runs: D.render_bins(run, D.BIN_MODES[0], None, None, views.CELLS_ROW),
    "compare: metric entropy": lambda run, runs: _compare(runs, metric="entropy"),
    "compare: x-axis wall time": lambda run, runs: _compare(runs, x_axis=views.X_WALL),
    "compare: x-axis rollouts, smoothing 0.9": lambda run, runs: _compare(runs, x_axis=views.X_ROLLOUTS, weight=0.9),
    "compare: grouped by algorithm, x-axis rollouts": lambda run, runs: _compare(runs, x_axis=views.X_ROLLOUTS,
                                                                                  grouping=views.GROUP_ALGO),
    "responses: verdict unparsable, text search": lambda run, runs: D.render_responses(run, None, ["unparsable"],
                                                                                         None, "answer"),
    "click-through: an X2 bar": _click_x2,
}
# a drawn mark that says the tab finished rendering in the browser
DRAWN = {D.TAB_OVERVIEW: ("overview-reward", "line"), D.TAB_HEALTH: ("health-0", "line"),
         D.TAB_BATCH: ("batch-composition", "rect"), D.TAB_LEDGER: ("ledger-curve", "line"),
         D.TAB_BINS: ("bins-hist-a", "rect"), D.TAB_PROMPT: ("prompt-history", "symbol"),
         D.TAB_RESPONSES: ("responses-table", None), D.TAB_COMPARE: ("compare-solved", "line")}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"{platform.node()}: {cpu}, {len(os.sched_getaffinity(0))} usable cores, load average {load}; "
            f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}")


def describe(run_dir) -> str:
    (steps,) = R.query_ro(run_dir, "SELECT COUNT(*) FROM steps")[0]
    (rows,) = R.query_ro(run_dir, "SELECT COUNT(*) FROM prompt_steps")[0]
    (prompts,) = R.query_ro(run_dir, "SELECT COUNT(*) FROM problems")[0]
    size = (Path(run_dir) / R.DB_NAME).stat().st_size / 2**20
    return f"{run_dir}: {prompts} prompts, {steps} steps, {rows} prompt_steps rows, {size:.0f} MiB"


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def append_step(run_dir) -> None:
    """One more step like the last one (same groups), as the trainer writes it."""
    last = R.query_ro(run_dir, "SELECT MAX(step) FROM steps")[0][0]
    groups = [tuple(r) for r in R.query_ro(run_dir, "SELECT uid, correct, G, subset FROM prompt_steps WHERE step = ?",
                                           (last,))]
    metrics = dict(Run(run_dir).step_records()[-1])
    record = R.RunRecord.open(run_dir)
    try:
        record.log_step(last + 1, {k: v for k, v in metrics.items() if k not in ("step", "time")}, groups=groups)
    finally:
        record.close()


def bench_data(paths: list[str], repeat: int) -> dict[str, tuple[float, float, float]]:
    cold, warm, step = {t: [] for t in TABS}, {t: [] for t in TABS}, {t: [] for t in TABS}
    for _ in range(repeat):
        for tab, fn in TABS.items():  # cold: a fresh server's Run objects for every tab
            runs = data.load_runs(paths)
            cold[tab].append(timed(fn, runs[0], runs))
            warm[tab].append(timed(fn, runs[0], runs))
        with tempfile.TemporaryDirectory() as tmp:  # +step, on a copy (the given records are only read)
            copies = []
            for i, p in enumerate(paths):
                dst = Path(tmp) / f"run{i}"
                dst.mkdir()
                src, out = R.connect_ro(p), sqlite3.connect(dst / R.DB_NAME)
                src.backup(out)
                src.close()
                out.close()
                copies.append(str(dst))
            runs = data.load_runs(copies)
            for fn in TABS.values():
                fn(runs[0], runs)
            append_step(copies[0])
            for tab, fn in TABS.items():
                step[tab].append(timed(fn, runs[0], runs))
    med = statistics.median
    return {t: (med(cold[t]), med(warm[t]), med(step[t])) for t in TABS}


def bench_controls(paths: list[str], repeat: int) -> dict[str, float]:
    """Seconds the server takes when one of CONTROLS is changed, its tab already drawn (median of `repeat`)."""
    times = {c: [] for c in CONTROLS}
    for _ in range(repeat):
        runs = data.load_runs(paths)
        for fn in TABS.values():
            fn(runs[0], runs)
        for name, fn in CONTROLS.items():
            times[name].append(timed(fn, runs[0], runs))
    return {c: statistics.median(v) for c, v in times.items()}


def bench_show(path: str, repeat: int) -> float:
    """`bapo runs show --json`: read_run from scratch and the JSON text."""
    return statistics.median(timed(lambda: json.dumps(read_run(path), allow_nan=False)) for _ in range(repeat))


# the dashboard in its own process, as `bapo dashboard` runs it; "ready" once its start-up read is done
SERVER = """
import sys, threading, time
from bapo_vl.app.dashboard import launch
launch(sys.argv[2:], port=int(sys.argv[1]), block=False, poll_seconds=60)
[t.join() for t in threading.enumerate() if t.name == "dashboard-warm"]
print("ready", flush=True)
while True:
    time.sleep(60)
"""


def drawn(page, tab) -> None:
    elem, mark = DRAWN[tab]
    if mark is None:  # a table: until its rows are there
        page.wait_for_function(f"document.querySelectorAll('#{elem} [role=gridcell]').length > 0", timeout=120_000)
        return
    page.wait_for_function(f"(() => {{ const svg = document.querySelector('#{elem} svg.marks'); return !!svg && "
                           f"svg.getBoundingClientRect().width > 0 && "
                           f"svg.querySelectorAll('g.mark-{mark} path').length > 0; }})()", timeout=120_000)


def _old(page, elem) -> None:
    """Mark the chart in `elem` as drawn before: `redrawn` waits for a new one."""
    page.evaluate("id => { const s = document.querySelector(`#${id} svg.marks`); if (s) s.dataset.old = '1'; }", elem)


def redrawn(page, elem, mark) -> None:
    page.wait_for_function("([id, mark]) => { const s = document.querySelector(`#${id} svg.marks`); return !!s && "
                           "!s.dataset.old && s.getBoundingClientRect().width > 0 && "
                           "s.querySelectorAll(`g.mark-${mark} path`).length > 0; }", arg=[elem, mark],
                           timeout=120_000)


def _open(page, elem) -> None:
    page.locator(f"#{elem} input").first.click()


def _pick(page, option) -> None:
    page.get_by_role("option", name=option, exact=True).click()


def _smooth(page, value) -> None:
    box = page.locator("#smooth input[type='number']")
    box.fill(str(value))
    box.press("Enter")


def _x2_bar(page) -> None:
    page.locator("#batch-composition path[aria-label^='x2@']").last.click()


# (control, the tab it is on, what the user does before the change (untimed: opening a dropdown's list), the
# change, the chart whose redraw ends it (None: the migration table))
nothing = lambda page: None
BROWSER_CONTROLS = [
    ("smoothing 0.9 (Overview)", D.TAB_OVERVIEW, nothing, lambda page: _smooth(page, 0.9), ("overview-reward", "line")),
    ("smoothing 0 (Training health)", D.TAB_HEALTH, nothing, lambda page: _smooth(page, 0), ("health-8", "line")),
    ("other metric t_train (Training health)", D.TAB_HEALTH, lambda page: _open(page, "health-other-pick"),
     lambda page: _pick(page, "t_train"), ("health-other", "line")),
    ("migration: row %", D.TAB_BINS, nothing,
     lambda page: page.locator("#bins-cells").get_by_text(views.CELLS_ROW).click(), None),
    ("compare: metric entropy", D.TAB_COMPARE, lambda page: _open(page, "compare-metric"),
     lambda page: _pick(page, "entropy"), ("compare-plot", "line")),
    ("compare: x-axis wall time", D.TAB_COMPARE, nothing,
     lambda page: page.locator("#compare-x").get_by_text(views.X_WALL).click(), ("compare-plot", "line")),
    ("compare: grouped by algorithm", D.TAB_COMPARE, nothing,
     lambda page: page.locator("#compare-group").get_by_text(views.GROUP_ALGO, exact=True).click(),
     ("compare-plot", "line")),
    ("click-through: an X2 bar", D.TAB_BATCH, nothing, _x2_bar, ("prompt-history", "symbol")),
]


def bench_browser(paths: list[str], repeat: int, screenshots: Path | None):
    """Seconds from a tab click until its plots are drawn (server warmed up, as `bapo dashboard` does at start),
    from changing each of BROWSER_CONTROLS until its chart is drawn again, and the first page load (until the
    Overview's plots are drawn)."""
    from playwright.sync_api import sync_playwright

    times, controls, loads = {t: [] for t in TABS}, {c[0]: [] for c in BROWSER_CONTROLS}, []
    for i in range(repeat):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), *paths], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready", "the dashboard server did not start"
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                t0 = time.perf_counter()
                page.goto(f"http://127.0.0.1:{port}/")
                drawn(page, D.TAB_OVERVIEW)
                loads.append(time.perf_counter() - t0)
                for tab in [*list(TABS)[1:], D.TAB_OVERVIEW]:
                    page.wait_for_timeout(500)
                    t0 = time.perf_counter()
                    page.get_by_role("tab", name=D.TAB_TITLES[tab]).click()
                    drawn(page, tab)
                    times[tab].append(time.perf_counter() - t0)
                    if screenshots and i == 0:
                        page.wait_for_timeout(1000)  # let transitions settle
                        screenshots.mkdir(parents=True, exist_ok=True)
                        page.screenshot(path=str(screenshots / f"{tab}.png"), full_page=True)
                for name, tab, prepare, act, chart in BROWSER_CONTROLS:
                    page.get_by_role("tab", name=D.TAB_TITLES[tab]).click()
                    drawn(page, tab)
                    page.wait_for_timeout(500)
                    if chart:
                        _old(page, chart[0])
                    prepare(page)
                    page.wait_for_timeout(300)
                    t0 = time.perf_counter()
                    act(page)
                    if chart:
                        redrawn(page, *chart)
                    else:
                        page.wait_for_function("() => [...document.querySelectorAll('#bins-matrix [role=gridcell]')]"
                                               ".some(c => /\\./.test(c.innerText))", timeout=120_000)
                    controls[name].append(time.perf_counter() - t0)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    med = statistics.median
    return {t: med(v) for t, v in times.items()}, {c: med(v) for c, v in controls.items()}, med(loads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (the first is the one shown; all are compared)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--browser", action="store_true", help="also time each tab end to end in headless Chromium")
    ap.add_argument("--screenshots", type=Path, help="with --browser: save a 1280x800 PNG of each tab here")
    a = ap.parse_args(argv)
    print(machine())
    for p in a.runs:
        print(describe(p))
    rows = bench_data(a.runs, a.repeat)
    server_controls = bench_controls(a.runs, a.repeat)
    browser, browser_controls, load = (bench_browser(a.runs, a.repeat, a.screenshots) if a.browser or a.screenshots
                                       else ({}, {}, None))
    head = f"{'tab':40s} {'cold s':>8s} {'warm s':>8s} {'+step s':>8s}" + (f" {'browser s':>10s}" if browser else "")
    print(f"\nmedian of {a.repeat}\n{head}\n{'-' * len(head)}")
    for tab, (cold, warm, step) in rows.items():
        line = f"{D.TAB_TITLES[tab]:40s} {cold:8.3f} {warm:8.3f} {step:8.3f}"
        print(line + (f" {browser[tab]:10.2f}" if browser else ""))
    head = f"{'control (its tab drawn)':40s} {'server s':>8s}" + (f" {'browser s':>10s}" if browser else "")
    print(f"\n{head}\n{'-' * len(head)}")
    for name, t in server_controls.items():
        print(f"{name:40s} {t:8.3f}")
    for name, t in browser_controls.items():
        print(f"{name:40s} {'':8s} {t:10.2f}")
    print(f"bapo runs show --json: {bench_show(a.runs[0], a.repeat):.3f} s")
    if browser:
        print(f"browser: first page load until the Overview's plots are drawn {load:.2f} s; a tab's column is "
              f"click -> plots drawn, a control's is change -> its chart drawn again, with the server warmed up")
    print(machine())  # the load again, after the runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
