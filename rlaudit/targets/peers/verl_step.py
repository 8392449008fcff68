"""``train_step`` of ``--target verl``: verl's own FSDP training step (rlaudit/targets/peers/
verl_train.py) laid out as rlaudit's :class:`TrainStepOutput`, what it cannot run
(:func:`supports`), and the conventions of verl's trainer the reference must be told about
(:func:`train_differences`), each linked to the line of verl at the release tag.

verl >= 0.9 only: its platform registry (``verl/plugin/platform``) is how the CPU platform of
``verl_cpu`` is plugged in; an older release has no registry, and its step is n/a here.
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
from rlaudit.targets.contract.guard import batch_state, unchanged_since
from rlaudit.targets.peers.verl_layout import to_batch_width
from rlaudit.targets.peers.verl_train import train_steps, unsupported
from rlaudit.targets.run.target_backend import to_variant_run

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


def has_platform_registry() -> bool:
    """verl >= 0.9: ``verl.plugin.platform`` exists (the CPU platform plugs in there)."""
    try:
        return importlib.util.find_spec("verl.plugin.platform") is not None
    except ModuleNotFoundError:
        return False


def supports(config: Config, *, registry: bool) -> tuple[bool, str]:
    """Whether verl's step can run ``config`` (``registry``: the release has the platform
    registry), with the reason when not."""
    if not registry:
        return False, ("this verl release has no platform registry (verl/plugin/platform, from "
                       "0.9.0): its training step cannot be put on the CPU without patching it")
    why = unsupported(config)
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
    would be (:func:`~rlaudit.targets.run.target_backend.to_variant_run`)."""
    before = [batch_state(v.batch) for v in request.variants]
    results = train_steps(request.model, [(v.batch, v.config, v.steps) for v in request.variants],
                          dp=adapter.dp, peer=adapter.peer, device=request.device)
    runs = {}
    for v, result, state in zip(request.variants, results, before):
        run = to_variant_run(v, output(result, v.batch), source=f"{adapter.name}.train_step",
                             model_path=request.model, dtype=request.dtype)
        run.inputs_unchanged = unchanged_since(v.batch, state)
        runs[v.name] = run
    return runs
