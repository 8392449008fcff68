"""Rendering the drift localisation: under the failing check in the console, a section and the
drift-vs-depth plot in the reports, artifacts in MLflow; nothing at all for a result without it."""

from __future__ import annotations

import json

import pytest

from rlaudit.report import console, localise_view
from rlaudit.report.run_report import build_run_report, render_html
from rlaudit.verdict.result import CheckResult

CURVE = [{"module": m, "drift": d, "bound": 1e-7, "out": d > 1e-7}
         for m, d in (("model.embed_tokens", 0.0), ("model.layers.0.input_layernorm", 2e-16),
                      ("model.layers.0.self_attn", 0.2), ("model.norm", 0.3), ("lm_head", 0.5))]
ENTRY = {"backend": "fsdp", "against": "reference", "checks": ["backend-parity", "golden"],
         "variant": "base", "step": 0, "stage": "old/ref log-probs", "optimizer_step": None,
         "agreed": ["scores"],
         "divergences": [{"quantity": "old_log_probs", "message": "old_log_probs: 85 entries out"}],
         "layers": {"direction": "forward", "module": "model.layers.0.self_attn",
                    "what": "output", "drift": 0.2, "bound": 1e-7, "curve": CURVE,
                    "worst_tokens": [{"row": 10, "position": 9, "token_id": 128,
                                      "part": "response token 2", "max_abs_diff": 1.1}]},
         "probe": {"ran": True, "rows": [0, 1], "role": "actor", "target_step": 0,
                   "seconds": 3.2},
         "summary": "step 0, stage \"old/ref log-probs\", first module out of tolerance "
                    "(forward): model.layers.0.self_attn"}


def _failing(make):
    res = make("scn_a", shift={"fsdp": {"actor/pg_loss": 1e-3}})
    res.checks.append(CheckResult("backend-parity", "fsdp", "fail", "variant base: step 0: ..."))
    res.localisation = [json.loads(json.dumps(ENTRY))]
    return res


def test_console_prints_the_entry_once_under_its_first_failing_check(make):
    text = console.render_result(_failing(make))
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("  FAIL backend-parity [fsdp]"))
    assert lines[i + 1].startswith("    where: step 0, stage \"old/ref log-probs\"")
    assert "model.layers.0.self_attn" in lines[i + 1]
    assert any("drift over depth (forward): embed 0 · L0.in_norm 2e-16 · L0.attn 0.2" in ln
               for ln in lines)
    assert any("row 10 pos 9 (response token 2, id 128)" in ln for ln in lines)
    j = next(k for k, ln in enumerate(lines) if ln.startswith("  golden FAIL [fsdp]"))
    assert lines[j + 1] == "    where: see backend-parity [fsdp] above"
    assert text.count("where: step 0") == 1


def test_a_result_without_localisation_renders_as_before(make, monkeypatch, tmp_path):
    res = make("scn_a", failing_check=True)
    before = console.render_result(res)
    monkeypatch.setattr(console, "console_lines", lambda *a, **k: [])
    assert console.render_result(res) == before
    assert "where:" not in before
    assert localise_view.drift_plot(res) is None
    assert "Where it diverged" not in render_html([res], {})
    written = build_run_report([res], tmp_path)
    assert not any("drift-vs-depth" in p.name for p in written)


def test_reports_carry_the_section_and_the_plot(make, tmp_path):
    res = _failing(make)
    png = localise_view.drift_plot(res)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    written = {p.name: p for p in build_run_report([res], tmp_path)}
    assert "scn_a-drift-vs-depth.png" in written
    html = written["report.html"].read_text()
    assert "Where it diverged" in html and "model.layers.0.self_attn" in html
    md = written["report.md"].read_text()
    assert "### Where it diverged" in md and "plots/scn_a-drift-vs-depth.png" in md


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")
def test_mlflow_logs_the_localisation_on_the_failing_backends_run(make, report_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from rlaudit.report.mlflow_log import log_invocation
    uri = f"sqlite:///{report_dir / 'mlflow.db'}"
    out = log_invocation([_failing(make)], tracking_uri=uri, report_dir=report_dir)
    assert out.ok, out.message
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("rlaudit")
    children = {c.data.tags["rlaudit.backend"]: c for c in client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{out.parent_run_id}'")}
    fsdp = {a.path for a in client.list_artifacts(children["fsdp"].info.run_id)}
    assert {"localisation.json", "drift_vs_depth.png"} <= fsdp
    assert client.list_artifacts(children["reference"].info.run_id) == []
    local = client.download_artifacts(children["fsdp"].info.run_id, "localisation.json",
                                      str(tmp_path))
    assert json.loads(open(local).read())[0]["layers"]["module"] == "model.layers.0.self_attn"
    results = client.download_artifacts(out.parent_run_id, "results.json", str(tmp_path / "p"))
    assert json.loads(open(results).read())[0]["localisation"][0]["backend"] == "fsdp"
    plots = {a.path for a in client.list_artifacts(out.parent_run_id, "plots")}
    assert "plots/scn_a-drift-vs-depth.png" in plots
