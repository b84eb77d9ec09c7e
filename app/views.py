"""Pure plot functions: data read from a run record (bapo_vl.reader, app/data.py) -> the long-format tables the plots
draw and the text the tabs show. No Gradio and no SQL here, so each is testable on its own.

Every chart is a hand-written Vega-Lite spec (app/dashboard.py says why). Line charts are interactive the way W&B's
are: the mouse wheel zooms the x-axis and a drag pans it (double-click resets), a click on a legend entry
highlights that series (a second click toggles it back), and hovering shows a crosshair with the value of every
series that has one at that x (the page keeps zoom and highlight when a chart is drawn again: dashboard.py). A
series of few points is drawn as points, a long one as a min/max envelope, a value not measured as a gap. Colours
are fixed here, never left to the theme: one per subset, one per verdict, one per run.
"""
from __future__ import annotations

import html
import json
import math
import time

import numpy as np
import pandas as pd

from bapo_vl.reader import ledger_counts, retry_counts, step_summary, summary
from bapo_vl.record import FILTERED, GENERATED, NOT_PROMOTED, X1, X2, X3

# series labels (the legend); kept here so code and tests use the same strings
FRESH_REWARD = "fresh reward (train)"
BATCH_REWARD = "batch reward (train)"
EVAL_PREFIX = "eval "
# one label and one colour per subset (bapo_vl.record's vocabulary), the same in every tab
SUBSET_LABELS = {X1: "X1 (fresh, kept)", FILTERED: "fresh, filtered out", X2: "X2 (re-evaluated, promoted)",
                 NOT_PROMOTED: "re-evaluated, not promoted", X3: "X3 (replayed)"}
SUBSET_COLORS = {X1: "#4c78a8", FILTERED: "#9ecae9", X2: "#f58518", NOT_PROMOTED: "#ffbf79", X3: "#54a24b"}
# one colour per run, by its place on the command line (app/dashboard.py): the same in every chart
RUN_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#72b7b2", "#eeca3b", "#9d755d", "#ff9da6",
              "#bab0ac")
# verifier verdicts (bapo_vl.problem.Verdict values), bottom to top; other values get NEUTRAL
VERDICT_COLORS = {"correct": "#54a24b", "wrong": "#e45756", "unparsable": "#f58518", "timeout": "#b279a2"}
NEUTRAL = "#8c8c8c"  # a mark that must read on a light and a dark page (the dashed B level)
B_LINE = "configured B"
# the phases of a step, which add up to its recorded time (record.STEP_COLUMNS says what each one times)
PHASES = {"t_generate": "generate (sample + log-probs)", "t_verify": "verify (decode + grade)",
          "t_train": "train (update)", "t_sync": "sync (α ← π_θ)"}
BUFFERS = {"bad_size": "B_bad", "high_size": "B_high"}
THRESHOLDS = {"c1": "c1", "c2": "c2", "c3": "c3", "r_tot": "r_tot"}
HARD_SEEN = "first seen at 0/G (cumulative)"
HARD_SOLVED = "later reached ≥ 1/G (cumulative)"
ROLLOUT_KINDS = {"rollouts": "all", "rollouts_fresh": "fresh", "rollouts_reevaluated": "re-evaluation"}
STALENESS = "staleness"  # derived: policy_version - rollout_version
UPDATE_SPEED = "update_tokens_per_s"  # derived: trained_tokens / t_train
# Training health: one chart per group of per-step scalars (title, y-axis title, {metric: legend label}); a metric
# the run did not record is left out, a chart with none is left empty
HEALTH = (
    ("Reward", "mean reward", {"fresh_reward": "fresh (before filtering)", "reward": "training batch",
                               "reevaluated_reward": "re-evaluated"}),
    ("Policy loss", "loss", {"loss": "loss (minimised)", "pg_loss": "policy-gradient term"}),
    ("KL", "KL (per token)", {"kl": "KL to the reference (k3)", "ppo_kl": "KL to the rollout policy"}),
    ("Entropy (mean token entropy)", "nats per token", {"entropy": "entropy"}),
    ("Clip fraction (tokens whose gradient the clip removed)", "share of tokens",
     {"clip_frac": "clip", "clip_frac_dual": "dual clip"}),
    ("Importance ratio π_θ / π_rollout (mean)", "ratio", {"ratio_mean": "mean ratio"}),
    ("Largest importance ratio of a token, by where its response came from", "ratio",
     {"ratio_max": "all", "ratio_max_x1": "X1 (fresh)", "ratio_max_x2": "X2 (re-evaluated)",
      "ratio_max_x3": "X3 (replayed)"}),
    ("Gradient norm (before clipping)", "L2 norm", {"grad_norm": "grad norm"}),
    ("Response length (tokens, fresh rollouts)", "tokens", {"response_length": "mean length"}),
    ("Staleness: policy updates between the rollout policy and the update", "updates", {STALENESS: "updates behind"}),
    ("Generate: where its time went", "seconds per step",
     {"t_generate": "all of generate", "t_generate_sample": "sampling (rollout engine)",
      "t_generate_logprobs": "behaviour log-probs (embedded backend)"}),
    ("Update speed: prompt + response tokens trained per second of the update", "tokens / s",
     {UPDATE_SPEED: "tokens / s (all GPUs)"}),
    ("GPU memory: the card's at each phase's peak (GB)", "GB",
     {"gpu_memory_generate_gb": "generate", "gpu_memory_train_gb": "update (verl: its actor's torch peak)"}),
)
MAX_BARS = 125  # stacked bar charts show at most this many bars (means of consecutive steps beyond)
MAX_POINTS = 250  # line charts draw at most about this many points per series (beyond, a min/max envelope)
MAX_HOVER = 120  # x positions the crosshair snaps to (beyond, an even subset, at whole steps): each is an
# SVG element and a Voronoi cell, the main cost of drawing a long line chart


def long(df: pd.DataFrame, x: str, columns: dict[str, str], value: str, series: str) -> pd.DataFrame:
    """Wide columns -> (x, value, series) rows, one series per column present; NaN values dropped."""
    cols = [c for c in columns if c in df.columns]
    if df.empty or not cols:
        return pd.DataFrame({x: pd.Series(dtype="int64"), value: pd.Series(dtype="float64"),
                             series: pd.Series(dtype="object")})
    out = df[[x, *cols]].melt(id_vars=x, var_name="_series", value_name="_value").dropna(subset=["_value"])
    out = out.rename(columns={"_series": series, "_value": value})
    out[series] = out[series].map(columns)
    out[value] = out[value].astype("float64")
    return out.reset_index(drop=True)


def ema(values: pd.Series, weight: float) -> pd.Series:
    """Exponential moving average with W&B's and TensorBoard's debiasing (the first points are not pulled towards
    0): s_t = sum_i w^i x_(t-i) / sum_i w^i over the values so far. weight 0: unchanged. NaN stays NaN."""
    values = pd.to_numeric(values, errors="coerce").astype("float64")
    if weight <= 0 or values.empty:
        return values
    out = values.ewm(alpha=1 - min(weight, 0.999), adjust=True, ignore_na=True).mean()
    return out.where(values.notna())


def smoothed(df: pd.DataFrame, value: str, series: str, weight: float) -> pd.DataFrame:
    """A long frame with its `value` smoothed per series (ema) and the raw values kept in `raw` (drawn faint);
    without smoothing, unchanged (no raw column)."""
    if weight <= 0 or df.empty:
        return df
    df = df.copy()
    df["raw"] = df[value]
    df[value] = df.groupby(series, sort=False)[value].transform(lambda s: ema(s, weight)) if series else ema(
        df[value], weight)
    return df


def bin_labels(G: int) -> list[str]:
    """'0/8' ... '8/8', zero-padded for G >= 10 so that text order is bin order (stack and legend order)."""
    width = len(str(G))
    return [f"{c:0{width}d}/{G}" for c in range(G + 1)]


def nice_max(x: float) -> float:
    """An upper y-limit a little above x (bar plots need explicit limits to start at 0)."""
    return 1.0 if not x or x <= 0 or not math.isfinite(x) else float(x) * 1.08


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def fmt(x, spec: str = "{}") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)


def duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ----------------------------------------------------------------------------- Overview


def reward_frame(steps: pd.DataFrame, evals: pd.DataFrame, weight: float = 0.0) -> pd.DataFrame:
    """(step, reward, series[, raw]): fresh and batch reward per step (smoothed: raw kept), and each evaluation's
    mean@k (never smoothed: few points)."""
    train = smoothed(long(steps, "step", {"fresh_reward": FRESH_REWARD, "reward": BATCH_REWARD}, "reward", "series"),
                     "reward", "series", weight)
    ev = evals[evals["metric"] == "mean@k"] if not evals.empty else evals
    if ev.empty:
        return train
    ev = pd.DataFrame({"step": ev["step"], "reward": ev["value"], "series": EVAL_PREFIX + ev["name"] + " mean@k"})
    if "raw" in train:
        ev["raw"] = ev["reward"]
    return pd.concat([train, ev], ignore_index=True)


def rollouts_frame(steps: pd.DataFrame) -> pd.DataFrame:
    """(step, rollouts, kind): responses generated so far (cumulative), all / fresh / re-evaluation."""
    cum = steps[["step"]].copy()
    for c in ROLLOUT_KINDS:
        if c in steps:
            cum[c] = steps[c].fillna(0).cumsum()
    return long(cum, "step", ROLLOUT_KINDS, "rollouts", "kind")


def eta(steps: pd.DataFrame, total_steps, status: str, recent: int = 10, budget: int = 0) -> str | None:
    """'ETA …' from the median time between the last `recent` step commits and the steps left: to the step cap, or
    sooner to the rollout budget (max_rollouts) at the median rollouts of those steps. None when the run is not
    running or nothing is left to estimate."""
    if status != "running" or not total_steps or len(steps) < 2:
        return None
    left = int(total_steps) - int(steps["step"].iloc[-1])
    if budget and "rollouts" in steps:
        per_step_rollouts = float(steps["rollouts"].iloc[-recent:].median())
        if per_step_rollouts > 0:
            to_budget = budget - float(steps["rollouts"].fillna(0).sum())
            left = min(left, max(1, math.ceil(to_budget / per_step_rollouts)))
    gaps = steps["time"].diff().iloc[-recent:].dropna()
    gaps = gaps[gaps > 0]
    if left <= 0 or gaps.empty:
        return None
    per_step = float(gaps.median())
    at = time.strftime("%H:%M", time.localtime(float(steps["time"].iloc[-1]) + left * per_step))
    return (f"ETA <b id='eta'>{duration(left * per_step)}</b> (about {at}): {left} steps left at "
            f"{per_step:.1f} s/step, the median of the last {len(gaps)}")


def overview_text(run_label: str, meta: dict, config: dict, steps: pd.DataFrame, evals: pd.DataFrame) -> str:
    label = html.escape(run_label)
    if steps.empty:
        return f"**{label}** · status **{meta.get('status', '?')}** · no step recorded yet"
    last = steps.iloc[-1]
    total_rollouts = step_summary(steps)["rollouts"]
    budget = int(config.get("max_rollouts") or 0)  # a rollout budget ends the run before its step cap
    seconds = float(steps[list(PHASES)].fillna(0).to_numpy().sum())
    parts = [f"**{label}**", f"status **{meta.get('status', '?')}**",
             f"algo {config.get('algo', '?')}", f"task {config.get('task', '?')}",
             f"B = {config.get('batch_size', fmt(last.get('batch_size')))}", f"G = {config.get('group_size', '?')}"]
    lines = [" · ".join(parts),
             (f"last step: <b id='last-step'>{int(last['step'])}</b> of {config.get('steps', '?')} · "
              f"rollouts: <b id='total-rollouts'>{total_rollouts}</b>"
              + (f" of a {budget:,} budget" if budget else "") + " · "
              f"fresh reward at last step: {fmt(last['fresh_reward'], '{:.3f}')} · "
              f"wall time recorded: {seconds / 60:.1f} min")]
    if (e := eta(steps, config.get("steps"), meta.get("status", "?"), budget=budget)) is not None:
        lines.append(e)
    if not evals.empty:
        e = evals[evals["metric"] == "mean@k"]
        if not e.empty:
            at = e["step"].max()
            lines.append("evaluation at step " + str(int(at)) + ": " + ", ".join(
                f"{html.escape(str(r.name))} mean@k {r.value:.3f}" for r in e[e["step"] == at].itertuples()))
    return "\n\n".join(lines)


# ----------------------------------------------------------------------------- chart building blocks


def _base(title: str, height: int, layers: list[dict]) -> dict:
    # no width: Gradio's frontend sizes a chart to its container; the empty top-level encoding keeps its theming
    # away from the layers' colors; SVG so that marks are countable (tests) and crisp (screenshots). A transparent
    # background: the page's (light or dark, Gradio follows the OS) shows through, and Gradio colours the text
    # for that page. Gradio replaces `config`, so nothing here may rely on it.
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "title": title, "height": height,
            "background": "transparent", "encoding": {}, "layer": layers,
            "usermeta": {"embedOptions": {"renderer": "svg"}}}


def _records(df: pd.DataFrame, cols) -> list[dict]:
    """Rows as dicts for a chart's data, NaN and infinities as null, floats to 7 significant digits (a KL of 1e-6
    keeps its digits). Through pandas' C JSON writer: a Python loop over every value costs more than the chart."""
    out = df[list(cols)].replace([np.inf, -np.inf], np.nan)
    return json.loads(out.to_json(orient="records", double_precision=7))


def _step_axis(lo: float, hi: float) -> dict:
    """An integer x-axis (steps): ticks only at whole numbers, at most one per step, so that a short run has no
    repeated labels (a 'd' format alone rounds 1.5 to a second '2')."""
    span = max(hi - lo, 0)
    values = list(range(math.ceil(lo), math.floor(hi) + 1))
    if span <= 12 and values:
        return {"values": values, "format": "d"}
    return {"tickMinStep": 1, "format": "d"}


def envelope(df: pd.DataFrame, x: str, y: str, color: str | None, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """At most about `max_points` rows per series: beyond, each bucket of k consecutive rows keeps only its lowest
    and its highest `y` (a min/max envelope). Rows are kept as they are, at their own x: a spike is drawn at its
    height and its step, never averaged away with its neighbours."""
    if df.empty:
        return df
    n = df.groupby(color).size().max() if color else len(df)
    k = math.ceil(n / max(max_points // 2, 1))
    if k <= 1:
        return df
    keys = [color] if color else []
    df = df.sort_values([*keys, x], kind="stable")
    bucket = df.groupby(keys, sort=False).cumcount() // k if keys else pd.Series(np.arange(len(df)) // k, df.index)
    groups = df[y].groupby([df[color], bucket] if keys else bucket, sort=False)
    keep = pd.Index(groups.idxmin().dropna()).union(pd.Index(groups.idxmax().dropna()))
    return df.loc[df.index.isin(keep)]


def sparse_series(df: pd.DataFrame, x: str, color: str | None, integer_x: bool) -> set:
    """The series to draw as points (a line alone would hide them): a single point, far fewer points than the
    densest series of the chart (evaluations beside training steps), or on a step axis no two points at
    consecutive steps (a value measured every m steps)."""
    if df.empty:
        return set()
    groups = list(df.groupby(color, sort=False)[x]) if color else [(None, df[x])]
    densest = max(len(xs) for _, xs in groups)
    out = set()
    for name, xs in groups:
        gaps = np.diff(np.sort(xs.to_numpy(dtype=float)))
        if len(xs) <= 1 or len(xs) < densest / 5 or (integer_x and len(gaps) and gaps.min() > 1):
            out.add(name)
    return out


def gap_rows(df: pd.DataFrame, x: str, y: str, color: str | None, skip: set) -> pd.DataFrame:
    """A row with no value half a step after each point that is followed by a missing step (on an integer axis),
    in every series but `skip`: its line breaks there instead of joining across steps it has no value for."""
    parts = []
    for name, part in (df.groupby(color, sort=False) if color else [(None, df)]):
        if name in skip:
            continue
        xs = np.sort(part[x].to_numpy(dtype=float))
        before = xs[:-1][np.diff(xs) > 1]
        if len(before):
            parts.append(pd.DataFrame({x: before + 0.5, y: np.nan, **({color: name} if color else {})}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[x, y, *([color] if color else [])])


def hover_table(df: pd.DataFrame, x: str, y: str, color: str | None, order: list[str]) -> pd.DataFrame:
    """One row per x the crosshair can stop at, a column s0, s1, ... per series (in `order`): its value there,
    linearly interpolated between its own points when series have different x (e.g. rollouts of two runs)."""
    if df.empty:
        return pd.DataFrame(columns=[x])
    if not color:
        return df[[x, y]].rename(columns={y: "s0"}).sort_values(x)
    wide = df.pivot_table(index=x, columns=color, values=y, aggfunc="last").reindex(columns=order).sort_index()
    wide = wide.interpolate(method="index", limit_area="inside")
    if len(wide) > MAX_HOVER:
        wide = wide.iloc[np.unique(np.linspace(0, len(wide) - 1, MAX_HOVER).round().astype(int))]
    wide.columns = [f"s{i}" for i in range(len(order))]
    return wide.reset_index()


def _tooltip_rows(hover: pd.DataFrame, x: str, x_title: str, names: list[str], integer_x: bool) -> list[dict]:
    """The crosshair's rows: x, and `tip`, what its tooltip lists: x, then each series' value there (4 significant
    digits); a series without a value there is left out, never shown as "null" or "NaN"."""
    out = []
    for r in _records(hover, hover.columns):
        at = r[x]
        tip = {x_title: f"{at:.0f}" if integer_x else f"{at:,.0f}" if float(at).is_integer() else f"{at:,.2f}"}
        tip.update((n, f"{r[f's{i}']:.4g}") for i, n in enumerate(names) if r.get(f"s{i}") is not None)
        out.append({x: at, "tip": tip})
    return out


def empty_spec(title: str, height: int, text: str = "not recorded in this run") -> dict:
    """A chart with nothing to draw: its title and a line saying so, at the full width (a chart without data
    would shrink to nothing and clip its title)."""
    hidden = {"type": "quantitative", "scale": {"domain": [0, 1]}, "axis": None}
    return _base(title, height, [{"data": {"values": [{"text": text}]},
                                  "mark": {"type": "text", "color": NEUTRAL, "fontSize": 13},
                                  "encoding": {"x": {**hidden, "datum": 0.5}, "y": {**hidden, "datum": 0.5},
                                               "text": {"field": "text"}}}])


def line_spec(df: pd.DataFrame, x: str, y: str, color: str | None, title: str, height: int,
              x_title: str | None = None, y_title: str | None = None, y_domain=None, zero: bool = False,
              points: bool = False, integer_x: bool = True, colors: dict[str, str] | None = None) -> dict:
    """Lines (one per `color` value, in order of first appearance), interactive (see the module docstring); a
    `raw` column in `df` is drawn faint under its smoothed line. `colors` fixes the colour of given values.
    A sparse series (see `sparse_series`) is drawn as points on its line; a dense one breaks where steps are
    missing; beyond MAX_POINTS a series is a min/max envelope. points=True: a scatter with a tooltip per point."""
    if df.empty:
        return empty_spec(title, height)
    order = list(dict.fromkeys(df[color])) if color else []  # legend: order of appearance
    raw = "raw" if "raw" in df else None
    x_title, y_title = x_title or x, y_title or y
    xs = {"field": x, "type": "quantitative", "title": x_title, "scale": {"zero": False, "nice": False}}
    if integer_x:
        xs["axis"] = _step_axis(float(df[x].min()), float(df[x].max()))
    ys = {"field": y, "type": "quantitative", "title": y_title, "scale": {"zero": zero}}
    if y_domain:
        ys["scale"]["domain"] = list(y_domain)
    col = {}
    if color:
        scale = {"domain": order, **({"range": [colors.get(o, NEUTRAL) for o in order]} if colors else {})}
        col = {"color": {"field": color, "type": "nominal", "title": None, "legend": {"orient": "bottom"},
                         "scale": scale}}
        if {"lo", "hi"} <= set(df.columns):  # the legend takes its swatches from the faint band: full colour
            col["color"]["legend"]["symbolOpacity"] = 1
    x_tip = {"field": x, "type": "quantitative", "title": x_title, "format": "d" if integer_x else ",.6~g"}
    if points:
        # half a step of room: a point at the first or last step is not cut in half
        xs["scale"]["domain"] = [float(df[x].min()) - 0.5, float(df[x].max()) + 0.5]
        tip = [x_tip, {"field": y, "type": "quantitative", "title": y_title, "format": ".4~g"},
               *([{"field": color, "type": "nominal", "title": " "}] if color else [])]
        return _base(title, height, [{"data": {"values": _records(df, [c for c in (x, y, color) if c])},
                                      "mark": {"type": "circle", "size": 45, "opacity": 0.85, "strokeWidth": 0},
                                      "encoding": {"x": xs, "y": ys, **col, "tooltip": tip}}])
    sparse = sparse_series(df, x, color, integer_x)
    drawn = envelope(df, x, raw or y, color)
    hover = hover_table(drawn, x, y, color, order)
    if integer_x:
        drawn = pd.concat([drawn, gap_rows(df, x, y, color, sparse).assign(**({raw: np.nan} if raw else {}))],
                          ignore_index=True).sort_values([*([color] if color else []), x], kind="stable")
    band = ["lo", "hi"] if {"lo", "hi"} <= set(df.columns) else []  # mean ± sd of a group of runs
    data_ = {"values": _records(drawn, [c for c in (x, y, raw, *band, color) if c])}
    picked = {"param": "legend", "empty": True}
    faded = lambda on, off: {"opacity": {"condition": {**picked, "value": on}, "value": off}} if color else {}
    line = {"type": "line", "clip": True, "invalid": "break-paths-filter-domains"}
    # the selections live on the first layer: the legend is bound to the first layer that draws it, and a legend
    # selection on a later one (the smoothed line over the raw one) never sees the click
    params = [{"name": "zoom", "select": {"type": "interval", "encodings": ["x"]}, "bind": "scales"},
              *([{"name": "legend", "select": {"type": "point", "fields": [color], "toggle": "true"},
                  "bind": "legend"}] if color else [])]
    layers = []
    if band:
        layers.append({"data": data_, "mark": {"type": "area", "clip": True, "invalid": "break-paths-filter-domains"},
                       "encoding": {"x": xs, "y": {**ys, "field": "lo"}, "y2": {"field": "hi"}, **col,
                                    **faded(0.2, 0.04)}})
    if raw:
        layers.append({"data": data_, "mark": {**line, "strokeWidth": 1},
                       "encoding": {"x": xs, "y": {**ys, "field": raw}, **col, **faded(0.28, 0.05)}})
    layers.append({"data": data_, "mark": {**line, "strokeWidth": 1.8},
                   "encoding": {"x": xs, "y": ys, **col, **faded(1, 0.15)}})
    layers[0]["params"] = params
    if sparse:
        dots = drawn[drawn[color].isin(sparse)] if color else drawn
        layers.append({"data": {"values": _records(dots.dropna(subset=[y]), [c for c in (x, y, color) if c])},
                       "mark": {"type": "circle", "size": 36, "clip": True},
                       "encoding": {"x": xs, "y": ys, **col, **faded(1, 0.15)}})
    # the crosshair: a rule at the x nearest the pointer (invisible elsewhere) whose tooltip lists every series
    # that has a value there (a run that ended earlier is left out, never shown as "null")
    names = order or [y_title]
    layers.append({"data": {"values": _tooltip_rows(hover, x, x_title, names, integer_x)},
                   "params": [{"name": "hover", "select": {"type": "point", "fields": [x], "nearest": True,
                                                           "on": "pointerover", "clear": "pointerout"}}],
                   "mark": {"type": "rule", "strokeWidth": 1, "color": NEUTRAL, "aria": False},
                   "encoding": {"x": xs, "opacity": {"condition": {"param": "hover", "empty": False, "value": 0.7},
                                                     "value": 0}, "tooltip": {"field": "tip", "type": "nominal"}}})
    # a dot per series at the crosshair; the first row always passes the filter, unseen: a layer filtered down to
    # nothing would give the shared scales an infinite extent (a console warning on every draw)
    at = hover.melt(id_vars=x, var_name="_s", value_name=y).dropna(subset=[y])
    at["_s"] = at["_s"].map({f"s{i}": n for i, n in enumerate(names)})
    at = at.rename(columns={"_s": color or "_s"}).assign(_anchor=False)
    at.iloc[:1, at.columns.get_loc("_anchor")] = True
    unseen = {"test": {"and": [{"field": "_anchor", "equal": True}, {"not": {"param": "hover", "empty": False}}]}}
    layers.append({"data": {"values": _records(at, [x, y, color or "_s", "_anchor"])},
                   "transform": [{"filter": {"or": [{"param": "hover", "empty": False},
                                                    {"field": "_anchor", "equal": True}]}}],
                   "mark": {"type": "circle", "size": 40, "clip": True, "aria": False},
                   "encoding": {"x": xs, "y": ys, **col, "opacity": {"condition": {**unseen, "value": 0}, "value": 1}}})
    return _base(title, height, layers)


def bar_spec(df: pd.DataFrame, x: str, y: str, title: str, height: int, color: str = "#4c78a8") -> dict:
    """One bar per `x` category, in the frame's order, from 0. A `key` column goes into each bar's description
    (what a click on it opens: app/dashboard.py, click-through)."""
    top = float(df[y].max()) if not df.empty else 0
    enc = {"x": {"field": x, "type": "ordinal", "sort": list(df[x]), "title": x, "axis": {"labelAngle": 0}},
           "y": {"field": y, "type": "quantitative", "title": y, "scale": {"domain": [0, nice_max(top)]}},
           "tooltip": [{"field": x}, {"field": y, "type": "quantitative"}]}
    mark = {"type": "bar", "color": color, "strokeWidth": 0}
    if "key" in df:
        enc["description"] = {"field": "key"}
        mark["cursor"] = "pointer"
    return _base(title, height, [{"data": {"values": _records(df, [c for c in (x, y, "key") if c in df])},
                                  "mark": mark, "encoding": enc}])


def stacked_spec(wide: pd.DataFrame, series: dict[str, str], colors: list[str], title: str, y_title: str,
                 height: int, line: tuple[str, str] | None = None, max_bars: int = MAX_BARS,
                 keys: dict[str, str] | None = None, y_format: str = ".4~g") -> dict:
    """A Vega-Lite chart of one stacked bar per step: the `series` columns of `wide` (column -> legend label)
    stacked in that order from the bottom, and optionally `line` = (column, label) drawn as a dashed level over
    each bar. Native Gradio bar plots stack in label order and cannot overlay a line. Beyond `max_bars` steps,
    each bar is the mean of k consecutive steps (said in the title): fewer marks keep the browser quick.
    `keys` (column -> a name): each bar segment carries `key` = "name@first-last" in its description, which the
    page reads when it is clicked (app/dashboard.py, click-through)."""
    labels = list(series.values())
    bars, level = [], []
    cols = [c for c in series if c in wide.columns]
    k = max(1, math.ceil(len(wide) / max_bars))
    if k > 1:
        title = f"{title} (each bar: mean of {k} steps)"
        bucket = (wide["step"] - wide["step"].min()) // k
        agg = {c: "mean" for c in cols + ([line[0]] if line else [])}
        wide = wide.groupby(bucket).agg({"step": ["min", "max"], **agg})
        wide.columns = ["first", "last", *agg]
    else:
        wide = wide.assign(first=wide["step"], last=wide["step"])
    for r in wide.itertuples(index=False):
        first, last, y = int(r.first), int(r.last), 0.0
        span = str(first) if first == last else f"{first}–{last}"
        for c in cols:
            n = getattr(r, c)
            if n is None or pd.isna(n) or not n:
                continue
            n = float(n)
            bar = {"step": span, "x0": first - 0.45, "x1": last + 0.45, "y0": y, "y1": y + n,
                   "series": series[c], "value": round(n, 4)}
            if keys and c in keys:
                bar["key"] = f"{keys[c]}@{first}-{last}"
            bars.append(bar)
            y += n
        if line and not pd.isna(v := getattr(r, line[0])):
            level += [{"step": span, "x": first - 0.5, "level": float(v)}, {"step": span, "x": last + 0.5, "level": float(v)}]
    top = max([b["y1"] for b in bars] + [v["level"] for v in level] + [0])
    lo, hi = (int(wide["first"].min()), int(wide["last"].max())) if len(wide) else (0, 1)
    x = {"type": "quantitative", "title": "step", "axis": _step_axis(lo, hi),
         "scale": {"domain": [lo - 0.5, hi + 0.5], "nice": False, "zero": False}}
    domain, rng = labels + ([line[1]] if line else []), colors[:len(labels)] + ([NEUTRAL] if line else [])
    color = {"type": "nominal", "title": None, "legend": {"orient": "bottom"}, "scale": {"domain": domain, "range": rng}}
    enc = {"x": {**x, "field": "x0"}, "x2": {"field": "x1"},
           "y": {"field": "y0", "type": "quantitative", "title": y_title, "scale": {"domain": [0, nice_max(top)]}},
           "y2": {"field": "y1"}, "color": {**color, "field": "series"},
           "tooltip": [{"field": "step"}, {"field": "series", "title": " "},
                       {"field": "value", "type": "quantitative", "title": y_title, "format": y_format}]}
    mark = {"type": "rect", "strokeWidth": 0}
    if keys:
        enc["description"] = {"field": "key"}
        mark["cursor"] = "pointer"
    layers = [{"data": {"values": bars}, "mark": mark, "encoding": enc}]
    if line:
        layers.append({"data": {"values": level}, "mark": {"type": "line", "strokeDash": [5, 3], "strokeWidth": 1.5},
                       "encoding": {"x": {**x, "field": "x"}, "y": {"field": "level", "type": "quantitative"},
                                    "detail": {"field": "step"}, "color": {**color, "datum": line[1]},
                                    "tooltip": [{"field": "step"},
                                                {"field": "level", "type": "quantitative", "title": line[1]}]}})
    return _base(title, height, layers)


# ----------------------------------------------------------------------------- Batch composition


def composition_spec(steps: pd.DataFrame, height: int = 200) -> dict:
    """|X1|, |X2|, |X3| per step, stacked in that order from the bottom, against the configured B (dashed). A click
    on a segment opens its prompts (key = the subset)."""
    batch = (X1, X2, X3)  # the step columns x1, x2, x3 count the groups of the subsets of those names
    return stacked_spec(steps, {s: SUBSET_LABELS[s] for s in batch}, [SUBSET_COLORS[s] for s in batch],
                        "Batch composition: |X1| + |X2| + |X3| against the configured B", "groups", height,
                        line=("batch_size", B_LINE), keys={s: s for s in batch})


def bin_colors(G: int) -> list[str]:
    """Red (0/G) through yellow to green (G/G)."""
    stops = [(214, 39, 40), (242, 193, 78), (44, 160, 44)]
    out = []
    for i in range(G + 1):
        t = i / max(G, 1) * 2
        k = min(int(t), 1)
        a, b, f = stops[k], stops[k + 1], t - k
        out.append("#" + "".join(f"{round(a[j] + (b[j] - a[j]) * f):02x}" for j in range(3)))
    return out


def fresh_bins_spec(steps: pd.DataFrame, G: int, height: int = 200) -> dict:
    """Fresh groups (kept or filtered) per accuracy bin 0/G..G/G at each step, stacked with 0/G at the bottom.
    A click on a segment opens its prompts (key = bin<i>)."""
    labels = bin_labels(G)
    wide = pd.DataFrame([[s, *((list(b) if b else []) + [0] * (G + 1))[:G + 1]]
                         for s, b in zip(steps["step"], steps["bins"])], columns=["step", *map(str, range(G + 1))])
    wide.columns = ["step", *(f"b{i}" for i in range(G + 1))]
    return stacked_spec(wide, {f"b{i}": labels[i] for i in range(G + 1)}, bin_colors(G),
                        "Fresh groups by accuracy bin (correct / G)", "groups", height,
                        keys={f"b{i}": f"bin{i}" for i in range(G + 1)})


def time_spec(steps: pd.DataFrame, height: int = 200) -> dict:
    """Wall time per step, stacked: generate, verify, train, sync (PHASES)."""
    return stacked_spec(steps, PHASES, ["#4c78a8", "#f58518", "#e45756", "#72b7b2"], "Wall time per step",
                        "seconds", height)


# one line per term of the batch charts (μ = a group's correct / G), in the paper's words
BATCH_TERMS = "<br>".join((
    "<b>B_bad</b>: prompts whose fresh group failed (μ ≤ c1), generated for again with the current policy every m "
    "steps; promoted into X2 when it now does better (c1 < μ < 1 by default).",
    "<b>B_high</b>: groups of the last few steps with c2 ≤ μ ≤ c3, replayed with their stored responses as X3 to "
    "fill the batch up to B.",
    "<b>c1</b>: the failure threshold (1/8 by default); <b>c2</b>, <b>c3</b>: the band of μ that B_high keeps.",
    "<b>r_tot</b>: the running mean reward of all fresh rollouts so far; c2 and c3 move with it (eq. 8).",
))


def buffers_frame(steps: pd.DataFrame) -> pd.DataFrame:
    return long(steps, "step", BUFFERS, "groups", "buffer")


def thresholds_frame(steps: pd.DataFrame) -> pd.DataFrame:
    return long(steps, "step", THRESHOLDS, "value", "threshold")


def batch_text(steps: pd.DataFrame) -> str:
    if steps.empty:
        return "no step recorded yet"
    r, s = steps.iloc[-1], step_summary(steps)
    n = lambda k: fmt(None if pd.isna(r[k]) else int(r[k]))
    return (f"step <b id='batch-step'>{int(r['step'])}</b>: |X1| = <b id='batch-x1'>{n('x1')}</b>, "
            f"|X2| = <b id='batch-x2'>{n('x2')}</b>, |X3| = <b id='batch-x3'>{n('x3')}</b> of "
            f"B = <b id='batch-b'>{n('batch_size')}</b> · |B_bad| = {n('bad_size')}, |B_high| = {n('high_size')} · "
            f"c2 = {fmt(r['c2'], '{:.3f}')}, c3 = {fmt(r['c3'], '{:.3f}')} · "
            f"steps with X2: {s['steps_with_x2']}, with X3: {s['steps_with_x3']} · "
            f"click a bar to open its prompts")


# ----------------------------------------------------------------------------- Training health


KL_OFF = "kl_coef = 0: no KL term, no KL to the reference"


def measured(metrics: pd.DataFrame, config: dict) -> pd.DataFrame:
    """The per-step metrics with what was not measured missing instead of the 0.0 the record holds: the
    re-evaluated reward at a step that re-evaluated nothing, and the KL to the reference when the KL term is off
    (kl_coef = 0: there is no reference model)."""
    masks = {}
    if "reevaluated_reward" in metrics and "rollouts_reevaluated" in metrics:
        masks["reevaluated_reward"] = metrics["rollouts_reevaluated"].fillna(0) <= 0
    if "kl" in metrics and config.get("kl_coef") == 0:
        masks["kl"] = pd.Series(True, index=metrics.index)
    if not masks:
        return metrics
    out = metrics.assign(**{c: metrics[c].mask(m) for c, m in masks.items()})
    return out.drop(columns=[c for c in masks if out[c].isna().all()])


def health_frames(metrics: pd.DataFrame, config: dict | None = None) -> list[tuple[str, str, pd.DataFrame]]:
    """(title, y-axis title, long frame (step, value, series)) per HEALTH chart, from the table of every per-step
    metric (Run.metrics(), through `measured`); the derived staleness and update speed are added here, and the KL
    chart says when the KL term is off."""
    if STALENESS not in metrics and {"policy_version", "rollout_version"} <= set(metrics):
        metrics = metrics.assign(**{STALENESS: metrics["policy_version"] - metrics["rollout_version"]})
    if UPDATE_SPEED not in metrics and {"trained_tokens", "t_train"} <= set(metrics):
        trained = (metrics["trained_tokens"] > 0) & (metrics["t_train"] > 0)  # a step that trained nothing: no point
        metrics = metrics.assign(**{UPDATE_SPEED: (metrics["trained_tokens"] / metrics["t_train"]).where(trained)})
    kl_off = (config or {}).get("kl_coef") == 0
    return [(f"{title} ({KL_OFF})" if kl_off and "kl" in cols else title, y_title,
             long(metrics, "step", cols, "value", "series")) for title, y_title, cols in HEALTH]


def other_metrics(metrics: pd.DataFrame) -> list[str]:
    """The per-step metrics that no Training-health chart shows (a backend's own, the batch counters...)."""
    shown = {c for *_, cols in HEALTH for c in cols} | {"step", "time", "policy_version", "rollout_version"}
    return [c for c in metrics.columns if c not in shown]


def verdict_spec(verdicts: pd.DataFrame, height: int) -> dict:
    """Share of the responses scored at each step per verifier verdict, stacked (correct at the bottom)."""
    if verdicts.empty:
        wide = pd.DataFrame(columns=["step"])
    else:
        wide = verdicts.pivot_table(index="step", columns="verdict", values="count", aggfunc="sum", fill_value=0)
        wide = wide.div(wide.sum(axis=1).clip(lower=1), axis=0).reset_index()
    names = [v for v in VERDICT_COLORS if v in wide]
    names += sorted(c for c in wide if c not in VERDICT_COLORS and c != "step")
    return stacked_spec(wide, {v: v for v in names}, [VERDICT_COLORS.get(v, NEUTRAL) for v in names],
                        "Verifier verdicts (share of the responses scored)", "share", height, y_format=".1%")


def verdict_text(verdicts: pd.DataFrame) -> str:
    if verdicts.empty:
        return "no verifier verdicts recorded"
    total = verdicts.groupby("verdict")["count"].sum()
    n = int(total.sum())
    return "verdicts over the run: " + " · ".join(
        f"{v} <b id='verdicts-{html.escape(str(v))}'>{int(k)}</b> ({100 * k / max(n, 1):.1f} %)"
        for v, k in total.sort_values(ascending=False).items())


# ----------------------------------------------------------------------------- Hard-problem ledger


def ledger_curve(ledger: pd.DataFrame, steps: pd.Series) -> pd.DataFrame:
    """(step, prompts, series): hard prompts found so far and how many of them were solved by each step."""
    if len(steps) == 0:
        return pd.DataFrame(columns=["step", "prompts", "series"])
    idx = pd.Index(sorted(steps), name="step")
    seen = ledger.groupby("first_seen").size().reindex(idx, fill_value=0).cumsum()
    solved = ledger.dropna(subset=["first_solved"]).groupby("first_solved").size()
    solved = solved.reindex(idx, fill_value=0).cumsum()
    wide = pd.DataFrame({"step": idx, "seen": seen.to_numpy(), "solved": solved.to_numpy()})
    return long(wide, "step", {"seen": HARD_SEEN, "solved": HARD_SOLVED}, "prompts", "series")


def solved_share(ledger: pd.DataFrame, steps: pd.Series) -> np.ndarray:
    """Per step: of the hard prompts generated for again by then (retried), the % that reached >= 1/G by then;
    NaN while none was retried (a run that never retries has no such share)."""
    at = np.asarray(steps, dtype=float)
    retried = np.sort(ledger["first_retry"].dropna().to_numpy(dtype=float))
    solved = np.sort(ledger["first_solved"].dropna().to_numpy(dtype=float))
    n = np.searchsorted(retried, at, side="right")
    k = np.searchsorted(solved, at, side="right")
    return np.where(n > 0, 100 * k / np.maximum(n, 1), np.nan)


def ledger_text(ledger: pd.DataFrame, G: int) -> str:
    """The ledger's counts, with the one that makes runs comparable: of the hard prompts generated again later
    (retried), how many were solved. 'Solved % of all' also counts prompts never tried again, which no run can
    solve; a run that never re-generates a prompt (GRPO) has 0 there by construction."""
    n, k, frac = ledger_counts(ledger)
    retried, solved_r, frac_r = retry_counts(ledger)
    mean_retries = float(ledger.loc[ledger["retries"] > 0, "retries"].mean()) if retried else 0.0
    text = (f"Prompts that were 0/{G} the first time they were generated for: <b id='ledger-hard'>{n}</b> · "
            f"generated again later (retried): <b id='ledger-retried'>{retried}</b> "
            f"({fmt(100 * retried / n if n else None, '{:.1f}')} %, {mean_retries:.1f} retries each on average) · "
            f"later reached ≥ 1/{G}: <b id='ledger-solved'>{k}</b>\n\n"
            f"solved % of all: <b id='ledger-fraction'>{100 * frac:.1f}</b> % · "
            f"solved % of retried: <b id='ledger-retried-fraction'>{fmt(100 * frac_r if retried else None, '{:.1f}')}"
            f"</b> %")
    if n and not retried:
        text += (" · <b id='ledger-never'>this run never generated a hard prompt again</b>: its solved count is 0 by "
                 "construction, not a measure of learning")
    elif n - retried:
        text += f" · {n - retried} hard prompt(s) were never generated again (no chance to be solved)"
    return text


HARD_SET, HARD_SET_NONE = "hard_set", "not evaluated (scripts/study.py)"  # the study's evals name (bapo_vl.study)


def hard_set_result(evals: pd.DataFrame) -> dict | None:
    """The run's latest held-out hard-set evaluation {step, unlocked_fraction, hard_set_size, k}, which
    scripts/study.py writes into the record; None if it has none."""
    e = evals[evals["name"] == HARD_SET] if not evals.empty else evals
    if e.empty:
        return None
    last = e[e["step"] == e["step"].max()]
    return {"step": int(last["step"].iloc[0]), **dict(zip(last["metric"], last["value"].astype(float)))}


def hard_set_cell(evals: pd.DataFrame) -> str:
    """The hard-set figure in a few words (Compare's table), or HARD_SET_NONE."""
    h = hard_set_result(evals)
    if h is None:
        return HARD_SET_NONE
    return f"{h['unlocked_fraction']:.3f} of {int(h['hard_set_size'])} (k = {int(h['k'])}, step {h['step']})"


def hard_set_text(evals: pd.DataFrame) -> str:
    """The algorithm-neutral measure beside the ledger's: of the held-out prompts the start policy got 0/k right,
    the fraction this run's policy solves >= 1/k. Every run is judged on the same prompts, retried or not."""
    h = hard_set_result(evals)
    head = "Held-out hard set (algorithm-neutral, the same prompts for every run): "
    if h is None:
        return f"{head}<b id='hard-set-none'>{HARD_SET_NONE}</b>"
    k, n = int(h["k"]), int(h["hard_set_size"])
    return (f"{head}unlocked <b id='hard-set-unlocked'>{h['unlocked_fraction']:.3f}</b> of "
            f"<b id='hard-set-size'>{n}</b> prompts that the start policy got 0/{k} right, now solved ≥ 1/{k} "
            f"(k = <b id='hard-set-k'>{k}</b>, at step {h['step']})")


LEDGER_SOLVED, LEDGER_RETRIED, LEDGER_NEVER, LEDGER_ALL = (
    "solved later", "retried, not solved", "never retried", "all")
LEDGER_FILTERS = (LEDGER_SOLVED, LEDGER_RETRIED, LEDGER_NEVER, LEDGER_ALL)


def ledger_table(ledger: pd.DataFrame, which: str, limit: int) -> tuple[pd.DataFrame, int]:
    """The ledger's prompts as a table (uid, first seen, retries, first solved, steps to solve), most recent
    first; `which` in LEDGER_FILTERS. Returns (at most `limit` rows, how many matched)."""
    solved = ledger["first_solved"].notna()
    picks = {LEDGER_SOLVED: (solved, "first_solved"), LEDGER_RETRIED: (~solved & (ledger["retries"] > 0), "first_seen"),
             LEDGER_NEVER: (ledger["retries"] == 0, "first_seen"), LEDGER_ALL: (solved | ~solved, "first_seen")}
    rows, by = picks[which]
    df = ledger[rows].sort_values([by, "uid"], ascending=[False, True])
    total = len(df)
    df = df.head(limit)
    out = pd.DataFrame({"uid": df["uid"], "first seen": df["first_seen"].astype(int),
                        "retries": df["retries"].astype(int),
                        "first solved": df["first_solved"].map(lambda v: "" if pd.isna(v) else int(v)),
                        "steps to solve": (df["first_solved"] - df["first_seen"]).map(
                            lambda v: "" if pd.isna(v) else int(v))})
    return out.reset_index(drop=True), total


# ----------------------------------------------------------------------------- Accuracy bins and migration


def histogram_frame(bins: list[int], G: int) -> pd.DataFrame:
    labels = bin_labels(G)
    counts = list(bins) + [0] * (G + 1 - len(bins))
    return pd.DataFrame({"bin": labels, "prompts": counts[:G + 1]})


CELLS_COUNT, CELLS_ROW = "counts", "row %"
CELLS = (CELLS_COUNT, CELLS_ROW)
MATRIX_CORNER = "from \\ to"


def matrix_frame(m: list[list[int]], G: int, cells: str = CELLS_COUNT) -> pd.DataFrame:
    """The migration matrix as a table: first column the row's bin (at the first step), one column per bin;
    cells=row %: each row as percentages of its prompts (so a row of few prompts reads as well as a large one)."""
    labels = bin_labels(G)
    a = np.array(m if m else [[0] * (G + 1) for _ in range(G + 1)], dtype=float)
    if cells == CELLS_ROW:
        a = np.round(100 * a / np.maximum(a.sum(axis=1, keepdims=True), 1), 1)
        df = pd.DataFrame(a, columns=labels)
    else:
        df = pd.DataFrame(a.astype(int), columns=labels)
    df.insert(0, MATRIX_CORNER, labels)
    return df


def matrix_style(df: pd.DataFrame):
    """Shade each cell by its share of its row (light -> dark blue), so one big cell does not wash out the rest;
    opaque colours with a text colour to match read on a light and a dark page. Diagonal cells in bold."""
    values = df.iloc[:, 1:].to_numpy(dtype=float)
    share = values / np.maximum(values.sum(axis=1, keepdims=True), 1e-12)
    lo, hi = np.array([236, 242, 250]), np.array([31, 74, 128])

    def shade(col):
        j = df.columns.get_loc(col.name) - 1
        out = []
        for i, v in enumerate(col):
            if not v:
                out.append("")
                continue
            a = share[i, j]
            rgb = (lo + (hi - lo) * (0.15 + 0.85 * a)).round().astype(int)
            css = f"background-color: rgb({rgb[0]}, {rgb[1]}, {rgb[2]}); color: {'white' if a > 0.45 else 'black'}"
            out.append(css + ("; font-weight: bold" if i == j else ""))
        return out

    styler = df.style.apply(shade, subset=list(df.columns[1:]))
    if any(pd.api.types.is_float_dtype(t) for t in df.dtypes.iloc[1:]):  # row %: one decimal, never "81.400000"
        styler = styler.format("{:.1f}", subset=list(df.columns[1:]))
    return styler


# ----------------------------------------------------------------------------- Prompt drill-down


def history_frame(history: pd.DataFrame) -> pd.DataFrame:
    """(step, accuracy, subset): correct/G of each group of this prompt, per subset (its label)."""
    if history.empty:
        return pd.DataFrame(columns=["step", "accuracy", "subset"])
    return pd.DataFrame({"step": history["step"], "accuracy": history["correct"] / history["G"].clip(lower=1),
                         "subset": history["subset"].map(lambda s: SUBSET_LABELS.get(s, s))})


def history_spec(history: pd.DataFrame, height: int) -> dict:
    """A prompt's accuracy per step, a point per group, coloured by subset as in every tab."""
    return line_spec(history_frame(history), "step", "accuracy", "subset", "Accuracy (correct / G) per step", height,
                     y_domain=(0, 1), points=True, colors={SUBSET_LABELS[s]: c for s, c in SUBSET_COLORS.items()})


def history_table(history: pd.DataFrame) -> pd.DataFrame:
    if history.empty:
        return pd.DataFrame(columns=["step", "subset", "correct"])
    return pd.DataFrame({"step": history["step"], "subset": history["subset"].map(lambda s: SUBSET_LABELS.get(s, s)),
                         "correct": history["correct"].astype(str) + "/" + history["G"].astype(str)})


def prompt_text(detail: dict) -> str:
    """The prompt as HTML. Its text, answer and uid are data from the task and may hold anything (``` fences,
    <img> tags): each is escaped, never interpreted as Markdown or HTML."""
    esc = lambda v: html.escape(str(v), quote=True)
    if not detail["found"]:
        return f"<p>no prompt with uid <code>{esc(detail['uid'])}</code> in this run</p>"
    text = detail["text"] if detail["text"] is not None else "(text not recorded)"
    h = detail["history"]
    gen = h[h["subset"].isin(GENERATED)]
    seen = (f"generated for at {gen['step'].nunique()} step(s), replayed (X3) at "
            f"{int((h['subset'] == X3).sum())}") if not h.empty else "never seen in training yet"
    return (f"<p><b>uid</b> <code>{esc(detail['uid'])}</code> · {seen}</p>"
            f"<pre class='prompt-body' style='white-space: pre-wrap'>{esc(text)}</pre>"
            f"<p><b>answer</b> <code>{esc(answer_text(detail['answer']))}</code></p>")


def answer_text(answer) -> str:
    """A task's answer as one line: a dict's fields as "key value" joined by " · ", lists by ", "
    (`{"letter": "C", "choices": ["68", "73"]}` -> `letter C · choices 68, 73`); anything else as str()."""
    def one(v):
        return ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    if isinstance(answer, dict):
        return " · ".join(f"{k} {one(v)}" for k, v in answer.items())
    return one(answer)


def no_match_text(query: str) -> str:
    return f"<p id='prompt-none'>no prompt matches <code>{html.escape(query)}</code> (by uid or text)</p>"


def list_text(what: str, n: int, shown: int) -> str:
    more = f", the first {shown} listed" if n > shown else ""
    return (f"<p id='prompt-list'>{html.escape(what)}: <b id='prompt-list-n'>{n}</b> prompt(s){more} "
            f"(pick one above)</p>")


# ----------------------------------------------------------------------------- Responses at a step


def responses_text(step: int, wanted: int | None, n: int, total: int, shown: int, sampled_steps: int,
                   query: str) -> str:
    """What the responses table holds: the step (and why, if not the one asked for), how many match of those
    sampled there, and how many are listed."""
    moved = "" if wanted is None or wanted == step else f" (no responses were sampled at step {wanted})"
    what = f" containing <code>{html.escape(query)}</code>" if query else ""
    more = f"; the first {shown} listed" if n > shown else ""
    return (f"step <b id='responses-at'>{step}</b>{moved}: <b id='responses-n'>{n}</b> of {total} sampled responses"
            f"{what} match{more} · responses were sampled at {sampled_steps} step(s); the record keeps a sample of "
            f"each step's responses, not all of them")


# ----------------------------------------------------------------------------- Compare runs

X_STEP, X_ROLLOUTS, X_WALL = "step", "rollouts generated", "wall time (min)"
X_AXES = (X_STEP, X_ROLLOUTS, X_WALL)
SOLVED_METRIC = "hard prompts solved later (cumulative)"
SOLVED_SHARE = "solved % of retried (cumulative)"  # the ledger's measure that compares runs that retry
# the evaluation metrics Compare offers: accuracies, not the counts beside them (problems, k, verdicts, set size)
EVAL_MEASURES = ("mean@k", "pass@k", "greedy", "unlocked_fraction")


def compare_metrics(metrics_by_run: dict[str, pd.DataFrame], evals_by_run: dict[str, pd.DataFrame]) -> list[str]:
    """Every metric any of the runs recorded: the per-step ones (rewards first), eval '<set> <metric>', and the
    ledger's cumulative solved count."""
    first = ["fresh_reward", "reward"]
    seen = dict.fromkeys(first)
    for m in metrics_by_run.values():
        seen.update(dict.fromkeys(c for c in m.columns if c not in ("step", "time")))
    evals = dict.fromkeys(f"{EVAL_PREFIX}{n} {k}" for e in evals_by_run.values() if not e.empty
                          for n, k in zip(e["name"], e["metric"]) if k in EVAL_MEASURES)
    return [*seen, *evals, SOLVED_METRIC, SOLVED_SHARE]


def wall_minutes(metrics: pd.DataFrame, started: float | None) -> pd.Series:
    """Minutes since the run started (meta created_at; else the first step's commit less its recorded time)."""
    t = metrics["time"].astype(float)
    if started is None:
        first = sum(float(metrics[c].iloc[0]) for c in PHASES if c in metrics and pd.notna(metrics[c].iloc[0]))
        started = float(t.iloc[0]) - first
    return (t - started) / 60


def compare_frame(runs: dict[str, dict], metric: str, x_axis: str) -> pd.DataFrame:
    """runs: {label: {"metrics", "evals", "ledger", "started"}} -> (x, value, run) of `metric` for each run that
    recorded it, x on `x_axis` (X_AXES)."""
    out = []
    for label, r in runs.items():
        m = r["metrics"]
        if m.empty:
            continue
        xs = {X_STEP: m["step"].astype(float), X_ROLLOUTS: m["rollouts"].fillna(0).cumsum() if "rollouts" in m else
              pd.Series(np.nan, index=m.index), X_WALL: wall_minutes(m, r.get("started"))}[x_axis]
        if metric == SOLVED_METRIC:
            curve = ledger_curve(r["ledger"], m["step"])
            ys = curve[curve["series"] == HARD_SOLVED].set_index("step")["prompts"].reindex(m["step"]).to_numpy()
            df = pd.DataFrame({"x": xs.to_numpy(), "value": ys})
        elif metric == SOLVED_SHARE:
            df = pd.DataFrame({"x": xs.to_numpy(), "value": solved_share(r["ledger"], m["step"])})
        elif metric.startswith(EVAL_PREFIX) and metric not in m:
            e = r["evals"]
            e = e[(EVAL_PREFIX + e["name"] + " " + e["metric"]) == metric]
            if e.empty:
                continue
            # an evaluation sits at the x of the last training step at or before it
            i = np.searchsorted(m["step"].to_numpy(), e["step"].to_numpy(), side="right") - 1
            df = pd.DataFrame({"x": np.where(i >= 0, xs.to_numpy()[np.maximum(i, 0)], 0.0),
                               "value": e["value"].to_numpy()})
        elif metric in m:
            df = pd.DataFrame({"x": xs.to_numpy(), "value": pd.to_numeric(m[metric], errors="coerce").to_numpy()})
        else:
            continue
        out.append(df.dropna().assign(run=label))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=["x", "value", "run"])


GROUP_NONE, GROUP_ALGO, GROUP_SEED = "each run", "algorithm", "seed"
GROUPINGS = {GROUP_NONE: None, GROUP_ALGO: "algo", GROUP_SEED: "seed"}  # Compare's "group runs by": config field


def group_of(config: dict, grouping: str) -> str:
    """The group a run belongs to under `grouping` (GROUPINGS): its algorithm, or 'seed <n>'."""
    value = config.get(GROUPINGS[grouping], "?")
    return f"seed {value}" if grouping == GROUP_SEED else str(value)


def grouped_frame(curves: pd.DataFrame, groups: dict[str, str]) -> tuple[pd.DataFrame, list[str]]:
    """(x, value, lo, hi, run) with `run` = '<group> (n runs)': per group, the mean of its runs' curves (x, value,
    run) and the band mean ± sd, at every x of any of its runs within the range all of them reached (each run
    interpolated linearly between its own points): equal x for every run, e.g. equal rollouts. Also the groups
    left out because their runs share no x range."""
    out, apart = [], []
    for group in dict.fromkeys(groups[r] for r in dict.fromkeys(curves["run"]) if r in groups):
        members = [r for r in dict.fromkeys(curves["run"]) if groups.get(r) == group]
        series = [curves[curves["run"] == r].sort_values("x").drop_duplicates("x", keep="last") for r in members]
        lo, hi = max(s["x"].min() for s in series), min(s["x"].max() for s in series)
        if lo > hi:
            apart.append(group)
            continue
        grid = np.unique(np.concatenate([s["x"].to_numpy(dtype=float) for s in series]))
        grid = grid[(grid >= lo) & (grid <= hi)]
        values = np.vstack([np.interp(grid, s["x"].to_numpy(dtype=float), s["value"].to_numpy(dtype=float))
                            for s in series])
        mean, sd = values.mean(axis=0), values.std(axis=0, ddof=1) if len(series) > 1 else np.zeros(len(grid))
        label = f"{group} ({len(series)} run{'s' if len(series) > 1 else ''})"
        out.append(pd.DataFrame({"x": grid, "value": mean, "lo": mean - sd, "hi": mean + sd, "run": label}))
    frame = pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=["x", "value", "lo", "hi", "run"])
    return frame, apart


# the runs table: config fields (column title) shown for every run compared
CONFIG_COLUMNS = {"algo": "algo", "task": "task", "model": "model", "seed": "seed", "batch_size": "B",
                  "group_size": "G", "delay": "v", "reeval_every": "m", "lr": "lr"}
DIFFERS = "background-color: #fde68a; color: #1f2937; font-weight: bold"  # a config value not shared by all runs


def runs_table(configs: dict[str, dict]) -> pd.DataFrame:
    """One row per run: its label and the CONFIG_COLUMNS of its config ('' where it has none)."""
    rows = [{"run": label, **{title: _cell(config.get(field)) for field, title in CONFIG_COLUMNS.items()}}
            for label, config in configs.items()]
    return pd.DataFrame(rows, columns=["run", *CONFIG_COLUMNS.values()])


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def differing(table: pd.DataFrame) -> list[str]:
    """The config columns of the runs table whose values are not the same for every run."""
    return [c for c in table.columns[1:] if table[c].nunique() > 1]


def runs_style(table: pd.DataFrame):
    """The runs table with the columns that differ between the runs shaded (DIFFERS), readable on a light and a
    dark page."""
    cols = differing(table)
    return table.style.apply(lambda col: [DIFFERS] * len(col), subset=cols) if cols and len(table) else table.style


HARD_SET_COLUMN = "held-out hard set unlocked (algorithm-neutral)"
HARD_COLUMN, RETRIED_COLUMN = "hard (0/G at first)", "retried"


def compare_table(runs: dict[str, dict]) -> pd.DataFrame:
    """A summary row per run: its algorithm and task, size, reward early and late, the ledger with its retries
    (comparable between runs that retry), and the held-out hard set unlocked (comparable between any runs)."""
    rows = []
    for label, r in runs.items():
        s = summary(r["steps"], r["ledger"])
        retried, solved_r, frac_r = retry_counts(r["ledger"])
        config = r.get("config", {})
        rows.append({"run": label, "algo": config.get("algo", "?"), "task": config.get("task", "?"),
                     "steps": s["last_step"], "rollouts": s["rollouts"],
                     "fresh reward, first 20 %": _round(s["fresh_reward_first"], 4),
                     "fresh reward, last 20 %": _round(s["fresh_reward_last"], 4),
                     HARD_COLUMN: s["first_unsolved"], RETRIED_COLUMN: retried,
                     "later solved": s["later_solved"],
                     "solved % of all": round(100 * s["later_solved_fraction"], 1),
                     "solved % of retried": round(100 * frac_r, 1) if retried else None,
                     HARD_SET_COLUMN: hard_set_cell(r["evals"])})
    cols = ["run", "algo", "task", "steps", "rollouts", "fresh reward, first 20 %", "fresh reward, last 20 %",
            HARD_COLUMN, RETRIED_COLUMN, "later solved", "solved % of all", "solved % of retried", HARD_SET_COLUMN]
    return pd.DataFrame(rows, columns=cols)


def group_text(grouping: str, x_axis: str, apart: list[str]) -> str:
    """What a grouped comparison draws, and the groups it could not."""
    text = (f"<span id='compare-grouped'>grouped by {grouping}: each line is the mean of its runs at equal "
            f"{x_axis}, the band ± one standard deviation, over the range every run of the group reached")
    if x_axis != X_ROLLOUTS:
        text += f" (x-axis '{X_ROLLOUTS}' compares them at equal rollouts)"
    text += "</span>"
    if apart:
        text += f"<br>not drawn: {html.escape(', '.join(apart))} (their runs share no range of {x_axis})"
    return text


def compare_notes(table: pd.DataFrame, errors: dict[str, str]) -> str:
    """What the comparison cannot show as numbers: runs that could not be read, runs of different tasks on one
    axis, and runs that never generate a hard prompt again (their 'later solved' is 0 by construction, not
    comparable with a run that retries)."""
    notes = [f"<b class='compare-error'>{html.escape(lab)}</b>: {html.escape(msg)}" for lab, msg in errors.items()]
    tasks = sorted(set(map(str, table["task"])))
    if len(tasks) > 1:
        notes.append(f"<span class='compare-tasks'>these runs train on different tasks "
                     f"({html.escape(', '.join(tasks))}): their curves share the axes but measure different "
                     f"things</span>")
    for row in table.to_dict("records"):
        if row[HARD_COLUMN] and not row[RETRIED_COLUMN]:  # hard prompts, none retried
            notes.append(f"<span class='compare-never'><b>{html.escape(str(row['run']))}</b> never generated a hard "
                         f"prompt again (no re-evaluation): its 'later solved' is 0 by construction; compare "
                         f"'solved % of retried', or the held-out hard set (scripts/study.py)</span>")
    return "<br>".join(notes) if notes else ""
