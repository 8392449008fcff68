"""rlaudit.report.svg: the metrics grid drawn without matplotlib. The charts are read back the
way a person reads them -- a value from where its point sits between two labelled grid lines --
and the ticks checked against their definition (round steps, within range, labels that say the
tick's value)."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaudit.report import svg

NS = "{http://www.w3.org/2000/svg}"


def parse(doc: str) -> ET.Element:
    root = ET.fromstring(doc)
    assert root.tag == f"{NS}svg"
    return root


def texts(root) -> list[ET.Element]:
    return list(root.iter(f"{NS}text"))


def in_plot_area(circle, height) -> bool:
    """A marker inside the panels (not in the legend row at the bottom)."""
    return float(circle.get("cy")) < height - svg.FOOT


def y_axis(root) -> tuple[float, float, float, float]:
    """(pixel, value) of the first two labelled horizontal grid lines of a one-panel chart."""
    lines = [el for el in root.iter(f"{NS}line") if el.get("y1") == el.get("y2")]
    labels = [t for t in texts(root) if t.get("text-anchor") == "end" and t.text is not None
              and t.get("font-size") == "9" and not t.text.endswith("drawn")]
    assert len(lines) >= 2 and len(labels) == len(lines)
    (p0, v0), (p1, v1) = [(float(ln.get("y1")), float(lb.text)) for ln, lb in
                          zip(lines[:2], labels[:2])]
    assert (v1 - v0) / (p1 - p0) < 0  # larger values higher up (SVG's y grows downwards)
    return p0, v0, p1, v1


def value_at(py: float, axis) -> float:
    p0, v0, p1, v1 = axis
    return v0 + (py - p0) * (v1 - v0) / (p1 - p0)


def one_panel(ys, *, xs=None, band=None, title="m", flagged=False) -> ET.Element:
    xs = list(range(len(ys))) if xs is None else xs
    panel = svg.Panel(title, [svg.Series("fsdp", xs, ys, "#1f77b4")], band=band,
                      flagged=flagged)
    return parse(svg.panel_grid("t", [panel], columns=4))


def test_points_sit_at_their_values_read_off_the_labelled_grid():
    ys = [0.0123, 0.0171, 0.0149, -0.002]
    root = one_panel(ys)
    height = float(root.get("height"))
    axis = y_axis(root)
    dots = [c for c in root.iter(f"{NS}circle") if in_plot_area(c, height)]
    assert len(dots) == len(ys)
    dots.sort(key=lambda c: float(c.get("cx")))
    span = max(ys) - min(ys)
    for dot, want in zip(dots, ys):
        # coordinates are written to 1/100 px over a ~180 px tall plot
        assert value_at(float(dot.get("cy")), axis) == pytest.approx(want, abs=span * 2e-3)
    # x: equal steps land equal distances apart, left to right
    cx = [float(c.get("cx")) for c in dots]
    gaps = [b - a for a, b in zip(cx, cx[1:])]
    assert min(gaps) > 0 and max(gaps) - min(gaps) < 0.05
    line = [el for el in root.iter(f"{NS}polyline")]
    assert len(line) == 1 and len(line[0].get("points").split()) == len(ys)


def test_a_non_finite_value_breaks_the_line_and_is_said():
    root = one_panel([1.0, 2.0, float("nan"), 3.0, 2.5, float("inf")])
    height = float(root.get("height"))
    lines = [len(p.get("points").split()) for p in root.iter(f"{NS}polyline")]
    assert lines == [2, 2]
    dots = [c for c in root.iter(f"{NS}circle") if in_plot_area(c, height)]
    assert len(dots) == 4
    assert any(t.text == "2 non-finite value(s) not drawn" for t in texts(root))
    empty = one_panel([float("nan")])
    assert any(t.text == "no finite values (1 non-finite)" for t in texts(empty))


def test_numpy_and_torch_scalars_are_drawn_like_floats():
    """A target's metrics may come as numpy or torch scalars."""
    import numpy as np
    import torch

    ys = [np.float32(0.5), torch.tensor(0.75, dtype=torch.float64), 1.0, np.float64(0.25)]
    root = one_panel(ys)
    axis = y_axis(root)
    height = float(root.get("height"))
    dots = sorted((c for c in root.iter(f"{NS}circle") if in_plot_area(c, height)),
                  key=lambda c: float(c.get("cx")))
    assert [round(value_at(float(d.get("cy")), axis), 3) for d in dots] == [0.5, 0.75, 1.0, 0.25]
    assert len(list(root.iter(f"{NS}polyline"))) == 1


def test_the_band_is_an_error_bar_from_lo_to_hi():
    band = svg.Band([0, 1], [0.9, 1.9], [1.1, 2.1])
    root = one_panel([1.0, 2.0], band=band)
    axis = y_axis(root)
    bars = [p.get("d") for p in root.iter(f"{NS}path") if p.get("d").count("M") == 3]
    assert len(bars) == 2
    for d, lo, hi in zip(bars, band.lo, band.hi):
        vertical = d.split("M")[1]                       # "x,ylo" + "V" + "yhi"
        ylo, yhi = float(vertical.split(",")[1].split("V")[0]), float(vertical.split("V")[1])
        assert value_at(ylo, axis) == pytest.approx(lo, abs=2e-3)
        assert value_at(yhi, axis) == pytest.approx(hi, abs=2e-3)
    legend = [t.text for t in texts(root) if t.get("text-anchor") == "start"]
    assert legend == ["golden ± tol", "fsdp"]


def test_a_flagged_title_is_red_and_bold_and_text_is_escaped():
    root = one_panel([1.0, 2.0], title="actor/<pg>&loss", flagged=True)
    title = next(t for t in texts(root) if t.text == "actor/<pg>&loss")
    assert title.get("fill") == svg.FLAG and title.get("font-weight") == "bold"
    plain = one_panel([1.0, 2.0], title="x")
    title = next(t for t in texts(plain) if t.text == "x")
    assert title.get("fill") != svg.FLAG and title.get("font-weight") == "normal"


def test_grid_layout_and_legend_order():
    panels = [svg.Panel(f"m{i}", [svg.Series(b, [0, 1], [i, i + 1.0], c)
                                  for b, c in (("megatron", "#2"), ("reference", "#1"))])
              for i in range(7)]
    root = parse(svg.panel_grid("title", panels, columns=4,
                                legend=[("reference", "#1"), ("megatron", "#2")]))
    assert float(root.get("width")) == 4 * svg.PANEL_W
    assert float(root.get("height")) == svg.HEAD + 2 * svg.PANEL_H + svg.FOOT
    assert sorted(t.text for t in texts(root) if t.text.startswith("m") and t.text[1:].isdigit()
                  ) == [f"m{i}" for i in range(7)]
    legend = [t.text for t in texts(root) if t.get("text-anchor") == "start"]
    assert legend == ["reference", "megatron"]  # as given, not as first drawn


def test_a_constant_series_gets_an_axis_around_it():
    root = one_panel([0.25, 0.25, 0.25])
    axis = y_axis(root)
    height = float(root.get("height"))
    dots = [c for c in root.iter(f"{NS}circle") if in_plot_area(c, height)]
    assert all(value_at(float(d.get("cy")), axis) == pytest.approx(0.25, abs=1e-4) for d in dots)


@settings(max_examples=300, deadline=None)
@given(st.floats(-1e9, 1e9), st.floats(1e-9, 1e9), st.integers(3, 8))
def test_ticks_are_round_steps_within_range_and_labelled_exactly(lo, span, want):
    hi = lo + span
    if not hi - lo > max(abs(lo), abs(hi)) * 1e-9:  # beyond float64 resolution: y_range widens it
        return
    ticks = svg.ticks_between(lo, hi, want)
    assert len(ticks) >= 2
    step = svg.nice_step(lo, hi, want)
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(abs(mantissa - m) < 1e-9 for m in (1, 2, 2.5, 5, 10))
    # k * step carries float64 rounding of the values' own size
    slack = step * 1e-6 + 8 * math.ulp(max(abs(lo), abs(hi)))
    assert all(abs((b - a) - step) <= slack for a, b in zip(ticks, ticks[1:]))
    assert lo - slack <= ticks[0] and ticks[-1] <= hi + slack
    # no round step left unused at either end
    assert ticks[0] - step < lo + slack and ticks[-1] + step > hi - slack
    labels = svg.tick_labels(ticks)
    assert len(set(labels)) == len(labels)
    assert all(abs(float(t) - v) <= slack for t, v in zip(labels, ticks))


def test_tick_counts_stay_near_the_aim():
    counts = {len(svg.ticks_between(0.0, s)) for s in (0.7, 1.0, 1.3, 2.2, 3.7, 4.9, 7.5, 9.9)}
    assert counts <= {3, 4, 5, 6, 7}
    assert svg.x_ticks(0, 3) == [0, 1, 2, 3]
    assert svg.x_ticks(0, 40) == [0, 10, 20, 30, 40]
