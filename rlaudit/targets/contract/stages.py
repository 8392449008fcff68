"""The stage signatures, as a :class:`typing.Protocol`: the one place they are written down.

An adapter provides any subset of these methods (each optional; see :mod:`.adapter` for the
conventions every stage follows). ``rlaudit run --target`` reads each method's parameters with
:func:`inspect.signature` (rlaudit/targets/run/validate.py) to check, before any check runs, that
the adapter's stage can be called as the checks call it: parameters without a default are
required (those before ``*`` by position, the rest by keyword); parameters with a default are
optional, passed only when the stage accepts them.

Shapes: per-token tensors are ``[B, R]`` (rows, response width), padded and response-aligned;
``response_mask``/``mask`` ``[B, R]`` bool, True = the token counts; ``uid`` ``[B]`` int64.
"""

from __future__ import annotations

from typing import Any, Protocol


class Stages(Protocol):
    """Every stage method an adapter may define, with what it returns."""

    def filter_groups(self, *, batch, metric) -> Any:
        """The kept rows (RolloutBatch or {field: tensor})."""

    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid, values,
                           gamma, lam, norm_adv_by_std_in_grpo) -> Any:
        """(advantages [B, R], returns [B, R])."""

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty) -> Any:
        """(token_level_rewards [B, R], kl [B, R])."""

    def kl_penalty(self, *, log_prob, ref_log_prob, kind) -> Any:
        """[B, R] per-token estimate (unmasked)."""

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None) -> Any:
        """A scalar: ``loss_mat`` [B, R] reduced over ``mask`` as ``mode`` says."""

    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                    denominators=None) -> Any:
        """(loss scalar, metrics {catalogue name: float | 0-dim tensor})."""

    def value_loss(self, *, vpreds, values, returns, response_mask, cliprange_value,
                   loss_agg_mode, denominators=None) -> Any:
        """(loss scalar, metrics {catalogue name: float | 0-dim tensor}, e.g.
        ``critic/vf_clipfrac``): the clipped value loss of predictions ``vpreds`` [B, R] around
        the old ``values`` [B, R] towards ``returns`` [B, R]."""

    def make_microbatches(self, batch, *, dp_size, micro_batch_size=None,
                          max_token_len=None) -> Any:
        """Per rank, a list of micro-batches (RolloutBatch or {field: tensor})."""

    def distill_loss(self, *, name, student, teacher, mask) -> Any:
        """Per-token loss ([B, R] or nested)."""

    def train_step(self, *, model_path, ref_model_path, batch, config, steps, device) -> Any:
        """A :class:`~rlaudit.targets.contract.adapter.TrainStepOutput`."""
