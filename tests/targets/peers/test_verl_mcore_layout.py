"""verl 0.9.1's Megatron engine on the CPU over several ranks (verl_mcore.train_steps' layout):
two pipeline stages, and two data-parallel ranks with the rows laid out as verl's dispatch cuts
them (verl_dp.laid_out), each against rlaudit's one-rank reference on the same two optimizer
steps (bf16 against float32: the Megatron column's tolerance). The rank group is verl's own
dispatch and collect (verl_train.LocalWorkerGroup: the last stage's outputs collected). Tensor
parallelism does not run on the CPU: verl_mcore.TP_BLOCKER says why."""

from __future__ import annotations

import pytest
from verl091 import MODEL, PEER

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers import verl_mcore
from rlaudit.targets.peers.verl_dp import laid_out

ROLLOUT = MODEL.parents[1] / "rollouts" / "short-ref.safetensors"
#: bf16 against float32 (test_verl_mcore.py's)
RTOL = 3e-2

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (PEER / "verl").is_dir() or not (PEER / "mbridge").is_dir(),
                                 reason=f"verl 0.9.1 with mbridge is not installed under "
                                        f"{PEER.parent} (run `make peers`)")]

# 16 rows (4 prompts x n 4), mini-batches of 8 rows: two optimizer steps
CONFIG = load_config({"rollout": {"n": 4, "response_length": 12},
                      "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                                "optim": {"name": "sgd", "lr": 0.05}},
                      "trainer": {"dtype": "float32"}})


@pytest.fixture(scope="module")
def reference():
    return ReferenceAdapter().train_step(model_path=MODEL, batch=load_rollout(ROLLOUT),
                                         config=CONFIG, steps=1).metrics[0]


@pytest.mark.parametrize("layout", [{"pp": 2}, {"dp": 2}])
def test_megatron_engine_over_two_ranks_matches_the_reference(reference, layout):
    batch, _ = laid_out(load_rollout(ROLLOUT), CONFIG, layout.get("dp", 1))
    (result,) = verl_mcore.train_steps(MODEL, [(batch, CONFIG, 1)], params=False,
                                       layout=layout)
    got = result["metrics"][0]
    for name in ("actor/pg_loss", "actor/grad_norm"):
        assert got[name] == pytest.approx(float(reference[name]), rel=RTOL), (layout, name)
    assert got["actor/pg_clipfrac"] > 0       # the second optimizer step is off-policy


def test_tensor_parallel_layout_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="llm_bridge.py:76"):
        verl_mcore.train_steps(MODEL, [], layout={"tp": 2})
