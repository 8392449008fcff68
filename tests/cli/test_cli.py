"""The `rlaudit` command in-process (rlaudit.cli.main.main with capsys), and once through the real
console script."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from rlaudit.cli.main import main
from rlaudit.data.io import load_rollout
from rlaudit.model.load import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "scenarios"
MODEL = SCENARIOS / "models" / "qwen2-tiny-short"
ROLLOUT = SCENARIOS / "rollouts" / "short-ref.safetensors"
SUBCOMMANDS = ("list", "run", "golden", "train", "record", "report")


@pytest.fixture
def tiny(tmp_path) -> Path:
    """A one-step reference-only scenario with absolute paths, in its own scenarios dir."""
    path = tmp_path / "scn" / "tiny_cli.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({
        "description": "tiny CLI scenario", "model": str(MODEL), "rollout": str(ROLLOUT),
        "steps": 1, "dtype": "float64",
        "config": {"rollout": {"n": 4, "response_length": 12},
                   "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                             "calculate_entropy": True, "optim": {"name": "sgd", "lr": 0.05}}},
        "backends": {"reference": {}},
        "invariants": ["sanity-bounds", "on-policy-identities"]}))
    return path


def run_args(tiny: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["run", str(tiny), "--report-dir", str(tmp_path / "reports"), "--golden-dir",
            str(tmp_path / "golden"), *extra]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlaudit {version('rlaudit')}"


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in SUBCOMMANDS:
        assert cmd in out
    for cmd in SUBCOMMANDS:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert f"usage: rlaudit {cmd}" in capsys.readouterr().out


def test_no_command_and_bad_usage_exit_2(capsys):
    assert main([]) == 2
    assert "usage: rlaudit" in capsys.readouterr().out
    for argv in (["frobnicate"], ["run", "--no-such-flag"], ["list", "everything"],
                 ["golden"], ["run", "--timeout", "soon"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "rlaudit: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_list_json(capsys):
    assert main(["list", "--json", "--scenarios-dir", str(SCENARIOS)]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {s["name"] for s in data["scenarios"]}
    assert names == {p.stem for p in SCENARIOS.glob("*.yaml")} and len(names) == 38
    assert {b["name"] for b in data["backends"]} == {"reference", "fsdp", "megatron"}
    ref = next(b for b in data["backends"] if b["name"] == "reference")
    assert ref["available"] is True
    listed = {i["name"] for i in data["invariants"]}
    used = {inv for p in SCENARIOS.glob("*.yaml")
            for inv in yaml.safe_load(p.read_text())["invariants"]}
    assert used <= listed
    assert {"sanity-bounds", "backend-parity", "microbatch-invariance"} <= listed
    assert all(i["doc"] and i["family"] for i in data["invariants"])
    assert any("grpo" in names for names in data["algorithms"].values())
    # the text form names the same things
    assert main(["list", "--scenarios-dir", str(SCENARIOS)]) == 0
    out = capsys.readouterr().out
    assert out.count("scenario  ") == 38 and "invariant sanity-bounds" in out


def test_list_invariants_only_needs_no_scenarios(tmp_path, capsys):
    assert main(["list", "invariants", "--json", "--scenarios-dir", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"invariants"}


def test_run_without_a_scenario_exits_2(tmp_path, capsys):
    assert main(["run", "--no-mlflow", "--report-dir", str(tmp_path)]) == 2
    assert "name at least one scenario" in capsys.readouterr().err


def test_run_unknown_scenario_name_exits_2_naming_it(tmp_path, capsys):
    rc = main(["run", "no_such_scenario_xyz", "--scenarios-dir", str(SCENARIOS), "--no-mlflow",
               "--report-dir", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no_such_scenario_xyz" in err
    assert "seed_stored_kl" in err  # and lists the known ones
    assert main(["run", "a", "--all", "--scenarios-dir", str(SCENARIOS), "--no-mlflow"]) == 2
    assert "not both" in capsys.readouterr().err


def test_run_unknown_backend_exits_2(tiny, tmp_path, capsys):
    assert main(run_args(tiny, tmp_path, "--no-mlflow", "--backend", "deepspeed")) == 2
    err = capsys.readouterr().err
    assert "deepspeed" in err and "--backend" in err
    assert not (tmp_path / "golden").exists()


@pytest.mark.slow
def test_run_json_and_local_report(tiny, tmp_path, capsys):
    rc = main(run_args(tiny, tmp_path, "--json", "--no-mlflow"))
    out, err = capsys.readouterr()
    assert rc == 0, err
    results = json.loads(out)  # stdout is nothing but the JSON document
    assert [r["scenario"] for r in results] == ["tiny_cli"]
    (r,) = results
    # no golden to compare against: its own state, not a pass (exit 0 without --require-golden)
    assert r["passed"] is False and r["state"] == "no golden" and r["errors"] == {}
    assert {c["invariant"] for c in r["checks"]} == {"sanity-bounds", "on-policy-identities"}
    assert [g["status"] for g in r["golden"]] == ["no golden"]
    assert len(r["metrics"]["reference"]) == 1 and "actor/pg_loss" in r["metrics"]["reference"][0]
    latest = tmp_path / "reports" / "latest"
    html, md = latest / "report.html", latest / "report.md"
    assert html.is_file() and md.is_file()
    assert "tiny_cli" in html.read_text() and "tiny_cli" in md.read_text()
    assert str(html) in err
    assert not (tmp_path / "reports" / "mlflow.db").exists() and "MLflow" not in err
    # the text form prints the table and the summary
    assert main(run_args(tiny, tmp_path, "--no-mlflow")) == 0
    out = capsys.readouterr().out
    assert "tiny_cli: NO GOLDEN" in out and "0/1 scenarios passed (1 no golden)" in out


@pytest.mark.slow
def test_run_logs_to_a_sqlite_mlflow_store(tiny, tmp_path, capsys):
    db = tmp_path / "store" / "x.db"
    rc = main(run_args(tiny, tmp_path, "--json", "--tracking-uri", f"sqlite:///{db}"))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)[0]["state"] == "no golden"  # MLflow printed nothing onto stdout
    assert "logged 1 scenario(s)" in err and f"sqlite:///{db}" in err
    with sqlite3.connect(db) as con:
        names = [r[0] for r in con.execute("select name from runs")]
    assert len(names) >= 2  # a parent run for the invocation and a child per backend


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_with_unreachable_mlflow_still_exits_0(tiny, tmp_path, capsys):
    uri = f"http://127.0.0.1:{_closed_port()}"
    rc = main(run_args(tiny, tmp_path, "--tracking-uri", uri))
    out, err = capsys.readouterr()
    assert rc == 0
    assert "tiny_cli: NO GOLDEN" in out
    assert f"MLflow logging to {uri} failed" in err and "nothing was logged" in err


def test_record_reference_rollout(tmp_path, capsys):
    out = tmp_path / "rec" / "r.safetensors"
    rc = main(["record", "--model", str(MODEL), "--out", str(out), "--engine", "reference",
               "--task", "short", "--prompts", "2", "--n", "3", "--max-new-tokens", "6",
               "--seed", "4"])
    assert rc == 0, capsys.readouterr().err
    assert "wrote 6 trajectories" in capsys.readouterr().err
    batch = load_rollout(out)  # verifies hashes, fields, masks
    assert len(batch) == 6
    assert batch["uid"].tolist() == [0, 0, 0, 1, 1, 1]
    assert int(batch["response_lengths"].max()) <= 6
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["engine"] == "reference" and meta["task"] == "short"
    committed = json.loads(ROLLOUT.with_suffix(".json").read_text())["meta"]
    assert meta["model_snapshot_id"] == committed["model_snapshot_id"]  # same model snapshot
    # scores are the `short` rule on each row's own decoded response: 1 - |len - 4| / 12, >= 0
    tok = load_tokenizer(MODEL)
    for i in range(len(batch)):
        n = int(batch["response_lengths"][i])
        ids = [t for t in batch["response_ids"][i, :n].tolist() if t != tok.eos_token_id]
        text = tok.decode(ids, skip_special_tokens=True)
        want = max(1 - abs(len(text) - 4) / 12, 0.0)
        assert float(batch["scores"][i]) == pytest.approx(want, abs=1e-6), i


@pytest.mark.parametrize("argv,fragment", [
    (["--out", "{tmp}/r.txt"], "--out"),
    (["--out", "{tmp}/r.safetensors", "--prompts", "0"], "--prompts"),
    (["--out", "{tmp}/r.safetensors", "--n", "0"], "--n"),
    (["--out", "{tmp}/r.safetensors", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--out", "{tmp}/r.safetensors", "--task", "nope"], "nope"),
    (["--out", "{tmp}/r.safetensors", "--model", "{tmp}/no-model"], "no-model"),
])
def test_record_bad_args_exit_2(tmp_path, capsys, argv, fragment):
    argv = [a.format(tmp=tmp_path) for a in argv]
    if "--model" not in argv:
        argv = ["--model", str(MODEL), *argv]
    assert main(["record", *argv]) == 2
    assert fragment in capsys.readouterr().err
    assert not list(tmp_path.glob("r.*"))


@pytest.mark.parametrize("argv", [
    ["record", "--out", "x.safetensors"],                              # no --model
    ["record", "--model", "m", "--out", "x.safetensors", "--engine", "sglang"],
    ["record", "--model", "m", "--out", "x.safetensors", "--prompts", "two"],
])
def test_record_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "rlaudit: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_entry_point(tmp_path):
    exe = Path(sys.executable).parent / "rlaudit"
    assert exe.exists()
    p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"rlaudit {version('rlaudit')}"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": str(MODEL), "rollout": str(ROLLOUT),
                                   "invariants": ["sanity-bounds"], "backend": {}}))
    p = subprocess.run([str(exe), "run", str(bad), "--no-mlflow", "--report-dir",
                        str(tmp_path / "r")], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert f"{bad}: backend: unknown key" in p.stderr
    assert "Traceback" not in p.stderr


_LEAVE = """
import atexit, os, sys, threading, time
from pathlib import Path
from rlaudit.cli.main import leave
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.5)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()           # not a daemon: exit waits for it
class Teardown:                                  # freed only by the interpreter's teardown
    def __init__(self, path):                    # (opened now: late in it `open` is gone)
        self.fd, self.write = os.open(path, os.O_WRONLY | os.O_CREAT), os.write
    def __del__(self):
        self.write(self.fd, b"ran")
kept = Teardown(str(out / "teardown"))
sys.stdout.write("no newline, still buffered")  # a pipe: block-buffered
sys.stderr.write("err without newline")
leave(3)
print("never")
"""


def test_leave_exits_like_the_interpreter_without_its_teardown(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffers to flush
    p = subprocess.run([sys.executable, "-c", _LEAVE, str(tmp_path)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 3
    assert p.stdout == "no newline, still buffered" and p.stderr == "err without newline"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "teardown").read_text() == ""  # what leave() skips: freeing every object


#: entry() with a module-level object that only the interpreter's teardown frees
_ENTRY = """
import sys
import os
class Teardown:  # the file is opened now: late in the teardown even `open` is gone
    def __init__(self, path):
        self.fd, self.write = os.open(path, os.O_WRONLY | os.O_CREAT), os.write
    def __del__(self):
        self.write(self.fd, b"ran")
kept = Teardown(sys.argv[1])
sys.argv = ["rlaudit", *sys.argv[2:]]
from rlaudit.cli.main import entry
entry()
"""


@pytest.mark.parametrize("argv,code,where", [(["--help"], 0, "stdout"),
                                              (["run", "--nope"], 2, "stderr")])
def test_argparse_exits_go_through_leave(argv, code, where, tmp_path):
    marker = tmp_path / "teardown"
    p = subprocess.run([sys.executable, "-c", _ENTRY, str(marker), *argv], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == code
    assert "usage: rlaudit" in getattr(p, where)
    assert marker.read_text() == ""  # left through leave(), not the interpreter's teardown


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`rlaudit list | head -1`: the pipe closes under the CLI (here before it has printed
    anything: it is still importing); it exits like a process SIGPIPE ended (141), with nothing
    on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "rlaudit.cli.main", "list"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                       # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
