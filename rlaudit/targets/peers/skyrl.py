"""SkyRL (NovaSky-AI/SkyRL, pinned ``skyrl==0.4.0``) behind rlaudit's adapter API.

    rlaudit run --target skyrl               # SkyRL from the environment, else <peers dir>/skyrl-*
    rlaudit run --target skyrl==0.4.0

Every stage calls SkyRL's own functions; this module only converts tensors:

- ``compute_advantages``: ``ppo_utils.compute_advantages_and_returns`` (gae, grpo, grpo without
  std = Dr.GRPO, rloo, reinforce++), in SkyRL's layout: response tensors **right-aligned**
  (a row's response fills the last positions, see ``convert_prompts_responses_to_batch_tensors``),
  ``response_mask`` = the response span (no holes) and ``loss_mask`` = rlaudit's response mask.
- ``kl_penalty``: ``ppo_utils.compute_approx_kl`` (k1, abs, k2, k3).
- ``policy_loss``: the registered loss (``PolicyLossRegistry``: dual_clip, gspo, cispo) on
  advantages pre-scaled by ``apply_loss_reduction_to_advantages_minibatch``, as SkyRL's trainer
  does per mini-batch before the worker sums each micro-batch's loss.
- ``make_microbatches``: rlaudit's batch converted with SkyRL's trainer's own conversion
  (``convert_prompts_responses_to_batch_tensors``), sharded over data-parallel ranks by
  ``MeshDispatch.stage_chunks`` and cut by ``get_microbatch_iterator`` (sample-based, or
  token-based with padding micro-batches), each micro-batch converted back to rlaudit's names.

SkyRL computes in float32 (its trainer's tensors are float32; ``safe_exp_delta`` exponentiates in
float32): inputs are cast to float32 here, and ``precision = "float32"``.

SkyRL 0.4.0 declares Python >= 3.12; skyrl_base.py imports it on 3.11.

- ``train_step`` / ``replay``: SkyRL 0.4's own FSDP policy worker and trainer steps on CPU
  (skyrl_train.py; the CUDA calls it makes by name, file:line, in skyrl_cpu.py); ``supports``
  names every setting it does not map, and why a release other than 0.4 is not mapped
  (``skyrl_compat.train_step_unsupported``).
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.contract.adapter import TargetAdapter
from rlaudit.targets.contract.declare import Difference
from rlaudit.targets.peers import skyrl_compat, skyrl_train
from rlaudit.targets.peers.skyrl_base import import_skyrl, shift

_SRC = "https://github.com/NovaSky-AI/SkyRL/blob/skyrl-v0.4.0"
_PPO_UTILS = f"{_SRC}/skyrl/backends/skyrl_train/utils/ppo_utils.py"

#: rlaudit estimator -> (SkyRL estimator, grpo_norm_by_std forced or None)
ESTIMATORS = {"gae": ("gae", None), "grpo": ("grpo", None), "drgrpo": ("grpo", False),
              "rloo": ("rloo", None), "reinforce_plus_plus": ("reinforce++", None)}
#: rlaudit loss mode -> SkyRL policy_loss_type (rlaudit's vanilla always applies the dual clip)
LOSS_MODES = {"vanilla": "dual_clip", "gspo": "gspo", "cispo": "cispo"}
#: rlaudit loss_agg_mode -> SkyRL algorithm.loss_reduction
LOSS_REDUCTIONS = {"token-mean": "token_mean", "seq-mean-token-mean": "sequence_mean",
                   "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}


# ---- layout ----------------------------------------------------------------------------------

def _span(mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: one past each row's last True (0 for a row without one): the response SkyRL
    sees, whose loss-masked tokens (tool output) stay inside it."""
    pos = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    span = torch.where(mask.bool(), pos, 0)
    return span.amax(dim=1) if mask.shape[1] else torch.zeros(len(mask), dtype=torch.int64)


# ---- the adapter -----------------------------------------------------------------------------

class SkyRLAdapter(TargetAdapter):
    """SkyRL's advantage estimators, KL estimators, policy losses and micro-batch iterators."""

    name = "skyrl"
    precision = "float32"
    #: train_step: SkyRL's FSDP worker in float32 (fp32 mixed precision), skyrl_train.py
    train_precision = "float32"
    metric_names = tuple(skyrl_train.METRICS.values())

    # SkyRL's worker averages clip_ratio (a local masked mean) over micro-batches; `*_loss`
    # metrics (policy_loss: the loss on pre-scaled advantages, a contribution) are summed
    # (worker_utils.reduce_metrics(sum_loss_metrics=True))
    metric_reduction = {"actor/pg_loss": "contribution", "*": "microbatch-mean"}
    advantage_estimators = tuple(ESTIMATORS)
    kl_estimators = ("k1", "abs", "k2", "k3")
    loss_modes = tuple(LOSS_MODES)
    loss_agg_modes = tuple(LOSS_REDUCTIONS)
    differences = (
        Difference(
            "outcome-score-unmasked-sum",
            reason="outcome estimators (grpo, rloo) score a row by token_level_rewards.sum(-1) "
                   "over every position, loss-masked ones included",
            link=f"{_PPO_UTILS} (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage)",
            checks=("compute_advantages:*",), convention={"outcome_score": "unmasked-sum"}),
        Difference(
            "rloo-singleton-zero",
            reason="RLOO gives a prompt with a single response advantage 0 (no leave-one-out "
                   "baseline exists; SkyRL logs a warning), where verl and rlaudit use "
                   "baseline 0 (advantage = score)",
            link=f"{_PPO_UTILS} (compute_rloo_outcome_advantage)",
            checks=("compute_advantages:parity",),
            cases=tuple(f"rloo {what} on {case}" for what in ("advantages", "returns")
                        for case in ("ragged", "one-row"))),
        Difference(
            "recursions-through-loss-masked-tokens",
            reason="advantages are computed over the response span (response_mask); tokens "
                   "inside it with loss_mask 0 (tool output of a multi-turn rollout) are steps "
                   "of the GAE / REINFORCE++ recursions (discounted, their rewards and values "
                   "read) and count in the whitening statistics; rlaudit (verl) skips them",
            link=f"{_SRC}/skyrl/train/trainer.py (RayPPOTrainer.compute_advantages_and_returns)",
            checks=("compute_advantages:parity", "compute_advantages:masked-values"),
            cases=tuple(f"{label} {what} on ragged"
                        for label in ("gae gamma=0.9 lam=0.95", "reinforce_plus_plus gamma=0.9")
                        for what in ("advantages", "returns"))),
        Difference(
            "sequence-mean-over-all-rows",
            reason="sequence_mean and seq_mean_token_sum_norm divide by the mini-batch's row "
                   "count (advantages / (batch_size * ...)), rows without a loss-mask token "
                   "included (a row's own count is clamped to 1: its loss is 0); rlaudit's "
                   "default divides by the rows with at least one",
            link=f"{_PPO_UTILS} (apply_loss_reduction_to_advantages_minibatch)",
            checks=("policy_loss:*",), convention={"seq_count": "all-rows"}),
    )

    def __init__(self):
        # the report column names the release audited (as verl's does)
        self.version = str(import_skyrl().version)
        self.name = f"skyrl-{self.version}"

    # ---- advantages ----------------------------------------------------------------------
    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           values=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        if estimator not in ESTIMATORS:
            raise NotImplementedError(f"SkyRL has no {estimator} estimator")
        sky = import_skyrl()
        name, norm = ESTIMATORS[estimator]
        span = _span(response_mask)
        right = functools.partial(shift, lengths=span, to_right=True)
        r = token_level_rewards.shape[1]
        resp_mask = (torch.arange(r).unsqueeze(0) >= (r - span).unsqueeze(1)).to(torch.int64)
        rewards = right(token_level_rewards.detach().to(torch.float32))
        vals = None if values is None else right(values.detach().to(torch.float32))
        adv, ret = sky.ppo.compute_advantages_and_returns(
            token_level_rewards=rewards, response_mask=resp_mask,
            index=[str(u) for u in uid.tolist()], adv_estimator=name,
            config=sky.config.AlgorithmConfig(), values=vals,
            grpo_norm_by_std=bool(norm_adv_by_std_in_grpo if norm is None else norm),
            gamma=float(gamma), lambd=float(lam))
        left = functools.partial(shift, lengths=span, to_right=False)
        return left(adv), left(ret)

    # ---- KL ------------------------------------------------------------------------------
    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        if kind not in self.kl_estimators:
            raise NotImplementedError(f"SkyRL has no {kind} KL estimator")
        return import_skyrl().ppo.compute_approx_kl(
            log_prob.to(torch.float32), ref_log_prob.to(torch.float32), loss_mask=None,
            kl_estimator_type=kind)

    # ---- policy loss ---------------------------------------------------------------------
    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c):
        """One mini-batch as SkyRL's trainer and worker handle it: advantages scaled for
        ``loss_reduction`` over the mini-batch, then the loss summed (the worker sums micro-batch
        losses). No ``denominators``: the scaling is computed from the mini-batch SkyRL holds,
        so the global-split check is n/a (docs/peers.md)."""
        if loss_mode not in LOSS_MODES or loss_agg_mode not in LOSS_REDUCTIONS:
            raise NotImplementedError(f"SkyRL has no {loss_mode}/{loss_agg_mode}")
        sky = import_skyrl()
        skyrl_compat.require_advantage_scaling(sky)
        cfg = sky.config.AlgorithmConfig(
            policy_loss_type=LOSS_MODES[loss_mode], loss_reduction=LOSS_REDUCTIONS[loss_agg_mode],
            eps_clip_low=float(clip_ratio_low), eps_clip_high=float(clip_ratio_high),
            clip_ratio_c=float(clip_ratio_c),
            cispo=sky.config.CISPOConfig(cispo_eps_clip_low=float(clip_ratio_low),
                                         cispo_eps_clip_high=float(clip_ratio_high)))
        loss_mask = response_mask.to(torch.float32)     # the trainer's loss_mask is float32
        scaled = sky.ppo.apply_loss_reduction_to_advantages_minibatch(
            advantages=advantages.detach().to(torch.float32), loss_mask=loss_mask,
            loss_reduction=cfg.loss_reduction, micro_batch_size=loss_mask.shape[0],
            max_seq_len=loss_mask.shape[1])
        fn = sky.ppo.PolicyLossRegistry.get(cfg.policy_loss_type)
        loss, metrics = fn(log_prob.to(torch.float32), old_log_prob.detach().to(torch.float32),
                           scaled, config=cfg, loss_mask=loss_mask, rollout_logprobs=None)
        # the worker logs policy_loss.item() and loss_metrics/clip_ratio (worker.py)
        return loss, {"actor/pg_loss": loss.detach().clone(),
                      "actor/pg_clipfrac": float(metrics["clip_ratio"])}

    # ---- micro-batches -------------------------------------------------------------------
    def make_microbatches(self, batch: RolloutBatch, *, dp_size: int,
                          micro_batch_size: int | None = None,
                          max_token_len: int | None = None):
        """SkyRL's DP sharding (``MeshDispatch.stage_chunks``) and micro-batch iterator per
        rank; the token-based iterator's cross-rank MAX of micro-batch counts (an all-reduce in
        SkyRL) is given the ranks' real counts in-process (:func:`_rank_collective`)."""
        sky = import_skyrl()
        skyrl_compat.require_microbatch_iterator(sky)
        data = to_training_input(batch, sky)
        with _ray_put_identity(sky):
            shards = sky.dispatch.MeshDispatch.stage_chunks(dp_size, data, [(0, len(batch))])[0]
        mbs = micro_batch_size or 0
        tokens = max_token_len or 0
        make = functools.partial(sky.workers.get_microbatch_iterator, micro_batch_size=mbs,
                                 max_tokens_per_microbatch=tokens)
        if tokens > 0:
            counts = [len(make(s)) for s in shards]     # each rank alone: its own count
            with _rank_collective(sky, max(counts)):
                iterators = [make(s) for s in shards]
        else:
            iterators = [make(s) for s in shards]
        width_p = batch["prompt_ids"].shape[1]
        width_r = batch["response_ids"].shape[1]
        return [[from_training_input(mb, width_p, width_r) for mb in it] for it in iterators]


    # ---- the whole training step --------------------------------------------------------
    def supports(self, config):
        why = [w for w in (skyrl_compat.train_step_unsupported(self.version),
                           skyrl_train.missing_imports()) if w]
        why += skyrl_train.unsupported(config)
        return not why, "; ".join(why)

    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu"):
        """SkyRL's own update (skyrl_train), ``steps`` times on ``batch``, on CPU;
        ``ref_model_path`` is unused (no KL term is mapped: :meth:`supports`)."""
        ok, why = self.supports(config)
        if device != "cpu" or not ok:
            raise NotImplementedError(why or "SkyRL's train_step is mapped on CPU only")
        why = skyrl_train.rows_unsupported(config, batch)
        if why:
            raise NotImplementedError(why)
        (result,) = skyrl_train.train_steps(model_path, [(batch, config, steps)],
                                            version=self.version)
        return skyrl_train.output(result, batch)

    def replay(self, request):
        """Every supported variant of a scenario in one rank (skyrl_train.replay)."""
        if skyrl_compat.train_step_unsupported(self.version):
            return {}
        return skyrl_train.replay(self, request)


# ---- conversions -----------------------------------------------------------------------------

#: rlaudit per-token field -> the TrainingInputBatch field SkyRL's trainer holds it in
_TOKEN_FIELDS = {"old_log_probs": "action_log_probs", "ref_log_probs": "base_action_log_probs",
                 "values": "values", "advantages": "advantages", "returns": "returns"}


def to_training_input(batch: RolloutBatch, sky):
    """rlaudit's batch as SkyRL's trainer builds it for its workers: the trainer's own
    ``convert_prompts_responses_to_batch_tensors`` (left-padded sequences, right-aligned float32
    response tensors), then the per-token fields the trainer adds (log-probs, values,
    advantages, returns) right-aligned the same way. Fields SkyRL's batch does not have (uid,
    scores, ...) are not carried: its trainer does not hand them to the workers."""
    t = batch.tensors
    pl, rl = t["prompt_lengths"].tolist(), t["response_lengths"].tolist()
    prompts = [t["prompt_ids"][i, :p].tolist() for i, p in enumerate(pl)]
    responses = [t["response_ids"][i, :r].tolist() for i, r in enumerate(rl)]
    masks = [t["response_mask"][i, :r].float().tolist() for i, r in enumerate(rl)]
    logprobs = ([t["rollout_log_probs"][i, :r].tolist() for i, r in enumerate(rl)]
                if "rollout_log_probs" in t else None)
    seqs, attn, resp_mask, _rewards, loss_mask, rollout_lp = skyrl_compat.batch_tensors(
        sky, prompts, responses, [[0.0] * r for r in rl], masks, logprobs)
    fields = {"sequences": seqs, "attention_mask": attn, "response_mask": resp_mask,
              "loss_mask": loss_mask, "rollout_logprobs": rollout_lp}
    width = resp_mask.shape[1]
    lengths = t["response_lengths"]
    for ours, theirs in _TOKEN_FIELDS.items():
        if ours in t:
            x = t[ours].detach().to(torch.float32)
            x = x[:, :width] if x.shape[1] >= width else torch.nn.functional.pad(
                x, (0, width - x.shape[1]))
            fields[theirs] = shift(x, lengths, to_right=True).contiguous()
    data = sky.workers.TrainingInputBatch(fields)
    data.metadata = {"response_length": width}
    return data


#: TrainingInputBatch field -> rlaudit name, for the per-token fields converted back
_BACK = {v: k for k, v in _TOKEN_FIELDS.items()} | {"rollout_logprobs": "rollout_log_probs"}


def from_training_input(mb, width_p: int, width_r: int) -> dict[str, torch.Tensor]:
    """A SkyRL micro-batch under rlaudit's names: prompt/response ids and lengths from
    ``sequences``/``attention_mask``/``response_mask``, ``response_mask`` from ``loss_mask``,
    and every per-token field SkyRL carries left-aligned again, dtypes kept. Fields absent from
    the micro-batch stay absent (what padding-complete looks at)."""
    seqs, attn = mb["sequences"], mb["attention_mask"]
    r_len = mb["response_mask"].sum(-1).to(torch.int64)
    p_len = (attn.sum(-1).to(torch.int64) - r_len).clamp(min=0)
    s = seqs.shape[1]
    out = {"prompt_lengths": p_len, "response_lengths": r_len}
    prompt = torch.zeros(len(seqs), width_p, dtype=torch.int64)
    response = torch.zeros(len(seqs), width_r, dtype=torch.int64)
    for i in range(len(seqs)):
        p, r = int(p_len[i]), int(r_len[i])
        prompt[i, :min(p, width_p)] = seqs[i, s - r - p:s - r][:width_p]
        response[i, :min(r, width_r)] = seqs[i, s - r:][:width_r]
    out["prompt_ids"], out["response_ids"] = prompt, response

    def back(x):
        x = shift(x, r_len.clamp(max=x.shape[1]), to_right=False)
        return x[:, :width_r] if x.shape[1] >= width_r else torch.nn.functional.pad(
            x, (0, width_r - x.shape[1]))

    out["response_mask"] = back(mb["loss_mask"]) != 0
    for theirs, ours in _BACK.items():
        if mb.get(theirs) is not None:
            out[ours] = back(mb[theirs])
    return out


@contextlib.contextmanager
def _ray_put_identity(sky):
    """``stage_chunks`` puts each rank's chunk in Ray's object store; here the chunk itself."""
    real = sky.dispatch.ray
    sky.dispatch.ray = SimpleNamespace(put=lambda x: x)
    try:
        yield
    finally:
        sky.dispatch.ray = real


@contextlib.contextmanager
def _rank_collective(sky, busiest: int):
    """TokenBasedBatchIterator._sync_num_microbatches all-reduces (MAX) the ranks' micro-batch
    counts over the process group; with every rank in this process, that MAX is ``busiest``
    (counted beforehand), handed back through the same calls."""
    real = sky.workers.dist

    def all_reduce(tensor, op=None, group=None):
        tensor.fill_(max(int(tensor), busiest))

    sky.workers.dist = SimpleNamespace(is_initialized=lambda: True, all_reduce=all_reduce,
                                       ReduceOp=real.ReduceOp)
    try:
        yield
    finally:
        sky.workers.dist = real
