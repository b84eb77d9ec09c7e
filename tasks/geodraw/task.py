"""Geodraw: procedurally drawn geometry diagrams whose answer needs the image; four choices A-D.

Every problem is generated from a seed (no data files) and drawn with Pillow: a white square image, thick black
lines, large digits in Pillow's built-in font (ImageFont.load_default(size=...), no font file). The numbers that
determine the answer are written ONLY in the diagram; the question text holds no digit ("Find x.", "Find the area
of the rectangle.") and the four choices follow it, as in Geometry3K. Kinds:

  triangle   a triangle with two interior angles written next to their vertices and the third marked x°: x.
  parallel   two parallel lines (arrow marks) cut by a transversal; one angle written at one crossing, x° marked
             at the other (corresponding, alternate, co-interior ... angles): x is that angle or its supplement.
  circle     a circle with a radius (or a diameter) drawn and its length written: the diameter, the radius or the
             circumference (choices "14 \\pi").
  rectangle  a rectangle with its two side lengths written: its area or its perimeter.

The choices carry no hint of the answer: each problem first draws its set of four choices (neighbouring values:
angles 5 degrees apart, lengths 1-2 apart; the parallel kind {t, u, 180-t, 180-u}), THEN the right one uniformly
among them, THEN diagram parameters that give that answer. Choices are listed in ascending order, so the right
letter is uniform, and the question and choices alone give any reader 1/4 in expectation (load(...,
blank_images=True) makes the same problems with a blank white image, to show that a policy needs the picture).

Splits: train (10,000 problems), val (500) and test (500, the EVAL_SPLITS), each a seeded stream of its own
(random.Random(f"geodraw/{split}/{seed}")). They are disjoint by construction: every problem's drawn parameters
have a key (triangle: its two written angles, unordered; parallel: the transversal's angle, the written angle's
line and corner and x's corner; circle: question, written length, the segment's direction sector and label side;
rectangle: question, both sides and which sides carry the labels), and a hash of the key puts it in one split
only (1/10 test, 1/10 val, 8/10 train). Answers and choices are drawn from values that have keys in the split,
so the hold-out does not tell a text-only reader which choice is right either. Same seed: byte-identical images
and texts; `limit` keeps a prefix (problem i does not depend on how many are made).

Each Problem: uid `geodraw-{split}-{i}`; messages as geometry3k builds them (an image part, then the question, the
choices A-D and the instruction; template "value" asks for \\boxed{} instead); images = [the diagram, PIL RGB];
answer = {"letter", "value", "choices", "precise_values"} graded by bapo_vl.verifiers.choice (a letter, or a value
that picks the single nearest choice); meta = {split, index, seed, kind, question, key, spec, template, blank,
image_size}, where spec is the JSON-able drawing recipe: render(spec, image_size) redraws the image.

layout(spec, image_size) says what is written where (each label's text and centre, each character's ink centre):
what a reader of the image must find, e.g. to supervise a vision tower patch by patch.

Determinism holds for one Pillow build (glyph rasterisation may differ between FreeType versions).
"""
from __future__ import annotations

import functools
import hashlib
import math
import random

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from bapo_vl.problem import Problem
from bapo_vl.verifiers.choice import verify as verify_choice

NAME = "geodraw"
# the Geometry3K choice verifier (bapo_vl.verifiers.choice) decides; bump with it or with the answer format
VERSION = "geodraw-1.1"
EVAL_SPLITS = ["test"]
KINDS = ("triangle", "parallel", "circle", "rectangle")
SPLIT_SIZES = {"train": 10_000, "val": 500, "test": 500}
HELD_OUT = {"test": 0, "val": 1}  # a key's bucket (of BUCKETS) for these splits; train has the others
BUCKETS = 10
IMAGE_SIZE = 224
REF = 224.0  # drawing coordinates are for a REF x REF canvas, scaled to image_size
LETTERS = "ABCD"
SPAN = 6  # a choice set: 4 of SPAN neighbouring candidate values
TEMPLATES = ("letter", "value")

# as geometry3k's make_messages (tasks/geometry3k/task.py)
INSTRUCTION = ("Answer with the letter of the correct choice. Think step by step, then give the final "
               "letter inside <answer> </answer> tags, e.g. <answer>A</answer>.")
VALUE_INSTRUCTION = ("Think step by step, then give the final answer (a number or expression, without units) "
                     "inside \\boxed{}, e.g. \\boxed{12}.")

QUESTIONS = {
    ("triangle", "angle"): "Find x.",
    ("parallel", "angle"): "The two lines marked with arrows are parallel. Find x.",
    ("circle", "diameter"): "Find the diameter of the circle.",
    ("circle", "radius"): "Find the radius of the circle.",
    ("circle", "circumference"): "Find the circumference of the circle.",
    ("rectangle", "area"): "Find the area of the rectangle.",
    ("rectangle", "perimeter"): "Find the perimeter of the rectangle.",
}
SUBS = {kind: tuple(sub for k, sub in QUESTIONS if k == kind) for kind in KINDS}
STEPS = {("triangle", "angle"): 5, ("circle", "diameter"): 2, ("circle", "circumference"): 2,
         ("rectangle", "perimeter"): 2}  # spacing of neighbouring choices (default 1)

TRIANGLE_MIN = 25  # smallest written triangle angle; x is then 20..130
PARALLEL_ACUTE = range(52, 81)  # the transversal's acute angle
CIRCLE_R = range(2, 41)
RECT_SIDES = range(2, 16)
SECTORS = 16  # circle: the segment's direction, in sectors of 360/16 degrees (part of the key)


def make_messages(question: str, choices: list[str], template: str = "letter") -> list[dict]:
    if template == "letter":
        text = question + "\nChoices:\n" + "\n".join(f"{letter}. {c}" for letter, c in zip(LETTERS, choices))
        text += "\n" + INSTRUCTION
    else:
        text = f"{question}\n{VALUE_INSTRUCTION}"
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


# --- keys, split membership, the values each split can ask ---------------------------------------------------

def bucket(key: tuple) -> int:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big") % BUCKETS


def split_of(key: tuple) -> str:
    b = bucket(key)
    return next((s for s, hb in HELD_OUT.items() if hb == b), "train")


def _keys(kind: str, sub: str):
    """(answer value, key) of every drawable problem of (kind, sub); the key holds the drawn parameters."""
    if kind == "triangle":
        for a in range(TRIANGLE_MIN, 181):
            for b in range(a, 181):
                x = 180 - a - b
                if 20 <= x <= 130:
                    yield x, ("triangle", "angle", a, b)
    elif kind == "parallel":
        for t in PARALLEL_ACUTE:
            for theta in (t, 180 - t):
                for line in (0, 1):
                    for q in range(4):
                        for qx in range(4):
                            yield _corner_value(theta, qx), ("parallel", "angle", theta, line, q, qx)
    elif kind == "circle":
        for r in CIRCLE_R:
            given, value = (2 * r, r) if sub == "radius" else (r, 2 * r)
            for sector in range(SECTORS):
                for side in (0, 1):
                    yield value, ("circle", sub, given, sector, side)
    elif kind == "rectangle":
        for w in RECT_SIDES:
            for h in RECT_SIDES:
                value = w * h if sub == "area" else 2 * (w + h)
                for wside in (0, 1):
                    for hside in (0, 1):
                        yield value, ("rectangle", sub, w, h, wside, hside)


@functools.lru_cache(maxsize=None)
def pool(kind: str, sub: str, split: str) -> dict[int, list[tuple]]:
    """{answer value: [keys of `split` with that answer]} of (kind, sub): the values `split` may ask."""
    out: dict[int, list[tuple]] = {}
    for value, key in _keys(kind, sub):
        if split_of(key) == split:
            out.setdefault(value, []).append(key)
    return out


def _corner_value(theta: int, corner: int) -> int:
    """The angle of a corner at a crossing: 0 upper right, 1 upper left, 2 lower left, 3 lower right, when the
    transversal leaves the line at `theta` degrees (counterclockwise from the line's right-hand ray)."""
    return theta if corner in (0, 2) else 180 - theta


def _window(rng: random.Random, values: list[int], step: int) -> list[int]:
    """4 of SPAN neighbouring values (one residue class mod `step`), ascending."""
    classes = [c for c in (sorted(v for v in values if v % step == r) for r in range(step)) if len(c) >= SPAN]
    cls = rng.choice(classes)
    i = rng.randrange(len(cls) - SPAN + 1)
    return sorted(rng.sample(cls[i:i + SPAN], 4))


def _choice_set(rng: random.Random, kind: str, sub: str, split: str) -> list[int]:
    values = pool(kind, sub, split)
    if kind == "parallel":
        acute = [t for t in PARALLEL_ACUTE if t in values and 180 - t in values]
        t, u = rng.sample(acute, 2)
        return sorted({t, u, 180 - t, 180 - u})
    return _window(rng, sorted(values), STEPS.get((kind, sub), 1))


# --- one problem's recipe ------------------------------------------------------------------------------------

def _u(rng: random.Random, lo: float, hi: float) -> float:
    return round(rng.uniform(lo, hi), 2)


def make_spec(rng: random.Random, split: str, kinds=KINDS) -> dict:
    """A problem's recipe: kind, question, choices, the right one, its key and the drawing's parameters."""
    kind = rng.choice(list(kinds))
    sub = rng.choice(SUBS[kind])
    values = _choice_set(rng, kind, sub, split)
    answer = rng.choice(values)
    key = rng.choice(pool(kind, sub, split)[answer])
    spec = {"kind": kind, "sub": sub, "choices": values, "answer": answer, "key": list(key)}
    if kind == "triangle":
        a, b = key[2:]
        if rng.random() < 0.5:
            a, b = b, a
        angles = [a, b, answer]
        shift = rng.randrange(3)  # which vertex (counterclockwise) is x
        spec |= {"angles": angles[shift:] + angles[:shift], "x_vertex": (2 - shift) % 3,
                 "rotation": _u(rng, 0, 360)}
    elif kind == "parallel":
        theta, line, q, qx = key[2:]
        spec |= {"theta": theta, "written_line": line, "written_corner": q, "x_corner": qx,
                 "written": _corner_value(theta, q), "y": [_u(rng, 76, 84), _u(rng, 140, 148)],
                 "x_center": _u(rng, 108, 116)}
    elif kind == "circle":
        given, sector, side = key[2:]
        spec |= {"given": given, "direction": round((sector + rng.uniform(0.1, 0.9)) * 360 / SECTORS, 2),
                 "side": side, "center": [_u(rng, 106, 118), _u(rng, 106, 118)], "radius_px": _u(rng, 74, 84)}
    else:
        w, h, wside, hside = key[2:]
        spec |= {"w": w, "h": h, "w_label": ("top", "bottom")[wside], "h_label": ("left", "right")[hside],
                 "center": [_u(rng, 106, 118), _u(rng, 104, 116)]}
    return spec


def choice_texts(spec: dict) -> tuple[list[str], list[float]]:
    if spec["sub"] == "circumference":
        return [f"{v} \\pi" for v in spec["choices"]], [v * math.pi for v in spec["choices"]]
    return [str(v) for v in spec["choices"]], [float(v) for v in spec["choices"]]


# --- drawing -------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _font(px: int):
    return ImageFont.load_default(size=px)


def _unit(x: float, y: float) -> tuple[float, float]:
    n = math.hypot(x, y)
    return (x / n, y / n) if n else (0.0, 0.0)


def _cross(a, b) -> float:
    return a[0] * b[1] - a[1] * b[0]


class Canvas:
    """A white image of `size` px drawn in REF x REF coordinates (y down)."""

    def __init__(self, size: int):
        self.size, self.k = size, size / REF
        self.image = Image.new("RGB", (size, size), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.font = _font(max(8, round(30 * self.k)))
        self.width = max(1, round(3 * self.k))
        self.labels: list[tuple[str, float, float]] = []  # (text, x, y): each label and its centre, px
        self.glyphs: list[tuple[str, float, float]] = []  # (character, x, y): each character's ink centre, px

    def _p(self, p) -> tuple[float, float]:
        return (p[0] * self.k, p[1] * self.k)

    def line(self, points, width: int | None = None):
        self.draw.line([self._p(p) for p in points], fill="black", width=width or self.width, joint="curve")

    def circle(self, center, radius: float, fill=None):
        (x, y), r = self._p(center), radius * self.k
        self.draw.ellipse([x - r, y - r, x + r, y + r], outline="black", fill=fill, width=self.width)

    def arc(self, center, radius: float, start: float, sweep: float):
        """An arc from `start` degrees (clockwise from 3 o'clock, as on screen) over `sweep` degrees clockwise."""
        (x, y), r = self._p(center), radius * self.k
        self.draw.arc([x - r, y - r, x + r, y + r], start, start + sweep, fill="black",
                      width=max(1, round(2 * self.k)))

    def box(self, text: str) -> tuple[float, float, float, float]:
        """The text's box around its anchor, in REF units (left, top, right, bottom)."""
        left, top, right, bottom = self.draw.textbbox((0, 0), text, font=self.font, anchor="mm")
        return left / self.k, top / self.k, right / self.k, bottom / self.k

    def half(self, text: str) -> tuple[float, float]:
        left, top, right, bottom = self.box(text)
        return (right - left) / 2 + 2, (bottom - top) / 2 + 2  # with the white margin

    def label(self, text: str, center):
        """`text` centred at `center` (kept inside the canvas) on a white box, so no line runs through it."""
        left, top, right, bottom = self.box(text)
        hw, hh = (right - left) / 2 + 2, (bottom - top) / 2 + 2
        cx = min(max(center[0], hw + 1), REF - hw - 1)
        cy = min(max(center[1], hh + 1), REF - hh - 1)
        self.draw.rectangle([(cx - hw) * self.k, (cy - hh) * self.k, (cx + hw) * self.k, (cy + hh) * self.k],
                            fill="white")
        anchor = self._p((cx - (left + right) / 2, cy - (top + bottom) / 2))
        self.draw.text(anchor, text, font=self.font, fill="black", anchor="mm")
        self.labels.append((text, *anchor))
        # where each character's ink lies: the text's origin (left, baseline), then each character drawn alone after
        # the advance of those before it, on a mask of its own
        whole = self.draw.textbbox(anchor, text, font=self.font, anchor="mm")
        at_zero = self.draw.textbbox((0, 0), text, font=self.font, anchor="ls")
        ox, oy = whole[0] - at_zero[0], whole[1] - at_zero[1]
        for i, ch in enumerate(text):
            mask = Image.new("L", self.image.size)
            ImageDraw.Draw(mask).text((ox + self.font.getlength(text[:i]), oy), ch, font=self.font, fill=255,
                                      anchor="ls")
            ink = np.asarray(mask, dtype=np.float64)
            if ink.any():  # the centre of the ink's mass: on the stroke of a "1", not beside it
                total = ink.sum()
                self.glyphs.append((ch, float((ink.sum(0) * np.arange(ink.shape[1])).sum() / total) + 0.5,
                                    float((ink.sum(1) * np.arange(ink.shape[0])).sum() / total) + 0.5))


def _offset(canvas: Canvas, text: str, direction, gap: float) -> float:
    """How far along unit `direction` a label's centre must be for its box to be `gap` beyond the start point."""
    hw, hh = canvas.half(text)
    return gap + hw * abs(direction[0]) + hh * abs(direction[1])


def _in_wedge(canvas: Canvas, text: str, apex, r1, r2, avoid=(), band=(0.0, REF), clear: float = 15.0,
              gap: float = 3.0) -> tuple[float, float] | None:
    """The centre of a label inside the wedge from ray r1 to ray r2 (unit vectors, less than 180 degrees apart):
    the nearest place to the apex, on one of a few directions in the wedge, where its box keeps `gap` from both
    rays and `clear` from the apex (the angle's arc), stays in the canvas and `gap` inside the horizontal band (top y,
    bottom y) and overlaps none of the boxes `avoid` (left, top, right, bottom); None if there is none."""
    hw, hh = canvas.half(text)
    sign = 1.0 if _cross(r1, r2) > 0 else -1.0
    spread = math.atan2(sign * _cross(r1, r2), r1[0] * r2[0] + r1[1] * r2[1])  # the wedge's angle, radians
    base = math.atan2(r1[1], r1[0])
    directions = []
    for f in (0.5, 0.4, 0.6, 0.3, 0.7, 0.2, 0.8):
        a = base + sign * f * spread
        directions.append((math.cos(a), math.sin(a)))

    def fits(c) -> bool:
        left, top, right, bottom = c[0] - hw, c[1] - hh, c[0] + hw, c[1] + hh
        if left < 1 or top < 1 or right > REF - 1 or bottom > REF - 1:
            return False
        corners = [(x - apex[0], y - apex[1]) for x in (left, right) for y in (top, bottom)]
        if not all(sign * _cross(r1, p) >= gap and sign * _cross(p, r2) >= gap for p in corners):
            return False
        nx, ny = min(max(apex[0], left), right), min(max(apex[1], top), bottom)  # the box's point nearest the apex
        if math.hypot(nx - apex[0], ny - apex[1]) < clear:
            return False
        if top < band[0] + gap or bottom > band[1] - gap:
            return False
        return not any(left < b[2] + 2 and b[0] - 2 < right and top < b[3] + 2 and b[1] - 2 < bottom for b in avoid)

    for d in range(6, 160):
        for u in directions:
            c = (apex[0] + u[0] * d, apex[1] + u[1] * d)
            if fits(c):
                return c
    return None


def _screen_angle(v) -> float:
    """Direction of a vector on screen, degrees clockwise from 3 o'clock (PIL's arc convention)."""
    return math.degrees(math.atan2(v[1], v[0])) % 360


def _arc_between(canvas: Canvas, apex, r1, r2, radius: float):
    """An arc in the smaller angle between the rays r1, r2 from apex."""
    a1, a2 = _screen_angle(r1), _screen_angle(r2)
    sweep = (a2 - a1) % 360
    if sweep <= 180:
        canvas.arc(apex, radius, a1, sweep)
    else:
        canvas.arc(apex, radius, a2, 360 - sweep)


def _draw_triangle(canvas: Canvas, spec: dict):
    A, B, C = (math.radians(a) for a in spec["angles"])
    # counterclockwise (y up): V0 at the origin, V1 at (1, 0), V2 from the law of sines; then y flipped for screen
    side = math.sin(B) / math.sin(C)
    pts = [(0.0, 0.0), (1.0, 0.0), (side * math.cos(A), side * math.sin(A))]
    rot = math.radians(spec["rotation"])
    pts = [(x * math.cos(rot) - y * math.sin(rot), -(x * math.sin(rot) + y * math.cos(rot))) for x, y in pts]
    texts = [f"{a}°" for a in spec["angles"]]
    texts[spec["x_vertex"]] = "x°"
    cx, cy = sum(p[0] for p in pts) / 3, sum(p[1] for p in pts) / 3
    outward, offsets = [], []
    for i, (x, y) in enumerate(pts):  # each label outside its vertex, on the bisector of the outer angle
        e1 = _unit(pts[i - 1][0] - x, pts[i - 1][1] - y)
        e2 = _unit(pts[(i + 1) % 3][0] - x, pts[(i + 1) % 3][1] - y)
        u = _unit(-(e1[0] + e2[0]), -(e1[1] + e2[1]))
        if u == (0.0, 0.0):
            u = _unit(x - cx, y - cy)
        outward.append(u)
        offsets.append(_offset(canvas, texts[i], u, gap=5.0))

    halves = [canvas.half(t) for t in texts]

    def extent(scale: float):
        xs, ys = [], []
        for (x, y), u, d, (hw, hh) in zip(pts, outward, offsets, halves):
            lx, ly = scale * x + u[0] * d, scale * y + u[1] * d
            xs += [scale * x, lx - hw, lx + hw]
            ys += [scale * y, ly - hh, ly + hh]
        return min(xs), max(xs), min(ys), max(ys)

    lo, hi = 10.0, 400.0  # the largest scale at which triangle and labels fit in the canvas (4 px margin)
    for _ in range(40):
        mid = (lo + hi) / 2
        x0, x1, y0, y1 = extent(mid)
        lo, hi = (mid, hi) if x1 - x0 <= REF - 8 and y1 - y0 <= REF - 8 else (lo, mid)
    x0, x1, y0, y1 = extent(lo)
    dx, dy = (REF - (x1 - x0)) / 2 - x0, (REF - (y1 - y0)) / 2 - y0
    screen = [(lo * x + dx, lo * y + dy) for x, y in pts]
    canvas.line(screen + [screen[0]])
    for i, p in enumerate(screen):
        e1 = _unit(screen[i - 1][0] - p[0], screen[i - 1][1] - p[1])
        e2 = _unit(screen[(i + 1) % 3][0] - p[0], screen[(i + 1) % 3][1] - p[1])
        _arc_between(canvas, p, e1, e2, 13.0)
    for p, u, d, t in zip(screen, outward, offsets, texts):
        canvas.label(t, (p[0] + u[0] * d, p[1] + u[1] * d))


def _draw_parallel(canvas: Canvas, spec: dict):
    theta = math.radians(spec["theta"])
    up = (math.cos(theta), -math.sin(theta))  # the transversal's upward ray on screen
    ys, xc = spec["y"], spec["x_center"]
    ym = sum(ys) / 2
    cross = [(xc + (ym - y) * math.cos(theta) / math.sin(theta), y) for y in ys]
    for y in ys:
        canvas.line([(4, y), (REF - 4, y)])
    t0, t1 = (ym - 4) / math.sin(theta), (REF - 4 - ym) / math.sin(theta)
    canvas.line([(xc + up[0] * t0, ym + up[1] * t0), (xc - up[0] * t1, ym - up[1] * t1)])
    # parallel marks: the same chevron on both lines, on the side away from the crossings
    ax = 30.0 if sum(p[0] for p in cross) / 2 > REF / 2 else REF - 30.0
    for y in ys:
        canvas.line([(ax - 7, y - 7), (ax + 1, y), (ax - 7, y + 7)], width=max(1, round(3 * canvas.k)))
    rays = [(1.0, 0.0), up, (-1.0, 0.0), (-up[0], -up[1])]  # corner c lies between rays c and c + 1
    marks = [(spec["written_line"], spec["written_corner"], f"{spec['written']}°"),
             (1 - spec["written_line"], spec["x_corner"], "x°")]
    edges = [0.0, *ys, REF]
    items = []
    for line, corner, text in marks:
        apex, r1, r2 = cross[line], rays[corner], rays[(corner + 1) % 4]
        _arc_between(canvas, apex, r1, r2, 12.0)
        # a label stays between its own line and the next one on its side: upper corners above, lower below
        band = (edges[line], edges[line + 1]) if corner < 2 else (edges[line + 1], edges[line + 2])
        items.append((text, apex, r1, r2, band))
    for order in (items, items[::-1]):  # the written label first, else x's
        placed, centres = [], {}
        for text, apex, r1, r2, band in order:
            c = _in_wedge(canvas, text, apex, r1, r2, avoid=placed, band=band)
            if c is None:
                break
            hw, hh = canvas.half(text)
            placed.append((c[0] - hw, c[1] - hh, c[0] + hw, c[1] + hh))
            centres[text] = c
        else:
            break
    for text, apex, r1, r2, _ in items:  # where no order fits (none in 48,000 drawings tried): on the bisector
        u = _unit(r1[0] + r2[0], r1[1] + r2[1])
        canvas.label(text, centres.get(text) or (apex[0] + u[0] * 40, apex[1] + u[1] * 40))


def _draw_circle(canvas: Canvas, spec: dict):
    c, R = spec["center"], spec["radius_px"]
    canvas.circle(c, R)
    canvas.circle(c, 3.5, fill="black")
    phi = math.radians(spec["direction"])
    u = (math.cos(phi), -math.sin(phi))
    end = (c[0] + u[0] * R, c[1] + u[1] * R)
    normal = (-u[1], u[0]) if spec["side"] == 0 else (u[1], -u[0])
    text = str(spec["given"])
    if spec["sub"] == "radius":  # a diameter is drawn and written: label beside its middle (the centre)
        canvas.line([(c[0] - u[0] * R, c[1] - u[1] * R), end])
        at, gap = c, 8.0  # clear of the centre's dot
    else:  # a radius is drawn and written: label beside its middle
        canvas.line([c, end])
        at, gap = (c[0] + u[0] * R / 2, c[1] + u[1] * R / 2), 5.0
    d = _offset(canvas, text, normal, gap=gap)
    canvas.label(text, (at[0] + normal[0] * d, at[1] + normal[1] * d))


def _draw_rectangle(canvas: Canvas, spec: dict):
    aspect = min(max(spec["w"] / spec["h"], 0.5), 2.0)  # not to scale beyond 1:2
    W = min(130.0, 110.0 * aspect)
    H = W / aspect
    cx, cy = spec["center"]
    x0, x1, y0, y1 = cx - W / 2, cx + W / 2, cy - H / 2, cy + H / 2
    canvas.line([(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)])
    m = 9.0  # right-angle marks
    for (x, y), (sx, sy) in zip([(x0, y0), (x1, y0), (x1, y1), (x0, y1)], [(1, 1), (-1, 1), (-1, -1), (1, -1)]):
        canvas.line([(x + sx * m, y), (x + sx * m, y + sy * m), (x, y + sy * m)], width=max(1, round(2 * canvas.k)))
    wt, ht = str(spec["w"]), str(spec["h"])
    if spec["w_label"] == "top":
        canvas.label(wt, (cx, y0 - _offset(canvas, wt, (0, -1), 5.0)))
    else:
        canvas.label(wt, (cx, y1 + _offset(canvas, wt, (0, 1), 5.0)))
    if spec["h_label"] == "left":
        canvas.label(ht, (x0 - _offset(canvas, ht, (-1, 0), 5.0), cy))
    else:
        canvas.label(ht, (x1 + _offset(canvas, ht, (1, 0), 5.0), cy))


DRAW = {"triangle": _draw_triangle, "parallel": _draw_parallel, "circle": _draw_circle, "rectangle": _draw_rectangle}


def render(spec: dict, size: int = IMAGE_SIZE) -> Image.Image:
    """The diagram of a recipe (make_spec's, or a problem's meta["spec"]) as a size x size RGB image."""
    canvas = Canvas(size)
    DRAW[spec["kind"]](canvas, spec)
    return canvas.image


def layout(spec: dict, size: int = IMAGE_SIZE) -> dict[str, list[tuple[str, float, float]]]:
    """What is written in the diagram and where, in the size x size image (px), in drawing order:
    {"labels": [(text, x, y) of each label's centre], "glyphs": [(character, x, y) of the centre of each character's
    ink mass]}:
    what a reader of the image must find."""
    canvas = Canvas(size)
    DRAW[spec["kind"]](canvas, spec)
    return {"labels": canvas.labels, "glyphs": canvas.glyphs}


def blank(size: int = IMAGE_SIZE) -> Image.Image:
    return Image.new("RGB", (size, size), "white")


# --- the plugin ----------------------------------------------------------------------------------------------

def _kinds(kinds) -> tuple[str, ...]:
    if kinds is None:
        return KINDS
    if isinstance(kinds, str):
        kinds = [k.strip() for k in kinds.split(",") if k.strip()]
    if not isinstance(kinds, (list, tuple)) or not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"geodraw: kinds must be a non-empty list of {', '.join(KINDS)}; got {kinds!r}")
    return tuple(dict.fromkeys(kinds))


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"geodraw: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def load(split: str = "train", source: str | None = None, limit: int | None = None, seed: int = 0,
         template: str = "letter", kinds=None, n: int | None = None, image_size: int = IMAGE_SIZE,
         blank_images: bool = False) -> list[Problem]:
    """The first min(n, limit) problems of `split` (train/val/test; n defaults to 10,000/500/500) generated with
    `seed`. kinds: a subset of KINDS (a list or "a,b"); image_size: the square image's side in px; blank_images:
    the same problems with a blank white image. template: "letter" (choices, <answer>X</answer>) or "value"."""
    if source is not None:
        raise ValueError(f"geodraw generates its problems and reads no source (got source={source!r})")
    if split not in SPLIT_SIZES:
        raise ValueError(f"geodraw: unknown split {split!r}; have {', '.join(SPLIT_SIZES)}")
    if template not in TEMPLATES:
        raise ValueError(f"geodraw: unknown template {template!r}; have {', '.join(TEMPLATES)}")
    kinds = _kinds(kinds)
    count = _count("n", n, 0) if n is not None else SPLIT_SIZES[split]
    if limit is not None:
        count = min(count, _count("limit", limit, 0))
    _count("image_size", image_size, 28)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"geodraw: seed must be an integer, got {seed!r}")
    rng = random.Random(f"geodraw/{split}/{seed}")
    problems = []
    for i in range(count):
        spec = make_spec(rng, split, kinds)
        choices, precise = choice_texts(spec)
        right = spec["choices"].index(spec["answer"])
        image = blank(image_size) if blank_images else render(spec, image_size)
        question = QUESTIONS[spec["kind"], spec["sub"]]
        problems.append(Problem(
            uid=f"geodraw-{split}-{i}", messages=make_messages(question, choices, template),
            answer={"letter": LETTERS[right], "value": choices[right], "choices": choices, "precise_values": precise},
            images=[image],
            meta={"split": split, "index": i, "seed": seed, "kind": spec["kind"], "question": spec["sub"],
                  "key": spec["key"], "spec": spec, "template": template, "blank": bool(blank_images),
                  "image_size": image_size}))
    return problems


def verify(response: str, answer):
    return verify_choice(response, answer)
