"""A password or token in the tracking URI never reaches what rlaudit prints: the URI is named
with its secrets masked (``user:***@host``, ``?token=***``), in ``run``'s MLflow line and in
``report``'s errors alike."""

from __future__ import annotations

import socket

import pytest
from reltools import write_scenario

from rlaudit.report.redact import mask_uri, redact

SECRET = "s3cr3t-Pa55"


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("uri,masked", [
    (f"http://alice:{SECRET}@db.example:5000/x", "http://alice:***@db.example:5000/x"),
    (f"https://{SECRET}@mlflow.example", "https://***@mlflow.example"),
    (f"postgresql://u:{SECRET}@db/mlflow", "postgresql://u:***@db/mlflow"),
    (f"http://h:5000/?token={SECRET}&x=1", "http://h:5000/?token=***&x=1"),
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ("http://h:5000", "http://h:5000"),
])
def test_uris_are_masked(uri, masked):
    assert mask_uri(uri) == masked
    text = f"failed at {uri}: {SECRET}"
    if SECRET in uri:
        assert redact(text, uri) == f"failed at {masked}: ***"
    else:  # nothing to hide: the message is unchanged
        assert redact(text, uri) == text


def test_run_names_the_tracking_uri_without_its_password(cli, tmp_path):
    scn = write_scenario(tmp_path / "solo.yaml")
    uri = f"http://alice:{SECRET}@127.0.0.1:{_closed_port()}"
    res = cli("run", scn, "--golden-dir", tmp_path / "golden", "--report-dir",
              tmp_path / "reports", "--tracking-uri", uri)
    assert "MLflow logging to http://alice:***@127.0.0.1:" in res.err, res.err
    assert SECRET not in res.err and SECRET not in res.out


def test_report_names_the_tracking_uri_without_its_password(cli, tmp_path):
    uri = f"http://alice:{SECRET}@127.0.0.1:{_closed_port()}"
    res = cli("report", "--report-dir", tmp_path / "reports", "--tracking-uri", uri)
    assert res.rc == 2, res.err
    assert "alice:***@127.0.0.1" in res.err, res.err
    assert SECRET not in res.err and SECRET not in res.out
