"""Bounded work on hostile input: every size that drives work or memory has a limit checked
on load (exit 2, naming the key), YAML aliases expand only within a small budget and duplicate
keys are refused (the message names lines, never the expanded value), and two scenario files
with one name are refused instead of one being skipped."""

from __future__ import annotations

import resource
import time

import pytest
import yaml
from reltools import assert_named, scenario_dict, write_scenario

from rlaudit.scenarios.bounds import MAX_WORLD, limits

LIMITS = limits()


def _run(scn, tmp, *extra):
    return ["run", scn, "--golden-dir", tmp / "golden", "--report-dir", tmp / "reports",
            "--no-mlflow", *extra]


def _refused(res, tmp, source, key):
    assert res.rc == 2, res.err[-2000:]
    assert_named(res.err, source, key)
    assert "running" not in res.err  # nothing ran ...
    assert not (tmp / "reports").exists() and not (tmp / "golden").exists()  # ... or was written


def _set(d: dict, dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return d


HUGE = 10 ** 12


@pytest.mark.parametrize("key", sorted(LIMITS))
def test_a_size_above_its_limit_exits_2_in_seconds(cli, tmp_path, key):
    scn = write_scenario(tmp_path / "scn.yaml", _set(scenario_dict(), key, HUGE))
    res = cli(*_run(scn, tmp_path))
    _refused(res, tmp_path, scn, key)
    assert f"limit of {LIMITS[key][0]}" in res.err
    assert res.seconds < 30


def test_a_size_at_its_limit_is_not_refused_by_the_bounds():
    from pathlib import Path
    from types import SimpleNamespace

    from rlaudit.config import Config
    from rlaudit.scenarios.bounds import size_problems
    cfg = Config()
    cfg.actor.ppo_epochs = LIMITS["config.actor.ppo_epochs"][0]
    scn = SimpleNamespace(path=Path("s.yaml"), steps=LIMITS["steps"][0], config=cfg,
                          backends={"fsdp": {"dp": MAX_WORLD}})
    assert size_problems(scn) == []


def test_a_layout_that_starts_too_many_ranks_exits_2(cli, tmp_path):
    scn = write_scenario(tmp_path / "scn.yaml", backends={"fsdp": {"dp": HUGE}})
    res = cli(*_run(scn, tmp_path))
    _refused(res, tmp_path, scn, "backends.fsdp")
    assert f"limit of {MAX_WORLD}" in res.err


def _bomb(levels: int = 9) -> str:
    """The "billion laughs": each level repeats the one before nine times (9**levels leaves)."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_in_a_short_message_without_memory(cli, tmp_path):
    base = yaml.safe_dump(scenario_dict())
    scn = tmp_path / "scn.yaml"
    scn.write_text(base + _bomb() + "tags: *l8\n")
    assert len(scn.read_bytes()) < 2000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    res = cli(*_run(scn, tmp_path))
    assert res.rc == 2, res.err[-2000:]
    assert time.perf_counter() - t0 < 10
    assert str(scn) in res.err and "aliases expand past the limit" in res.err
    assert len(res.err) < 2000 and res.err.count("lol") <= 2  # the source line, not the value
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200 * 1024


@pytest.mark.parametrize("text,fragment", [
    ("a: &a [1]\nb: &b [*b]\n", "recursive alias *b"),
    ("".join(f"k{i}: &a{i} 1\n" for i in range(101)) + "".join(f"v{i}: *a{i}\n" for i in range(101)),
     "more than 100 aliases"),
])
def test_recursive_and_too_many_aliases_are_refused(text, fragment):
    from rlaudit.yaml_load import load_yaml
    with pytest.raises(yaml.YAMLError) as e:
        load_yaml(text)
    assert fragment in str(e.value)


def test_a_few_aliases_and_merge_keys_still_load():
    from rlaudit.yaml_load import load_yaml
    text = "base: &b {lr: 0.1, name: sgd}\nactor: {optim: *b}\ncritic:\n  <<: *b\n  lr: 0.2\n"
    assert load_yaml(text) == yaml.safe_load(text)


@pytest.mark.parametrize("text,first", [
    ("steps: 1\ninvariants: [sanity-bounds]\nsteps: 2\n", (1, 1)),
    ("invariants: [sanity-bounds]\nconfig: {actor: {ppo_epochs: 1, ppo_epochs: 2}}\n", (2, 18)),
])
def test_a_duplicate_key_exits_2_naming_both_lines(cli, tmp_path, text, first):
    scn = tmp_path / "scn.yaml"
    body = yaml.safe_dump({k: v for k, v in scenario_dict().items()
                           if k not in ("steps", "invariants", "config")})
    scn.write_text(body + text)
    line = f"first on line {body.count(chr(10)) + first[0]}, column {first[1]}"
    res = cli(*_run(scn, tmp_path))
    assert res.rc == 2, res.err[-2000:]
    assert str(scn) in res.err and "duplicate key" in res.err and line in res.err
    assert "Traceback" not in res.err


def test_two_scenario_files_with_one_name_are_refused(cli, tmp_path):
    root = tmp_path / "scenarios"
    a = write_scenario(root / "a" / "same.yaml")
    b = write_scenario(root / "b" / "same.yaml")
    for argv in (["--all"], ["same"]):
        res = cli("run", *argv, "--scenarios-dir", root, "--golden-dir", tmp_path / "golden",
                  "--report-dir", tmp_path / "reports", "--no-mlflow")
        assert res.rc == 2, res.err[-2000:]
        assert "two scenario files named 'same'" in res.err
        assert str(a) in res.err and str(b) in res.err
        assert not (tmp_path / "reports").exists()


def test_two_scenarios_given_one_name_by_their_name_key_are_refused(cli, tmp_path):
    a = write_scenario(tmp_path / "a.yaml", name="same")
    b = write_scenario(tmp_path / "b.yaml", name="same")
    res = cli(*_run(a, tmp_path)[:2], b, *_run(a, tmp_path)[2:])
    assert res.rc == 2, res.err[-2000:]
    assert "two scenarios named 'same'" in res.err and str(b) in res.err


def test_weights_that_do_not_match_the_recorded_hash_exit_2(cli, tmp_path):
    """A snapshot whose weights changed after rlaudit_snapshot.json recorded their sha256 (a
    complete, loadable file: only the hash tells) is refused before anything runs."""
    import shutil

    import safetensors.torch
    from reltools import MODEL
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    weights = model / "model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt"})
    scn = write_scenario(tmp_path / "scn.yaml", model=str(model))
    res = cli(*_run(scn, tmp_path))
    assert res.rc == 2, res.err[-2000:]
    assert "does not match the weights_sha256" in res.err and str(weights) in res.err
    assert "running" not in res.err and not (tmp_path / "reports").exists()
