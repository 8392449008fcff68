"""rlaudit.report.warm: the report's and MLflow's modules imported in the background, once, and
nothing of MLflow when the run does not log to it, nor matplotlib (the report draws its metrics
grid itself; checked in fresh interpreters)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
from rlaudit.report.warm import warm_report_imports
t = warm_report_imports(mlflow_uri={uri!r})
t.join(120)
again = warm_report_imports(mlflow_uri={uri!r})
print(json.dumps({{"again": again is None,
                  "mods": {{m: m in sys.modules for m in (
                      "rlaudit.report.run_report", "matplotlib", "mlflow.tracking",
                      "mlflow.store.tracking.sqlalchemy_store")}}}}))
"""


def _run(uri):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(uri=uri)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_imports_for_a_sqlite_store_once(tmp_path):
    pytest.importorskip("mlflow")
    got = _run(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert got["again"]
    assert got["mods"] == {"rlaudit.report.run_report": True, "matplotlib": False,
                           "mlflow.tracking": True,
                           "mlflow.store.tracking.sqlalchemy_store": True}


@pytest.mark.slow
def test_no_mlflow_when_the_run_does_not_log_to_it():
    got = _run(None)
    assert got["mods"]["rlaudit.report.run_report"] and not got["mods"]["mlflow.tracking"]
    http = _run("http://127.0.0.1:9")  # a server: no SQL store module needed
    assert http["mods"]["mlflow.tracking"] is True
    assert http["mods"]["mlflow.store.tracking.sqlalchemy_store"] is False
