"""``train_step`` of ``--target verl``: verl's own training step laid out as rlaudit's
:class:`TrainStepOutput`, what it cannot run (:func:`supports`), and the conventions of verl's
trainer the reference must be told about (:func:`train_differences`), each linked to the line of
verl at the release tag. Each of verl's engines is its own column (:class:`VerlEngine`,
``verl-fsdp-<version>``, ``verl-megatron-<version>``: rlaudit/targets/run/engines.py compares
each with the reference and the two with each other); what drives each (:func:`engines_of`):

- ``fsdp``: verl >= 0.9, the FSDP engine worker (verl_train.py) on the CPU platform verl_cpu.py
  plugs into verl's platform registry (``verl/plugin/platform``); verl 0.7, the legacy
  ``DataParallelPPOActor`` (verl_dp_actor.py);
- ``megatron``: verl 0.7, the legacy ``MegatronPPOActor`` on a real megatron-core model
  (verl_megatron.py); verl >= 0.9, the Megatron engine (verl_mcore.py) on megatron-core without
  Transformer Engine (verl_mcore_cpu.py names the two construction steps that stand in), in
  bf16, all its config accepts: that column declares ``train_precision = "bfloat16"``
  (rlaudit/targets/run/engines.py compares it, and engine-parity with it, at bf16 tolerances).
"""

from __future__ import annotations

import importlib
import importlib.util
from concurrent.futures import ThreadPoolExecutor

import torch

from rlaudit.backends.base import ReplayRequest, VariantRun
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.metrics import CATALOGUE
from rlaudit.targets.contract.adapter import TrainStepOutput
from rlaudit.targets.contract.declare import Difference
from rlaudit.verdict.unsupported import UnsupportedFeature
from rlaudit.targets.peers.verl_layout import to_batch_width
from rlaudit.targets.peers import verl_dp, verl_dp_actor, verl_mcore, verl_megatron
from rlaudit.targets.peers.verl_train import rows_unsupported, train_steps, unsupported
from rlaudit.targets.run.target_backend import replayed_runs

#: verl's metric -> rlaudit's where the names differ. ``actor/entropy_loss`` is the entropy the
#: update computes (calculate_entropy or entropy_coeff != 0), aggregated like the loss with the
#: global counts and summed over micro-batches (verl/workers/utils/losses.py:124-130): what
#: rlaudit's ``actor/entropy`` is. fit()'s own ``actor/entropy`` is the old-log-prob pass's
#: (the policy before the update, over the whole batch, whatever calculate_entropy says): no
#: catalogue name, not reported
RENAMES = {"actor/entropy_loss": "actor/entropy", "actor/entropy": None,
           # apply_kl_penalty logs the KL itself (no coefficient) as a mean over rows of each
           # row's token-mean (ray_trainer.py:108-115 at v0.9.1); rlaudit's is kl_coef x the
           # token-mean: another quantity, not reported
           "actor/reward_kl_penalty": None,
           # the token-mean of the (truncated) IS weights over the batch, as rlaudit's
           # (rollout_corr_helper.py:712,723)
           "rollout_corr/rollout_is_mean": "rollout_corr/is_weight_mean",
           # a mean over every row of each row's token-mean (rollout_corr_helper.py:980);
           # rlaudit's is over the rows with a response: another quantity on a batch with an
           # empty response, not reported
           "rollout_corr/log_ppl_diff": None}
#: what fit() logs under rlaudit's catalogue names in every configuration this step runs
#: (verl's others, e.g. ``perf/*``, have no catalogue name)
TRAIN_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                 "actor/ppo_kl", "actor/grad_norm", "actor/lr", "actor/loss",
                 "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean",
                 "critic/returns/mean")
#: how the engine workers reduce what train_step adds to the stage functions' metrics:
#: ``kl_loss`` is aggregated like the policy loss with the global counts and logged with its
#: aggregation (losses.py:136-141 at v0.9.1): summed over micro-batches, a contribution
TRAIN_REDUCTION = {"actor/kl_loss": "contribution"}
#: verl's step tensors -> rlaudit's names (TrainStepOutput.tokens)
TOKENS = {"old_log_probs": "old_log_probs", "advantages": "advantages", "returns": "returns",
          "token_level_scores": "token_level_scores",
          "token_level_rewards": "token_level_rewards", "ref_log_prob": "ref_log_probs",
          "rollout_is_weights": "rollout_is_weights"}
_BLOB = "https://github.com/verl-project/verl/blob/v{v}/verl/"
#: training steps a declared per-step case is spelled out for
MAX_STEPS = 8


#: what verl 0.7.1's legacy Megatron actor and worker log under catalogue names
MEGATRON_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                    "actor/ppo_kl", "actor/grad_norm", "actor/lr")


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def engines_of() -> dict[str, str]:
    """verl's engines in the installed release -> which implementation drives each:
    ``engine`` (the engine workers, verl >= 0.9) or ``legacy`` (verl 0.7's actors)."""
    out = {}
    if _found("verl.plugin.platform"):
        out["fsdp"] = "engine"
    elif _found("verl.workers.actor.dp_actor"):
        out["fsdp"] = "legacy"
    if _found("verl.workers.actor.megatron_actor"):
        out["megatron"] = "legacy"
    elif _found("verl.workers.engine.megatron"):
        out["megatron"] = "engine"
    return out


def release_blocker(engine: str, impl: str) -> str | None:
    """Why the installed release's ``engine`` (``impl``: engines_of) cannot run on the CPU at
    all, whatever the config; None when it can."""
    if impl == "legacy" and not _found("verl.workers.config"):
        return ("the adapter builds the legacy actors' configs as verl.workers.config's "
                "dataclasses (from 0.6); this release has none, and its omegaconf_to_dataclass "
                "asserts a `_target_` key those configs lack")
    if (engine, impl) == ("fsdp", "engine") and not _found("flash_attn"):
        attention = importlib.import_module("verl.utils.attention_utils")
        if not hasattr(attention, "_fallback_unpad_input"):
            return ("verl/utils/attention_utils.py imports flash_attn.bert_padding on every "
                    "device but NPUs (L30 at v0.9.0; 0.9.1 adds pure-torch fallbacks), and "
                    "flash-attn needs CUDA")
    return None


def supports(config: Config, *, engine: str | None, impl: str = "engine") -> tuple[bool, str]:
    """Whether verl's step on ``engine`` (``impl``: engines_of) can run ``config``, with the
    reason when not."""
    if engine is None:
        return False, ("this verl release has neither a platform registry (verl/plugin/platform, "
                       "from 0.9.0) nor the legacy actors")
    if not _found("hydra"):
        return False, ("hydra-core is missing from the verl peer (verl/utils/config.py:48 "
                       "builds every worker config with it): re-run `make peers`")
    if engine == "fsdp" and impl == "engine":
        why = unsupported(config)
    elif engine == "fsdp":
        why = verl_dp_actor.unsupported(config)
    elif impl == "legacy":
        why = verl_megatron.unsupported(config)
    else:
        why = unsupported(config)     # the Megatron engine: verl_train's mapping (verl_mcore)
        if config.actor.use_kl_loss or config.algorithm.use_kl_in_reward:
            why.append("KL (actor.use_kl_loss / algorithm.use_kl_in_reward): the Megatron "
                       "column builds no reference worker")
    return not why, "; ".join(why)


def train_differences(version: str) -> tuple[Difference, ...]:
    """How verl's trainer differs from rlaudit's reference by design, at run level."""
    at = _BLOB.format(v=version.split("+")[0])
    return (
        Difference(
            "seq-mean-counts-every-row",
            reason="the seq-mean aggregations divide by global_batch_size, which _update_actor "
                   "sets to the mini-batch's row count (ppo_mini_batch_size x rollout.n), rows "
                   "without a valid token included",
            link=at + "trainer/ppo/ray_trainer.py#L1362",
            checks=("backend-parity",), convention={"seq_count": "all-rows"}),
        Difference(
            "score-metrics-skip-empty-responses",
            reason="compute_data_metrics takes critic/score/* and critic/rewards/* over the rows "
                   "with a response (an empty one is an aborted sample); rlaudit's are over "
                   "every trajectory",
            link=at + "trainer/ppo/metric_utils.py#L468",
            checks=("backend-parity",), cases=("critic/score/", "critic/rewards/")),
        Difference(
            "token-budget-microbatches-balanced",
            reason="with use_dynamic_bsz, rearrange_micro_batches partitions a mini-batch by "
                   "sequence length (karmarkar_karp balancing), so the micro-batch means "
                   "pg_clipfrac, pg_clipfrac_lower and ppo_kl are taken over other micro-batches "
                   "than the reference's token-budget cut; the loss, gradient norm and "
                   "parameters do not depend on the cut and are compared",
            link=at + "utils/seqlen_balancing.py#L348",
            checks=("backend-parity",),
            cases=tuple(f"variant microbatch:tokens: step {s}: actor/{m} ="
                        for s in range(MAX_STEPS)
                        for m in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"))),
        Difference(
            "rollout-k3-kl-in-float32",
            reason="the train-vs-rollout mismatch metric rollout_corr/k3_kl is exp(d) - d - 1 "
                   "on the trainer's float32 log-probs: where the rollout replays the same "
                   "weights (|d| ~ 1e-6) the rounding of exp(d) dominates and the mean can fall "
                   "below 0 by ~1e-9; backend-parity still compares it with the reference",
            link=at + "trainer/ppo/rollout_corr_helper.py#L965",
            checks=("sanity-bounds",), cases=("rollout_corr/k3_kl =",)),
    )


def legacy_differences(version: str) -> tuple[Difference, ...]:
    """How verl 0.7's legacy actors differ from rlaudit's reference by design, at run level."""
    at = _BLOB.format(v=version.split("+")[0])
    return (
        Difference(
            "kl-loss-logged-without-kl-loss",
            reason="the legacy FSDP actor starts its metrics with actor/kl_loss = 0.0 and logs "
                   "it whether or not use_kl_loss is on; rlaudit logs no KL loss without one",
            link=at + "workers/actor/dp_actor.py#L554",
            checks=("backend-parity",), cases=("only in one run ['actor/kl_loss']",)),
    )


def catalogue_metrics(step: dict, renames: dict = RENAMES) -> dict:
    """verl's metrics of one step under rlaudit's catalogue names (:data:`RENAMES` for the
    engine workers; the legacy actors log the update's entropy as ``actor/entropy`` itself,
    dp_actor.py:643, so nothing is renamed for them)."""
    out = {}
    for name, value in step.items():
        ours = renames.get(name, name)
        if ours in CATALOGUE:
            out[ours] = value
    return out


def correction_renames(config: Config | None) -> dict:
    """verl's share of IS weights outside the bounds under rlaudit's ``is_clipfrac`` where it
    counts the same things for ``config``: ``rollout_is_ratio_fraction_high`` under truncation
    (the valid tokens above the threshold at token level, the rows above it at sequence level;
    rollout_corr_helper.py:717, 728 at v0.9.1), ``rollout_is_oob_ratio`` (the valid tokens
    outside the band) under IcePop's mask at token level (616-621)."""
    rc = None if config is None else config.actor.rollout_correction
    if rc is None or rc.rollout_is is None:
        return {}
    if rc.rollout_is_mode == "truncate":
        return {"rollout_corr/rollout_is_ratio_fraction_high": "rollout_corr/is_clipfrac"}
    return {"rollout_corr/rollout_is_oob_ratio": "rollout_corr/is_clipfrac"}


def per_responding_row(step: dict, config: Config | None, batch: RolloutBatch) -> dict:
    """``step``'s sequence-level ``is_clipfrac`` over the rows with a response, as rlaudit
    counts it: verl divides its count of rows above the threshold by every row
    (``exceeds_upper.float().mean()``, rollout_corr_helper.py:717 at v0.9.1), and an empty row's
    log-ratio sum is 0, above the threshold exactly when it is below 1. The count is verl's;
    only the denominator changes."""
    rc = None if config is None else config.actor.rollout_correction
    name = "rollout_corr/is_clipfrac"
    if rc is None or rc.rollout_is != "sequence" or name not in step:
        return step
    rows = len(batch)
    empty = int((batch["response_lengths"] == 0).sum())
    if not empty or empty == rows:
        return step
    above = round(float(step[name]) * rows)
    if rc.rollout_is_threshold < 1:
        above -= empty
    return {**step, name: above / (rows - empty)}


def output(result: dict, batch: RolloutBatch, renames: dict = RENAMES,
           config: Config | None = None) -> TrainStepOutput:
    """verl_train's rank-0 result as a TrainStepOutput: catalogue metrics per step, step 0's
    tensors (the old-log-prob pass is the initial policy's log-probs and entropy at the rollout
    temperature) as float64 ``[B, R]`` (from verl's response width, verl_layout), 0 where
    ``response_mask`` is False."""
    mask = batch.mask.bool()

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, to_batch_width(t, mask.shape[1]).double(), 0.0)

    tokens = result["tokens"]
    renames = {**renames, **correction_renames(config)}
    return TrainStepOutput(
        metrics=[per_responding_row(catalogue_metrics(step, renames), config, batch)
                 for step in result["metrics"]],
        log_probs=per_token(tokens["old_log_probs"]),
        entropy=per_token(tokens["entropys"]),
        tokens={ours: per_token(tokens[theirs]) for theirs, ours in TOKENS.items()
                if theirs in tokens},
        params=result["params"])


class VerlEngine:
    """One of verl's engines as its own column of ``--target verl`` (module docstring): a
    ``train_step`` / ``replay`` / ``supports`` of that engine; every other attribute (the
    declarations) is the target's."""

    def __init__(self, target, engine: str, impl: str, dp: int | None = None):
        self.target, self.engine, self.impl = target, engine, impl
        self.name = f"verl-{engine}-{target.version}"
        self.dp = target.dp if (engine, impl) == ("fsdp", "engine") else 1
        if dp is not None:          # the FSDP engine's dp column (verl_dp)
            self.name, self.dp = f"verl-{engine}-dp{dp}-{target.version}", dp
            self.layout = {"dp": dp}
            #: the variants it runs and the invariants checked on it (engines.engine_checks)
            self.only_variants, self.checked_invariants = verl_dp.VARIANTS, verl_dp.INVARIANTS
        self.metric_names = MEGATRON_METRICS if impl == "legacy" else TRAIN_METRICS
        self.renames = {} if impl == "legacy" else RENAMES
        #: another engine class for the Megatron engine's rank (verl_mcore.train_steps'
        #: ``engine``: a test's broken one); None: verl_mcore_cpu.MegatronEngineCPU
        self.mcore_engine = None
        #: the Megatron column's jobs started beside the FSDP column's (shared_outputs), for
        #: this column's replay that follows in the same scenario
        self.prefetched: dict = {}
        if (engine, impl) == ("megatron", "engine"):
            #: McoreEngineConfig accepts bf16 / fp16 only (workers/config/engine.py:218)
            self.train_precision = "bfloat16"

    def __getattr__(self, name):
        return getattr(self.target, name)

    def supports(self, config):
        return supports(config, engine=self.engine, impl=self.impl)

    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu"):
        """verl's step on this engine, ``steps`` times on ``batch``; ``ref_model_path``: the
        reference policy of a KL term (None: the model)."""
        self.refuse_release()
        why = rows_unsupported(config, len(batch), self.dp)
        if why:
            raise NotImplementedError(why)
        laid, order = (verl_dp.laid_out(batch, config, self.dp) if self.dp > 1
                       else (batch, None))
        (result,) = run_jobs(self, model_path, [(laid, config, steps)], device,
                             ref_model=ref_model_path)
        out = output(result, laid, self.renames, config)
        return out if order is None else verl_dp.restored(out, order)

    def replay(self, request):
        """Every supported variant of a scenario in one group of ranks (:func:`replay`)."""
        self.refuse_release()
        return replay(self, request)

    def refuse_release(self) -> None:
        """Raise :class:`UnsupportedFeature` when this release's engine cannot run here at all
        (:func:`release_blocker`): the release's limit, never a red."""
        why = release_blocker(self.engine, self.impl)
        if why:
            part = "actor" if self.impl == "legacy" else "engine"
            raise UnsupportedFeature(f"train_step on its {self.engine} {part} on the CPU",
                                     release=f"verl {self.target.version}", reason=why)


def replay(engine: VerlEngine, request: ReplayRequest) -> dict[str, VariantRun]:
    """Every variant of ``request`` through ``engine``'s step in one group of ranks (verl
    imported and the ranks started once, a fresh worker per variant), each laid out as
    ``train_step``'s output would be (:func:`~rlaudit.targets.run.target_backend.
    to_variant_run`). A variant whose rows verl would refuse (:func:`~rlaudit.targets.peers.
    verl_train.rows_unsupported`: not whole mini-batches) is not run: its invariants are n/a for
    verl ("not returned")."""
    only = engine.__dict__.get("only_variants")      # the dp column's (verl_dp.VARIANTS)
    variants = [v for v in request.variants
                if not rows_unsupported(v.config, len(v.batch), engine.dp)
                and (only is None or v.name in only)]
    if not variants:       # every variant's rows are ones verl refuses: nothing ran (n/a)
        return {}

    held, engine.prefetched = engine.prefetched, {}

    def train_all(vs):
        shared = shared_outputs(engine, request, vs, held)
        if shared is not None:
            return shared
        if engine.dp > 1:
            laid = [verl_dp.laid_out(v.batch, v.config, engine.dp) for v in vs]
            results = run_jobs(engine, request.model, [(b, v.config, v.steps) for (b, _), v
                                                       in zip(laid, vs)],
                               request.device, ref_model=request.ref_model)
            return [verl_dp.restored(output(r, b, engine.renames, v.config), order)
                    for r, (b, order), v in zip(results, laid, vs)]
        results = run_jobs(engine, request.model, [(v.batch, v.config, v.steps) for v in vs],
                           request.device, ref_model=request.ref_model)
        return [output(r, v.batch, engine.renames, v.config) for r, v in zip(results, vs)]

    return replayed_runs(request, variants, train_all, source=f"{engine.name}.train_step")


def prefetch_key(v) -> tuple:
    """A variant as both engines' replays of one scenario see it (the same batch and config
    objects; the TargetBackend hands each engine its own Variant copy)."""
    return v.name, id(v.batch), id(v.config), v.steps


def shared_outputs(engine: VerlEngine, request: ReplayRequest, vs: list,
                   held: dict) -> list[TrainStepOutput] | None:
    """The two engine workers of verl >= 0.9 side by side: the FSDP column's replay (dp 1)
    starts the Megatron column's jobs for the same variants in a thread (their own rank, a
    process of its own: rlaudit's launcher runs concurrent launches) before running its own, and
    keeps the pending result in that column's ``prefetched``; the Megatron column's replay, next
    in the same scenario, collects it when it asks for exactly those variants (its failure
    raised as its own crash). On two cores the columns' ranks, mostly starting verl and
    megatron-core, then overlap. None: not shared, the column runs its own jobs."""
    if (engine.engine, engine.impl) == ("megatron", "engine"):
        if not held:
            return None
        keys, mvs, pending = held["keys"], held["variants"], held["pending"]
        if keys != [prefetch_key(v) for v in vs]:
            pending.exception()          # let it finish (its rank holds a core), then run anew
            return None
        return [output(r, v.batch, engine.renames, v.config)
                for r, v in zip(pending.result(), mvs)]
    mega = next((e for e in getattr(engine.target, "engines", ())
                 if (e.engine, e.impl) == ("megatron", "engine")), None)
    if (engine.engine, engine.impl) != ("fsdp", "engine") or engine.dp != 1 or mega is None \
            or release_blocker(mega.engine, mega.impl):
        return None
    mvs = [v for v in vs if mega.supports(v.config)[0]
           and not rows_unsupported(v.config, len(v.batch), mega.dp)]
    pool = ThreadPoolExecutor(1)
    pending = pool.submit(run_jobs, mega, request.model,
                          [(v.batch, v.config, v.steps) for v in mvs], request.device)
    pool.shutdown(wait=False)
    mega.prefetched = {"keys": [prefetch_key(v) for v in mvs], "variants": mvs,
                       "pending": pending}
    results = run_jobs(engine, request.model, [(v.batch, v.config, v.steps) for v in vs],
                       request.device, ref_model=request.ref_model)
    return [output(r, v.batch, engine.renames, v.config) for r, v in zip(results, vs)]


def run_jobs(engine: VerlEngine, model_path, jobs: list, device: str,
             ref_model=None) -> list[dict]:
    """``(batch, config, steps)`` jobs on ``engine``, in one group of ranks; ``ref_model``: the
    reference snapshot of the FSDP engine's KL terms (the others refuse KL)."""
    if engine.impl == "legacy":
        module = verl_megatron if engine.engine == "megatron" else verl_dp_actor
        return module.train_steps(model_path, jobs, peer=engine.peer, device=device)
    if engine.engine == "megatron":
        return verl_mcore.train_steps(model_path, jobs, peer=engine.peer,
                                      version=engine.target.version, device=device,
                                      engine=engine.mcore_engine)
    return train_steps(model_path, jobs, dp=engine.dp, peer=engine.peer, device=device,
                       ref_model_path=ref_model)
