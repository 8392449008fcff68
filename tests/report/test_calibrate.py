"""Tolerance calibration from repeated runs: the documented rule on hand-computed inputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rlaudit.config import Config
from rlaudit.errors import CheckFailed, InputError
from rlaudit.report import calibrate
from rlaudit.report.calibrate import apply_tolerances, calibrate_scenario, propose_tolerances
from rlaudit.verdict.result import ScenarioResult
from rlaudit.scenarios.spec import Scenario


def test_relative_spread_sets_rtol():
    # step 0: values 1.0, 1.001, 0.999 -> median 1.0, max |dev| 1e-3 -> rel 1e-3
    # step 1: values 2.0, 2.0, 2.006 -> median 2.0, max |dev| 6e-3 -> rel 3e-3 (the larger)
    runs = [[{"a": 1.0}, {"a": 2.0}], [{"a": 1.001}, {"a": 2.0}], [{"a": 0.999}, {"a": 2.006}]]
    tol = propose_tolerances(runs, safety=5.0)
    assert tol["a"]["rtol"] == pytest.approx(5.0 * 3e-3)
    assert tol["a"]["atol"] == calibrate.ATOL_FLOOR


def test_noise_around_zero_sets_atol():
    # median 0 (values 0, 1e-9, -2e-9): max |dev| 2e-9 is not <= 1% of |0| -> atol = 5 * 2e-9
    runs = [[{"kl": 0.0}], [{"kl": 1e-9}], [{"kl": -2e-9}]]
    tol = propose_tolerances(runs, safety=5.0)
    assert tol["kl"]["atol"] == pytest.approx(1e-8)
    assert tol["kl"]["rtol"] == calibrate.RTOL_FLOOR


def test_even_number_of_repeats_uses_the_mean_of_the_middle_two():
    # values 1, 2, 3, 10: median 2.5, max |dev| 7.5 -> 7.5 > 1% of 2.5 -> noise-dominated: atol
    runs = [[{"x": v}] for v in (1.0, 2.0, 3.0, 10.0)]
    assert propose_tolerances(runs, safety=2.0)["x"] == {"rtol": calibrate.RTOL_FLOOR,
                                                         "atol": pytest.approx(15.0)}


def test_deterministic_metrics_get_the_floors_and_the_proposal_covers_every_repeat():
    runs = [[{"a": 0.5, "b": 3.0}], [{"a": 0.5, "b": 3.0 + 1e-7}], [{"a": 0.5, "b": 3.0 - 2e-7}]]
    tol = propose_tolerances(runs, safety=1.0, rtol_floor=1e-12, atol_floor=0.0)
    assert tol["a"] == {"rtol": 1e-12, "atol": 0.0}
    m = 3.0
    for run in runs:  # with safety 1 every repeat sits inside the band around the median
        assert abs(run[0]["b"] - m) <= tol["b"]["atol"] + tol["b"]["rtol"] * abs(m) * (1 + 1e-12)
    assert tol["b"]["rtol"] == pytest.approx(2e-7 / 3.0)


@pytest.mark.parametrize("runs, key", [
    ([[{"a": 1.0}]], "runs"),                                  # one repeat: no spread
    ([[{"a": 1.0}], [{"a": 1.0}, {"a": 1.0}]], "runs"),       # different step counts
    ([[{"a": 1.0}], [{"b": 1.0}]], "runs"),                    # different metric names
    ([[{"a": 1.0}], [{"a": float("nan")}]], "a"),              # non-finite value
])
def test_bad_repeats_name_the_problem(runs, key):
    with pytest.raises(InputError) as e:
        propose_tolerances(runs)
    assert e.value.key == key


GOLDEN = {"scenario": "s", "provenance": {"model_sha": "m"},
          "backends": {"reference@cpu": {"steps": [
              {"actor/pg_loss": {"value": 0.5, "rtol": 1e-6, "atol": 1e-9},
               "actor/entropy": {"value": 2.0, "rtol": 1e-6, "atol": 1e-9}},
              {"actor/pg_loss": {"value": 0.6, "rtol": 1e-6, "atol": 1e-9}}]},
              "fsdp@cuda": {"steps": [{"actor/pg_loss": {"value": 0.5, "rtol": 1e-6,
                                                         "atol": 1e-9}}]}}}


def test_apply_tolerances_sets_every_step_and_leaves_the_input_alone():
    before = copy.deepcopy(GOLDEN)
    doc = apply_tolerances(GOLDEN, {"actor/pg_loss": {"rtol": 1e-3, "atol": 1e-7},
                                    "actor/not_in_golden": {"rtol": 1.0, "atol": 1.0}})
    assert GOLDEN == before
    for key in ("reference@cpu", "fsdp@cuda"):
        for step in doc["backends"][key]["steps"]:
            assert step["actor/pg_loss"]["rtol"] == 1e-3 and step["actor/pg_loss"]["atol"] == 1e-7
    ent = doc["backends"]["reference@cpu"]["steps"][0]["actor/entropy"]
    assert ent == {"value": 2.0, "rtol": 1e-6, "atol": 1e-9}
    assert doc["backends"]["reference@cpu"]["steps"][1]["actor/pg_loss"]["value"] == 0.6
    assert "actor/not_in_golden" not in doc["backends"]["reference@cpu"]["steps"][0]


def test_apply_tolerances_to_one_backend_by_bare_name():
    doc = apply_tolerances(GOLDEN, {"actor/pg_loss": {"rtol": 0.1, "atol": 0.0}}, backends=["fsdp"])
    assert doc["backends"]["fsdp@cuda"]["steps"][0]["actor/pg_loss"]["rtol"] == 0.1
    assert doc["backends"]["reference@cpu"]["steps"][0]["actor/pg_loss"]["rtol"] == 1e-6
    with pytest.raises(InputError, match="megatron"):
        apply_tolerances(GOLDEN, {}, backends=["megatron"])
    with pytest.raises(InputError) as e:
        apply_tolerances(GOLDEN, {"actor/pg_loss": {"rtol": -1.0, "atol": 0.0}})
    assert e.value.key == "actor/pg_loss"


def _scenario() -> Scenario:
    return Scenario(name="calib", path=Path("calib.yaml"), description="", model=Path("m"),
                    rollout=Path("r"), config=Config(), backends={"reference": {}, "fsdp": {}},
                    invariants=["backend_parity"], device="cpu")


def test_calibrate_scenario_repeats_the_baseline_and_merges_backends(monkeypatch):
    calls = []
    # per repeat: reference is deterministic, fsdp's pg_loss wobbles by +-2e-6 around 0.5
    fsdp_values = [0.5, 0.5 + 2e-6, 0.5 - 1e-6]

    def fake_run(scn, *, backends=None, golden_dir="unset", **kw):
        calls.append((scn.invariants, backends, golden_dir))
        k = len(calls) - 1
        res = ScenarioResult(scenario=scn.name, path="", backends=["reference", "fsdp"])
        res.metrics = {"reference": [{"actor/pg_loss": 0.5, "timing/step": 0.1 * k}],
                       "fsdp": [{"actor/pg_loss": fsdp_values[k], "timing/step": 0.3}]}
        return res

    monkeypatch.setattr("rlaudit.scenarios.engine.run_scenario", fake_run)
    out = calibrate_scenario(_scenario(), runs=3, safety=5.0)
    assert calls == [([], None, None)] * 3          # invariants off, no golden comparison
    assert set(out["backends"]) == {"reference@cpu", "fsdp@cpu"}
    assert "timing/step" not in out["tolerances"]   # not golden-compared
    assert out["backends"]["reference@cpu"]["actor/pg_loss"]["rtol"] == calibrate.RTOL_FLOOR
    assert out["tolerances"]["actor/pg_loss"]["rtol"] == pytest.approx(5.0 * 2e-6 / 0.5)
    assert out["runs"] == 3 and out["scenario"] == "calib"


def test_calibrate_scenario_rejects_too_few_runs_and_crashes(monkeypatch):
    with pytest.raises(InputError) as e:
        calibrate_scenario(_scenario(), runs=1)
    assert e.value.key == "--runs"

    def crash(scn, **kw):
        res = ScenarioResult(scenario=scn.name, path="", backends=["fsdp"])
        res.errors["fsdp"] = "RankFailure: rank 1 died"
        return res

    monkeypatch.setattr("rlaudit.scenarios.engine.run_scenario", crash)
    with pytest.raises(CheckFailed, match="rank 1 died"):
        calibrate_scenario(_scenario(), runs=2)


def test_apply_tolerances_takes_calibrate_scenarios_output_per_backend():
    calib = {"scenario": "s", "runs": 3, "safety": 5.0,
             "backends": {"fsdp@cuda": {"actor/pg_loss": {"rtol": 1e-2, "atol": 1e-8}},
                          "megatron@cuda": {"actor/pg_loss": {"rtol": 9.0, "atol": 9.0}}},
             "tolerances": {"actor/pg_loss": {"rtol": 9.0, "atol": 9.0}}}
    before = copy.deepcopy(GOLDEN)
    doc = apply_tolerances(GOLDEN, calib)
    assert GOLDEN == before and doc is not GOLDEN
    assert doc["backends"]["fsdp@cuda"]["steps"][0]["actor/pg_loss"] == {
        "value": 0.5, "rtol": 1e-2, "atol": 1e-8}
    assert doc["backends"]["reference@cpu"] == GOLDEN["backends"]["reference@cpu"]  # not calibrated
    assert "megatron@cuda" not in doc["backends"]


def test_calibrate_repeats_are_replayed_never_answered_from_the_reference_memo(tmp_path,
                                                                              monkeypatch):
    """Each repeat is a measurement of run-to-run spread: the reference memo must not answer a
    repeat with the first run's copy (on a GPU that would read as zero spread)."""
    import dataclasses

    from rlaudit.backends import memo
    from rlaudit.backends.reference import ReferenceBackend
    from rlaudit.scenarios.engine import run_scenario
    from rlaudit.scenarios.spec import load_scenario
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scenarios"))
    from test_engine_golden import write_scenario
    scn = load_scenario(write_scenario(tmp_path / "calib.yaml", backends={"reference": {}}))
    replays = []
    real = ReferenceBackend.replay

    def counted(self, request):
        replays.append(len(request.variants))
        return real(self, request)
    monkeypatch.setattr(ReferenceBackend, "replay", counted)
    memo.clear()
    hits = memo.stats["hits"]
    calibrate_scenario(scn, runs=3)
    assert replays == [1, 1, 1] and memo.stats["hits"] == hits
    # outside calibrate, the same baseline replay is a memo hit (the test can see one)
    base_only = dataclasses.replace(scn, invariants=[])
    run_scenario(base_only, backends=["reference"])
    run_scenario(base_only, backends=["reference"])
    assert memo.stats["hits"] > hits
