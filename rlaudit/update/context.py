"""The parallel context: everything a backend contributes to an update step.

The actor/critic update (rlaudit/update/actor.py, critic.py) is written once. It asks its context
for exactly five things, and backends differ only in how they provide them:

- ``dp_rank``/``dp_size`` and ``all_reduce``/``all_gather_rows`` over the data-parallel group;
- ``forward_backward(micros, loss_fn, ...)``: run the model on each micro-batch, hand the per-token
  outputs to ``loss_fn`` and back-propagate the returned loss *contribution*, scaled for however
  the engine reduces gradients (FSDP and Megatron DDP average over ranks; Megatron's schedule
  also divides by the number of micro-batches) so that the accumulated gradient is the gradient
  of the whole mini-batch loss;
- ``clip_and_step(max_norm)``: the global pre-clip L2 norm of the gradient over every parameter
  shard; clip to ``max_norm`` (<= 0: no clipping) and step the optimizer, unless the norm is not
  finite (then the step is skipped, as verl does);
- ``zero_grad()`` and ``lr``.

:class:`TorchContext` serves plain modules (the reference trainer, one process) and FSDP2-sharded
modules (same code; the FSDP backend passes its process group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from rlaudit.data.batch import RolloutBatch
from rlaudit.update import collectives
from rlaudit.update import forward as fwd
from rlaudit.update.plan import describe_micro

#: loss_fn(micro, outputs) -> (loss contribution (scalar tensor), stats: name -> scalar tensor
#: contributions that sum over micro-batches and ranks to the mini-batch value)
LossFn = Callable[[RolloutBatch, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class ForwardSpec:
    """What the model must produce per micro-batch.

    kind: "logprobs" (policy: ``log_probs`` [b, R], ``entropy`` [b, R] if calc_entropy,
    ``topk_log_probs`` [b, R, K] at ``topk_field`` ids if given) or "values" (critic: ``values``
    [b, R]).
    """

    kind: str = "logprobs"
    temperature: float = 1.0
    calc_entropy: bool = False
    chunk_size: int = 256
    topk_field: str | None = None


class ParallelContext(Protocol):
    dp_rank: int
    dp_size: int

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def forward_backward(self, micros: list[RolloutBatch], spec: ForwardSpec,
                         loss_fn: LossFn | None) -> list[dict]: ...

    def clip_and_step(self, max_norm: float) -> float: ...

    def zero_grad(self) -> None: ...

    @property
    def lr(self) -> float: ...

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, under Hugging Face names (for parity checks)."""


def build_optimizer(params, optim_cfg) -> torch.optim.Optimizer:
    """AdamW or SGD from an :class:`rlaudit.config.OptimConfig`."""
    params = [p for p in params if p.requires_grad]
    if optim_cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                 eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay,
                                 foreach=False)
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(params, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay,
                               foreach=False)
    raise ValueError(f"unknown optimizer {optim_cfg.name!r}")  # config validation prevents this


@dataclass
class TorchContext:
    """A plain or FSDP2-wrapped torch module on one device.

    ``model`` is a causal LM (kind "logprobs") or a :class:`rlaudit.model.critic.ValueModel`
    (kind "values"). ``group`` is the data-parallel process group (None = no distribution, or the
    default group when torch.distributed is initialised and ``distributed`` is True).
    ``grad_average_over_dp``: whether the engine averages gradients over ranks (FSDP2 does), in
    which case the loss is multiplied by dp_size so the result is the mini-batch *sum* semantics
    the loss contributions assume.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    distributed: bool = False
    group: object = None
    grad_average_over_dp: bool = True
    pad_id: int = 0
    micro_log: list = field(default_factory=list)
    """One entry per optimizer step: describe_micro() of every micro-batch this rank ran."""

    def __post_init__(self):
        if self.distributed and dist.is_initialized():
            self.dp_rank = dist.get_rank(self.group)
            self.dp_size = dist.get_world_size(self.group)
        else:
            self.dp_rank, self.dp_size = 0, 1

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return collectives.all_reduce(t, op, group=self.group, size=self.dp_size,
                                      device=self.device)

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape except dim 0, which may differ), rank order."""
        return collectives.all_gather_rows(t, group=self.group, size=self.dp_size,
                                           device=self.device)

    # ---- model -------------------------------------------------------------------------------
    def _outputs(self, micro: RolloutBatch, spec: ForwardSpec) -> dict:
        inputs = fwd.build_inputs(micro.to(self.device), pad_id=self.pad_id)
        if spec.kind == "values":
            per_pos = self.model(input_ids=inputs.input_ids,
                                 attention_mask=inputs.attention_mask.long(),
                                 position_ids=inputs.position_ids)
            return {"values": fwd.response_gather(per_pos, inputs)}
        logits = fwd.hf_logits(self.model, inputs)
        logp, ent = fwd.logprobs_from_position_logits(
            logits, inputs, temperature=spec.temperature, calc_entropy=spec.calc_entropy,
            chunk_size=spec.chunk_size)
        out = {"log_probs": logp}
        if ent is not None:
            out["entropy"] = ent
        if spec.topk_field is not None:
            out["topk_log_probs"] = fwd.topk_logprobs_from_position_logits(
                logits, inputs, micro[spec.topk_field].to(self.device),
                temperature=spec.temperature, chunk_size=spec.chunk_size)
        return out

    def forward_backward(self, micros: list[RolloutBatch], spec: ForwardSpec,
                         loss_fn: LossFn | None) -> list[dict]:
        """Per micro-batch: outputs (detached) and, when ``loss_fn`` is given, its stats.

        With ``loss_fn=None`` this is a no-grad forward (old/ref log-probs, values)."""
        results = []
        scale = float(self.dp_size) if self.grad_average_over_dp else 1.0
        if loss_fn is not None:
            self.micro_log.append([describe_micro(m) for m in micros])
        for micro in micros:
            if loss_fn is None:
                with torch.no_grad():
                    out = self._outputs(micro, spec)
                results.append({"outputs": out, "stats": {}})
                continue
            out = self._outputs(micro, spec)
            loss, stats = loss_fn(micro.to(self.device), out)
            (loss * scale).backward()
            results.append({"outputs": {k: v.detach() for k, v in out.items()},
                            "stats": {k: v.detach() for k, v in stats.items()}})
        if loss_fn is None:
            self._reshard()
        return results

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters unsharded after a forward with no backward (it
        expects one). While unsharded, ``model.parameters()`` yields the unsharded tensors, so a
        later ``zero_grad`` misses the sharded gradients and the next backward accumulates onto
        the previous step's: reshard explicitly after forward-only passes."""
        reshard = getattr(self.model, "reshard", None)
        if callable(reshard):
            reshard()

    # ---- optimizer ---------------------------------------------------------------------------
    def _params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def clip_and_step(self, max_norm: float) -> float:
        grads = [p.grad for p in self._params() if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(total, "full_tensor"):  # DTensor under FSDP2: reduce over shards
            total = total.full_tensor()
        if not torch.isfinite(total):
            return float(total)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params(), max_norm, total)
        self.optimizer.step()
        return float(total)

    def zero_grad(self) -> None:
        # the optimizer holds the parameters it steps (sharded ones under FSDP2): clear those
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def full_parameters(self) -> dict[str, torch.Tensor]:
        # FSDP2 DTensor shards -> whole parameters, gathered together (not one per parameter)
        whole = collectives.full_tensors({n: p.detach() for n, p in self.model.named_parameters()})
        return {name: t.cpu() for name, t in whole.items()}
