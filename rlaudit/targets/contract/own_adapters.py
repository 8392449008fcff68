"""rlaudit's own trainer exposed through the adapter API: the reference implementation of every
stage, and the built-in backends' training step.

    rlaudit run --target rlaudit.targets.contract.own_adapters:ReferenceAdapter  # passes all
    rlaudit run --target rlaudit.targets.contract.own_adapters:FSDPAdapter       # FSDP2, dp=2

:class:`ReferenceAdapter` calls rlaudit.algo, rlaudit.data.batching and the reference backend;
the stage checks compare other adapters against it. :class:`BackendAdapter` is the same with its
``train_step`` run by any backend of :mod:`rlaudit.backends.registry` (``backend`` and ``layout``
class attributes). Both also offer ``replay(request)``: a backend adapter hands all of a
scenario's variants to its backend at once (one process-group spawn, not one per variant).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from rlaudit.algo.advantages import compute_advantages
from rlaudit.algo.agg import agg_loss
from rlaudit.algo.dapo import filter_groups
from rlaudit.algo.distill import compute_distill_loss
from rlaudit.algo.kl import kl_penalty
from rlaudit.algo.policy_loss import compute_policy_loss
from rlaudit.algo.reward import apply_kl_in_reward
from rlaudit.backends.base import ReplayRequest, Variant, VariantRun
from rlaudit.backends.registry import get_backend
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.batching import (microbatches_by_count, microbatches_by_tokens,
                                   pad_microbatch_list, shard_for_dp)
from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import TargetAdapter, TrainStepOutput


class ReferenceAdapter(TargetAdapter):
    """Every stage, implemented by rlaudit's reference code (see the module docstring)."""

    name = "reference-adapter"
    #: registry name of the backend that runs train_step / replay, and its layout
    backend = "reference"
    layout: dict[str, int] = {}
    #: rlaudit's backends compute in exact float64 (rlaudit/model/exact.py): the scenarios' own
    #: tolerances apply, no floor
    train_precision = "float64"

    # ---- math stages -------------------------------------------------------------------------
    def filter_groups(self, *, batch: RolloutBatch, metric: torch.Tensor) -> RolloutBatch:
        """DAPO dynamic sampling: the rows of groups whose ``metric`` varies, and singletons."""
        return batch.select(filter_groups(batch["uid"], metric).nonzero().flatten())

    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           values=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        return compute_advantages(estimator, token_level_rewards=token_level_rewards,
                                  response_mask=response_mask, uid=uid, values=values,
                                  gamma=gamma, lam=lam,
                                  norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        return apply_kl_in_reward(token_level_scores, old_log_probs, ref_log_probs, response_mask,
                                  kl_coef=kl_coef, kl_penalty=kl_penalty)

    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        return kl_penalty(log_prob, ref_log_prob, kind)

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        return agg_loss(loss_mat, mask, mode, denominators)

    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                    denominators=None, gspo_gradient="per-token"):
        """The actor's policy-gradient term as rlaudit.update.actor assembles it: the loss
        aggregated with ``loss_agg_mode`` and the clip/KL metrics as token-means, all divided by
        ``denominators`` when given (micro-batch contributions). ``gspo_gradient``: the
        convention of that name (rlaudit.algo.policy_loss)."""
        pol = compute_policy_loss(loss_mode, old_log_prob=old_log_prob, log_prob=log_prob,
                                  advantages=advantages, mask=response_mask,
                                  clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                  clip_ratio_c=clip_ratio_c, gspo_gradient=gspo_gradient)
        loss = agg_loss(pol.loss_mat, response_mask, loss_agg_mode, denominators)
        tok = partial(agg_loss, mask=response_mask, mode="token-mean", denom=denominators)
        dtype = log_prob.dtype
        return loss, {"actor/pg_loss": loss.detach().clone(),
                      "actor/pg_clipfrac": tok(pol.clipped.to(dtype)),
                      "actor/pg_clipfrac_lower": tok(pol.clipped_lower.to(dtype)),
                      "actor/ppo_kl": tok(pol.ppo_kl_mat)}

    def distill_loss(self, *, name, student, teacher, mask=None):
        return compute_distill_loss(name, student, teacher, mask)

    def make_microbatches(self, batch: RolloutBatch, *, dp_size: int,
                          micro_batch_size: int | None = None,
                          max_token_len: int | None = None,
                          extra_padding: int = 0) -> list[list[RolloutBatch]]:
        """Contiguous equal-count shards per rank, micro-batches by count or token budget,
        then padding micro-batches so every rank runs as many as the busiest one, plus
        ``extra_padding`` more on every rank."""
        if (micro_batch_size is None) == (max_token_len is None):
            raise InputError("give exactly one of micro_batch_size and max_token_len",
                             key="micro_batch_size")
        shards = shard_for_dp(batch, dp_size)
        per_rank = [microbatches_by_count(s, micro_batch_size) if micro_batch_size else
                    microbatches_by_tokens(s, max_token_len) for s in shards]
        target = max(len(m) for m in per_rank) + extra_padding
        return [pad_microbatch_list(m, target, s) for m, s in zip(per_rank, shards)]

    # ---- whole step --------------------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        return get_backend(self.backend).available()

    def replay(self, request: ReplayRequest) -> dict[str, VariantRun]:
        """Every variant of ``request`` on this adapter's backend and layout."""
        backend = get_backend(self.backend)
        ok, why = backend.available()
        if not ok:
            raise RuntimeError(f"backend {self.backend} unavailable: {why}")
        return backend.replay(dataclasses.replace(request, layout=dict(self.layout)))

    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu") -> TrainStepOutput:
        """``steps`` training steps on ``batch`` from the snapshot at ``model_path``."""
        request = ReplayRequest(model=str(model_path), variants=[Variant("step", config, batch,
                                                                         steps)],
                                ref_model=None if ref_model_path is None else str(ref_model_path),
                                dtype=config.trainer.dtype, device=device)
        return output_from_run(self.replay(request)["step"])


class BackendAdapter(ReferenceAdapter):
    """A built-in backend's training step behind the adapter API (stages as the reference).
    Subclass with ``backend`` and ``layout``, or instantiate ``BackendAdapter("fsdp",
    {"dp": 2})``."""

    def __init__(self, backend: str | None = None, layout: dict[str, int] | None = None):
        if backend is not None:
            self.backend = backend
        if layout is not None:
            self.layout = dict(layout)
        self.name = self.backend


class FSDPAdapter(BackendAdapter):
    """The FSDP2 backend, two data-parallel ranks."""

    backend = "fsdp"
    layout = {"dp": 2}


class MegatronAdapter(BackendAdapter):
    """The Megatron backend, tensor-parallel 2."""

    backend = "megatron"
    layout = {"tp": 2, "pp": 1, "dp": 1}


def output_from_run(run: VariantRun) -> TrainStepOutput:
    """A backend's :class:`VariantRun` as the adapter API's :class:`TrainStepOutput`."""
    params = []
    for flat in run.params:
        parts = torch.split(flat, run.param_numels)
        params.append(dict(zip(run.param_names, parts)))
    tokens = {k: v for k, v in run.tokens.items() if not k.startswith("probe_")}
    return TrainStepOutput(metrics=[dict(m) for m in run.steps],
                           log_probs=run.tokens.get("probe_log_probs"),
                           entropy=run.tokens.get("probe_entropy"), tokens=tokens,
                           params=params, microbatches=run.micro_log)
