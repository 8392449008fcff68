"""Several reward functions in a rollout (rlaudit/data/rewards.py): the combined score and the
per-function means against hand-worked values, the shipped rollout, and bad input naming the
file and the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlaudit.algo.reward import combine_reward_scores, reward_function_means
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import load_rollout, sidecar_path
from rlaudit.errors import InputError

ROLLOUTS = Path(__file__).resolve().parents[2] / "scenarios" / "rollouts"
SHIPPED = ROLLOUTS / "short-ref-rewards.safetensors"


def test_combined_score_and_means_by_hand():
    per = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, -6.0]])
    applied = torch.tensor([[True, False], [True, True], [False, True]])
    # row 0: 1 (function 1 did not score it); row 1: 3 + 0.5 * 4; row 2: 0.5 * -6
    assert combine_reward_scores(per, [1.0, 0.5], applied).tolist() == [1.0, 5.0, -3.0]
    assert combine_reward_scores(per, [1.0, 0.5]).tolist() == [2.0, 5.0, 2.0]
    # function 0 over rows 0, 1; function 1 over rows 1, 2 (a row it did not score is left
    # out, not counted as 0)
    assert reward_function_means(per, applied) == [2.0, -1.0]
    with pytest.raises(InputError, match="expected 2 weights"):
        combine_reward_scores(per, [1.0])


def test_shipped_rollout_scores_are_the_weighted_sums():
    b = load_rollout(SHIPPED)
    assert b.meta["reward_functions"] == ["task", "brevity"]
    assert b.meta["reward_weights"] == [1.0, 0.5]
    # row 0: task 1.0, 5 tokens of 12 -> brevity 7/12, weight 0.5
    assert b["scores"][0].item() == pytest.approx(1.0 + 0.5 * 7 / 12, abs=1e-7)
    # row 5: task 10/12 < 0.9, so brevity did not score it: the task score alone
    assert not b["reward_mask"][5, 1] and b["scores"][5].item() == pytest.approx(10 / 12,
                                                                                abs=1e-7)
    assert int(b["reward_mask"][:, 1].sum()) == 10


def _copy(tmp_path) -> Path:
    for suffix in (".safetensors", ".json"):
        shutil.copy(SHIPPED.with_suffix(suffix), tmp_path / f"r{suffix}")
    return tmp_path / "r.safetensors"


def _edit_meta(path: Path, **meta):
    side = sidecar_path(path)
    doc = json.loads(side.read_text())
    for k, v in meta.items():
        if v is None:
            doc["meta"].pop(k, None)
        else:
            doc["meta"][k] = v
    side.write_text(json.dumps(doc))


@pytest.mark.parametrize("meta, key, words", [
    ({"reward_weights": [1.0, 0.5, 2.0]}, "meta.reward_weights", "3 weights for 2 reward"),
    ({"reward_weights": [1.0, "x"]}, "meta.reward_weights", "finite numbers"),
    ({"reward_functions": None}, "meta.reward_functions", "without meta.reward_functions"),
    ({"reward_functions": ["task"]}, "reward_scores", "F=1"),
    ({"reward_functions": ["task", "task"]}, "meta.reward_functions", "distinct"),
])
def test_bad_meta_names_the_file_and_key(tmp_path, meta, key, words):
    path = _copy(tmp_path)
    _edit_meta(path, **meta)
    with pytest.raises(InputError) as e:
        load_rollout(path)
    assert e.value.key == key and str(path) in str(e.value) and words in str(e.value)


def test_reward_functions_named_without_scores(tmp_path):
    for suffix in (".safetensors", ".json"):
        shutil.copy((ROLLOUTS / "short-ref").with_suffix(suffix), tmp_path / f"r{suffix}")
    path = tmp_path / "r.safetensors"
    _edit_meta(path, reward_functions=["task", "brevity"])
    with pytest.raises(InputError) as e:
        load_rollout(path)
    assert e.value.key == "reward_scores" and "no reward_scores field" in str(e.value)


def test_scores_must_be_the_combination_and_every_row_scored():
    b = load_rollout(SHIPPED)
    wrong = b["scores"].clone()
    wrong[3] += 0.25           # as if the weights were ignored on one row
    with pytest.raises(InputError) as e:
        RolloutBatch.from_tensors({**b.tensors, "scores": wrong}, meta=b.meta, source="x")
    assert e.value.key == "scores" and "row 3" in str(e.value)
    mask = b["reward_mask"].clone()
    mask[7] = False
    with pytest.raises(InputError) as e:
        RolloutBatch.from_tensors({**b.tensors, "reward_mask": mask}, meta=b.meta, source="x")
    assert e.value.key == "reward_mask" and "rows [7]" in str(e.value)
    nan = b["reward_scores"].clone()
    nan[2, 1] = float("nan")
    with pytest.raises(InputError) as e:
        RolloutBatch.from_tensors({**b.tensors, "reward_scores": nan}, meta=b.meta, source="x")
    assert e.value.key == "reward_scores"


def test_scores_left_out_are_computed(tmp_path):
    """A file without ``scores`` gets the combined score at load (rlaudit's reference
    computes it)."""
    from rlaudit.data.io import save_rollout
    b = load_rollout(SHIPPED)
    path = tmp_path / "no-scores.safetensors"
    # save_rollout validates the batch (scores required there); a file written without them
    # (another writer) is the case at hand: write the tensors, then drop the field
    save_rollout(b, path)
    import safetensors.torch
    from rlaudit.data.io import rollout_sha256
    tensors = safetensors.torch.load(path.read_bytes())
    tensors.pop("scores")
    path.write_bytes(safetensors.torch.save(tensors))
    side = sidecar_path(path)
    doc = json.loads(side.read_text())
    doc["fields"].pop("scores")
    doc["sha256"] = rollout_sha256(tensors)
    side.write_text(json.dumps(doc))
    got = load_rollout(path)
    assert torch.equal(got["scores"], b["scores"].double())


def test_cli_refuses_mismatched_weights_before_running(tmp_path):
    """``rlaudit run`` on a scenario whose rollout has 3 weights for 2 functions: exit 2, the
    message names the rollout file and ``meta.reward_weights``, nothing replayed."""
    import os
    import subprocess
    import sys
    import yaml
    path = _copy(tmp_path)
    _edit_meta(path, reward_weights=[1.0, 0.5, 2.0])
    scn = yaml.safe_load((ROLLOUTS.parent / "trl_reward_weights.yaml").read_text())
    scn.update(model=str(ROLLOUTS.parent / scn["model"]), rollout=str(path))
    (tmp_path / "bad_weights.yaml").write_text(yaml.safe_dump(scn))
    repo = ROLLOUTS.parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "rlaudit.cli.main", "run", str(tmp_path / "bad_weights.yaml"),
         "--no-mlflow", "--report-dir", str(tmp_path / "rep")], cwd=repo, capture_output=True,
        text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert str(path) in proc.stderr and "meta.reward_weights" in proc.stderr, proc.stderr
    assert "3 weights for 2 reward functions" in proc.stderr
