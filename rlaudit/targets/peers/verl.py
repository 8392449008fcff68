"""verl's real functions behind rlaudit's adapter API (pinned: verl 0.9.1 and 0.7.1).

    make peers                          # .peers/verl-0.9.1, .peers/verl-0.7.1
    rlaudit run --target verl==0.9.1    # or --target verl: an installed verl, else the newest

Nothing of verl is re-implemented here: each stage converts rlaudit's tensors to what verl's
trainer hands the function (float32, verl's mask dtypes, a ``DataProto`` with string uids, an
``ActorConfig``), calls it, and converts back. What is called, per stage:

- ``compute_advantages``: ``verl.trainer.ppo.ray_trainer.compute_advantage`` (the trainer's
  dispatcher; it calls ``core_algos``' registered estimator). rlaudit's ``drgrpo`` is verl's
  ``grpo`` with ``norm_adv_by_std_in_grpo=False`` (how verl spells Dr.GRPO); the vectorized
  implementations are :class:`VerlVectorizedAdapter`'s. verl's other estimators (remax, opo,
  grpo_passk, gpg, gdpo, optimal_token_baseline, ...) have no rlaudit reference and are not run.
- ``apply_kl_in_reward``: ``ray_trainer.apply_kl_penalty`` with a ``FixedKLController``. verl
  stores no KL tensor (it logs ``actor/reward_kl_penalty``, a scalar computed from it): the
  ``kl`` returned is the tensor verl's own ``core_algos.kl_penalty`` returned inside that call,
  captured by wrapping the function for the duration of the call.
- ``kl_penalty``: ``core_algos.kl_penalty``; ``agg_loss``: ``core_algos.agg_loss``, with rlaudit's
  global ``Denominators`` mapped to verl's ``batch_num_tokens`` / ``global_batch_size`` /
  ``loss_scale_factor`` and ``dp_size=1`` (verl multiplies by ``dp_size`` because DDP/FSDP then
  *average* gradients over ranks; rlaudit's contributions are summed).
- ``policy_loss``: the registered loss (``get_policy_loss_fn``: vanilla, gspo, cispo) with an
  ``FSDPActorConfig`` whose ``global_batch_info`` is filled as ``verl/workers/utils/losses.py``
  fills it.
- ``make_microbatches``: the DP split of the dispatcher (``DataProto.chunk``), then per rank the
  actor's micro-batching: verl >= 0.8 the engine's ``prepare_micro_batches`` (dynamic batching
  through ``rearrange_micro_batches``, micro-batch counts all-reduced over the DP group), verl
  0.7 the legacy ``DataParallelPPOActor``'s (``prepare_dynamic_batch`` / ``DataProto.split``).
  DP ranks run as threads over a stand-in for ``torch.distributed``
  (``verl_threads.ThreadGroup``) so verl's own collective logic runs unchanged in one process.

- ``train_step``: verl's own training step, one column per engine (``engines``, verl_step.py):
  ``verl-fsdp-<version>`` (the FSDP engine worker on 0.9+, verl_train.py; the legacy
  ``DataParallelPPOActor`` on 0.7, verl_dp_actor.py) and ``verl-megatron-<version>`` (the legacy
  ``MegatronPPOActor`` on 0.7, verl_megatron.py; unsupported on 0.9+, verl_mcore.py), every
  variant of a scenario in one group of ranks; ``supports`` says what it cannot map.

docs/peers.md lists per version what is covered, the declared differences and what is n/a.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlaudit.algo.agg import Denominators
from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import TargetAdapter
from rlaudit.targets.contract.declare import Difference, source_line
from rlaudit.targets.peers import verl_compat
from rlaudit.targets.peers.registry import import_advice
from rlaudit.targets.peers import verl_dp, verl_step
from rlaudit.targets.peers.verl_layout import verl_tensors
from rlaudit.targets.peers.verl_threads import ThreadGroup


#: verl computes everything the stages cover in float32 (log-probs, rewards, losses)
DTYPE = torch.float32
#: verl at a release tag (a fork's local version "+..." links to the release it is based on)
_BLOB = "https://github.com/verl-project/verl/blob/v{v}/"


def _differences(version: str, core) -> tuple:
    """The documented, deliberate ways verl ``version`` differs from rlaudit's reference
    (docs/peers.md, "verl"), linked to the lines of the installed ``core_algos``."""
    path = _BLOB.format(v=version.split("+")[0]) + "verl/trainer/ppo/core_algos.py"
    return (
        Difference(
            "outcome-score-unmasked-sum",
            reason="outcome estimators (grpo, rloo, reinforce_plus_plus_baseline) score a row by "
                   "token_level_rewards.sum(dim=-1) over every position, masked ones included: "
                   "verl's reward managers write the score on the last response token only "
                   "(the mask was dropped on purpose in verl PR #152)",
            link=path + source_line(core.compute_grpo_outcome_advantage, "token_level_rewards.sum"),
            checks=("compute_advantages:*",), convention={"outcome_score": "unmasked-sum"}),
        Difference(
            "agg-loss-nan-on-empty",
            reason="agg_loss without global counts divides by the batch's own token / sequence "
                   "count, 0/0 = NaN when no token is valid; verl's trainer always passes global "
                   "counts (verl/workers/utils/losses.py), with which such a micro-batch gives 0",
            link=path + source_line(core.agg_loss),
            checks=("agg_loss:parity",), cases=("without a valid token",)),
    )


class VerlAdapter(TargetAdapter):
    """The installed verl's stages (see the module docstring)."""

    name = "verl"
    precision = "float32"
    #: verl's clip/KL metrics (pg_clipfrac, pg_clipfrac_lower, ppo_kl) are each micro-batch's
    #: local mean, reduced by mean (``AggregationType.MEAN`` in verl/workers/utils/losses.py,
    #: verl PR #4778); ``actor/pg_loss`` is the loss value, reduced by sum
    #: (``AggregationType.SUM``) whenever global counts are given: a contribution
    #: train_step: ``actor/loss`` is the sum of the micro-batches' losses (engine_workers.py:
    #: 194), ``actor/entropy`` (verl's ``actor/entropy_loss``, verl_step) is reduced like
    #: ``actor/pg_loss``: contributions
    metric_reduction = {"actor/pg_loss": "contribution", "actor/loss": "contribution",
                        "actor/entropy": "contribution", "*": "microbatch-mean"}
    #: ``train_step``: verl's FSDP engine trains in fp32 (verl_train.py)
    train_precision = "float32"
    metric_names = verl_step.TRAIN_METRICS
    #: data-parallel ranks of ``train_step`` (verl's FSDP engine over gloo)
    dp = 1
    advantage_estimators = ("gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus",
                            "reinforce_plus_plus_baseline")
    loss_modes = ("vanilla", "gspo", "cispo")
    #: rlaudit estimator -> the verl estimator run for it (default: the same name)
    estimator_impl: dict[str, str] = {"drgrpo": "grpo"}

    def __init__(self):
        try:
            verl = importlib.import_module("verl")
            self.core = importlib.import_module("verl.trainer.ppo.core_algos")
            self.trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
            self.protocol = importlib.import_module("verl.protocol")
        except ImportError as e:
            raise InputError(f"cannot import verl's modules: {import_advice(e)}",
                             key="--target") from None
        self.version = str(verl.__version__)
        self.name = f"verl-{self.version}"
        self.differences = (_differences(self.version, self.core)
                            + verl_compat.differences(self.version, self.core))
        #: verl < 0.8 trains with the legacy FSDP worker's DataParallelPPOActor by default
        #: (``trainer.use_legacy_worker_impl: auto``); 0.8+ has only the engine workers
        self.legacy_actor = importlib.util.find_spec("verl.workers.actor") is not None
        #: verl's engines, each its own column of train_step (verl_step.VerlEngine): the FSDP
        #: one first, the Megatron one compared with it (rlaudit/targets/run/engines.py)
        impls = verl_step.engines_of()
        self.engines = tuple(verl_step.VerlEngine(self, e, impls[e])
                             for e in ("fsdp", "megatron") if e in impls)
        if impls.get("fsdp") == "engine":
            # the FSDP engine again over two ranks: per-rank normalisers (verl_dp)
            self.engines += (verl_step.VerlEngine(self, "fsdp", "engine", dp=verl_dp.DP),)
            self.differences += verl_step.train_differences(self.version)
            self.metric_reduction = {**self.metric_reduction, **verl_step.TRAIN_REDUCTION}
        elif "legacy" in impls.values():
            # metric_reduction stays the stage functions' (pg_loss a contribution under global
            # counts): the legacy actors pass none, the bug of verl #5863 (docs/peers.md); the
            # FSDP one logs actor/entropy as each micro-batch's local mean, averaged
            # (dp_actor.py:643; the Megatron one logs none, verl #6016)
            self.metric_names = verl_step.MEGATRON_METRICS
            self.metric_reduction = {**self.metric_reduction, "actor/entropy": "microbatch-mean"}
            self.differences += verl_step.legacy_differences(self.version)
        self.peer = str(Path(verl.__file__).parent.parent)

    # ---- conversions -----------------------------------------------------------------------
    @staticmethod
    def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(DTYPE)

    @staticmethod
    def _int_mask(mask: torch.Tensor) -> torch.Tensor:
        """verl's trainer-side ``response_mask``: a slice of the int64 attention mask."""
        return mask.to(torch.int64)

    @staticmethod
    def _uids(uid: torch.Tensor) -> np.ndarray:
        """verl keeps group ids as a numpy object array of strings (``non_tensor_batch``)."""
        return np.array([str(u) for u in uid.tolist()], dtype=object)

    def _proto(self, tensors: dict, uid: torch.Tensor | None = None):
        non = {"uid": self._uids(uid)} if uid is not None else None
        return self.protocol.DataProto.from_dict(tensors=tensors, non_tensors=non)

    # ---- stages ------------------------------------------------------------------------------
    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           values=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        from verl.trainer.config import AlgoConfig  # lazy: verl is optional, imported when audited
        name = self.estimator_impl.get(estimator, estimator)
        norm = False if estimator == "drgrpo" else bool(norm_adv_by_std_in_grpo)
        if name not in self.core.ADV_ESTIMATOR_REGISTRY:
            raise NotImplementedError(f"verl {self.version} has no estimator {name!r}")
        tensors = {"token_level_rewards": self._f32(token_level_rewards),
                   "response_mask": self._int_mask(response_mask)}
        if values is not None:
            tensors["values"] = self._f32(values)
        config = AlgoConfig(gamma=float(gamma), lam=float(lam), adv_estimator=name,
                            norm_adv_by_std_in_grpo=norm)
        data = self.trainer.compute_advantage(self._proto(tensors, uid), adv_estimator=name,
                                              gamma=float(gamma), lam=float(lam),
                                              norm_adv_by_std_in_grpo=norm, config=config)
        return data.batch["advantages"], data.batch["returns"]

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty, **_):
        captured: list[torch.Tensor] = []
        real = self.core.kl_penalty

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            captured.append(out)
            return out

        data = self._proto({"token_level_scores": self._f32(token_level_scores),
                            "old_log_probs": self._f32(old_log_probs),
                            "ref_log_prob": self._f32(ref_log_probs),
                            "response_mask": self._int_mask(response_mask)})
        self.core.kl_penalty = spy
        try:
            data, _metrics = self.trainer.apply_kl_penalty(
                data, kl_ctrl=self.core.FixedKLController(kl_coef=float(kl_coef)),
                kl_penalty=kl_penalty)
        except NotImplementedError as e:
            raise NotImplementedError(f"verl {self.version}'s kl_penalty raises "
                                      f"NotImplementedError for {kl_penalty!r}") from e
        finally:
            self.core.kl_penalty = real
        if len(captured) != 1:
            raise RuntimeError(f"expected apply_kl_penalty to call kl_penalty once, it called it "
                               f"{len(captured)} times")
        return data.batch["token_level_rewards"], captured[0]

    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        try:
            return self.core.kl_penalty(self._f32(log_prob), self._f32(ref_log_prob),
                                        kl_penalty=kind)
        except NotImplementedError as e:
            raise NotImplementedError(f"verl {self.version}'s kl_penalty raises "
                                      f"NotImplementedError for {kind!r}") from e

    @staticmethod
    def _global_info(denominators: Denominators | None) -> dict:
        """verl's ``global_batch_info`` for rlaudit's whole-mini-batch counts (see the module
        docstring for ``dp_size=1``); empty (local counts) without them."""
        if denominators is None:
            return {}
        return {"dp_size": 1, "batch_num_tokens": denominators.tokens,
                "global_batch_size": denominators.seqs,
                "loss_scale_factor": denominators.norm_len}

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        if denominators is not None:
            verl_compat.require_global_counts(self.core, release=self.name)
        return self.core.agg_loss(loss_mat=self._f32(loss_mat), loss_mask=mask.bool(),
                                  loss_agg_mode=mode, **self._global_info(denominators))

    def _actor_config(self, loss_mode, loss_agg_mode, low, high, c, denominators):
        # lazy: verl is optional, imported when audited
        from verl.workers.config import FSDPActorConfig
        config = FSDPActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
            clip_ratio=float(low), clip_ratio_low=float(low), clip_ratio_high=float(high),
            clip_ratio_c=float(c), loss_agg_mode=loss_agg_mode,
            policy_loss=_policy_cfg(loss_mode))
        config.global_batch_info.update(self._global_info(denominators))
        return config

    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                    denominators=None):
        """The registered policy loss as the trainer calls it (verl/workers/utils/losses.py::
        ``ppo_loss``: ``response_mask`` as bool). Metrics as ``ppo_loss`` logs them: verl's
        ``pg_metrics`` (each a local masked mean over this call's tokens) and ``actor/pg_loss``,
        the loss value itself (summed over micro-batches under global counts: a contribution,
        :attr:`metric_reduction`)."""
        verl_compat.require_policy_loss(self.core, loss_mode, release=self.name,
                                        global_counts=denominators is not None)
        fn = self.core.get_policy_loss_fn(loss_mode)
        config = self._actor_config(loss_mode, loss_agg_mode, clip_ratio_low, clip_ratio_high,
                                    clip_ratio_c, denominators)
        loss, metrics = fn(old_log_prob=self._f32(old_log_prob), log_prob=self._f32(log_prob),
                           advantages=self._f32(advantages), response_mask=response_mask.bool(),
                           loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=None)
        out = {k: float(v) for k, v in metrics.items()
               if k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl")}
        out["actor/pg_loss"] = float(loss.detach())     # ppo_loss: metrics["actor/pg_loss"]
        return loss, out

    def value_loss(self, **kw):
        """``core_algos.compute_value_loss`` as this release's trainer calls it (verl_compat)."""
        return verl_compat.value_loss(self.core, **kw)
    # ---- the whole training step --------------------------------------------------------------
    def supports(self, config):
        if not self.engines:
            return verl_step.supports(config, engine=None)
        return self.engines[0].supports(config)

    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu"):
        """verl's step on its first engine (:attr:`engines`: FSDP when the release has it);
        ``--target verl`` runs every engine, each its own column."""
        return self.engines[0].train_step(model_path=model_path, ref_model_path=ref_model_path,
                                          batch=batch, config=config, steps=steps,
                                          device=device)

    # ---- micro-batching ----------------------------------------------------------------------
    def make_microbatches(self, batch: RolloutBatch, *, dp_size: int,
                          micro_batch_size: int | None = None,
                          max_token_len: int | None = None) -> list[list[dict]]:
        """The dispatcher's DP split, then this version's actor micro-batching per rank (see
        the module docstring); micro-batches are returned as rlaudit-named tensor dicts."""
        td = verl_tensors(batch)
        shards = self._proto(td).chunk(dp_size)     # the dispatcher: contiguous equal chunks
        if self.legacy_actor:
            per_rank = [self._legacy_micro(s, micro_batch_size, max_token_len) for s in shards]
        else:
            per_rank = ThreadGroup(dp_size).run(
                lambda rank, group: self._engine_micro(shards[rank].batch, group,
                                                       micro_batch_size, max_token_len))
        names = set(batch.tensors)
        return [[{k: v for k, v in mb.items() if k in names} for mb in rank]
                for rank in per_rank]

    def _legacy_micro(self, shard, micro_batch_size, max_token_len) -> list[dict]:
        """verl 0.7 ``DataParallelPPOActor.update_policy`` (dp_actor.py): ``split`` by count, or
        ``prepare_dynamic_batch(mini_batch, max_token_len)`` (no ``dp_group``)."""
        if micro_batch_size is not None:
            micros = shard.split(micro_batch_size)
        else:
            # lazy: verl is optional, imported when audited
            from verl.utils.seqlen_balancing import prepare_dynamic_batch
            micros, _ = prepare_dynamic_batch(shard, max_token_len=max_token_len)
        return [dict(m.batch.items()) for m in micros]

    def _engine_micro(self, td, group, micro_batch_size, max_token_len) -> list[dict]:
        """verl >= 0.8 engine ``forward_backward_batch``: ``prepare_micro_batches(data,
        dp_group, same_micro_num_in_dp=True)`` (verl/workers/engine/utils.py)."""
        # lazy: verl is optional, imported when audited
        from verl.utils import tensordict_utils as tu
        # lazy: verl is optional, imported when audited
        from verl.workers.engine.utils import prepare_micro_batches
        if micro_batch_size is not None:
            tu.assign_non_tensor(td, use_dynamic_bsz=False,
                                 micro_batch_size_per_gpu=micro_batch_size)
        else:
            tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len)
        try:
            micros, _ = prepare_micro_batches(td, dp_group=group, same_micro_num_in_dp=True)
        except AssertionError as e:
            if "divisible" in str(e):
                raise NotImplementedError(f"verl {self.version}: {e}") from e
            raise
        return [{k: v for k, v in m.items() if isinstance(v, torch.Tensor)} for m in micros]


class VerlVectorizedAdapter(VerlAdapter):
    """verl's vectorized implementations of the outcome estimators, through the same trainer
    dispatcher: ``grpo_vectorized`` for grpo and drgrpo, ``rloo_vectorized`` for rloo.

        rlaudit run --target rlaudit.targets.peers.verl:VerlVectorizedAdapter   # verl importable

    Not part of ``--target verl``: it fails on verl 0.9.1 (docs/peers.md): the dispatcher does
    not pass ``norm_adv_by_std_in_grpo`` to ``grpo_vectorized`` (verl PR #7893), and
    ``as_torch_index`` keeps integer group ids as they are instead of numbering them 0..G-1, so
    large or negative uids make ``group_mean_std`` allocate ``max(uid) + 1`` groups or fail.
    """

    advantage_estimators = ("grpo", "drgrpo", "rloo")
    estimator_impl = {"grpo": "grpo_vectorized", "drgrpo": "grpo_vectorized",
                      "rloo": "rloo_vectorized"}

    def __init__(self):
        super().__init__()
        self.name = f"verl-{self.version}-vectorized"
        rloo = self.core.compute_rloo_vectorized_outcome_advantage
        self.differences = self.differences + (Difference(
            "rloo-vectorized-singleton-zero",
            reason="rloo_vectorized gives a prompt with a single response advantage 0 "
                   "(`* (c > 1)`), where verl's rloo and rlaudit use baseline 0 (advantage "
                   "= score)",
            link=_BLOB.format(v=self.version.split("+")[0])
            + "verl/trainer/ppo/core_algos.py" + source_line(rloo, "(c > 1)"),
            checks=("compute_advantages:*",),
            cases=tuple(f"rloo {what} on {case}" for what in ("advantages", "returns")
                        for case in ("ragged", "one-row"))),)


def _policy_cfg(loss_mode: str):
    # lazy: verl is optional, imported when audited
    from verl.workers.config.actor import PolicyLossConfig
    return PolicyLossConfig(loss_mode=loss_mode)
