"""What differs between verl releases, read from the installed release's functions (by feature,
not by version string), for the verl adapter (``verl.py``).

- :func:`differences`: the deliberate conventions of releases whose ``agg_loss`` takes no
  global counts (verl 0.5): the seq-mean modes average over every row of the batch (N_seq
  counts rows without a valid token), and ``seq-mean-token-sum-norm`` is the token sum over the
  width alone (Dr.GRPO's constant normaliser as that release wrote it; verl PR #4510 divided by
  the row count too).
- :func:`value_loss`: ``core_algos.compute_value_loss`` called as that release's trainer calls
  it. From 0.9 it takes the global counts (``dp_size``, ``batch_num_tokens``,
  ``global_batch_size``, ``loss_scale_factor``) and ``workers/utils/losses.py`` passes them;
  before, it has no such keywords and the trainer normalised each micro-batch by its own counts
  (verl 0.8.0 ``losses.py`` L167-174, fixed by https://github.com/verl-project/verl/pull/6957):
  the adapter then calls it with the micro-batch's own counts too, so
  ``value_loss:global-split`` shows what that trainer computes.
- :func:`require_keyword`: a function of the release must take a keyword the check needs, else
  :class:`~rlaudit.verdict.unsupported.UnsupportedFeature` naming the release (asked before the
  call, so a ``TypeError`` raised inside verl's math stays a finding).
- :func:`require_global_counts`: ``agg_loss`` takes the global counts (``dp_size`` and the
  rest) only from verl 0.7 (0.5.0's is ``agg_loss(loss_mat, loss_mask, loss_agg_mode)``).
- :func:`require_policy_loss`: the loss mode is in the release's ``POLICY_LOSS_REGISTRY`` (0.5.0
  registers only gpg, clip_cov and kl_cov; its vanilla PPO loss is the unregistered
  ``compute_policy_loss``) and the release has the ``FSDPActorConfig`` the registered losses
  read, with ``global_batch_info`` when global counts are given.
"""

from __future__ import annotations

from typing import Any, Callable

import dataclasses
import importlib

import torch

from rlaudit.algo.agg import Denominators
from rlaudit.targets.contract import UnsupportedFeature
from rlaudit.targets.contract.adapter import accepts
from rlaudit.targets.contract.declare import Difference, source_line

#: verl computes its losses in float32
DTYPE = torch.float32
#: the keyword of compute_value_loss that came with global normalisation (verl 0.9)
GLOBAL_VALUE_KEYWORD = "batch_num_tokens"
#: verl's core_algos at a release tag
CORE_AT = "https://github.com/verl-project/verl/blob/v{v}/verl/trainer/ppo/core_algos.py"


def differences(version: str, core) -> tuple[Difference, ...]:
    """The conventions of a release whose ``agg_loss`` takes no global counts (module
    docstring), linked to the lines of the installed ``core_algos``; none for later ones."""
    if accepts(core.agg_loss, "dp_size"):
        return ()
    at = CORE_AT.format(v=version.split("+")[0])
    return (
        Difference(
            "sequence-mean-over-all-rows",
            reason="agg_loss's seq-mean modes take torch.mean over the batch's rows, rows "
                   "without a valid token included (later releases exclude them)",
            link=at + source_line(core.agg_loss, "torch.mean(seq_losses)"),
            checks=("agg_loss:*", "value_loss:*"), convention={"seq_count": "all-rows"}),
        Difference(
            "token-sum-norm-without-row-count",
            reason="seq-mean-token-sum-norm divides the batch's token sum by the width alone "
                   "(Dr.GRPO's constant normaliser, as the release's comment says), not by the "
                   "row count too (verl PR #4510 added it)",
            link=at + source_line(core.agg_loss, "loss_mask.shape[-1]"),
            checks=("agg_loss:parity", "value_loss:parity"),
            cases=("seq-mean-token-sum-norm",)),
    )


def global_info(denominators: Denominators | None) -> dict[str, Any]:
    """verl's global-count keywords for rlaudit's whole-mini-batch counts (``dp_size=1``: verl
    multiplies by it because DDP/FSDP average gradients over ranks; rlaudit's contributions are
    summed); empty without counts."""
    if denominators is None:
        return {}
    return {"dp_size": 1, "batch_num_tokens": denominators.tokens,
            "global_batch_size": denominators.seqs,
            "loss_scale_factor": denominators.norm_len}


def require_keyword(fn: Callable, keyword: str, *, release: str, feature: str,
                    reason: str = "") -> None:
    """Raise UnsupportedFeature unless ``fn`` takes ``keyword``."""
    if not accepts(fn, keyword):
        raise UnsupportedFeature(f"{feature} ({getattr(fn, '__name__', fn)} takes no "
                                 f"`{keyword}`)", release=release, reason=reason)


def require_global_counts(core, *, release: str) -> None:
    """UnsupportedFeature unless ``core.agg_loss`` takes verl's global-count keywords."""
    require_keyword(core.agg_loss, "dp_size", release=release,
                    feature="agg_loss with global token/sequence counts",
                    reason="present from verl 0.7")


def require_policy_loss(core, loss_mode: str, *, release: str, global_counts: bool) -> None:
    """UnsupportedFeature unless the release registers ``loss_mode`` and has the actor config
    the registered losses read (with ``global_batch_info`` when ``global_counts``)."""
    registry = getattr(core, "POLICY_LOSS_REGISTRY", {})
    if loss_mode not in registry:
        raise UnsupportedFeature(f"policy loss {loss_mode!r} in its POLICY_LOSS_REGISTRY "
                                 f"(registered: {', '.join(sorted(registry))})", release=release)
    try:
        config = importlib.import_module("verl.workers.config").FSDPActorConfig
    except (ImportError, AttributeError):
        raise UnsupportedFeature("verl.workers.config.FSDPActorConfig (the actor config the "
                                 "registered policy losses read)", release=release) from None
    if global_counts and "global_batch_info" not in {f.name for f in dataclasses.fields(config)}:
        raise UnsupportedFeature("global_batch_info in FSDPActorConfig (global counts for the "
                                 "policy loss)", release=release)


def value_loss(core, *, vpreds, values, returns, response_mask, cliprange_value,
               loss_agg_mode, denominators=None):
    """``core.compute_value_loss`` as the release's trainer calls it (module docstring):
    ``(loss, {"critic/vf_loss", "critic/vf_clipfrac"})``."""
    fn = core.compute_value_loss
    counts = global_info(denominators) if accepts(fn, GLOBAL_VALUE_KEYWORD) else {}
    loss, clipfrac = fn(vpreds=vpreds.to(DTYPE), values=values.to(DTYPE),
                        returns=returns.to(DTYPE), response_mask=response_mask.bool(),
                        cliprange_value=float(cliprange_value), loss_agg_mode=loss_agg_mode,
                        **counts)
    return loss, {"critic/vf_loss": float(loss.detach()), "critic/vf_clipfrac": float(clipfrac)}


__all__ = ["differences", "global_info", "require_global_counts", "require_keyword",
           "require_policy_loss", "value_loss"]
