"""TRL's real GRPOTrainer audited end to end through ``train_step`` (rlaudit/targets/peers/trl.py).

Skipped unless TRL is importable or installed under the peers directory:
    pip install --no-deps --target .peers/trl-1.16.0 -r requirements/peers/trl-1.16.0.txt

The clean trainer must show no undeclared failure on the built-in target scenario and the TRL
scenario family; three realistic bugs injected into TRL's loss path (by subclassing or
monkeypatching TRL, never by editing it) must each be caught by a named invariant.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import pytest
import torch

from rlaudit.errors import InputError
from rlaudit.targets.peers import activate, installed_versions

VERSION = os.environ.get("RLAUDIT_TRL_VERSION")   # None: the installed/newest one

try:
    activate("trl", VERSION)
    # found, not imported: importing TRL (and vLLM and MLflow through it) costs each pytest
    # worker ~4.5 s at collection; the tests below import it when they run (_gt)
    if importlib.util.find_spec("trl") is None:
        raise ImportError("No module named 'trl'")
except (InputError, ImportError) as e:  # pragma: no cover - depends on the machine
    pytest.skip(f"TRL is not installed (pip install --no-deps --target .peers/trl-1.16.0 -r "
                f"requirements/peers/trl-1.16.0.txt; installed: {installed_versions('trl')}): "
                f"{e}", allow_module_level=True)

from rlaudit.targets.peers import trl as trl_peer  # noqa: E402
from rlaudit.targets.run.runner import run_target  # noqa: E402

pytestmark = pytest.mark.slow
FAMILY = ["trl_gradacc_uneven", "trl_seq_importance", "trl_group_of_three", "trl_two_minibatches"]
BUG_SCENARIO = "trl_gradacc_uneven"



@pytest.fixture(autouse=True, scope="module")
def _trl_active():
    """TRL's directory first on the path again when this module's tests run: collection
    imports every peer's test module, and each activation leaves the other peers' directories
    (registry.leave_other_peers), so the last module collected would otherwise win."""
    activate("trl", VERSION)


@functools.cache
def _gt():
    """TRL's GRPO trainer module, imported on first use (what it imports is frozen after the
    adapter's first train_step: rlaudit/heap.py)."""
    from trl.trainer import grpo_trainer

    return grpo_trainer


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is ~100x faster than two on a loaded 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(adapter, scenarios=None, invariants=None, columns=None):
    """The run-level results of ``adapter``'s column (and of ``columns``, e.g. the reference's,
    or "*" for errors of a check itself)."""
    res = run_target(adapter, scenario_names=scenarios, stages=[], invariants=invariants)
    keep = {adapter.name, "*", *(columns or ())}
    return [c for r in res[1:] for c in r.checks if c.backend in keep]


def _undeclared(checks):
    return [f"{c.backend} {c.invariant}: {c.message}" for c in checks
            if c.status in ("fail", "error")]


def _status(checks, invariant):
    return {c.status for c in checks if c.invariant == invariant}


def _params_differ(checks):
    """backend-parity failed on the updated parameters (not only on a declared metric)."""
    return any("parameters after step" in str(c.details) for c in checks
               if c.invariant == "backend-parity" and c.status == "fail")


# ---- the clean trainer -------------------------------------------------------------------------

def _differs_only_as(checks, invariant, *names):
    """``invariant`` reports differs, declared by exactly the differences ``names``."""
    found = [c for c in checks if c.invariant == invariant and c.status == "differs"]
    assert found, [(c.invariant, c.status, c.message) for c in checks if c.invariant == invariant]
    for c in found:
        assert set(c.details["differences"]) <= set(names), c.details["differences"]


def test_family_end_to_end_no_undeclared_failure():
    adapter = trl_peer.TRLAdapter()
    checks = _run(adapter, FAMILY)
    assert not _undeclared(checks), _undeclared(checks)
    # what must really have run (not n/a) on TRL's own code, under TRL's declared conventions
    for name in ("rollout-parity",                    # temperature in the forward
                 "masked-values", "padding-appended",  # holes and padding ignored
                 "grad-norm-identity", "on-policy-identities",
                 "entropy-logged-when-coeff-zero",     # the micro-batch means recomputed
                 "row-permutation", "microbatch-invariance", "sanity-bounds",
                 "no-input-mutation"):
        assert _status([c for c in checks if c.backend == adapter.name], name) == {"pass"}, name
    # parity: GSPO sequence ratios over 2 iterations agree exactly; on the uneven token-mean
    # scenario the clip fraction of the advantage that is 0 up to float32 rounding (TRL's 0, the
    # reference's -1.5e-8) is within the noise floor's undecided tokens -- once a declared
    # difference, now a pass with nothing declared (every other metric, the per-token tensors
    # and the parameters agree)
    assert _status(checks, "backend-parity") == {"pass"}
    assert not _params_differ(checks)


def test_builtin_scenario_no_undeclared_failure():
    adapter = trl_peer.TRLAdapter()
    checks = _run(adapter, columns=["reference"])
    assert not _undeclared(checks), _undeclared(checks)
    mine = [c for c in checks if c.backend == adapter.name]
    for name in ("rollout-parity", "no-input-mutation", "on-policy-identities",
                 "entropy-logged-when-coeff-zero", "row-permutation", "microbatch-invariance",
                 "grad-norm-identity", "masked-values", "padding-appended", "sanity-bounds",
                 "ppo-epochs-identity",
                 # TRL's beta term (k3 x the importance ratio) descends the KL, two epochs
                 "kl-loss-direction"):
        assert _status(mine, name) == {"pass"}, name
    # grpo / dr_grpo loss types (cfg:agg variants, an empty completion) agree strictly under
    # seq_count = all-rows; TRL has no seq-mean entropy to report there, and no policy loss of
    # its own with beta > 0 (its loss, KL, grad norm and parameters agree in the KL variants)
    _differs_only_as(mine, "backend-parity", "trl-entropy-logged-as-token-mean",
                     "trl-no-policy-loss-with-kl")
    # n/a, each with its reason
    why = {c.invariant: c.message for c in mine if c.status == "n/a"}
    assert "entropy bonus" in why["config-effect"] and "kl_loss_coef 0" in why["config-effect"]
    assert "KL in reward" in why["stored-kl-unaltered"]
    assert "use_dynamic_bsz" in why["batch-invariance"]


def test_kl_term_agrees_only_under_its_declared_conventions():
    """TRL's beta term is k3 (no value clamp) times the differentiable importance ratio. The
    reference computing it without the ratio (rlaudit's own convention) fails backend-parity in
    the KL variants: on-policy the two have equal values but not equal gradients, and the
    second epoch's ratio is not 1 (docs/peers.md, "TRL")."""
    class WithoutRatio(trl_peer.TRLAdapter):
        def __init__(self):
            super().__init__()
            self.differences = tuple(
                dataclasses.replace(d, convention={k: v for k, v in d.convention.items()
                                                   if k != "kl_loss_weight"})
                if d.convention and "kl_loss_weight" in d.convention else d
                for d in self.differences)

    checks = _run(WithoutRatio(), invariants=["backend-parity", "kl-loss-direction"])
    assert _status(checks, "backend-parity") == {"fail"}
    problems = [f["message"] for c in checks if c.invariant == "backend-parity"
                for f in c.details.get("failures", []) if isinstance(f, dict)]
    undeclared = [p for p in problems if "actor/pg_loss" not in p]
    assert undeclared and all("kl:descent" in p for p in undeclared), undeclared
    assert _params_differ(checks)


# ---- three bugs injected into TRL's loss path, one at a time ------------------------------------

@functools.cache
def _bug_trainers() -> dict:
    """Bugs 1 and 3 as subclasses of TRL's real GRPOTrainer (built once TRL is imported)."""
    gt = _gt()

    class LocalTokenNormaliser(gt.GRPOTrainer):
        """Bug 1: the DAPO/token-mean loss normalised by the local micro-batch's token count
        (``num_items_in_batch`` counted per micro-batch instead of over the accumulation
        window)."""

        def _compute_loss(self, model, inputs):
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            spg, ga = self.args.steps_per_generation, self.current_gradient_accumulation_steps
            local = mask.sum().clamp(min=1) * spg / ga   # TRL rescales by ga / spg: local count
            return super()._compute_loss(model, dict(inputs, num_items_in_batch=local))

    class StaleOldLogProbs(gt.GRPOTrainer):
        """Bug 3: the old policy's log-probs dropped from the generation batch, so every
        iteration (num_iterations = 2) uses the current forward as the old policy: ratio 1, no
        clipping."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            out.pop("old_per_token_logps", None)
            return out

    return {"local-token-normaliser": LocalTokenNormaliser,
            "stale-old-log-probs": StaleOldLogProbs}


def _no_temperature(monkeypatch):
    """Bug 2: the rollout temperature dropped from the training forward."""
    gt = _gt()
    if hasattr(gt, "add_fused_lm_head"):        # 1.15+: the temperature lives in the LM head
        real = gt.add_fused_lm_head

        def add_fused_lm_head(model, temperature=1.0, **kw):
            return real(model, temperature=1.0, **kw)
        monkeypatch.setattr(gt, "add_fused_lm_head", add_fused_lm_head)
        return gt.GRPOTrainer

    class NoTemperature(gt.GRPOTrainer):     # before: logits / self.temperature in the forward
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.temperature = 1.0
    return NoTemperature


def test_bug_local_token_normaliser_caught_by_backend_parity():
    adapter = trl_peer.TRLAdapter()
    adapter.trainer_class = _bug_trainers()["local-token-normaliser"]
    checks = _run(adapter, [BUG_SCENARIO], ["backend-parity", "grad-norm-identity"])
    assert _status(checks, "backend-parity") == {"fail"}
    assert _params_differ(checks)                    # not only the declared metric difference
    assert _status(checks, "grad-norm-identity") == {"pass"}   # self-consistent, still wrong


def test_bug_temperature_dropped_caught_by_rollout_parity(monkeypatch):
    adapter = trl_peer.TRLAdapter()
    adapter.trainer_class = _no_temperature(monkeypatch)
    checks = _run(adapter, [BUG_SCENARIO], ["rollout-parity"])
    assert _status(checks, "rollout-parity") == {"fail"}


def test_bug_stale_old_log_probs_caught_by_backend_parity():
    adapter = trl_peer.TRLAdapter()
    adapter.trainer_class = _bug_trainers()["stale-old-log-probs"]
    checks = _run(adapter, [BUG_SCENARIO], ["backend-parity"])
    assert _status(checks, "backend-parity") == {"fail"}
    assert _params_differ(checks)


def test_a_grpo_config_key_the_release_lacks_is_unsupported_not_a_failure(tiny_model):
    """A release whose GRPOConfig has no field for a key the scenario needs (stand-in: the
    installed GRPOConfig without ``delta``) makes train_step's checks ``unsupported`` naming the
    key and release; before, GRPOConfig's TypeError read as a failed metrics-are-copies."""
    from trl import GRPOConfig

    from rlaudit.targets.stages import run_stage_checks

    class NoDelta:   # the release's GRPOConfig, as the adapter reads it: its fields
        __dataclass_fields__ = {k: f for k, f in GRPOConfig.__dataclass_fields__.items()
                                if k != "delta"}

        def __new__(cls, **kw):
            raise AssertionError(f"built despite the missing key: {sorted(kw)[:3]}...")

    class Lacking(trl_peer.TRLAdapter):
        config_class = NoDelta

    adapter = Lacking()
    checks = run_stage_checks(adapter, stages=["train_step"], model_path=tiny_model).checks
    assert checks and {c.status for c in checks} == {"unsupported"}, [
        (c.invariant, c.status, c.message) for c in checks]
    for c in checks:
        assert f"TRL {adapter.version} lacks GRPOConfig delta=" in c.message, c.message
        assert c.backend == f"trl-{adapter.version}"
