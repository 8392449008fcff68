"""AReaL's own PPO update on CPU: its FSDP engine (FSDP2 over gloo, AReaL's CPU platform), its
``PPOActor`` (advantages, then ``_ppo_update``), on rlaudit's tiny Qwen2 snapshot, in a process of
its own (a process group; AReaL replaces ``logging.root``). Writes JSON to OUT: the mean
log-prob of the response tokens before and after one update whose every advantage is +1.

    python tests/targets/peers/areal_train_probe.py 1.0.4 MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(version: str, model: str) -> dict:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    from rlaudit.targets.peers import activate
    activate("areal", version)
    from rlaudit.targets.peers.areal import import_areal, sequence_batch
    import_areal()
    from areal.api import FinetuneSpec
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
    from areal.engine.fsdp_engine import FSDPEngine
    from areal.trainer.ppo.actor import PPOActor

    # plain SGD without weight decay: the update is the loss gradient alone; no KL term. One row
    # per micro-batch (n_mbs = rows) and sdpa: AReaL packs a micro-batch's rows into one
    # sequence without a mask, which only a varlen kernel keeps apart (areal_train.py)
    config = PPOActorConfig(
        experiment_name="rlaudit", trial_name="probe", path=model, dtype="float32",
        backend="fsdp:d1", attn_impl="sdpa", mb_spec=MicroBatchSpec(n_mbs=4),
        optimizer=OptimizerConfig(type="sgd", lr=0.05, weight_decay=0.0,
                                  lr_scheduler_type="constant"),
        kl_ctl=0.0, recompute_logprob=True, ppo_n_minibatches=1)
    engine = FSDPEngine(config)
    engine.create_process_group()
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=4))
    actor = PPOActor(config, engine)

    g = torch.Generator().manual_seed(0)
    b, r = 4, 3
    data = sequence_batch(torch.ones(b, r, dtype=torch.bool), torch.ones(b), torch.zeros(b, r),
                          None)
    # AReaL's engine trims a batch to its longest row: keep the prompt token and the responses
    data = {k: v[:, :1 + r] if v.dim() == 2 else v for k, v in data.items()}
    data["input_ids"] = torch.randint(1, 60, data["input_ids"].shape, generator=g)
    inputs = {k: v.clone() for k, v in data.items()}
    # the response tokens' log-probs sit one position before each token (AReaL's shift)
    predicts = torch.roll(data["loss_mask"].float(), shifts=-1, dims=-1).bool()

    def mean_logp() -> float:
        logp = actor._compute_logp({k: v.clone() for k, v in inputs.items()})
        return float(logp[predicts].mean())

    before = mean_logp()
    data["prox_logp"] = actor._compute_logp({k: v.clone() for k, v in inputs.items()})
    data = actor._compute_advantages(data)
    adv = data["advantages"][predicts]
    actor._ppo_update(data)
    return {"before": before, "after": mean_logp(), "device": str(next(engine.model.parameters()).device),
            "advantages": [float(adv.min()), float(adv.max())]}


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2])
    with open(sys.argv[3], "w") as f:
        json.dump(result, f)
