"""The progress display of `rlaudit run` (rlaudit.executors.progress) and the third-party log
routing (rlaudit.quiet), with a fake clock and in-memory streams."""

from __future__ import annotations

import io
import logging
import sys
import warnings

from rlaudit.quiet import third_party_to_log
from rlaudit.executors.progress import Progress, clock


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Request(str):
    """A replay request as the stub backends here see it: a name, and the time it may take
    (what the engine gives each replay: what is left of its scenario's --timeout)."""

    timeout = 60.0


def test_clock_format():
    assert [clock(x) for x in (None, 0, 59.6, 75.2, 3725)] == ["--", "0:00", "1:00", "1:15",
                                                              "1:02:05"]


def test_plain_lines_off_a_terminal_with_elapsed_and_time_left():
    out, now = io.StringIO(), Clock()
    p = Progress(4, stream=out, live=False, now=now)
    p.start("kl_k1", "reference")
    now.t += 10
    p.finish("kl_k1", "reference")
    p.start("kl_k1", "fsdp")
    now.t += 30
    p.finish("kl_k1", "fsdp")
    p.close()
    lines = out.getvalue().splitlines()
    # mean job 20 s, 2 jobs left: 40 s left
    assert lines == ["[1/4] kl_k1 reference: 10.0 s (elapsed 0:10, left ~0:30)",
                     "[2/4] kl_k1 fsdp: 30.0 s (elapsed 0:40, left ~0:40)"]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_terminal_line_redraws_in_place_and_clears_while_paused():
    out, now = io.StringIO(), Clock()
    p = Progress(3, stream=out, live=True, now=now, parallel=1)
    p.start("adv_rloo", "megatron")
    now.t += 65
    assert p.line() == "[0/3] adv_rloo · megatron   elapsed 1:05   left ~--"
    p.finish("adv_rloo", "megatron")
    assert p.line() == "[1/3]   elapsed 1:05   left ~2:10"
    with p.paused():
        out.write("TABLE\n")
    p.close()
    text = out.getvalue()
    assert text.startswith("\r[0/3] adv_rloo · megatron") and "\x1b[K" in text
    assert "\r\x1b[KTABLE\n" in text      # the status line is cleared before the table
    assert text.endswith("\r\x1b[K")       # and gone at the end
    assert Progress(1, stream=out, enabled=False).live is False


def test_third_party_warnings_and_logs_go_to_the_file(tmp_path, capsys):
    path = tmp_path / "reports" / "rlaudit.log"
    with third_party_to_log(path):
        warnings.warn("Transformer Engine and Apex are not installed", UserWarning)
        logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables")
        print("rlaudit's own line", file=sys.stderr)
    err = capsys.readouterr().err
    assert err == "rlaudit's own line\n"
    text = path.read_text()
    assert "Transformer Engine and Apex are not installed" in text
    assert "Creating initial MLflow database tables" in text
    assert logging.getLogger().handlers == [] or all(
        getattr(h, "baseFilename", None) != str(path) for h in logging.getLogger().handlers)


def test_nothing_logged_leaves_no_file(tmp_path):
    with third_party_to_log(tmp_path / "reports" / "rlaudit.log"):
        pass
    assert not (tmp_path / "reports").exists()


def test_local_executor_keeps_order_and_runs_in_process_replays_one_at_a_time():
    import threading
    import time
    from types import SimpleNamespace

    from rlaudit.executors import LocalExecutor

    active = {"reference": 0, "fsdp": 0}
    peak = {"reference": 0, "fsdp": 0, "both": 0}
    lock = threading.Lock()

    class Stub:
        def __init__(self, name):
            self.name = name

        def replay(self, request):
            with lock:
                active[self.name] += 1
                peak[self.name] = max(peak[self.name], active[self.name])
                peak["both"] = max(peak["both"], active["reference"] + active["fsdp"])
            time.sleep(0.05)
            with lock:
                active[self.name] -= 1
            return {"base": request}

    def run_one(scn, replay):
        return [replay(Stub(b), Request(f"{scn.name}/{b}")) for b in ("reference", "fsdp")]

    scenarios = [SimpleNamespace(name=f"s{i}") for i in range(6)]
    out = io.StringIO()
    with LocalExecutor(Progress(12, stream=out, live=False), jobs=2) as ex:
        results = list(ex.map(scenarios, run_one))
    assert [s.name for s, _ in results] == [s.name for s in scenarios]
    assert results[3][1] == [{"base": "s3/reference"}, {"base": "s3/fsdp"}]
    assert peak["reference"] == 1          # in-process replays never overlap each other
    assert peak["both"] == 2               # but overlap another scenario's multi-rank replay
    assert out.getvalue().count("\n") == 12 and "[12/12]" in out.getvalue()
