"""`rlaudit golden orphans`: goldens whose scenario is gone are named, exit 1; none, exit 0."""

from __future__ import annotations

from pathlib import Path

from rlaudit.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_orphan_golden_is_named_and_matched_one_is_not(tmp_path, capsys):
    scenarios, golden = tmp_path / "scn", tmp_path / "golden"
    scenarios.mkdir()
    golden.mkdir()
    (scenarios / "kept.yaml").write_text("description: a scenario\n")
    (scenarios / "stem.yaml").write_text("name: renamed\n")  # filed under its name key
    for name in ("kept", "renamed", "gone", "kept.obtained"):
        (golden / f"{name}.json").write_text("{}\n")
    code = main(["golden", "orphans", "--scenarios-dir", str(scenarios),
                 "--golden-dir", str(golden)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"orphan golden gone ({golden / 'gone.json'})" in out
    assert len(out.splitlines()) == 1  # not kept, renamed, nor the .obtained.json mismatch output


def test_repo_has_no_orphan_goldens(capsys):
    code = main(["golden", "orphans", "--scenarios-dir", str(REPO / "scenarios"),
                 "--golden-dir", str(REPO / "golden")])
    assert code == 0, capsys.readouterr().out
