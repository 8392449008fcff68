"""``train_step`` of ``--target verl``: verl's own training step laid out as rlaudit's
:class:`TrainStepOutput`, what it cannot run (:func:`supports`), and the conventions of verl's
trainer the reference must be told about (:func:`train_differences`), each linked to the line of
verl at the release tag. The engine (:func:`engine_of`):

- ``fsdp``, verl >= 0.9: verl's FSDP engine worker (verl_train.py) on the CPU platform verl_cpu.py
  plugs into verl's platform registry (``verl/plugin/platform``);
- ``megatron``, verl 0.7 (no platform registry; its legacy workers are the default): the legacy
  ``MegatronPPOActor`` on a real megatron-core model (verl_megatron.py).
"""

from __future__ import annotations

import importlib.util

import torch

from rlaudit.backends.base import ReplayRequest, VariantRun
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.metrics import CATALOGUE
from rlaudit.targets.contract.adapter import TrainStepOutput
from rlaudit.targets.contract.declare import Difference
from rlaudit.targets.peers.verl_layout import to_batch_width
from rlaudit.targets.peers import verl_megatron
from rlaudit.targets.peers.verl_train import rows_unsupported, train_steps, unsupported
from rlaudit.targets.run.target_backend import replayed_runs

#: verl's metric -> rlaudit's where the names differ. ``actor/entropy_loss`` is the entropy the
#: update computes (calculate_entropy or entropy_coeff != 0), aggregated like the loss with the
#: global counts and summed over micro-batches (verl/workers/utils/losses.py:124-130): what
#: rlaudit's ``actor/entropy`` is. fit()'s own ``actor/entropy`` is the old-log-prob pass's
#: (the policy before the update, over the whole batch, whatever calculate_entropy says): no
#: catalogue name, not reported
RENAMES = {"actor/entropy_loss": "actor/entropy", "actor/entropy": None}
#: what fit() logs under rlaudit's catalogue names in every configuration this step runs
#: (verl's others, e.g. ``perf/*``, have no catalogue name)
TRAIN_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                 "actor/ppo_kl", "actor/grad_norm", "actor/lr", "actor/loss",
                 "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean",
                 "critic/returns/mean")
#: verl's step tensors -> rlaudit's names (TrainStepOutput.tokens)
TOKENS = {"old_log_probs": "old_log_probs", "advantages": "advantages", "returns": "returns",
          "token_level_scores": "token_level_scores",
          "token_level_rewards": "token_level_rewards"}
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


def engine_of() -> str | None:
    """The engine train_step drives in the installed verl (module docstring), or None."""
    if _found("verl.plugin.platform"):
        return "fsdp"
    if _found("verl.workers.actor.megatron_actor"):
        return "megatron"
    return None


def supports(config: Config, *, engine: str | None) -> tuple[bool, str]:
    """Whether verl's step on ``engine`` can run ``config``, with the reason when not."""
    if engine is None:
        return False, ("this verl release has neither a platform registry (verl/plugin/platform, "
                       "from 0.9.0) nor the legacy Megatron actor")
    if not _found("hydra"):
        return False, ("hydra-core is missing from the verl peer (verl/utils/config.py:48 "
                       "builds every worker config with it): re-run `make peers`")
    why = unsupported(config) if engine == "fsdp" else verl_megatron.unsupported(config)
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
    )


def catalogue_metrics(step: dict) -> dict:
    """verl's metrics of one step under rlaudit's catalogue names (:data:`RENAMES`)."""
    out = {}
    for name, value in step.items():
        ours = RENAMES.get(name, name)
        if ours in CATALOGUE:
            out[ours] = value
    return out


def output(result: dict, batch: RolloutBatch) -> TrainStepOutput:
    """verl_train's rank-0 result as a TrainStepOutput: catalogue metrics per step, step 0's
    tensors (the old-log-prob pass is the initial policy's log-probs and entropy at the rollout
    temperature) as float64 ``[B, R]`` (from verl's response width, verl_layout), 0 where
    ``response_mask`` is False."""
    mask = batch.mask.bool()

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, to_batch_width(t, mask.shape[1]).double(), 0.0)

    tokens = result["tokens"]
    return TrainStepOutput(
        metrics=[catalogue_metrics(step) for step in result["metrics"]],
        log_probs=per_token(tokens["old_log_probs"]),
        entropy=per_token(tokens["entropys"]),
        tokens={ours: per_token(tokens[theirs]) for theirs, ours in TOKENS.items()},
        params=result["params"])


def replay(adapter, request: ReplayRequest) -> dict[str, VariantRun]:
    """Every variant of ``request`` through verl's step in one group of ranks (verl imported and
    the ranks started once, a fresh worker per variant), each laid out as ``train_step``'s output
    would be (:func:`~rlaudit.targets.run.target_backend.to_variant_run`). A variant whose rows
    verl would refuse (:func:`~rlaudit.targets.peers.verl_train.rows_unsupported`: not whole
    mini-batches) is not run: its invariants are n/a for verl ("not returned")."""
    dp = adapter.dp if adapter.engine == "fsdp" else 1
    variants = [v for v in request.variants if not rows_unsupported(v.config, len(v.batch), dp)]
    if not variants:       # every variant's rows are ones verl refuses: nothing ran (n/a)
        return {}

    def train_all(vs):
        results = run_jobs(adapter, request.model, [(v.batch, v.config, v.steps) for v in vs],
                           request.device)
        return [output(r, v.batch) for r, v in zip(results, vs)]

    return replayed_runs(request, variants, train_all, source=f"{adapter.name}.train_step")


def run_jobs(adapter, model_path, jobs: list, device: str) -> list[dict]:
    """``(batch, config, steps)`` jobs on the adapter's engine, in one group of ranks."""
    if adapter.engine == "megatron":
        return verl_megatron.train_steps(model_path, jobs, peer=adapter.peer, device=device)
    return train_steps(model_path, jobs, dp=adapter.dp, peer=adapter.peer, device=device)
