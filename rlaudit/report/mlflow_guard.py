"""Keeping MLflow from losing an invocation's record or holding the invocation up.

- :func:`open_store_lock`: a fresh embedded sqlite store is created under an exclusive file lock
  (``<db>.lock``, ``fcntl.flock``), migrated in a temporary file and renamed into place. Without
  it, two first runs on a fresh store both run MLflow's ~50 alembic migrations on the same file:
  one fails ("duplicate column name: step", "table ... already exists") and the store is left
  half-migrated, so every later run fails too. Opening an existing store takes the same lock, so
  nobody opens a store that is still being created.
- :func:`ping`: an http(s) tracking server must answer one request, whole, within
  :data:`PING_TIMEOUT_S`, not merely accept the connection (a hung server used to cost ~48 s of
  per-request timeouts and retries; one answering a byte at a time held the run forever).
- :class:`RetryBudget` / :class:`BudgetedClient`: MLflow's per-request retries are off; every
  client call of an invocation shares :data:`RETRY_BUDGET` retry(ies) in total.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

#: seconds an http(s) server gets to answer the ping request (connection included)
PING_TIMEOUT_S = 5.0
#: retries of failed MLflow calls per invocation, all calls together
RETRY_BUDGET = 1
#: seconds between a failed call and its retry
RETRY_PAUSE_S = 1.0
#: how long to wait for another process creating or opening the same sqlite store
LOCK_TIMEOUT_S = 300.0


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores and ``:memory:``)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):]
    return None if path in ("", ":memory:") else Path(path)


@contextlib.contextmanager
def open_store_lock(uri: str) -> Iterator[None]:
    """Hold the store's lock while the block opens it; create a missing sqlite store first (see
    the module docstring). Other stores: no lock."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    import fcntl  # lazy: POSIX only; only a local sqlite store takes this lock
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {lock.name} for "
                                       f"{LOCK_TIMEOUT_S:.0f}s") from None
                time.sleep(0.2)
        try:
            if store_missing(db):
                _create_sqlite_store(db)
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def store_missing(db: Path) -> bool:
    """Whether the sqlite store ``db`` is yet to be created (no file, or an empty one)."""
    return not db.exists() or db.stat().st_size == 0


def _create_sqlite_store(db: Path) -> None:
    """Create and migrate a sqlite store in a temporary file beside ``db``, then rename it into
    place: a crash part-way leaves no half-migrated store behind."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow is slow to import; only logging needs it
    tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    try:
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
        os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)


def ping(uri: str, *, timeout: float | None = None) -> None:
    """Raise OSError unless an http(s) server at ``uri`` answers a request within ``timeout``
    seconds (default :data:`PING_TIMEOUT_S`, read at each call). Any HTTP answer counts (even
    401 or 404); other schemes are not pinged."""
    timeout = PING_TIMEOUT_S if timeout is None else timeout
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    # any answer counts, 401 too: credentials in the URI stay out of the request (urllib would
    # take ``user:password@host`` for a host name) and out of the messages
    netloc = parsed.netloc.rpartition("@")[2]
    url = (urllib.parse.urlunparse(parsed._replace(netloc=netloc)).rstrip("/")
           + "/api/2.0/mlflow/experiments/get-by-name?experiment_name="
           + urllib.parse.quote("rlaudit-probe"))
    # each socket read has ``timeout``, but a server answering a byte at a time never lets one
    # expire: the whole answer gets ``timeout`` too (the reader, a daemon, is left behind)
    done: list[BaseException | None] = []
    reader = threading.Thread(target=_ask, args=(url, timeout, done), daemon=True,
                              name="rlaudit-mlflow-ping")
    reader.start()
    reader.join(timeout)
    if not done:
        raise OSError(f"{netloc} did not answer within {timeout:g}s (no whole answer "
                      "to one request: a hung server, or one answering a byte at a time)")
    if done[0] is not None:
        _answered_or_raise(done[0], netloc, timeout)


def _ask(url: str, timeout: float, done: list) -> None:
    """Read the answer to ``url`` whole; append None, or what went wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            answer.read()
        done.append(None)
    except BaseException as e:  # noqa: BLE001 - judged by the caller
        done.append(e)


def _answered_or_raise(exc: BaseException, netloc: str, timeout: float) -> None:
    """Nothing if ``exc`` still means the server answered; else OSError saying what failed."""
    try:
        raise exc
    except urllib.error.HTTPError:
        return  # it answered
    except ssl.SSLError as e:
        if "timed out" not in str(e):
            return  # it answered the TLS handshake; MLflow's own client decides about the cert
        raise OSError(f"{netloc} accepted the connection but did not answer within "
                      f"{timeout:g}s") from None
    except (socket.timeout, TimeoutError):
        raise OSError(f"{netloc} accepted the connection but did not answer within "
                      f"{timeout:g}s") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise OSError(f"{netloc} did not answer within {timeout:g}s") from None
        raise OSError(f"{netloc}: {reason}") from None
    except (http.client.HTTPException, OSError) as e:  # a broken answer: not an HTTP server's
        raise OSError(f"{netloc} did not answer as an HTTP server: {type(e).__name__}: "
                      f"{e}") from None


class RetryBudget:
    """Retries left for the whole invocation, and what they were spent on."""

    def __init__(self, retries: int = RETRY_BUDGET):
        self.left = retries
        self.spent: list[str] = []

    def call(self, name: str, fn, *args, **kwargs):
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - MLflow, requests and sqlalchemy errors alike
                if self.left <= 0 or not transient(e):
                    raise
                self.left -= 1
                self.spent.append(f"{name} ({type(e).__name__})")
                time.sleep(RETRY_PAUSE_S)


def transient(exc: BaseException) -> bool:
    """An error a retry may cure: a timeout, a refused or reset connection, a 5xx or 429 answer,
    a locked sqlite database."""
    text = f"{type(exc).__name__}: {exc}".lower()
    markers = ("timed out", "timeout", "connection", "max retries", "database is locked",
               "temporarily unavailable", " 500", " 502", " 503", " 504", " 429",
               "internal_error", "temporarily_unavailable", "resource_exhausted")
    return isinstance(exc, (OSError, TimeoutError)) or any(m in text for m in markers)


class BudgetedClient:
    """An MlflowClient whose every method call goes through a shared :class:`RetryBudget`."""

    def __init__(self, client: Any, budget: RetryBudget):
        self._client = client
        self.budget = budget

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            return self.budget.call(name, attr, *args, **kwargs)
        return call
