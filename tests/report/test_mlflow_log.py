"""MLflow logging: what goes into a child run (pure functions), the embedded sqlite store end to
end, and every way MLflow can fail without the call raising."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pandas as pd
import pytest

from rlaudit.report import mlflow_content, mlflow_log
from rlaudit.report.mlflow_content import (child_metrics, child_params, child_tags, sanitize_key,
                                           token_diffs)
from rlaudit.report.mlflow_log import log_invocation, resolve_tracking_uri


def test_sanitize_key_keeps_valid_names_and_fixes_the_rest():
    assert sanitize_key("actor/pg_loss") == "actor/pg_loss"
    assert sanitize_key("golden_drift/critic/score/mean") == "golden_drift/critic/score/mean"
    assert sanitize_key("a:b(c)") == "a_b_c_"
    assert sanitize_key("/a//b/../c/") == "a/b/c"
    assert sanitize_key("x" * 300) == "x" * 250


def test_resolve_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri, art = resolve_tracking_uri(None, tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert art == (tmp_path / "mlartifacts").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert resolve_tracking_uri(None, tmp_path) == ("http://mlflow.internal:5000", None)
    assert resolve_tracking_uri("sqlite:////x/y.db", tmp_path)[0] == "sqlite:////x/y.db"


def test_child_params_tags_and_metrics(make):
    res = make(failing_check=True, shift={"fsdp": {"actor/pg_loss": 1e-3}})
    params = child_params(res, "fsdp", "0123abcd")
    assert params["layout.dp"] == "2" and params["dtype"] == "float64"
    assert params["actor.entropy_coeff"] == "0.0" and params["provenance.vllm"] == "None"
    assert params["provenance.model_sha"] == "abc123" and params["git_revision"] == "0123abcd"
    tags = child_tags(res, "fsdp", "p" * 32, None, {"ci.job": "42"})
    assert tags["invariant.stored_kl_unaltered"] == "fail"
    assert tags["invariant.stored_kl_unaltered.message"].startswith("rollout/kl 0.5 vs 0.25")
    assert tags["invariant.backend_parity"] == "pass" and tags["invariant.entropy_logged"] == "pass"
    assert tags["golden"] == "fail" and tags["mlflow.parentRunId"] == "p" * 32
    assert tags["ci.job"] == "42" and tags["rlaudit.kind"] == "scenario"
    assert child_tags(res, "reference", "p", None, {})["invariant.stored_kl_unaltered"] == "pass"
    m = {(k, s): v for k, v, s in child_metrics(res, "fsdp")}
    assert m[("actor/pg_loss", 1)] == pytest.approx(0.5 + 0.1 + 1e-3)
    assert m[("golden/actor/pg_loss", 1)] == pytest.approx(0.6)
    assert m[("golden_drift/actor/pg_loss", 0)] == pytest.approx(1e-3 / 0.5)
    assert m[("golden_rtol/actor/entropy", 0)] == 1e-6 and ("timing/step", 0) in m
    assert ("golden/timing/step", 0) not in m


def test_token_diffs_match_a_naive_loop(make):
    res = make()
    df, truncated = token_diffs(res, "fsdp", "reference")
    assert not truncated
    a, b = res.runs["fsdp"]["base"].tokens, res.runs["reference"]["base"].tokens
    expected = []
    for name in sorted(a):
        for i in range(a[name].shape[0]):
            for t in range(a[name].shape[1]):
                va, vb = float(a[name][i, t]), float(b[name][i, t])
                expected.append(("base", name, i, t, va, vb, va - vb))
    got = [tuple(r) for r in df[["variant", "tensor", "row", "token", "value", "reference",
                                 "diff"]].itertuples(index=False)]
    assert got == expected
    # probe_log_probs differ by the factory's 0.001 offset; advantages are identical
    assert df[df.tensor == "probe_log_probs"]["diff"].tolist() == pytest.approx([0.001] * 6)
    assert (df[df.tensor == "advantages"]["diff"] == 0).all()
    df2, truncated = token_diffs(res, "fsdp", "reference", max_rows=6)
    assert truncated and set(df2.tensor) == {"advantages"}


def test_unreachable_server_fails_fast_without_raising(make, tmp_path):
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    out = log_invocation([make()], tracking_uri=f"http://127.0.0.1:{port}", report_dir=tmp_path)
    assert time.monotonic() - t0 < 5
    assert not out.ok and out.parent_run_id is None
    assert f"127.0.0.1:{port}" in out.message and "nothing was logged" in out.message


def test_report_dir_that_cannot_be_created(make, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = log_invocation([make()], tracking_uri=None, report_dir=blocker / "reports")
    assert not out.ok and "nothing was logged" in out.message


@pytest.mark.slow
def test_file_store_is_refused_cleanly(make, tmp_path):
    out = log_invocation([make()], tracking_uri=(tmp_path / "mlruns").as_uri(), report_dir=tmp_path)
    assert not out.ok and "opening the tracking store" in out.message


@pytest.mark.slow
def test_hung_server_is_bounded(make, tmp_path, monkeypatch):
    """A server that accepts connections but never answers: the ping's timeout bounds the call
    (1 s here instead of its 5 s)."""
    from rlaudit.report import mlflow_guard
    monkeypatch.setattr(mlflow_guard, "PING_TIMEOUT_S", 1.0)
    monkeypatch.setattr(mlflow_log, "HTTP_TIMEOUT_S", 1)
    monkeypatch.setattr(mlflow_log, "HTTP_MAX_RETRIES", 0)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)   # never accept(): connects succeed, requests hang
    try:
        t0 = time.monotonic()
        out = log_invocation([make()], tracking_uri=f"http://127.0.0.1:{srv.getsockname()[1]}",
                             report_dir=tmp_path)
        assert time.monotonic() - t0 < 60
    finally:
        srv.close()
    assert not out.ok and "nothing was logged" in out.message
    assert "did not answer within 1s" in out.message
    import os
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ or \
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] != "1"   # restored after the call


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")  # mlflow's sqlalchemy use
def test_embedded_sqlite_store(make, report_dir, monkeypatch, tmp_path):
    """tracking_uri=None and no $MLFLOW_TRACKING_URI: <report_dir>/mlflow.db + mlartifacts."""
    from mlflow.tracking import MlflowClient
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = [make("scn_a", failing_check=True, shift={"fsdp": {"actor/pg_loss": 1e-3}}),
               make("scn_b", backends=("reference", "fsdp"), crashed="fsdp", steps=3)]
    out = log_invocation(results, tracking_uri=None, report_dir=report_dir, run_name="nightly",
                         extra_tags={"ci.job": "42"})
    assert out.ok, out.message
    assert out.tracking_uri == f"sqlite:///{report_dir.resolve()}/mlflow.db"
    client = MlflowClient(tracking_uri=out.tracking_uri)
    exp = client.get_experiment_by_name("rlaudit")
    assert exp.artifact_location == (report_dir / "mlartifacts").resolve().as_uri()
    parent = client.get_run(out.parent_run_id)
    assert parent.info.run_name == "nightly" and parent.info.status == "FINISHED"
    assert parent.data.tags["rlaudit.kind"] == "invocation" and parent.data.tags["ci.job"] == "42"
    assert parent.data.tags["rlaudit.passed"] == "false"
    assert parent.data.tags["rlaudit.states"] == "scn_a=failed,scn_b=failed"
    assert parent.data.metrics == {"scenarios_total": 2.0, "scenarios_passed": 0.0,
                                   "scenarios_no_golden": 0.0, "seconds": 3.0}
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.html", "report.md", "results.json", "plots"} <= arts
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "plots")} == {
        "plots/scn_a.svg", "plots/scn_b.svg"}
    children = client.search_runs([exp.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{out.parent_run_id}'")
    by = {(c.data.tags["rlaudit.scenario"], c.data.tags["rlaudit.backend"]): c for c in children}
    assert set(by) == {("scn_a", "reference"), ("scn_a", "fsdp"), ("scn_b", "reference"),
                       ("scn_b", "fsdp")}
    a_fsdp = by[("scn_a", "fsdp")]
    hist = client.get_metric_history(a_fsdp.info.run_id, "actor/pg_loss")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [
        (0, pytest.approx(0.501)), (1, pytest.approx(0.601))]
    gd = client.get_metric_history(a_fsdp.info.run_id, "golden_drift/actor/pg_loss")
    assert sorted((m.step, round(m.value, 6)) for m in gd) == [(0, 0.002), (1, 0.001667)]
    assert a_fsdp.data.params["layout.dp"] == "2" and a_fsdp.data.params["dtype"] == "float64"
    assert a_fsdp.data.tags["invariant.stored_kl_unaltered"] == "fail"
    assert a_fsdp.data.tags["golden"] == "fail" and a_fsdp.data.tags["ci.job"] == "42"
    assert a_fsdp.data.tags["rlaudit.state"] == "failed"
    assert by[("scn_b", "fsdp")].info.status == "FAILED"
    assert by[("scn_b", "fsdp")].data.tags["invariant.backend"] == "error"
    assert "rank 1 died" in by[("scn_b", "fsdp")].data.tags["error"]
    assert [a.path for a in client.list_artifacts(a_fsdp.info.run_id)] == ["token_diffs.parquet"]
    assert client.list_artifacts(by[("scn_a", "reference")].info.run_id) == []
    local = client.download_artifacts(a_fsdp.info.run_id, "token_diffs.parquet", str(tmp_path))
    diffs = pd.read_parquet(local)
    ref = results[0].runs["reference"]["base"].tokens["probe_log_probs"]
    got = diffs[diffs.tensor == "probe_log_probs"].sort_values(["row", "token"])
    assert got["reference"].tolist() == ref.flatten().tolist()
    assert got["diff"].tolist() == pytest.approx([0.001] * ref.numel())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")
def test_report_files_are_attached_as_given(make, report_dir, tmp_path):
    """With report_files (what write_run_report returned) nothing is rendered again."""
    from mlflow.tracking import MlflowClient
    files = [tmp_path / "report.html", tmp_path / "report.md", tmp_path / "scn_a.svg",
             tmp_path / "scn_a-drift-vs-depth.png"]
    for f in files:
        f.write_text(f"content of {f.name}")
    uri = f"sqlite:///{report_dir / 'mlflow.db'}"
    out = log_invocation([make()], tracking_uri=uri, report_dir=report_dir, report_files=files)
    assert out.ok, out.message
    client = MlflowClient(tracking_uri=uri)
    local = client.download_artifacts(out.parent_run_id, "", str(tmp_path / "dl"))
    got = {p.relative_to(local).as_posix(): p for p in Path(local).rglob("*") if p.is_file()}
    assert set(got) == {"report.html", "report.md", "plots/scn_a.svg",
                        "plots/scn_a-drift-vs-depth.png", "results.json"}
    assert got["report.html"].read_text() == "content of report.html"
    # a file gone meanwhile (a concurrent run replaced reports/latest/): rendered again instead
    missing = log_invocation([make()], tracking_uri=uri, report_dir=report_dir,
                             report_files=[tmp_path / "nope.html"])
    assert missing.ok and missing.parent_run_id is not None, missing.message
    again = client.download_artifacts(missing.parent_run_id, "", str(tmp_path / "dl2"))
    assert "scn_a" in (Path(again) / "report.html").read_text()


def test_token_diffs_fall_back_to_csv_without_a_parquet_engine(make, tmp_path, monkeypatch):
    df, _ = token_diffs(make(), "fsdp", "reference")

    def no_engine(*a, **k):
        raise ImportError("Unable to find a usable engine; tried using: 'pyarrow', 'fastparquet'")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", no_engine)
    path = mlflow_content.write_frame(df, tmp_path / "token_diffs")
    assert path.name == "token_diffs.csv.gz"
    back = pd.read_csv(path)
    assert back["diff"].tolist() == pytest.approx(df["diff"].tolist())


def test_git_revision(tmp_path):
    assert mlflow_log.git_revision(tmp_path) is None          # not a repository
    rev = mlflow_log.git_revision(Path(__file__).parent)
    assert rev is None or len(rev) >= 7                      # a checkout, or an sdist
