"""OpenRLHF (OpenRLHF/OpenRLHF, pinned ``openrlhf==0.11.2``) behind rlaudit's adapter API.

    rlaudit run --target openrlhf               # OpenRLHF from the environment, else <peers dir>
    rlaudit run --target openrlhf==0.10.2       # the release before the empty-row fixes

Every stage calls OpenRLHF's own code; this module only converts tensors and builds the
arguments its trainer would pass:

- ``compute_advantages``: ``RemoteExperienceMaker.compute_advantages_and_returns`` on one
  ``Experience`` (gae, reinforce, reinforce_baseline, group_norm, dr_grpo, rloo). OpenRLHF's
  rewards are one scalar per sample (placed on the last action token by ``compute_reward``) plus
  ``-kl_coef * kl`` per token: outcome estimators get the row's score (its masked reward sum) as
  that scalar; token-level estimators (gae, reinforce) get rlaudit's token rewards exactly
  through the per-token term (scalar 0, ``kl = -token_level_rewards``, ``kl_coef = 1``). Groups
  are OpenRLHF's: ``n_samples_per_prompt`` consecutive samples per prompt in original order;
  rows are put in that order through ``Experience.index`` (the trainer's own reordering).
- ``apply_kl_in_reward``: ``compute_approx_kl`` then ``compute_reward``, as
  ``RemoteExperienceMaker.make_experience`` and ``compute_advantages_and_returns`` call them.
- ``kl_penalty``: ``compute_approx_kl`` (k1, k2, k3; k1+ and k3+ as ``unbiased_gradient=True``
  without ``log_probs_old``: the estimator's value, k2's gradient).
- ``agg_loss``: ``aggregate_loss`` (token-mean, seq-mean-token-mean), global counts as the
  actor's ``loss_batch_info`` (``batch_num_tokens``, ``global_batch_size``, ``dp_size=1``).
- ``policy_loss``: ``PolicyLoss`` (ppo with ``dual_clip``, gspo), called as the actor's
  ``training_step`` calls it.
- ``value_loss``: ``ValueLoss`` as the critic builds it (``ValueLoss(value_clip)``, so
  token-mean only: ``PPOCritic.training_step``), global counts as ``loss_batch_info``. It logs no
  clip fraction.
- ``train_step``: not on CPU (OpenRLHF calls CUDA by name: ``openrlhf_train.BLOCKERS``, named
  in every run-level check's n/a); the CUDA path is ``openrlhf_train`` and its gpu test.

Precision: OpenRLHF computes the KL estimators in float32 (``.float()``) and whitens advantages
in float32; its losses keep the inputs' dtype (float64 here).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from rlaudit.algo.agg import Denominators
from rlaudit.targets.contract.adapter import TargetAdapter
from rlaudit.targets.peers import openrlhf_train
from rlaudit.targets.peers.openrlhf_declared import differences
from rlaudit.targets.peers.openrlhf_import import import_openrlhf

#: the pinned release this adapter was written against (docs/peers.md)
PINNED = "0.11.2"

#: rlaudit estimator -> OpenRLHF ``algo.advantage.estimator`` (grpo without std: dr_grpo)
ESTIMATORS = {"gae": "gae", "reinforce_plus_plus": "reinforce", "grpo": "group_norm",
              "drgrpo": "dr_grpo", "rloo": "rloo",
              "reinforce_plus_plus_baseline": "reinforce_baseline"}
#: OpenRLHF estimators that read the per-prompt group (train_ppo_ray.py asserts n > 1 for them)
GROUPED = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")
#: rlaudit loss_agg_mode -> OpenRLHF ``token_level_loss`` (``actor.loss_agg_mode``)
TOKEN_LEVEL = {"token-mean": True, "seq-mean-token-mean": False}
#: rlaudit loss mode -> OpenRLHF ``actor.policy_loss_type``
LOSS_TYPES = {"vanilla": "ppo", "gspo": "gspo"}
#: rlaudit KL estimator -> (OpenRLHF ``kl_estimator``, ``unbiased_gradient``)
KL_KINDS = {"k1": ("k1", False), "k2": ("k2", False), "k3": ("k3", False),
            "k1+": ("k1", True), "k3+": ("k3", True)}


def _args(estimator: str, n: int, gamma: float, lam: float) -> SimpleNamespace:
    """The trainer arguments ``compute_advantages_and_returns`` reads (train_ppo_ray.py's
    defaults: no reward clip, no length penalties, advantages whitened)."""
    ns = SimpleNamespace
    return ns(rollout=ns(n_samples_per_prompt=n),
              algo=ns(advantage=ns(estimator=estimator, gamma=gamma, lambd=lam,
                                   no_std_norm=False)),
              reward=ns(clip_range=None, overlong_buffer_len=None,
                        stop_properly_penalty_coef=None))


def _group_order(uid: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(position of each row in prompt order, group size) when every group has the same size;
    None otherwise (OpenRLHF reshapes the rewards to ``[prompts, n_samples_per_prompt]``)."""
    _, inv, counts = torch.unique(uid, return_inverse=True, return_counts=True)
    if len(uid) == 0 or bool((counts != counts[0]).any()):
        return None
    order = torch.argsort(inv, stable=True)         # rows of prompt 0, then prompt 1, ...
    position = torch.empty_like(order)
    position[order] = torch.arange(len(uid))
    return position, int(counts[0])


class OpenRLHFAdapter(TargetAdapter):
    """OpenRLHF's advantage estimators, KL estimators, loss aggregation and policy losses."""

    name = "openrlhf"
    precision = "float64"
    stage_precision = {"kl_penalty": "float32", "apply_kl_in_reward": "float32",
                       "compute_advantages": "float32"}
    # the actor logs ppo_clip_ratio / ppo_kl as each micro-batch's local masked mean, averaged
    # over micro-batches (PolicyActor.ppo_train's status_mean); the loss is a contribution
    metric_reduction = {"actor/pg_loss": "contribution", "*": "microbatch-mean"}
    advantage_estimators = tuple(ESTIMATORS)
    loss_modes = tuple(LOSS_TYPES)
    # GSPO forces sequence-level loss (PolicyLoss.__init__: token_level_loss = False)
    loss_agg_modes = {"gspo": ("seq-mean-token-mean",), "*": tuple(TOKEN_LEVEL),
                      # the critic builds ValueLoss(value_clip): token_level_loss's default
                      "value": ("token-mean",)}

    def __init__(self):
        self.orl = import_openrlhf()
        self.version = self.orl.version
        self.name = f"openrlhf-{self.version}"     # the version column, as every peer
        self.kl_estimators = tuple(k for k, (_, unbiased) in KL_KINDS.items()
                                   if not unbiased or self._has_unbiased_kl())
        self.differences = differences(self.version, self.orl)
        if not hasattr(self.orl.loss, "aggregate_loss"):
            self.agg_loss = None            # before 0.10.3 the losses reduced inline

    def _has_unbiased_kl(self) -> bool:
        return "unbiased_gradient" in inspect.signature(self.orl.utils.compute_approx_kl).parameters

    # ---- the whole training step ----------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        """OpenRLHF's actor step calls CUDA by name (openrlhf_train.BLOCKERS): run-level checks
        are n/a with those lines, and the reference is not replayed for nothing. On CUDA the
        step is driven by the gpu test only, not by ``run --target`` (bf16 parameters)."""
        return False, openrlhf_train.blockers(self.version)

    def supports(self, config):
        return self.available()

    def train_step(self, **_):
        """Never called through ``run --target`` (:meth:`available`); here so that the run-level
        checks say why OpenRLHF's step does not run instead of that it has none."""
        raise NotImplementedError(openrlhf_train.blockers(self.version))

    # ---- advantages --------------------------------------------------------------------------
    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           values=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        name = ESTIMATORS.get(estimator)
        if name is None:
            raise NotImplementedError(f"OpenRLHF has no {estimator} estimator")
        if name == "group_norm" and not norm_adv_by_std_in_grpo:
            name = "dr_grpo"
        mask = response_mask.bool()
        rewards = token_level_rewards.detach().to(torch.float64)
        b = len(rewards)
        if name in GROUPED:
            grouping = _group_order(uid)
            if grouping is None or grouping[1] < 2:
                raise NotImplementedError(
                    f"OpenRLHF's {name} needs every prompt to have the same number of samples, "
                    f"n_samples_per_prompt > 1 (train_ppo_ray.py asserts it)")
            position, n = grouping
            # the sample reward: the row's score; no per-token term
            scalar, per_token = torch.where(mask, rewards, 0.0).sum(-1), torch.zeros_like(rewards)
        else:
            position, n = torch.arange(b), 1
            scalar, per_token = torch.zeros(b, dtype=rewards.dtype), -rewards
        exp = self.orl.experience.Experience(
            action_mask=mask, rewards=scalar, kl=per_token, index=position.tolist(),
            values=None if values is None else values.detach().to(torch.float64))
        args = _args(name, n, float(gamma), float(lam))
        maker = self.orl.maker.RemoteExperienceMaker(
            None, None, None, None, kl_controller=SimpleNamespace(value=1.0),
            strategy=SimpleNamespace(args=args), tokenizer=None)
        out, = maker.compute_advantages_and_returns([exp])
        return out.advantages, out.returns

    # ---- KL ----------------------------------------------------------------------------------
    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        if kind not in self.kl_estimators:
            raise NotImplementedError(f"OpenRLHF has no {kind} KL estimator")
        theirs, unbiased = KL_KINDS[kind]
        kw = {"unbiased_gradient": True} if unbiased else {}
        return self.orl.utils.compute_approx_kl(log_prob, ref_log_prob, kl_estimator=theirs, **kw)

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        """``make_experience``'s stored KL of the rollout policy against the reference, then
        ``compute_reward``: the sample's score on its last action token minus ``kl_coef * kl``.
        OpenRLHF's score is one number per sample: rows whose score is not on their last valid
        token are not expressible (NotImplementedError)."""
        if kl_penalty not in KL_KINDS or KL_KINDS[kl_penalty][1]:
            raise NotImplementedError(f"OpenRLHF has no {kl_penalty} KL estimator in the reward")
        mask = response_mask.bool()
        scores = torch.where(mask, token_level_scores, 0.0)
        score = scores.sum(-1)
        last = mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1)
        if bool((scores != 0).sum(-1).gt(1).any()) or bool(
                (scores.gather(1, last.unsqueeze(1)).squeeze(1) != score).any()):
            raise NotImplementedError("OpenRLHF's reward is one scalar per sample, on its last "
                                      "action token")
        kl = self.orl.utils.compute_approx_kl(old_log_probs, ref_log_probs,
                                              kl_estimator=KL_KINDS[kl_penalty][0])
        rewards = self.orl.utils.compute_reward(score, float(kl_coef), kl, action_mask=mask)
        return rewards, kl.clone()

    # ---- losses ------------------------------------------------------------------------------
    @staticmethod
    def _batch_info(denominators: Denominators | None) -> dict:
        """The actor's ``loss_batch_info`` (utils/loss_utils.py): global counts, one rank."""
        if denominators is None:
            return {}
        return {"dp_size": 1, "batch_num_tokens": denominators.tokens,
                "global_batch_size": denominators.seqs}

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        if mode not in TOKEN_LEVEL:
            raise NotImplementedError(f"OpenRLHF has no {mode} aggregation")
        return self.orl.loss.aggregate_loss(loss_mat, mask.to(loss_mat.dtype),
                                            token_level_loss=TOKEN_LEVEL[mode],
                                            **self._batch_info(denominators))

    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                    denominators=None):
        """``PolicyLoss`` as ``training_step`` calls it. rlaudit's vanilla loss always has the
        dual clip: ``dual_clip=clip_ratio_c``; GSPO has none (``dual_clip`` unset). Metrics:
        ``ppo_clip_ratio`` and ``ppo_kl`` (local masked means) and the loss itself."""
        if loss_mode not in LOSS_TYPES or loss_agg_mode not in TOKEN_LEVEL:
            raise NotImplementedError(f"OpenRLHF has no {loss_mode}/{loss_agg_mode}")
        fn = self.orl.loss.PolicyLoss(
            clip_eps_low=float(clip_ratio_low), clip_eps_high=float(clip_ratio_high),
            dual_clip=float(clip_ratio_c) if loss_mode == "vanilla" else None,
            token_level_loss=TOKEN_LEVEL[loss_agg_mode], policy_loss_type=LOSS_TYPES[loss_mode])
        info = self._batch_info(denominators)
        if info and "batch_num_tokens" not in inspect.signature(fn.forward).parameters:
            raise NotImplementedError(f"OpenRLHF {self.version}'s PolicyLoss takes no global "
                                      f"counts (each micro-batch is reduced on its own)")
        mask = response_mask.bool()
        out = fn(log_prob, old_log_prob.detach(), advantages.detach(), action_mask=mask, **info)
        loss, clip_ratio, ppo_kl = out[0], out[1], out[2]
        return loss, {"actor/pg_loss": loss.detach().clone(),
                      "actor/pg_clipfrac": float(clip_ratio), "actor/ppo_kl": float(ppo_kl)}

    def value_loss(self, *, vpreds, values, returns, response_mask, cliprange_value,
                   loss_agg_mode, denominators=None):
        """``ValueLoss(value_clip)`` as ``PPOCritic.training_step`` calls it:
        ``0.5 * max((v - G)^2, (V + clamp(v - V, -c, c) - G)^2)`` aggregated token-mean, over
        the global token count when given (0.10.3 and later)."""
        if loss_agg_mode != "token-mean":
            raise NotImplementedError(f"OpenRLHF's critic has no {loss_agg_mode} value loss")
        fn = self.orl.loss.ValueLoss(float(cliprange_value))
        info = self._batch_info(denominators)
        if info and "batch_num_tokens" not in inspect.signature(fn.forward).parameters:
            raise NotImplementedError(f"OpenRLHF {self.version}'s ValueLoss takes no global "
                                      f"counts (each micro-batch is reduced on its own)")
        loss = fn(vpreds, values.detach(), returns.detach(), action_mask=response_mask.bool(),
                  **info)
        return loss, {"critic/vf_loss": float(loss.detach())}
