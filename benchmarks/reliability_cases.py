"""The numbered cases of issue #13 run through the real `rlaudit` command (one process per
invocation, as a user runs it): for each, the command, its exit code, the first line of its
message and its wall time. The assertions live in tests/reliability; this prints the figures.

    python benchmarks/reliability_cases.py            # everything (~5-10 min on 2 loaded cores)
    python benchmarks/reliability_cases.py 1 4 9      # some cases

Case 3's late half (a file changed while the invocation runs) needs an in-process hook and is
only in tests/reliability/test_reliability_isolation.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rlaudit.data.io import load_rollout, save_rollout  # noqa: E402
from tests.reliability.reltools import (ROLLOUT, base_tensors, scenario_dict,  # noqa: E402
                                        write_rollout, write_scenario)

OTHER_ROLLOUT = REPO / "scenarios" / "rollouts" / "short-distill.safetensors"


def rlaudit(*argv, env=None, show=True) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "rlaudit.cli.main", *map(str, argv)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    seconds = time.perf_counter() - t0
    lines = [ln for ln in (p.stderr + p.stdout).splitlines()
             if ln.startswith(("rlaudit:", "  /", "  golden", "  bad input", "goldens"))
             or ": NO GOLDEN" in ln or ": FAILED" in ln or ": PASSED" in ln]
    if show:
        print(f"  $ rlaudit {' '.join(map(str, argv))}")
        print(f"    exit {p.returncode} in {seconds:.1f}s")
        for ln in lines[:6]:
            print(f"    | {ln[:220]}")
    return p.returncode, p.stdout + p.stderr, seconds


def run_args(scn, tmp, *extra):
    return ["run", scn, "--golden-dir", tmp / "golden", "--report-dir", tmp / "reports",
            "--no-mlflow", *extra]


def case1(tmp):
    empty = {k: v[:0].clone() for k, v in base_tensors().items()}
    r = write_rollout(tmp / "empty.safetensors", empty)
    rlaudit(*run_args(write_scenario(tmp / "empty.yaml", rollout=str(r),
                                     invariants=["sanity-bounds", "row-permutation"]), tmp))
    try:
        batch = load_rollout(ROLLOUT)
        from rlaudit.data.batch import RolloutBatch
        save_rollout(RolloutBatch.from_tensors(empty, kinds=batch.kinds), tmp / "e.safetensors")
    except Exception as e:  # noqa: BLE001
        print(f"  save_rollout(0 rows): {type(e).__name__}: {e}")


def case2(tmp):
    t = base_tensors()
    t["response_mask"] = torch.zeros_like(t["response_mask"])
    r = write_rollout(tmp / "masked.safetensors", t)
    rlaudit(*run_args(write_scenario(tmp / "masked.yaml", rollout=str(r)), tmp))
    scn = write_scenario(tmp / "solo.yaml")
    rlaudit(*run_args(scn, tmp))
    rlaudit(*run_args(scn, tmp, "--require-golden"))


def case3(tmp):
    scns = [write_scenario(tmp / f"s{i:02d}.yaml") for i in range(19)]
    t = base_tensors()
    t["rollout_log_probs"][0, 0] = float("nan")
    r = write_rollout(tmp / "nan.safetensors", t)
    scns.append(write_scenario(tmp / "s19.yaml", rollout=str(r)))
    rlaudit("run", *scns, *run_args(scns[0], tmp)[2:])


def case4(tmp):
    scn = write_scenario(tmp / "tp3.yaml", backends={"reference": {}, "fsdp": {"dp": 2},
                                                    "megatron": {"tp": 3}})
    rlaudit(*run_args(scn, tmp))
    rlaudit(*run_args(scn, tmp, "--backend", "reference"))


def case5(tmp):
    reports = tmp / "reports"
    procs = []
    t0 = time.perf_counter()
    for i in range(2):
        scn = write_scenario(tmp / f"racer{i}.yaml")
        cmd = [sys.executable, "-m", "rlaudit.cli.main", "run", str(scn), "--golden-dir",
               str(tmp / "golden"), "--report-dir", str(reports)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    print(f"  $ rlaudit run racer0.yaml & rlaudit run racer1.yaml  (fresh {reports}/mlflow.db)")
    for p in procs:
        _, err = p.communicate()
        msg = [ln for ln in err.splitlines() if "MLflow" in ln and "rlaudit:" in ln]
        print(f"    exit {p.returncode} | {msg[0][:200] if msg else '(no MLflow line)'}")
    import sqlite3
    with sqlite3.connect(reports / "mlflow.db") as con:
        names = sorted(r[0] for r in con.execute("select name from runs"))
    print(f"    runs in the store: {[n for n in names if n.startswith('racer')]} "
          f"({time.perf_counter() - t0:.1f}s)")


def case6(tmp):
    sys.path.insert(0, str(REPO / "tests" / "reliability"))
    from test_reliability_loopback import _listening_in_rank, listening_addresses

    from rlaudit.backends.launch import rendezvous, launch
    store = rendezvous.rendezvous_store("127.0.0.1", timeout=30)
    print(f"  rendezvous store listens on: "
          f"{[a for a in listening_addresses(os.getpid()) if a.endswith(f':{store.port}')]}")
    del store
    t0 = time.perf_counter()
    out = launch(_listening_in_rank, 2, timeout=120)
    print(f"  launch(2 ranks) sockets: {[r['listen'] for r in out]}, GLOO_SOCKET_IFNAME="
          f"{out[0]['ifname']} ({time.perf_counter() - t0:.1f}s)")


def case7(tmp):
    scn_dir = tmp / "scn"
    d = scenario_dict(backends={"reference": {}, "fsdp": {"dp": 2}},
                      invariants=["sanity-bounds", "backend-parity"],
                      tolerances={"default": {"rtol": 0.0, "atol": 0.0}})
    write_scenario(scn_dir / "exact.yaml", d)  # parity at 0 tolerance: fails by ~1e-16
    args = ["--scenarios-dir", scn_dir, "--golden-dir", tmp / "golden"]
    rlaudit("golden", "bless", "exact", *args)
    print(f"    golden dir after: {sorted(p.name for p in (tmp / 'golden').glob('*'))}")
    duo = scenario_dict(backends={"reference": {}, "fsdp": {"dp": 2}})
    write_scenario(scn_dir / "duo.yaml", duo)
    rlaudit("golden", "bless", "duo", *args)
    write_scenario(scn_dir / "duo.yaml", {**duo, "rollout": str(OTHER_ROLLOUT)})
    rlaudit("golden", "bless", "duo", *args, "--backend", "fsdp")
    rlaudit("run", "duo", *args, "--report-dir", tmp / "reports", "--no-mlflow")


def case8(tmp):
    scn_dir = tmp / "scn"
    write_scenario(scn_dir / "cfg.yaml")
    args = ["--scenarios-dir", scn_dir, "--golden-dir", tmp / "golden"]
    rlaudit("golden", "bless", "cfg", *args, show=False)
    d = scenario_dict()
    d["config"]["actor"]["logprob_chunk_size"] = 128
    write_scenario(scn_dir / "cfg.yaml", d)
    rlaudit("run", "cfg", *args, "--report-dir", tmp / "reports", "--no-mlflow")


def case9(tmp):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        scn = write_scenario(tmp / "solo.yaml")
        rlaudit("run", scn, "--golden-dir", tmp / "golden", "--report-dir", tmp / "reports",
                "--tracking-uri", f"http://127.0.0.1:{srv.getsockname()[1]}")
        rlaudit("run", scn, "--golden-dir", tmp / "golden", "--report-dir", tmp / "reports",
                "--no-mlflow")
    finally:
        srv.close()


CASES = {1: case1, 2: case2, 3: case3, 4: case4, 5: case5, 6: case6, 7: case7, 8: case8,
         9: case9}

if __name__ == "__main__":
    wanted = [int(a) for a in sys.argv[1:]] or list(CASES)
    for n in wanted:
        print(f"case {n}: {CASES[n].__doc__ or ''}".rstrip())
        with tempfile.TemporaryDirectory(prefix=f"rlaudit-case{n}-") as tmp:
            CASES[n](Path(tmp))
        print()
