"""TRL releases before 1.9 audited as a user runs them (``rlaudit run --target trl==X --json``):
every red is the one real TRL bug traced in docs/peers.md ("Older releases"), nothing else.

TRL 1.0.0-1.5.1 divide the DAPO (token-mean) loss by the whole generation batch's token count,
not rescaled to the optimizer step's window (huggingface/trl#5619, fixed by #5890). The built-in
scenario cuts each generation into M = 2 optimizer steps, so by hand TRL's step-0 loss and grad
norm are exactly 1/2 of the reference's token mean, while the loss types normalised by the
accumulation steps (grpo, dr_grpo: the ``cfg:agg:*`` variants) agree. Skipped for releases not
installed under the peers directory (requirements/peers-matrix/trl-X.txt); ~2.5 min each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from rlaudit.targets.peers import installed_versions

from peer_cli import REPO

pytestmark = pytest.mark.slow

#: mini-batches (optimizer steps) per generation in the built-in scenario: the factor of the bug
MINIBATCHES_PER_GENERATION = 2
STEP0 = re.compile(r"^variant (?P<variant>\S+): step 0: actor/(?P<metric>loss|grad_norm) = "
                   r"(?P<got>\S+), expected (?P<want>\S+) ")
#: backend-parity problems the adapter declares for every release (docs/peers.md, "TRL")
DECLARED = ("metric actor/entropy missing", "metric actor/pg_loss missing",
            "only in one run ['actor/entropy']", "only in one run ['actor/pg_loss']")


def _audit(version, tmp_path):
    if version not in installed_versions("trl"):
        pytest.skip(f"TRL {version} is not installed under the peers directory (pip install "
                    f"--no-deps --target .peers/trl-{version} -r "
                    f"requirements/peers-matrix/trl-{version}.txt)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, "-m", "rlaudit.cli.main", "run", "--target", f"trl=={version}",
         "--json", "--no-mlflow", "--report-dir", str(tmp_path / "reports")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("version", ["1.0.0", "1.5.1"])
def test_every_red_is_the_dapo_normaliser_bug(version, tmp_path):
    rc, results = _audit(version, tmp_path)
    mine = [c for r in results for c in r["checks"] if c["backend"] == f"trl-{version}"]
    assert mine, "no column named after the release"
    reds = [c for c in mine if c["status"] in ("fail", "error")]
    assert [c["invariant"] for c in reds] == ["backend-parity"], [
        (c["invariant"], c["message"]) for c in reds]
    assert rc == 1
    problems = [f["message"] if isinstance(f, dict) else str(f)
                for f in reds[0]["details"]["failures"]]
    ratios = {}
    for p in problems:
        m = STEP0.match(p)
        if m:
            ratios[(m["variant"], m["metric"])] = float(m["got"]) / float(m["want"])
    # the token-mean variants: loss and grad norm exactly 1/M at step 0
    assert ("base", "loss") in ratios and ("base", "grad_norm") in ratios, problems[:5]
    for key, ratio in ratios.items():
        assert ratio == pytest.approx(1 / MINIBATCHES_PER_GENERATION, rel=1e-6), key
    # the grpo / dr_grpo loss types (normalised by the accumulation steps) carry only what the
    # adapter declares for every release
    agg = [p for p in problems if p.startswith("variant cfg:agg:seq-mean")]
    assert agg and all(p.endswith(DECLARED) for p in agg), agg
    # every problem is in a variant whose step-0 loss is halved, or a declared one
    halved = {v for v, _ in ratios}
    for p in problems:
        assert re.match(r"variant (\S+):", p)[1] in halved or p.endswith(DECLARED), p
