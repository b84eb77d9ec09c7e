"""Pure plot functions: data read from a run record (bapo_vl.reader, app/data.py) -> the long-format tables the plots
draw and the text the tabs show. No Gradio and no SQL here, so each is testable on its own."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from bapo_vl.reader import ledger_counts, step_summary, summary
from bapo_vl.record import FILTERED, GENERATED, NOT_PROMOTED, X1, X2, X3

# series labels (the legend); kept here so code and tests use the same strings
FRESH_REWARD = "fresh reward (train)"
BATCH_REWARD = "batch reward (train)"
EVAL_PREFIX = "eval "
# one label and one colour per subset (bapo_vl.record's vocabulary), the same in every tab
SUBSET_LABELS = {X1: "X1 (fresh, kept)", FILTERED: "fresh, filtered out", X2: "X2 (re-evaluated, promoted)",
                 NOT_PROMOTED: "re-evaluated, not promoted", X3: "X3 (replayed)"}
SUBSET_COLORS = {X1: "#4c78a8", FILTERED: "#9ecae9", X2: "#f58518", NOT_PROMOTED: "#ffbf79", X3: "#54a24b"}
B_LINE = "configured B"
PHASES = {"t_generate": "generate", "t_score": "score", "t_train": "train", "t_sync": "sync"}
BUFFERS = {"bad_size": "B_bad", "high_size": "B_high"}
THRESHOLDS = {"c1": "c1", "c2": "c2", "c3": "c3", "r_tot": "r_tot"}
HARD_SEEN = "first seen at 0/G (cumulative)"
HARD_SOLVED = "later reached ≥ 1/G (cumulative)"
ROLLOUT_KINDS = {"rollouts": "all", "rollouts_fresh": "fresh", "rollouts_reevaluated": "re-evaluation"}
MAX_BARS = 125  # stacked bar charts show at most this many bars (means of consecutive steps beyond)
MAX_POINTS = 250  # line charts show at most about this many points per series (means of consecutive steps beyond)
MAX_TOOLTIPS = 300  # a line chart with more points than this has no per-point tooltips (each is an SVG mark)


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


def smooth(df: pd.DataFrame, columns, window: int) -> pd.DataFrame:
    """Trailing rolling mean of `columns` over `window` steps (1: unchanged)."""
    if window <= 1 or df.empty:
        return df
    df = df.copy()
    for c in columns:
        if c in df:
            df[c] = df[c].rolling(window, min_periods=1).mean()
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


# ----------------------------------------------------------------------------- Overview


def reward_frame(steps: pd.DataFrame, evals: pd.DataFrame, window: int = 1) -> pd.DataFrame:
    """(step, reward, series): fresh and batch reward per step (smoothed), and each evaluation's mean@k."""
    train = long(smooth(steps, ["fresh_reward", "reward"], window), "step",
                 {"fresh_reward": FRESH_REWARD, "reward": BATCH_REWARD}, "reward", "series")
    ev = evals[evals["metric"] == "mean@k"] if not evals.empty else evals
    if ev.empty:
        return train
    ev = pd.DataFrame({"step": ev["step"], "reward": ev["value"], "series": EVAL_PREFIX + ev["name"] + " mean@k"})
    return pd.concat([train, ev], ignore_index=True)


def rollouts_frame(steps: pd.DataFrame) -> pd.DataFrame:
    """(step, rollouts, kind): responses generated so far (cumulative), all / fresh / re-evaluation."""
    cum = steps[["step"]].copy()
    for c in ROLLOUT_KINDS:
        if c in steps:
            cum[c] = steps[c].fillna(0).cumsum()
    return long(cum, "step", ROLLOUT_KINDS, "rollouts", "kind")


def overview_text(run_label: str, meta: dict, config: dict, steps: pd.DataFrame, evals: pd.DataFrame) -> str:
    if steps.empty:
        return f"**{run_label}** · status **{meta.get('status', '?')}** · no step recorded yet"
    last = steps.iloc[-1]
    total_rollouts = step_summary(steps)["rollouts"]
    seconds = float(steps[list(PHASES)].fillna(0).to_numpy().sum())
    parts = [f"**{run_label}**", f"status **{meta.get('status', '?')}**",
             f"algo {config.get('algo', '?')}", f"task {config.get('task', '?')}",
             f"B = {config.get('batch_size', fmt(last.get('batch_size')))}", f"G = {config.get('group_size', '?')}"]
    lines = [" · ".join(parts),
             (f"last step: <b id='last-step'>{int(last['step'])}</b> of {config.get('steps', '?')} · "
              f"rollouts: <b id='total-rollouts'>{total_rollouts}</b> · "
              f"fresh reward at last step: {fmt(last['fresh_reward'], '{:.3f}')} · "
              f"wall time recorded: {seconds / 60:.1f} min")]
    if not evals.empty:
        e = evals[evals["metric"] == "mean@k"]
        if not e.empty:
            at = e["step"].max()
            lines.append("evaluation at step " + str(int(at)) + ": " + ", ".join(
                f"{r.name} mean@k {r.value:.3f}" for r in e[e["step"] == at].itertuples()))
    return "\n\n".join(lines)


# ----------------------------------------------------------------------------- Batch composition


def stacked_spec(wide: pd.DataFrame, series: dict[str, str], colors: list[str], title: str, y_title: str,
                 height: int, line: tuple[str, str] | None = None, max_bars: int = MAX_BARS) -> dict:
    """A Vega-Lite chart of one stacked bar per step: the `series` columns of `wide` (column -> legend label)
    stacked in that order from the bottom, and optionally `line` = (column, label) drawn as a dashed level over
    each bar. Native Gradio bar plots stack in label order and cannot overlay a line. Beyond `max_bars` steps,
    each bar is the mean of k consecutive steps (said in the title): fewer marks keep the browser quick."""
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
            bars.append({"step": span, "x0": first - 0.45, "x1": last + 0.45, "y0": y, "y1": y + n,
                         "series": series[c], "value": round(n, 4)})
            y += n
        if line and not pd.isna(v := getattr(r, line[0])):
            level += [{"step": span, "x": first - 0.5, "level": float(v)}, {"step": span, "x": last + 0.5, "level": float(v)}]
    top = max([b["y1"] for b in bars] + [v["level"] for v in level] + [0])
    lo, hi = (int(wide["first"].min()), int(wide["last"].max())) if len(wide) else (0, 1)
    x = {"type": "quantitative", "title": "step", "axis": {"tickMinStep": 1, "format": "d"},
         "scale": {"domain": [lo - 0.5, hi + 0.5], "nice": False, "zero": False}}
    domain, rng = labels + ([line[1]] if line else []), colors[:len(labels)] + (["#222222"] if line else [])
    color = {"type": "nominal", "title": None, "legend": {"orient": "bottom"}, "scale": {"domain": domain, "range": rng}}
    layers = [{"data": {"values": bars}, "mark": {"type": "rect", "strokeWidth": 0},
               "encoding": {"x": {**x, "field": "x0"}, "x2": {"field": "x1"},
                            "y": {"field": "y0", "type": "quantitative", "title": y_title,
                                  "scale": {"domain": [0, nice_max(top)]}},
                            "y2": {"field": "y1"}, "color": {**color, "field": "series"},
                            "tooltip": [{"field": "step"}, {"field": "series", "title": " "},
                                        {"field": "value", "type": "quantitative", "title": y_title}]}}]
    if line:
        layers.append({"data": {"values": level}, "mark": {"type": "line", "strokeDash": [5, 3], "strokeWidth": 1.5},
                       "encoding": {"x": {**x, "field": "x"}, "y": {"field": "level", "type": "quantitative"},
                                    "detail": {"field": "step"}, "color": {**color, "datum": line[1]},
                                    "tooltip": [{"field": "step"},
                                                {"field": "level", "type": "quantitative", "title": line[1]}]}})
    return _base(title, height, layers)


def _base(title: str, height: int, layers: list[dict]) -> dict:
    # no width: Gradio's frontend sizes a chart to its container; the empty top-level encoding keeps its theming
    # away from the layers' colors; SVG so that marks are countable (tests) and crisp (screenshots)
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "title": title, "height": height,
            "encoding": {}, "layer": layers, "usermeta": {"embedOptions": {"renderer": "svg"}}}


def _records(df: pd.DataFrame, cols) -> list[dict]:
    out = df[list(cols)].copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = out[c].round(5)
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in out.astype(object).to_dict("records")]


def thin(df: pd.DataFrame, x: str, y: str, color: str | None, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """At most about `max_points` points per series: beyond, the mean of each bucket of k consecutive x values
    (the charts stay quick to draw and to move around in the browser)."""
    if df.empty:
        return df
    n = df.groupby(color).size().max() if color else len(df)
    k = math.ceil(n / max_points)
    if k <= 1:
        return df
    keys = [color] if color else []
    df = df.sort_values([*keys, x]).copy()
    df["_b"] = df.groupby(keys).cumcount() // k if keys else pd.RangeIndex(len(df)) // k
    return df.groupby([*keys, "_b"], as_index=False, sort=False).agg({x: "mean", y: "mean"})


def line_spec(df: pd.DataFrame, x: str, y: str, color: str | None, title: str, height: int,
              x_title: str | None = None, y_title: str | None = None, y_domain=None, zero: bool = False,
              points: bool = False, integer_x: bool = True, colors: dict[str, str] | None = None) -> dict:
    """Lines (one per `color` value, in order of first appearance), with a tooltip on every point; `colors` fixes
    the colour of given values."""
    order = list(dict.fromkeys(df[color])) if color and not df.empty else []  # legend: order of appearance
    df = thin(df, x, y, color) if not points else df
    xs = {"field": x, "type": "quantitative", "title": x_title or x, "scale": {"zero": False, "nice": False}}
    if integer_x:
        xs["axis"] = {"tickMinStep": 1, "format": "d"}
    ys = {"field": y, "type": "quantitative", "title": y_title or y, "scale": {"zero": zero}}
    if y_domain:
        ys["scale"]["domain"] = list(y_domain)
    enc = {"x": xs, "y": ys, "tooltip": [{"field": x, "type": "quantitative", "title": x_title or x},
                                         {"field": y, "type": "quantitative", "title": y_title or y, "format": ".4~g"}]}
    if color:
        scale = {"domain": order, **({"range": [colors.get(o, "#888888") for o in order]} if colors else {})}
        enc["color"] = {"field": color, "type": "nominal", "title": None, "legend": {"orient": "bottom"},
                        "scale": scale}
        enc["tooltip"].append({"field": color, "type": "nominal", "title": " "})
    data_ = {"values": _records(df, [c for c in (x, y, color) if c])}
    if points:
        layers = [{"data": data_, "mark": {"type": "circle", "size": 45, "opacity": 0.85, "strokeWidth": 0},
                   "encoding": enc}]
    else:
        layers = [{"data": data_, "mark": {"type": "line", "strokeWidth": 1.6},
                   "encoding": {k: v for k, v in enc.items() if k != "tooltip"}}]
        if len(df) <= MAX_TOOLTIPS:  # invisible points that carry the tooltips (one SVG mark each: not for big plots)
            layers.append({"data": data_, "mark": {"type": "circle", "size": 40, "opacity": 0, "strokeWidth": 0},
                           "encoding": enc})
    return _base(title, height, layers)


def bar_spec(df: pd.DataFrame, x: str, y: str, title: str, height: int, color: str = "#4c78a8") -> dict:
    """One bar per `x` category, in the frame's order, from 0."""
    top = float(df[y].max()) if not df.empty else 0
    enc = {"x": {"field": x, "type": "ordinal", "sort": list(df[x]), "title": x, "axis": {"labelAngle": 0}},
           "y": {"field": y, "type": "quantitative", "title": y, "scale": {"domain": [0, nice_max(top)]}},
           "tooltip": [{"field": x}, {"field": y, "type": "quantitative"}]}
    return _base(title, height, [{"data": {"values": _records(df, [x, y])},
                                  "mark": {"type": "bar", "color": color, "strokeWidth": 0}, "encoding": enc}])


def composition_spec(steps: pd.DataFrame, height: int = 200) -> dict:
    """|X1|, |X2|, |X3| per step, stacked in that order from the bottom, against the configured B (dashed)."""
    batch = (X1, X2, X3)  # the step columns x1, x2, x3 count the groups of the subsets of those names
    return stacked_spec(steps, {s: SUBSET_LABELS[s] for s in batch}, [SUBSET_COLORS[s] for s in batch],
                        "Batch composition: |X1| + |X2| + |X3| against the configured B", "groups", height,
                        line=("batch_size", B_LINE))


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
    """Fresh groups (kept or filtered) per accuracy bin 0/G..G/G at each step, stacked with 0/G at the bottom."""
    labels = bin_labels(G)
    wide = pd.DataFrame([[s, *((list(b) if b else []) + [0] * (G + 1))[:G + 1]]
                         for s, b in zip(steps["step"], steps["bins"])], columns=["step", *map(str, range(G + 1))])
    wide.columns = ["step", *(f"b{i}" for i in range(G + 1))]
    return stacked_spec(wide, {f"b{i}": labels[i] for i in range(G + 1)}, bin_colors(G),
                        "Fresh groups by accuracy bin (correct / G)", "groups", height)


def time_spec(steps: pd.DataFrame, height: int = 200) -> dict:
    """Wall time per step, stacked: generate, score, train, sync."""
    return stacked_spec(steps, PHASES, ["#4c78a8", "#f58518", "#e45756", "#72b7b2"], "Wall time per step",
                        "seconds", height)


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
            f"steps with X2: {s['steps_with_x2']}, with X3: {s['steps_with_x3']}")


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


def ledger_text(ledger: pd.DataFrame, G: int) -> str:
    n, k, frac = ledger_counts(ledger)
    return (f"Prompts that were 0/{G} the first time they were generated for: <b id='ledger-hard'>{n}</b> · "
            f"later reached ≥ 1/{G}: <b id='ledger-solved'>{k}</b> "
            f"(<b id='ledger-fraction'>{100 * frac:.1f}</b> %)")


def ledger_table(ledger: pd.DataFrame, which: str, limit: int) -> tuple[pd.DataFrame, int]:
    """The ledger's prompts as a table (uid, first seen, first solved, steps to solve), most recent first;
    `which` in LEDGER_FILTERS. Returns (at most `limit` rows, how many matched)."""
    df = ledger
    if which == "solved later":
        df = df[df["first_solved"].notna()].sort_values(["first_solved", "uid"], ascending=[False, True])
    elif which == "not solved yet":
        df = df[df["first_solved"].isna()].sort_values(["first_seen", "uid"], ascending=[False, True])
    else:
        df = df.sort_values(["first_seen", "uid"], ascending=[False, True])
    total = len(df)
    df = df.head(limit)
    out = pd.DataFrame({"uid": df["uid"], "first seen": df["first_seen"].astype(int),
                        "first solved": df["first_solved"].map(lambda v: "" if pd.isna(v) else int(v)),
                        "steps to solve": (df["first_solved"] - df["first_seen"]).map(
                            lambda v: "" if pd.isna(v) else int(v))})
    return out.reset_index(drop=True), total


LEDGER_FILTERS = ("solved later", "not solved yet", "all")


# ----------------------------------------------------------------------------- Accuracy bins and migration


def histogram_frame(bins: list[int], G: int) -> pd.DataFrame:
    labels = bin_labels(G)
    counts = list(bins) + [0] * (G + 1 - len(bins))
    return pd.DataFrame({"bin": labels, "prompts": counts[:G + 1]})


def matrix_frame(m: list[list[int]], G: int) -> pd.DataFrame:
    """The migration matrix as a table: first column the row's bin (at the first step), one column per bin."""
    labels = bin_labels(G)
    if not m:
        m = [[0] * (G + 1) for _ in range(G + 1)]
    df = pd.DataFrame(m, columns=labels)
    df.insert(0, "from \\ to", labels)
    return df


def matrix_style(df: pd.DataFrame):
    """Shade each cell by its count (white -> blue), diagonal cells outlined: a heat map that stays a table."""
    values = df.iloc[:, 1:]
    top = max(int(values.to_numpy().max()) if values.size else 0, 1)

    def shade(col):
        out = []
        for i, v in enumerate(col):
            a = v / top
            css = f"background-color: rgba(76, 120, 168, {0.08 + 0.8 * a:.2f}); color: {'white' if a > 0.55 else 'black'}"
            if df.columns.get_loc(col.name) - 1 == i:
                css += "; font-weight: bold"
            out.append(css if v else "")
        return out

    return df.style.apply(shade, subset=list(df.columns[1:]))


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
    if not detail["found"]:
        return f"no prompt with uid `{detail['uid']}` in this run"
    text = detail["text"] if detail["text"] is not None else "(text not recorded)"
    h = detail["history"]
    gen = h[h["subset"].isin(GENERATED)]
    seen = (f"generated for at {gen['step'].nunique()} step(s), replayed (X3) at "
            f"{int((h['subset'] == X3).sum())}") if not h.empty else "never seen in training yet"
    return (f"**uid** `{detail['uid']}` · {seen}\n\n```text\n{text}\n```\n\n**answer** `{detail['answer']}`")


# ----------------------------------------------------------------------------- Compare runs


def compare_frames(runs: dict[str, tuple], metric: str, window: int = 1):
    """runs: {label: (steps, evals, ledger)} -> (metric per step with the rollouts generated so far: step, value,
    rollouts, run; hard problems solved so far per step: step, prompts, run; a summary row per run)."""
    curves, solved, rows = [], [], []
    for label, (steps, evals, ledger) in runs.items():
        if steps.empty:
            continue
        cum = steps["rollouts"].fillna(0).cumsum()
        if metric in (FRESH_REWARD, BATCH_REWARD):
            col = "fresh_reward" if metric == FRESH_REWARD else "reward"
            y = smooth(steps, [col], window)[col]
            df = pd.DataFrame({"step": steps["step"], "value": y, "rollouts": cum})
        else:  # evaluation: mean of the sets' mean@k at each evaluated step
            e = evals[evals["metric"] == "mean@k"]
            e = e[~e["name"].str.endswith("/average")] if (~e["name"].str.endswith("/average")).any() else e
            e = e.groupby("step", as_index=False)["value"].mean()
            # rollouts generated by the last training step at or before each evaluation
            i = np.searchsorted(steps["step"].to_numpy(), e["step"].to_numpy(), side="right") - 1
            df = pd.DataFrame({"step": e["step"], "value": e["value"],
                               "rollouts": np.where(i >= 0, cum.to_numpy()[np.maximum(i, 0)], 0)})
        df["run"] = label
        curves.append(df)
        curve = ledger_curve(ledger, steps["step"])
        curve = curve[curve["series"] == HARD_SOLVED].assign(run=label)
        solved.append(curve[["step", "prompts", "run"]])
        s = summary(steps, ledger)
        rows.append({"run": label, "steps": s["last_step"], "rollouts": s["rollouts"],
                     "fresh reward, first 20 %": _round(s["fresh_reward_first"], 4),
                     "fresh reward, last 20 %": _round(s["fresh_reward_last"], 4),
                     "hard (0/G at first)": s["first_unsolved"], "later solved": s["later_solved"],
                     "solved %": round(100 * s["later_solved_fraction"], 1)})
    cat = lambda xs, cols: pd.concat(xs, ignore_index=True) if xs else pd.DataFrame(columns=cols)
    return cat(curves, ["step", "value", "rollouts", "run"]), cat(solved, ["step", "prompts", "run"]), pd.DataFrame(rows)


COMPARE_METRICS = (FRESH_REWARD, BATCH_REWARD, "eval mean@k (mean over sets)")
