"""The local run report: files written atomically, content from hand-built results."""

from __future__ import annotations

import base64
import re
import xml.etree.ElementTree as ET

import pytest

from rlaudit.report import render
from rlaudit.report.run_report import failures, golden_rows, invariant_rows, write_run_report

SVG = "{http://www.w3.org/2000/svg}"


def is_svg(data: bytes) -> bool:
    """A well-formed SVG document (parsed, not just sniffed)."""
    return ET.fromstring(data).tag == f"{SVG}svg"


def test_invariant_table_takes_the_worst_status_per_backend(make):
    res = make(failing_check=True)
    rows = {r[0]: r[1:] for r in invariant_rows(res)}
    assert rows["stored_kl_unaltered"] == ["pass", "fail"]
    assert rows["backend_parity"] == ["pass", "pass"]          # a "*" check applies to both
    assert rows["golden"] == ["pass", "pass"]
    crashed = make(crashed="fsdp")
    rows = {r[0]: r[1:] for r in invariant_rows(crashed)}
    assert rows["(backend ran)"] == ["-", "error"]
    assert rows["entropy_logged"] == ["pass", "-"]


def test_golden_rows_put_failures_first(make):
    res = make(shift={"fsdp": {"actor/pg_loss": 1e-3}})
    rows = golden_rows(res)
    bad = [r for r in rows if not r["ok"]]
    assert [(r["backend"], r["metric"], r["step"]) for r in bad] == [
        ("fsdp", "actor/pg_loss", 0), ("fsdp", "actor/pg_loss", 1)]
    assert rows[:2] == bad
    assert len(rows) == 2 * 2 * 4   # backends x steps x golden metrics (timing excluded)
    assert any("golden FAIL [fsdp]" in f for f in failures(res))


@pytest.mark.slow
def test_write_run_report(make, tmp_path):
    results = [make("scn_a", shift={"fsdp": {"actor/pg_loss": 1e-3}}, failing_check=True),
               make("scn_b", steps=3, crashed="fsdp"), make("scn_c", backends=("reference",))]
    stale = [tmp_path / "latest" / "plots" / f"old_scenario.{ext}" for ext in ("png", "svg")]
    stale[0].parent.mkdir(parents=True)
    for old in stale:
        old.write_bytes(b"old")
    paths = write_run_report(results, tmp_path)
    latest = tmp_path / "latest"
    assert paths[:2] == [latest / "report.html", latest / "report.md"]
    assert sorted(p.name for p in paths[2:]) == ["scn_a.svg", "scn_b.svg", "scn_c.svg"]
    assert not any(old.exists() for old in stale)
    assert sorted(p.name for p in latest.iterdir()) == ["plots", "report.html", "report.md"]
    html = (latest / "report.html").read_text()
    # self-contained: three embedded SVGs that decode and parse, no external references
    imgs = re.findall(r'src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(imgs) == 3 and all(is_svg(base64.b64decode(i)) for i in imgs)
    assert "<link" not in html and "http://" not in html and "https://" not in html
    # failure messages are shown, escaped
    assert "rollout/kl 0.5 vs 0.25 &lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html
    assert "RankFailure: rank 1 died" in html
    assert html.count('class="badge bad">FAILED') == 3   # summary + scn_a + scn_b
    assert html.count('class="badge ok">PASSED') == 1    # scn_c
    md = (latest / "report.md").read_text()
    assert "**1/3 scenarios passed**" in md
    assert "![scn_a metrics](plots/scn_a.svg)" in md
    assert "| fsdp | 0 | actor/pg_loss | 0.501 | 0.5 | 0.002 |" in md
    for p in paths[2:]:
        assert is_svg(p.read_bytes())


def test_write_atomic_gives_normal_permissions(tmp_path):
    import os
    mask = os.umask(0o022)
    try:
        path = render.write_atomic(tmp_path / "r.html", "x")
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o644 and path.read_text() == "x"


def test_write_atomic_leaves_no_temp_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "x.html"
    target.write_text("old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(render.os, "replace", boom)
    with pytest.raises(OSError):
        render.write_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.html"]


def test_fmt_num_and_tables():
    assert render.fmt_num(None) == "" and render.fmt_num(float("nan")) == "nan"
    assert render.fmt_num(1.23456789e-7, 3) == "1.23e-07"
    assert render.md_table(["a|b"], [["x\ny"]]) == "| a\\|b |\n|---|\n| x y |"
    assert render.text_table(["k", "value"], [["long-key", 1]]).splitlines() == [
        "k         value", "--------  -----", "long-key  1"]


def test_plots_rendered_ahead_are_used_and_the_rest_rendered(make, tmp_path):
    """`rlaudit run` renders each result's plots while later scenarios still run and hands them
    over by id(result): those are written as given, the others rendered here."""
    from rlaudit.report.run_report import build_run_report, scenario_plots

    a, b = make("scn_a"), make("scn_b")
    written = {p.name: p.read_bytes()
               for p in build_run_report([a, b], tmp_path / "x",
                                         {id(a): (b"rendered ahead", None)})}
    assert written["scn_a.svg"] == b"rendered ahead"
    assert is_svg(written["scn_b.svg"])
    # what was rendered ahead is what the report would have rendered itself
    ahead = scenario_plots(b)
    assert is_svg(ahead[0]) and ahead[1] is None
    plain = {p.name: p.read_bytes() for p in build_run_report([b], tmp_path / "y")}
    given = {p.name: p.read_bytes() for p in build_run_report([b], tmp_path / "z", {id(b): ahead})}
    assert given["scn_b.svg"] == plain["scn_b.svg"] == ahead[0]
    assert given["report.md"] == plain["report.md"]


def test_the_cli_renders_plots_as_results_come_in(monkeypatch, tmp_path):
    """Each result's plots are rendered once, before the report, which then renders none."""
    from rlaudit.cli.main import main
    from rlaudit.report import run_report

    calls = []
    real = run_report.scenario_plots
    monkeypatch.setattr(run_report, "scenario_plots",
                        lambda res: calls.append(res.scenario) or real(res))
    written = []
    real_build = run_report.build_run_report
    monkeypatch.setattr(run_report, "build_run_report",
                        lambda *a, **k: written.append(list(calls)) or real_build(*a, **k))
    assert main(["run", "seed_entropy_coeff_zero", "adv_rloo", "--backend", "reference",
                 "--no-mlflow", "--report-dir", str(tmp_path)]) == 0
    assert written == [["seed_entropy_coeff_zero", "adv_rloo"]]   # both before the report
    assert calls == ["seed_entropy_coeff_zero", "adv_rloo"]       # and not again
    assert (tmp_path / "latest" / "plots" / "adv_rloo.svg").is_file()


def test_metrics_grid_panels_colours_and_flags(make):
    """One panel per plotted metric (timing left out), each backend one colour in every panel,
    the golden band in the legend first, a metric out of its golden tolerance titled in red."""
    from rlaudit.report import svg
    from rlaudit.report.run_report import plot_metrics

    res = make("scn_a", backends=("reference", "fsdp", "megatron"),
               shift={"megatron": {"actor/pg_loss": 1e-3}})
    root = ET.fromstring(plot_metrics(res))
    titles = {t.text: t for t in root.iter(f"{SVG}text") if t.get("font-size") == "11"}
    assert set(titles) == {"actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"}
    assert titles["actor/pg_loss"].get("fill") == svg.FLAG
    assert all(titles[n].get("fill") != svg.FLAG for n in titles if n != "actor/pg_loss")
    lines = [p.get("stroke") for p in root.iter(f"{SVG}polyline")]
    assert len(lines) == 3 * 4 and len(set(lines)) == 3  # 3 backends x 4 panels, 3 colours
    legend = [t.text for t in root.iter(f"{SVG}text") if t.get("text-anchor") == "start"]
    assert legend == ["golden ± tol", "reference", "fsdp", "megatron"]
    assert plot_metrics(make("scn_b", golden=False)) is not None
