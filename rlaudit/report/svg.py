"""Small-multiple line charts drawn as SVG text, for the run report's metrics-over-steps grid.

Every scenario of ``rlaudit run`` gets that grid; drawn by matplotlib it cost ~0.5 s of CPU per
scenario plus ~0.6 s to import matplotlib (a scenario's last half second, and 15 s of a 31-scenario
``run --all``). What the grid shows is simple -- a few lines of a handful of points per panel,
error bars, titles, ticks, one legend -- so it is written here directly (milliseconds): a
standalone SVG (vector, sharp at any zoom) that browsers show inline and as a file.

    svg = panel_grid("kl_k3: metrics over steps", [Panel("actor/pg_loss", [Series("fsdp",
                     [0, 1], [0.12, 0.10], PALETTE[0])])], columns=4)

Non-finite values (nan, inf) are left out of a line, which breaks there, and said in the panel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from rlaudit.report.render import esc

#: line colours, in the order backends are listed (matplotlib's default cycle, for continuity
#: with the reports' other plots)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
FLAG = "#cf222e"  # the title of a panel whose metric failed its golden
BAND = "#5a5a5a"  # golden +/- tolerance marks

#: panel size and inner margins (px): room for the title, the tick labels and "step"
PANEL_W, PANEL_H = 360, 240
LEFT, RIGHT, TOP, BOTTOM = 66, 14, 26, 36
HEAD, FOOT = 30, 30  # the figure title above the grid, the legend below it


@dataclasses.dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    colour: str


@dataclasses.dataclass
class Band:
    """Intervals ``[lo, hi]`` drawn as error bars with a hollow square at their middle."""

    xs: Sequence[float]
    lo: Sequence[float]
    hi: Sequence[float]
    label: str = "golden ± tol"


@dataclasses.dataclass
class Panel:
    title: str
    series: list[Series]
    band: Band | None = None
    flagged: bool = False  # drawn with a red bold title


def nice_step(lo: float, hi: float, ticks: int = 5) -> float:
    """The 1, 2, 2.5 or 5 x 10^k step whose multiples within ``[lo, hi]`` (``hi > lo``) number
    closest to ``ticks`` (the larger step on a tie)."""
    power = 10.0 ** math.floor(math.log10((hi - lo) / max(1, ticks - 1)))
    best = None
    for step in (m * power * scale for scale in (0.1, 1, 10) for m in (1, 2, 2.5, 5)):
        count = math.floor(hi / step + 1e-9) - math.ceil(lo / step - 1e-9) + 1
        key = (abs(count - ticks), -step)
        if best is None or key < best[0]:
            best = (key, step)
    return best[1]


def y_range(values: Sequence[float]) -> tuple[float, float]:
    """An axis range around finite ``values``: their span plus 8 % each side; a zero span (one
    value, or all equal) opens to +/- 5 % of the value (+/- 1 around zero)."""
    lo, hi = min(values), max(values)
    span = hi - lo
    if span <= abs(hi) * 1e-12:  # also a zero span at zero
        half = abs(hi) * 0.05 or 1.0
        return lo - half, hi + half
    return lo - 0.08 * span, hi + 0.08 * span


def ticks_between(lo: float, hi: float, ticks: int = 5) -> list[float]:
    """Multiples of :func:`nice_step` within ``[lo, hi]`` (a near-zero multiple is 0)."""
    step = nice_step(lo, hi, ticks)
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [0.0 if k == 0 else k * step for k in range(first, last + 1)]


def tick_labels(values: Sequence[float]) -> list[str]:
    """The shortest ``%g`` texts (fewest significant digits) that tell the ticks apart and each
    read back as its tick (to a millionth of their spacing)."""
    gaps = [abs(b - a) for a, b in zip(values, values[1:]) if b != a]
    tol = min(gaps) * 1e-6 if gaps else 0.0
    for digits in range(1, 18):
        labels = [_g(v, digits) for v in values]
        if (len(set(labels)) == len(labels)
                and all(abs(float(t) - v) <= tol for t, v in zip(labels, values))):
            return labels
    return [repr(float(v)) for v in values]


def _g(v: float, digits: int) -> str:
    text = f"{v:.{digits}g}"
    return "0" if text in ("-0", "0") else text


def x_ticks(lo: int, hi: int) -> list[int]:
    """Integer ticks (training steps) from ``lo`` to ``hi``: every one up to 10, else a nice
    stride."""
    if hi - lo <= 10:
        return list(range(lo, hi + 1))
    stride = max(1, round(nice_step(lo, hi, 6)))
    return list(range(lo - lo % stride + (stride if lo % stride else 0), hi + 1, stride))


def _finite(v) -> bool:
    """A finite number (numpy and torch scalars too: a target's metrics may be either)."""
    if isinstance(v, (str, bytes)):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _segments(xs, ys) -> list[list[tuple[float, float]]]:
    """Runs of consecutive points with finite values (a non-finite one breaks the line)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys):
        if _finite(y):
            runs[-1].append((float(x), float(y)))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _num(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _text(x, y, s, *, size=10, anchor="middle", colour="#1f2328", weight="normal") -> str:
    return (f'<text x="{_num(x)}" y="{_num(y)}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{colour}" font-weight="{weight}">{esc(s)}</text>')


def _marker_square(x, y, size, colour) -> str:
    h = size / 2
    return (f'<rect x="{_num(x - h)}" y="{_num(y - h)}" width="{_num(size)}" '
            f'height="{_num(size)}" fill="none" stroke="{colour}" stroke-width="1.2"/>')


def _panel(p: Panel, ox: float, oy: float) -> list[str]:
    """One panel's elements, its top-left corner at (ox, oy)."""
    out = [_text(ox + LEFT + (PANEL_W - LEFT - RIGHT) / 2, oy + 16, p.title, size=11,
                 colour=FLAG if p.flagged else "#1f2328",
                 weight="bold" if p.flagged else "normal")]
    x0, y0 = ox + LEFT, oy + TOP
    w, h = PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM
    xs = [float(x) for s in p.series for x, y in zip(s.xs, s.ys) if _finite(y)]
    ys = [float(y) for s in p.series for y in s.ys if _finite(y)]
    band = [] if p.band is None else [
        (float(x), float(lo), float(hi)) for x, lo, hi in zip(p.band.xs, p.band.lo, p.band.hi)
        if _finite(lo) and _finite(hi)]
    xs += [x for x, _, _ in band]
    ys += [v for _, lo, hi in band for v in (lo, hi)]
    out.append(f'<rect x="{_num(x0)}" y="{_num(y0)}" width="{_num(w)}" height="{_num(h)}" '
               f'fill="#fff" stroke="#9ca3af" stroke-width="1"/>')
    skipped = sum(not _finite(y) for s in p.series for y in s.ys)
    if not ys:
        why = f"no finite values ({skipped} non-finite)" if skipped else "no values"
        out.append(_text(x0 + w / 2, y0 + h / 2, why, colour="#6e7781"))
        return out
    xlo, xhi = int(math.floor(min(xs))), int(math.ceil(max(xs)))
    xmin, xmax = (xlo - 0.4, xhi + 0.4) if xhi > xlo else (xlo - 1.0, xhi + 1.0)
    ymin, ymax = y_range(ys)
    sx = lambda x: x0 + (x - xmin) / (xmax - xmin) * w  # noqa: E731
    sy = lambda y: y0 + h - (y - ymin) / (ymax - ymin) * h  # noqa: E731
    yt = ticks_between(ymin, ymax)
    for t, label in zip(yt, tick_labels(yt)):
        out.append(f'<line x1="{_num(x0)}" y1="{_num(sy(t))}" x2="{_num(x0 + w)}" '
                   f'y2="{_num(sy(t))}" stroke="#e5e7eb" stroke-width="1"/>')
        out.append(_text(x0 - 5, sy(t) + 3.5, label, size=9, anchor="end"))
    for t in x_ticks(xlo, xhi):
        out.append(f'<line x1="{_num(sx(t))}" y1="{_num(y0)}" x2="{_num(sx(t))}" '
                   f'y2="{_num(y0 + h)}" stroke="#e5e7eb" stroke-width="1"/>')
        out.append(_text(sx(t), y0 + h + 13, str(t), size=9))
    out.append(_text(x0 + w / 2, y0 + h + 29, "step", size=9))
    for x, lo, hi in band:
        cx, ylo, yhi = sx(x), sy(lo), sy(hi)
        out.append(f'<path d="M{_num(cx)},{_num(ylo)}V{_num(yhi)}M{_num(cx - 6)},{_num(ylo)}'
                   f'H{_num(cx + 6)}M{_num(cx - 6)},{_num(yhi)}H{_num(cx + 6)}" '
                   f'stroke="{BAND}" stroke-width="1.2" fill="none"/>')
        out.append(_marker_square(cx, (ylo + yhi) / 2, 10, BAND))
    for s in p.series:
        for run in _segments(s.xs, s.ys):
            pts_text = " ".join(f"{_num(sx(x))},{_num(sy(y))}" for x, y in run)
            if len(run) > 1:
                out.append(f'<polyline points="{pts_text}" fill="none" stroke="{s.colour}" '
                           f'stroke-width="1.6"/>')
            out += [f'<circle cx="{_num(sx(x))}" cy="{_num(sy(y))}" r="2.8" fill="{s.colour}"/>'
                    for x, y in run]
    if skipped:
        out.append(_text(x0 + w - 4, y0 + 12, f"{skipped} non-finite value(s) not drawn",
                         size=9, anchor="end", colour=FLAG))
    return out


def _legend(entries: list[tuple[str, str, str]], cx: float, y: float) -> list[str]:
    """One centred row: ``(label, colour, kind)`` with kind "line" or "band"."""
    widths = [30 + 6.2 * len(label) for label, _, _ in entries]
    x = cx - sum(widths) / 2
    out = []
    for (label, colour, kind), width in zip(entries, widths):
        if kind == "band":
            out.append(f'<path d="M{_num(x + 11)},{_num(y - 7)}V{_num(y + 7)}" stroke="{colour}" '
                       f'stroke-width="1.2"/>')
            out.append(_marker_square(x + 11, y, 10, colour))
        else:
            out.append(f'<path d="M{_num(x)},{_num(y)}H{_num(x + 22)}" stroke="{colour}" '
                       f'stroke-width="1.6"/>')
            out.append(f'<circle cx="{_num(x + 11)}" cy="{_num(y)}" r="2.8" fill="{colour}"/>')
        out.append(_text(x + 27, y + 4, label, size=10, anchor="start"))
        x += width
    return out


def panel_grid(title: str, panels: Sequence[Panel], *, columns: int = 4,
               legend: Sequence[tuple[str, str]] | None = None) -> str:
    """The panels in rows of ``columns`` under ``title``, as an SVG document, with one legend:
    the band (when a panel has one), then ``legend``'s ``(label, colour)`` entries (default:
    every series label, in the order first seen, with its first colour)."""
    columns = max(1, min(columns, len(panels)))
    rows = math.ceil(len(panels) / columns)
    width, height = columns * PANEL_W, HEAD + rows * PANEL_H + FOOT
    body = [_text(width / 2, 20, title, size=13)]
    for i, p in enumerate(panels):
        body += _panel(p, (i % columns) * PANEL_W, HEAD + (i // columns) * PANEL_H)
    entries: dict[str, tuple[str, str]] = {}
    for p in panels:
        if p.band is not None and len(p.band.xs):
            entries.setdefault(p.band.label, (BAND, "band"))
    if legend is None:
        legend = [(s.label, s.colour) for p in panels for s in p.series]
    for label, colour in legend:
        entries.setdefault(label, (colour, "line"))
    body += _legend([(k, c, kind) for k, (c, kind) in entries.items()], width / 2,
                    height - FOOT / 2)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="Helvetica,Arial,sans-serif">'
            f'<rect width="100%" height="100%" fill="#fff"/>' + "".join(body) + "</svg>\n")
