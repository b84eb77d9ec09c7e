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
--repeat runs. It prints the machine and the record's size with the table; no pass/fail.
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

# tab -> (what the server runs, given (run, all runs)); controls at their defaults
TABS = {
    D.TAB_OVERVIEW: lambda run, runs: D.render_overview(run, 1),
    D.TAB_BATCH: lambda run, runs: D.render_batch(run),
    D.TAB_LEDGER: lambda run, runs: D.render_ledger(run, views.LEDGER_FILTERS[0]),
    D.TAB_BINS: lambda run, runs: D.render_bins(run, D.BIN_MODES[0], None, None),
    D.TAB_PROMPT: lambda run, runs: D.render_prompt(run, None),
    D.TAB_COMPARE: lambda run, runs: D.render_compare({r.label: r for r in runs}, [r.label for r in runs],
                                                      views.COMPARE_METRICS[0], 1),
}
# a drawn mark that says the tab finished rendering in the browser
DRAWN = {D.TAB_OVERVIEW: ("overview-reward", "line"), D.TAB_BATCH: ("batch-composition", "rect"),
         D.TAB_LEDGER: ("ledger-curve", "line"), D.TAB_BINS: ("bins-hist-a", "rect"),
         D.TAB_PROMPT: ("prompt-history", "symbol"), D.TAB_COMPARE: ("compare-solved", "line")}
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


def bench_browser(paths: list[str], repeat: int, screenshots: Path | None) -> tuple[dict[str, float], float]:
    """Seconds from a tab click until its plots are drawn (server warmed up, as `bapo dashboard` does at start),
    and the first page load (until the Overview's plots are drawn)."""
    from playwright.sync_api import sync_playwright

    times, loads = {t: [] for t in TABS}, []
    for i in range(repeat):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), *paths], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready", "the dashboard server did not start"
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 800})
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
                        page.screenshot(path=str(screenshots / f"{tab}.png"))
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {t: statistics.median(v) for t, v in times.items()}, statistics.median(loads)


def drawn(page, tab) -> None:
    elem, mark = DRAWN[tab]
    page.wait_for_function(f"(() => {{ const svg = document.querySelector('#{elem} svg.marks'); return !!svg && "
                           f"svg.getBoundingClientRect().width > 0 && "
                           f"svg.querySelectorAll('g.mark-{mark} path').length > 0; }})()", timeout=120_000)


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
    browser, load = bench_browser(a.runs, a.repeat, a.screenshots) if a.browser or a.screenshots else ({}, None)
    head = f"{'tab':28s} {'cold s':>8s} {'warm s':>8s} {'+step s':>8s}" + (f" {'browser s':>10s}" if browser else "")
    print(f"\nmedian of {a.repeat}\n{head}\n{'-' * len(head)}")
    for tab, (cold, warm, step) in rows.items():
        line = f"{D.TAB_TITLES[tab]:28s} {cold:8.3f} {warm:8.3f} {step:8.3f}"
        print(line + (f" {browser[tab]:10.2f}" if browser else ""))
    print(f"bapo runs show --json: {bench_show(a.runs[0], a.repeat):.3f} s")
    if browser:
        print(f"browser: first page load until the Overview's plots are drawn {load:.2f} s; a tab's column is "
              f"click -> plots drawn, with the server warmed up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
