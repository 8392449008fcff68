"""verl 0.9.1's FSDP engine over two ranks, laid out as the ``verl-fsdp-dp2`` column lays it out
(rlaudit.targets.peers.verl_dp), against rlaudit's one-rank reference: an independent computation
of the same two optimizer steps. Then verl broken inside its ranks the way a per-rank normaliser
breaks it (each rank divides its loss by its own token count, not the dp group's): at dp 2 the
gradient differs from the reference, at dp 1 it cannot (one rank's count is the group's), which
is why the column exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from verl091 import MODEL, missing

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers.verl_dp import laid_out, restored
from rlaudit.targets.peers.verl_step import output
from rlaudit.targets.peers.verl_train import train_rank, train_steps

REPO = Path(__file__).resolve().parents[3]
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
#: float32 on both sides, different reduction orders
RTOL = 1e-4


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(missing()), reason=missing())]

# 16 rows (4 prompts x n 4), mini-batches of 8 rows: two optimizer steps, so the row order
# handed to the ranks decides which rows each step trains
CONFIG = load_config({"rollout": {"n": 4, "response_length": 12},
                      "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                                "optim": {"name": "sgd", "lr": 0.05}},
                      "trainer": {"dtype": "float32"}})


def local_normaliser_rank(info, request):
    """verl_train's rank body with the FSDP engine's token count left per rank: the value
    forward_backward_batch all-reduces over the dp group (fsdp/transformer_impl.py:730-734) is
    replaced by the rank's own count where it is stored for the loss."""
    import sys  # lazy: the rank's own path set-up, as train_rank's
    sys.path.insert(0, request["peer"])
    from rlaudit.targets.peers import verl_cpu  # lazy: verl only inside the rank
    verl_cpu.select()
    from verl.workers.engine.fsdp import transformer_impl  # lazy: as above
    real = transformer_impl.tu

    class LocalCount:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def assign_non_tensor(data, **kw):
            if "batch_num_tokens" in kw:
                kw["batch_num_tokens"] = int(data["loss_mask"].sum())
            return real.assign_non_tensor(data, **kw)

    transformer_impl.tu = LocalCount()
    return train_rank(info, request)


def _verl(dp: int, rank=None):
    batch = load_rollout(ROLLOUT)
    laid, order = laid_out(batch, CONFIG, dp)
    (result,) = train_steps(MODEL, [(laid, CONFIG, 1)], dp=dp, rank=rank)
    return restored(output(result, laid, config=CONFIG), order)


@pytest.fixture(scope="module")
def reference():
    return ReferenceAdapter().train_step(model_path=MODEL, batch=load_rollout(ROLLOUT),
                                         config=CONFIG, steps=1)


def test_dp2_laid_out_matches_the_one_rank_reference(reference):
    got = _verl(2)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert float(got.metrics[0][key]) == pytest.approx(float(reference.metrics[0][key]),
                                                           rel=RTOL, abs=1e-6), key
    # per-token outputs back in the rollout's order: the reference computed them in that order
    mask = load_rollout(ROLLOUT).mask.bool()
    for name in ("advantages", "old_log_probs"):
        want = reference.tokens[name] if name in reference.tokens else reference.log_probs
        torch.testing.assert_close(got.tokens[name][mask].double(), want[mask].double(),
                                   rtol=RTOL, atol=1e-5, msg=name)
    for name, value in reference.params[0].items():
        torch.testing.assert_close(got.params[0][name].reshape(-1), value.reshape(-1).float(),
                                   rtol=RTOL, atol=1e-6, msg=name)


def test_a_per_rank_normaliser_shows_at_dp2_only(reference):
    want = float(reference.metrics[0]["actor/grad_norm"])
    dp1 = float(_verl(1, rank=local_normaliser_rank).metrics[0]["actor/grad_norm"])
    dp2 = float(_verl(2, rank=local_normaliser_rank).metrics[0]["actor/grad_norm"])
    assert dp1 == pytest.approx(want, rel=RTOL)          # one rank: its count is the group's
    assert abs(dp2 - want) > 100 * RTOL * want, (dp2, want)
