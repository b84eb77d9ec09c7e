"""`bapo dashboard RUN_DIR...`: a Gradio web dashboard over run records, live while a run is training.

Layout: one Blocks page, a run picker and the smoothing on top and eight tabs (Overview, Training health, Batch
composition, Hard-problem ledger, Accuracy bins & migration, Prompt drill-down, Responses at a step, Compare runs).
A gr.Timer polls the record: each tick compares a cheap version key of the run(s) shown (read-only connection, no
lock the trainer waits on) with the one already on screen, and only when it changed re-renders the tab in view. The
runs come from the command line (a folder given there is looked at again for new runs); the browser only picks among
their labels. A run whose record cannot be read (empty, corrupt, old schema) is said so once, in place of what its
tab would show. Charts keep the reader's zoom, pan and legend choice when they are drawn again (VIEW_STATE_JS).

Every plot is a Vega-Lite chart built by app/views.py (see `vega` for why not gr.LinePlot). Tab renderers take
the controls' values and return the tab's component values; the wiring is at the bottom of `build`.
Click-through: a click on a bar of the batch or histogram charts (read by CLICK_JS from the segment's
description), on a migration cell or on a ledger row opens the prompts behind it in the drill-down.
"""
from __future__ import annotations

import io
import json
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402
from gradio.components.plot import AltairPlotData  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402

from bapo_vl.app import data, views  # noqa: E402
from bapo_vl.reader import Run  # noqa: E402
from bapo_vl.problem import Verdict  # noqa: E402
from bapo_vl.record import DB_NAME, FRESH, SUBSETS, X2, RecordVersionError  # noqa: E402

POLL_SECONDS = 3.0
FIND_SECONDS = 5.0  # how often the served folders are looked at for new runs
LEDGER_ROWS = 200  # rows of the ledger table shown (the counts and curve cover all)
SEARCH_RESULTS = 50
DRILL_RESULTS = 200  # prompts listed by a click-through
SAMPLE_COLUMNS = ["step", "subset", "idx", "verdict", "reward", "response"]  # a prompt's sampled responses
RESPONSE_COLUMNS = ["uid", "subset", "verdict", "reward", "response"]  # the responses sampled at a step
RESPONSE_ROWS = 500  # rows of the responses table (the note counts all that match)
PLOT_HEIGHT = 260
SPEC_HEIGHT = 190  # the plot area of the hand-written Vega-Lite charts (their PLOT_HEIGHT less title and legend)
LOGIN_FAILURES, LOGIN_WINDOW_S = 5, 300  # at most this many wrong passwords per client per window

# choice labels: the code branches on these very constants
TAB_OVERVIEW, TAB_HEALTH, TAB_BATCH, TAB_LEDGER, TAB_BINS, TAB_PROMPT, TAB_RESPONSES, TAB_COMPARE = (
    "overview", "health", "batch", "ledger", "bins", "prompt", "responses", "compare")
TAB_TITLES = {TAB_OVERVIEW: "Overview", TAB_HEALTH: "Training health", TAB_BATCH: "Batch composition",
              TAB_LEDGER: "Hard-problem ledger", TAB_BINS: "Accuracy bins & migration",
              TAB_PROMPT: "Prompt drill-down", TAB_RESPONSES: "Responses at a step", TAB_COMPARE: "Compare runs"}
MODE_AT = "generated at exactly step A and step B"
MODE_WINDOW = "latest result up to step A → latest result in (A, B]"
BIN_MODES = (MODE_WINDOW, MODE_AT)
MIGRATION_TERMS = (
    "A prompt's bin is its group's correct / G. *Latest result up to step A → latest result in (A, B]*: every "
    "prompt seen by step A and generated for again after it, in the row of its last result up to A and the column "
    "of its last result after A (right of the diagonal: it did better). *Generated at exactly step A and step B*: "
    "only the prompts generated for at both steps.")
# charts whose bars open their prompts when clicked (their segments carry a key in their description)
DRILL_CHARTS = ("batch-composition", "batch-bins", "bins-hist-a", "bins-hist-b")
VERDICTS = tuple(v.value for v in Verdict)
CSS = """
.gradio-container {max-width: 1400px !important}
.summary p {margin: 2px 0}
.drill-hidden {display: none !important}
#prompt-text pre {white-space: pre-wrap; padding: 8px; border: 1px solid var(--border-color-primary);
                  border-radius: 4px; max-height: 360px; overflow: auto}
"""
# a click on a bar of a DRILL_CHARTS chart: its key ("chart|description") goes through the hidden button's event
CLICK_JS = """
() => {
  const charts = %s;
  document.addEventListener('click', (e) => {
    const mark = e.target.closest ? e.target.closest('[aria-label]') : null;
    const chart = e.target.closest ? e.target.closest(charts.map(c => '#' + c).join(',')) : null;
    if (!mark || !chart || !chart.contains(mark) || mark.getAttribute('role') !== 'graphics-symbol') return;
    window.__bapoDrill = chart.id + '|' + mark.getAttribute('aria-label');
    document.querySelector('#drill-go').click();
  }, true);
}
""" % json.dumps(list(DRILL_CHARTS))


STATE_KEY = "chart_key"  # a chart's name for its zoom and legend state (the `owner` given to `vega`, and its title)
# Gradio draws each new value of a chart (a poll of a live run, a tab shown again, another smoothing) in a new Vega
# view, which would forget the reader's zoom, pan and legend choice. This keeps them: when a view is finalized, its
# interaction state (the x-zoom selection and the legend selection) is saved under its element id and STATE_KEY,
# and the next view of the same chart starts from it. Vega keeps no global list of its views; a view is found as
# it is built (the one object that sets `_renderType` on itself), before Gradio initializes it.
VIEW_STATE_JS = """
<script>
(() => {
  const saved = new Map();
  const kept = {signals: (name) => /^zoom_/.test(name) && !/^zoom_(tuple|modify|translate|zoom)/.test(name),
                data: (name) => name === 'zoom_store' || name === 'legend_store', recurse: false};
  const keyOf = (view) => {
    const chart = view._el && view._el.closest && view._el.closest('[id]');
    try { return chart ? chart.id + '|' + view.signal('%s') : null; } catch (e) { return null; }
  };
  function keepState(view) {
    const initialize = view.initialize, finalize = view.finalize;
    view.initialize = function (...args) {
      const out = initialize.apply(this, args);
      const key = keyOf(this);
      if (key && saved.has(key)) {
        try { this.setState(saved.get(key)); } catch (e) { saved.delete(key); }
      }
      return out;
    };
    view.finalize = function (...args) {
      const key = keyOf(this);
      if (key) {
        try { saved.set(key, this.getState(kept)); } catch (e) { saved.delete(key); }
      }
      return finalize.apply(this, args);
    };
  }
  Object.defineProperty(Object.prototype, '_renderType', {
    configurable: true,
    set(value) {
      Object.defineProperty(this, '_renderType', {value, writable: true, configurable: true, enumerable: true});
      if (typeof this.getState === 'function' && typeof this.initialize === 'function') keepState(this);
    },
  });
})();
</script>
""" % STATE_KEY


def _run(runs: dict[str, Run], label: str) -> Run:
    if label not in runs:  # the browser can only name runs given on the command line
        raise gr.Error(f"unknown run {label!r}")
    return runs[label]


def vega(spec: dict, owner: str = "") -> AltairPlotData:
    """A Vega-Lite chart (app/views.py builds them) for gr.Plot, drawn by the vega-embed that Gradio's native
    plots use, and themed and sized like them; no altair needed. Why not gr.LinePlot/BarPlot: they stack bars in
    label order and cannot draw a line over bars, and their values are tables that the browser deep-copies on
    every event (each poll), which stalls a page of 500-step plots; a chart's value here is one JSON string.
    chart="scatter" only restyles a top-level color encoding, which the specs leave to their layers. Each call's
    chart differs (a stamp in usermeta), so a tab shown again redraws at its width (hidden, a chart shrinks to 0).
    `owner` (the run, or the prompt, it shows) and the title name the chart's zoom and legend state, which
    VIEW_STATE_JS carries from one drawing of it to the next."""
    spec = {**spec, "usermeta": {**spec.get("usermeta", {}), "drawn": time.time_ns()},
            "params": [*spec.get("params", []), {"name": STATE_KEY, "value": f"{owner}|{spec.get('title', '')}"}]}
    return AltairPlotData(plot=json.dumps(spec), chart="scatter")


UNREADABLE = (sqlite3.DatabaseError, RecordVersionError, OSError, ValueError)


def unreadable(run: Run, e: Exception) -> str:
    """One line saying why `run`'s record cannot be read (record.UnreadableRecordError, RecordVersionError, ...),
    without the server's paths."""
    text = str(e).replace(str(run.path / DB_NAME), "run.db").replace(str(run.path), run.label)
    if "no such table" in text:  # an empty file (a trainer that has just created it) or a foreign SQLite file
        text = "run.db holds no run record (yet): it is empty or was not written by bapo-vl"
    elif not text.startswith("run.db"):
        text = f"run.db cannot be read ({type(e).__name__}: {text})"
    return f"{run.label}: {text}"


def blank(component, message: str):
    """What `component` shows while its run cannot be read: the message in text, nothing in plots and tables."""
    if isinstance(component, (gr.Markdown, gr.HTML)):
        return f"<span class='unreadable'>{message}</span>"
    if isinstance(component, gr.Plot):
        return None
    if isinstance(component, gr.Dataframe):
        return pd.DataFrame()
    if isinstance(component, gr.Dropdown):
        return gr.Dropdown(choices=[], value=None)
    if isinstance(component, gr.Image):
        return gr.Image(value=None, visible=False)
    return gr.skip()


# ----------------------------------------------------------------------------- tab renderers (pure of Gradio events)


def render_overview(run: Run, weight: float) -> list:
    steps, evals = run.steps(), run.evals()
    return [views.overview_text(run.label, {**run.meta(), "status": run.status()}, run.config(), steps, evals),
            vega(views.line_spec(views.reward_frame(steps, evals, weight), "step", "reward", "series",
                                 "Reward (train and eval)", SPEC_HEIGHT), run.label),
            vega(views.line_spec(views.rollouts_frame(steps), "step", "rollouts", "kind",
                                 "Rollouts generated (cumulative)", SPEC_HEIGHT, zero=True), run.label),
            vega(views.time_spec(steps, SPEC_HEIGHT))]


def measured_metrics(run: Run) -> pd.DataFrame:
    """The run's per-step metrics, what was not measured missing (views.measured)."""
    return views.measured(run.metrics(), run.config())


def render_health(run: Run, weight: float, other: str | None) -> list:
    metrics, steps = measured_metrics(run), run.steps()
    verdicts = run.verdicts()
    eta = views.eta(steps, run.config().get("steps"), run.status())
    text = " · ".join(t for t in (eta or f"status {run.status()}: no ETA", views.verdict_text(verdicts)) if t)
    charts = [vega(views.line_spec(views.smoothed(df, "value", "series", weight), "step", "value", "series", title,
                                   SPEC_HEIGHT, y_title=y_title), run.label)
              for title, y_title, df in views.health_frames(metrics, run.config())]
    return [text, *charts, vega(views.verdict_spec(verdicts, SPEC_HEIGHT)), *render_other(run, weight, other)]


def render_other(run: Run, weight: float, other: str | None) -> list:
    """The Training-health picker of every other recorded metric, and its chart."""
    metrics = measured_metrics(run)
    choices = views.other_metrics(metrics)
    other = other if other in choices else (choices[0] if choices else None)
    df = views.long(metrics, "step", {other: other} if other else {}, "value", "series")
    return [gr.Dropdown(choices=choices, value=other),
            vega(views.line_spec(views.smoothed(df, "value", "series", weight), "step", "value", "series",
                                 other or "no other metric recorded", SPEC_HEIGHT, y_title=other or "value"),
                 run.label)]


def render_batch(run: Run) -> list:
    steps = run.steps()
    G = run.group_size()
    return [views.batch_text(steps), vega(views.composition_spec(steps, SPEC_HEIGHT)),
            vega(views.fresh_bins_spec(steps, G, SPEC_HEIGHT)),
            vega(views.line_spec(views.buffers_frame(steps), "step", "groups", "buffer", "Buffer sizes", SPEC_HEIGHT,
                                 zero=True), run.label),
            vega(views.line_spec(views.thresholds_frame(steps), "step", "value", "threshold",
                                 "Thresholds c1, c2, c3 and r_tot", SPEC_HEIGHT, y_title="μ (share of G correct)",
                                 y_domain=(0, 1)), run.label)]


def render_ledger(run: Run, which: str) -> list:
    ledger, steps = run.ledger_retries(), run.steps()
    G = run.group_size()
    table, total = views.ledger_table(ledger, which, LEDGER_ROWS)
    table["text"] = table["uid"].map(data.texts(run, list(table["uid"]))).fillna("")
    note = f"{total} prompt(s) {which}" + (f"; the {LEDGER_ROWS} most recent shown" if total > LEDGER_ROWS else "")
    curve = views.line_spec(views.ledger_curve(ledger, steps["step"]), "step", "prompts", "series",
                            "Hard prompts over steps", SPEC_HEIGHT, zero=True)
    return [views.ledger_text(ledger, G) + "\n\n" + views.hard_set_text(run.evals()), vega(curve, run.label), table,
            note]


def _step_range(steps: pd.DataFrame) -> tuple[int, int]:
    if steps.empty:
        return 0, 1
    lo, hi = int(steps["step"].min()), int(steps["step"].max())
    return lo, max(hi, lo + 1)


def bin_steps(run: Run, step_a, step_b) -> tuple[int, int, bool, bool]:
    """(A, B, A was valid, B was valid): the steps the bins tab compares. Unset or out of range, they default to
    the pair of steps that share the most prompts (a prompt generated at A and next at B, e.g. a re-evaluation
    step and the step its prompts came from), else the middle and the last step."""
    lo, hi = _step_range(run.steps())
    valid_a, valid_b = bool(step_a) and lo <= step_a <= hi, bool(step_b) and lo <= step_b <= hi
    pair = None if valid_a and valid_b else run.regenerated_pair()
    a0, b0 = pair[:2] if pair else ((lo + hi) // 2, hi)
    return (int(step_a) if valid_a else a0), (int(step_b) if valid_b else b0), valid_a, valid_b


def bins_of(run: Run, mode: str, a: int, b: int):
    """Per uid code: (bin at A, bin at B, row bin, column bin) as Run.migration draws them (-1: not there)."""
    gen, G = run.generated(), run.group_size()
    if mode == MODE_WINDOW:
        ba, bb = gen.bins(None, a, G), gen.bins(None, b, G)
        return ba, bb, ba, gen.bins(a, b, G)
    ba, bb = gen.bins(a - 1, a, G), gen.bins(b - 1, b, G)
    return ba, bb, ba, bb


def render_bins(run: Run, mode: str, step_a, step_b, cells: str) -> list:
    G = run.group_size()
    lo, hi = _step_range(run.steps())
    a, b, valid_a, valid_b = bin_steps(run, step_a, step_b)
    hist_a, hist_b, m = run.migration(a, b, window=mode == MODE_WINDOW)
    if mode == MODE_AT:
        what_a, what_b = f"prompts generated for at step {a}", f"prompts generated for at step {b}"
        rows = f"generated for at both step {a} and step {b}"
    else:
        what_a, what_b = f"latest result of each prompt seen up to step {a}", f"… up to step {b}"
        rows = f"seen up to step {a} and generated for again in ({a}, {b}]"
    total = sum(map(sum, m)) if m else 0
    up = sum(m[i][j] for i in range(len(m)) for j in range(len(m)) if j > i) if m else 0
    down = sum(m[i][j] for i in range(len(m)) for j in range(len(m)) if j < i) if m else 0
    text = (f"Histogram A: {what_a} ({sum(hist_a)}) · histogram B: {what_b} ({sum(hist_b)})\n\n"
            f"Migration matrix (rows: bin at A, columns: bin at B): <b id='matrix-total'>{total}</b> prompts {rows}; "
            f"{up} moved up, {down} moved down, {total - up - down} stayed. Click a bar or a cell to open its prompts.")
    if not total and run.regenerated_pair() is None:
        text += " <b id='matrix-none'>No prompt of this run was generated for at two steps: no matrix to show.</b>"
    ha, hb = views.histogram_frame(hist_a, G), views.histogram_frame(hist_b, G)
    # a slider's value is sent back only when it was defaulted: never undo what the user is moving meanwhile
    return [gr.Slider(minimum=lo, maximum=hi, **({} if valid_a else {"value": a})),
            gr.Slider(minimum=lo, maximum=hi, **({} if valid_b else {"value": b})), text,
            vega(views.bar_spec(ha.assign(key=[f"bin{i}" for i in range(G + 1)]), "bin", "prompts", f"A: step {a}",
                                SPEC_HEIGHT)),
            vega(views.bar_spec(hb.assign(key=[f"bin{i}" for i in range(G + 1)]), "bin", "prompts", f"B: step {b}",
                                SPEC_HEIGHT)),
            views.matrix_style(views.matrix_frame(m, G, cells))]


def default_prompt(run: Run) -> str | None:
    """What the drill-down opens on: the latest sampled prompt that was promoted into X2 (it failed once and is
    now partly solved), else the latest sampled prompt. Cheap: it reads only the last steps' samples."""
    return data.last_sampled(run, subset=X2) or data.last_sampled(run)


def _choices(run: Run, uids: list[str]) -> list[tuple[str, str]]:
    text = data.texts(run, uids, 70)
    return [(f"{u} — {text[u]}" if text.get(u) else u, u) for u in uids]


def render_prompt(run: Run, uid: str | None, query: str = "", listed: dict | None = None) -> list:
    """The drill-down: `uid` if given; else the first prompt matching `query` (none: it says so); else the
    default prompt. `listed` ({"what", "uids", "n"}, from a click-through) fills the picker instead of the search."""
    query = (query or "").strip()
    note = ""
    if listed:
        uids = listed["uids"]
        uid = uid if uid in uids else (uids[0] if uids else None)
        choices, note = _choices(run, uids), views.list_text(listed["what"], listed["n"], len(uids))
        if not uids:
            return [gr.Dropdown(choices=[], value=None), note, gr.Image(value=None, visible=False),
                    history_plot(pd.DataFrame(columns=["step", "subset", "correct", "G"])),
                    views.history_table(pd.DataFrame()), pd.DataFrame(columns=SAMPLE_COLUMNS)]
    else:
        hits = data.search_prompts(run, query, SEARCH_RESULTS)
        if not uid and query:
            if not hits:  # say so: never show another prompt as if it matched
                empty = pd.DataFrame(columns=["step", "subset", "correct", "G"])
                return [gr.Dropdown(choices=[], value=None), views.no_match_text(query),
                        gr.Image(value=None, visible=False), history_plot(empty), views.history_table(empty),
                        pd.DataFrame(columns=SAMPLE_COLUMNS)]
            uid = hits[0][0]
        uid = uid or default_prompt(run)
        choices = ([(uid, uid)] if uid else []) + [(f"{u} — {t[:70]}", u) for u, t in hits if u != uid]
    picker = gr.Dropdown(choices=choices, value=uid)
    if not uid:
        empty = pd.DataFrame(columns=["step", "subset", "correct", "G"])
        return [picker, "no prompt recorded yet", gr.Image(value=None, visible=False), history_plot(empty),
                views.history_table(empty), pd.DataFrame(columns=SAMPLE_COLUMNS)]
    d = data.prompt_detail(run, uid)
    if not d["found"] and not listed and (fallback := default_prompt(run)):  # e.g. a uid picked in another run
        uid, d = fallback, data.prompt_detail(run, fallback)
        picker = gr.Dropdown(choices=[(uid, uid), *choices], value=uid)
    image = None
    if d["image"]:
        from PIL import Image

        image = Image.open(io.BytesIO(d["image"]))
    return [picker, note + views.prompt_text(d), gr.Image(value=image, visible=image is not None),
            history_plot(d["history"]), views.history_table(d["history"]), d["samples"]]


def render_responses(run: Run, step, verdicts, subsets, query: str) -> list:
    """Every response sampled at a step, of the verdicts and subsets ticked, whose text contains `query`. An unset
    step, or one without samples, shows the nearest sampled step before it (else the last)."""
    steps = data.sampled_steps(run)
    if not steps:
        return [gr.Slider(), "<span id='responses-none'>no responses were sampled in this run</span>",
                pd.DataFrame(columns=RESPONSE_COLUMNS)]
    wanted = int(step) if step else None
    shown = max([s for s in steps if wanted is not None and s <= wanted] or [steps[-1]])
    rows, n, total = data.responses_at(run, shown, verdicts, subsets, query, RESPONSE_ROWS)
    table = pd.DataFrame({"uid": rows["uid"], "subset": rows["subset"].map(lambda v: views.SUBSET_LABELS.get(v, v)),
                          "verdict": rows["verdict"], "reward": rows["reward"], "response": rows["response"]},
                         columns=RESPONSE_COLUMNS)
    note = views.responses_text(shown, wanted, n, total, len(table), len(steps), (query or "").strip())
    # the slider's value is sent back only when it was defaulted: never undo what the user is moving meanwhile
    return [gr.Slider(minimum=steps[0], maximum=max(steps[-1], steps[0] + 1),
                      **({} if wanted == shown else {"value": shown})), note, table]


def history_plot(history: pd.DataFrame) -> AltairPlotData:
    return vega(views.history_spec(history, SPEC_HEIGHT))


def compare_inputs(runs: dict[str, Run], labels) -> tuple[dict[str, dict], dict[str, str]]:
    """What Compare reads of each chosen run, and the runs that could not be read (label -> message)."""
    chosen, errors = {}, {}
    for lab in labels or []:
        r = _run(runs, lab)
        try:
            started = pd.Timestamp(r.meta()["created_at"]).timestamp() if r.meta().get("created_at") else None
            chosen[lab] = {"metrics": measured_metrics(r), "steps": r.steps(), "evals": r.evals(),
                           "ledger": r.ledger_retries(), "started": started, "config": r.config()}
        except UNREADABLE as e:
            errors[lab] = unreadable(r, e).split(": ", 1)[1]
    return chosen, errors


def render_compare(runs: dict[str, Run], labels: list[str], metric: str | None, x_axis: str, weight: float,
                   colors: dict[str, str], out_dir: Path, grouping: str = views.GROUP_NONE) -> list:
    """The chosen runs' `metric` against `x_axis` (EMA-smoothed, raw faint; grouped: each group's mean ± sd), their
    solved hard prompts, the runs table (config, what differs shaded), the summary table with notes, and the
    plotted data as CSV. An unreadable run is named in the notes; the others are still drawn."""
    chosen, errors = compare_inputs(runs, labels)
    choices = views.compare_metrics({k: v["metrics"] for k, v in chosen.items()},
                                    {k: v["evals"] for k, v in chosen.items()})
    metric = metric if metric in choices else choices[0]
    x_axis = x_axis if x_axis in views.X_AXES else views.X_STEP
    grouping = grouping if grouping in views.GROUPINGS else views.GROUP_NONE
    curves = views.smoothed(views.compare_frame(chosen, metric, x_axis), "value", "run", weight)
    solved = views.compare_frame(chosen, views.SOLVED_SHARE, x_axis)
    table = views.compare_table(chosen)
    note = views.compare_notes(table, errors) or ("choose runs to compare" if not labels else "")
    line_colors = colors
    if grouping != views.GROUP_NONE:
        groups = {lab: views.group_of(r["config"], grouping) for lab, r in chosen.items()}
        curves, apart = views.grouped_frame(curves.drop(columns=["raw"], errors="ignore"), groups)
        solved, _ = views.grouped_frame(solved, groups)
        line_colors = {g: views.RUN_COLORS[i % len(views.RUN_COLORS)]
                       for i, g in enumerate(dict.fromkeys(curves["run"]))}
        note = "<br>".join(n for n in (views.group_text(grouping, x_axis, apart), note) if n)
    csv = out_dir / "compare.csv"
    cols = {"x": x_axis, "value": metric, **({"raw": f"{metric} (raw)"} if "raw" in curves else {}),
            **({"lo": f"{metric} mean - sd", "hi": f"{metric} mean + sd"} if "lo" in curves else {}),
            "run": "run" if grouping == views.GROUP_NONE else "group"}
    table_out = curves[list(cols)].rename(columns=cols)
    if x_axis != views.X_WALL:  # steps and rollouts are counts: 12, not 12.0
        table_out[x_axis] = table_out[x_axis].round().astype("int64")
    table_out.to_csv(csv, index=False)
    integer_x = x_axis == views.X_STEP
    config_table = views.runs_table({lab: r["config"] for lab, r in chosen.items()})
    return [gr.Dropdown(choices=choices, value=metric),
            vega(views.line_spec(curves, "x", "value", "run", f"{metric} vs {x_axis}", SPEC_HEIGHT, x_title=x_axis,
                                 y_title=metric, integer_x=integer_x, colors=line_colors), f"{x_axis}|{grouping}"),
            vega(views.line_spec(solved, "x", "value", "run",
                                 "Hard prompts (0/G at first) generated again: % that reached ≥ 1/G", SPEC_HEIGHT,
                                 x_title=x_axis, y_title="solved % of retried", zero=True, integer_x=integer_x,
                                 colors=line_colors), f"{x_axis}|{grouping}"),
            note, views.runs_style(config_table), table, gr.DownloadButton(value=str(csv), visible=not curves.empty)]


# ----------------------------------------------------------------------------- click-through


def drill(run: Run, key: str, mode: str, step_a, step_b) -> dict:
    """The prompts behind a clicked aggregate: key "chart|name@first-last" for a bar of the batch charts (a
    subset, or bin<i> of the fresh groups, over steps first..last), "bins-hist-a|bin<i>" or "...-b|bin<i>" for a
    histogram bar of the bins tab, "bins-matrix|<i>,<j>" for a migration cell. -> {"what", "uids", "n"}."""
    chart, _, name = key.partition("|")
    G = run.group_size()
    labels = views.bin_labels(G)
    if chart in ("batch-composition", "batch-bins"):
        name, _, span = name.partition("@")
        first, _, last = span.partition("-")
        first, last = int(first), int(last or first)
        at = f"step {first}" if first == last else f"steps {first}–{last}"
        if chart == "batch-composition":
            uids = data.prompts_at(run, [name], first, last)
            what = f"{views.SUBSET_LABELS.get(name, name)} at {at}"
        else:
            i = int(name.removeprefix("bin"))
            uids = data.prompts_at(run, list(FRESH), first, last, bin_=i, G=G)
            what = f"fresh groups at {labels[i]} at {at}"
    else:
        a, b, _, _ = bin_steps(run, step_a, step_b)
        ba, bb, rows, cols = bins_of(run, mode, a, b)
        gen = run.generated()
        if chart == "bins-matrix":
            i, j = (int(v) for v in name.split(","))
            uids = gen.uids_in_bins(rows, cols, i, j)
            what = f"migration cell {labels[i]} at A (step {a}) → {labels[j]} at B (step {b})"
        else:
            i = int(name.removeprefix("bin"))
            uids = gen.uids_in_bins(ba if chart.endswith("-a") else bb, None, i, None)
            what = f"prompts at {labels[i]} in histogram {'A' if chart.endswith('-a') else 'B'} (step " \
                   f"{a if chart.endswith('-a') else b})"
    return {"what": what, "uids": sorted(uids)[:DRILL_RESULTS], "n": len(uids)}


# ----------------------------------------------------------------------------- the login limit


class LoginLimit:
    """ASGI middleware: a client (by address) that sent LOGIN_FAILURES wrong passwords within LOGIN_WINDOW_S is
    refused (429, saying for how long) until the oldest of them is older than that. Gradio's /login has no limit."""

    def __init__(self, app, failures: int = LOGIN_FAILURES, window: float = LOGIN_WINDOW_S):
        self.app, self.failures, self.window = app, failures, window
        self.seen: dict[str, list[float]] = {}
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != "/login":
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("?",))[0]
        now = time.monotonic()
        with self.lock:
            recent = [t for t in self.seen.get(client, []) if now - t < self.window]
            self.seen[client] = recent
        if len(recent) >= self.failures:
            wait = int(self.window - (now - recent[0])) + 1
            body = json.dumps({"detail": f"too many wrong passwords: try again in {wait} s"}).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", str(wait).encode())]})
            return await send({"type": "http.response.body", "body": body})

        async def watch(message):
            if message["type"] == "http.response.start" and message["status"] == 400:  # Gradio: wrong password
                with self.lock:
                    self.seen.setdefault(client, []).append(time.monotonic())
            await send(message)

        return await self.app(scope, receive, watch)


# ----------------------------------------------------------------------------- the page


# ----------------------------------------------------------------------------- layout: one function per tab
# Each is called inside its gr.Tab and returns its components; `outputs` lists, in order, what its renderer fills.


def overview_tab() -> SimpleNamespace:
    text = gr.Markdown(elem_id="overview-text", elem_classes="summary")
    with gr.Row():
        reward = gr.Plot(show_label=False, elem_id="overview-reward")
        rollouts = gr.Plot(show_label=False, elem_id="overview-rollouts")
    timing = gr.Plot(show_label=False, elem_id="overview-time")
    return SimpleNamespace(reward=reward, outputs=[text, reward, rollouts, timing])


def health_tab() -> SimpleNamespace:
    text = gr.Markdown(elem_id="health-text", elem_classes="summary")
    plots = []
    for i in range(0, len(views.HEALTH) + 1, 2):
        with gr.Row():
            plots += [gr.Plot(show_label=False, elem_id=f"health-{k}")
                      for k in range(i, min(i + 2, len(views.HEALTH) + 1))]
    with gr.Row():
        other = gr.Dropdown([], label="any other recorded metric", elem_id="health-other-pick", scale=1)
        other_plot = gr.Plot(show_label=False, elem_id="health-other", scale=3)
    return SimpleNamespace(plots=plots, other=other, other_plot=other_plot,
                           outputs=[text, *plots, other, other_plot])


def batch_tab() -> SimpleNamespace:
    text = gr.Markdown(elem_id="batch-text", elem_classes="summary")
    with gr.Row():
        composition = gr.Plot(show_label=False, elem_id="batch-composition")
        bins = gr.Plot(show_label=False, elem_id="batch-bins")
    with gr.Row():
        buffers = gr.Plot(show_label=False, elem_id="batch-buffers")
        thresholds = gr.Plot(show_label=False, elem_id="batch-thresholds")
    gr.Markdown(views.BATCH_TERMS, elem_id="batch-terms", elem_classes="summary")
    return SimpleNamespace(outputs=[text, composition, bins, buffers, thresholds])


def ledger_tab() -> SimpleNamespace:
    text = gr.Markdown(elem_id="ledger-text", elem_classes="summary")
    curve = gr.Plot(show_label=False, elem_id="ledger-curve")
    with gr.Row():
        which = gr.Radio(list(views.LEDGER_FILTERS), value=views.LEDGER_FILTERS[0], label="show",
                         elem_id="ledger-which", scale=3)
        note = gr.Markdown(elem_id="ledger-note")
    table = gr.Dataframe(interactive=False, max_height=320, elem_id="ledger-table",
                         label="hard prompts (click a row to open it in the drill-down)")
    return SimpleNamespace(which=which, table=table, outputs=[text, curve, table, note])


def bins_tab() -> SimpleNamespace:
    with gr.Row():
        mode = gr.Radio(list(BIN_MODES), value=BIN_MODES[0], label="prompts compared", scale=2, elem_id="bins-mode")
        step_a = gr.Slider(0, 1, value=0, step=1, label="step A", elem_id="step-a")
        step_b = gr.Slider(0, 1, value=0, step=1, label="step B", elem_id="step-b")
        cells = gr.Radio(list(views.CELLS), value=views.CELLS[0], label="matrix cells", elem_id="bins-cells", scale=1)
    gr.Markdown(MIGRATION_TERMS, elem_id="bins-terms", elem_classes="summary")
    text = gr.Markdown(elem_id="bins-text", elem_classes="summary")
    with gr.Row():
        hist_a = gr.Plot(show_label=False, elem_id="bins-hist-a")
        hist_b = gr.Plot(show_label=False, elem_id="bins-hist-b")
    matrix = gr.Dataframe(interactive=False, label="migration matrix (rows: bin at A, columns: bin at B; "
                                                   "click a cell to open its prompts)", elem_id="bins-matrix")
    return SimpleNamespace(mode=mode, step_a=step_a, step_b=step_b, cells=cells, matrix=matrix,
                           outputs=[step_a, step_b, text, hist_a, hist_b, matrix])


def prompt_tab() -> SimpleNamespace:
    with gr.Row():
        query = gr.Textbox(label="search by uid or text", scale=2, elem_id="prompt-query")
        # custom values allowed: a clicked row's uid may reach the server before the choices that list it (a live
        # refresh in flight sends older ones), and Gradio would refuse the event; render_prompt takes any uid
        found = gr.Dropdown([], label="prompt", scale=3, elem_id="prompt-pick", allow_custom_value=True)
    with gr.Row():
        with gr.Column(scale=3):
            text = gr.HTML(elem_id="prompt-text")
        # png: Gradio's default webp is lossy, and a diagram's thin lines and small digits are what is inspected
        image = gr.Image(visible=False, type="pil", format="png", label="image", scale=1, elem_id="prompt-image",
                         interactive=False, height=200)
    with gr.Row():
        history = gr.Plot(show_label=False, elem_id="prompt-history", scale=2)
        rows = gr.Dataframe(interactive=False, max_height=PLOT_HEIGHT, label="subset per step", elem_id="prompt-rows",
                            scale=1)
    samples = gr.Dataframe(interactive=False, max_height=360, wrap=True, label="sampled responses",
                           elem_id="prompt-samples")
    return SimpleNamespace(query=query, found=found, outputs=[found, text, image, history, rows, samples])


def responses_tab() -> SimpleNamespace:
    with gr.Row():
        step = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="responses-step", scale=2)
        verdicts = gr.CheckboxGroup(VERDICTS, value=list(VERDICTS), label="verdict", elem_id="responses-verdict",
                                    scale=2)
        subsets = gr.CheckboxGroup([(views.SUBSET_LABELS[s], s) for s in SUBSETS], value=list(SUBSETS),
                                   label="subset", elem_id="responses-subset", scale=3)
    query = gr.Textbox(label="search the responses' text", elem_id="responses-query")
    note = gr.Markdown(elem_id="responses-note", elem_classes="summary")
    table = gr.Dataframe(interactive=False, max_height=560, wrap=True, elem_id="responses-table",
                         label="sampled responses (click a row to open its prompt in the drill-down)")
    return SimpleNamespace(step=step, verdicts=verdicts, subsets=subsets, query=query, table=table,
                           outputs=[step, note, table])


def compare_tab(labels: list[str]) -> SimpleNamespace:
    with gr.Row():
        runs = gr.CheckboxGroup(labels, value=labels, label="runs", scale=3, elem_id="compare-runs")
        metric = gr.Dropdown([views.FRESH_REWARD], value=None, label="metric", elem_id="compare-metric",
                             allow_custom_value=False, scale=2)
        x_axis = gr.Radio(list(views.X_AXES), value=views.X_AXES[0], label="x-axis", elem_id="compare-x", scale=2)
        group = gr.Radio(list(views.GROUPINGS), value=views.GROUP_NONE, label="group runs by (mean ± sd)",
                         elem_id="compare-group", scale=2)
        csv = gr.DownloadButton("CSV of the plotted data", elem_id="compare-csv", scale=1, visible=False)
    note = gr.Markdown(elem_id="compare-note")
    plot = gr.Plot(show_label=False, elem_id="compare-plot")
    solved = gr.Plot(show_label=False, elem_id="compare-solved")
    configs = gr.Dataframe(interactive=False, label="runs (shaded: settings that differ between them)",
                           elem_id="compare-configs")
    table = gr.Dataframe(interactive=False, label="summary", elem_id="compare-table")
    return SimpleNamespace(runs=runs, metric=metric, x_axis=x_axis, group=group, plot=plot, csv=csv,
                           outputs=[metric, plot, solved, note, configs, table, csv])


TAB_LAYOUTS = {TAB_OVERVIEW: overview_tab, TAB_HEALTH: health_tab, TAB_BATCH: batch_tab, TAB_LEDGER: ledger_tab,
               TAB_BINS: bins_tab, TAB_PROMPT: prompt_tab, TAB_RESPONSES: responses_tab, TAB_COMPARE: compare_tab}


# ----------------------------------------------------------------------------- the whole page and its wiring


def build(runs: list[Run] | data.RunSet, poll_seconds: float = POLL_SECONDS) -> gr.Blocks:
    """The dashboard over `runs` (from the command line, never chosen by the browser): the header, the tabs (their
    layout functions above) and the events between them. A RunSet's folders are looked at again every
    FIND_SECONDS: a run started under one appears in the pickers (and is ticked in Compare)."""
    run_set = runs if isinstance(runs, data.RunSet) else None
    by_label = run_set.runs if run_set else {r.label: r for r in runs}  # a RunSet's dict: it grows as runs appear
    if not by_label:
        raise ValueError("the dashboard needs at least one run directory")
    labels = list(by_label)
    colors = {lab: views.RUN_COLORS[i % len(views.RUN_COLORS)] for i, lab in enumerate(labels)}
    out_dir = Path(tempfile.mkdtemp(prefix="bapo-dashboard-"))  # the Compare CSV (Gradio serves it from its cache)

    with gr.Blocks(title="bapo dashboard") as demo:
        with gr.Row(equal_height=True):
            run_dd = gr.Dropdown(labels, value=labels[0], label="run", scale=3, elem_id="run")
            weight = gr.Slider(0, 0.99, value=0, step=0.01, label="smoothing (EMA weight; raw lines stay faint)",
                               scale=2, elem_id="smooth")
            live = gr.Markdown("", elem_id="live", elem_classes="summary")
        active = gr.State(TAB_OVERVIEW)
        shown = gr.State(None)  # version key of what the active tab shows
        listed = gr.State(None)  # the prompts a click-through listed in the drill-down
        timer = gr.Timer(poll_seconds)
        finder = gr.Timer(max(FIND_SECONDS, poll_seconds), active=run_set is not None)
        known = gr.State(labels)  # the runs this page's pickers offer
        drill_key = gr.Textbox(elem_id="drill-key", elem_classes="drill-hidden", container=False)
        drill_go = gr.Button("open", elem_id="drill-go", elem_classes="drill-hidden")
        tab_blocks, ui = {}, {}
        with gr.Tabs(elem_id="tabs") as tabs:
            for tab, layout in TAB_LAYOUTS.items():
                with gr.Tab(TAB_TITLES[tab], id=tab, elem_id=f"tab-{tab}") as tab_blocks[tab]:
                    ui[tab] = layout(labels) if tab == TAB_COMPARE else layout()
        ov, health, ledger, bins, prompt, responses, compare = (
            ui[t] for t in (TAB_OVERVIEW, TAB_HEALTH, TAB_LEDGER, TAB_BINS, TAB_PROMPT, TAB_RESPONSES, TAB_COMPARE))

        # ------------------------------------------------------------------------- wiring
        outputs = {tab: ui[tab].outputs for tab in TAB_LAYOUTS}
        controls = {"run": run_dd, "weight": weight, "which": ledger.which, "mode": bins.mode, "a": bins.step_a,
                    "b": bins.step_b, "cells": bins.cells, "uid": prompt.found, "query": prompt.query, "listed": listed,
                    "r_step": responses.step, "r_verdicts": responses.verdicts, "r_subsets": responses.subsets,
                    "r_query": responses.query, "compare": compare.runs, "metric": compare.metric,
                    "x": compare.x_axis, "group": compare.group, "other": health.other}
        names, inputs = list(controls), list(controls.values())
        # one token per tab: setting it re-renders that tab. The timer's event outputs only these States, so an
        # idle tick costs the browser nothing (an event's outputs are redrawn whenever it completes), and a
        # re-render updates only the components of the tab in view.
        tokens = {tab: gr.State(0) for tab in outputs}

        def version(tab, c):
            """What the tab shows depends on: a run's version, or why it cannot be read."""
            runs = [_run(by_label, lab) for lab in c["compare"] or []] if tab == TAB_COMPARE else [_run(by_label, c["run"])]
            key = [tab, c["run"]]
            for r in runs:
                try:
                    key.append((r.label, r.version()))
                except UNREADABLE as e:
                    key.append((r.label, unreadable(r, e)))
            return key

        renderers = {  # tab -> its renderer, given the run shown and the controls' values
            TAB_OVERVIEW: lambda run, c: render_overview(run, float(c["weight"] or 0)),
            TAB_HEALTH: lambda run, c: render_health(run, float(c["weight"] or 0), c["other"]),
            TAB_BATCH: lambda run, c: render_batch(run),
            TAB_LEDGER: lambda run, c: render_ledger(run, c["which"]),
            TAB_BINS: lambda run, c: render_bins(run, c["mode"], c["a"], c["b"], c["cells"]),
            TAB_PROMPT: lambda run, c: render_prompt(run, c["uid"], c["query"], c["listed"]),
            TAB_RESPONSES: lambda run, c: render_responses(run, c["r_step"], c["r_verdicts"], c["r_subsets"],
                                                           c["r_query"]),
            TAB_COMPARE: lambda run, c: render_compare(by_label, c["compare"], c["metric"], c["x"],
                                                       float(c["weight"] or 0), colors, out_dir, c["group"]),
        }

        def render(tab, c: dict) -> dict:
            key = version(tab, c)  # before reading: a step committed meanwhile makes the next poll re-render
            run = _run(by_label, c["run"])
            try:  # an unreadable record is said once, in place: the poll re-renders only when the reason changes
                values = renderers[tab](run, c)
            except UNREADABLE as e:
                values = [blank(comp, unreadable(run, e)) for comp in outputs[tab]]
            try:  # the header is the picked run's (Compare, which names its own unreadable runs, is not blanked)
                steps = run.steps()
                stamp = (f"<span id='live-step'>{run.label} · step "
                         f"{int(steps['step'].max()) if not steps.empty else '–'}</span> · {run.status()} · "
                         f"read {time.strftime('%H:%M:%S')} · polled every {poll_seconds:g} s")
            except UNREADABLE as e:
                stamp = f"<span id='live-error'>{unreadable(run, e)}</span>"
            return {**dict(zip(outputs[tab], values)), live: stamp, shown: key}

        def renderer(tab):
            return lambda *args: render(tab, dict(zip(names, args)))

        def opener(tab):  # a tab was opened: it is the active one now, drawn at once
            return lambda *args: {active: tab, **render(tab, dict(zip(names, args)))}

        def bump(tab):  # a new token value: its change event re-renders the tab
            return {tokens[tab]: time.monotonic_ns()}

        def poll(tab, seen, run_label, compare_labels):  # the timer: re-render the tab in view if its records changed
            if seen is not None and version(tab, {"run": run_label, "compare": compare_labels}) == seen:
                return {tokens[tab]: gr.skip()}
            return bump(tab)

        def search(*args):  # a new search: the first match (or "no match"), and the click-through list is gone
            c = dict(zip(names, args))
            return {listed: None, **render(TAB_PROMPT, {**c, "uid": None, "listed": None})}

        def open_prompts(c: dict, what: dict) -> dict:  # the search box is emptied: the list replaces its result
            c = {**c, "uid": None, "query": "", "listed": what}
            return {listed: what, prompt.query: "", tabs: gr.Tabs(selected=TAB_PROMPT), active: TAB_PROMPT,
                    **render(TAB_PROMPT, c)}

        def pick_row(table, evt: gr.SelectData):  # a row of the ledger or the responses table: open its prompt
            uid = str(table.iloc[evt.index[0]]["uid"])
            return {prompt.query: uid, listed: None, prompt.found: gr.Dropdown(choices=[(uid, uid)], value=uid),
                    tabs: gr.Tabs(selected=TAB_PROMPT), active: TAB_PROMPT, **bump(TAB_PROMPT)}

        def pick_cell(evt: gr.SelectData, *args):  # Gradio passes the event where the signature names it
            c = dict(zip(names, args))
            i, j = evt.index
            if j == 0:  # the row's label
                return {}
            run = _run(by_label, c["run"])
            return open_prompts(c, drill(run, f"bins-matrix|{i},{j - 1}", c["mode"], c["a"], c["b"]))

        def pick_bar(key, *args):
            c = dict(zip(names, args))
            if not key or key.partition("|")[0] not in DRILL_CHARTS:
                return {}
            run = _run(by_label, c["run"])
            return open_prompts(c, drill(run, key, c["mode"], c["a"], c["b"]))

        for tab, block in tab_blocks.items():
            outs = [*outputs[tab], live, shown]
            # the drill-down's events run one at a time, in order: a search typed while the tab is still being
            # opened is answered after the opening, never overwritten by it
            one = {"concurrency_id": "prompt", "concurrency_limit": 1} if tab == TAB_PROMPT else {}
            block.select(opener(tab), inputs, [*outs, active], show_progress="hidden", **one)
            tokens[tab].change(renderer(tab), inputs, outs, show_progress="hidden", trigger_mode="always_last", **one)
        demo.load(renderer(TAB_OVERVIEW), inputs, [*outputs[TAB_OVERVIEW], live, shown])

        def find(offered, ticked):  # runs that appeared under the served folders: offered, and ticked in Compare
            run_set.refresh()
            every = list(by_label)
            if every == offered:
                return {known: gr.skip(), run_dd: gr.skip(), compare.runs: gr.skip()}
            new = [lab for lab in every if lab not in offered]
            for lab in new:
                colors.setdefault(lab, views.RUN_COLORS[every.index(lab) % len(views.RUN_COLORS)])
            return {known: every, run_dd: gr.Dropdown(choices=every),
                    compare.runs: gr.CheckboxGroup(choices=every, value=[*(ticked or []), *new])}

        if run_set is not None:
            finder.tick(find, [known, compare.runs], [known, run_dd, compare.runs], show_progress="hidden")
        timer.tick(poll, [active, shown, run_dd, compare.runs], list(tokens.values()), show_progress="hidden")
        # another run, or another smoothing: the tab in view is drawn again in the same round trip (its outputs
        # are a part of all tabs' outputs; the others are left as they are). A slider's `input` fires on every
        # change the user makes, typing in its number box included (not only when it loses focus); a dropdown's
        # pick is its `select` (its `input` fires twice per pick).
        every = list(dict.fromkeys(c for outs in outputs.values() for c in outs))
        run_dd.select(lambda tab, *args: {listed: None, **render(tab, {**dict(zip(names, args)), "listed": None})},
                     [active, *inputs], [listed, *every, live, shown], trigger_mode="always_last",
                     show_progress="hidden")
        # a smoothing change redraws only the smoothed charts of the tab in view (Training health: not its text,
        # verdict chart or picker; Batch, ledger, bins, prompt: nothing). `shown` is left alone: a step committed
        # meanwhile still makes the next poll redraw the whole tab
        smoothed = {TAB_OVERVIEW: {ov.reward}, TAB_HEALTH: {*health.plots[:len(views.HEALTH)], health.other_plot},
                    TAB_COMPARE: {compare.plot, compare.csv}}  # the CSV holds the smoothed values too

        def resmooth(tab, *args):
            drawn = render(tab, dict(zip(names, args))) if tab in smoothed else {}
            return {comp: v for comp, v in drawn.items() if comp in smoothed[tab]}

        weight.input(resmooth, [active, *inputs], [*every, live, shown], trigger_mode="always_last",
                     show_progress="hidden")
        for comp, tab in ((ledger.which, TAB_LEDGER), (bins.mode, TAB_BINS), (bins.step_a, TAB_BINS),
                          (bins.step_b, TAB_BINS), (bins.cells, TAB_BINS), (responses.step, TAB_RESPONSES),
                          (responses.verdicts, TAB_RESPONSES), (responses.subsets, TAB_RESPONSES),
                          (responses.query, TAB_RESPONSES), (compare.runs, TAB_COMPARE)):
            comp.input(renderer(tab), inputs, [*outputs[tab], live, shown], trigger_mode="always_last",
                       show_progress="hidden")
        prompt.found.select(renderer(TAB_PROMPT), inputs, [*outputs[TAB_PROMPT], live, shown],
                            trigger_mode="always_last", show_progress="hidden", concurrency_id="prompt",
                            concurrency_limit=1)
        # the same runs: the metric picker keeps its choices (not sent again)
        for event in (compare.metric.select, compare.x_axis.input, compare.group.input):
            event(lambda *args: {**renderer(TAB_COMPARE)(*args), compare.metric: gr.skip()}, inputs,
                  [*outputs[TAB_COMPARE], live, shown], trigger_mode="always_last", show_progress="hidden")
        # another metric in Training health redraws only its own chart (the picker keeps its choices)
        health.other.select(lambda *args: render_other(_run(by_label, args[0]), float(args[1] or 0), args[2])[1],
                            [run_dd, weight, health.other], health.other_plot, trigger_mode="always_last", show_progress="hidden")
        responses.query.submit(renderer(TAB_RESPONSES), inputs, [*outputs[TAB_RESPONSES], live, shown],
                               trigger_mode="always_last", show_progress="hidden")
        prompt_outs = [listed, *outputs[TAB_PROMPT], live, shown]
        prompt.query.submit(search, inputs, prompt_outs, concurrency_id="prompt", concurrency_limit=1)
        for table in (ledger.table, responses.table):
            table.select(pick_row, table, [prompt.query, listed, prompt.found, tabs, active, *tokens.values()])
        drill_outs = [listed, prompt.query, tabs, active, *prompt_outs[1:]]
        bins.matrix.select(pick_cell, inputs, drill_outs)
        drill_go.click(pick_bar, [drill_key, *inputs], drill_outs, js="(k, ...rest) => [window.__bapoDrill, ...rest]")
    return demo


def launch(paths, host: str = "127.0.0.1", port: int | None = None, password: str | None = None,
           user: str = "bapo", poll_seconds: float = POLL_SECONDS, block: bool = True, warm: bool = True):
    """Build the dashboard over the run directories `paths` and serve it; returns the Blocks (serving in a
    thread when block=False). Binding to anything but localhost is the caller's explicit choice (the CLI
    asks for --host); `password` turns on Gradio's login, with at most LOGIN_FAILURES wrong passwords per
    client per LOGIN_WINDOW_S."""
    run_set = data.RunSet(paths)
    runs = list(run_set.runs.values())
    demo = build(run_set, poll_seconds)
    if warm:  # read every run's generated groups once in the background: the ledger, migration and compare
        # tabs then open from memory (a request meanwhile waits for the same read, never repeats it)
        def warm_up():
            for r in runs:
                try:
                    r.generated()
                except UNREADABLE:  # said on its tab
                    pass

        threading.Thread(target=warm_up, name="dashboard-warm", daemon=True).start()
    demo.queue(default_concurrency_limit=4)
    demo.launch(server_name=host, server_port=port, auth=(user, password) if password else None, share=False,
                prevent_thread_lock=not block, show_error=True, quiet=not block, css=CSS, js=CLICK_JS,
                head=VIEW_STATE_JS, ssr_mode=False,
                footer_links=[], app_kwargs={"middleware": [Middleware(LoginLimit)]})
    return demo
