"""Third-party chatter goes to a log file, not the terminal.

megatron-core warns at import that Transformer Engine and Apex are missing (eight times),
MLflow logs its database migrations, Ray and transformers have their own loggers. None of it is
rlaudit's result. Inside :func:`third_party_to_log`, Python warnings and every logger's records
(INFO and up) go to one file, normally ``<report dir>/rlaudit.log``; rlaudit's own messages,
which are printed, are untouched.

    with third_party_to_log(Path("reports/rlaudit.log")):
        ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Iterator

#: Environment switches that stop libraries from installing their own terminal handlers, set
#: (unless the user set them) for the block and the processes it starts.
QUIET_ENV = {
    "MLFLOW_CONFIGURE_LOGGING": "false",      # mlflow: no StreamHandler of its own; propagate
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}
#: Loggers that install a terminal handler at import whatever the environment says.
_OWN_HANDLER_LOGGERS = ("torch", "transformers", "ray", "alembic", "mlflow")


@contextlib.contextmanager
def third_party_to_log(path: Path) -> Iterator[Path]:
    """Route warnings and log records to ``path`` for the block. The file (and its folder) is
    created, truncated, at the first record: a run stopped by bad input leaves nothing behind."""
    path.unlink(missing_ok=True)  # a previous run's log must not pass for this one's
    handler = _LazyFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_env = {k: os.environ.get(k) for k in QUIET_ENV}
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    quiet_loggers()             # libraries imported before the block brought their own handlers
    logging.captureWarnings(True)
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # each distinct warning once, into the log
        try:
            yield path
        finally:
            logging.captureWarnings(False)
            root.handlers, root.level = saved_handlers, saved_level
            handler.close()
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def quiet_loggers() -> None:
    """Send the loggers that bring their own terminal handler to the root logger (the log file).
    Call after importing such a library (MLflow, Ray, transformers)."""
    for name in _OWN_HANDLER_LOGGERS:
        logger = logging.getLogger(name)
        for h in logger.handlers[:]:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
        logger.propagate = True


class _LazyFileHandler(logging.FileHandler):
    def __init__(self, path: Path):
        super().__init__(path, mode="w", encoding="utf-8", delay=True)

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()
