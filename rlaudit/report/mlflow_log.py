"""Log one ``rlaudit run`` invocation to MLflow: a parent run, a child run per scenario x backend.

Parent run (tag ``rlaudit.kind=invocation``): the invocation's report (report.html, report.md,
plots/*.svg and *.png) and results.json as artifacts; metrics
``scenarios_total``/``scenarios_passed``.
Child run (tag ``rlaudit.kind=scenario``, ``mlflow.parentRunId``):

- params: the flattened scenario config (``actor.entropy_coeff`` ...), ``layout.<dim>``, ``dtype``,
  ``device``, ``provenance.<name>`` (rlaudit/torch/megatron/vllm/transformers versions, model and
  rollout sha), ``git_revision`` (``git rev-parse HEAD`` of the working directory, when in a repo);
- metrics at ``step=i`` for every training step: the catalogue metrics, and from the golden rows
  ``golden/<m>`` (golden value), ``golden_drift/<m>`` (relative drift), ``golden_rtol/<m>``,
  ``golden_atol/<m>`` — what ``rlaudit report`` reads back;
- tags: ``invariant.<name>`` = pass | fail | n/a | error (worst check for this backend),
  ``invariant.<name>.message`` for failures, ``golden`` = the golden status, ``error`` (crash);
- artifact ``token_diffs.parquet`` (non-reference backends): per-token tensors minus the
  reference backend's, long format: variant, tensor, row, token, value, reference, diff;
- artifacts ``localisation.json`` and ``drift_vs_depth.png`` on a backend whose parity or golden
  check failed: where it first diverged (rlaudit/scenarios/localise.py).

Where it logs: ``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else the embedded store
``sqlite:///<report_dir>/mlflow.db`` with artifacts under ``<report_dir>/mlartifacts``.

MLflow failing (bad URI, server down or hung, permissions) never raises: the outcome says what
could not be logged. A server must answer a ping request within a few seconds; HTTP requests
are bounded by a timeout; all calls of an invocation share one retry; a fresh sqlite store is
created under a file lock (rlaudit.report.mlflow_guard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from rlaudit.report import localise_view, run_report
from rlaudit.report.mlflow_content import (INVOCATION, KIND_TAG, MAX_TAG_VALUE, child_metrics,
                                           child_params, child_tags, reference_backend,
                                           sanitize_key, token_diffs, write_frame)
from rlaudit.report.mlflow_guard import BudgetedClient, RetryBudget, open_store_lock, ping
from rlaudit.report.redact import redact
from rlaudit.verdict.result import INTERRUPTED, NOTHING_APPLIED, ScenarioResult

EMBEDDED_DB = "mlflow.db"
EMBEDDED_ARTIFACTS = "mlartifacts"
DEFAULT_EXPERIMENT = "rlaudit"
#: SQL stores need an explicit artifact location (a file: tracking store is refused by MLflow 3)
DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")

#: seconds to wait for a TCP connection to an http(s) tracking server before giving up on it
CONNECT_TIMEOUT_S = 3.0
#: per-request HTTP timeout while logging, and MLflow's own per-request retries: none, the
#: invocation's calls share mlflow_guard.RETRY_BUDGET instead (MLflow's defaults, 120 s x 7
#: retries with backoff, can hang a CI job for many minutes on a dead server)
HTTP_TIMEOUT_S = 10
HTTP_MAX_RETRIES = 0
HTTP_BACKOFF_FACTOR = 1
#: MLflow's per-request limits for log_batch
BATCH_METRICS, BATCH_PARAMS_TAGS = 1000, 100
#: seconds `git rev-parse` may take (a network filesystem can stall)
GIT_TIMEOUT_S = 5
#: seconds one invocation's logging may take in all: each request's read timeout does not
#: bound a server answering every request a byte at a time after a prompt ping
LOG_DEADLINE_S = 300.0


@dataclass
class LogOutcome:
    ok: bool
    message: str
    parent_run_id: str | None
    tracking_uri: str


# ---- where to log ------------------------------------------------------------------------------

def is_database_uri(uri: str) -> bool:
    """True for a SQL tracking store (``sqlite:///...``, ``postgresql+psycopg2://...``)."""
    return urlparse(uri).scheme.split("+")[0] in DB_SCHEMES


def resolve_tracking_uri(tracking_uri: str | None, report_dir: Path) -> tuple[str, str | None]:
    """(tracking URI, artifact location for a new experiment or None to let the server decide)."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(Path(report_dir) / EMBEDDED_DB).resolve()}"
    artifacts = (Path(report_dir) / EMBEDDED_ARTIFACTS).resolve().as_uri() \
        if is_database_uri(uri) else None
    return uri, artifacts


def preflight(uri: str) -> None:
    """Fail fast (OSError) when an http(s) server does not accept connections, or a sqlite
    store's directory cannot be created."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        with socket.create_connection((parsed.hostname or "localhost", port), CONNECT_TIMEOUT_S):
            pass
    elif parsed.scheme == "sqlite" and uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if str(db) != ":memory:":
            db.parent.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def bounded_http(*, retries: int = HTTP_MAX_RETRIES) -> Iterator[None]:
    """For the duration of the block (restored after): bound MLflow's HTTP timeout/retries, and
    stop it printing "View run at <url>" to stdout (it would corrupt `rlaudit run --json`)."""
    values = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(HTTP_TIMEOUT_S),
              "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(HTTP_BACKOFF_FACTOR),
              "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    quiet = [logging.getLogger(n) for n in ("mlflow", "alembic")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:  # migrations of a new sqlite store log a dozen INFO lines
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, lvl in zip(quiet, levels):
            lg.setLevel(lvl)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def git_revision(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    rev = out.stdout.strip()
    return rev if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{7,64}", rev) else None


# ---- logging -----------------------------------------------------------------------------------

class _Progress:
    """What has been logged so far, for the message when something fails part-way."""

    def __init__(self):
        self.stage = "connecting"
        self.parent: str | None = None
        self.children = 0
        self.total = 0
        self.notes: list[str] = []


def _experiment_id(client, name: str, artifact_location: str | None) -> str:
    from mlflow.exceptions import MlflowException  # lazy: mlflow only when logging
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # created concurrently by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage != "active":
        raise RuntimeError(f"experiment {name!r} is deleted; restore it (mlflow experiments "
                           f"restore --experiment-id {exp.experiment_id}) or use another name")
    return exp.experiment_id


def _log_batch(client, run_id: str, *, metrics=(), params=None, tags=None) -> None:
    from mlflow.entities import Metric, Param, RunTag  # lazy: mlflow only when logging
    now = int(time.time() * 1000)
    ms = [Metric(k, v, now, s) for k, v, s in metrics]
    for i in range(0, len(ms), BATCH_METRICS):
        client.log_batch(run_id, metrics=ms[i:i + BATCH_METRICS])
    for kind, items in ((Param, params or {}), (RunTag, tags or {})):
        ents = [kind(k, v) for k, v in items.items()]
        for i in range(0, len(ents), BATCH_PARAMS_TAGS):
            chunk = ents[i:i + BATCH_PARAMS_TAGS]
            client.log_batch(run_id, **({"params": chunk} if kind is Param else {"tags": chunk}))


def invocation_passed(results: list[ScenarioResult], interrupted=()) -> bool:
    """As the exit code has it: not interrupted, every scenario passed or had nothing apply
    ("n/a", counted apart), and at least one passed (a run where nothing applied verified
    nothing)."""
    return (not interrupted and any(r.passed for r in results)
            and all(r.passed or r.state == NOTHING_APPLIED for r in results))


def _log(results, client, exp_id, prog: _Progress, *, run_name, extra_tags, git,
         report_files: list[Path] | None, interrupted: list[str] = ()) -> None:
    prog.stage = "creating the parent run"
    # an interrupted invocation never passed: its unfinished scenarios are named, not dropped
    states = [f"{r.scenario}={r.state}" for r in results] + [f"{n}={INTERRUPTED}"
                                                            for n in interrupted]
    parent_tags = {**extra_tags, KIND_TAG: INVOCATION,
                   "rlaudit.passed": str(invocation_passed(results, interrupted)).lower(),
                   "rlaudit.interrupted": str(bool(interrupted)).lower(),
                   "rlaudit.states": ",".join(states)[:MAX_TAG_VALUE],
                   "rlaudit.scenarios": ",".join(r.scenario for r in results)[:MAX_TAG_VALUE]}
    with contextlib.suppress(Exception):
        parent_tags["mlflow.user"] = getpass.getuser()
    if git:
        parent_tags["mlflow.source.git.commit"] = git
    name = run_name or time.strftime("rlaudit %Y-%m-%d %H:%M:%S")
    parent = client.create_run(exp_id, run_name=name,
                               tags={sanitize_key(k): str(v) for k, v in parent_tags.items()})
    prog.parent = pid = parent.info.run_id
    pairs = [(r, b) for r in results for b in r.backends]
    prog.total = len(pairs)
    with tempfile.TemporaryDirectory(prefix="rlaudit-mlflow-") as tmp:
        for res, b in pairs:
            prog.stage = f"logging {res.scenario} [{b}]"
            child = client.create_run(exp_id, run_name=f"{res.scenario} [{b}]",
                                      tags=child_tags(res, b, pid, git, extra_tags))
            cid = child.info.run_id
            _log_batch(client, cid, metrics=child_metrics(res, b),
                       params=child_params(res, b, git))
            loc = localise_view.artifact_json(res, b)
            if loc is not None:  # only a failing backend has one
                d = Path(tmp) / f"{cid}-localisation"
                d.mkdir()
                (d / "localisation.json").write_text(loc)
                png = localise_view.drift_plot(dataclasses.replace(
                    res, localisation=[e for e in res.localisation if e.get("backend") == b]))
                if png is not None:
                    (d / "drift_vs_depth.png").write_bytes(png)
                client.log_artifacts(cid, str(d))
            ref = reference_backend(res)
            if ref is not None and b != ref and b in res.runs:
                df, truncated = token_diffs(res, b, ref)
                if df is not None:
                    d = Path(tmp) / cid
                    d.mkdir()
                    write_frame(df, d / "token_diffs")
                    client.log_artifacts(cid, str(d))
                    client.set_tag(cid, "token_diffs.reference", ref)
                if truncated:
                    client.set_tag(cid, "token_diffs.truncated", "true")
            client.set_terminated(cid, status="FAILED" if b in res.errors else "FINISHED")
            prog.children += 1
        prog.stage = "writing the report artifacts"
        rep = Path(tmp) / "report"
        rep.mkdir()
        try:
            try:
                if not report_files:
                    raise FileNotFoundError("no rendered report given")
                for f in map(Path, report_files):  # already rendered: attach (plots under plots/)
                    dest = rep / "plots" / f.name if f.suffix in (".png", ".svg") else rep / f.name
                    dest.parent.mkdir(exist_ok=True)
                    shutil.copyfile(f, dest)
            except OSError:  # not given, or replaced meanwhile by a concurrent invocation's
                run_report.build_run_report(results, rep)
        except Exception as e:  # a plotting/file problem must not cost the run its results.json
            prog.notes.append(f"report not attached ({type(e).__name__}: {e})")
        (rep / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=1,
                                                     default=str))
        prog.stage = "uploading the report artifacts"
        client.log_artifacts(pid, str(rep))
    prog.stage = "finishing the parent run"
    _log_batch(client, pid, metrics=[("scenarios_total", float(len(results)), 0),
                                     ("scenarios_passed", float(sum(r.passed for r in results)), 0),
                                     ("scenarios_no_golden", float(sum(r.state == "no golden"
                                                                       for r in results)), 0),
                                     ("seconds", float(sum(r.seconds for r in results)), 0)])
    client.set_terminated(pid, status="KILLED" if interrupted else "FINISHED")


def log_invocation(results: list[ScenarioResult], *, tracking_uri: str | None, report_dir: Path,
                   **options) -> LogOutcome:
    """Log ``results`` (one ``rlaudit run`` invocation). Never raises: ``ok=False`` and a message
    saying what was and was not logged when MLflow is missing, unreachable or misconfigured, or
    did not finish within :data:`LOG_DEADLINE_S` (read at each call; the logging thread, a
    daemon, is left behind).

    ``options``: ``experiment``, ``run_name``, ``extra_tags``; ``report_files``: the paths
    ``write_run_report`` returned for these results, attached as they are (without them the
    report is rendered again into a temporary directory); ``interrupted``: scenarios a Ctrl-C
    stopped before they finished (the parent run ends KILLED, ``rlaudit.passed`` false)."""
    prog, done = _Progress(), []
    worker = threading.Thread(
        target=lambda: done.append(_log_invocation(results, prog, tracking_uri=tracking_uri,
                                                    report_dir=report_dir, **options)),
        daemon=True, name="rlaudit-mlflow-log")
    worker.start()
    worker.join(LOG_DEADLINE_S)
    if done:
        return done[0]
    uri = resolve_tracking_uri(tracking_uri, Path(report_dir))[0]
    return LogOutcome(False, redact(
        f"MLflow logging to {uri} did not finish within {LOG_DEADLINE_S:g}s (stuck while "
        f"{prog.stage}; parent run {prog.parent or 'not created'}, {prog.children}/{prog.total} "
        "child runs logged): left behind (the audit result above stands)", uri), prog.parent, uri)


def _log_invocation(results: list[ScenarioResult], prog: _Progress, *,
                    tracking_uri: str | None, report_dir: Path,
                    experiment: str = DEFAULT_EXPERIMENT, run_name: str | None = None,
                    extra_tags: dict | None = None, report_files: list[Path] | None = None,
                    interrupted: list[str] | None = None) -> LogOutcome:
    uri, artifact_location = resolve_tracking_uri(tracking_uri, Path(report_dir))
    client = None
    budget = RetryBudget()
    t0 = time.perf_counter()
    try:
        with bounded_http():
            preflight(uri)
            ping(uri)
            prog.stage = "importing mlflow"
            from mlflow.tracking import MlflowClient  # lazy: mlflow only when logging
            prog.stage = "opening the tracking store"
            with open_store_lock(uri):
                client = BudgetedClient(MlflowClient(tracking_uri=uri), budget)
                exp_id = _experiment_id(client, experiment, artifact_location)
            _log(results, client, exp_id, prog, run_name=run_name, extra_tags=extra_tags or {},
                 git=git_revision(), report_files=report_files, interrupted=interrupted or [])
    except Exception as e:
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if isinstance(e, ImportError):
            err += " (install the mlflow extra: pip install 'rlaudit[mlflow]')"
        done = (f"parent run {prog.parent} created, {prog.children}/{prog.total} child runs "
                f"logged" if prog.parent else "nothing was logged")
        if client is not None and prog.parent:
            with contextlib.suppress(Exception), bounded_http(retries=0):
                client._client.set_terminated(prog.parent, status="FAILED")  # no retry left
        return LogOutcome(False, redact(f"MLflow logging to {uri} failed while {prog.stage}: "
                                        f"{err}; {done} (the audit result above stands)", uri),
                          prog.parent, uri)
    retried = [f"retried {', '.join(budget.spent)}"] if budget.spent else []
    notes = f"; {'; '.join(prog.notes + retried)}" if prog.notes or retried else ""
    return LogOutcome(not prog.notes, redact(
        f"logged {len(results)} scenario(s), {prog.children} run(s) to MLflow {uri} (experiment "
        f"{experiment!r}, parent run {prog.parent}, {time.perf_counter() - t0:.1f}s){notes}", uri),
                      prog.parent, uri)
