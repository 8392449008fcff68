"""The backend protocol and the records a replay produces.

A backend replays *variants* of a scenario — (name, config, batch, steps) — on fresh copies of a
model snapshot and returns one :class:`VariantRun` per variant. Multi-rank backends run all
variants inside one spawned process group (spawning costs seconds), so the scenario engine hands
over every run an invariant needs at once.

    class Backend(Protocol):
        name: str
        def available(self) -> tuple[bool, str]: ...
        def replay(self, request: ReplayRequest) -> dict[str, VariantRun]: ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlaudit.backends.faults import from_env as faults_from_env
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.update.forward_memo import from_env as forward_memo_from_env


@dataclass
class Variant:
    """One run a scenario needs: the baseline, or a re-cut/permuted/flag-flipped copy of it."""

    name: str
    config: Config
    batch: RolloutBatch
    steps: int = 1
    probe: Any = None
    """A :class:`rlaudit.backends.probe.ProbeSpec` only in the drift localisation's re-run of a
    failing variant (the run then stops after the probed step and carries ``info["probe"]``);
    None in every ordinary replay."""


@dataclass
class ReplayRequest:
    model: str                                   # HF snapshot directory
    ref_model: str | None = None                 # reference policy snapshot (None: = model)
    variants: list[Variant] = field(default_factory=list)
    layout: dict[str, int] = field(default_factory=dict)   # e.g. {"dp": 2} or {"tp": 2, "pp": 1}
    dtype: str = "float32"
    device: str = "cpu"
    timeout: float = 600.0
    weight_noise: float = 0.0
    """Relative std of a fixed multiplicative noise applied to every weight after loading
    (reference backend only): how the noise floor of a target's precision is measured (see
    rlaudit/targets/contract/declare.py). 0: the snapshot's exact weights."""
    noise_draw: int = 0
    """Which fixed draw of that noise (0, 1, ...): the floor of a target that misses it narrowly
    is measured again with the next draws (rlaudit/targets/run/runner.py)."""
    faults: str = field(default_factory=lambda: faults_from_env())
    """Test-only fault injectors (rlaudit/backends/faults.py): a copy of ``$RLAUDIT_FAULT`` taken
    when the request is made, so it reaches ranks spawned earlier; empty in every real run."""
    forward_memo: bool = field(default_factory=lambda: forward_memo_from_env())
    """Answer a forward-only pass that repeats an earlier one of this request from a memo (CPU
    only; rlaudit/update/forward_memo.py). ``$RLAUDIT_FORWARD_MEMO=0`` when the request is made
    turns it off; the results are the same bit for bit either way."""


@dataclass
class VariantRun:
    """What one variant produced on one backend.

    steps: per training step, metric name -> value (catalogue names only).
    tokens: per-token tensors [B, R] at step 0 in the variant's row order — ``probe_log_probs`` and
        ``probe_entropy`` (a forward of the initial policy with entropy on), and the batch fields
        the step derived (old_log_probs, ref_log_probs, values, kl, advantages, returns,
        rollout_is_weights, token_level_rewards), read at the *end* of the step.
    params: per step, the updated parameters as one flat float64 vector over HF parameter names in
        sorted order (``param_names``), when the model is small enough; ``param_norms`` always.
    micro_log: per step, per rank, per optimizer step: describe_micro() of each micro-batch.
    inputs_unchanged: the batch handed in was bit-identical after the run (no in-place mutation).
    """

    name: str
    steps: list[dict[str, float]] = field(default_factory=list)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)
    param_numels: list[int] = field(default_factory=list)
    params_initial: torch.Tensor | None = None
    param_norms: list[dict[str, float]] = field(default_factory=list)
    micro_log: list[list[list[list[dict]]]] = field(default_factory=list)
    inputs_unchanged: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    noise: "VariantRun | None" = field(default=None, repr=False, compare=False)
    """The same variant replayed by the reference with weights perturbed at a target's
    precision (set by the target runner): comparisons against this run allow a multiple of its
    spread (rlaudit.verdict.compare.NOISE_FACTOR)."""


class Backend(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(True, "") or (False, why not: e.g. megatron-core is not installed)."""

    def replay(self, request: ReplayRequest) -> dict[str, VariantRun]:
        """Run every variant of ``request``; keyed by variant name."""
