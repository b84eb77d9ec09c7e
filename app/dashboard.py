"""`bapo dashboard RUN_DIR...`: a Gradio web dashboard over run records, live while a run is training.

Layout: one Blocks page, a run picker on top and six tabs (Overview, Batch composition, Hard-problem ledger,
Accuracy bins & migration, Prompt drill-down, Compare runs). A gr.Timer polls the record: each tick compares a
cheap version key of the run(s) shown (read-only connection, no lock the trainer waits on) with the one already
on screen, and only when it changed re-renders the tab in view. The runs are fixed when the app is built (from
the command line); the browser only picks among their labels.

Every plot is a Vega-Lite chart built by app/views.py (see `vega` for why not gr.LinePlot). Tab renderers take
the controls' values and return the tab's component values; the wiring is at the bottom of `build`.
"""
from __future__ import annotations

import io
import json
import os
import threading
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402
from gradio.components.plot import AltairPlotData  # noqa: E402

from bapo_vl.app import data, views  # noqa: E402
from bapo_vl.reader import Run  # noqa: E402
from bapo_vl.record import X2  # noqa: E402

POLL_SECONDS = 3.0
LEDGER_ROWS = 200  # rows of the ledger table shown (the counts and curve cover all)
SEARCH_RESULTS = 50
PLOT_HEIGHT = 260
SPEC_HEIGHT = 190  # the plot area of the hand-written Vega-Lite charts (their PLOT_HEIGHT less title and legend)

# choice labels: the code branches on these very constants
TAB_OVERVIEW, TAB_BATCH, TAB_LEDGER, TAB_BINS, TAB_PROMPT, TAB_COMPARE = (
    "overview", "batch", "ledger", "bins", "prompt", "compare")
TAB_TITLES = {TAB_OVERVIEW: "Overview", TAB_BATCH: "Batch composition", TAB_LEDGER: "Hard-problem ledger",
              TAB_BINS: "Accuracy bins & migration", TAB_PROMPT: "Prompt drill-down", TAB_COMPARE: "Compare runs"}
MODE_AT = "generated at exactly step A and step B"
MODE_WINDOW = "latest result up to step A → latest result in (A, B]"
BIN_MODES = (MODE_WINDOW, MODE_AT)
CSS = """
.gradio-container {max-width: 1400px !important}
.summary p {margin: 2px 0}
"""


def _run(runs: dict[str, Run], label: str) -> Run:
    if label not in runs:  # the browser can only name runs given on the command line
        raise gr.Error(f"unknown run {label!r}")
    return runs[label]


def vega(spec: dict) -> AltairPlotData:
    """A Vega-Lite chart (app/views.py builds them) for gr.Plot, drawn by the vega-embed that Gradio's native
    plots use, and themed and sized like them; no altair needed. Why not gr.LinePlot/BarPlot: they stack bars in
    label order and cannot draw a line over bars, and their values are tables that the browser deep-copies on
    every event (each poll), which stalls a page of 500-step plots; a chart's value here is one JSON string.
    chart="scatter" only restyles a top-level color encoding, which the specs leave to their layers. Each call's
    chart differs (a stamp in usermeta), so a tab shown again redraws at its width (hidden, a chart shrinks to 0)."""
    spec = {**spec, "usermeta": {**spec.get("usermeta", {}), "drawn": time.time_ns()}}
    return AltairPlotData(plot=json.dumps(spec), chart="scatter")


# ----------------------------------------------------------------------------- tab renderers (pure of Gradio events)


def render_overview(run: Run, window: int) -> list:
    steps, evals = run.steps(), run.evals()
    return [views.overview_text(run.label, run.meta(), run.config(), steps, evals),
            vega(views.line_spec(views.reward_frame(steps, evals, window), "step", "reward", "series",
                                 "Reward (train and eval)", SPEC_HEIGHT)),
            vega(views.line_spec(views.rollouts_frame(steps), "step", "rollouts", "kind",
                                 "Rollouts generated (cumulative)", SPEC_HEIGHT, zero=True)),
            vega(views.time_spec(steps, SPEC_HEIGHT))]


def render_batch(run: Run) -> list:
    steps = run.steps()
    G = run.group_size()
    return [views.batch_text(steps), vega(views.composition_spec(steps, SPEC_HEIGHT)),
            vega(views.fresh_bins_spec(steps, G, SPEC_HEIGHT)),
            vega(views.line_spec(views.buffers_frame(steps), "step", "groups", "buffer", "Buffer sizes", SPEC_HEIGHT,
                                 zero=True)),
            vega(views.line_spec(views.thresholds_frame(steps), "step", "value", "threshold",
                                 "Thresholds c1, c2, c3 and r_tot", SPEC_HEIGHT, y_domain=(0, 1)))]


def render_ledger(run: Run, which: str) -> list:
    ledger, steps = run.ledger(), run.steps()
    G = run.group_size()
    table, total = views.ledger_table(ledger, which, LEDGER_ROWS)
    table["text"] = table["uid"].map(data.texts(run, list(table["uid"]))).fillna("")
    note = f"{total} prompt(s) {which}" + (f"; the {LEDGER_ROWS} most recent shown" if total > LEDGER_ROWS else "")
    curve = views.line_spec(views.ledger_curve(ledger, steps["step"]), "step", "prompts", "series",
                            "Hard prompts over steps", SPEC_HEIGHT, zero=True)
    return [views.ledger_text(ledger, G), vega(curve), table, note]


def _step_range(steps: pd.DataFrame) -> tuple[int, int]:
    if steps.empty:
        return 0, 1
    lo, hi = int(steps["step"].min()), int(steps["step"].max())
    return lo, max(hi, lo + 1)


def render_bins(run: Run, mode: str, step_a, step_b) -> list:
    steps = run.steps()
    G = run.group_size()
    lo, hi = _step_range(steps)
    valid_a, valid_b = bool(step_a) and lo <= step_a <= hi, bool(step_b) and lo <= step_b <= hi
    a = int(step_a) if valid_a else (lo + hi) // 2
    b = int(step_b) if valid_b else hi
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
            f"{up} moved up, {down} moved down, {total - up - down} stayed.")
    ha, hb = views.histogram_frame(hist_a, G), views.histogram_frame(hist_b, G)
    # a slider's value is sent back only when it was defaulted: never undo what the user is moving meanwhile
    return [gr.Slider(minimum=lo, maximum=hi, **({} if valid_a else {"value": a})),
            gr.Slider(minimum=lo, maximum=hi, **({} if valid_b else {"value": b})), text,
            vega(views.bar_spec(ha, "bin", "prompts", f"A: step {a}", SPEC_HEIGHT)),
            vega(views.bar_spec(hb, "bin", "prompts", f"B: step {b}", SPEC_HEIGHT)),
            views.matrix_style(views.matrix_frame(m, G))]


def default_prompt(run: Run) -> str | None:
    """What the drill-down opens on: the latest sampled prompt that was promoted into X2 (it failed once and is
    now partly solved), else the latest sampled prompt. Cheap: it reads only the last steps' samples."""
    return data.last_sampled(run, subset=X2) or data.last_sampled(run)


def render_prompt(run: Run, uid: str | None, query: str = "") -> list:
    uid = uid or default_prompt(run)
    hits = data.search_prompts(run, query or "", SEARCH_RESULTS)
    choices = ([(uid, uid)] if uid else []) + [(f"{u} — {t[:70]}", u) for u, t in hits if u != uid]
    picker = gr.Dropdown(choices=choices, value=uid)
    if not uid:
        empty = pd.DataFrame(columns=["step", "subset", "correct", "G"])
        return [picker, "no prompt recorded yet", gr.Image(value=None, visible=False), history_plot(empty),
                views.history_table(empty), pd.DataFrame(columns=["step", "subset", "idx", "verdict", "reward", "response"])]
    d = data.prompt_detail(run, uid)
    if not d["found"] and (fallback := default_prompt(run)):  # e.g. a uid picked in another run
        uid, d = fallback, data.prompt_detail(run, fallback)
        picker = gr.Dropdown(choices=[(uid, uid), *choices], value=uid)
    image = None
    if d["image"]:
        from PIL import Image

        image = Image.open(io.BytesIO(d["image"]))
    return [picker, views.prompt_text(d), gr.Image(value=image, visible=image is not None),
            history_plot(d["history"]), views.history_table(d["history"]), d["samples"]]


def history_plot(history: pd.DataFrame) -> AltairPlotData:
    return vega(views.history_spec(history, SPEC_HEIGHT))


def render_compare(runs: dict[str, Run], labels: list[str], metric: str, window: int) -> list:
    chosen = {lab: (r.steps(), r.evals(), r.ledger()) for lab in labels or [] if (r := _run(runs, lab))}
    curves, solved, table = views.compare_frames(chosen, metric, window)
    return [vega(views.line_spec(curves, "step", "value", "run", f"{metric} vs steps", SPEC_HEIGHT, y_title=metric)),
            vega(views.line_spec(curves, "rollouts", "value", "run", f"{metric} vs rollouts generated",
                                 SPEC_HEIGHT, y_title=metric, integer_x=False)),
            vega(views.line_spec(solved, "step", "prompts", "run",
                                 "Hard problems solved (0/G at first, later ≥ 1/G), cumulative", SPEC_HEIGHT, zero=True)),
            table]


# ----------------------------------------------------------------------------- the page


def build(runs: list[Run], poll_seconds: float = POLL_SECONDS) -> gr.Blocks:
    """The dashboard over `runs` (fixed here, never chosen by the browser)."""
    if not runs:
        raise ValueError("the dashboard needs at least one run directory")
    by_label = {r.label: r for r in runs}
    labels = list(by_label)

    with gr.Blocks(title="bapo dashboard") as demo:
        with gr.Row(equal_height=True):
            run_dd = gr.Dropdown(labels, value=labels[0], label="run", scale=3, elem_id="run")
            window = gr.Slider(1, 50, value=1, step=1, label="smoothing (steps, trailing mean)", scale=2,
                               elem_id="smooth")
            live = gr.Markdown("", elem_id="live", elem_classes="summary")
        active = gr.State(TAB_OVERVIEW)
        shown = gr.State(None)  # version key of what the active tab shows
        timer = gr.Timer(poll_seconds)
        with gr.Tabs(elem_id="tabs") as tabs:
            with gr.Tab(TAB_TITLES[TAB_OVERVIEW], id=TAB_OVERVIEW, elem_id="tab-overview") as t_overview:
                ov_text = gr.Markdown(elem_id="overview-text", elem_classes="summary")
                with gr.Row():
                    ov_reward = gr.Plot(show_label=False, elem_id="overview-reward")
                    ov_rollouts = gr.Plot(show_label=False, elem_id="overview-rollouts")
                ov_time = gr.Plot(show_label=False, elem_id="overview-time")
            with gr.Tab(TAB_TITLES[TAB_BATCH], id=TAB_BATCH, elem_id="tab-batch") as t_batch:
                b_text = gr.Markdown(elem_id="batch-text", elem_classes="summary")
                with gr.Row():
                    b_comp = gr.Plot(show_label=False, elem_id="batch-composition")
                    b_bins = gr.Plot(show_label=False, elem_id="batch-bins")
                with gr.Row():
                    b_buffers = gr.Plot(show_label=False, elem_id="batch-buffers")
                    b_thresholds = gr.Plot(show_label=False, elem_id="batch-thresholds")
            with gr.Tab(TAB_TITLES[TAB_LEDGER], id=TAB_LEDGER, elem_id="tab-ledger") as t_ledger:
                l_text = gr.Markdown(elem_id="ledger-text", elem_classes="summary")
                l_curve = gr.Plot(show_label=False, elem_id="ledger-curve")
                with gr.Row():
                    l_which = gr.Radio(list(views.LEDGER_FILTERS), value=views.LEDGER_FILTERS[0], label="show",
                                       elem_id="ledger-which", scale=3)
                    l_note = gr.Markdown(elem_id="ledger-note")
                l_table = gr.Dataframe(interactive=False, max_height=320, elem_id="ledger-table",
                                       label="hard prompts (click a row to open it in the drill-down)")
            with gr.Tab(TAB_TITLES[TAB_BINS], id=TAB_BINS, elem_id="tab-bins") as t_bins:
                with gr.Row():
                    mode = gr.Radio(list(BIN_MODES), value=BIN_MODES[0], label="prompts compared", scale=2,
                                    elem_id="bins-mode")
                    step_a = gr.Slider(0, 1, value=0, step=1, label="step A", elem_id="step-a")
                    step_b = gr.Slider(0, 1, value=0, step=1, label="step B", elem_id="step-b")
                bins_text = gr.Markdown(elem_id="bins-text", elem_classes="summary")
                with gr.Row():
                    hist_a = gr.Plot(show_label=False, elem_id="bins-hist-a")
                    hist_b = gr.Plot(show_label=False, elem_id="bins-hist-b")
                matrix = gr.Dataframe(interactive=False, label="migration matrix (rows: bin at A, columns: bin at B)",
                                      elem_id="bins-matrix")
            with gr.Tab(TAB_TITLES[TAB_PROMPT], id=TAB_PROMPT, elem_id="tab-prompt") as t_prompt:
                with gr.Row():
                    query = gr.Textbox(label="search by uid or text", scale=2, elem_id="prompt-query")
                    found = gr.Dropdown([], label="prompt", scale=3, elem_id="prompt-pick", allow_custom_value=False)
                with gr.Row():
                    with gr.Column(scale=3):
                        p_text = gr.Markdown(elem_id="prompt-text")
                    p_image = gr.Image(visible=False, type="pil", label="image", scale=1, elem_id="prompt-image",
                                       interactive=False, height=200)
                with gr.Row():
                    p_plot = gr.Plot(show_label=False, elem_id="prompt-history", scale=2)
                    p_rows = gr.Dataframe(interactive=False, max_height=PLOT_HEIGHT, label="subset per step",
                                          elem_id="prompt-rows", scale=1)
                p_samples = gr.Dataframe(interactive=False, max_height=360, wrap=True, label="sampled responses",
                                         elem_id="prompt-samples")
            with gr.Tab(TAB_TITLES[TAB_COMPARE], id=TAB_COMPARE, elem_id="tab-compare") as t_compare:
                with gr.Row():
                    c_runs = gr.CheckboxGroup(labels, value=labels, label="runs", scale=3, elem_id="compare-runs")
                    c_metric = gr.Dropdown(list(views.COMPARE_METRICS), value=views.COMPARE_METRICS[0],
                                           label="metric", elem_id="compare-metric")
                with gr.Row():
                    c_step = gr.Plot(show_label=False, elem_id="compare-steps")
                    c_rollouts = gr.Plot(show_label=False, elem_id="compare-rollouts")
                c_solved = gr.Plot(show_label=False, elem_id="compare-solved")
                c_table = gr.Dataframe(interactive=False, label="summary", elem_id="compare-table")

        # ------------------------------------------------------------------------- wiring
        outputs = {
            TAB_OVERVIEW: [ov_text, ov_reward, ov_rollouts, ov_time],
            TAB_BATCH: [b_text, b_comp, b_bins, b_buffers, b_thresholds],
            TAB_LEDGER: [l_text, l_curve, l_table, l_note],
            TAB_BINS: [step_a, step_b, bins_text, hist_a, hist_b, matrix],
            TAB_PROMPT: [found, p_text, p_image, p_plot, p_rows, p_samples],
            TAB_COMPARE: [c_step, c_rollouts, c_solved, c_table],
        }
        controls = {"run": run_dd, "window": window, "which": l_which, "mode": mode, "a": step_a, "b": step_b,
                    "uid": found, "query": query, "compare": c_runs, "metric": c_metric}
        names, inputs = list(controls), list(controls.values())
        # one token per tab: setting it re-renders that tab. The timer's event outputs only these States, so an
        # idle tick costs the browser nothing (an event's outputs are redrawn whenever it completes), and a
        # re-render updates only the components of the tab in view.
        tokens = {tab: gr.State(0) for tab in outputs}

        def version(tab, c):
            runs = [_run(by_label, lab) for lab in c["compare"] or []] if tab == TAB_COMPARE else [_run(by_label, c["run"])]
            return [tab, c["run"], *((r.label, r.version()) for r in runs)]

        renderers = {  # tab -> its renderer, given the run shown and the controls' values
            TAB_OVERVIEW: lambda run, c: render_overview(run, int(c["window"] or 1)),
            TAB_BATCH: lambda run, c: render_batch(run),
            TAB_LEDGER: lambda run, c: render_ledger(run, c["which"]),
            TAB_BINS: lambda run, c: render_bins(run, c["mode"], c["a"], c["b"]),
            TAB_PROMPT: lambda run, c: render_prompt(run, c["uid"], c["query"]),
            TAB_COMPARE: lambda run, c: render_compare(by_label, c["compare"], c["metric"], int(c["window"] or 1)),
        }

        def render(tab, c: dict) -> dict:
            key = version(tab, c)  # before reading: a step committed meanwhile makes the next poll re-render
            run = _run(by_label, c["run"])
            values = renderers[tab](run, c)
            steps = run.steps()
            stamp = (f"<span id='live-step'>step {int(steps['step'].max()) if not steps.empty else '–'}</span> · "
                     f"{run.meta().get('status', '?')} · read {time.strftime('%H:%M:%S')} · polled every "
                     f"{poll_seconds:g} s")
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

        def search(*args):
            c = dict(zip(names, args))
            hits = data.search_prompts(_run(by_label, c["run"]), c["query"], 1)
            return render(TAB_PROMPT, {**c, "uid": hits[0][0] if hits else None})

        def pick_from_ledger(table, evt: gr.SelectData):
            uid = str(table.iloc[evt.index[0]]["uid"])
            return {query: uid, found: gr.Dropdown(choices=[(uid, uid)], value=uid), tabs: gr.Tabs(selected=TAB_PROMPT),
                    active: TAB_PROMPT, **bump(TAB_PROMPT)}

        tab_blocks = {TAB_OVERVIEW: t_overview, TAB_BATCH: t_batch, TAB_LEDGER: t_ledger, TAB_BINS: t_bins,
                      TAB_PROMPT: t_prompt, TAB_COMPARE: t_compare}
        for tab, block in tab_blocks.items():
            outs = [*outputs[tab], live, shown]
            block.select(opener(tab), inputs, [*outs, active], show_progress="hidden")
            tokens[tab].change(renderer(tab), inputs, outs, show_progress="hidden", trigger_mode="always_last")
        demo.load(renderer(TAB_OVERVIEW), inputs, [*outputs[TAB_OVERVIEW], live, shown])
        timer.tick(poll, [active, shown, run_dd, c_runs], list(tokens.values()), show_progress="hidden")
        run_dd.input(lambda tab: bump(tab), active, list(tokens.values()))  # another run: redraw the tab in view
        window.release(lambda tab: bump(tab), active, list(tokens.values()))
        for comp, tab, event in ((l_which, TAB_LEDGER, "input"), (mode, TAB_BINS, "input"), (step_a, TAB_BINS, "release"),
                                 (step_b, TAB_BINS, "release"), (found, TAB_PROMPT, "input"),
                                 (c_runs, TAB_COMPARE, "input"), (c_metric, TAB_COMPARE, "input")):
            getattr(comp, event)(renderer(tab), inputs, [*outputs[tab], live, shown], trigger_mode="always_last")
        query.submit(search, inputs, [*outputs[TAB_PROMPT], live, shown])
        l_table.select(pick_from_ledger, l_table, [query, found, tabs, active, *tokens.values()])
    return demo


def launch(paths, host: str = "127.0.0.1", port: int | None = None, password: str | None = None,
           user: str = "bapo", poll_seconds: float = POLL_SECONDS, block: bool = True, warm: bool = True):
    """Build the dashboard over the run directories `paths` and serve it; returns the Blocks (serving in a
    thread when block=False). Binding to anything but localhost is the caller's explicit choice (the CLI
    asks for --host); `password` turns on Gradio's login."""
    runs = data.load_runs(paths)
    demo = build(runs, poll_seconds)
    if warm:  # read every run's generated groups once in the background: the ledger, migration and compare
        # tabs then open from memory (a request meanwhile waits for the same read, never repeats it)
        threading.Thread(target=lambda: [r.generated() for r in runs], name="dashboard-warm", daemon=True).start()
    demo.queue(default_concurrency_limit=4)
    demo.launch(server_name=host, server_port=port, auth=(user, password) if password else None, share=False,
                prevent_thread_lock=not block, show_error=True, quiet=not block, css=CSS, ssr_mode=False,
                footer_links=[])
    return demo
