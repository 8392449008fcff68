"""``train_step`` of ``--target areal``: AReaL's own PPO update on CPU, in a rank of rlaudit's
launcher (gloo; AReaL's CPU platform, float32).

    out = train_steps(model_path, [(batch, cfg, steps)], version="1.0.4")[0]
    out["metrics"][step]["actor/pg_loss"], out["params"][step], out["tokens"]["advantages"]

The rank (:func:`train_rank`) activates AReaL's peer directory, builds AReaL's ``FSDPEngine``
from a ``PPOActorConfig`` (:func:`actor_config`: rlaudit's :class:`~rlaudit.config.Config` in
AReaL's names) with the model loaded by AReaL's own HF loading code, and a ``PPOActor`` over it.
Each step runs what AReaL's trainer runs after generation, with the actor's own methods
(areal/trainer/rl_trainer.py at the release): ``_compute_logp`` (recompute_logprob: the proximal
log-probs, which also overwrite the rollout's, no decoupled loss), ``_compute_advantages``,
``_ppo_update`` (one mini-batch; the engine splits it into micro-batches and weighs each by its
token count: token-mean over the mini-batch), then the LR scheduler's step. The metrics are
AReaL's stats tracker's, exported after the update (:data:`METRICS`).

Only what maps is accepted (:func:`unsupported`). AReaL's layout: one row is prompt then
response, right-padded; position ``t`` carries the log-prob of token ``t + 1``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlaudit.backends.base import ReplayRequest, VariantRun
from rlaudit.backends.launch import launch
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.contract.adapter import TrainStepOutput
from rlaudit.targets.run.target_backend import replayed_runs
from rlaudit.update.collectives import full_params
from rlaudit.targets.peers.step_config import unmapped_layout

#: rlaudit estimator -> AReaL's reward_norm as NormConfig kwargs (group of ``rollout.n`` rows;
#: eps from ``algorithm.grpo_std_eps``); no batch advantage normalisation, no critic
ESTIMATORS = {
    "grpo": dict(mean_level="group", std_level="group"),
    "drgrpo": dict(mean_level="group", std_level=None),
    "rloo": dict(mean_level="group", mean_leave1out=True, std_level=None),
}
OPTIMIZERS = {"adamw": "adam", "sgd": "sgd"}
#: AReaL's stats-tracker key (after ``_ppo_update``) -> (rlaudit catalogue name, sign).
#: ``approx_kl`` is ``logprobs - proximal_logprobs`` (utils/functional/functional.py,
#: ppo_actor_loss_fn), rlaudit's ``actor/ppo_kl`` is old - new: the same mean, negated
METRICS = {
    "update/actor_loss/avg": ("actor/pg_loss", 1.0),
    "update/clip_ratio/avg": ("actor/pg_clipfrac", 1.0),
    "update/approx_kl/avg": ("actor/ppo_kl", -1.0),
    "update/grad_norm": ("actor/grad_norm", 1.0),
    "update/lr": ("actor/lr", 1.0),
    "advantages/avg": ("critic/advantages/mean", 1.0),
    "task_reward/avg": ("critic/score/mean", 1.0),
}


def unsupported(cfg: Config) -> list[str]:
    """The settings of ``cfg`` AReaL's step is not mapped for (empty: it runs)."""
    a, act, t = cfg.algorithm, cfg.actor, cfg.trainer
    rc = act.rollout_correction
    checks = {
        f"algorithm.adv_estimator={a.adv_estimator!r} (only the critic-free group estimators "
        f"{sorted(ESTIMATORS)} are mapped)": a.adv_estimator not in ESTIMATORS,
        "KL (actor.use_kl_loss / algorithm.use_kl_in_reward: AReaL's kl_ctl shapes rewards "
        "with a reference model this step does not load)": act.use_kl_loss or a.use_kl_in_reward,
        "rollout correction (actor.rollout_correction)":
            rc.rollout_is is not None or rc.use_rollout_kl_loss,
        f"actor.loss_mode={act.loss_mode!r} (vanilla is mapped)": act.loss_mode != "vanilla",
        f"actor.loss_agg_mode={act.loss_agg_mode!r} (AReaL's update is token-mean over the "
        f"mini-batch)": act.loss_agg_mode != "token-mean",
        "actor.loss_token_denominator=batch-mean": act.loss_token_denominator != "minibatch",
        f"actor.entropy_coeff={act.entropy_coeff} (grpo_loss_fn has no entropy term)":
            act.entropy_coeff != 0,
        f"actor.ppo_epochs={act.ppo_epochs} (_ppo_update makes one pass)": act.ppo_epochs != 1,
        f"trainer.dtype={t.dtype!r} (this step runs AReaL in float32)":
            t.dtype not in ("float32", "float64"),
        **unmapped_layout(cfg),
        "algorithm.filter_groups (DAPO's group filter)": a.filter_groups.enable,
        "algorithm.outcome_score=unmasked-sum": a.outcome_score != "masked-sum",
    }
    return [why for why, bad in checks.items() if bad]


def rows_unsupported(cfg: Config, rows: int) -> str:
    """Why AReaL's step cannot run ``rows`` as ``cfg`` says ("" if it can): ``_ppo_update``
    cuts mini-batches by balancing sequence lengths (``split_padded_tensor_dict_into_mb_list``),
    not in row order as the reference does, so only a batch of one mini-batch is mapped; its
    group normalisation takes ``rollout.n`` consecutive rows."""
    n = cfg.rollout.n
    if rows > cfg.actor.ppo_mini_batch_size * n:
        return (f"{rows} rows are more than one mini-batch ({cfg.actor.ppo_mini_batch_size} x "
                f"{n}): AReaL balances mini-batches by length, not in row order")
    if rows % n:
        return f"{rows} rows are not whole groups of rollout.n={n}"
    return ""


def actor_config(cfg: Config, *, model_path: str, rows: int) -> dict[str, Any]:
    """``PPOActorConfig`` keyword arguments (nested configs as dicts) for ``cfg`` on ``rows``.

    AReaL's engine packs a micro-batch's rows into one sequence and hands the model
    ``cu_seq_lens`` with no attention mask (fsdp_engine.py, ``_prepare_mb_list``): only a
    varlen kernel (flash_attention_2, CUDA) keeps the rows apart. On CPU every micro-batch holds
    one row (``n_mbs`` = rows) and attention is ``sdpa``, causal when no mask is given: exact.
    The engine weighs micro-batches by their token counts, so the update is unchanged."""
    act, a = cfg.actor, cfg.algorithm
    low = act.clip_ratio if act.clip_ratio_low is None else act.clip_ratio_low
    high = act.clip_ratio if act.clip_ratio_high is None else act.clip_ratio_high
    return {
        "experiment_name": "rlaudit", "trial_name": "train_step", "path": str(model_path),
        "dtype": "float32", "backend": "fsdp:d1", "attn_impl": "sdpa",
        "temperature": float(cfg.rollout.temperature),
        "mb_spec": {"n_mbs": rows}, "ppo_n_minibatches": 1,
        "optimizer": {"type": OPTIMIZERS[act.optim.name], "lr": act.optim.lr,
                      "weight_decay": act.optim.weight_decay, "beta1": act.optim.betas[0],
                      "beta2": act.optim.betas[1], "eps": act.optim.eps,
                      "lr_scheduler_type": "constant", "warmup_steps_proportion": 0.0,
                      # rlaudit's grad_clip <= 0 is "no clipping"
                      "gradient_clipping": act.grad_clip if act.grad_clip > 0 else float("inf")},
        "kl_ctl": 0.0, "recompute_logprob": True, "use_decoupled_loss": False,
        "eps_clip": float(low), "eps_clip_higher": float(high), "c_clip": float(act.clip_ratio_c),
        "discount": float(a.gamma), "gae_lambda": float(a.lam),
        "reward_norm": dict(ESTIMATORS[a.adv_estimator], group_size=cfg.rollout.n,
                            eps=float(a.grpo_std_eps))
        if a.norm_adv_by_std_in_grpo or a.adv_estimator != "grpo"
        else dict(ESTIMATORS["drgrpo"], group_size=cfg.rollout.n),
        "adv_norm": None,
    }


def areal_batch(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """rlaudit's batch in AReaL's padded layout: each row its prompt then its response,
    right-padded to the longest row; ``loss_mask`` on the response tokens; ``rewards`` the
    score; ``logprobs`` zeros (recompute_logprob overwrites them)."""
    t = batch.tensors
    b, p = t["prompt_ids"].shape
    r = t["response_ids"].shape[1]
    pl, rl = t["prompt_lengths"].long(), t["response_lengths"].long()
    width = int((pl + rl).max())
    ids = torch.zeros(b, width, dtype=torch.long)
    loss = torch.zeros(b, width, dtype=torch.bool)
    for i in range(b):
        n, m = int(pl[i]), int(rl[i])
        ids[i, :n] = t["prompt_ids"][i, :n]
        ids[i, n:n + m] = t["response_ids"][i, :m]
        loss[i, n:n + m] = t["response_mask"][i, :m].bool()
    attn = (torch.arange(width).unsqueeze(0) < (pl + rl).unsqueeze(1)).long()
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss,
            "logprobs": torch.zeros(b, width), "rewards": t["scores"].to(torch.float32)}


def at_response(x: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """AReaL's rolled per-position tensor -> rlaudit's ``[B, R]`` (response token ``j`` of a row
    with prompt length ``p`` is predicted at position ``p - 1 + j``), float64, 0 off the mask."""
    t = batch.tensors
    r = t["response_ids"].shape[1]
    pos = (t["prompt_lengths"].long().unsqueeze(1) - 1 + torch.arange(r).unsqueeze(0))
    pos = pos.clamp(max=x.shape[1] - 1)
    return torch.where(t["response_mask"].bool(), x.gather(1, pos).double(), 0.0)


def train_steps(model_path, jobs: list[tuple[RolloutBatch, Config, int]], *, version: str,
                timeout: float = 300.0) -> list[dict]:
    """``(batch, config, steps)`` jobs through AReaL's step, one after the other in one rank
    (AReaL imported once; a fresh engine per job)."""
    for batch, cfg, _steps in jobs:
        bad = unsupported(cfg) + list(filter(None, [rows_unsupported(cfg, len(batch))]))
        if bad:
            raise NotImplementedError(f"AReaL train_step does not map: {'; '.join(bad)}")
    request = {"version": version,
               "jobs": [{"steps": steps, "data": areal_batch(batch),
                         "config": actor_config(cfg, model_path=str(model_path),
                                               rows=len(batch))}
                        for batch, cfg, steps in jobs]}
    return launch(train_rank, 1, args=(request,), timeout=timeout * len(jobs),
                  env={"TOKENIZERS_PARALLELISM": "false"})[0]


def train_rank(info, request: dict) -> list[dict]:
    """The rank body: AReaL's peer directory first on ``sys.path``, then each job."""
    del info
    # lazy: AReaL is an optional peer, activated inside the rank only
    from rlaudit.targets.peers.registry import activate
    activate("areal", request["version"])
    os.environ.setdefault("LOCAL_RANK", "0")
    return [train_job(job) for job in request["jobs"]]


def _build(config: dict):
    # lazy: AReaL's modules exist only inside the rank (train_rank activated them)
    from areal.api import FinetuneSpec
    from areal.api.cli_args import (  # lazy: as above
        MicroBatchSpec, NormConfig, OptimizerConfig, PPOActorConfig)
    from areal.engine.fsdp_engine import FSDPEngine  # lazy: as above
    from areal.trainer.ppo.actor import PPOActor  # lazy: as above

    kw = dict(config)
    kw["mb_spec"] = MicroBatchSpec(**kw["mb_spec"])
    kw["optimizer"] = OptimizerConfig(**kw["optimizer"])
    kw["reward_norm"] = NormConfig(**kw["reward_norm"])
    ppo = PPOActorConfig(**kw)
    engine = FSDPEngine(ppo)
    engine.create_process_group()
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=1,
                                         train_batch_size=1))
    return engine, PPOActor(ppo, engine)


def train_job(job: dict) -> dict:
    """One job: per step the catalogue metrics and every parameter after it (HF names); the
    tensors step 0 held, in AReaL's rolled layout (``at_response`` maps them back)."""
    # lazy: AReaL's stats tracker, inside the rank
    from areal.utils import stats_tracker

    engine, actor = _build(job["config"])
    result: dict[str, Any] = {"metrics": [], "raw_metrics": [], "params": []}
    for step in range(job["steps"]):
        data = {k: v.clone() for k, v in job["data"].items()}
        stats_tracker.DEFAULT_TRACKER.export(reset=True)
        data["prox_logp"] = actor._compute_logp({k: v.clone() for k, v in data.items()})
        data = actor._compute_advantages(data)
        tokens = {"old_log_probs": data["logprobs"].detach().clone(),
                  "advantages": data["advantages"].detach().clone(),
                  "returns": data["returns"].detach().clone()}
        actor._ppo_update(data)
        engine.lr_scheduler_step()
        raw = stats_tracker.DEFAULT_TRACKER.export(reset=True)
        result["raw_metrics"].append(raw)
        result["metrics"].append({ours: sign * float(raw[theirs])
                                  for theirs, (ours, sign) in METRICS.items() if theirs in raw})
        if step == 0:
            result["tokens"] = tokens
        result["params"].append(full_params(engine.model))
    return result


def output(result: dict, batch: RolloutBatch) -> TrainStepOutput:
    """:func:`train_job`'s result as a TrainStepOutput: the recomputed log-probs of step 0 are
    the initial policy's (at the rollout temperature), per-token tensors back in rlaudit's
    ``[B, R]`` (:func:`at_response`)."""
    tokens = {k: at_response(v, batch) for k, v in result["tokens"].items()}
    return TrainStepOutput(metrics=result["metrics"], log_probs=tokens["old_log_probs"],
                           tokens=tokens, params=result["params"])


def replay(adapter, request: ReplayRequest) -> dict[str, VariantRun]:
    """Every variant of ``request`` AReaL's step maps, in one rank (AReaL imported once), each
    laid out as ``train_step``'s output would be. A variant whose rows it cannot run
    (:func:`rows_unsupported`) is not run: its invariants are n/a for AReaL."""
    variants = [v for v in request.variants if not rows_unsupported(v.config, len(v.batch))]
    if not variants or request.device != "cpu":     # mapped on CPU only
        return {}

    def train_all(vs):
        results = train_steps(request.model, [(v.batch, v.config, v.steps) for v in vs],
                              version=adapter.version)
        return [output(r, v.batch) for r, v in zip(results, vs)]

    return replayed_runs(request, variants, train_all, source=f"{adapter.name}.train_step")
