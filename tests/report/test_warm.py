"""rlaudit.report.warm: the report's and MLflow's modules imported in the background, once, and
nothing of MLflow when the run does not log to it, nor matplotlib (the report draws its metrics
grid itself; checked in fresh interpreters); a local sqlite store that does not exist yet is
created there too (migrated), and nothing else is touched."""

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
import os
db = {uri!r} and {uri!r}.startswith("sqlite:///") and {uri!r}[len("sqlite:///"):]
print(json.dumps({{"again": again is None, "db": bool(db) and os.path.getsize(db) > 0,
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
    db = tmp_path / "reports" / "mlflow.db"  # its folder does not exist yet either
    got = _run(f"sqlite:///{db}")
    assert got["again"]
    assert got["db"]  # created in the background, not after the last scenario
    from mlflow.tracking import MlflowClient  # a migrated store: it opens as it is, no temp left
    assert MlflowClient(tracking_uri=f"sqlite:///{db}").get_experiment_by_name("Default")
    assert sorted(p.name for p in db.parent.iterdir()) == ["mlflow.db", "mlflow.db.lock"]
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


def test_an_existing_store_or_a_server_is_left_alone(tmp_path, monkeypatch):
    from rlaudit.report import mlflow_guard, warm

    opened = []
    monkeypatch.setattr(mlflow_guard, "_create_sqlite_store", opened.append)
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not touched")
    warm._create_missing_store(f"sqlite:///{db}")
    warm._create_missing_store("http://127.0.0.1:9")
    warm._create_missing_store("sqlite:///:memory:")
    assert opened == [] and db.read_bytes() == b"not touched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]  # not even its lock
    warm._create_missing_store(f"sqlite:///{tmp_path / 'new.db'}")
    assert opened == [tmp_path / "new.db"]  # a missing one: created under the logging's lock


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
