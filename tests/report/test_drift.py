"""Drift analysis on hand-built windows (no MLflow): each documented status, "since", rendering."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from rlaudit.report.drift import Selection, Window, analyse, flagged, render_html, \
    render_markdown, render_text

RTOL, ATOL = 1e-6, 1e-9


def window(series: dict[tuple[str, str, str], list], *, n_runs: int | None = None,
           children: dict[tuple[str, str], list[int]] | None = None, dtype: str = "float64"):
    """series: (scenario, backend, metric) -> per run (value or None = not logged, or
    (value, golden) with the golden rtol/atol above)."""
    n = n_runs or max(len(v) for v in series.values())
    inv = pd.DataFrame({"inv": range(n), "run_id": [f"{i:032x}" for i in range(n)],
                        "name": [f"night-{i}" for i in range(n)],
                        "start": pd.date_range("2026-11-01", periods=n, freq="D", tz="UTC"),
                        "commit": "abc", "passed": "true"})
    vals, kids = [], set()
    for (scn, b, m), per_run in series.items():
        for i, x in enumerate(per_run):
            if x is None:
                continue
            kids.add((i, scn, b))
            v, g = x if isinstance(x, tuple) else (x, None)
            vals.append({"inv": i, "scenario": scn, "backend": b, "dtype": dtype, "metric": m,
                         "value": v, "golden": g, "rtol": RTOL if g is not None else None,
                         "atol": ATOL if g is not None else None})
    for (scn, b), invs in (children or {}).items():
        kids |= {(i, scn, b) for i in invs}
    ch = pd.DataFrame([{"inv": i, "scenario": s, "backend": b, "dtype": dtype, "run_id": "x"}
                       for i, s, b in sorted(kids)])
    return Window(inv, ch, pd.DataFrame(vals), Selection(last=n), "rlaudit")


def status(table, metric, backend="fsdp"):
    row = table[(table.metric == metric) & (table.backend == backend)].iloc[0]
    return row.status, row.since


def test_golden_out_of_bounds_in_the_latest_run_only():
    w = window({("s", "fsdp", "actor/pg_loss"): [(0.5, 0.5), (0.5, 0.5), (0.5006, 0.5)],
                ("s", "fsdp", "actor/entropy"): [(2.0, 2.0), (2.0, 2.0), (2.0 + 1e-7, 2.0)]})
    t = analyse(w)
    assert status(t, "actor/pg_loss") == ("out-of-bounds", "night-2")
    assert status(t, "actor/entropy") == ("ok", "")   # 1e-7 <= 1e-9 + 1e-6 * 2
    row = t[t.metric == "actor/pg_loss"].iloc[0]
    assert row.drift == pytest.approx(0.0006 / 0.5) and row.change == pytest.approx(0.0006 / 0.5)
    assert row.value == 0.5006 and row.golden == 0.5 and row.runs == 3
    assert list(flagged(t).metric) == ["actor/pg_loss"]


def test_drift_against_the_first_run_without_a_golden_uses_the_dtype_default():
    # float64 default (1e-6, 1e-9): 1.000002 is out against 1.0, 1.0000005 is not
    w = window({("s", "fsdp", "actor/pg_loss"): [1.0, 1.0, 1.000002],
                ("s", "fsdp", "actor/entropy"): [1.0, 1.0, 1.0000005]})
    t = analyse(w)
    assert status(t, "actor/pg_loss") == ("drift", "night-2")
    assert status(t, "actor/entropy") == ("ok", "")
    row = t[t.metric == "actor/pg_loss"].iloc[0]
    assert (row.rtol, row.atol) == (1e-6, 1e-9) and math.isnan(row.golden)
    # float32 default (2e-4, 1e-6): the same change is within tolerance
    t32 = analyse(window({("s", "fsdp", "actor/pg_loss"): [1.0, 1.0, 1.000002]}, dtype="float32"))
    assert status(t32, "actor/pg_loss") == ("ok", "")


def test_since_is_the_start_of_the_trailing_out_of_bounds_streak():
    w = window({("s", "fsdp", "actor/pg_loss"): [1.0, 2.0, 1.0, 2.0, 2.0],   # out at 1, 3, 4
                ("s", "fsdp", "actor/entropy"): [1.0, 2.0, 2.0, 1.0, 1.0]})  # back in bounds
    t = analyse(w)
    assert status(t, "actor/pg_loss") == ("drift", "night-3")
    assert status(t, "actor/entropy") == ("ok", "")


def test_golden_takes_priority_and_a_moving_golden_is_followed():
    # the golden was re-blessed at run 1 (0.5 -> 0.7): run 2 matches the new golden, so no
    # golden failure, but it still drifted from the window's first value
    w = window({("s", "fsdp", "actor/pg_loss"): [(0.5, 0.5), (0.7, 0.7), (0.7, 0.7)]})
    assert status(analyse(w), "actor/pg_loss") == ("drift", "night-1")


def test_missing_metric_in_the_newest_run_of_its_backend():
    w = window({("s", "fsdp", "actor/entropy"): [2.0, 2.0, None],
                ("s", "fsdp", "actor/pg_loss"): [0.5, 0.5, 0.5],
                ("t", "megatron", "actor/entropy"): [2.0, None, None]},   # t not run since
               children={("t", "megatron"): [0]})
    t = analyse(w)
    assert status(t, "actor/entropy") == ("missing", "night-2")
    assert status(t, "actor/entropy", "megatron") == ("ok", "")


def test_nan_is_out_of_bounds():
    w = window({("s", "fsdp", "actor/pg_loss"): [(0.5, 0.5), (float("nan"), 0.5)]})
    assert status(analyse(w), "actor/pg_loss") == ("out-of-bounds", "night-1")


def test_a_single_run_window_checks_only_the_golden():
    t = analyse(window({("s", "fsdp", "actor/pg_loss"): [(0.5, 0.5)],
                        ("s", "fsdp", "actor/entropy"): [(2.5, 2.0)]}))
    assert status(t, "actor/pg_loss") == ("ok", "")
    assert status(t, "actor/entropy") == ("out-of-bounds", "night-0")


@pytest.mark.slow
def test_rendering_lists_flagged_rows_and_plots_them():
    w = window({("s", "fsdp", "actor/pg_loss"): [(0.5, 0.5), (0.5, 0.5), (0.6, 0.5)],
                ("s", "fsdp", "actor/entropy"): [(2.0, 2.0)] * 3})
    t = analyse(w)
    text = render_text(t, w)
    assert "actor/pg_loss" in text and "actor/entropy" not in text
    assert "1 of 2 metric(s) flagged (1 out-of-bounds, 0 drift, 0 missing)" in text
    md = render_markdown(t, w)
    assert "**1 of 2 metric(s) flagged**" in md and md.count("| s | fsdp | actor/pg_loss |") == 2
    html = render_html(t, w)
    assert html.count("data:image/png;base64,") == 1
    assert 'alt="actor/pg_loss over runs"' in html
    clean = analyse(window({("s", "fsdp", "actor/entropy"): [(2.0, 2.0)] * 2}))
    assert "NO DRIFT" in render_html(clean, w) and "data:image/png" not in render_html(clean, w)
