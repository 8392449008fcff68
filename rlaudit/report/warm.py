"""Import what the local report and MLflow logging need while the replays still run.

``rlaudit run`` spends its last seconds, after every replay and check, on the report and MLflow
(mlflow, its SQL store, sqlalchemy): about 2 CPU-seconds of imports on one core while the other
idles. (matplotlib is not among them: the report draws its metrics grid itself, and only a
localised failure's drift-vs-depth plot needs matplotlib -- imported then.)
:func:`warm_report_imports` moves them into a background thread started while this process has
nothing else to import -- the local executor calls it once the first in-process replay is back,
or when the first reference replay it sends to a warm pool starts if no reference replays in
this process: from then on the scenarios' time is spent in other processes' ranks. It imports,
and creates a local sqlite store that does not exist yet (the first run's ~1.3 s of MLflow
migrations, otherwise paid after the last scenario); any failure is left for the report or the
MLflow logging to meet and report as usual.
"""

from __future__ import annotations

import threading

from rlaudit.heap import importing

_lock = threading.Lock()
_thread: threading.Thread | None = None  # the background imports, once started


def warm_report_imports(*, mlflow_uri: str | None) -> threading.Thread | None:
    """Start the imports once per process (later calls return None). ``mlflow_uri``: the
    tracking URI the run will log to (its SQL store module is imported for database URIs), or
    None when it will not log to MLflow."""
    global _thread
    with _lock:
        if _thread is not None:
            return None
        _thread = threading.Thread(target=_imports, args=(mlflow_uri,), daemon=True,
                                   name="rlaudit-warm-imports")
    _thread.start()
    return _thread


def wait_for_warm_imports(timeout: float | None = None) -> None:
    """Return once the background imports, if any were started, are done. Whoever imports MLflow
    next calls this first: two threads importing the same package at once can hand one of them
    a partly initialised module where the package's modules import each other (seen: "cannot
    import name '_get_store' from partially initialized module 'mlflow.tracking'", when a
    reference-only scenario's checks ended while the background import was still under way)."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def _imports(mlflow_uri: str | None) -> None:
    with importing():  # no full collections on the way (rlaudit/heap.py)
        _import_all(mlflow_uri)


def _import_all(mlflow_uri: str | None) -> None:
    try:
        # lazy: importing these off the caller's thread is this module's whole job
        from rlaudit.report import run_report  # noqa: F401

        if mlflow_uri is None:
            return
        import mlflow.entities  # noqa: F401  # lazy: warmed off the main thread
        import mlflow.tracking  # noqa: F401  # lazy: warmed off the main thread
        from rlaudit.report.mlflow_log import is_database_uri  # lazy: warmed off the main thread

        if is_database_uri(mlflow_uri):
            # lazy: warmed off the main thread, for a database store only
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        _create_missing_store(mlflow_uri)
    except Exception:  # noqa: BLE001 - the report / MLflow logging meets it and says so
        pass


def _create_missing_store(mlflow_uri: str) -> None:
    """A local sqlite store that does not exist yet is created now, as the logging would create
    it (``mlflow_guard.open_store_lock``: under its lock, migrated in a temporary file, renamed
    into place): MLflow's ~50 migrations cost ~1.3 s on one core, at the end of a first run
    otherwise. An existing store, or any other, is left alone (nothing is opened, no server is
    contacted); a failure is left for the logging to meet."""
    # lazy: runs on the warming thread, like every import here
    from rlaudit.report.mlflow_guard import open_store_lock, sqlite_path, store_missing

    db = sqlite_path(mlflow_uri)
    if db is None or not store_missing(db):  # no lock taken (nor its file made) for an existing one
        return
    with open_store_lock(mlflow_uri):
        pass
