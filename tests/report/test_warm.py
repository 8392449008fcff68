"""rlaudit.report.warm: the report's and MLflow's modules imported in the background, once, and
nothing of MLflow when the run does not log to it (checked in fresh interpreters)."""

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
import matplotlib
import os, sqlite3
db = {uri!r}[len("sqlite:///"):] if str({uri!r}).startswith("sqlite:///") else None
try:
    tables = (sorted(r[0] for r in sqlite3.connect(db).execute(
        "select name from sqlite_master where type='table'")) if db and os.path.exists(db)
        else None)
except sqlite3.DatabaseError:
    tables = "not a database"
print(json.dumps({{"again": again is None, "backend": matplotlib.get_backend().lower(),
                  "tables": tables,
                  "mods": {{m: m in sys.modules for m in (
                      "matplotlib.pyplot", "mlflow.tracking",
                      "mlflow.store.tracking.sqlalchemy_store")}}}}))
"""


def _run(uri):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(uri=uri)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_imports_for_a_sqlite_store_once_and_on_agg(tmp_path):
    pytest.importorskip("mlflow")
    got = _run(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert got["again"] and got["backend"] == "agg"
    assert got["mods"] == {"matplotlib.pyplot": True, "mlflow.tracking": True,
                           "mlflow.store.tracking.sqlalchemy_store": True}
    # the new store was created, migrated, in the background: the logging only opens it
    assert {"alembic_version", "experiments", "runs", "metrics"} <= set(got["tables"])
    assert not list(tmp_path.glob(".mlflow.db.*.tmp"))


@pytest.mark.slow
def test_an_existing_store_is_left_to_the_logging(tmp_path):
    """Only a missing (or empty) sqlite file is created here; anything else is the logging's to
    open, and to report on: a file that is not a store stays as it was."""
    pytest.importorskip("mlflow")
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not a database")
    got = _run(f"sqlite:///{db}")
    assert got["mods"]["mlflow.store.tracking.sqlalchemy_store"] is True
    assert db.read_bytes() == b"not a database"


@pytest.mark.slow
def test_no_mlflow_when_the_run_does_not_log_to_it():
    got = _run(None)
    assert got["mods"]["matplotlib.pyplot"] and not got["mods"]["mlflow.tracking"]
    http = _run("http://127.0.0.1:9")  # a server: no SQL store module needed
    assert http["mods"]["mlflow.tracking"] is True
    assert http["mods"]["mlflow.store.tracking.sqlalchemy_store"] is False
