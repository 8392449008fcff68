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


def test_the_report_waits_for_the_background_imports(monkeypatch, tmp_path):
    """`rlaudit run` imports the report and MLflow only once the background imports are done:
    two threads importing MLflow at once gave one a partly initialised mlflow.tracking."""
    import argparse
    import threading
    import time

    from rlaudit.cli import run as run_cmd
    from rlaudit.report import run_report, warm

    done = threading.Event()
    slow = threading.Thread(target=lambda: (time.sleep(0.5), done.set()), daemon=True)
    monkeypatch.setattr(warm, "_thread", slow)
    seen = []
    monkeypatch.setattr(run_report, "write_run_report",
                        lambda *a, **k: seen.append(done.is_set()) or [])
    slow.start()
    run_cmd._report([], argparse.Namespace(report_dir=str(tmp_path), no_mlflow=True))
    assert seen == [True]


def test_waiting_needs_no_thread_and_never_waits_on_itself(monkeypatch):
    import threading

    from rlaudit.report import warm

    monkeypatch.setattr(warm, "_thread", None)
    warm.wait_for_warm_imports()  # nothing started: returns at once
    got = []

    def body():
        warm.wait_for_warm_imports(timeout=5)  # from the warm thread itself: no self-join
        got.append("returned")

    me = threading.Thread(target=body)
    monkeypatch.setattr(warm, "_thread", me)
    me.start()
    me.join(10)
    assert got == ["returned"]
