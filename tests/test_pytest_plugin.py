"""The pytest plugin (pytest11 entry point): scenario files collected as items with readable ids,
backend filtering, a failing golden reported with the invariant table, non-scenario YAML ignored.
Runs pytest in-process with the `pytester` fixture (a handful of runs, most collect-only)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

import rlaudit.report.console  # noqa: F401  (imported here, not first inside an inner run)
from rlaudit.scenarios.engine import run_scenario
from rlaudit.scenarios.spec import load_scenario

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"


def scenario(**over) -> str:
    d = {"description": "plugin test", "model": str(MODEL), "rollout": str(ROLLOUT),
         "steps": 1, "dtype": "float64",
         "config": {"rollout": {"n": 4, "response_length": 12},
                    "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                              "optim": {"name": "sgd", "lr": 0.05}}},
         "backends": {"reference": {}}, "invariants": ["sanity-bounds"]}
    d.update(over)
    return yaml.safe_dump(d)


@pytest.fixture(scope="module", autouse=True)
def blessed_golden(tmp_path_factory) -> dict:
    """The golden document of `tiny_badgolden`, blessed in this process before any inner pytest
    run. It also warms the process up: in-process pytester restores sys.modules after each run,
    and a torch module imported for the first time inside a run would be re-imported (and
    re-register its operators) later; after a full scenario run nothing new is imported."""
    root = tmp_path_factory.mktemp("plugin")
    (root / "tiny_badgolden.yaml").write_text(scenario())
    run_scenario(load_scenario(root / "tiny_badgolden.yaml"), golden_dir=root, bless=True)
    return json.loads((root / "tiny_badgolden.json").read_text())


@pytest.fixture
def project(pytester, blessed_golden):
    """scenarios/ with two scenarios, a plain YAML file and a YAML under models/; a golden for
    `tiny_badgolden` with actor/pg_loss set far from what the run gives."""
    sc = pytester.mkdir("scenarios")
    (sc / "tiny_ok.yaml").write_text(scenario(backends={"reference": {}, "fsdp": {"dp": 2}}))
    (sc / "tiny_badgolden.yaml").write_text(scenario())
    (sc / "settings.yaml").write_text("retries: 3\nnames: [a, b]\n")  # no `invariants`: not one
    (sc / "models").mkdir()
    (sc / "models" / "inside_models.yaml").write_text(scenario())  # models/ is data, not scenarios
    doc = copy.deepcopy(blessed_golden)
    doc["backends"]["reference@cpu"]["steps"][0]["actor/pg_loss"]["value"] = 123.0
    (pytester.mkdir("golden") / "tiny_badgolden.json").write_text(json.dumps(doc))
    return pytester


def collected(result) -> list[str]:
    return sorted(line for line in result.outlines if "::" in line)


def test_collection_ids_and_backend_filter(project):
    res = project.runpytest("scenarios", "--collect-only", "-q", "-p", "no:cacheprovider")
    assert collected(res) == ["scenarios/tiny_badgolden.yaml::tiny_badgolden[reference]",
                              "scenarios/tiny_ok.yaml::tiny_ok[fsdp]",
                              "scenarios/tiny_ok.yaml::tiny_ok[reference]"]
    res = project.runpytest("scenarios", "--collect-only", "-q", "-p", "no:cacheprovider",
                            "--rlaudit-backend", "fsdp")
    assert collected(res) == ["scenarios/tiny_ok.yaml::tiny_ok[fsdp]"]


def test_items_pass_and_a_failing_golden_shows_the_table(project):
    res = project.runpytest("scenarios", "-p", "no:cacheprovider", "--rlaudit-backend",
                            "reference", "--rlaudit-golden-dir", "golden", "-rA")
    res.assert_outcomes(passed=1, failed=1)
    out = res.stdout.str()
    assert "PASSED scenarios/tiny_ok.yaml::tiny_ok[reference]" in out
    assert "FAILED scenarios/tiny_badgolden.yaml::tiny_badgolden[reference]" in out
    # the failure report is the invariant table, not a Python traceback
    res.stdout.fnmatch_lines([
        "*tiny_badgolden: FAILED*",
        "invariant*reference*worst drift*",
        "sanity-bounds*pass*",
        "golden*FAIL*",
        "*golden FAIL [[]reference[]]: 1 mismatch(es); first: actor/pg_loss step 0:*123*",
    ])
    assert "Traceback" not in out
    assert (project.path / "golden" / "tiny_badgolden.obtained.json").exists()
    assert not (project.path / "golden" / "tiny_ok.json").exists()  # a missing golden is no failure


def test_models_in_an_ancestor_directory_do_not_hide_scenarios(pytester):
    """Only models/ and rollouts/ inside the project are data: a checkout that happens to live
    under some `.../models/...` directory still has its scenarios collected."""
    proj = pytester.mkdir("models") / "proj"
    (proj / "scenarios").mkdir(parents=True)
    (proj / "scenarios" / "tiny_nested.yaml").write_text(scenario())
    res = pytester.runpytest("--rootdir", str(proj), str(proj / "scenarios"), "--collect-only",
                             "-q", "-p", "no:cacheprovider")
    assert collected(res) == ["scenarios/tiny_nested.yaml::tiny_nested[reference]"]
