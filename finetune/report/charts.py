"""Line charts as inline SVG: axes, ticks, one polyline per run, every drawn point an element.

Written by hand because the page must be one self-contained file (no network, no script library):
a few dozen lines of SVG do what a plotting library would, and every point carries its step and
value as data attributes (`data-step`, `data-value`) so a browser test can count and check them.
A series longer than `MAX_POINTS` is thinned (`decimate`) keeping each bucket's lowest and highest
value, so spikes stay visible; its group says how many points were logged and how many are drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

MAX_POINTS = 600
WIDTH, HEIGHT = 520, 250
LEFT, RIGHT, TOP, BOTTOM = 64, 26, 12, 34
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


@dataclass
class Series:
    """One run's points of one metric: (step, value) pairs in step order; `skipped` counts the
    records whose value could not be drawn (nonfinite, written "nan" or "inf" by the log)."""

    run: str
    color: str
    points: list[tuple[float, float]]
    skipped: int = 0


def fmt(value: float) -> str:
    """A number for a tick or a tooltip, short.

    >>> fmt(0.00030000001), fmt(1234567.0), fmt(2.0), fmt(-0.5)
    ('0.0003', '1.235e+06', '2', '-0.5')
    """
    return f"{value:.4g}"


def tick_text(value: float) -> str:
    """A tick label: whole numbers in full with thousands separators, others as `fmt`.

    >>> tick_text(20000), tick_text(0.25), tick_text(3e-05)
    ('20,000', '0.25', '3e-05')
    """
    if float(value).is_integer() and abs(value) < 1e12:
        return f"{int(value):,}"
    return fmt(value)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values spanning [low, high] (1, 2 or 5 times a power of ten apart); a flat range
    is widened by a tenth of its value.

    >>> nice_ticks(0.0, 1.0)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    >>> nice_ticks(3.0, 3.0)
    [2.6, 2.8, 3.0, 3.2, 3.4]
    >>> nice_ticks(1, 7)
    [0, 2, 4, 6, 8]
    >>> nice_ticks(-1e308, 1e308)  # a range beyond the largest float: no overflow
    [-1e+308, -5e+307, 0, 5e+307, 1e+308]
    """
    if high <= low:
        pad = abs(low) / 10 or 1.0
        low, high = low - pad, high + pad
    count = max(count, 1)
    raw = high / count - low / count  # (high - low) / count, which overflows for huge values
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    digits = max(0, -math.floor(math.log10(step)) + 1)  # no 0.6000000000000001 on an axis
    first = math.floor(low / step)
    ticks = []
    k = first
    while not ticks or ticks[-1] < high:
        value = round(k * step, digits)
        ticks.append(int(value) if float(step).is_integer() and abs(value) < 1e15 else value)
        k += 1
    return ticks


def decimate(points: list[tuple[float, float]], max_points: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most about `max_points` of `points`: the first and last, and each bucket's lowest and
    highest value in step order (a spike survives, unlike every-n-th sampling).

    >>> pts = [(i, float(i % 7)) for i in range(1000)]
    >>> kept = decimate(pts, 100)
    >>> len(kept) <= 102, kept[0] == pts[0], kept[-1] == pts[-1], max(v for _, v in kept)
    (True, True, True, 6.0)
    """
    if len(points) <= max_points:
        return list(points)
    buckets = max((max_points - 2) // 2, 1)
    inner = points[1:-1]
    size = len(inner) / buckets
    kept = [points[0]]
    for b in range(buckets):
        chunk = inner[int(b * size) : int((b + 1) * size)]
        if chunk:
            low, high = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
            kept.extend(sorted({low, high}))
    kept.append(points[-1])
    return kept


def line_chart(key: str, title: str, series: list[Series], *, source: str) -> str:
    """A <figure> with the SVG chart of `series` (one polyline per run) and its legend; `key` and
    `source` (steps or evals) are data attributes for tests."""
    drawn = [(s, decimate(s.points)) for s in series]
    xs = [x for _, pts in drawn for x, _ in pts] or [0.0]
    ys = [y for _, pts in drawn for _, y in pts] or [0.0]
    x_ticks, y_ticks = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    if all(float(t).is_integer() for t in xs):  # steps: whole-number ticks only
        x_ticks = [t for t in x_ticks if float(t).is_integer()] or x_ticks

    def px(x: float) -> float:
        return LEFT + (x - x_ticks[0]) / ((x_ticks[-1] - x_ticks[0]) or 1) * (WIDTH - LEFT - RIGHT)

    def py(y: float) -> float:
        return (
            HEIGHT - BOTTOM - (y - y_ticks[0]) / ((y_ticks[-1] - y_ticks[0]) or 1) * (HEIGHT - TOP - BOTTOM)
        )

    parts = [
        f'<svg class="plot" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">'
    ]
    parts += _axes(x_ticks, y_ticks, px, py)
    for s, pts in drawn:
        parts.append(
            f'<g class="series" data-run="{escape(s.run)}" data-logged="{len(s.points)}" '
            f'data-drawn="{len(pts)}" data-skipped="{s.skipped}" stroke="{s.color}" fill="{s.color}">'
        )
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke-width="1.6" points="{line}"/>')
        radius = 2.6 if len(pts) <= 60 else 0.9  # dense series: the line shows the shape
        for x, y in pts:
            step = (
                int(x) if x.is_integer() else x
            )  # exact values in the attributes, short ones in the tooltip
            parts.append(
                f'<circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="{radius}" '
                f'data-step="{step!r}" data-value="{y!r}"><title>{escape(s.run)} step {step}: '
                f"{fmt(y)}</title></circle>"
            )
        parts.append("</g>")
    parts.append("</svg>")
    return (
        f'<figure class="chart" data-key="{escape(key)}" data-source="{escape(source)}">'
        f"<figcaption>{escape(title)}</figcaption>{''.join(parts)}{_legend(drawn)}</figure>"
    )


def _axes(x_ticks, y_ticks, px, py) -> list[str]:
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    out = ['<g class="axes" stroke="#999" font-size="10" fill="#444">']
    for t in y_ticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{LEFT - 5}" y="{y + 3:.1f}" text-anchor="end" stroke="none">{tick_text(t)}</text>'
        )
    for t in x_ticks:
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}"/>')
        out.append(
            f'<text x="{x:.1f}" y="{bottom + 15}" text-anchor="middle" stroke="none">{tick_text(t)}</text>'
        )
    out.append(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}"/>')
    out.append(f'<line x1="{LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}"/>')
    out.append(
        f'<text x="{(LEFT + right) / 2:.0f}" y="{HEIGHT - 4}" text-anchor="middle" stroke="none">step</text>'
    )
    out.append("</g>")
    return out


def _legend(drawn: list[tuple[Series, list]]) -> str:
    items = []
    for s, pts in drawn:
        notes = []
        if len(pts) < len(s.points):
            notes.append(f"{len(pts)} of {len(s.points)} points drawn")
        if s.skipped:
            notes.append(f"{s.skipped} nonfinite not drawn")
        note = f" ({'; '.join(notes)})" if notes else ""
        items.append(
            f'<li><span class="swatch" style="background:{s.color}"></span>{escape(s.run)}{escape(note)}</li>'
        )
    return f'<ul class="legend">{"".join(items)}</ul>'
