"""A target with several engines (rlaudit/targets/run/engines.py): one column per engine, each
checked against the reference, and engine-parity between them. The engines are rlaudit's own
reference adapter under two names, one of them logging a doubled ``actor/pg_loss`` (a metric
only: the update is the same)."""

from __future__ import annotations

import dataclasses

import pytest

from rlaudit.backends.replay import RECORDED_FIELDS
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs import builtin
from rlaudit.targets.run.engines import ENGINE_PARITY
from rlaudit.targets.run.runner import run_target_scenario
from rlaudit.verdict.result import FAIL, PASS

pytestmark = pytest.mark.slow


class Engine:
    """rlaudit's reference adapter's train_step (variant by variant) under ``name``."""

    def __init__(self, name: str, pg_loss_factor: float = 1.0):
        self.name, self.factor, self.inner = name, pg_loss_factor, ReferenceAdapter()

    def train_step(self, **kw):
        out = self.inner.train_step(**kw)
        metrics = [{k: (v * self.factor if k == "actor/pg_loss" else v) for k, v in m.items()}
                   for m in out.metrics]
        # the reference's own per-token fields, those a train_step may return
        tokens = {k: t for k, t in out.tokens.items() if k in RECORDED_FIELDS}
        return dataclasses.replace(out, metrics=metrics, tokens=tokens)


class TwoEngines:
    name = "two"

    def __init__(self, second: Engine):
        self.engines = (Engine("two-a"), second)

    def train_step(self, **kw):
        return self.engines[0].train_step(**kw)


def _run(target, tiny_model, builtin_rollout):
    scn = builtin.scenario(tiny_model, ["backend-parity"],
                           ref_model_path=builtin.tiny_model_path(None, "llama"))
    res = run_target_scenario(target, scn, builtin_rollout, invariants=["backend-parity"])
    return res, {(c.backend, c.invariant): c for c in res.checks}


def test_engine_parity_names_what_differs(tiny_model, builtin_rollout):
    res, checks = _run(TwoEngines(Engine("two-b", pg_loss_factor=2.0)), tiny_model,
                       builtin_rollout)
    assert res.backends == ["two-a", "two-b", "reference"]
    assert checks[("two-a", "backend-parity")].status == PASS
    assert checks[("two-b", "backend-parity")].status == FAIL
    engine = checks[("two-b", ENGINE_PARITY)]
    assert engine.status == FAIL and "against two-a" in engine.message
    failures = [f["message"] for f in engine.details["failures"]]
    assert failures and all("actor/pg_loss" in m for m in failures), failures
    assert ("two-a", ENGINE_PARITY) not in checks      # reported in the later engine's column


def test_identical_engines_agree(tiny_model, builtin_rollout):
    res, checks = _run(TwoEngines(Engine("two-b")), tiny_model, builtin_rollout)
    assert checks[("two-b", ENGINE_PARITY)].status == PASS
    assert checks[("two-b", ENGINE_PARITY)].message.startswith("1 variant(s) agree with two-a")
    # the reference's own results appear once, not once per engine
    ref = [c for c in res.checks if c.backend == "reference"]
    assert len(ref) == len({c.invariant for c in ref})


class Counting(Engine):
    """An engine column checked by named invariants only (``checked_invariants``), counting
    the steps it was asked for."""

    def __init__(self, name: str, checks: tuple[str, ...]):
        super().__init__(name, pg_loss_factor=2.0)
        self.checked_invariants, self.calls = checks, 0

    def train_step(self, **kw):
        self.calls += 1
        return super().train_step(**kw)


def test_an_engine_with_its_own_checks_runs_only_for_them(tiny_model, builtin_rollout):
    # its doubled pg_loss would fail backend-parity and engine-parity: neither is its check
    own = Counting("two-dp", ("dp-invariance",))
    res, checks = _run(TwoEngines(own), tiny_model, builtin_rollout)
    assert own.calls == 0                             # the scenario checks no dp-invariance
    assert not [c for c in res.checks if c.backend == "two-dp"]
    own = Counting("two-only", ("backend-parity",))
    res, checks = _run(TwoEngines(own), tiny_model, builtin_rollout)
    assert own.calls > 0
    assert {c.invariant for c in res.checks if c.backend == "two-only"} == {"backend-parity"}
    assert checks[("two-only", "backend-parity")].status == FAIL
