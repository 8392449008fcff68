"""One real verl >= 0.9 training step on CPU: verl's FSDP actor worker, driven by verl's trainer.

    out = train_step(model_path, batch, cfg, dp=2, steps=2)   # in rlaudit's launcher, gloo
    out["metrics"][step]["actor/pg_loss"], out["params"][step], out["tokens"]["advantages"]

Each rank (:func:`train_rank`, started by :func:`rlaudit.backends.launch.launch` with the default
process group already up) selects the CPU platform (``verl_cpu``), builds verl's
``ActorRolloutRefWorker`` (role ``actor``) from verl's own generated default trainer config plus
the overrides :func:`verl_overrides` maps from rlaudit's :class:`~rlaudit.config.Config`, runs its
``init_model`` (FSDP2 engine), and then the post-generation part of ``RayPPOTrainer.fit`` in fit's
order (verl 0.9.1 trainer/ppo/ray_trainer.py:1586-1690): the trainer's own
``_compute_old_log_prob``; with a KL term (verl's ``need_reference_policy``) the trainer's
own ``_compute_ref_log_prob`` on a second ``ActorRolloutRefWorker`` of role ``ref`` (fit's
standalone reference worker group, Role.RefPolicy) loaded from the reference snapshot;
``apply_kl_penalty`` with the trainer's KL controller (``core_algos.get_kl_controller``) or
``token_level_rewards = token_level_scores``; ``compute_rollout_correction_and_add_to_batch``
when the batch has the rollout's log-probs (verl's rollout returns them by default);
``compute_advantage``, the trainer's own ``_update_actor`` (verl's ``ppo_loss`` adds the KL
loss, workers/utils/losses.py:132-142), ``reduce_metrics`` as fit reduces the actor's output,
and fit's ``compute_data_metrics``; ``steps`` times on the same batch with the same workers
(:func:`fit_step`). ``self`` of those trainer methods is a bare ``RayPPOTrainer`` with the
config and worker-group stand-ins (:class:`LocalWorkerGroup`). Nothing verl computes is
re-implemented.

Only what this step maps is accepted (:func:`unsupported`): no critic, vanilla / gspo / cispo
losses, KL as verl computes it, token / sequence rollout IS; float32 (a float64 config runs in
float32).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlaudit.backends.launch import launch
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.peers.registry import peers_dir
from rlaudit.targets.peers.verl_kl import (kl_refusals, reference_overrides, reference_policy,
                                           rollout_correction_overrides, shape_rewards)
from rlaudit.targets.peers.verl_layout import to_batch_width, verl_tensors
from rlaudit.update.collectives import full_params

#: verl's own defaults, inside the installed package
DEFAULT_CONFIG = "trainer/config/_generated_ppo_trainer.yaml"
#: rlaudit estimator -> (verl estimator, norm_adv_by_std_in_grpo or None = rlaudit's setting)
ESTIMATORS = {"grpo": ("grpo", None), "drgrpo": ("grpo", False), "rloo": ("rloo", None),
              "reinforce_plus_plus": ("reinforce_plus_plus", None),
              "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", None)}
OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD"}
_FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def unsupported(cfg: Config) -> list[str]:
    """The settings of ``cfg`` this step does not map to verl (empty: it runs). float64 runs in
    float32, verl's widest training dtype (verl/utils/torch_dtypes.py:61-69): the adapter
    declares ``train_precision = "float32"``, so comparisons use its tolerances."""
    a, act, t = cfg.algorithm, cfg.actor, cfg.trainer
    checks = {
        f"algorithm.adv_estimator={a.adv_estimator!r} (critic/GAE not mapped)":
            a.adv_estimator not in ESTIMATORS,
        f"actor.loss_mode={act.loss_mode!r}": act.loss_mode not in ("vanilla", "gspo", "cispo"),
        "actor.gspo_gradient=sequence (verl differentiates GSPO per token)":
            act.gspo_gradient != "per-token",
        "actor.loss_token_denominator=batch-mean": act.loss_token_denominator != "minibatch",
        # agg_loss's L is then the micro-batch's padded width (core_algos.py:1190-1192)
        "seq-mean-token-sum-norm without actor.loss_scale_factor":
            act.loss_agg_mode == "seq-mean-token-sum-norm" and act.loss_scale_factor is None,
        f"algorithm.grpo_std_eps={a.grpo_std_eps} (verl's is 1e-6)": a.grpo_std_eps != 1e-6,
        f"trainer.dtype={t.dtype!r} (verl's FSDP engine trains in fp32 at most; bf16 is not "
        f"this adapter's declared precision)": t.dtype not in ("float32", "float64"),
        "reward.overlong_buffer": cfg.reward.overlong_buffer.enable,
        "actor.shuffle (verl shuffles with its own seed per rank)": act.shuffle,
        "trainer.balance_batch (a trainer method bound to live worker groups)": t.balance_batch,
        "padding micro-batches (trainer.extra_padding_microbatches)":
            t.extra_padding_microbatches > 0,
        "actor.context_parallel_size > 1": act.context_parallel_size > 1,
        "distillation": act.distill.enable,
        # verl asserts it (workers/engine/utils.py:125)
        "fixed micro-batches that do not divide the mini-batch (ppo_mini_batch_size x "
        "rollout.n % ppo_micro_batch_size_per_gpu)": not act.use_dynamic_bsz and (
            act.ppo_mini_batch_size * cfg.rollout.n) % act.ppo_micro_batch_size_per_gpu != 0,
    }
    checks.update(kl_refusals(cfg))
    return [why for why, bad in checks.items() if bad]


def mini_rows(cfg: Config, rows: int) -> int:
    """Rows per optimizer step as :func:`verl_overrides` sets them: ``ppo_mini_batch_size``
    prompts of ``rollout.n`` rows, at most the whole batch (a batch smaller than a mini-batch
    is one)."""
    n = cfg.rollout.n
    return min(cfg.actor.ppo_mini_batch_size, max(rows // n, 1)) * n


def rows_unsupported(cfg: Config, rows: int, dp: int = 1) -> str:
    """Why verl cannot cut ``rows`` into ``cfg``'s mini-batches over ``dp`` ranks ("" if it
    can): its trainer checks the batch is whole mini-batches (tensordict_utils.make_iterator
    asserts it, utils/tensordict_utils.py:588)."""
    mini = mini_rows(cfg, rows)
    if rows % mini or mini % dp:
        return (f"{rows} rows do not cut into mini-batches of {mini} rows over {dp} rank(s) "
                f"(verl's make_iterator asserts it)")
    return ""


def verl_overrides(cfg: Config, *, model_path: str, dp: int, rows: int | None = None,
                   device: str = "cpu") -> dict[str, Any]:
    """Dotted keys of verl's trainer config -> values: rlaudit's ``cfg`` in verl's names, plus the
    CPU set (verl_cpu's docstring says why each). ``rows``: the batch's; a mini-batch is at most
    the whole batch (verl's config check keeps ppo_mini_batch_size <= data.train_batch_size)."""
    act, a = cfg.actor, cfg.algorithm
    mini = act.ppo_mini_batch_size
    if rows is not None and rows >= cfg.rollout.n:
        mini = min(mini, rows // cfg.rollout.n)
    estimator, norm = ESTIMATORS[a.adv_estimator]
    ar, actor = "actor_rollout_ref", "actor_rollout_ref.actor"
    low = act.clip_ratio if act.clip_ratio_low is None else act.clip_ratio_low
    high = act.clip_ratio if act.clip_ratio_high is None else act.clip_ratio_high
    micro = act.ppo_micro_batch_size_per_gpu
    return {
        "trainer.device": device, "trainer.n_gpus_per_node": dp, "trainer.nnodes": 1,
        f"{ar}.model.path": str(model_path),
        f"{ar}.model.use_remove_padding": True,
        f"{ar}.model.enable_gradient_checkpointing": False,
        f"{ar}.model.override_config": {"attn_implementation": "sdpa"},
        f"{actor}.strategy": "fsdp2", f"{actor}.fsdp_config.strategy": "fsdp2",
        f"{actor}.fsdp_config.dtype": "float32", f"{actor}.fsdp_config.model_dtype": "fp32",
        f"{actor}.fsdp_config.mixed_precision": dict(_FP32),
        f"{actor}.fsdp_config.use_torch_compile": False, f"{actor}.use_torch_compile": False,
        f"{actor}.ppo_mini_batch_size": mini,
        f"{actor}.ppo_micro_batch_size_per_gpu": micro,
        f"{actor}.use_dynamic_bsz": act.use_dynamic_bsz,
        f"{actor}.ppo_max_token_len_per_gpu": act.ppo_max_token_len_per_gpu,
        f"{actor}.ppo_epochs": act.ppo_epochs, f"{actor}.shuffle": False,
        f"{actor}.clip_ratio": act.clip_ratio, f"{actor}.clip_ratio_low": low,
        f"{actor}.clip_ratio_high": high, f"{actor}.clip_ratio_c": act.clip_ratio_c,
        f"{actor}.loss_agg_mode": act.loss_agg_mode,
        f"{actor}.loss_scale_factor": act.loss_scale_factor,
        f"{actor}.policy_loss.loss_mode": act.loss_mode,
        f"{actor}.entropy_coeff": act.entropy_coeff,
        f"{actor}.calculate_entropy": act.calculate_entropy,
        f"{actor}.use_kl_loss": act.use_kl_loss, f"{actor}.kl_loss_type": act.kl_loss_type,
        f"{actor}.kl_loss_coef": act.kl_loss_coef,
        f"{actor}.optim.optimizer": OPTIMIZERS[act.optim.name],
        f"{actor}.optim.lr": act.optim.lr, f"{actor}.optim.weight_decay": act.optim.weight_decay,
        f"{actor}.optim.betas": list(act.optim.betas),
        # rlaudit's grad_clip <= 0 is "no clipping"; verl always clips (clip_grad_norm_ with
        # max_norm 0 zeroes the gradient, fsdp/transformer_impl.py:808): inf clips nothing
        f"{actor}.optim.clip_grad": act.grad_clip if act.grad_clip > 0 else float("inf"),
        f"{actor}.optim.override_optimizer_config": (
            {"eps": act.optim.eps} if act.optim.name == "adamw" else None),
        f"{ar}.rollout.n": cfg.rollout.n, f"{ar}.rollout.temperature": cfg.rollout.temperature,
        f"{ar}.rollout.log_prob_micro_batch_size_per_gpu": micro,
        "algorithm.adv_estimator": estimator, "algorithm.gamma": a.gamma, "algorithm.lam": a.lam,
        "algorithm.norm_adv_by_std_in_grpo": a.norm_adv_by_std_in_grpo if norm is None else norm,
        "algorithm.use_kl_in_reward": a.use_kl_in_reward, "algorithm.kl_penalty": a.kl_penalty,
        # rlaudit's KL-in-reward coefficient is constant: verl's fixed controller
        "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": a.kl_coef,
        **reference_overrides(micro, device),
        **rollout_correction_overrides(cfg),
    }


def train_step(model_path, batch: RolloutBatch, cfg: Config, *, dp: int = 1, steps: int = 1,
               version: str = "0.9.1", peer: str | None = None, params: bool = True,
               device: str = "cpu", backend: str | None = None, timeout: float = 300.0,
               ref_model_path=None) -> dict:
    """``steps`` training steps of verl ``version`` (installed under the peers directory; or the
    one whose package lies in ``peer``) on ``batch`` over ``dp`` ranks (gloo on ``cpu``, NCCL on
    ``cuda``, or ``backend``). ``ref_model_path``: the reference policy's snapshot (None: the
    model's, as verl's reference is). Returns rank 0's result (:func:`train_rank`)."""
    return train_steps(model_path, [(batch, cfg, steps)], dp=dp, version=version, peer=peer,
                       params=params, device=device, backend=backend, timeout=timeout,
                       ref_model_path=ref_model_path)[0]


def train_steps(model_path, jobs: list[tuple[RolloutBatch, Config, int]], *, dp: int = 1,
                version: str = "0.9.1", peer: str | None = None, params: bool = True,
                device: str = "cpu", backend: str | None = None,
                timeout: float = 300.0, ref_model_path=None, rank=None) -> list[dict]:
    """:func:`train_step` for each ``(batch, config, steps)`` of ``jobs``, one after the other in
    one group of ranks (verl imported once; fresh workers per job). ``timeout`` is per job.
    ``rank``: the rank body, ``fn(info, request)`` (default :func:`train_rank`)."""
    for _batch, cfg, _steps in jobs:
        bad = unsupported(cfg)
        if bad:
            raise NotImplementedError(f"verl train_step does not map: {'; '.join(bad)}")
    ref = str(ref_model_path or model_path)
    request = {"peer": peer or str(peers_dir() / f"verl-{version}"), "params": params,
               "device": device,
               "jobs": [{"steps": steps, "ref_model": ref,
                         "tensors": verl_tensors(batch, width=cfg.rollout.response_length),
                         "overrides": verl_overrides(cfg, model_path=str(model_path), dp=dp,
                                                     rows=len(batch), device=device)}
                        for batch, cfg, steps in jobs]}
    # env: spawned ranks (never forked from a parent that may have resolved another platform)
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        env["VERL_PLATFORM"] = "cpu"
    return launch(rank or train_rank, dp, args=(request,), env=env,
                  timeout=timeout * len(jobs), device=device, backend=backend)[0]


def train_rank(info, request: dict) -> list[dict]:
    """The rank body (module docstring): per job, a fresh actor worker trained ``steps`` times
    on the job's batch (:func:`train_job`)."""
    peer = request["peer"]
    # a rank spawned from a process that activated other peers (a test session that ran TRL's or
    # SkyRL's adapter) inherits their directories on sys.path, and verl imports trl whenever one is
    # importable (models/transformers/monkey_patch.py:352): this rank sees verl's directory alone,
    # as a verl install would
    sys.path[:] = [p for p in sys.path if p == peer or Path(p).parent != Path(peer).parent]
    if peer not in sys.path:
        sys.path.insert(0, peer)
    if request["device"] == "cpu":
        # lazy: verl is an optional peer; the platform must be selected before verl.trainer
        from rlaudit.targets.peers import verl_cpu
        verl_cpu.select()
    return [train_job(info, job, params=request["params"]) for job in request["jobs"]]


def train_job(info, job: dict, *, params: bool, config_file: str = DEFAULT_CONFIG) -> dict:
    """One job, ``job["steps"]`` times on the same batch: per step the metrics (verl's names,
    reduced as fit reduces them) and (rank 0) the parameters after it by Hugging Face name; the
    per-token tensors step 0 held (old log-probs and entropy of the initial policy, scores,
    rewards, advantages, returns). ``config_file``: verl's generated trainer config the
    overrides apply to (inside the installed package)."""
    # lazy: verl is an optional peer, imported after the platform is selected (train_rank)
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker  # lazy: as above

    cfg = _verl_config(job["overrides"], config_file)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = cfg
    trainer.actor_rollout_wg = LocalWorkerGroup(worker, info.rank, info.world_size)
    ref = reference_policy(trainer, job.get("ref_model"))
    if ref is not None:
        trainer.ref_policy_wg = LocalWorkerGroup(ref, info.rank, info.world_size, mesh="ref")
    result: dict[str, Any] = {"metrics": [], "raw_metrics": [], "params": []}
    for step in range(job["steps"]):
        metrics, raw, tokens = fit_step(trainer, rollout_proto(job["tensors"], cfg))
        result["metrics"].append(metrics)
        result["raw_metrics"].append(raw)
        if step == 0:
            result["tokens"] = tokens
        state = full_params(worker.actor.engine.module) if params else None
        if info.rank == 0 and state is not None:
            result["params"].append(state)
    return result


def fit_step(trainer, batch) -> tuple[dict, dict, dict]:
    """The post-generation part of one ``RayPPOTrainer.fit`` iteration (verl 0.9.1
    ray_trainer.py:1586-1772) with the trainer's own methods: old log-probs (with the initial
    policy's entropy, which that pass always computes), reference log-probs when a KL term needs
    them (1618-1622), rewards and rollout correction (:func:`shape_rewards`),
    ``compute_advantage``, ``_update_actor``, ``reduce_metrics`` of the actor's output, and
    ``compute_data_metrics`` (1772). Returns (reduced metrics, verl's raw lists, step tensors).
    fit's own ``actor/entropy`` (the old-log-prob pass's entropy, 1590) is left out: rlaudit's
    ``actor/entropy`` is the update's entropy, verl's ``actor/entropy_loss`` (verl_step)."""
    # lazy: verl is an optional peer, imported after the platform is selected
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage  # lazy: as above
    from verl.utils.metric import reduce_metrics  # lazy: as above

    cfg = trainer.config
    old, _mfu = RayPPOTrainer._compute_old_log_prob(trainer, batch)
    entropys = old.batch.pop("entropys")
    batch = batch.union(old)
    if trainer.use_reference_policy:
        batch = batch.union(RayPPOTrainer._compute_ref_log_prob(trainer, batch))
    batch, metrics = shape_rewards(trainer, batch)
    alg = cfg.algorithm
    batch = compute_advantage(batch, adv_estimator=alg.adv_estimator, gamma=alg.gamma,
                              lam=alg.lam, num_repeat=cfg.actor_rollout_ref.rollout.n,
                              norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, config=alg)
    out = RayPPOTrainer._update_actor(trainer, batch)
    raw = out.meta_info["metrics"]
    metrics.update({k: float(v) for k, v in reduce_metrics(raw).items()})
    metrics.update(compute_data_metrics(batch=batch, use_critic=False))
    kept = ("old_log_probs", "advantages", "returns", "token_level_scores",
            "token_level_rewards", "ref_log_prob", "rollout_is_weights")
    tokens = {k: batch.batch[k].detach().clone() for k in kept if k in batch.batch.keys()}
    tokens["entropys"] = entropys.detach().clone()
    return metrics, {k: _plain(v) for k, v in raw.items()}, tokens


def _verl_config(overrides: dict[str, Any], config_file: str = DEFAULT_CONFIG):
    # lazy: verl (and omegaconf, from its peer directory) only exist inside a verl rank
    import verl
    from omegaconf import OmegaConf  # lazy: from verl's peer directory
    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), config_file))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def rollout_proto(tensors: dict[str, torch.Tensor], cfg):
    """rlaudit's batch as verl's rollout hands it to the trainer: verl's layout (verl_tensors),
    int64 response mask, the score on the last response token, string uids, and the sampler's
    ``rollout_log_probs`` (0 past each response) when the batch has them and verl's rollout
    computes them (``rollout.calculate_log_probs``, on in verl's defaults)."""
    # lazy: verl is an optional peer
    from verl import DataProto
    mask = tensors["response_mask"]
    last = (tensors["response_lengths"] - 1).clamp(min=0)
    scores = torch.zeros(mask.shape, dtype=torch.float32)
    scores.scatter_(1, last.unsqueeze(1), tensors["scores"].float().unsqueeze(1))
    keep = ("input_ids", "attention_mask", "position_ids", "responses")
    data = {k: tensors[k] for k in keep}
    if cfg.actor_rollout_ref.rollout.calculate_log_probs and "rollout_log_probs" in tensors:
        data["rollout_log_probs"] = torch.where(
            mask.bool(), to_batch_width(tensors["rollout_log_probs"], mask.shape[1]).float(), 0.0)
    data.update(prompts=tensors["input_ids"][:, :tensors["prompt_ids"].shape[1]],
                response_mask=mask.to(torch.int64), token_level_scores=scores)
    uid = np.array([str(int(u)) for u in tensors["uid"]], dtype=object)
    proto = DataProto.from_dict(tensors=data, non_tensors={"uid": uid})
    # as fit() sets them (ray_trainer.py:1479,1553): the log-prob path reads both
    proto.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
    proto.meta_info["global_token_num"] = data["attention_mask"].sum(-1).tolist()
    return proto


class LocalWorkerGroup:
    """The Ray worker group as seen from one rank, dispatching and collecting as verl's nd
    dispatch does (single_controller/base/decorator.py: dispatch_lazy_compute_data_proto,
    collect_lazy_compute_data_proto) from what the worker registered for its mesh (``actor``,
    or ``ref`` for the reference worker): the batch cut into as many equal contiguous chunks as
    the mesh has dp ranks, this rank computing the chunk of its dp rank, and the outputs of the
    collecting ranks (per dp rank, the one holding the outputs: the last pipeline stage's on
    Megatron, every rank on FSDP) concatenated in rank order, on every rank."""

    def __init__(self, worker, rank: int, world: int, mesh: str = "actor"):
        self.worker, self.rank, self.world, self.mesh = worker, rank, world, mesh
        self.layout: tuple[int, int, list[int]] | None = None

    def mesh_layout(self) -> tuple[int, int, list[int]]:
        """(this rank's dp rank, the dp size, the collecting ranks) of the mesh."""
        if self.layout is None:
            mine = (self.worker._query_dispatch_info(self.mesh),
                    bool(self.worker.query_collect_info(self.mesh)))
            everyone = [mine]
            if self.world > 1:
                everyone = [None] * self.world
                torch.distributed.all_gather_object(everyone, mine)
            self.layout = (mine[0], max(d for d, _ in everyone) + 1,
                           [r for r, (_, collect) in enumerate(everyone) if collect])
        return self.layout

    def _chunk(self, td):
        # lazy: verl is an optional peer
        from verl.utils import tensordict_utils as tu
        dp_rank, dp_size, _ = self.mesh_layout()
        return tu.chunk_tensordict(td, dp_size)[dp_rank] if dp_size > 1 else td

    def _collected(self, out) -> list:
        if self.world == 1:
            return [out]
        outs = [None] * self.world
        torch.distributed.all_gather_object(outs, out)
        return [outs[r] for r in self.mesh_layout()[2]]

    def compute_log_prob(self, td):
        return self._gathered(self.worker.compute_log_prob, td)

    def compute_ref_log_prob(self, td):
        return self._gathered(self.worker.compute_ref_log_prob, td)

    def _gathered(self, method, td):
        # lazy: verl is an optional peer
        from verl.utils import tensordict_utils as tu
        outs = self._collected(method(self._chunk(td)))
        if len(outs) == 1:
            return outs[0]
        metrics = tu.get(outs[0], "metrics")
        cat = tu.concat_tensordict([o.select(*[k for k in o.keys() if k != "metrics"])
                                    for o in outs])
        tu.assign_non_tensor(cat, metrics=metrics)
        return cat

    def update_actor(self, td):
        # the metrics are all-gathered over dp inside the worker: the first collecting rank's
        # output is the result
        return self._collected(self.worker.update_actor(self._chunk(td)))[0]


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [float(v) for v in value]
    return float(value)
