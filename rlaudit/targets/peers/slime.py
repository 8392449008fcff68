"""slime (THUDM/slime, source snapshots by commit) behind rlaudit's adapter API.

    rlaudit run --target slime               # the pinned commit 624b824a8 (after PR #2114)
    rlaudit run --target slime==a0d6d26a2    # before #2114: the stored KL is shaped in place
    RLAUDIT_SLIME_DIR=~/src/slime rlaudit run --target slime      # your fork's checkout

slime is not on the package index; rlaudit.targets.peers finds the snapshot. Every stage calls
slime's own code in ``slime/backends/megatron_utils/loss.py`` and ``slime/utils/ppo_utils.py``:

- ``apply_kl_in_reward``: ``compute_advantages_and_returns`` with ``advantage_estimator="ppo"``
  (the branch that puts the KL into the reward). The stored KL is what slime leaves in
  ``rollout_data["kl"]`` after the call (what ``rollout/kl`` logs); the shaped per-token rewards
  are what the call hands to ``get_advantages_and_returns_batch`` (recorded on the way through:
  slime keeps no other copy).
- ``kl_penalty``: ``compute_approx_kl`` (k1, k2, low_var_kl = rlaudit's k3).
- ``policy_loss``: ``loss_function`` with ``loss_type="policy_loss"`` (so ``policy_loss_function``,
  ``compute_policy_loss`` / ``compute_cispo_loss`` / ``compute_gspo_kl`` and slime's reducers),
  the log-probs handed in where slime would compute them from the logits
  (``get_log_probs_and_entropy``: vocab-parallel Megatron math, not what this stage audits).

slime runs on Megatron: a one-rank model-parallel state (tp = pp = cp = dp = 1, gloo) is
initialised in this process on first use. Its KL and loss kernels are ``torch.compile``d; on CPU
they run eagerly here (``torch.compiler.set_stance("force_eager")``: the same float32 arithmetic
without an inductor build per shape). slime computes KL and losses in float32:
``precision = "float32"``.

``train_step`` / ``replay``: slime's own Megatron actor step (its rollout manager's hand-over,
``MegatronTrainRayActor.train``, Megatron's forward-backward, slime's loss and optimizer) on the
CPU in a rank of rlaudit's launcher (slime_train.py; what stands in for the GPU cluster is in
slime_cpu.py); ``supports`` names every setting it does not map.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import torch

from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import TargetAdapter
from rlaudit.targets.contract.declare import Difference
from rlaudit.targets.peers import slime_train
from rlaudit.targets.peers.registry import snapshot_column
from rlaudit.targets.stages.loss import CLIP_SETTINGS, POLICY_METRICS

_SRC = "https://github.com/THUDM/slime/blob/624b824a898ab0ec1fcb4d373004c7f3852bf515"
_LOSS = f"{_SRC}/slime/backends/megatron_utils/loss.py"

#: rlaudit KL estimator -> slime kl_loss_type. slime's "low_var_kl" clamps the value to +-10 as
#: rlaudit's k3 does (slime's plain "k3" does not clamp: no rlaudit equivalent).
KL_KINDS = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}
#: rlaudit loss mode -> slime advantage_estimator (which selects the loss branch)
LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo"}
#: rlaudit loss_agg_mode -> slime calculate_per_token_loss
AGG_MODES = {"token-mean": True, "seq-mean-token-mean": False}


@functools.lru_cache(maxsize=None)
def _import_slime() -> SimpleNamespace:
    """slime's loss and ppo_utils modules, with a one-rank Megatron parallel state."""
    try:
        # lazy: slime and Megatron are optional, imported when audited
        import slime  # noqa: F401
    except ImportError as e:
        raise InputError(f"slime is not importable ({e}); see docs/peers.md",
                         key="--target") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "Transformer Engine and Apex are not installed"
        logging.getLogger().setLevel(logging.ERROR)
        try:
            # lazy: slime and Megatron are optional, imported when audited
            from slime.backends.megatron_utils import loss
            # lazy: slime and Megatron are optional, imported when audited
            from slime.utils import ppo_utils
        finally:
            logging.getLogger().setLevel(logging.WARNING)
    _one_rank_megatron()
    return SimpleNamespace(loss=loss, ppo=ppo_utils, path=slime.__file__)


def _one_rank_megatron() -> None:
    """Megatron's parallel state for a single rank (slime's loss code asks it for the pipeline
    stage, the context-parallel rank and the data-parallel size)."""
    import torch.distributed as dist  # lazy: slime and Megatron are optional, imported when audited
    # lazy: slime and Megatron are optional, imported when audited
    from megatron.core import parallel_state
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


@contextlib.contextmanager
def _eager():
    with torch.compiler.set_stance("force_eager"):
        yield


def _token_normaliser_cases() -> tuple[str, ...]:
    """Problem labels (rlaudit.targets.stages.loss) of the per-token reduction (token-mean) on
    the ``ragged`` case, the only one with rows without a valid token."""
    whats = ("loss", "gradient") + POLICY_METRICS
    labels = [f"{mode}/token-mean clip={clip}" for mode in LOSS_MODES for clip in CLIP_SETTINGS]
    return tuple(f"{lab} {what} on ragged" for lab in labels for what in whats) + tuple(
        f"{lab} on ragged:" for lab in labels)


class SlimeAdapter(TargetAdapter):
    """slime's KL-in-reward (stored KL), KL estimators and policy losses."""

    name = "slime"
    precision = "float32"
    kl_estimators = tuple(KL_KINDS)
    loss_modes = tuple(LOSS_MODES)
    loss_agg_modes = tuple(AGG_MODES)
    #: train_step: slime's Megatron actor over megatron-core on the CPU, float32 (slime_train.py)
    train_precision = "float32"
    metric_names = tuple(slime_train.METRICS.values())
    differences = (
        Difference(
            "sample-mean-over-every-sample",
            reason="the per-sample-mean loss (sum_of_sample_mean: a sample's loss over "
                   "max(1, its loss-mask tokens)) is divided by the step's sample count "
                   "(step_global_batch_size), samples without a loss-mask token included",
            link=f"{_LOSS} (loss_function)",
            checks=("policy_loss:*",), convention={"seq_count": "all-rows"}),
        Difference(
            "per-token-normaliser-counts-empty-samples",
            reason="the per-token loss (calculate_per_token_loss) is divided by num_tokens = the "
                   "sum over samples of max(1, loss-mask tokens): a sample without a loss-mask "
                   "token counts as one token; rlaudit counts the loss-mask tokens. (Given "
                   "global counts, the adapter divides by denominators.tokens, as Megatron "
                   "divides by the normalisers summed over the step: the whole-batch call and "
                   "the split then differ on such a batch.)",
            link=f"{_LOSS} (loss_function: num_tokens)",
            checks=("policy_loss:parity", "policy_loss:global-split"),
            cases=_token_normaliser_cases()),
        Difference(
            "ppo-kl-log-ratio-unclamped",
            reason="the logged ppo_kl is the token mean of old_log_probs - log_probs as they "
                   "are (and the ratio exp of it); rlaudit clamps the log-ratio to +-20 first, as "
                   "verl does. They differ only where a token's log-ratio passes 20 nats (a "
                   "policy moved that far: ppo_dual_clip's SGD at lr 2.0), where the clipped "
                   "loss and its gradient agree",
            link=f"{_LOSS}#L1033",
            checks=("backend-parity",), cases=("actor/ppo_kl",)),
        Difference(
            "gspo-sequence-level-gradient",
            reason="GSPO's ratio is exp of the sequence's mean log-ratio with the gradient "
                   "flowing through that mean (GSPO, eq. 7), so each token's term moves every "
                   "token of its row; verl's is GSPO-token (the same when a row's advantages "
                   "are equal)",
            link=f"{_SRC}/slime/utils/ppo_utils.py (compute_gspo_kl)",
            checks=("policy_loss:*",), convention={"gspo_gradient": "sequence"}),
    )

    def __init__(self):
        # the report column names the snapshot audited (slime-<commit>)
        self.name = snapshot_column("slime")

    @property
    def snapshot(self) -> str:
        """The folder holding the ``slime/`` package audited (put on the rank's path)."""
        return str(Path(_import_slime().path).resolve().parents[1])

    # ---- the whole training step ---------------------------------------------------------
    def supports(self, config):
        why = slime_train.unsupported(config)
        return not why, "; ".join(why)

    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu"):
        """slime's own actor step (slime_train), ``steps`` times on ``batch``, on CPU;
        ``ref_model_path`` is unused (no KL term is mapped: :meth:`supports`)."""
        if device != "cpu":
            raise NotImplementedError("slime's train_step is mapped on CPU only")
        why = slime_train.rows_unsupported(config, len(batch), batch.tensors)
        if why:
            raise NotImplementedError(why)
        (result,) = slime_train.train_steps(model_path, [(batch, config, steps)],
                                            snapshot=self.snapshot)
        return slime_train.output(result, batch)

    def replay(self, request):
        """Every supported variant of a scenario in one rank (slime_train.replay)."""
        return slime_train.replay(self, request)

    # ---- KL in reward --------------------------------------------------------------------
    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty, response_lengths):
        """slime's PPO branch on the rows with a response token (a slime sample always has
        one: the branch writes the reward at ``[-1]``): ``rollout_data["kl"]`` after the call
        is the stored KL, the rewards it builds are recorded on their way to GAE."""
        if kl_penalty not in KL_KINDS:
            raise NotImplementedError(f"slime has no {kl_penalty} KL estimator")
        sl = _import_slime()
        b, r = token_level_scores.shape
        lengths = [int(x) for x in response_lengths.tolist()]
        rows = [i for i in range(b) if lengths[i] > 0]
        last = torch.arange(r).unsqueeze(0) == (response_lengths - 1).unsqueeze(1)
        if bool((token_level_scores.ne(0) & ~last).any()):
            raise NotImplementedError("slime places one scalar reward on a sample's last token")

        def per_row(x):
            return [x[i, :lengths[i]].detach().to(torch.float32).clone() for i in rows]

        rollout_data = {
            "log_probs": per_row(old_log_probs), "ref_log_probs": per_row(ref_log_probs),
            "rewards": [float(token_level_scores[i].sum()) for i in rows],
            "values": [torch.zeros(lengths[i]) for i in rows],
            "response_lengths": [lengths[i] for i in rows],
            "loss_masks": [response_mask[i, :lengths[i]].to(torch.float32) for i in rows],
            "total_lengths": [lengths[i] + 1 for i in rows]}
        args = Namespace(use_rollout_logprobs=False, kl_coef=float(kl_coef),
                         kl_loss_type=KL_KINDS[kl_penalty], custom_advantage_function_path=None,
                         advantage_estimator="ppo", gamma=1.0, lambd=1.0, use_opd=False,
                         normalize_advantages=False)
        seen = {}
        real_gae = sl.loss.get_advantages_and_returns_batch

        def record(total_lengths, response_lengths, values_list, rewards_list, *a, **kw):
            seen["rewards"] = [x.detach().clone() for x in rewards_list]
            return real_gae(total_lengths, response_lengths, values_list, rewards_list, *a, **kw)

        sl.loss.get_advantages_and_returns_batch = record
        try:
            if rows:
                with _eager():
                    sl.loss.compute_advantages_and_returns(args, rollout_data)
        finally:
            sl.loss.get_advantages_and_returns_batch = real_gae
        kl = torch.zeros(b, r, dtype=torch.float32)
        rewards = token_level_scores.detach().to(torch.float32).clone()
        for j, i in enumerate(rows):
            kl[i, :lengths[i]] = rollout_data["kl"][j]
            rewards[i, :lengths[i]] = seen["rewards"][j]
        return rewards, kl

    # ---- KL ------------------------------------------------------------------------------
    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        if kind not in KL_KINDS:
            raise NotImplementedError(f"slime has no {kind} KL estimator")
        sl = _import_slime()
        with _eager():
            return sl.ppo.compute_approx_kl(log_prob, ref_log_prob, kl_loss_type=KL_KINDS[kind])

    # ---- policy loss ---------------------------------------------------------------------
    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                    denominators=None):
        """slime's ``loss_function`` on one micro-batch whose samples are the rows (each of
        width R, its loss mask marking the tokens that count), then divided by the normaliser
        it returns, as Megatron does. With ``denominators``, the step's sample count
        (``step_global_batch_size``) is ``denominators.seqs`` and the per-token normaliser
        ``denominators.tokens``. Metrics are slime's logged sums divided by the same
        denominator as its train step does; clip fraction and ppo_kl are returned for the
        token-mean reduction only (with per-sample means slime logs sequence-means of them)."""
        if loss_mode not in LOSS_MODES or loss_agg_mode not in AGG_MODES:
            raise NotImplementedError(f"slime has no {loss_mode}/{loss_agg_mode}")
        sl = _import_slime()
        b, r = log_prob.shape
        per_token = AGG_MODES[loss_agg_mode]
        lp32 = log_prob.to(torch.float32)
        masks = [response_mask[i].to(torch.float32) for i in range(b)]
        batch = {
            "advantages": [advantages[i].detach().to(torch.float32) for i in range(b)],
            "log_probs": [old_log_prob[i].detach().to(torch.float32) for i in range(b)],
            "response_lengths": [r] * b, "total_lengths": [r + 1] * b,
            "unconcat_tokens": [torch.zeros(r + 1, dtype=torch.int64)] * b,
            "loss_masks": masks, "rollout_mask_sums": None}
        args = Namespace(
            loss_type="policy_loss", advantage_estimator=LOSS_MODES[loss_mode],
            calculate_per_token_loss=per_token, eps_clip=float(clip_ratio_low),
            eps_clip_high=float(clip_ratio_high),
            # slime's dual clip (--eps-clip-c) applies to the PPO losses; rlaudit's gspo has none
            eps_clip_c=float(clip_ratio_c) if loss_mode == "vanilla" else None,
            use_rollout_logprobs=False, rollout_top_p=1.0, use_opsm=False,
            get_mismatch_metrics=False, use_tis=False, custom_pg_loss_reducer_function_path=None,
            entropy_coef=0.0, use_kl_loss=False, recompute_loss_function=False,
            allgather_cp=False)

        def log_probs_from_logits(logits, **kw):    # where slime reads them off the logits
            return None, {"log_probs": list(lp32.unbind(0)),
                          "entropy": [torch.zeros(r) for _ in range(b)]}

        real = sl.loss.get_log_probs_and_entropy
        sl.loss.get_log_probs_and_entropy = log_probs_from_logits
        try:
            with _eager():
                samples = b if denominators is None else int(denominators.seqs)
                loss, normalizer, log = sl.loss.loss_function(
                    args, batch, num_microbatches=1, step_global_batch_size=max(samples, 1),
                    logits=torch.zeros(1, b * r, 1))
        finally:
            sl.loss.get_log_probs_and_entropy = real
        if per_token:
            denom = normalizer if denominators is None else torch.tensor(
                float(max(int(denominators.tokens), 1)))
            loss = loss / denom
        else:
            denom = torch.tensor(float(max(samples, 1)))
        values = dict(zip(log["keys"], log["values"][1:]))
        metrics = {"actor/pg_loss": values["pg_loss"] / denom}
        if per_token:
            metrics["actor/pg_clipfrac"] = values["pg_clipfrac"] / denom
            if loss_mode != "gspo":     # slime's GSPO ppo_kl is the sequence-level KL
                metrics["actor/ppo_kl"] = values["ppo_kl"] / denom
        return loss, metrics
