"""The verl adapter against the pinned verl releases (installed by `make peers`), run the way a user
runs it: `rlaudit run --target verl==<version>` in a subprocess (two verl versions cannot share a
process), plus hand-worked inputs through each version (tests/targets/peers/verl_probe.py).

verl 0.9.1 must pass with its documented differences declared, on both engines' columns (its
Megatron engine in bf16, compared at bf16 tolerances); verl 0.7.1 must fail exactly on its known bugs: GSPO ignoring
loss_agg_mode, the REINFORCE++ return recursion resetting at masked (tool-output) tokens, the
legacy actor's dynamic batching giving DP ranks different micro-batch counts (verl issues
#6176/#6178, fixed by PR #5591 after 0.7.1), and in its own training step, one column per engine,
only the reds known_reds.py traces (#6016 on the Megatron column alone, the per-micro-batch
normalisation of both legacy actors, their different pg_loss logging between the two).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlaudit.targets.peers import peers_dir
from rlaudit.targets.peers.known_reds import traced

REPO = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).with_name("verl_probe.py")
#: the stage checks and the built-in scenario through verl's own training step
TIMEOUT_S = 1800


def _needs(version: str):
    path = peers_dir() / f"verl-{version}"
    return pytest.mark.skipif(not path.is_dir(), reason=f"verl {version} is not installed under "
                              f"{path.parent} (run `make peers`)")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("RLAUDIT_TEST_THREADS", "1")
    return env


def _run(version: str, tmp_path: Path) -> tuple[dict, int, dict[str, dict[str, dict]], str]:
    """verl_probe.py in a subprocess: (hand-worked outputs, CLI exit code, CLI checks by column
    (``verl-<version>``: the stage checks; ``verl-fsdp-<version>``, ``verl-megatron-<version>``:
    the run-level invariants per engine) and name, CLI stderr)."""
    out = tmp_path / "probe.json"
    p = subprocess.run([sys.executable, str(PROBE), version, str(out), str(tmp_path / "report")],
                       capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=_env())
    if not out.is_file():
        pytest.fail(f"the probe failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    try:
        results = json.loads(p.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"exit {p.returncode}, no JSON on stdout:\n{p.stdout[-2000:]}\n"
                    f"{p.stderr[-4000:]}")
    # verl's columns (the reference's column of the run-level invariants is not verl's result)
    columns: dict[str, dict[str, dict]] = {}
    for r in results:
        for c in r["checks"]:
            if c["backend"] != "reference":
                columns.setdefault(c["backend"], {})[c["invariant"]] = c
    return json.loads(out.read_text()), p.returncode, columns, p.stderr


def _failed(column: dict[str, dict]) -> set[str]:
    return {k for k, c in column.items() if c["status"] in ("fail", "error")}


# ---- hand-worked numbers ------------------------------------------------------------------------

#: GRPO, group {row 0: score 1, row 1: score 0 + 5 on a masked position}: verl sums every
#: position (scores 1 and 5: mean 3, std sqrt(8)), so row 0 gets (1 - 3) / (sqrt(8) + 1e-6)
GRPO_UNMASKED = (1 - 3) / (math.sqrt(8) + 1e-6)
#: k3+ at log_prob -1, ref -1.5: value exp(-0.5) + 0.5 - 1, gradient of k2 = -1 - (-1.5)
K3PLUS = [math.exp(-0.5) + 0.5 - 1, 0.5]


@pytest.mark.slow
@_needs("0.9.1")
def test_verl_091(tmp_path):
    out, code, columns, stderr = _run("0.9.1", tmp_path)
    assert out["version"] == "0.9.1"
    checks, fsdp = columns["verl-0.9.1"], columns["verl-fsdp-0.9.1"]
    # REINFORCE++, rewards [0, 0, 1], mask [1, 0, 1], gamma 0.5: the tool token is skipped, so
    # the first action's return is 0 + 0.5 * 1
    assert out["rfpp_returns"] == pytest.approx([0.5, 1.0], abs=1e-6)
    assert out["grpo_adv_row0"] == pytest.approx(GRPO_UNMASKED, rel=1e-5)
    assert out["grpo_returns_is_advantages"] is True       # aliased outputs: a note, not a bug
    # GSPO on-policy, losses -1, -1 (row 0) and -4 (row 1): token-mean -6/3, seq-mean -(1+4)/2
    assert out["gspo_token-mean"] == pytest.approx(-2.0, abs=1e-6)
    assert out["gspo_seq-mean-token-mean"] == pytest.approx(-2.5, abs=1e-6)
    # loss and logged pg_loss: the micro-batch's contribution -6 / 6, not its local mean -6 / 3
    assert out["vanilla_contribution"] == pytest.approx([-1.0, -1.0], abs=1e-6)
    assert math.isnan(out["agg_empty_local"]) and out["agg_empty_global"] == 0.0
    assert out["k3plus"] == pytest.approx(K3PLUS, rel=1e-6)
    ranks = out["microbatches_per_rank"]
    assert len(set(ranks)) == 1, ranks                     # counts all-reduced over DP ranks
    # VerlVectorizedAdapter: grpo_vectorized ignores norm_adv_by_std_in_grpo=False through the
    # trainer's dispatcher (verl PR #7893): row 0 gets (1 - 0.5) / std{1, 0} instead of 1 - 0.5
    assert out["drgrpo_vectorized_row0"] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)
    # rloo_vectorized: a single-response prompt gets 0, rloo gives its score
    assert (out["rloo_singleton"], out["rloo_vectorized_singleton"]) == (2.0, 0.0)

    # rlaudit run --target verl==0.9.1: exit 0, the documented differences declared
    bad = {(col, k): cs[k]["message"] for col, cs in columns.items() for k in _failed(cs)}
    assert code == 0 and not bad, (code, bad, stderr[-2000:])
    for name in ("compute_advantages:parity", "policy_loss:parity", "agg_loss:global-split",
                 "apply_kl_in_reward:stored-kl-unaltered", "kl_penalty:parity",
                 "make_microbatches:equal-count-per-rank"):
        assert checks[name]["status"] == "pass", (name, checks[name]["message"])
    # the NaN of agg_loss on an all-masked batch without global counts is declared, not hidden
    assert checks["agg_loss:parity"]["status"] == "differs"
    assert "agg-loss-nan-on-empty" in checks["agg_loss:parity"]["message"]
    # train_step on verl's FSDP engine: the run-level invariants ran on it and hold
    for name in ("entropy-logged-when-coeff-zero", "microbatch-invariance", "row-permutation",
                 "grad-norm-identity", "ppo-epochs-identity", "on-policy-identities",
                 "rollout-parity", "padding-appended"):
        assert fsdp[name]["status"] == "pass", (name, fsdp[name]["message"])
    # backend-parity: only the declared differences (critic/score over non-empty responses)
    assert fsdp["backend-parity"]["status"] == "differs", fsdp["backend-parity"]["message"]
    assert "score-metrics-skip-empty-responses" in fsdp["backend-parity"]["message"]
    # train_step on verl's Megatron engine (bf16, verl_mcore.py): the same invariants hold at
    # bf16 tolerances, and it agrees with the FSDP engine (engine-parity at the looser precision)
    mega = columns["verl-megatron-0.9.1"]
    for name in ("entropy-logged-when-coeff-zero", "microbatch-invariance", "row-permutation",
                 "on-policy-identities", "padding-appended", "engine-parity"):
        assert mega[name]["status"] == "pass", (name, mega[name]["message"])
    # its parameters are the bf16 ones its model holds: identities over ||delta theta|| / lr
    # do not apply (the invariant says why), never red
    assert mega["grad-norm-identity"]["status"] == "n/a", mega["grad-norm-identity"]
    # the FSDP engine over two ranks (verl_dp.py): dp-invariance only, against the reference,
    # with backend-parity's declared differences
    dp2 = columns["verl-fsdp-dp2-0.9.1"]
    assert set(dp2) == {"dp-invariance"}, sorted(dp2)
    assert dp2["dp-invariance"]["status"] == "differs", dp2["dp-invariance"]["message"]
    assert "score-metrics-skip-empty-responses" in dp2["dp-invariance"]["message"]


@pytest.mark.slow
@_needs("0.7.1")
def test_verl_071(tmp_path):
    out, code, columns, stderr = _run("0.7.1", tmp_path)
    assert out["version"] == "0.7.1"
    checks = columns["verl-0.7.1"]
    # the running return is reset to 0 at the tool token: the first action gets 0 + 0.5 * 0
    assert out["rfpp_returns"] == pytest.approx([0.0, 1.0], abs=1e-6)
    assert out["grpo_adv_row0"] == pytest.approx(GRPO_UNMASKED, rel=1e-5)
    # GSPO aggregates seq-mean-token-mean whatever loss_agg_mode says
    assert out["gspo_token-mean"] == pytest.approx(-2.5, abs=1e-6)
    assert out["gspo_seq-mean-token-mean"] == pytest.approx(-2.5, abs=1e-6)
    assert out["k3plus"].startswith("NotImplementedError")  # '+' kinds came in verl PR #6058
    # rows 0-5 (54 tokens) and 6-11 (16 tokens) with a budget of 16, no DP all-reduce
    assert out["microbatches_per_rank"] == [4, 1]
    # VerlVectorizedAdapter: grpo_vectorized ignores norm_adv_by_std_in_grpo=False through the
    # trainer's dispatcher (verl PR #7893): row 0 gets (1 - 0.5) / std{1, 0} instead of 1 - 0.5
    assert out["drgrpo_vectorized_row0"] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)
    # rloo_vectorized: a single-response prompt gets 0, rloo gives its score
    assert (out["rloo_singleton"], out["rloo_vectorized_singleton"]) == (2.0, 0.0)

    # rlaudit run --target verl==0.7.1: exit 1 through exactly these stage checks
    failed = {k for k, c in checks.items() if c["status"] in ("fail", "error")}
    assert code == 1, stderr[-2000:]
    stage_failed = {k for k in failed if ":" in k}
    assert stage_failed == {"compute_advantages:parity", "policy_loss:parity",
                            "make_microbatches:equal-count-per-rank",
                            "make_microbatches:within-token-budget",
                            "value_loss:global-split"}, \
        {k: checks[k]["message"] for k in failed}
    assert not failed - stage_failed, {k: checks[k]["message"] for k in failed - stage_failed}
    _check_071_megatron_step(columns["verl-megatron-0.7.1"])
    _check_071_fsdp_step(columns["verl-fsdp-0.7.1"])
    # every red of verl's own training step is a known upstream bug (known_reds.py)
    for engine in ("fsdp", "megatron"):
        for name in _failed(columns[f"verl-{engine}-0.7.1"]):
            assert traced("verl", "0.7.1", f"{name}@{engine}"), (engine, name)
    problems = {k: checks[k]["details"]["problems"] for k in stage_failed}
    # only REINFORCE++ (not its -baseline) differs among the estimators ...
    assert all(p.startswith("reinforce_plus_plus gamma=") for p in
               problems["compute_advantages:parity"]), problems["compute_advantages:parity"]
    # ... only GSPO among the losses, and never under its hard-coded seq-mean-token-mean
    assert all(p.startswith("gspo/") and "seq-mean-token-mean" not in p.split(" ")[0]
               for p in problems["policy_loss:parity"]), problems["policy_loss:parity"]
    # ... and only the token-budget layouts (DataProto.split by count gives equal counts)
    assert all("max_token_len" in p for p in problems["make_microbatches:equal-count-per-rank"])
    # rearrange_micro_batches cuts ceil(T / B) micro-batches (fixed by verl PR #7553): rank 0 of
    # dp=2 holds rows of 10, 10, 9, 9, 9, 7 tokens (54) under a budget of 16, so 4 micro-batches;
    # two of them hold two rows, and past 7 + 9 = 16 every pair left holds at least 9 + 9 = 18
    over = problems["make_microbatches:within-token-budget"]
    assert "dp=2, max_token_len=16: rank 0 micro-batch" in over[0] and "holds 18 tokens" in over[0]
    assert all("over the budget" in p for p in over), over
    # compute_value_loss takes no global counts before 0.9 (verl PR #6957): each micro-batch is
    # normalised by its own, so the micro-batch losses do not sum to the whole batch's
    assert all("sum of micro-batch losses" in p or "micro-batch gradients" in p
               for p in problems["value_loss:global-split"])


def _check_071_megatron_step(checks: dict) -> None:
    """train_step on 0.7.1's legacy Megatron actor (rlaudit/targets/peers/verl_megatron.py)."""
    run_failed = _failed(checks)
    entropy = checks["entropy-logged-when-coeff-zero"]
    if entropy["status"] == "n/a":       # a peer installed before hydra-core was pinned for it
        assert "hydra-core" in entropy["message"] and not run_failed, entropy["message"]
        return
    # verl PR #6016: megatron_actor.py:789 gates entropy on entropy_coeff alone
    assert entropy["status"] == "fail" and "not logged" in entropy["message"], entropy["message"]
    # verl issue #5863: each micro-batch normalised by its own token count (megatron_actor.py:520
    # without global counts), so results depend on the micro-batch cut and the row order, the
    # logged pg_loss is a mean of micro-batch means, and a micro-batch without a valid token
    # logs pg_loss 0/0
    assert run_failed <= {"entropy-logged-when-coeff-zero", "backend-parity",
                          "microbatch-invariance", "row-permutation", "sanity-bounds",
                          "on-policy-identities", "engine-parity"}, \
        {k: checks[k]["message"] for k in run_failed}
    if "on-policy-identities" in run_failed:
        assert "pg_loss" in checks["on-policy-identities"]["message"]
    # ... and nothing else: with one micro-batch per mini-batch it agrees with the reference
    parity = [f["message"] for f in checks["backend-parity"]["details"].get("failures", [])]
    assert parity and not [m for m in parity if m.startswith("variant microbatch:all:")], parity
    for name in ("masked-values", "padding-appended", "rollout-parity", "grad-norm-identity"):
        assert checks[name]["status"] == "pass", (name, checks[name]["message"])
    # the two legacy actors against each other (engine-parity): the same update (both normalise
    # per micro-batch), but the FSDP actor sums pg_loss over mini-batches and epochs (verl PR
    # #5766) where the Megatron one averages it: pg_loss is all that differs
    engine = [f["message"] for f in checks["engine-parity"]["details"].get("failures", [])]
    assert checks["engine-parity"]["status"] == "fail" and engine, checks["engine-parity"]
    assert all("actor/pg_loss" in m for m in engine), engine


def _check_071_fsdp_step(checks: dict) -> None:
    """train_step on 0.7.1's legacy FSDP actor (rlaudit/targets/peers/verl_dp_actor.py): it
    honours calculate_entropy (dp_actor.py:580), so the founding bug is red on Megatron only;
    it shares the per-micro-batch normalisation (verl issue #5625)."""
    entropy = checks["entropy-logged-when-coeff-zero"]
    if entropy["status"] == "n/a":       # a peer installed before hydra-core was pinned for it
        assert "hydra-core" in entropy["message"], entropy["message"]
        return
    assert entropy["status"] == "pass", entropy["message"]
    assert _failed(checks) <= {"backend-parity", "microbatch-invariance", "row-permutation",
                               "sanity-bounds", "on-policy-identities"}, \
        {k: checks[k]["message"] for k in _failed(checks)}
    for name in ("masked-values", "padding-appended", "rollout-parity", "grad-norm-identity",
                 "ppo-epochs-identity"):
        assert checks[name]["status"] == "pass", (name, checks[name]["message"])
