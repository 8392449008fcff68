"""The parts of verl 0.9.1's Megatron engine that run on the CPU, with the real code on
hand-built inputs: ``MegatronEngineWithLMHead.postprocess_micro_batch_func`` (what each
micro-batch hands megatron's schedule: the loss scaled by the micro-batch count, its metrics,
its detached outputs) and ``postprocess_batch_func`` (what ``forward_backward_batch`` makes of
the micro-batches: outputs back in row order after dynamic batching, per-micro-batch losses and
metrics collected for the trainer's reduction), compared with values worked by hand below.

The engine object is made without ``__init__`` (which builds megatron-core's parallel state on
CUDA): only the attributes these two functions read are set.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlaudit.targets.peers import peers_dir

REPO = Path(__file__).resolve().parents[3]
PEER = peers_dir() / "verl-0.9.1"

pytestmark = pytest.mark.skipif(not (PEER / "verl").is_dir(),
                                reason=f"verl 0.9.1 is not installed under {PEER.parent}")

SCRIPT = r"""
import json, sys, types
sys.path.insert(0, sys.argv[1])
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func

engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
engine.engine_config = types.SimpleNamespace(dynamic_context_parallel=False)
engine.tf_config = None
engine.get_data_parallel_group = lambda: None

rows = [[0.1, 0.2], [0.3, 0.4, 0.5], [0.6]]
split = [[2, 0], [1]]                      # dynamic batching's micro-batches (row indices)
losses, clipfracs = [0.25, 0.75], [0.5, 0.0]
outputs, scaled = [], []
for k, idx in enumerate(split):
    data = TensorDict({"input_ids": torch.zeros(len(idx), 3)}, batch_size=[len(idx)])
    tu.assign_non_tensor(data, num_micro_batch=len(split), use_dynamic_bsz=True)
    logp = torch.nested.as_nested_tensor([torch.tensor(rows[i], requires_grad=True)
                                          for i in idx], layout=torch.jagged)

    def loss_function(model_output, data, dp_group, k=k):
        return (torch.tensor(losses[k], requires_grad=True),
                {"actor/pg_loss": losses[k], "actor/pg_clipfrac": clipfracs[k]})

    loss, out = engine.postprocess_micro_batch_func({"log_probs": logp}, data, False,
                                                    loss_function)
    scaled.append(loss.item())
    outputs.append(out)
    detached = not out["model_output"]["log_probs"].requires_grad

data = TensorDict({"input_ids": torch.zeros(3, 3)}, batch_size=[3])
tu.assign_non_tensor(data, use_dynamic_bsz=True)
batch = postprocess_batch_func(output_lst=outputs, indices=split, data=data)
print(json.dumps({
    "scaled": scaled, "detached": detached,
    "micro_loss": [o["loss"] for o in outputs],
    "log_probs": [t.tolist() for t in batch["model_output"]["log_probs"].unbind()],
    "loss": batch["loss"], "metrics": batch["metrics"]}))
"""


@pytest.fixture(scope="module")
def got():
    # verl in a child: two verl releases cannot share a process
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(PEER)], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_micro_batch_loss_scaled_for_megatrons_schedule(got):
    # megatron's schedule divides each micro-batch's loss by num_microbatches (2 here), so the
    # engine multiplies by it first: 0.25 * 2 and 0.75 * 2; what it logs is the unscaled loss
    assert got["scaled"] == pytest.approx([0.5, 1.5])
    assert got["micro_loss"] == pytest.approx([0.25, 0.75])
    assert got["detached"] is True


def test_outputs_back_in_row_order_and_metrics_per_micro_batch(got):
    # micro-batch 0 held rows 2, 0 and micro-batch 1 row 1: restored to rows 0, 1, 2
    want = [[0.1, 0.2], [0.3, 0.4, 0.5], [0.6]]
    assert len(got["log_probs"]) == 3
    for row, ref in zip(got["log_probs"], want):
        assert row == pytest.approx(ref)
    # one entry per micro-batch, in schedule order (the trainer's reduce_metrics means them)
    assert got["loss"] == pytest.approx([0.25, 0.75])
    assert got["metrics"]["actor/pg_loss"] == pytest.approx([0.25, 0.75])
    assert got["metrics"]["actor/pg_clipfrac"] == pytest.approx([0.5, 0.0])
