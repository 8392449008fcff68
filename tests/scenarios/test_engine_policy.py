"""run_scenario(policy=...): where a scenario runs (rlaudit's backends, or a target with the
reference as the oracle) is one object the engine asks at each step, so both paths share the
engine's result building, error capture and localisation."""

from __future__ import annotations

from rlaudit.errors import RlauditError
from rlaudit.scenarios.engine import ScenarioPolicy, check_one, run_scenario
from rlaudit.scenarios.spec import load_scenario
from rlaudit.verdict.result import ERROR, PASS, CheckResult
from test_engine_golden import write_scenario


class _Recording(ScenarioPolicy):
    tags = ("recorded",)

    def __init__(self, outcome):
        super().__init__()
        self.calls, self.outcome = [], outcome

    def plan(self, scn):
        self.calls.append("plan")
        return ["reference"], []

    def provenance(self, scn, batch):
        return {"rows": len(batch.mask)}

    def jobs(self, scn, names, variants, res):
        self.calls.append("jobs")
        return None if self.outcome is None else [("reference", None, None)]

    def replay_all(self, jobs):
        self.calls.append("replay_all")
        return [("reference", self.outcome)]

    def checks(self, scn, ctx):
        self.calls.append("checks")
        return [CheckResult("sanity-bounds", "reference", PASS, "checked by the policy")]

    def localise(self, scn, ctx, res):
        self.calls.append("localise")
        return [{"backend": b} for b in ctx.errors]


def test_a_policy_that_runs_nothing_gets_the_result_as_it_stands(tmp_path):
    scn = load_scenario(write_scenario(tmp_path / "policy.yaml"))
    policy = _Recording(None)
    res = run_scenario(scn, policy=policy)
    assert policy.calls == ["plan", "jobs"]
    assert res.tags == [*scn.tags, "recorded"] and res.provenance["rows"] > 0
    assert res.checks == [] and res.runs == {}


def test_a_crash_the_policy_reports_is_an_error_result_then_its_checks(tmp_path):
    scn = load_scenario(write_scenario(tmp_path / "policy.yaml"))
    policy = _Recording("Boom: the trainer fell over\ntraceback lines")
    res = run_scenario(scn, policy=policy)
    assert policy.calls == ["plan", "jobs", "replay_all", "checks", "localise"]
    assert [(c.backend, c.status, c.message) for c in res.checks] == [
        ("reference", ERROR, "Boom: the trainer fell over"),
        ("reference", PASS, "checked by the policy")]
    assert res.errors == {"reference": "Boom: the trainer fell over\ntraceback lines"}
    assert res.localisation == [{"backend": "reference"}]  # a failure is localised


def test_check_one_turns_a_crashing_invariant_into_an_error(monkeypatch):
    from rlaudit.scenarios.invariants import INVARIANTS

    class _Crash:
        def check(self, ctx):
            raise RlauditError("no data")

    monkeypatch.setattr(INVARIANTS, "get", lambda name: _Crash())
    [r] = check_one("sanity-bounds", ctx=None)
    assert (r.status, r.message) == (ERROR, "the check raised RlauditError: no data")
