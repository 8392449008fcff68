"""``train_step`` of ``--target skyrl``: SkyRL 0.4's own PPO update on CPU, in a rank of rlaudit's
launcher (gloo, float32).

    out = train_steps(model_path, [(batch, cfg, steps)], version="0.4.0")[0]
    out["metrics"][step]["actor/pg_loss"], out["params"][step], out["tokens"]["advantages"]

The rank (:func:`train_rank`) activates SkyRL's peer directory and builds SkyRL's
``FSDPPolicyWorkerBase`` -- the class ``fsdp_worker.PolicyWorker`` wraps in ``ray.remote`` --
directly, from SkyRL's own ``SkyRLTrainConfig`` (:func:`skyrl_settings`: rlaudit's
:class:`~rlaudit.config.Config` in SkyRL's names); its ``init_model`` loads the model through
SkyRL's ``HFModelWrapper`` and shards it with SkyRL's ``FSDPStrategy`` (FSDP2, fp32 mixed
precision). The CUDA calls SkyRL makes by name answer for the CPU (skyrl_cpu.py, each listed with
its file:line). Each step then runs what ``RayPPOTrainer.train`` runs after generation, with the
trainer's own methods on a bare trainer (its config, a tokenizer carrying the pad id and
:class:`LocalDispatch`, the worker dispatch of one in-process rank; :func:`fit_step` says why
``postprocess_generator_output`` is not among them): ``convert_to_training_input``,
``fwd_logprobs_values_reward`` (the old log-probs, per mini-batch),
``compute_advantages_and_returns`` and
``train_critic_and_policy`` (advantages scaled per mini-batch for the loss reduction, the
worker's ``forward_backward`` -- micro-batches, the registered policy loss, gradient
accumulation -- and ``optim_step`` per mini-batch, over ``update_epochs_per_batch``; metrics
reduced by SkyRL's ``reduce_metrics``). Nothing SkyRL computes is re-implemented.

The optimizer: SkyRL's FSDP strategy builds ``torch.optim.AdamW`` only
(distributed/fsdp_strategy.py:263-268, no ``eps``: torch's 1e-8). An SGD config gets
``torch.optim.SGD`` over the same FSDP parameters in the worker's ``optimizer`` attribute, with
the scheduler rebuilt by SkyRL's own call (``get_scheduler``); the strategy's
``optimizer_step`` (clip, step, scheduler, zero_grad) runs unchanged (:func:`use_sgd`).

Only what maps is accepted (:func:`unsupported`, :func:`rows_unsupported`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import SimpleNamespace
from typing import Any

import torch

from rlaudit.backends.base import ReplayRequest, VariantRun
from rlaudit.backends.launch.pool import run_ranks
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.contract.adapter import TrainStepOutput
from rlaudit.targets.peers import skyrl_cpu
from rlaudit.targets.peers.openrlhf_import import flash_attn_placeholders
from rlaudit.targets.peers.registry import activate
from rlaudit.targets.peers.skyrl_base import import_skyrl, shift
from rlaudit.targets.run.target_backend import replayed_runs
from rlaudit.update.collectives import full_params
from rlaudit.targets.peers.step_config import unmapped_layout

#: rlaudit estimator -> (SkyRL advantage_estimator, grpo_norm_by_std forced or None)
ESTIMATORS = {"grpo": ("grpo", None), "drgrpo": ("grpo", False), "rloo": ("rloo", None)}
#: rlaudit loss mode -> SkyRL policy_loss_type (rlaudit's vanilla applies the dual clip)
LOSS_MODES = {"vanilla": "dual_clip"}
#: rlaudit loss_agg_mode -> SkyRL loss_reduction
LOSS_REDUCTIONS = {"token-mean": "token_mean", "seq-mean-token-mean": "sequence_mean"}
#: torch's AdamW default, which SkyRL's strategy leaves in place (it passes no eps)
ADAMW_EPS = 1e-8
#: SkyRL's metric (``train_critic_and_policy``'s ``policy/`` keys) -> rlaudit catalogue name.
#: ``policy_loss`` is the mini-batch loss on pre-scaled advantages, summed over micro-batches
#: (worker_utils.reduce_metrics(sum_loss_metrics=True)) then averaged over optimizer steps
METRICS = {
    "policy/policy_loss": "actor/pg_loss",
    "policy/loss_metrics/clip_ratio": "actor/pg_clipfrac",
    "policy/grad_norm": "actor/grad_norm",
    "policy/policy_lr": "actor/lr",
}
# Not mapped: policy_entropy, the entropy the update computes (worker.py:1215-1217), is a token
# mean over each micro-batch (masked_mean over loss_mask) whatever loss_reduction says, where
# rlaudit's actor/entropy is aggregated with actor.loss_agg_mode (they differ under
# seq-mean-token-mean: 2.542 vs 2.231 on the built-in rollout)


#: what SkyRL's worker and trainer import beyond the stage adapter's modules
#: (requirements/peers/skyrl-0.4.0.txt says which module needs which)
TRAINER_IMPORTS = ("peft", "accelerate", "orjson", "datasets", "torchdata")


def missing_imports() -> str:
    """Why SkyRL's worker cannot be imported here ("" when it can): the packages of
    :data:`TRAINER_IMPORTS` not found (an older ``make peers`` did not install them)."""
    gone = [m for m in TRAINER_IMPORTS if importlib.util.find_spec(m) is None]
    if not gone:
        return ""
    return (f"{', '.join(gone)} missing from the SkyRL peer (its FSDP worker and trainer import "
            f"them): re-run `make peers`")


def unsupported(cfg: Config) -> list[str]:
    """The settings of ``cfg`` SkyRL's step is not mapped for (empty: it runs)."""
    a, act, t = cfg.algorithm, cfg.actor, cfg.trainer
    rc = act.rollout_correction
    checks = {
        f"algorithm.adv_estimator={a.adv_estimator!r} (mapped: {sorted(ESTIMATORS)}; no critic "
        f"worker)": a.adv_estimator not in ESTIMATORS,
        "KL (actor.use_kl_loss / algorithm.use_kl_in_reward: no reference worker)":
            act.use_kl_loss or a.use_kl_in_reward,
        "rollout correction (actor.rollout_correction)":
            rc.rollout_is is not None or rc.use_rollout_kl_loss,
        f"actor.loss_mode={act.loss_mode!r} (vanilla is mapped)": act.loss_mode not in LOSS_MODES,
        f"actor.loss_agg_mode={act.loss_agg_mode!r} (mapped: {sorted(LOSS_REDUCTIONS)})":
            act.loss_agg_mode not in LOSS_REDUCTIONS,
        "actor.loss_token_denominator=batch-mean": act.loss_token_denominator != "minibatch",
        "actor.loss_scale_factor": act.loss_scale_factor is not None,
        f"actor.entropy_coeff={act.entropy_coeff} (SkyRL's entropy term is a micro-batch mean)":
            act.entropy_coeff != 0,
        f"actor.optim.name={act.optim.name!r}": act.optim.name not in ("adamw", "sgd"),
        f"actor.optim.eps={act.optim.eps} (SkyRL's AdamW keeps torch's {ADAMW_EPS})":
            act.optim.name == "adamw" and act.optim.eps != ADAMW_EPS,
        f"algorithm.grpo_std_eps={a.grpo_std_eps} (SkyRL's is 1e-6)": a.grpo_std_eps != 1e-6,
        "rloo with rollout.n=1 (SkyRL gives a singleton advantage 0: rloo-singleton-zero)":
            a.adv_estimator == "rloo" and cfg.rollout.n == 1,
        f"trainer.dtype={t.dtype!r} (this step runs SkyRL in float32)":
            t.dtype not in ("float32", "float64"),
        "actor.use_dynamic_bsz (SkyRL's token-based micro-batches are not mapped)":
            act.use_dynamic_bsz,
        **unmapped_layout(cfg),
        "algorithm.filter_groups (DAPO's group filter)": a.filter_groups.enable,
    }
    return [why for why, bad in checks.items() if bad]


def rows_unsupported(cfg: Config, batch: RolloutBatch) -> str:
    """Why SkyRL's trainer cannot take ``batch`` as ``cfg`` says ("" if it can)."""
    n, rows = cfg.rollout.n, len(batch)
    uid = batch["uid"]
    if rows % n or bool((uid.view(-1, n) != uid.view(-1, n)[:, :1]).any()):
        return (f"{rows} rows are not consecutive groups of rollout.n={n} (SkyRL cuts "
                f"mini-batches by prompt, compute_prompt_mini_batch_boundaries)")
    if (rows // n) % cfg.actor.ppo_mini_batch_size:
        return (f"{rows // n} prompts do not cut into mini-batches of "
                f"{cfg.actor.ppo_mini_batch_size}")
    empty = (batch["response_lengths"] == 0) & (batch["scores"] != 0)
    if bool(empty.any()):
        return ("a row with an empty response has a score: SkyRL puts a response's reward on "
                "its last token (trainer.py, postprocess_generator_output)")
    last = (batch["response_lengths"] - 1).clamp(min=0).unsqueeze(1)
    held = batch["response_mask"].bool().gather(1, last).squeeze(1) | (batch["response_lengths"] == 0)
    if cfg.algorithm.outcome_score == "masked-sum" and not bool(held.all()):
        return ("a response's last token (where its score is) is outside response_mask: SkyRL "
                "sums rewards over every position (algorithm.outcome_score=unmasked-sum)")
    return ""


def skyrl_settings(cfg: Config, *, model_path: str, rows: int) -> dict[str, Any]:
    """Dotted ``SkyRLTrainConfig`` keys -> values for ``cfg`` on ``rows`` rows. float32 FSDP
    (fp32 mixed precision; SkyRL's default is bf16 params), sdpa attention, no padding removal
    (it needs flash-attention 2), no gradient checkpointing, no critic or reference model."""
    a, act = cfg.algorithm, cfg.actor
    estimator, norm = ESTIMATORS[a.adv_estimator]
    low = act.clip_ratio if act.clip_ratio_low is None else act.clip_ratio_low
    high = act.clip_ratio if act.clip_ratio_high is None else act.clip_ratio_high
    tr, alg, opt = "trainer", "trainer.algorithm", "trainer.policy.optimizer_config"
    return {
        f"{tr}.strategy": "fsdp", f"{tr}.flash_attn": False, f"{tr}.bf16": False,
        f"{tr}.remove_microbatch_padding": False, f"{tr}.gradient_checkpointing": False,
        f"{tr}.seed": int(cfg.trainer.seed), f"{tr}.policy.model.path": str(model_path),
        f"{tr}.policy.fsdp_config.mixed_precision": dict(
            param_dtype="fp32", reduce_dtype="fp32", buffer_dtype="fp32"),
        f"{tr}.critic.model.path": None, f"{tr}.ref.model.path": None,
        f"{tr}.train_batch_size": rows // cfg.rollout.n,
        f"{tr}.policy_mini_batch_size": act.ppo_mini_batch_size,
        f"{tr}.micro_train_batch_size_per_gpu": act.ppo_micro_batch_size_per_gpu,
        f"{tr}.micro_forward_batch_size_per_gpu": act.ppo_micro_batch_size_per_gpu,
        f"{tr}.update_epochs_per_batch": act.ppo_epochs,
        f"{opt}.lr": act.optim.lr, f"{opt}.weight_decay": act.optim.weight_decay,
        f"{opt}.adam_betas": list(act.optim.betas),
        # rlaudit's grad_clip <= 0 is "no clipping"; SkyRL's max_grad_norm <= 0 skips the norm
        # too (fsdp_strategy.py:165, grad_norm None, not logged): inf clips nothing, logs it
        f"{opt}.max_grad_norm": act.grad_clip if act.grad_clip > 0 else float("inf"),
        f"{opt}.offload_after_step": False, f"{opt}.scheduler": "constant_with_warmup",
        f"{opt}.num_warmup_steps": 0,
        f"{alg}.advantage_estimator": estimator,
        f"{alg}.grpo_norm_by_std": a.norm_adv_by_std_in_grpo if norm is None else norm,
        f"{alg}.gamma": a.gamma, f"{alg}.lambd": a.lam,
        f"{alg}.use_kl_loss": False, f"{alg}.use_kl_in_reward": False,
        f"{alg}.use_entropy_loss": False,
        f"{alg}.policy_loss_type": LOSS_MODES[act.loss_mode],
        f"{alg}.loss_reduction": LOSS_REDUCTIONS[act.loss_agg_mode],
        f"{alg}.eps_clip_low": float(low), f"{alg}.eps_clip_high": float(high),
        f"{alg}.clip_ratio_c": float(act.clip_ratio_c),
        f"{alg}.temperature": float(cfg.rollout.temperature),
        "generator.n_samples_per_prompt": cfg.rollout.n,
    }


def generator_output(batch: RolloutBatch) -> tuple[dict, list[str]]:
    """rlaudit's batch as SkyRL's generator hands it to the trainer: token ids per row, the loss
    mask, and token-level rewards (the score on the last response token, as
    ``postprocess_generator_output`` puts a response-level reward; an empty response has none,
    :func:`rows_unsupported`); string uids."""
    t = batch.tensors
    pl, rl = t["prompt_lengths"].tolist(), t["response_lengths"].tolist()
    rewards = []
    for i, r in enumerate(rl):
        row = [0.0] * r
        if r:
            row[-1] = float(t["scores"][i])
        rewards.append(row)
    out = {"prompt_token_ids": [t["prompt_ids"][i, :p].tolist() for i, p in enumerate(pl)],
           "response_ids": [t["response_ids"][i, :r].tolist() for i, r in enumerate(rl)],
           "loss_masks": [t["response_mask"][i, :r].long().tolist() for i, r in enumerate(rl)],
           "rewards": rewards, "stop_reasons": ["stop"] * len(rl)}
    return out, [str(int(u)) for u in t["uid"].tolist()]


def train_steps(model_path, jobs: list[tuple[RolloutBatch, Config, int]], *, version: str,
                timeout: float = 300.0) -> list[dict]:
    """``(batch, config, steps)`` jobs through SkyRL's step, one after the other in one rank
    (a fresh worker per job). Inside :func:`~rlaudit.backends.launch.pool.warm_pools` (``rlaudit
    run``) the rank is the warm pool ``skyrl``'s: SkyRL's imports (tens of seconds) are paid once
    for the stage checks' and the scenarios' calls."""
    for batch, cfg, _steps in jobs:
        bad = unsupported(cfg) + list(filter(None, [rows_unsupported(cfg, batch)]))
        if bad:
            raise NotImplementedError(f"SkyRL train_step does not map: {'; '.join(bad)}")
    request = {"version": version,
               "jobs": [{"steps": steps, "rollout": generator_output(batch),
                         "sgd": cfg.actor.optim.name == "sgd",
                         "settings": skyrl_settings(cfg, model_path=str(model_path),
                                                    rows=len(batch))}
                        for batch, cfg, steps in jobs]}
    return run_ranks(train_rank, 1, pool="skyrl", args=(request,), timeout=timeout * len(jobs),
                     env={"TOKENIZERS_PARALLELISM": "false", "SKYRL_LOG_FILE": ""})[0]


def train_rank(info, request: dict) -> list[dict]:
    """The rank body: SkyRL's peer directory first on ``sys.path``, its modules imported and
    each job's config built (``SkyRLTrainConfig.__post_init__`` imports vLLM where it is
    installed, which compiles with torch at import: before any torch entry point is stood in
    for), then each job with the CUDA calls answered for the CPU (skyrl_cpu)."""
    activate("skyrl", request["version"])
    mods = import_worker()
    cfgs = [skyrl_config(mods, job["settings"]) for job in request["jobs"]]
    with skyrl_cpu.cuda_as_cpu(mods.fsdp_utils):
        return [train_job(info, job, cfg, mods) for job, cfg in zip(request["jobs"], cfgs)]


def import_worker() -> SimpleNamespace:
    """SkyRL's worker, trainer and config modules (skyrl_base's 3.11 shims first; flash-attn
    placeholders while the worker module imports, skyrl_cpu's docstring says why)."""
    import_skyrl(trainer=True)
    names = {"fsdp_worker": "backends.skyrl_train.workers.fsdp.fsdp_worker",
             "fsdp_utils": "backends.skyrl_train.distributed.fsdp_utils",
             "dispatch": "backends.skyrl_train.distributed.dispatch",
             "trainer": "train.trainer", "config": "train.config"}
    with flash_attn_placeholders():
        return SimpleNamespace(**{k: importlib.import_module(f"skyrl.{v}")
                                  for k, v in names.items()})


def skyrl_config(mods, settings: dict[str, Any]):
    """SkyRL's own ``SkyRLTrainConfig`` (its defaults) with ``settings`` applied."""
    cfg = mods.config.SkyRLTrainConfig()
    for key, value in settings.items():
        *path, leaf = key.split(".")
        owner = cfg
        for part in path:
            owner = getattr(owner, part)
        if leaf == "mixed_precision":
            value = mods.config.MixedPrecisionConfig(**value)
        setattr(owner, leaf, value)
    return cfg


def build_worker(mods, cfg, model_path: str):
    """SkyRL's FSDP policy worker (the class under ``ray.remote``) on this rank, initialised as
    its actor group does: process group (already up: gloo) and device mesh, then
    ``init_model`` (SkyRL's HF loading, FSDP2 sharding, AdamW and LR scheduler)."""
    worker = mods.fsdp_worker.FSDPPolicyWorkerBase(
        cfg=cfg.trainer, world_size=1, rank=0, local_rank=0,
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ.get("MASTER_PORT", "29500")), sequence_parallel_size=1)
    worker.init_worker_process_group()
    worker.init_model(model_path)
    return worker


def use_sgd(worker, cfg) -> None:
    """torch.optim.SGD in place of the AdamW SkyRL's strategy built (module docstring), over
    the same parameters; the scheduler rebuilt by SkyRL's own ``get_scheduler`` call."""
    # lazy: SkyRL's strategy module, inside the rank
    from skyrl.backends.skyrl_train.distributed import fsdp_strategy
    opt = cfg.trainer.policy.optimizer_config
    worker.optimizer = torch.optim.SGD(worker.model.model.parameters(), lr=opt.lr,
                                       weight_decay=opt.weight_decay)
    worker.scheduler = fsdp_strategy.get_scheduler(
        opt.scheduler, worker.optimizer, num_warmup_steps=opt.num_warmup_steps,
        num_training_steps=None)


class LocalDispatch:
    """``WorkerDispatch`` for one in-process rank: what it sends to its Ray actor group goes to
    the worker itself; mini-batches are staged by SkyRL's ``MeshDispatch.stage_chunks`` (its
    ``ray.put`` hands the chunk back)."""

    def __init__(self, worker, mods):
        self.worker, self.mods = worker, mods

    def get_lcm_dp_size(self) -> int:
        return 1

    def stage_data(self, model, data, mini_batch_boundaries):
        dispatch = self.mods.dispatch
        real, dispatch.ray = dispatch.ray, SimpleNamespace(put=lambda x: x)
        try:
            return dispatch.MeshDispatch.stage_chunks(1, data, mini_batch_boundaries)
        finally:
            dispatch.ray = real

    def forward(self, model, data, **kwargs):
        return self.worker.forward(data, **kwargs)

    def forward_from_staged(self, model, chunk_refs, **kwargs):
        return self.worker.forward(chunk_refs[0], **kwargs)

    def forward_backward_from_staged(self, model, chunk_refs, **kwargs):
        return self.worker.forward_backward(chunk_refs[0], **kwargs)

    def optim_step(self, model, model_id=None):
        return self.worker.optim_step()

    def empty_cache(self, model=None) -> None:
        return None


def trainer_for(mods, cfg, worker):
    """A bare ``RayPPOTrainer`` whose methods the step calls: its config, a tokenizer carrying
    the pad id rlaudit's conversion uses, the local dispatch, no critic or reference model."""
    cls = mods.trainer.RayPPOTrainer
    trainer = cls.__new__(cls)
    trainer.cfg = cfg
    trainer.tokenizer = SimpleNamespace(pad_token_id=0)
    trainer.dispatch = LocalDispatch(worker, mods)
    trainer.ref_model = None
    trainer.all_metrics, trainer.all_timings = {}, {}
    trainer.global_step = 1
    return trainer


def fit_step(trainer, rollout) -> tuple[dict, dict]:
    """The post-generation part of one ``RayPPOTrainer.train`` iteration (trainer.py, steps 3
    to 7) with the trainer's own methods. Returns (its metrics, step tensors). Step 1.2,
    ``postprocess_generator_output``, is not called: for token-level rewards (what
    :func:`generator_output` hands over) it only computes reward metrics, which reject an empty
    response (generators/utils.py:250; SkyRL's generators always emit a token), and the
    built-in rollout has one."""
    cls = type(trainer)
    out, uids = rollout
    out = {k: [list(v) if isinstance(v, list) else v for v in vs] for k, vs in out.items()}
    data = cls.convert_to_training_input(trainer, out, list(uids))
    data = cls.fwd_logprobs_values_reward(trainer, data)
    data = cls.compute_advantages_and_returns(trainer, data)
    tokens = {ours: data[theirs].detach().clone() for theirs, ours in (
        ("action_log_probs", "old_log_probs"), ("advantages", "advantages"),
        ("returns", "returns"), ("rewards", "token_level_rewards"))}
    data.pop("rewards")
    data.metadata.pop("uids")
    data.metadata.pop("is_last_step", None)
    trainer.all_metrics = {}
    cls.train_critic_and_policy(trainer, data)
    metrics = dict(trainer.all_metrics)
    trainer.global_step += 1
    return metrics, tokens


def train_job(info, job: dict, cfg, mods) -> dict:
    """One job, ``job["steps"]`` times on the same rollout with one worker: per step SkyRL's
    metrics and every parameter after it (HF names); the tensors step 0 held, in SkyRL's
    right-aligned response layout."""
    del info
    worker = build_worker(mods, cfg, cfg.trainer.policy.model.path)
    if job["sgd"]:
        use_sgd(worker, cfg)
    trainer = trainer_for(mods, cfg, worker)
    result: dict[str, Any] = {"metrics": [], "params": []}
    for step in range(job["steps"]):
        metrics, tokens = fit_step(trainer, job["rollout"])
        result["metrics"].append({k: float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float))})
        if step == 0:
            result["tokens"] = tokens
        result["params"].append(full_params(worker.model.model))
    return result


def output(result: dict, batch: RolloutBatch) -> TrainStepOutput:
    """:func:`train_job`'s result as a TrainStepOutput: catalogue metrics per step
    (:data:`METRICS`); step 0's tensors back from SkyRL's right-aligned response columns to
    rlaudit's ``[B, R]``, float64, 0 off ``response_mask`` (the old log-probs are the initial
    policy's, at the rollout temperature)."""
    mask = batch["response_mask"].bool()
    lengths = batch["response_lengths"].long()
    width = mask.shape[1]

    def back(x: torch.Tensor) -> torch.Tensor:
        x = shift(x, lengths.clamp(max=x.shape[1]), to_right=False)[:, :width]
        x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        return torch.where(mask, x.double(), 0.0)

    tokens = {k: back(v) for k, v in result["tokens"].items()}
    metrics = [{ours: step[theirs] for theirs, ours in METRICS.items() if theirs in step}
               for step in result["metrics"]]
    return TrainStepOutput(metrics=metrics, log_probs=tokens["old_log_probs"], tokens=tokens,
                           params=result["params"])


def replay(adapter, request: ReplayRequest) -> dict[str, VariantRun]:
    """Every variant of ``request`` SkyRL's step maps, in one rank (SkyRL imported once), each
    laid out as ``train_step``'s output would be. A variant whose rows SkyRL's trainer cannot
    take (:func:`rows_unsupported`) is not run: its invariants are n/a for SkyRL."""
    variants = [v for v in request.variants if not rows_unsupported(v.config, v.batch)]
    if not variants or request.device != "cpu":     # mapped on CPU only
        return {}

    def train_all(vs):
        results = train_steps(request.model, [(v.batch, v.config, v.steps) for v in vs],
                              version=adapter.version)
        return [output(r, v.batch)
                for r, v in zip(results, vs)]

    return replayed_runs(request, variants, train_all, source=f"{adapter.name}.train_step")
