"""Run by test_reliability_stop.py as the ``rlaudit`` command in a process of its own:

    python stop_driver.py STARTED_FLAG run SCENARIO ... [options]

exactly ``rlaudit`` (``rlaudit.cli.main.entry``: its exit code and its way of leaving), except
that the file STARTED_FLAG is created when the first replay starts -- in this process (the
reference backend) or on a warm pool's ranks -- so that the test sends its SIGINT while a replay
runs, not while the command still imports.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import rlaudit.backends.launch.pool as pool
import rlaudit.backends.reference as reference
from rlaudit.cli.main import entry

STARTED = Path(sys.argv[1])


def flagged(original):
    def started_first(*args, **kwargs):
        STARTED.touch()
        return original(*args, **kwargs)
    return started_first


reference.ReferenceBackend.replay = flagged(reference.ReferenceBackend.replay)
pool.RankPool._run_task = flagged(pool.RankPool._run_task)

if __name__ == "__main__":
    # a process started with SIGINT ignored keeps it ignored, and Python then installs no
    # KeyboardInterrupt handler: a test run launched as `make test &` from a script, or a worker
    # that ignores SIGINT, would send a Ctrl-C nobody hears; a user's terminal delivers it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["rlaudit", *sys.argv[2:]]
    entry()
