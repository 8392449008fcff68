"""A target's own code cannot end the audit: a syntax error, an exception or ``SystemExit`` while
its module is imported or its adapter constructed is bad input for ``--target`` (exit 2, one
line, no traceback); a stage that raises ``SystemExit`` once loaded is that check's error state
(a finding: exit 1, reported in its checks), never a silent exit 0."""

from __future__ import annotations

import json
import sys

import pytest

KL_STAGE = ("    def kl_penalty(self, *, log_prob, ref_log_prob, kind):\n"
            "        {body}\n")


def _target(tmp_path, monkeypatch, module: str, source: str) -> str:
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    return f"{module}:Adapter"


def _run(cli, tmp_path, spec, *extra):
    return cli("run", "--target", spec, "--scenarios-dir", tmp_path / "none", "--no-mlflow",
               "--report-dir", tmp_path / "reports", *extra)


@pytest.mark.parametrize("kind,source,fragment", [
    ("syntax", "class Adapter(:\n    pass\n", "SyntaxError"),
    ("raises", "raise RuntimeError('no GPU here\\nsecond line')\n", "RuntimeError: no GPU here"),
    ("exits", "import sys\nsys.exit(0)\n", "SystemExit: exit code 0"),
    ("init", "class Adapter:\n    name = 'mine'\n    def __init__(self):\n"
             "        raise ValueError('needs a config')\n", "Adapter() raised ValueError"),
    ("init_exit", "class Adapter:\n    name = 'mine'\n    def __init__(self):\n"
                  "        raise SystemExit(3)\n", "Adapter() raised SystemExit"),
])
def test_a_target_that_fails_to_load_is_one_line_of_bad_input(cli, tmp_path, monkeypatch,
                                                              kind, source, fragment):
    spec = _target(tmp_path, monkeypatch, f"rel_target_{kind}", source)
    res = _run(cli, tmp_path, spec)
    assert res.rc == 2, (res.rc, res.out, res.err)
    assert fragment in res.err and "--target" in res.err and spec in res.err
    assert "Traceback" not in res.err and "second line" not in res.err
    assert not (tmp_path / "reports").exists()


def test_a_stage_that_raises_systemexit_is_that_checks_error_not_exit_0(cli, tmp_path,
                                                                          monkeypatch):
    source = "class Adapter:\n    name = 'mine'\n" + KL_STAGE.format(body="raise SystemExit(0)")
    spec = _target(tmp_path, monkeypatch, "rel_target_stage_exit", source)
    res = _run(cli, tmp_path, spec, "--json")
    assert res.rc == 1, (res.rc, res.out[-2000:], res.err[-2000:])
    results = json.loads(res.out)
    raised = [c for r in results for c in r["checks"]
              if c["status"] in ("fail", "error") and "raised SystemExit" in c["message"]]
    assert raised and all(c["invariant"].startswith("kl_penalty:") for c in raised), results
