"""The report of one ``rlaudit run`` invocation: ``<report_dir>/latest/report.html``
(self-contained: inline CSS, plots embedded) and ``report.md`` (plots under ``plots/``).

For every scenario: the verdict, the invariant x backend table, failures with their messages,
backend crashes, golden comparisons (value / golden / drift / tolerance) and a plot of every
golden-compared metric over the training steps, one line per backend, with the golden band.

    paths = write_run_report(results, Path("reports"))   # [report.html, report.md, plots/...]
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from rlaudit.metrics import golden_bound, golden_names
from rlaudit.report import localise_view as LV
from rlaudit.report import render as R
from rlaudit.report import svg
from rlaudit.verdict.result import STATUS_ORDER as RESULT_STATUS_ORDER
from rlaudit.verdict.result import (FAILED, INTERRUPTED, NO_GOLDEN_STATE, PASSED, STATES,
                                    ScenarioResult)

#: scenario state -> badge/cell CSS class
STATE_CLASS = {"passed": "ok", "no golden": "warn", "blessed": "warn", "failed": "bad",
               "bad input": "err", "n/a": "warn", "interrupted": "err"}

#: invariant cells show the worst status of the checks that apply to the backend, in this order
STATUS_ORDER = RESULT_STATUS_ORDER
#: subplots per row in the metrics-over-steps grid
PLOT_COLUMNS = 4
#: golden rows shown outside the collapsed "all rows" block (the failing ones come first)
GOLDEN_ROWS_SHOWN = 12
#: how the pseudo-invariant "*" (the backend itself ran, was available) is labelled
BACKEND_RAN = "(backend ran)"
#: lines of a backend's traceback kept in the report (the tail is where the cause is)
TRACEBACK_LINES = 25


def _worst(statuses: list[str]) -> str:
    for s in STATUS_ORDER:
        if s in statuses:
            return s
    return "-"


def invariant_rows(res: ScenarioResult) -> list[list[str]]:
    """[invariant, status per backend...]: a check on backend ``*`` applies to every backend."""
    rows = []
    for inv in dict.fromkeys(c.invariant for c in res.checks):
        rows.append([BACKEND_RAN if inv == "*" else inv] + [_worst([c.status for c in res.checks
                                     if c.invariant == inv and c.backend in (b, "*")])
                             for b in res.backends])
    if res.golden:
        by_backend = {g.backend: g.status for g in res.golden}
        rows.append(["golden"] + [by_backend.get(b, "-") for b in res.backends])
    return rows


def golden_rows(res: ScenarioResult) -> list[dict]:
    """Every golden comparison row tagged with its backend, failing rows first."""
    rows = [{"backend": g.backend, **r} for g in res.golden for r in g.rows]
    return sorted(rows, key=lambda r: (bool(r.get("ok")), r["backend"], r["step"], r["metric"]))


def failures(res: ScenarioResult) -> list[str]:
    out = [f"{c.status.upper()} {BACKEND_RAN if c.invariant == '*' else c.invariant} "
           f"[{c.backend}]: {c.message}" for c in res.checks if c.status in ("fail", "error")]
    out += [f"golden {g.status.upper()} [{g.backend}]: {g.message}"
            for g in res.golden if g.status in ("fail", "stale", "blessed", "refused", "no golden")]
    return out


def declared(res: ScenarioResult) -> list[str]:
    """Checks whose departure from the reference the target declared (status ``differs``)."""
    return [f"{c.invariant} [{c.backend}]: {c.message}" for c in res.checks
            if c.status == "differs"]


# ---- plot --------------------------------------------------------------------------------------

#: metrics plotted per scenario (besides any that fail their golden)
PLOTTED_METRICS = ("actor/pg_loss", "actor/loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl",
                   "actor/pg_clipfrac", "actor/kl_loss", "critic/vf_loss", "critic/score/mean")


def plot_metrics(res: ScenarioResult) -> bytes | None:
    """SVG grid (rlaudit/report/svg.py): one panel per plotted metric, value over steps per
    backend, with the golden value +/- its tolerance (of the first backend that has one) as grey
    error bars; the title of a metric out of its golden tolerance in red."""
    logged = golden_names({n for steps in res.metrics.values() for s in steps for n in s})
    failing = {r["metric"] for r in golden_rows(res) if not r.get("ok")}
    # the headline metrics plus every failing one: they say more than dozens of panels would,
    # next to the golden table
    names = [n for n in logged if n in PLOTTED_METRICS or n in failing]
    if not names:
        return None
    band: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for g in res.golden:
        for r in g.rows:
            bound = golden_bound(r["golden"], r["rtol"], r["atol"])
            band.setdefault((g.backend, r["metric"]), []).append(
                (r["step"], r["golden"] - bound, r["golden"] + bound))
    colour = {b: svg.PALETTE[i % len(svg.PALETTE)] for i, b in enumerate(res.backends)}
    panels = []
    for name in names:
        pts = next((sorted(band[(g.backend, name)]) for g in res.golden
                    if band.get((g.backend, name))), [])  # the first backend with a golden
        series = []
        for b in res.backends:
            steps = res.metrics.get(b, [])
            xs = [k for k, s in enumerate(steps) if name in s]
            if xs:
                series.append(svg.Series(b, xs, [steps[k][name] for k in xs], colour[b]))
        panels.append(svg.Panel(name, series, flagged=name in failing,
                                band=svg.Band([p[0] for p in pts], [p[1] for p in pts],
                                              [p[2] for p in pts]) if pts else None))
    title = f"{res.scenario}: metrics over training steps (red title: golden mismatch)"
    drawn = {s.label for p in panels for s in p.series}
    return svg.panel_grid(title, panels, columns=PLOT_COLUMNS,
                          legend=[(b, c) for b, c in colour.items() if b in drawn]).encode("utf-8")


# ---- HTML / Markdown ---------------------------------------------------------------------------

def _summary(results: list[ScenarioResult]) -> list[tuple[str, object]]:
    passed = sum(r.passed for r in results)
    backends = sorted({b for r in results for b in r.backends})
    no_golden = sum(r.state == NO_GOLDEN_STATE for r in results)
    stopped = sum(r.state == INTERRUPTED for r in results)
    return [("scenarios", len(results)), ("passed", passed), ("no golden", no_golden),
            *([("interrupted", stopped)] if stopped else []),
            ("failed", len(results) - passed - no_golden - stopped),
            ("backends", ", ".join(backends) or "-"),
            ("seconds", f"{sum(r.seconds for r in results):.1f}")]


def _golden_table_rows(rows: list[dict]) -> list[list]:
    return [[r["backend"], r["step"], r["metric"], R.num_cell(r["value"], 10),
             R.num_cell(r["golden"], 10), R.num_cell(r["drift"], 3), R.num_cell(r["rtol"], 2),
             R.num_cell(r["atol"], 2), R.status_cell("pass" if r.get("ok") else "fail")]
            for r in rows]


GOLDEN_HEADER = ["backend", "step", "metric", "value", "golden", "rel. drift", "rtol", "atol",
                 "status"]


def _html_scenario(res: ScenarioResult, grid: bytes | None, drift_png: bytes | None = None
                   ) -> str:
    verdict = R.badge(res.state.upper(), STATE_CLASS[res.state])
    out = [f'<section class="card" id="{R.esc(R.safe_filename(res.scenario))}">'
           f"<h2>{R.esc(res.scenario)}{verdict}</h2>",
           f'<div class="muted">{R.esc(res.path)} &middot; dtype {R.esc(res.dtype or "-")} '
           f"&middot; device {R.esc(res.device or '-')} &middot; {res.seconds:.1f}s</div>"]
    if res.layouts:
        out.append(R.table(["backend", "layout"], [[b, ", ".join(f"{k}={v}" for k, v in l.items())
                                                    or "single process"]
                                                   for b, l in res.layouts.items()]))
    out.append("<h3>Invariants</h3>")
    rows = [[r[0], *(R.status_cell(s) for s in r[1:])] for r in invariant_rows(res)]
    out.append(R.table(["invariant", *res.backends], rows) if rows
               else '<p class="muted">no checks ran</p>')
    fails = failures(res)
    if fails:
        out.append("<h3>Failures</h3><ul class=\"fail\">" +
                   "".join(f"<li><code>{R.esc(f)}</code></li>" for f in fails) + "</ul>")
    out.append(LV.html_section(res, drift_png))
    diffs = declared(res)
    if diffs:
        out.append("<h3>Declared differences</h3><ul>" +
                   "".join(f"<li><code>{R.esc(d)}</code></li>" for d in diffs) + "</ul>")
    for b, err in res.errors.items():
        tail = "\n".join(err.splitlines()[-TRACEBACK_LINES:])
        out.append(f"<h3>Backend {R.esc(b)} crashed</h3><pre>{R.esc(tail)}</pre>")
    grows = golden_rows(res)
    if grows:
        n_bad = sum(not r.get("ok") for r in grows)
        out.append(f"<h3>Golden comparison <span class=\"muted\">({len(grows)} values, "
                   f"{n_bad} out of tolerance)</span></h3>")
        shown = grows[:max(GOLDEN_ROWS_SHOWN, n_bad)]
        out.append(R.table(GOLDEN_HEADER, _golden_table_rows(shown)))
        if len(grows) > len(shown):
            out.append(f"<details><summary>all {len(grows)} rows</summary>"
                       f"{R.table(GOLDEN_HEADER, _golden_table_rows(grows))}</details>")
    if grid:
        out.append("<h3>Metrics over steps</h3>" + R.img(grid, f"{res.scenario} metrics"))
    out.append("</section>")
    return "\n".join(out)


def render_html(results: list[ScenarioResult], grids: dict[str, bytes],
                drift_pngs: dict[str, bytes] | None = None) -> str:
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    worst = next((s for s in STATES if any(r.state == s for r in results)), FAILED)
    verdict = R.badge(worst.upper(), STATE_CLASS[worst])
    head = [f'<section class="card"><h2>Summary{verdict}</h2>',
            R.stats(_summary(results))]
    head.append(R.table(["scenario", "verdict", "backends", "failures", "seconds"],
                        [[r.scenario, R.status_cell(r.state),
                          ", ".join(r.backends), len(failures(r)),
                          R.num_cell(round(r.seconds, 1))] for r in results]))
    head.append("</section>")
    body = head + [_html_scenario(r, grids.get(r.scenario), (drift_pngs or {}).get(r.scenario))
                   for r in results]
    return R.page("rlaudit run report", f"{len(results)} scenario(s) · generated {now}", body)


def render_markdown(results: list[ScenarioResult], plot_paths: dict[str, str],
                    drift_paths: dict[str, str] | None = None) -> str:
    passed = sum(r.passed for r in results)
    out = ["# rlaudit run report", "",
           f"**{passed}/{len(results)} scenarios passed** "
           f"({sum(r.seconds for r in results):.1f}s)", "",
           R.md_table(["scenario", "verdict", "backends"],
                      [[r.scenario, r.state if r.state in (PASSED, NO_GOLDEN_STATE)
                        else f"**{r.state.upper()}**", ", ".join(r.backends)]
                       for r in results])]
    for res in results:
        out += ["", f"## {res.scenario}: {res.state.upper()}", "",
                f"`{res.path}` · dtype {res.dtype or '-'} · device {res.device or '-'} · "
                f"{res.seconds:.1f}s", ""]
        rows = invariant_rows(res)
        cells = [[r[0], *(f"**{s.upper()}**" if s in ("fail", "error") else s for s in r[1:])]
                 for r in rows]
        out.append(R.md_table(["invariant", *res.backends], cells) if rows
                   else "_no checks ran_")
        fails = failures(res)
        if fails:
            out += ["", "### Failures", ""] + [f"- `{R.md_escape(f)}`" for f in fails]
        out += LV.markdown_lines(res, (drift_paths or {}).get(res.scenario))
        diffs = declared(res)
        if diffs:
            out += ["", "### Declared differences", ""] + [f"- `{R.md_escape(d)}`" for d in diffs]
        grows = golden_rows(res)
        if grows:
            n_bad = sum(not r.get("ok") for r in grows)
            out += ["", f"### Golden comparison ({len(grows)} values, {n_bad} out of "
                    "tolerance)", ""]
            md_rows = [[str(c) for c in row] for row in _golden_table_rows(grows)]
            if n_bad:
                out.append(R.md_table(GOLDEN_HEADER, md_rows[:n_bad]))
            out += ["", f"<details><summary>all {len(grows)} rows</summary>", "",
                    R.md_table(GOLDEN_HEADER, md_rows), "", "</details>"]
        if res.scenario in plot_paths:
            out += ["", f"![{res.scenario} metrics]({plot_paths[res.scenario]})"]
    return "\n".join(out) + "\n"


def scenario_plots(res: ScenarioResult) -> tuple[bytes | None, bytes | None]:
    """A result's two plots (metrics over steps, drift vs depth), as the report shows them:
    ``rlaudit run`` renders each while later scenarios still run (half a second each, which
    would otherwise all come after the last one) and hands them to :func:`build_run_report`."""
    return plot_metrics(res), LV.drift_plot(res)


def build_run_report(results: list[ScenarioResult], out_dir: Path,
                     plots: dict[int, tuple[bytes | None, bytes | None]] | None = None
                     ) -> list[Path]:
    """Write report.html, report.md, plots/<scenario>.svg (metrics over steps) and, for a
    localised failure, plots/<scenario>-drift-vs-depth.png into ``out_dir`` (each atomically;
    plots left over from an earlier invocation are removed). Returns [html, md, *plots].
    ``plots``: :func:`scenario_plots` of some of ``results`` already, by ``id(result)``."""
    out_dir = Path(out_dir)
    done = plots or {}
    rendered = [done[id(r)] if id(r) in done else scenario_plots(r) for r in results]
    grids = {r.scenario: grid for r, (grid, _) in zip(results, rendered) if grid is not None}
    plot_files = {s: f"plots/{R.safe_filename(s)}.svg" for s in grids}
    drift = {r.scenario: png for r, (_, png) in zip(results, rendered) if png is not None}
    drift_files = {s: f"plots/{R.safe_filename(s)}-drift-vs-depth.png" for s in drift}
    written = [R.write_atomic(out_dir / "report.html", render_html(results, grids, drift)),
               R.write_atomic(out_dir / "report.md",
                              render_markdown(results, plot_files, drift_files))]
    written += [R.write_atomic(out_dir / plot_files[s], grid) for s, grid in grids.items()]
    written += [R.write_atomic(out_dir / drift_files[s], png) for s, png in drift.items()]
    plots_dir = out_dir / "plots"
    if plots_dir.is_dir():
        for stale in {*plots_dir.glob("*.png"), *plots_dir.glob("*.svg")} - set(written):
            stale.unlink(missing_ok=True)
    return written


def write_run_report(results: list[ScenarioResult], report_dir: Path,
                     plots: dict[int, tuple[bytes | None, bytes | None]] | None = None
                     ) -> list[Path]:
    """The invocation's report under ``<report_dir>/latest/``; returns [report.html, report.md,
    plots...]. ``plots``: see :func:`build_run_report`."""
    return build_run_report(results, Path(report_dir) / "latest", plots)
