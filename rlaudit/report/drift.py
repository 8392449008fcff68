"""Metric drift across logged ``rlaudit run`` invocations (MLflow parent runs), with pandas.

    window = fetch_window(client, "rlaudit", Selection(last=3))
    table = analyse(window)          # one row per (scenario, backend, metric)
    print(render_text(table, window))

**What "drifting" means.** The window is the selected invocations, oldest first (for ``--runs A B``:
A then B). Only FINISHED invocations count (one whose logging broke is FAILED). For every
(scenario, backend, metric) that goldens compare (catalogue metrics with ``golden=True``; timing
and bookkeeping are excluded) the value is the one at the **final training step** of each run.
With tolerance ``rtol``/``atol`` — the golden's, logged with the run (latest run that has one),
else the golden default for the scenario's dtype — a value ``v`` is out of bounds against ``w``
when NOT ``|v - w| <= atol + rtol * |w|`` (the golden comparison's rule; NaN is out).

- ``out-of-bounds``: in the latest run the value is out of bounds against that run's golden value.
- ``drift``: in bounds of the golden (or there is no golden) but out of bounds against the value
  of the **first run of the window** that logged it (a change between runs, no golden needed).
- ``missing``: the newest run of that scenario and backend did not log the metric (the backend
  crashed, or the metric stopped being logged — itself a classic RL metric bug).
- ``ok``: none of the above.

``since`` is the first run of the trailing streak of out-of-bounds/drift runs that ends at the
latest run, i.e. the run where it (most recently) went out of bounds. Per-step golden failures
at earlier steps show in each run's ``golden`` tag and run report; this table reads final steps.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rlaudit.errors import InputError
from rlaudit.metrics import CATALOGUE, golden_bound
from rlaudit.report import render as R
from rlaudit.report.mlflow_content import INVOCATION, KIND_TAG, SCENARIO

FLAGGED = ("out-of-bounds", "drift", "missing")
#: last-resort tolerance for a run without golden tolerances nor a known dtype (float32's)
FALLBACK_TOL = (2e-4, 1e-6)
#: denominator floor of relative drift/change (the golden comparison uses the same)
REL_FLOOR = 1e-12
#: MLflow's max_results per search_runs page
PAGE = 1000
#: plots in the HTML page (one per flagged metric); the table still lists every row
MAX_PLOTS = 40
COLUMNS = ["scenario", "backend", "metric", "value", "golden", "drift", "change", "rtol", "atol",
           "status", "since", "runs"]


@dataclass(frozen=True)
class Selection:
    """Which invocations: the ``last`` N, those started in [since, until), or ``runs`` (A, B)."""

    last: int | None = None
    since: _dt.datetime | None = None
    until: _dt.datetime | None = None
    runs: tuple[str, str] | None = None

    def describe(self) -> str:
        if self.runs:
            return f"run {self.runs[0]} vs run {self.runs[1]}"
        if self.since:
            return f"runs since {self.since:%Y-%m-%d %H:%M}" + (
                f" until {self.until:%Y-%m-%d %H:%M}" if self.until else "")
        return f"last {self.last} invocation(s)"


@dataclass
class Window:
    invocations: pd.DataFrame   # inv, run_id, name, start, commit, passed   (oldest first)
    children: pd.DataFrame      # inv, run_id, scenario, backend, dtype
    values: pd.DataFrame        # inv, scenario, backend, dtype, metric, value, golden, rtol, atol
    selection: Selection
    experiment: str


# ---- reading MLflow ----------------------------------------------------------------------------

def _search(client, exp_id: str, filter_string: str, *, order: str = "ASC",
            limit: int | None = None) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([exp_id], filter_string=filter_string,
                                  max_results=min(PAGE, limit or PAGE), page_token=token,
                                  order_by=[f"attributes.start_time {order}"])
        runs += list(page)
        token = page.token
        if not token or (limit is not None and len(runs) >= limit):
            return runs[:limit] if limit else runs


def _resolve_run(client, exp_id: str, ref: str):
    """A parent run by id or run name; a child run's id resolves to its invocation."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow only when reading runs
    if re.fullmatch(r"[0-9a-f]{32}", ref):
        try:
            run = client.get_run(ref)
        except MlflowException:
            raise InputError(f"no MLflow run with id {ref}", key="--runs") from None
        if run.data.tags.get(KIND_TAG) == SCENARIO:
            run = client.get_run(run.data.tags["rlaudit.invocation"])
        if run.data.tags.get(KIND_TAG) != INVOCATION:
            raise InputError(f"run {ref} was not logged by `rlaudit run`", key="--runs")
        return run
    found = [r for r in _search(client, exp_id, f"tags.`{KIND_TAG}` = '{INVOCATION}'")
             if r.info.run_name == ref]
    if len(found) != 1:
        raise InputError(f"{len(found)} invocation runs are named {ref!r}"
                         + ("; pass a run id" if found else ""), key="--runs")
    return found[0]


def _invocations(client, exp_id: str, sel: Selection) -> list:
    base = f"tags.`{KIND_TAG}` = '{INVOCATION}' AND attributes.status = 'FINISHED'"
    if sel.runs:
        return [_resolve_run(client, exp_id, ref) for ref in sel.runs]
    if sel.since is not None:
        flt = f"{base} AND attributes.start_time >= {int(sel.since.timestamp() * 1000)}"
        if sel.until is not None:
            flt += f" AND attributes.start_time < {int(sel.until.timestamp() * 1000)}"
        return _search(client, exp_id, flt)
    return _search(client, exp_id, base, order="DESC", limit=sel.last)[::-1]


def _strip(key: str) -> tuple[str, str]:
    """``golden_rtol/actor/pg_loss`` -> ("golden_rtol", "actor/pg_loss"); plain -> ("", key)."""
    head, _, rest = key.partition("/")
    return (head, rest) if head in ("golden", "golden_drift", "golden_rtol", "golden_atol") \
        else ("", key)


def fetch_window(client, experiment: str, sel: Selection) -> Window:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise InputError(f"no MLflow experiment {experiment!r} (nothing was logged there yet?)",
                         key="--experiment")
    parents = _invocations(client, exp.experiment_id, sel)
    if not parents:
        raise InputError(f"no finished rlaudit invocations match ({sel.describe()}) in "
                         f"experiment {experiment!r}")
    inv_rows, child_rows, value_rows = [], [], []
    for i, p in enumerate(parents):
        inv_rows.append({"inv": i, "run_id": p.info.run_id, "name": p.info.run_name,
                         "start": pd.Timestamp(p.info.start_time, unit="ms", tz="UTC"),
                         "commit": p.data.tags.get("mlflow.source.git.commit", ""),
                         "passed": p.data.tags.get("rlaudit.passed", "")})
        flt = f"tags.`mlflow.parentRunId` = '{p.info.run_id}'"
        for c in _search(client, exp.experiment_id, flt):
            t = c.data.tags
            key = {"inv": i, "scenario": t.get("rlaudit.scenario", "?"),
                   "backend": t.get("rlaudit.backend", "?"),
                   "dtype": c.data.params.get("dtype", "")}
            child_rows.append({**key, "run_id": c.info.run_id})
            metrics: dict[str, dict[str, float]] = {}
            for k, v in c.data.metrics.items():
                prefix, name = _strip(k)
                metrics.setdefault(name, {})[prefix] = v
            for name, m in metrics.items():
                spec = CATALOGUE.get(name)
                if spec is None or not spec.golden or "" not in m:
                    continue
                value_rows.append({**key, "metric": name, "value": m[""],
                                   "golden": m.get("golden"), "rtol": m.get("golden_rtol"),
                                   "atol": m.get("golden_atol")})
    cols = ["inv", "scenario", "backend", "dtype", "metric", "value", "golden", "rtol", "atol"]
    children = pd.DataFrame(child_rows, columns=["inv", "scenario", "backend", "dtype", "run_id"])
    return Window(pd.DataFrame(inv_rows), children, pd.DataFrame(value_rows, columns=cols), sel,
                  experiment)


# ---- analysis ----------------------------------------------------------------------------------

def out_of_bounds(v: float, ref: float, rtol: float, atol: float) -> bool:
    return not (abs(v - ref) <= golden_bound(ref, rtol, atol))  # NaN -> True


def _rel(v: float, ref: float) -> float:
    return abs(v - ref) / max(abs(ref), REL_FLOOR)


def _default_tol(dtype: str) -> tuple[float, float]:
    from rlaudit.scenarios.golden import GOLDEN_TOLERANCES  # lazy: it imports torch
    return GOLDEN_TOLERANCES.get(dtype, FALLBACK_TOL)


def _isnum(x: Any) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def analyse(window: Window) -> pd.DataFrame:
    """One row per (scenario, backend, metric) with the COLUMNS; flagged rows first. Also
    ``history``: per run of the window, (inv, value, golden, bound, out) for the plots."""
    names = dict(zip(window.invocations["inv"], window.invocations["name"]))
    child_invs = window.children.groupby(["scenario", "backend"])["inv"].apply(sorted).to_dict()
    rows = []
    for (scn, backend, metric), g in window.values.groupby(["scenario", "backend", "metric"],
                                                          sort=True):
        g = g.sort_values("inv")
        with_tol = g[g["rtol"].notna() & g["atol"].notna()]
        if len(with_tol):
            rtol, atol = float(with_tol["rtol"].iloc[-1]), float(with_tol["atol"].iloc[-1])
        else:
            rtol, atol = _default_tol(str(g["dtype"].iloc[-1]))
        first = float(g["value"].iloc[0])
        history, streak = [], None
        for r in g.itertuples():
            v = float(r.value)
            gold = float(r.golden) if _isnum(r.golden) else None
            grtol = float(r.rtol) if _isnum(r.rtol) else rtol
            gatol = float(r.atol) if _isnum(r.atol) else atol
            g_out = gold is not None and out_of_bounds(v, gold, grtol, gatol)
            d_out = out_of_bounds(v, first, rtol, atol)
            history.append({"inv": int(r.inv), "value": v, "golden": gold,
                            "bound": None if gold is None else golden_bound(gold, grtol, gatol),
                            "golden_out": g_out, "drift_out": d_out})
            streak = (streak if streak is not None else int(r.inv)) if (g_out or d_out) else None
        last = history[-1]
        later = [i for i in child_invs.get((scn, backend), []) if i > last["inv"]]
        status = ("missing" if later else "out-of-bounds" if last["golden_out"]
                  else "drift" if last["drift_out"] else "ok")
        if later:  # since the first run of this scenario/backend that lacked the metric
            streak = later[0]
        gold = last["golden"]
        rows.append({"scenario": scn, "backend": backend, "metric": metric,
                     "value": last["value"], "golden": gold,
                     "drift": None if gold is None else _rel(last["value"], gold),
                     "change": (last["value"] - first) / max(abs(first), REL_FLOOR),
                     "rtol": rtol, "atol": atol, "status": status,
                     "since": names.get(streak, "") if status != "ok" else "",
                     "runs": len(history), "history": history, "first": first})
    table = pd.DataFrame(rows, columns=COLUMNS + ["history", "first"])
    numeric = ["value", "golden", "drift", "change", "rtol", "atol"]
    table[numeric] = table[numeric].astype(float)  # a missing golden is NaN, not None
    order = {s: i for i, s in enumerate(FLAGGED + ("ok",))}
    return table.sort_values(by=["status", "scenario", "backend", "metric"],
                             key=lambda c: c.map(order) if c.name == "status" else c,
                             ignore_index=True)


def flagged(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["status"].isin(FLAGGED)]


# ---- rendering ---------------------------------------------------------------------------------

def _num(x: Any, digits: int) -> str:
    return R.fmt_num(x, digits) if _isnum(x) else ""


def _cells(row) -> list[str]:
    return [row.scenario, row.backend, row.metric, R.fmt_num(row.value, 8),
            _num(row.golden, 8), _num(row.drift, 3), R.fmt_num(row.change, 3),
            R.fmt_num(row.rtol, 2), R.fmt_num(row.atol, 2), row.status, row.since, str(row.runs)]


def _header(window: Window) -> str:
    inv = window.invocations
    return (f"drift over {len(inv)} invocation(s) ({window.selection.describe()}; experiment "
            f"{window.experiment!r}): {inv['name'].iloc[0]} .. {inv['name'].iloc[-1]}")


def render_text(table: pd.DataFrame, window: Window) -> str:
    bad = flagged(table)
    out = [_header(window)]
    if len(bad):
        out.append(R.text_table(COLUMNS, [_cells(r) for r in bad.itertuples()]))
    out.append(f"{len(bad)} of {len(table)} metric(s) flagged "
               f"({', '.join(f'{(bad.status == s).sum()} {s}' for s in FLAGGED)})")
    return "\n".join(out)


def render_markdown(table: pd.DataFrame, window: Window) -> str:
    bad = flagged(table)
    verdict = f"**{len(bad)} of {len(table)} metric(s) flagged**" if len(bad) else \
        f"**no drift**: {len(table)} metric(s) within bounds"
    out = ["## rlaudit metric drift", "", _header(window), "", verdict, ""]
    if len(bad):
        out += [R.md_table(COLUMNS, [_cells(r) for r in bad.itertuples()]), ""]
    out += [f"<details><summary>all {len(table)} rows</summary>", "",
            R.md_table(COLUMNS, [_cells(r) for r in table.itertuples()]), "", "</details>", ""]
    return "\n".join(out)


def plot_history(row, window: Window) -> bytes:
    """Value per run (red where out of bounds), the golden band per run, and the tolerance band
    around the window's first value (the run-to-run drift reference)."""
    plt = R.pyplot()
    names = dict(zip(window.invocations["inv"], window.invocations["name"]))
    h = row.history
    xs = [p["inv"] for p in h]
    fig, ax = plt.subplots(figsize=(6.4, 3.0), layout="constrained")
    tol = golden_bound(row.first, row.rtol, row.atol)
    ax.axhspan(row.first - tol, row.first + tol, color="#0969da", alpha=0.08,
               label="first run ± tol")
    gold = [p for p in h if p["golden"] is not None]
    if gold:  # each run's golden band spans that run's slot (x - 0.5 .. x + 0.5)
        bx = [x for p in gold for x in (p["inv"] - 0.5, p["inv"] + 0.5)]
        lo = [p["golden"] - p["bound"] for p in gold for _ in (0, 1)]
        hi = [p["golden"] + p["bound"] for p in gold for _ in (0, 1)]
        ax.fill_between(bx, lo, hi, color="0.55", alpha=0.35, linewidth=0, label="golden ± tol")
        ax.plot(bx, [p["golden"] for p in gold for _ in (0, 1)], ls="--", color="0.3", lw=1,
                label="golden")
    ax.plot(xs, [p["value"] for p in h], color="#1f2937", marker="o", ms=5, lw=1.5, label="value")
    outs = [p for p in h if p["golden_out"] or p["drift_out"]]
    if outs:
        ax.scatter([p["inv"] for p in outs], [p["value"] for p in outs], color="#cf222e", s=60,
                   zorder=5, label="out of bounds")
    ax.set_xticks(range(len(window.invocations)))
    ax.set_xticklabels([names[i][-19:] for i in range(len(window.invocations))], rotation=20,
                       ha="right", fontsize=7)
    ax.set_xlim(-0.5, len(window.invocations) - 0.5)
    ax.tick_params(axis="y", labelsize=7)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.grid(alpha=0.3)
    ax.set_title(f"{row.metric}  ·  {row.scenario} [{row.backend}]  ·  {row.status}", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return R.fig_png(fig)


def render_html(table: pd.DataFrame, window: Window) -> str:
    bad = flagged(table)
    inv = window.invocations
    body = ['<section class="card"><h2>Summary' +
            (R.badge(f"{len(bad)} FLAGGED", "bad") if len(bad) else R.badge("NO DRIFT", "ok")) +
            "</h2>", R.stats([("invocations", len(inv)), ("metrics compared", len(table)),
                              *((s, int((table.status == s).sum())) for s in FLAGGED)]),
            f'<p class="muted">{R.esc(_header(window))}</p>',
            R.table(["#", "invocation", "run id", "started (UTC)", "git commit", "passed"],
                    [[i, r.name, r.run_id, f"{r.start:%Y-%m-%d %H:%M:%S}", r.commit[:12],
                      R.status_cell({"true": "pass", "false": "fail"}.get(r.passed, r.passed))]
                     for i, r in enumerate(inv.itertuples())]),
            '<details><summary>what "drifting" means</summary><pre>' +
            R.esc(__doc__.split("**What \"drifting\" means.**")[1].strip()) + "</pre></details>",
            "</section>"]

    def rows_html(df):
        return R.table(COLUMNS, [[*(_cells(r)[:9]), R.status_cell(r.status), *(_cells(r)[10:])]
                                 for r in df.itertuples()],
                       flag_rows=[s in FLAGGED for s in df.status])
    if len(bad):
        body += ['<section class="card"><h2>Flagged metrics</h2>', rows_html(bad)]
        for r in list(bad.itertuples())[:MAX_PLOTS]:
            body.append(R.img(plot_history(r, window), f"{r.metric} over runs"))
        if len(bad) > MAX_PLOTS:
            body.append(f'<p class="muted">{len(bad) - MAX_PLOTS} more not plotted</p>')
        body.append("</section>")
    body += ['<section class="card"><h2>All metrics</h2>', rows_html(table), "</section>"]
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    return R.page("rlaudit metric drift", f"{window.selection.describe()} · generated {now}", body)
