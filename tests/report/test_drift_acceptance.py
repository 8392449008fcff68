"""Acceptance: three invocations logged to a real `mlflow server`, the third with one drifted
metric; `rlaudit report --last 3` flags exactly that metric and exits 1."""

from __future__ import annotations

import math
import re
import shutil

import pytest

from rlaudit.cli.main import main
from rlaudit.report import drift
from rlaudit.report.mlflow_log import log_invocation

pytestmark = [pytest.mark.slow,  # one `mlflow server` start (30-90 s on a loaded 2-core box)
              pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")]
DRIFTED = ("scn_a", "fsdp", "actor/entropy")
SCREENSHOT_COPY = "/tmp/rlaudit_drift_report.html"


def test_drift_acceptance(mlflow_server, tmp_path_factory, tmp_path, make, capsys):
    """One test (not three) so that pytest-xdist cannot spread it over workers that would each
    start their own server."""
    inv = _log_three_invocations(mlflow_server, tmp_path_factory, make)
    _report_last_3_flags_exactly_the_drifted_metric(inv, tmp_path, capsys)
    _first_two_invocations_do_not_drift(inv, capsys)
    _server_artifacts_and_date_selection(inv, capsys)


def _log_three_invocations(mlflow_server, tmp_path_factory, make):
    experiment = "acceptance"
    report_dir = tmp_path_factory.mktemp("acceptance_reports")
    ids = []
    for i in range(3):
        # timing changes every night (never compared); the third night scn_a's fsdp entropy
        # moves by 1e-3 (golden rtol 1e-6), everything else is unchanged
        # (timing/gen is NaN: non-finite values must get through MLflow's REST API)
        shift = {b: {"timing/step": 0.05 * i, "timing/gen": float("nan")}
                 for b in ("reference", "fsdp")}
        drifted = {**shift, "fsdp": {**shift["fsdp"], "actor/entropy": 1e-3 if i == 2 else 0.0}}
        results = [make("scn_a", shift=drifted), make("scn_b", steps=3, shift=shift)]
        out = log_invocation(results, tracking_uri=mlflow_server, report_dir=report_dir,
                             experiment=experiment, run_name=f"night-{i}")
        assert out.ok, out.message
        ids.append(out.parent_run_id)
    return mlflow_server, experiment, ids


def _report_last_3_flags_exactly_the_drifted_metric(three_invocations, tmp_path, capsys):
    uri, experiment, ids = three_invocations
    assert "View run" not in capsys.readouterr().out   # MLflow's URL printing is suppressed
    base = ["report", "--tracking-uri", uri, "--experiment", experiment]
    assert main(base + ["--last", "3"]) == 1
    text = capsys.readouterr().out
    rows = text.splitlines()[3:-1]          # header line, column names, rule ... summary line
    flagged_lines = [ln for ln in rows if re.search(r"out-of-bounds|drift|missing", ln)]
    assert len(rows) == 1
    assert len(flagged_lines) == 1 and all(p in flagged_lines[0] for p in DRIFTED)
    assert "night-2" in flagged_lines[0]                          # since
    assert "1 of 16 metric(s) flagged (1 out-of-bounds, 0 drift, 0 missing)" in text

    # the same through the library: exactly one flagged (scenario, backend, metric)
    from mlflow.tracking import MlflowClient
    window = drift.fetch_window(MlflowClient(uri), experiment, drift.Selection(last=3))
    assert list(window.invocations["run_id"]) == ids
    table = drift.analyse(window)
    bad = drift.flagged(table)
    assert [tuple(r) for r in bad[["scenario", "backend", "metric"]].itertuples(index=False)] \
        == [DRIFTED]
    assert bad.iloc[0].value == pytest.approx(2.1 + 1e-3)
    assert bad.iloc[0].golden == pytest.approx(2.1)
    assert not any(m.startswith("timing/") for m in table.metric)

    html_path = tmp_path / "drift.html"
    assert main(base + ["--last", "3", "--format", "html", "--out", str(html_path)]) == 1
    html = html_path.read_text()
    assert html.count("data:image/png;base64,") == 1
    assert 'alt="actor/entropy over runs"' in html and "1 FLAGGED" in html
    shutil.copy(html_path, SCREENSHOT_COPY)

    md_path = tmp_path / "summary.md"
    assert main(base + ["--last", "3", "--format", "md", "--out", str(md_path)]) == 1
    assert "| scn_a | fsdp | actor/entropy |" in md_path.read_text()


def _first_two_invocations_do_not_drift(three_invocations, capsys):
    uri, experiment, ids = three_invocations
    base = ["report", "--tracking-uri", uri, "--experiment", experiment]
    assert main(base + ["--runs", ids[0], "night-1"]) == 0      # by id and by run name
    assert "0 of 16 metric(s) flagged" in capsys.readouterr().out
    assert main(base + ["--runs", "night-0", "night-2"]) == 1
    assert main(base + ["--runs", "night-0", "no-such-night"]) == 2
    assert "0 invocation runs are named 'no-such-night'" in capsys.readouterr().err


def _server_artifacts_and_date_selection(three_invocations, capsys):
    from mlflow.tracking import MlflowClient
    uri, experiment, ids = three_invocations
    client = MlflowClient(uri)
    arts = {a.path for a in client.list_artifacts(ids[2])}
    assert {"report.html", "report.md", "results.json", "plots"} <= arts
    exp = client.get_experiment_by_name(experiment)
    child = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{ids[2]}' "
                               "AND tags.`rlaudit.backend` = 'fsdp'")[0]
    assert [a.path for a in client.list_artifacts(child.info.run_id)] == ["token_diffs.parquet"]
    assert math.isnan(child.data.metrics["timing/gen"])
    base = ["report", "--tracking-uri", uri, "--experiment", experiment]
    assert main(base + ["--since", "2000-01-01"]) == 1            # all three
    assert main(base + ["--since", "2000-01-01", "--until", "2000-01-02"]) == 2   # none
    assert "no finished rlaudit invocations match" in capsys.readouterr().err
