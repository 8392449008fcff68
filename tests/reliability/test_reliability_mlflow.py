"""MLflow never loses a finished invocation's record and never holds an invocation up (issue #13
cases 5 and 9)."""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from reltools import write_scenario

from rlaudit.report import mlflow_guard, mlflow_log
from rlaudit.verdict.result import CheckResult, ScenarioResult


@pytest.mark.slow
def test_case5_two_first_runs_on_a_fresh_sqlite_store_both_log(first_runs):
    """Both racing first runs exit 0 and both records are in the store (before: one run's record
    was lost with "duplicate column name: step" and the store was left half-migrated)."""
    procs, db = first_runs
    for rc, err in procs:
        assert rc == 0, err
        assert "logged 1 scenario(s)" in err, err
    with sqlite3.connect(db) as con:
        names = sorted(r[0] for r in con.execute("select name from runs"))
    assert names.count("racer0 [reference]") == 1 and names.count("racer1 [reference]") == 1
    assert len(names) == 4  # and a parent run per invocation
    assert not list(db.parent.glob(".mlflow.db.*.tmp"))  # no temporary store left behind


def _silent_server():
    """A socket that accepts connections (the kernel's backlog) and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    return srv


@pytest.mark.slow  # waits out the ping's timeout (1 s here, 5 s by default; little CPU)
def test_case9_a_server_that_never_answers_costs_seconds_not_a_minute(cli, tmp_path,
                                                                       monkeypatch):
    """Before: ~48 s per invocation (15 s per request x 3 tries + backoff). The ping waits
    PING_TIMEOUT_S (5 s); 1 s here, so that the suite does not sit idle for the default."""
    assert mlflow_guard.PING_TIMEOUT_S <= 5
    monkeypatch.setattr(mlflow_guard, "PING_TIMEOUT_S", 1.0)
    scn = write_scenario(tmp_path / "solo.yaml")
    srv = _silent_server()
    uri = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        res = cli("run", scn, "--golden-dir", tmp_path / "golden", "--report-dir",
                  tmp_path / "reports", "--tracking-uri", uri)
        seconds = time.monotonic() - t0
    finally:
        srv.close()
    assert res.rc == 0, res.err  # the audit result stands: no golden, exit 0
    assert "solo: NO GOLDEN" in res.out
    assert f"MLflow logging to {uri} failed while connecting" in res.err
    assert f"did not answer within {mlflow_guard.PING_TIMEOUT_S:g}s" in res.err
    assert "nothing was logged" in res.err
    assert seconds < 3 * mlflow_guard.PING_TIMEOUT_S + 20  # the run itself included


class _ProbeOnly(BaseHTTPRequestHandler):
    """Answers rlaudit's ping at once; every other request hangs (counted) until released."""

    def do_GET(self):
        if "rlaudit-probe" in self.path:
            self.send_response(404)
            self.end_headers()
            return
        self.server.hung_requests.append(self.path)
        self.server.hung.wait(30)

    do_POST = do_GET

    def log_message(self, *a):
        pass


def test_calls_after_the_ping_share_one_retry_per_invocation(tmp_path, monkeypatch):
    """A server that answers the ping and then hangs: each call times out after HTTP_TIMEOUT_S
    and the whole invocation retries once, so it gives up after ~2 timeouts, not 2 per call."""
    monkeypatch.setattr(mlflow_log, "HTTP_TIMEOUT_S", 1)
    monkeypatch.setattr(mlflow_guard, "RETRY_PAUSE_S", 0.1)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _ProbeOnly)
    srv.hung, srv.hung_requests = threading.Event(), []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    res = ScenarioResult("s", "s.yaml", ["reference"],
                         checks=[CheckResult("sanity-bounds", "reference", "pass")])
    try:
        t0 = time.monotonic()
        out = mlflow_log.log_invocation([res], tracking_uri=f"http://127.0.0.1:{srv.server_port}",
                                        report_dir=tmp_path)
        seconds = time.monotonic() - t0
    finally:
        srv.hung.set()
        srv.shutdown()
    assert not out.ok and "nothing was logged" in out.message
    assert "failed while opening the tracking store" in out.message
    # the first call and the invocation's one retry, each bounded by the 1 s timeout
    assert len(srv.hung_requests) == 2, srv.hung_requests
    assert all("experiments/get-by-name" in p for p in srv.hung_requests)
    assert seconds < 10, seconds


def test_a_retry_is_spent_once_per_invocation():
    budget = mlflow_guard.RetryBudget(1)
    calls = []

    def flaky():
        calls.append(1)
        raise ConnectionError("connection reset")
    mlflow_guard.RETRY_PAUSE_S, saved = 0.0, mlflow_guard.RETRY_PAUSE_S
    try:
        with pytest.raises(ConnectionError):
            budget.call("a", flaky)
        assert len(calls) == 2 and budget.left == 0 and budget.spent == ["a (ConnectionError)"]
        with pytest.raises(ConnectionError):
            budget.call("b", flaky)
        assert len(calls) == 3  # no retry left for the second call
        with pytest.raises(ValueError):  # not transient: never retried
            mlflow_guard.RetryBudget(1).call("c", lambda: (_ for _ in ()).throw(ValueError("x")))
    finally:
        mlflow_guard.RETRY_PAUSE_S = saved
