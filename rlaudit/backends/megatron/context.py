"""MegatronContext: rlaudit's shared update step (rlaudit/update) on a megatron-core GPTModel.

The step asks a :class:`~rlaudit.update.context.ParallelContext` for collectives over the
data-parallel group, a forward/backward over micro-batches, a clipped optimizer step, the learning
rate and the full parameters. Here every one of those goes through megatron-core's own machinery:

- forward/backward: ``get_forward_backward_func()`` (no pipelining, or 1F1B for PP > 1) with a data
  iterator over the micro-batches, padding micro-batches included (they carry every field).
  ``variable_seq_lengths`` is on, so each micro-batch keeps its own ``[b, S]`` shape across
  pipeline p2p sends. The last stage turns its vocab-sharded logits into per-token log-probs,
  entropy and top-k log-probs with rlaudit's vocab-parallel functions (over the TP group), then
  calls the shared ``loss_fn`` (``actor_loss``).
- gradient scale: ``actor_loss`` returns a *contribution* already divided by the mini-batch's global
  token/sequence counts; the accumulated gradient must be the gradient of the *sum* of
  contributions over micro-batches and DP ranks. The model config sets
  ``calculate_per_token_loss=True``, which makes the schedule leave the loss undivided (no
  ``/ num_microbatches``) and megatron DDP *sum* gradients over DP (gradient scaling factor 1).
  Megatron would then divide the gradients by the total token count it collected from
  ``loss_func``; :func:`finalize_grads_without_token_scaling` runs megatron's
  ``finalize_model_grads`` (DP all-reduce, PP embedding all-reduce) without that division,
  because our denominators are already in the loss (and megatron's ``1 / num_tokens`` is a float32
  scalar, which would cost float64 runs their exactness).
- outputs and metric contributions exist only on the last pipeline stage; they are broadcast over
  the PP group so that every rank (the shared step runs everywhere) has them. Metrics are copies
  (``.detach().clone()``): megatron's schedule modifies loss tensors in place.
- optimizer: megatron's (``get_megatron_optimizer``: FP32Optimizer, Float16Optimizer for bf16, or
  the DistributedOptimizer) stepped as megatron's own ``step()`` does — ``prepare_grads``, norm and
  clip, ``step_with_ready_grads`` — with one addition the shared contract asks for: the step is
  skipped when the norm is not finite. With float32 main grads the norm and the clipping are
  megatron's own (``get_grad_norm``, ``clip_grad_by_total_norm_fp32``). Megatron's norm is
  float32-only (``get_grad_norm_fp32`` rounds to float32, ``clip_grad_by_total_norm_fp32`` asserts
  float32 grads), so with float64 grads the norm is taken over exactly the gradients megatron
  selects (``get_main_grads_for_grad_norm``: no TP duplicates, no shared copies), reduced over its
  grad-stats group in float64, and clipped with megatron's formula; megatron's own float32 norm is
  still computed and kept in :attr:`MegatronContext.norm_log` as a cross-check.

The reference policy (no optimizer) is a bare GPTModel stage in eval mode: forward-only passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from rlaudit.backends.megatron.convert import gather_hf_state_dict
from rlaudit.backends.megatron.model import attention_mask_4d, hf_model_spec, position_ids
from rlaudit.backends.megatron.vocab_parallel import (vocab_parallel_log_probs_at,
                                                      vocab_parallel_logprobs_entropy)
from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError
from rlaudit.update import collectives
from rlaudit.update import forward as fwd
from rlaudit.update.context import ForwardSpec, LossFn
from rlaudit.update.plan import describe_micro

#: megatron's (and torch's clip_grad_norm_) epsilon in the clip coefficient max_norm / (norm + eps)
CLIP_EPS = 1.0e-6
#: model config overrides every rlaudit GPTModel gets (see the module docstring: gradient scale)
CONFIG_OVERRIDES = {"calculate_per_token_loss": True}


def finalize_grads_without_token_scaling(model_chunks, num_tokens=None, **kwargs) -> None:
    """``config.finalize_model_grads_func``: megatron's ``finalize_model_grads`` (DP gradient
    all-reduce or reduce-scatter, embedding/LayerNorm all-reduces) with ``num_tokens=None``: the
    loss contributions are already divided by the mini-batch's global denominators."""
    # lazy: megatron-core: optional, 4 s import
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model_chunks, None, **kwargs)


def _copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def _to(records: list[dict], device) -> list[dict]:
    return [{part: {k: v.to(device) for k, v in rec[part].items()} for part in ("outputs", "stats")}
            for rec in records]


@dataclass
class MegatronContext:
    """This rank's pipeline stage of a GPTModel under megatron's TP/PP/DP groups.

    ``model``: megatron ``DistributedDataParallel`` around this rank's GPTModel stage (actor), or
    the bare stage (reference policy, ``optimizer=None``: forward-only). ``hf_config``: the HF
    config the model was built from (vocabulary size, parameter names for
    :meth:`full_parameters`). ``optimizer``: a megatron optimizer over ``model``. ``pad_id``: the id
    :func:`rlaudit.update.forward.build_inputs` pads with (must be a valid token id: labels are
    read at every position). Parallel sizes and groups come from ``megatron.core.parallel_state``.
    """

    model: torch.nn.Module
    hf_config: Any
    optimizer: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pad_id: int = 0
    micro_log: list = field(default_factory=list)
    """One entry per optimizer step: describe_micro() of every micro-batch this rank ran."""
    norm_log: list = field(default_factory=list)
    """One entry per optimizer step: {"grad_norm": the norm returned, "megatron_fp32": megatron's
    own float32 norm of the same gradients}."""

    def __post_init__(self):
        from megatron.core import parallel_state as ps  # lazy: megatron-core: optional, 4 s import

        self._dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._pp_size = ps.get_pipeline_model_parallel_world_size()
        self._pp_last_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank
        self._last_stage = ps.is_pipeline_last_stage()
        self.vocab_size = hf_model_spec(self.hf_config).vocab_size

    # ---- collectives over the data-parallel group ---------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A reduced copy of ``t`` over the DP group (TP/PP peers hold identical values)."""
        return collectives.all_reduce(t, op, group=self._dp_group, size=self.dp_size,
                                      device=self.device)

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every DP rank's ``t`` (same shape except dim 0, which may differ), DP-rank order."""
        return collectives.all_gather_rows(t, group=self._dp_group, size=self.dp_size,
                                           device=self.device)

    # ---- forward / backward -------------------------------------------------------------------
    def forward_backward(self, micros: list[RolloutBatch], spec: ForwardSpec,
                         loss_fn: LossFn | None) -> list[dict]:
        """Per micro-batch ``{"outputs": {log_probs [b, R], entropy [b, R]?, topk_log_probs
        [b, R, K]?}, "stats": {name: scalar contribution}}`` on every rank, in micro-batch order.

        ``loss_fn=None``: a no-grad forward (``forward_only=True``). Otherwise gradients of the
        summed contributions accumulate in megatron DDP's grad buffers (see the module docstring).
        Every rank of a model-parallel group must pass the same micro-batches.
        """
        if spec.kind != "logprobs":
            raise InputError("the megatron backend computes policy log-probs only; a critic "
                             "(values, GAE) is not implemented on it",
                             key="algorithm.adv_estimator")
        if loss_fn is not None:
            self.micro_log.append([describe_micro(m) for m in micros])
        if not micros:  # this DP rank has no rows (forward-only): no collective to join
            return []
        # lazy: megatron-core: optional, 4 s import
        from megatron.core.pipeline_parallel import get_forward_backward_func

        first = micros[0]
        seq = int((first["prompt_lengths"] + first["response_lengths"]).max())
        run = partial(get_forward_backward_func(),
                      forward_step_func=partial(self._forward_step, spec=spec, loss_fn=loss_fn),
                      data_iterator=iter(micros), model=[self.model],
                      num_microbatches=len(micros), seq_length=max(seq, 2),
                      micro_batch_size=len(first), forward_only=loss_fn is None)
        if loss_fn is None:
            with torch.no_grad():
                records = run()
        else:
            records = run()
        return self._from_last_stage(list(records) if self._last_stage else None)

    def _forward_step(self, data_iterator, model, *, spec: ForwardSpec, loss_fn: LossFn | None):
        """megatron's forward_step_func: run this stage on the next micro-batch (right-padded,
        explicit [b, 1, S, S] mask, positions 0..S-1); the last stage's output goes to
        :meth:`_loss_func`."""
        micro = next(data_iterator).to(self.device)
        inputs = fwd.build_inputs(micro, pad_id=self.pad_id)
        ids = inputs.input_ids
        output = model(ids, position_ids(ids), attention_mask_4d(inputs.attention_mask))
        return output, partial(self._loss_func, micro, inputs, spec, loss_fn)

    def _loss_func(self, micro: RolloutBatch, inputs: fwd.ModelInputs, spec: ForwardSpec,
                   loss_fn: LossFn | None, logits_shard: torch.Tensor):
        """Last stage: ``(loss, num_tokens, record)`` as megatron's schedule expects.

        With ``calculate_per_token_loss`` the schedule neither divides ``loss`` nor uses
        ``num_tokens`` (the micro-batch's valid tokens, int) for anything but its own total, which
        :func:`finalize_grads_without_token_scaling` ignores."""
        out = self._token_outputs(logits_shard, inputs, micro, spec)
        num_tokens = micro.mask.sum().to(torch.int)
        if loss_fn is None:
            return logits_shard.new_zeros(()), num_tokens, {"outputs": _copies(out), "stats": {}}
        loss, stats = loss_fn(micro, out)
        return loss, num_tokens, {"outputs": _copies(out), "stats": _copies(stats)}

    def _token_outputs(self, shard: torch.Tensor, inputs: fwd.ModelInputs, micro: RolloutBatch,
                       spec: ForwardSpec) -> dict[str, torch.Tensor]:
        """Vocab-sharded logits ``[b, S, V_pad/tp]`` -> response-aligned per-token outputs."""
        logp, ent = vocab_parallel_logprobs_entropy(
            shard, inputs.labels, temperature=spec.temperature, calc_entropy=spec.calc_entropy,
            tp_group=self._tp_group, vocab_size=self.vocab_size)
        out = {"log_probs": fwd.response_gather(logp, inputs)}
        if ent is not None:
            out["entropy"] = fwd.response_gather(ent, inputs)
        if spec.topk_field is not None:
            idx = inputs.gather_index.unsqueeze(-1).expand(-1, -1, shard.shape[-1])
            at = vocab_parallel_log_probs_at(shard.gather(1, idx), micro[spec.topk_field],
                                             temperature=spec.temperature,
                                             tp_group=self._tp_group, vocab_size=self.vocab_size)
            out["topk_log_probs"] = torch.where(inputs.valid.unsqueeze(-1), at,
                                                torch.zeros((), dtype=at.dtype, device=at.device))
        return out

    def _from_last_stage(self, records: list[dict] | None) -> list[dict]:
        """The last stage's records on every stage (broadcast over the PP group, via the CPU)."""
        if self._pp_size == 1:
            return records
        box = [_to(records, "cpu") if self._last_stage else None]
        dist.broadcast_object_list(box, src=self._pp_last_rank, group=self._pp_group)
        return _to(box[0], self.device)

    # ---- optimizer ----------------------------------------------------------------------------
    def inner_optimizers(self) -> list:
        """The megatron optimizers inside ``get_megatron_optimizer``'s ChainedOptimizer."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def clip_and_step(self, max_norm: float) -> float:
        """Pre-clip global L2 grad norm (every TP/PP shard once, DP-reduced grads); clip to
        ``max_norm`` (<= 0: no clipping) and step, unless the norm is not finite.

        Mirrors megatron's ``ChainedOptimizer.step``: prepare_grads, get_grad_norm, clip each
        inner optimizer's parameters by the total norm, step_with_ready_grads."""
        from megatron.core.optimizer import clip_grads  # lazy: megatron-core: optional, 4 s import

        opt = self.optimizer
        found_inf = opt.prepare_grads()          # DDP main grads -> the optimizer's grads
        inner = [o for o in self.inner_optimizers() if not getattr(o, "is_stub_optimizer", False)]
        grads = [g for o in inner for g in o.get_main_grads_for_grad_norm()]
        megatron_norm = float(opt.get_grad_norm())
        fp32 = all(g.dtype == torch.float32 for g in grads)
        norm = (megatron_norm if fp32 else
                self._exact_grad_norm(grads, opt.get_grad_stats_parallel_group()))
        self.norm_log.append({"grad_norm": norm, "megatron_fp32": megatron_norm})
        if found_inf or not math.isfinite(norm):
            return norm
        if max_norm > 0:
            for o in inner:
                params = o.get_parameters()
                if fp32:
                    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
                elif max_norm / (norm + CLIP_EPS) < 1.0:  # megatron's formula, any dtype
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(max_norm / (norm + CLIP_EPS))
        opt.step_with_ready_grads()
        return norm

    def _exact_grad_norm(self, grads: list[torch.Tensor], group) -> float:
        """sqrt(sum of squares) of ``grads`` in float64, summed over ``group``."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            sq = sq + g.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=group)
        return float(sq.sqrt())

    def zero_grad(self) -> None:
        if hasattr(self.model, "zero_grad_buffer"):  # megatron DDP's main-grad buffers
            self.model.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under HF names, gathered over the model-parallel group (collective)."""
        return gather_hf_state_dict(self.model, self.hf_config)
