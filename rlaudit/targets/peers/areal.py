"""AReaL (inclusionAI/AReaL, pinned ``areal==1.0.4``) behind rlaudit's adapter API.

    rlaudit run --target areal               # AReaL from the environment, else <peers dir>/areal-*

Every stage calls AReaL's own code; this module only converts tensors and builds the
configuration AReaL's trainer would hold:

- ``compute_advantages``: ``PPOActor._compute_advantages`` (the actor's KL-shaped rewards, its
  masked GAE scan, reward and advantage normalisation), built from AReaL's own
  ``PPOActorConfig`` / ``NormConfig``: gae (GAE, advantages normalised over the batch),
  reinforce_plus_plus (GAE with no critic and lambda 1: the discounted return, normalised over the
  batch), grpo / drgrpo / rloo / reinforce_plus_plus_baseline (group reward normalisation:
  ``mean_level="group"`` with ``std_level`` "group" or none, ``mean_leave1out`` for RLOO; the
  baseline one then normalised over the batch). AReaL's layout is the sequence's: position ``t``
  predicts token ``t + 1`` (the actor rolls ``loss_mask`` and ``logprobs`` by -1); here each row
  is one prompt token then its response, so AReaL's position ``j`` is rlaudit's response index
  ``j``. Token-level rewards reach the scan through the actor's own per-token term
  ``-kl_ctl * k1(old, ref)`` (``kl_ctl = 1``, old 0, ref = the reward: exact up to k1's float32
  cast); outcome scores through the sample reward. Groups are AReaL's: ``group_size`` consecutive
  rows; rows are put in that order (a permutation) and back.
- ``kl_penalty``: ``areal.utils.data.KLEstimator`` (k1, k2, k3).
- ``policy_loss``: ``grpo_loss_fn``, the actor's loss, as ``_ppo_update`` calls it (proximal
  log-probs = the old ones: no decoupled loss), vanilla (``c_clip`` = dual clip) and gspo
  (``importance_sampling_level="sequence"``); token-mean over the micro-batch (AReaL's engine
  weighs micro-batches by their token share; not called here: no ``denominators``).
- ``value_loss``: the critic's ``ppo_loss_fn`` (trainer/ppo/critic.py) over
  ``ppo_critic_loss_fn`` (mse: ``0.5 * max`` of the unclipped and the old-value-clipped squared
  errors), token-mean over the micro-batch (no ``denominators``, as the policy loss);
  ``critic/vf_clipfrac`` is the ``clip_ratio`` it logs.
- ``train_step`` / ``replay``: AReaL's own FSDP engine and ``PPOActor`` update on CPU
  (areal_train.py); ``supports`` names every setting it does not map.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
from types import SimpleNamespace

import torch

from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import TargetAdapter
from rlaudit.targets.contract.declare import Difference
from rlaudit.targets.peers import areal_train
from rlaudit.targets.peers.openrlhf_declared import KL_CLAMP_CASES

PINNED = "1.0.4"
BLOB = "https://github.com/inclusionAI/AReaL/blob/v{v}/areal/"

#: rlaudit estimator -> (reward_norm as NormConfig kwargs or None, batch advantage norm, GAE)
ESTIMATORS = {
    "gae": (None, True, True),
    "reinforce_plus_plus": (None, True, False),
    "grpo": (dict(mean_level="group", std_level="group"), False, False),
    "drgrpo": (dict(mean_level="group", std_level=None), False, False),
    "rloo": (dict(mean_level="group", mean_leave1out=True, std_level=None), False, False),
    "reinforce_plus_plus_baseline": (dict(mean_level="group", std_level=None), True, False),
}
LEVELS = {"vanilla": "token", "gspo": "sequence"}


@functools.lru_cache(maxsize=None)
def import_areal():
    """AReaL's modules this adapter calls (InputError when AReaL is not importable)."""
    try:
        import areal  # noqa: F401  # lazy: AReaL is optional, imported when audited
        mods = {k: importlib.import_module(f"areal.{v}") for k, v in {
            "cli": "api.cli_args", "actor": "trainer.ppo.actor", "data": "utils.data",
            "stats": "utils.stats_tracker", "critic": "trainer.ppo.critic"}.items()}
    except ImportError as e:
        raise InputError(f"AReaL is not importable ({e}); install it with `make peers` "
                         f"(requirements/peers/areal-{PINNED}.txt, docs/peers.md)",
                         key="--target") from None
    return SimpleNamespace(version=importlib.metadata.version("areal"), **mods)


@contextlib.contextmanager
def _quiet(logger):
    """PPOActor's constructor logs its configuration (INFO) through AReaL's own stdout handler,
    which would corrupt ``--json``: that logger is off for the constructor only."""
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def _group_order(uid: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(row order putting each group's rows together, group size), or None when the groups'
    sizes differ (AReaL normalises ``group_size`` consecutive rows)."""
    _, inv, counts = torch.unique(uid, return_inverse=True, return_counts=True)
    if len(uid) == 0 or bool((counts != counts[0]).any()):
        return None
    return torch.argsort(inv, stable=True), int(counts[0])


def _span(mask: torch.Tensor) -> torch.Tensor:
    """[B]: one past each row's last valid token (0 without one): the response AReaL holds."""
    pos = torch.arange(1, mask.shape[1] + 1)
    return torch.where(mask, pos, 0).amax(dim=1) if mask.shape[1] else torch.zeros(len(mask))


def sequence_batch(mask, rewards, token_rewards, values) -> dict:
    """AReaL's padded sequence batch for rows of one prompt token plus their response: width
    ``R + 2`` so that no row fills it (a full row is AReaL's "no EOS", which bootstraps)."""
    b, r = mask.shape
    s = r + 2
    span = _span(mask).long()
    attn = (torch.arange(s).unsqueeze(0) < (span + 1).unsqueeze(1)).long()

    def at_tokens(x):       # response index j -> sequence position 1 + j (before AReaL's roll)
        out = torch.zeros(b, s, dtype=torch.float32)
        out[:, 1:1 + r] = x
        return out

    def at_positions(x):    # already in AReaL's rolled convention: position j
        out = torch.zeros(b, s, dtype=torch.float32)
        out[:, :r] = x
        return out

    data = {"input_ids": torch.zeros(b, s, dtype=torch.long), "attention_mask": attn,
            "loss_mask": at_tokens(mask.float()).bool(), "logprobs": at_tokens(torch.zeros(b, r)),
            "ref_logp": at_positions(token_rewards), "rewards": rewards.to(torch.float32)}
    if values is not None:
        data["values"] = at_positions(values)
    return data


def _differences(version: str) -> tuple:
    blob = BLOB.format(v=version)
    return (
        Difference(
            "grpo-std-eps-1e-5",
            reason="group reward normalisation divides by (group std + eps), NormConfig's "
                   "default eps 1e-5; verl and rlaudit use 1e-6",
            link=blob + "api/cli_args.py (NormConfig.eps)",
            checks=("compute_advantages:*",), convention={"grpo_std_eps": 1e-5}),
        Difference(
            "normalise-by-std-plus-eps",
            reason="batch advantage normalisation divides by (std + 1e-5), NormConfig's default "
                   "eps; verl and rlaudit multiply by rsqrt(var + 1e-8): advantages differ by "
                   "~1e-5 / std relative",
            link=blob + "utils/data.py (Normalization.__call__)",
            checks=("compute_advantages:parity",),
            cases=tuple(f"{label} advantages on" for label in (
                "gae gamma=0.9 lam=0.95", "reinforce_plus_plus gamma=0.9",
                "reinforce_plus_plus_baseline"))),
        Difference(
            "singleton-group-mean-is-itself",
            reason="a group of one row is centred on its own mean (advantage 0) unless "
                   "mean_leave1out; verl and rlaudit use mean 0 for a singleton (advantage = "
                   "score)",
            link=blob + "utils/data.py (Normalization.__call__)",
            checks=("compute_advantages:parity",),
            cases=tuple(f"{e} {w} on one-row" for e in ("grpo norm_adv_by_std_in_grpo=True",
                                                         "grpo norm_adv_by_std_in_grpo=False",
                                                         "drgrpo", "reinforce_plus_plus_baseline")
                        for w in ("advantages", "returns"))),
        Difference(
            "baseline-returns-before-normalisation",
            reason="returns are the GAE returns before the batch advantage normalisation: for "
                   "reinforce_plus_plus_baseline the group-centred rewards (only a critic reads "
                   "returns; this estimator has none); rlaudit (verl) returns the whitened "
                   "advantages",
            link=blob + "trainer/ppo/actor.py (PPOActor._compute_advantages)",
            checks=("compute_advantages:parity",),
            cases=("reinforce_plus_plus_baseline returns on",)),
        Difference(
            "kl-value-clamp-10",
            reason="KLEstimator clamps every estimator's per-token value to [-10, 10] "
                   "(apply_clamp=True; k1 and k2 too, rlaudit clamps k3 only), with gradient 0 "
                   "where the clamp acts; the fixed stage cases stay far inside it",
            link=blob + "utils/data.py (KLEstimator._compute_approx_kl)",
            checks=("kl_penalty:parity",), cases=KL_CLAMP_CASES),
        Difference(
            "gspo-sequence-gradient",
            reason="GSPO's sequence ratio is differentiated through the sequence mean",
            link=blob + "utils/functional/functional.py "
                        "(_compute_sequence_level_ratio_and_advantages)",
            checks=("policy_loss:*",), convention={"gspo_gradient": "sequence"}),
        Difference(
            "gspo-sequence-mean-advantage",
            reason="GSPO replaces each token's advantage by its sequence's mean advantage "
                   "(the same for outcome advantages, constant over a row); rlaudit keeps the "
                   "per-token advantages",
            link=blob + "utils/functional/functional.py "
                        "(_compute_sequence_level_ratio_and_advantages)",
            checks=("policy_loss:parity",), cases=("gspo/",)),
    )


class ArealAdapter(TargetAdapter):
    """AReaL's advantage estimators, KL estimators and actor loss."""

    name = "areal"
    precision = "float32"
    advantage_estimators = tuple(ESTIMATORS)
    kl_estimators = ("k1", "k2", "k3")
    loss_modes = tuple(LEVELS)
    loss_agg_modes = ("token-mean",)
    #: train_step: AReaL's FSDP engine on its CPU platform, float32 (areal_train.py)
    train_precision = "float32"
    metric_names = tuple(ours for ours, _sign in areal_train.METRICS.values())

    def __init__(self):
        self.mods = import_areal()
        self.version = self.mods.version
        self.name = f"areal-{self.version}"     # the version column, as every peer
        self.differences = _differences(self.version)

    # ---- advantages --------------------------------------------------------------------------
    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           values=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        if estimator not in ESTIMATORS:
            raise NotImplementedError(f"AReaL has no {estimator} estimator")
        reward_norm, batch_norm, gae = ESTIMATORS[estimator]
        if estimator == "grpo" and not norm_adv_by_std_in_grpo:
            reward_norm = ESTIMATORS["drgrpo"][0]
        mask = response_mask.bool()
        b = len(mask)
        order, n = torch.arange(b), 1
        if reward_norm is not None:
            grouping = _group_order(uid)
            if grouping is None:
                raise NotImplementedError("AReaL normalises rewards over group_size consecutive "
                                          "rows: every group must have the same size")
            order, n = grouping
        rewards = token_level_rewards.detach()
        if reward_norm is not None:      # outcome: the row's score as the sample reward
            scalar, per_token = torch.where(mask, rewards, 0.0).sum(-1), torch.zeros_like(rewards)
        else:
            scalar, per_token = torch.zeros(b), rewards
        cli = self.mods.cli
        config = cli.PPOActorConfig(
            kl_ctl=1.0, kl_estimator="k1", discount=float(gamma),
            gae_lambda=float(lam) if gae else 1.0,
            reward_norm=None if reward_norm is None else cli.NormConfig(group_size=n,
                                                                        **reward_norm),
            adv_norm=cli.NormConfig(mean_level="batch", std_level="batch") if batch_norm
            else None)
        with _quiet(self.mods.actor.logger):
            actor = self.mods.actor.PPOActor(config, engine=None)
        vals = values.detach()[order] if (gae and values is not None) else None
        data = sequence_batch(mask[order], scalar[order], per_token[order], vals)
        out = actor._compute_advantages(data)
        r = mask.shape[1]
        adv, ret = torch.empty(b, r), torch.empty(b, r)
        adv[order], ret[order] = out["advantages"][:, :r].float(), out["returns"][:, :r].float()
        return adv, ret

    # ---- KL ----------------------------------------------------------------------------------
    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        if kind not in self.kl_estimators:
            raise NotImplementedError(f"AReaL has no {kind} KL estimator")
        return self.mods.data.KLEstimator(kind)(log_prob, ref_log_prob)

    # ---- policy loss -------------------------------------------------------------------------
    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c):
        """``grpo_loss_fn`` as the actor's update calls it; metrics as it logs them
        (``clip_ratio``, ``dual_clip_ratio``: token means over the micro-batch)."""
        if loss_mode not in LEVELS or loss_agg_mode != "token-mean":
            raise NotImplementedError(f"AReaL has no {loss_mode}/{loss_agg_mode}")
        mask = response_mask.bool()
        old = old_log_prob.detach().to(torch.float32)     # AReaL's trainer tensors: float32
        data = {"logprobs": old, "advantages": advantages.detach().to(torch.float32),
                "loss_mask": mask, "prox_logp": old}
        stats = self.mods.stats
        stats.DEFAULT_TRACKER.export(reset=True)      # nothing from an earlier call
        loss = self.mods.actor.grpo_loss_fn(
            log_prob.to(torch.float32), torch.zeros_like(old), data, eps_clip=float(clip_ratio_low),
            eps_clip_higher=float(clip_ratio_high),
            c_clip=float(clip_ratio_c) if loss_mode == "vanilla" else None,
            importance_sampling_level=LEVELS[loss_mode])
        logged = stats.DEFAULT_TRACKER.export(reset=True)
        out = {"actor/pg_loss": loss.detach().clone()}
        if "clip_ratio/avg" in logged:
            out["actor/pg_clipfrac"] = float(logged["clip_ratio/avg"])
        return loss, out

    # ---- value loss --------------------------------------------------------------------------
    def value_loss(self, *, vpreds, values, returns, response_mask, cliprange_value,
                   loss_agg_mode):
        """The critic's ``ppo_loss_fn`` as its update calls it: the critic head's ``[B, T, 1]``
        output, float32 inputs (``ppo_critic_loss_fn`` asserts float32)."""
        if loss_agg_mode != "token-mean":
            raise NotImplementedError(f"AReaL's critic has no {loss_agg_mode} value loss")
        data = {"values": values.detach().to(torch.float32),
                "returns": returns.detach().to(torch.float32), "loss_mask": response_mask.bool()}
        stats = self.mods.stats
        stats.DEFAULT_TRACKER.export(reset=True)      # nothing from an earlier call
        loss = self.mods.critic.ppo_loss_fn(vpreds.unsqueeze(-1), data,
                                            eps_clip=float(cliprange_value))
        logged = stats.DEFAULT_TRACKER.export(reset=True)
        out = {"critic/vf_loss": float(loss.detach())}
        if "clip_ratio/avg" in logged:
            out["critic/vf_clipfrac"] = float(logged["clip_ratio/avg"])
        return loss, out

    # ---- the whole training step --------------------------------------------------------------
    def supports(self, config):
        why = areal_train.unsupported(config)
        return not why, "; ".join(why)

    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu"):
        """AReaL's own update (areal_train), ``steps`` times on ``batch``, on CPU;
        ``ref_model_path`` is unused (no KL term is mapped: :meth:`supports`)."""
        if device != "cpu":
            raise NotImplementedError("AReaL's train_step is mapped on CPU only")
        why = areal_train.rows_unsupported(config, len(batch))
        if why:
            raise NotImplementedError(why)
        (result,) = areal_train.train_steps(model_path, [(batch, config, steps)],
                                            version=self.version)
        return areal_train.output(result, batch)

    def replay(self, request):
        """Every supported variant of a scenario in one rank (areal_train.replay)."""
        return areal_train.replay(self, request)
