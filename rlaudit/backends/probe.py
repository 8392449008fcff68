"""The drift localisation's probe, inside a backend's ranks (docs/internals.md, "Drift
localisation").

Only the localisation's re-run of a failing variant carries a :class:`ProbeSpec`
(``Variant.probe``); :func:`rlaudit.backends.replay.replay_variant` then runs the variant up to
``spec.target_step`` and this module records, besides the usual VariantRun:

- per training step, the batch fields the step derived (old/ref log-probs, KL, rewards, rollout
  IS weights, advantages, returns), ``[B, R]``;
- per optimizer step, through a proxy of the actor's ParallelContext: the rows of the
  mini-batch, the update forward's log-probs for them (``[n, R]``, gathered over DP ranks), the
  loss terms (mini-batch values: contributions summed over micro-batches and ranks), the pre-clip
  gradient and the parameters after the step (flat float64 over HF names in sorted order), and the
  grad norm;
- at the start of ``spec.target_step``: one pass of ``spec.rows`` as a single micro-batch with a
  hook on every module (:func:`module_table`): each module's output, the gradient arriving at it
  and every parameter's gradient (for the actor: its loss with the micro-batch's own
  denominators; for the reference policy: forward only). Every rank runs the same rows; gradients
  are divided by the DP size (each DP replica adds the same rows' gradient).

Megatron's side (sequence-first outputs, the vocab-split output layer, pipeline stages, gradients
in DDP buffers) is in :mod:`rlaudit.backends.megatron.probe`. Records land in
``run.info["probe"]`` on global rank 0 only; the other ranks take part in the collectives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from rlaudit.algo.agg import Denominators
from rlaudit.backends.hooks import ModuleHooks, hf_module_names
from rlaudit.backends.megatron.model import hf_model_spec
from rlaudit.data.batching import is_padding_microbatch
from rlaudit.update.actor import actor_forward_spec, actor_loss
from rlaudit.update.forward import build_inputs
from rlaudit.update.stats import MetricAccumulator
from rlaudit.update.step import prepare_batch

#: per-row index field added to the probed batch (every micro-batch carries it)
ROW_FIELD = "_probe_row"
#: batch fields recorded per training step (the prepared batch, in data-flow order)
PREPARED_FIELDS = ("token_level_scores", "old_log_probs", "ref_log_probs", "values", "kl",
                   "token_level_rewards", "rollout_is_weights", "advantages", "returns")
#: rows of the layer probe's micro-batch when the localisation names none
DEFAULT_ROWS = 8
#: gradients (flat, per optimizer step and in the layer probe) only for models up to this many
#: parameters: gathering them whole on every rank is for test-sized models
MAX_PARAMS = 5_000_000


@dataclass(frozen=True)
class ProbeSpec:
    """What the re-run records. ``target_step``: the training step whose start the layer probe
    hooks (the run stops after it). ``rows``: batch rows of the layer probe (empty: the first
    :data:`DEFAULT_ROWS`). ``role``: ``actor`` (forward + backward) or ``ref`` (forward only)."""

    target_step: int = 0
    rows: tuple[int, ...] = ()
    role: str = "actor"


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def is_megatron(ctx) -> bool:
    return hasattr(ctx, "hf_config")


def flat(tensors: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    """One float64 vector over sorted names (the layout of VariantRun.params), or None."""
    if tensors is None:
        return None
    names = sorted(tensors)
    if sum(tensors[n].numel() for n in names) > MAX_PARAMS:
        return None
    return torch.cat([tensors[n].detach().cpu().double().flatten() for n in names])


def param_count(ctx) -> int:
    """The model's parameter count, the same on every rank (megatron: from its HF config)."""
    if is_megatron(ctx):
        s = hf_model_spec(ctx.hf_config)
        per_layer = 2 * s.hidden_size + s.hidden_size * s.head_dim * (
            s.num_heads * 2 + s.num_kv_heads * 2) + 3 * s.hidden_size * s.ffn_hidden_size
        heads = 1 if s.tied_embeddings else 2
        return heads * s.vocab_size * s.hidden_size + s.num_layers * per_layer + s.hidden_size
    return sum(p.numel() for p in ctx.model.parameters())


def hf_grads(ctx) -> dict[str, torch.Tensor] | None:
    """The accumulated (DP-reduced) gradient of every parameter under HF names, on every rank
    (collective), or None when the engine does not hold whole gradients (megatron's distributed
    optimizer with DP > 1 keeps only its shard after the reduce-scatter) or the model is larger
    than :data:`MAX_PARAMS`."""
    if param_count(ctx) > MAX_PARAMS:
        return None
    if is_megatron(ctx):
        # lazy: megatron-core is optional (a Megatron context has it), 4 s import
        from rlaudit.backends.megatron.probe import hf_grads as megatron_grads
        return megatron_grads(ctx)
    out = {}
    for name, p in ctx.model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = torch.zeros(tuple(p.shape), dtype=p.dtype)
            continue
        if hasattr(g, "full_tensor"):  # FSDP2 DTensor shard -> whole gradient (collective)
            g = g.full_tensor()
        out[name] = g.detach().cpu().clone()
    return out


# ---- per optimizer step -------------------------------------------------------------------------

class RecordingContext:
    """A ParallelContext that records each optimizer step of the update into ``sink`` and
    otherwise behaves exactly as the context it wraps."""

    def __init__(self, inner, sink: list):
        self._inner = inner
        self._sink = sink
        self._pending: dict = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward_backward(self, micros, spec, loss_fn):
        results = self._inner.forward_backward(micros, spec, loss_fn)
        if loss_fn is not None:
            self._pending = self._update_record(micros, results)
        return results

    def clip_and_step(self, max_norm: float) -> float:
        small = param_count(self._inner) <= MAX_PARAMS
        grads = flat(hf_grads(self._inner)) if small else None
        norm = self._inner.clip_and_step(max_norm)
        params = flat(self._inner.full_parameters()) if small else None
        if is_rank0():
            self._sink.append({**self._pending, "grads": grads, "grad_norm": float(norm),
                               "lr": float(self._inner.lr), "params": params})
        self._pending = {}
        return norm

    def _update_record(self, micros, results) -> dict:
        """Rows and update-forward log-probs of the whole mini-batch (gathered over DP) and its
        loss terms (summed over micro-batches and ranks, as the update step reports them)."""
        ctx = self._inner
        rows, lps = [], []
        width = micros[0].response_width if micros else 0
        for micro, res in zip(micros, results):
            if is_padding_microbatch(micro) or ROW_FIELD not in micro:
                continue
            rows.append(micro[ROW_FIELD].long().cpu())
            lps.append(res["outputs"]["log_probs"].detach().double().cpu())
        local_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        local_lp = torch.cat(lps) if lps else torch.zeros(0, width, dtype=torch.float64)
        all_rows = torch.cat([t.cpu() for t in ctx.all_gather_rows(local_rows)])
        all_lp = torch.cat([t.cpu() for t in ctx.all_gather_rows(local_lp)])
        stats = MetricAccumulator.sum_micro_stats(ctx, [r["stats"] for r in results])
        order = torch.argsort(all_rows)
        return {"rows": all_rows[order], "log_probs": all_lp[order], "stats": stats}


def _hf_hooks(ctx) -> ModuleHooks:
    named = dict(ctx.model.named_modules())
    return ModuleHooks({n: named[n] for n in hf_module_names(ctx.model)})


def attach_hooks(ctx) -> ModuleHooks:
    if is_megatron(ctx):
        # lazy: megatron-core is optional (a Megatron context has it), 4 s import
        from rlaudit.backends.megatron.probe import attach_hooks as megatron_hooks
        return megatron_hooks(ctx)
    return _hf_hooks(ctx)


def collect_hooks(ctx, hooks: ModuleHooks) -> tuple[dict, dict]:
    """(outputs, gradients at the outputs) under HF module names, batch-first, on CPU (collective
    for megatron: the output layer is gathered over TP, stages over PP)."""
    if is_megatron(ctx):
        from rlaudit.backends.megatron.probe import collect  # lazy: megatron-core, optional
        return collect(ctx, hooks)
    return ({n: t.cpu() for n, t in hooks.outputs.items()},
            {n: t.cpu() for n, t in hooks.grads.items()})


def layer_probe(roles, batch, cfg, spec: ProbeSpec) -> dict:
    """One hooked pass of ``spec.rows`` at the current weights (see the module docstring)."""
    prepared, _ = prepare_batch(roles, batch, cfg)
    rows = list(spec.rows) or list(range(min(len(batch), DEFAULT_ROWS)))
    micro = prepared.select(rows)
    ctx = roles.actor if spec.role == "actor" else roles.ref
    if ctx is None:
        return {"error": f"the step has no {spec.role} model"}
    n_log = len(ctx.micro_log)
    grads = None
    hooks = attach_hooks(ctx)
    try:
        if spec.role == "actor":
            norm_len = float(cfg.actor.loss_scale_factor or batch.response_width)
            ctx.zero_grad()
            ctx.forward_backward([micro], actor_forward_spec(cfg, for_update=True),
                                 partial(actor_loss, cfg=cfg,
                                         denom=Denominators.of(micro.mask, norm_len=norm_len)))
            raw = hf_grads(ctx)
            if raw is not None:
                grads = {n: g.double() / ctx.dp_size for n, g in raw.items()}
            ctx.zero_grad()
        else:
            ctx.forward_backward([micro], actor_forward_spec(cfg, for_update=False), None)
    finally:
        hooks.remove()
        del ctx.micro_log[n_log:]
    outputs, out_grads = collect_hooks(ctx, hooks)
    inputs = build_inputs(micro, pad_id=getattr(ctx, "pad_id", 0))
    return {"role": spec.role, "rows": rows, "input_ids": inputs.input_ids.cpu(),
            "attention_mask": inputs.attention_mask.cpu(),
            "prompt_lengths": micro["prompt_lengths"].cpu(), "outputs": outputs,
            "output_grads": out_grads, "param_grads": grads}


# ---- the recorder replay_variant drives ---------------------------------------------------------

class ProbeRecorder:
    """Wraps a variant's roles and batch for the probe re-run and collects the records."""

    def __init__(self, spec: ProbeSpec):
        self.spec = spec
        self.steps_rec: list[dict] = []
        self.layers: dict | None = None
        self._opt: list[dict] = []
        self._inner = None

    def attach(self, roles, batch):
        """(roles with a recording actor, the batch with a row index field)."""
        self._inner = roles
        wrapped = dataclasses.replace(roles, actor=RecordingContext(roles.actor, self._opt))
        idx = torch.arange(len(batch))
        return wrapped, batch.with_fields(kinds={ROW_FIELD: "seq"}, **{ROW_FIELD: idx})

    def steps(self, steps: int) -> int:
        return min(steps, self.spec.target_step + 1)

    def before_step(self, step: int, batch, cfg) -> None:
        self._opt.clear()
        if step == self.spec.target_step:
            layers = layer_probe(self._inner, batch, cfg, self.spec)
            self.layers = layers if is_rank0() else None

    def after_step(self, step: int, result) -> None:
        if not is_rank0():
            return
        prepared = {f: result.batch[f].detach().cpu().clone() for f in PREPARED_FIELDS
                    if f in result.batch}
        self.steps_rec.append({"prepared": prepared, "optimizer_steps": list(self._opt)})

    def record(self, run) -> dict | None:
        """Everything recorded (rank 0; None elsewhere), with the layout of the flat gradient and
        parameter vectors and the initial parameters from ``run`` (the VariantRun)."""
        if not is_rank0():
            return None
        return {"spec": dataclasses.asdict(self.spec), "steps": self.steps_rec,
                "layers": self.layers, "param_names": list(run.param_names),
                "param_numels": list(run.param_numels), "params_initial": run.params_initial}
