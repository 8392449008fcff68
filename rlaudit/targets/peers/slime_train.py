"""``train_step`` of ``--target slime``: slime's own Megatron actor step on CPU, in a rank of
rlaudit's launcher (gloo; megatron-core 0.16 as rlaudit's Megatron backend runs it; float32).

    out = train_steps(model_path, [(batch, cfg, steps)], snapshot=path)[0]
    out["metrics"][step]["actor/pg_loss"], out["params"][step], out["tokens"]["advantages"]

Per training step, slime's code from the rollout manager's hand-over on (slime/ray/rollout.py,
slime/backends/megatron_utils/): the samples (``Sample``: prompt then response tokens, the loss
mask, the score as reward) through ``RolloutManager._convert_samples_to_train_data`` (slime's
GRPO reward normalisation, loss masks, per-rollout mask sums) and ``_split_train_data_by_dp``
(``build_dp_schedule``: steps of ``global_batch_size`` samples, static micro-batches), then the
actor's own ``MegatronTrainRayActor.train``: ``process_rollout_data``, ``train_actor``
(``compute_log_prob`` through ``forward_only`` and ``get_log_probs_and_entropy``,
``compute_advantages_and_returns``, ``log_rollout_data``, ``model.train``: per optimizer step
``train_one_step`` with Megatron's ``forward_backward_func``, slime's ``loss_function`` and its
loss scaling, the optimizer step, the LR scheduler, ``reduce_train_step_metrics``).

The model: slime builds its GPTModel from HF weights through mbridge (a CUDA-cluster package, not
installed); the GPTModel here is rlaudit's Megatron backend's for the same HF config and weights
(rlaudit.backends.megatron: the HF <-> Megatron mapping its own backend-parity checks hold to the
HF model), handed to slime's ``setup_model_and_optimizer`` as ``get_model``'s result, so slime
builds the optimizer (from its arguments, as on a cluster) and its LR scheduler. What else stands
in is in slime_cpu.py. The weights backup: ``TensorBackuper``'s copying variant pins host memory
(slime/utils/tensor_backper.py:58 ``pin_memory=True``: CUDA only), so the actor gets slime's
one-tag variant (``single_tag="actor"``), which checks the weights were not changed between its
backup and restore instead of copying them (no reference or old-actor model is mapped here).

Metrics are what slime logs (``logging_utils.log``, recorded on the way to its sinks), under
catalogue names (:data:`METRICS`), averaged over the optimizer steps of the training step.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from rlaudit.backends.base import ReplayRequest, VariantRun
from rlaudit.backends.launch import launch
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.contract.adapter import TrainStepOutput
from rlaudit.targets.peers.slime_step import METRICS, train_job
from rlaudit.targets.run.target_backend import replayed_runs
from rlaudit.targets.peers.step_config import unmapped_layout

#: rlaudit estimator -> (slime advantage_estimator, grpo_std_normalization); slime normalises
#: the rewards of ``n_samples_per_prompt`` consecutive samples (std with eps 1e-6, unbiased)
ESTIMATORS = {"grpo": ("grpo", True), "drgrpo": ("grpo", False)}
#: slime's GRPO std epsilon (slime/ray/rollout.py, _post_process_rewards)
GRPO_EPS = 1e-6
OPTIMIZERS = {"adamw": "adam", "sgd": "sgd"}
AGG_MODES = {"token-mean": True, "seq-mean-token-mean": False}


def unsupported(cfg: Config) -> list[str]:
    """The settings of ``cfg`` slime's step is not mapped for (empty: it runs)."""
    a, act, t = cfg.algorithm, cfg.actor, cfg.trainer
    rc = act.rollout_correction
    checks = {
        f"algorithm.adv_estimator={a.adv_estimator!r} (slime's reward normalisation maps "
        f"{sorted(ESTIMATORS)})": a.adv_estimator not in ESTIMATORS,
        f"algorithm.grpo_std_eps={a.grpo_std_eps} (slime's is {GRPO_EPS})":
            a.adv_estimator == "grpo" and a.norm_adv_by_std_in_grpo
            and a.grpo_std_eps != GRPO_EPS,
        "KL (actor.use_kl_loss / algorithm.use_kl_in_reward: no reference model is loaded)":
            act.use_kl_loss or a.use_kl_in_reward,
        "rollout correction": rc.rollout_is is not None or rc.use_rollout_kl_loss,
        f"actor.loss_mode={act.loss_mode!r} (vanilla is mapped)": act.loss_mode != "vanilla",
        f"actor.loss_agg_mode={act.loss_agg_mode!r}": act.loss_agg_mode not in AGG_MODES,
        "actor.loss_token_denominator=batch-mean": act.loss_token_denominator != "minibatch",
        f"actor.ppo_epochs={act.ppo_epochs} (slime passes over a rollout once)":
            act.ppo_epochs != 1,
        f"trainer.dtype={t.dtype!r} (this step runs slime in float32)":
            t.dtype not in ("float32", "float64"),
        "token-budget micro-batches (use_dynamic_bsz)": act.use_dynamic_bsz,
        **unmapped_layout(cfg),
        "algorithm.filter_groups (DAPO's group filter)": a.filter_groups.enable,
        "algorithm.outcome_score=unmasked-sum": a.outcome_score != "masked-sum",
    }
    return [why for why, bad in checks.items() if bad]


def rows_unsupported(cfg: Config, rows: int, fields=("rollout_log_probs",)) -> str:
    """Why slime cannot run ``rows`` as ``cfg`` says ("" if it can): slime normalises the
    rewards of ``rollout.n`` consecutive samples and cuts steps of whole mini-batches."""
    n, mini = cfg.rollout.n, cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    if rows <= mini and "rollout_log_probs" not in fields:
        # one optimizer step: slime reuses the loss's log-probs and shapes its zero KL on the
        # rollout engine's log-probs (loss.py compute_advantages_and_returns), always sent
        return "one optimizer step without rollout_log_probs (slime's engine always sends them)"
    if rows % n:
        return f"{rows} rows are not whole groups of rollout.n={n}"
    if rows % min(mini, rows):
        return f"{rows} rows are not whole mini-batches of {mini}"
    return ""


def slime_args(cfg: Config, *, rows: int, steps: int) -> dict[str, Any]:
    """slime's (and Megatron-LM's) argument values for ``cfg`` on ``rows``; every other slime
    argument keeps the default of slime's own parser."""
    act, a = cfg.actor, cfg.algorithm
    o = act.optim
    estimator, std = ESTIMATORS[a.adv_estimator]
    low = act.clip_ratio if act.clip_ratio_low is None else act.clip_ratio_low
    high = act.clip_ratio if act.clip_ratio_high is None else act.clip_ratio_high
    n = cfg.rollout.n
    return {
        # rollout and step layout (rows are samples; a step is a mini-batch of samples)
        "rollout_batch_size": rows // n, "n_samples_per_prompt": n, "num_rollout": steps,
        "global_batch_size": min(act.ppo_mini_batch_size * n, rows),
        "micro_batch_size": act.ppo_micro_batch_size_per_gpu, "use_dynamic_batch_size": False,
        "rollout_temperature": float(cfg.rollout.temperature),
        # advantages and loss
        "advantage_estimator": estimator, "rewards_normalization": True,
        "grpo_std_normalization": std if a.adv_estimator == "drgrpo"
        else bool(a.norm_adv_by_std_in_grpo),
        "loss_type": "policy_loss", "calculate_per_token_loss": AGG_MODES[act.loss_agg_mode],
        "eps_clip": float(low), "eps_clip_high": float(high), "eps_clip_c": float(act.clip_ratio_c),
        "entropy_coef": float(act.entropy_coeff), "use_kl_loss": False, "kl_coef": 0.0,
        # Megatron-LM's optimizer and schedule arguments (constant LR, no warm-up)
        "optimizer": OPTIMIZERS[o.name], "lr": float(o.lr), "min_lr": float(o.lr),
        "weight_decay": float(o.weight_decay), "start_weight_decay": float(o.weight_decay),
        "end_weight_decay": float(o.weight_decay), "adam_beta1": float(o.betas[0]),
        "adam_beta2": float(o.betas[1]), "adam_eps": float(o.eps), "sgd_momentum": 0.0,
        # rlaudit's grad_clip <= 0 is "no clipping"; inf clips nothing and keeps the norm
        "clip_grad": float(act.grad_clip) if act.grad_clip > 0 else float("inf"),
    }


def train_steps(model_path, jobs: list[tuple[RolloutBatch, Config, int]], *, snapshot: str,
                timeout: float = 300.0) -> list[dict]:
    """``(batch, config, steps)`` jobs through slime's step, one after the other in one rank
    (slime imported once; a fresh model per job). ``snapshot``: the folder holding ``slime/``."""
    for batch, cfg, _steps in jobs:
        bad = unsupported(cfg) + list(filter(None, [
            rows_unsupported(cfg, len(batch), batch.tensors)]))
        if bad:
            raise NotImplementedError(f"slime train_step does not map: {'; '.join(bad)}")
    request = {"snapshot": str(snapshot), "model": str(model_path),
               "jobs": [{"steps": steps, "samples": samples(batch),
                         "args": slime_args(cfg, rows=len(batch), steps=steps),
                         "entropy": bool(cfg.compute_entropy)}
                        for batch, cfg, steps in jobs]}
    return launch(train_rank, 1, args=(request,), timeout=timeout * len(jobs),
                  env={"TOKENIZERS_PARALLELISM": "false"})[0]


def samples(batch: RolloutBatch) -> list[dict]:
    """Each row as the fields of a slime ``Sample``: prompt then response tokens, the response
    length, its loss mask, the score as the reward, the sampler's log-probs as the rollout
    engine's (when the batch has them); ``index`` its group (the row's uid)."""
    t = batch.tensors
    out = []
    for i in range(len(batch)):
        p, r = int(t["prompt_lengths"][i]), int(t["response_lengths"][i])
        out.append({"tokens": t["prompt_ids"][i, :p].tolist() + t["response_ids"][i, :r].tolist(),
                    "response_length": r, "reward": float(t["scores"][i]),
                    "loss_mask": t["response_mask"][i, :r].int().tolist(),
                    "index": int(t["uid"][i])})
        if "rollout_log_probs" in t:
            out[-1]["rollout_log_probs"] = t["rollout_log_probs"][i, :r].tolist()
    return out


def train_rank(info, request: dict) -> list[dict]:
    """The rank body: slime's snapshot first on ``sys.path``, what slime_cpu provides, Megatron
    initialised as rlaudit's backend does, then every job."""
    del info
    sys.path.insert(0, request["snapshot"])
    # lazy: megatron-core and slime exist only inside the rank
    from rlaudit.backends.megatron import compat
    from rlaudit.targets.peers import slime_cpu  # lazy: slime's CPU stand-ins, rank only
    held: dict[str, Any] = {}
    slime_cpu.absent_packages(get_args=lambda: held["args"],
                              get_model=lambda *a, **kw: held["model"])
    os.environ.setdefault("SLIME_ACCELERATOR", "cpu")
    compat.init_megatron(tp=1, pp=1, seed=1234)
    slime_cpu.cpu_accelerator()
    # slime's KL, loss and entropy kernels are torch.compile'd; eager runs the same float32
    # arithmetic without an inductor build per shape (as the stage adapter, slime.py)
    torch.compiler.set_stance("force_eager")
    try:
        return [train_job(request["model"], job, held) for job in request["jobs"]]
    finally:
        compat.teardown_megatron()


def output(result: dict, batch: RolloutBatch) -> TrainStepOutput:
    """:func:`train_job`'s result as a TrainStepOutput: slime's per-sample response tensors of
    step 0 (``log_probs`` recomputed by the actor before its update: the initial policy's, at the
    rollout temperature) laid out ``[B, R]``, float64, 0 after a response."""
    b, r = batch.tensors["response_ids"].shape

    def dense(rows) -> torch.Tensor:
        out = torch.zeros(b, r, dtype=torch.float64)
        for i, x in enumerate(rows):
            out[i, :len(x)] = x.double()
        return out

    seen = result["tokens"]
    tokens = {ours: dense(seen[theirs]) for theirs, ours in
              (("log_probs", "old_log_probs"), ("advantages", "advantages"),
               ("returns", "returns")) if theirs in seen}
    return TrainStepOutput(metrics=result["metrics"], log_probs=tokens.get("old_log_probs"),
                           tokens=tokens, params=result["params"])


def replay(adapter, request: ReplayRequest) -> dict[str, VariantRun]:
    """Every variant of ``request`` slime's step maps, in one rank (slime imported once), each
    laid out as ``train_step``'s output would be; a variant whose rows it cannot run
    (:func:`rows_unsupported`) is not run: its invariants are n/a for slime."""
    variants = [v for v in request.variants
                if not rows_unsupported(v.config, len(v.batch), v.batch.tensors)]
    if not variants or request.device != "cpu":     # mapped on CPU only
        return {}

    def train_all(vs):
        results = train_steps(request.model, [(v.batch, v.config, v.steps) for v in vs],
                              snapshot=adapter.snapshot)
        return [output(res, v.batch) for res, v in zip(results, vs)]

    return replayed_runs(request, variants, train_all, source=f"{adapter.name}.train_step")
