"""One job of slime's CPU step inside the rank (slime_train.py's docstring is the design): the
model, slime's optimizer and scheduler, its Megatron actor, and per training step the rollout
manager's hand-over and the actor's ``train``. Imports slime: loaded inside the rank only."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import torch

from rlaudit.targets.peers.slime_cpu import PackedSequences, in_process_object_store

#: slime's per-step log key -> rlaudit catalogue name
METRICS = {"train/pg_loss": "actor/pg_loss", "train/pg_clipfrac": "actor/pg_clipfrac",
           "train/ppo_kl": "actor/ppo_kl", "train/grad_norm": "actor/grad_norm",
           "train/lr-pg_0": "actor/lr", "train/entropy_loss": "actor/entropy"}
#: rlaudit's one rank, as slime's rollout manager is told the training layout
PARALLEL = {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}


def megatron_defaults() -> dict[str, Any]:
    """Megatron-LM arguments slime's step reads, at Megatron-LM's defaults (its parser is in
    ``megatron.training``, absent here), for one rank in float32."""
    return {
        "bf16": False, "fp16": False, "params_dtype": torch.float32,
        "use_distributed_optimizer": False, "overlap_grad_reduce": False,
        "overlap_param_gather": False, "align_grad_reduce": True, "align_param_gather": False,
        "check_for_nan_in_loss_and_grad": True, "manual_gc": False, "manual_gc_interval": 0,
        "enable_gloo_process_groups": False, "moe_use_upcycling": False,
        "load": "rlaudit-tiny-model", "pretrained_checkpoint": None, "seq_length": 4096,
        "decoder_seq_length": None, "lr_decay_style": "constant", "lr_decay_iters": None,
        "lr_wsd_decay_iters": None, "lr_wsd_decay_style": "exponential",
        "lr_warmup_fraction": None, "lr_warmup_iters": 0, "lr_warmup_init": 0.0,
        "weight_decay_incr_style": "constant", "use_checkpoint_opt_param_scheduler": False,
        "override_opt_param_scheduler": False, "use_critic": False, "use_wandb": False,
        "use_tensorboard": False, "debug_rollout_only": False, "debug_train_only": False,
        "load_debug_rollout_data": None, "sequence_parallel": False, "no_load_optim": False,
        "num_experts": None, "q_lora_rank": None, "kv_lora_rank": None,
    }


def model_args(hf_config) -> dict[str, Any]:
    """Megatron-LM's model-shape arguments for the HF config (slime's FLOPs logging reads
    them)."""
    heads = hf_config.num_attention_heads
    return {"num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
            "ffn_hidden_size": hf_config.intermediate_size, "num_attention_heads": heads,
            "num_query_groups": getattr(hf_config, "num_key_value_heads", None) or heads,
            "kv_channels": getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // heads, "vocab_size": hf_config.vocab_size}


def base_args(values: dict[str, Any]) -> argparse.Namespace:
    """slime's parser's defaults, then Megatron-LM's (:func:`megatron_defaults`), then
    ``values``."""
    # lazy: slime exists only inside the rank
    from slime.utils.arguments import get_slime_extra_args_provider
    parser = get_slime_extra_args_provider()(argparse.ArgumentParser())
    args, _ = parser.parse_known_args(["--rollout-batch-size", str(values["rollout_batch_size"])])
    for key, value in {**megatron_defaults(), **values}.items():
        setattr(args, key, value)
    return args


def build_model(model_path: str, args):
    """The GPTModel for the HF snapshot (float32; slime_train.py's docstring) in megatron DDP,
    as slime's ``get_model`` returns it: a list of model chunks."""
    # lazy: megatron-core: optional, imported inside the rank only
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from safetensors.torch import load_file  # lazy: as above
    from transformers import AutoConfig  # lazy: as above

    from rlaudit.backends.megatron.convert import load_hf_weights  # lazy: megatron backend
    from rlaudit.backends.megatron.model import build_gpt_model, freeze_padding_embedding
    hf_config = AutoConfig.from_pretrained(model_path)
    state = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    # slime's TransformerConfig carries its --calculate-per-token-loss (Megatron then divides
    # the gradients by the step's token count in finalize_model_grads)
    gpt = build_gpt_model(hf_config, dtype=torch.float32, overrides={
        "calculate_per_token_loss": bool(args.calculate_per_token_loss)})
    load_hf_weights(gpt, state, hf_config)
    freeze_padding_embedding(gpt, hf_config)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=False), PackedSequences(gpt))
    return gpt, [ddp], hf_config


class _Quiet:
    """The actor's profiler and weight updater: nothing to profile, no rollout engine."""

    def step(self, **kwargs) -> None:
        return None

    def pop_metrics(self) -> dict:
        return {}


def make_actor(args, model, optimizer, scheduler):
    """slime's ``MegatronTrainRayActor`` without its Ray ``init`` (which starts the cluster
    side: rollout engines, weight sync, checkpoint loading): the attributes ``train`` reads."""
    # lazy: slime exists only inside the rank
    from slime.backends.megatron_utils import actor as actor_module
    from slime.utils.tensor_backper import TensorBackuper  # lazy: as above

    MegatronTrainRayActor, Timer = actor_module.MegatronTrainRayActor, actor_module.Timer

    actor = MegatronTrainRayActor.__new__(MegatronTrainRayActor)
    actor.args, actor.role = args, "actor"
    actor.model, actor.optimizer, actor.opt_param_scheduler = model, optimizer, scheduler
    actor.weights_backuper = TensorBackuper.create(
        source_getter=lambda: [(n, p) for chunk in model for n, p in chunk.named_parameters()],
        single_tag="actor")
    actor._active_model_tag = "actor"
    actor.weights_backuper.backup("actor")
    actor.prof, actor.weight_updater = _Quiet(), _Quiet()
    actor.rollout_data_postprocess = None
    if "train_wait" not in Timer().start_time:    # a previous job's train restarted it
        Timer().start("train_wait")     # what init's with_defer does when init returns
    return actor


def rollout_manager(args):
    """slime's ``RolloutManager`` (its class, not the Ray actor) with only what converting
    samples to train data reads: no rollout servers, no custom hooks."""
    # lazy: slime exists only inside the rank
    from slime.ray.rollout import RolloutManager
    cls = RolloutManager.__ray_metadata__.modified_class
    manager = cls.__new__(cls)
    manager.args = args
    manager.custom_reward_post_process_func = None
    manager.custom_convert_samples_to_train_data_func = None
    manager.train_parallel_config = dict(PARALLEL)
    return manager


@contextlib.contextmanager
def recording(held: dict):
    """slime's log calls and the rollout data after its advantages, recorded while the block
    runs (``logging_utils.log`` is slime's sink for wandb and tensorboard, both off; the module
    its training loop logs through, slime.observability's or, in older snapshots, slime.utils')."""
    # lazy: slime exists only inside the rank
    from slime.backends.megatron_utils import model
    logging_utils = model.logging_utils
    real = logging_utils.log

    def log(args, metrics, step_key):
        held["logs"].append(dict(metrics))
        return real(args, metrics, step_key)

    logging_utils.log = log
    try:
        yield
    finally:
        logging_utils.log = real


def train_job(model_path: str, job: dict, held: dict) -> dict:
    """One job: per step the catalogue metrics (and slime's raw log) and every parameter after
    it by HF name; step 0's per-sample tensors."""
    # lazy: slime and megatron-core exist only inside the rank
    from slime.backends.megatron_utils.model import setup_model_and_optimizer
    from slime.utils.types import Sample  # lazy: as above

    from rlaudit.backends.megatron.convert import gather_hf_state_dict  # lazy: megatron-core
    # lazy: transformers, inside the rank
    from transformers import AutoConfig
    args = base_args({**model_args(AutoConfig.from_pretrained(model_path)), **job["args"]})
    held["args"] = args
    gpt, model, hf_config = build_model(model_path, args)
    held["model"] = model
    model, optimizer, scheduler = setup_model_and_optimizer(args, "actor")
    actor = make_actor(args, model, optimizer, scheduler)
    manager = rollout_manager(args)
    seen: list[dict] = []
    actor.rollout_data_postprocess = lambda a, rid, data: seen.append(
        {k: [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in data[k]]
         for k in ("log_probs", "advantages", "returns", "response_lengths") if k in data})
    result: dict[str, Any] = {"metrics": [], "raw_metrics": [], "params": []}
    for rollout_id in range(job["steps"]):
        held["logs"] = []
        with in_process_object_store(), recording(held):
            data = manager._convert_samples_to_train_data([Sample(**s) for s in job["samples"]])
            actor.train(rollout_id, manager._split_train_data_by_dp(data))
        result["raw_metrics"].append(held["logs"])
        metrics = step_metrics(held["logs"], args.calculate_per_token_loss)
        if not job["entropy"]:      # slime logs it always; the config does not compute it
            metrics.pop("actor/entropy", None)
        result["metrics"].append(metrics)
        if rollout_id == 0:
            result["tokens"] = seen[0]
        result["params"].append({k: v.detach().cpu().clone()
                                 for k, v in gather_hf_state_dict(gpt, hf_config).items()})
    return result


def step_metrics(logs: list[dict], per_token: bool) -> dict[str, float]:
    """slime's per-optimizer-step logs (those with ``train/step``) averaged, catalogue names.
    With per-sample means (not ``per_token``) slime's clip fraction and ppo_kl are means over
    samples of per-sample means, not the catalogue's token-means: left out."""
    steps = [d for d in logs if "train/step" in d]
    out = {}
    for theirs, ours in METRICS.items():
        if not per_token and ours in ("actor/pg_clipfrac", "actor/ppo_kl"):
            continue
        vals = [float(d[theirs]) for d in steps if theirs in d]
        if vals:
            out[ours] = sum(vals) / len(vals)
    return out
