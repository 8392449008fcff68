"""verl 0.7.1's legacy FSDP actor, driven with verl's real code on the CPU: ``DataParallelPPOActor``
(verl/workers/actor/dp_actor.py) over the committed tiny model, with the optimizer and LR schedule
verl's FSDP worker builds (``build_optimizer``, ``get_constant_schedule_with_warmup``,
fsdp_workers.py:650-657).

    out = train_steps(model_path, [(batch, cfg, steps)], peer=".peers/verl-0.7.1")[0]
    out["metrics"][step]          # verl's names, reduced as fit reduces them

Per step, in ``RayPPOTrainer.fit``'s order, as the Megatron path (verl_megatron.py) runs it: the
old log-probs and entropy through ``DataParallelPPOActor.compute_log_prob`` with the meta-info the
FSDP worker sets (fsdp_workers.py:1109-1113), rewards = scores, the trainer's
``compute_advantage``, the trainer's own ``_update_actor`` (its legacy branch hands the batch to
the worker group), whose ``update_actor`` is the FSDP worker's glue (fsdp_workers.py:1007-1027:
``pad_token_id``, ``update_policy``, ``actor/lr`` from the scheduler, then its step), then
``reduce_metrics``.

What stands in for verl, and why it is faithful:

- No FSDP wrapper: one rank (dp 1), the module as ``AutoModelForCausalLM.from_pretrained`` loads
  it (what the worker's ``_build_model_optimizer`` loads before wrapping it, float32, sdpa
  attention instead of flash-attention-2, which has no CPU kernel). verl's actor takes any
  ``nn.Module`` and has a branch for a plain one in its optimizer step (dp_actor.py:399-400,
  ``torch.nn.utils.clip_grad_norm_``); on one rank FULL_SHARD holds every parameter whole, so
  its forward, backward and clipped gradient norm are the plain module's.
- ``fsdp_config.dtype = float32``: the actor's autocast (dp_actor.py:155) then keeps float32 (CPU
  autocast has no float32 mode and leaves the computation as it is). ``use_torch_compile`` off
  (a config switch of verl's): compiling ``entropy_from_logits`` changes no value.
- verl 0.7.1 has no platform registry; without CUDA ``verl.utils.device`` answers ``cpu``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from rlaudit.backends.launch import launch
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.peers import verl_megatron
from rlaudit.targets.peers.verl_layout import verl_tensors
from rlaudit.targets.peers.verl_train import OPTIMIZERS, rollout_proto

#: verl 0.7.1's own FSDP trainer defaults, inside the installed package
DEFAULT_CONFIG = "trainer/config/_generated_ppo_trainer.yaml"
_ACTOR = "actor_rollout_ref.actor"


def unsupported(cfg: Config) -> list[str]:
    """The settings this path does not map (empty: it runs): the Megatron path's."""
    return verl_megatron.unsupported(cfg)


def overrides(cfg: Config, *, rows: int) -> dict[str, Any]:
    """Dotted keys of verl 0.7.1's FSDP trainer config -> values for ``cfg``: the keys the two
    legacy actors share (verl_megatron.overrides: the mini-batch in rows, as the FSDP worker's
    __init__ normalises it too, fsdp_workers.py:249-250), the FSDP ones, and the optimizer."""
    keys = {k: v for k, v in verl_megatron.overrides(cfg, rows=rows).items()
            if ".megatron." not in k}
    o = cfg.actor.optim
    keys.update({
        f"{_ACTOR}.fsdp_config.dtype": "float32", f"{_ACTOR}.use_torch_compile": False,
        f"{_ACTOR}.use_remove_padding": False, f"{_ACTOR}.strategy": "fsdp",
        f"{_ACTOR}.optim.optimizer": OPTIMIZERS[o.name], f"{_ACTOR}.optim.lr": o.lr,
        f"{_ACTOR}.optim.weight_decay": o.weight_decay, f"{_ACTOR}.optim.betas": list(o.betas),
        f"{_ACTOR}.optim.override_optimizer_config": (
            {"eps": o.eps} if o.name == "adamw" else None),
        # rlaudit's grad_clip <= 0 is "no clipping"; the actor always clips
        # (clip_grad_norm_ at 0 zeroes the gradient): inf clips nothing and keeps the norm
        f"{_ACTOR}.grad_clip": cfg.actor.grad_clip if cfg.actor.grad_clip > 0 else float("inf"),
    })
    return keys


def train_steps(model_path, jobs: list[tuple[RolloutBatch, Config, int]], *, peer: str,
                device: str = "cpu", backend: str | None = None,
                timeout: float = 300.0) -> list[dict]:
    """Each ``(batch, config, steps)`` of ``jobs`` through verl's legacy FSDP actor, one rank
    (gloo on ``cpu``, NCCL on ``cuda`` unless ``backend`` says), a fresh model per job. Returns
    the rank's results (verl_megatron.train_job's layout)."""
    for _batch, cfg, _steps in jobs:
        bad = unsupported(cfg)
        if bad:
            raise NotImplementedError(f"verl's legacy FSDP actor path does not map: "
                                      f"{'; '.join(bad)}")
    request = {"peer": peer, "model": str(model_path), "device": device,
               "jobs": [{"steps": steps, "overrides": overrides(cfg, rows=len(batch)),
                         "tensors": verl_tensors(batch, width=cfg.rollout.response_length)}
                        for batch, cfg, steps in jobs]}
    return launch(train_rank, 1, args=(request,), timeout=timeout * len(jobs), device=device,
                  backend=backend)[0]


def train_rank(info, request: dict) -> list[dict]:
    """The rank body: verl 0.7.1 on the path, then every job."""
    peer = request["peer"]
    sys.path[:] = [p for p in sys.path if p == peer or Path(p).parent != Path(peer).parent]
    if peer not in sys.path:
        sys.path.insert(0, peer)
    return [train_job(request["model"], job, device=request["device"])
            for job in request["jobs"]]


def train_job(model_path: str, job: dict, *, device: str = "cpu") -> dict:
    """One job: per step the reduced metrics and the parameters after it by Hugging Face name;
    step 0's per-token tensors (verl_megatron.fit_step)."""
    # lazy: verl 0.7.1 is an optional peer, on the path only inside this rank
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.config import omega_conf_to_dataclass  # lazy: as above
    from verl.workers.actor.dp_actor import DataParallelPPOActor  # lazy: as above
    from verl.workers.config.optimizer import build_optimizer  # lazy: as above
    from verl.utils.torch_functional import get_constant_schedule_with_warmup  # lazy: as above
    from transformers import AutoModelForCausalLM  # lazy: only inside the rank

    cfg = verl_megatron.verl_config(job["overrides"], DEFAULT_CONFIG)
    actor_cfg = cfg.actor_rollout_ref.actor
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    optimizer = build_optimizer(model.parameters(), omega_conf_to_dataclass(actor_cfg.optim))
    scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0)
    actor = DataParallelPPOActor(config=omega_conf_to_dataclass(actor_cfg), actor_module=model,
                                 actor_optimizer=optimizer)
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config, trainer.use_legacy_worker_impl = cfg, "auto"
    trainer.actor_rollout_wg = LegacyFSDPGroup(actor, scheduler, pad_token_id=_pad_id(model))
    result: dict[str, Any] = {"metrics": [], "params": []}
    for step in range(job["steps"]):
        metrics, tokens = verl_megatron.fit_step(trainer, LogProbWorker(actor),
                                                 rollout_proto(job["tensors"], cfg))
        result["metrics"].append(metrics)
        if step == 0:
            result["tokens"] = tokens
        result["params"].append({k: v.detach().cpu().clone()
                                 for k, v in model.named_parameters()})
    return result


def _pad_id(model) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


class LogProbWorker:
    """The FSDP worker's ``compute_log_prob`` view of the actor for fit_step: the actor's
    ``compute_log_prob`` returns a dict (dp_actor.py:425), the Megatron actor's a tuple."""

    def __init__(self, actor):
        self.actor = actor

    def compute_log_prob(self, data, calculate_entropy: bool):
        out = self.actor.compute_log_prob(data=data, calculate_entropy=calculate_entropy)
        return out["log_probs"], out["entropys"], None


class LegacyFSDPGroup:
    """The worker group of a one-rank legacy FSDP actor: ``update_actor`` is the FSDP worker's
    (fsdp_workers.py:1007-1027) around the real actor and LR scheduler."""

    def __init__(self, actor, scheduler, *, pad_token_id: int):
        self.actor, self.scheduler, self.pad_token_id = actor, scheduler, pad_token_id

    def update_actor(self, data):
        # lazy: verl 0.7.1 is an optional peer, on the path only inside this rank
        from verl import DataProto
        data = data.to("cpu")
        data.meta_info.setdefault("pad_token_id", self.pad_token_id)
        metrics = self.actor.update_policy(data=data)
        lr = self.scheduler.get_last_lr()[0]
        metrics["actor/lr"] = lr.item() if torch.is_tensor(lr) else lr
        self.scheduler.step()
        return DataProto(meta_info={"metrics": metrics})
