"""Outside services cannot hold a run up: an MLflow tracking server that answers one byte at a
time (so that no socket read ever times out) costs ``run`` and ``report`` the ping's few seconds,
with the (redacted) address in the message; ``--ray-address`` at a port that accepts connections
but is not Ray is refused within seconds, saying so (``ray.init`` waited ~22 s there).

Each server is a tiny local socket server on 127.0.0.1 in a thread of the test."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from reltools import run_args, write_scenario

from rlaudit.errors import EXIT_BAD_INPUT
from rlaudit.executors import ray_address
from rlaudit.report import mlflow_guard

#: seconds between the drip server's bytes: far below any per-read timeout
DRIP_S = 0.05
SECRET = "hunter2"
#: how long a case may take before it counts as held (pytest-timeout)
HUNG_S = 120


class Server:
    """Accepts connections on 127.0.0.1 and treats each with ``serve(conn, stop)``."""

    def __init__(self, serve):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn, self.stop), daemon=True).start()

    def close(self):
        self.stop.set()
        self.sock.close()


def drip(conn, stop):
    """An HTTP answer one byte at a time that never ends: a status line, then header after
    header."""
    answer = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: y\r\n" * 1_000_000
    with conn:
        for i in range(len(answer)):
            if stop.is_set():
                return
            try:
                conn.sendall(answer[i:i + 1])
            except OSError:
                return
            time.sleep(DRIP_S)


def silent(conn, stop):
    """Reads what it is sent and never answers."""
    with conn:
        conn.settimeout(0.1)
        while not stop.is_set():
            try:
                if not conn.recv(1024):
                    return
            except socket.timeout:
                continue
            except OSError:
                return


def http_answer(conn, stop):
    """An HTTP/1.1 server's answer to anything: not gRPC."""
    with conn:
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture
def dripping():
    srv = Server(drip)
    yield srv
    srv.close()


@pytest.mark.slow  # one in-process run (~5 s)
@pytest.mark.timeout(HUNG_S, method="signal")  # before: held forever; a failure, not a hang
def test_run_is_not_held_by_a_server_answering_a_byte_at_a_time(cli, tmp_path, monkeypatch,
                                                                  dripping):
    monkeypatch.setattr(mlflow_guard, "PING_TIMEOUT_S", 1.0)
    scn = write_scenario(tmp_path / "solo.yaml")
    uri = f"http://rlaudit:{SECRET}@127.0.0.1:{dripping.port}"
    args = [a for a in run_args(scn, tmp_path) if a != "--no-mlflow"]
    t0 = time.monotonic()
    res = cli(*args, "--tracking-uri", uri)
    seconds = time.monotonic() - t0
    assert res.rc == 0, res.err      # the audit result stands (no golden: exit 0)
    assert f"127.0.0.1:{dripping.port} did not answer within 1s" in res.err, res.err
    assert "a byte at a time" in res.err and "nothing was logged" in res.err
    assert SECRET not in res.err + res.out
    assert seconds < 60, seconds     # the run itself included; before: never returned


@pytest.mark.timeout(HUNG_S, method="signal")
def test_report_is_not_held_by_a_server_answering_a_byte_at_a_time(cli, tmp_path, monkeypatch,
                                                                     dripping):
    monkeypatch.setattr(mlflow_guard, "PING_TIMEOUT_S", 1.0)
    uri = f"http://rlaudit:{SECRET}@127.0.0.1:{dripping.port}"
    t0 = time.monotonic()
    res = cli("report", "--tracking-uri", uri, "--report-dir", tmp_path)
    seconds = time.monotonic() - t0
    assert res.rc == EXIT_BAD_INPUT, res.err
    assert "--tracking-uri: cannot reach MLflow at http://" in res.err, res.err
    assert f"127.0.0.1:{dripping.port} did not answer within 1s" in res.err, res.err
    assert SECRET not in res.err + res.out
    assert seconds < 10, seconds


@pytest.mark.parametrize("serve, why", [
    (silent, "it accepts connections but did not answer gRPC's HTTP/2 handshake within 1 s"),
    (http_answer, "not gRPC's HTTP/2 handshake (is it another service's port?)"),
    (drip, "not gRPC's HTTP/2 handshake (is it another service's port?)"),
])
def test_a_ray_address_that_is_not_ray_is_refused_within_seconds(serve, why, monkeypatch):
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    srv = Server(serve)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            ray_address.probe_ray_address(f"127.0.0.1:{srv.port}", timeout=1.0)
        seconds = time.monotonic() - t0
    finally:
        srv.close()
    assert info.value.exit_code == EXIT_BAD_INPUT
    message = str(info.value)
    assert message.startswith(f"--ray-address: 127.0.0.1:{srv.port} (127.0.0.1:{srv.port}) is "
                              "not a Ray cluster: "), message
    assert why in message, message
    assert seconds < 3, seconds


def test_a_grpc_server_passes_the_ray_address_probe():
    """What a Ray GCS is to the probe: a gRPC server (no false refusal)."""
    grpc = pytest.importorskip("grpc")
    from concurrent import futures
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        ray_address.probe_ray_address(f"127.0.0.1:{port}", timeout=2.0)
        ray_address.probe_ray_address(f"ray://127.0.0.1:{port}", timeout=2.0)
    finally:
        server.stop(0)


def ping_then_drip(conn, stop):
    """Answers rlaudit's ping at once (404), every other request a byte at a time."""
    if b"rlaudit-probe" not in conn.recv(4096):
        drip(conn, stop)  # closes it
        return
    with conn:
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close"
                     b"\r\n\r\n")


@pytest.mark.timeout(HUNG_S, method="signal")
def test_logging_after_a_prompt_ping_is_bounded_in_all(tmp_path, monkeypatch):
    """Each request's read timeout never expires on a dripping answer: the invocation's logging
    as a whole is bounded (LOG_DEADLINE_S; 2 s here) and says where it was stuck."""
    pytest.importorskip("mlflow.tracking")  # imported now: the 2 s are the logging's alone
    from rlaudit.report import mlflow_log
    from rlaudit.verdict.result import CheckResult, ScenarioResult
    monkeypatch.setattr(mlflow_log, "LOG_DEADLINE_S", 2.0)
    srv = Server(ping_then_drip)
    res = ScenarioResult("s", "s.yaml", ["reference"],
                         checks=[CheckResult("sanity-bounds", "reference", "pass")])
    try:
        t0 = time.monotonic()
        out = mlflow_log.log_invocation([res], report_dir=tmp_path,
                                        tracking_uri=f"http://u:{SECRET}@127.0.0.1:{srv.port}")
        seconds = time.monotonic() - t0
    finally:
        srv.close()
    assert not out.ok
    assert out.message.startswith(f"MLflow logging to http://u:***@127.0.0.1:{srv.port} did not "
                                  "finish within 2s (stuck while opening the tracking store"), \
        out.message
    assert SECRET not in out.message
    assert seconds < 5, seconds
