"""Step and stage localisation of a divergence between two runs of one variant (docs/internals.md,
"Drift localisation").

Stages follow the data flow of one training step (rlaudit/update/step.py): :data:`STAGES`. Every
quantity a run carries belongs to one: per-token tensors (:data:`TOKEN_STAGE`), catalogue metrics
(:data:`METRIC_STAGE`), the parameters after each step. The first divergence is the earliest
training step at which any quantity leaves the scenario's tolerance, and within it the earliest
stage.

Two sources, the second finer than the first:

- :func:`first_divergence_in_runs`: what every VariantRun already carries (metrics per step,
  per-token tensors at step 0, parameters after each step). Metrics of the update are averaged
  over a step's optimizer steps, so beyond the batch-preparation stages at step 0 this places a
  divergence in a step, not yet in a stage.
- :func:`first_divergence_in_probe`: the probe re-run's records (rlaudit/backends/probe.py):
  the prepared batch of every step, and per optimizer step the update forward's log-probs, the
  loss terms, the pre-clip gradient, the grad norm and the parameters after it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from rlaudit.backends.base import VariantRun
from rlaudit.metrics import golden_names
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.tensors import compare_tensors
from rlaudit.verdict.tolerance import Tolerance

STAGES = ("scores", "old/ref log-probs", "KL in reward", "rollout IS weights", "advantages",
          "critic update", "per-micro-batch loss", "gradients", "grad norm",
          "parameters after the update")
#: stages of the batch preparation that involve no model: a divergence there at step 0 needs no
#: probe (the model's outputs, in the earlier stage "old/ref log-probs", agree)
NO_MODEL_STAGES = ("scores", "KL in reward", "rollout IS weights", "advantages")

TOKEN_STAGE = {
    "token_level_scores": "scores",
    "probe_log_probs": "old/ref log-probs", "probe_entropy": "old/ref log-probs",
    "old_log_probs": "old/ref log-probs", "ref_log_probs": "old/ref log-probs",
    "values": "old/ref log-probs",
    "kl": "KL in reward", "token_level_rewards": "KL in reward",
    "rollout_is_weights": "rollout IS weights",
    "advantages": "advantages", "returns": "advantages",
}

_STAGE_METRICS = {
    "scores": ("critic/score/mean", "critic/score/max", "critic/score/min",
               "response_length/mean", "response_length/max", "response_length/min",
               "response_length/clip_ratio", "prompt_length/mean", "train/overlong_penalty_mean",
               "train/num_gen_batches", "train/num_kept_groups"),
    "old/ref log-probs": ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff",
                          "rollout_corr/max_abs_log_prob_diff", "critic/values/mean"),
    "KL in reward": ("rollout/kl", "actor/reward_kl_penalty", "critic/rewards/mean"),
    "rollout IS weights": ("rollout_corr/is_weight_mean", "rollout_corr/is_clipfrac"),
    "advantages": ("critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
                   "critic/returns/mean"),
    "critic update": ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean",
                      "critic/grad_norm", "critic/lr"),
    "per-micro-batch loss": ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                             "actor/ppo_kl", "actor/entropy", "actor/kl_loss", "actor/kl_coef",
                             "actor/rollout_kl", "actor/distill_loss", "actor/loss",
                             "actor/num_microbatches"),
    "grad norm": ("actor/grad_norm",),
    "parameters after the update": ("actor/lr",),
}
METRIC_STAGE = {m: stage for stage, names in _STAGE_METRICS.items() for m in names}


def metric_stage(name: str) -> str | None:
    """The stage a catalogue metric is computed in (None: timing and unknown names)."""
    return METRIC_STAGE.get(name)


@dataclass
class Divergence:
    """One quantity out of tolerance: where (step, stage, optimizer step) and by how much."""

    quantity: str
    stage: str
    step: int
    message: str
    drift: float = 0.0
    optimizer_step: int | None = None
    worst: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StageReport:
    """The first divergent (step, stage[, optimizer step]); every divergent quantity there;
    the stages seen to agree before it at that step."""

    step: int | None
    stage: str | None
    divergences: list[Divergence]
    agreed: list[str]
    optimizer_step: int | None = None
    structural: list[str] = field(default_factory=list)
    """Failures that are not numeric divergences (metric names, a tensor in one run only)."""

    def to_json(self) -> dict:
        out = {"step": self.step, "stage": self.stage, "optimizer_step": self.optimizer_step,
               "agreed": list(self.agreed), "divergences": [d.to_json() for d in self.divergences]}
        if self.structural:
            out["structural"] = list(self.structural)
        return out


def _rel(got: float, want: float, tol: Tolerance) -> float:
    scale = max(abs(want), tol.atol / tol.rtol if tol.rtol > 0 else 0.0, 1e-300)
    return abs(got - want) / scale


def _tensor(scn, name: str, got: torch.Tensor, want: torch.Tensor, mask, *, stage: str,
            step: int, opt: int | None = None, tol_name: str | None = None) -> Divergence | None:
    tol = scn.tol(tol_name or name)
    ok, msg, det = compare_tensors(name, got, want, tol, mask)
    if ok:
        return None
    drift = det.get("max_abs_diff", float("inf"))
    return Divergence(name, stage, step, msg, drift, opt, det.get("worst", []))


def _metrics(scn, got: dict, want: dict, names, *, stage: str, step: int,
             opt: int | None = None) -> list[Divergence]:
    out = []
    for name in names:
        if name not in want or name not in got:
            continue
        tol = scn.tol(name)
        if not tol.close(got[name], want[name]):
            out.append(Divergence(name, stage, step, f"{name} = {got[name]:.10g}, expected "
                                  f"{want[name]:.10g}", _rel(got[name], want[name], tol), opt))
    return out


def param_of(names: list[str], numels: list[int], flat_index: int) -> tuple[str, int]:
    """(parameter name, index inside it) of an index into a flat parameter vector."""
    offset = 0
    for name, numel in zip(names, numels):
        if flat_index < offset + numel:
            return name, flat_index - offset
        offset += numel
    return "?", flat_index


def _params(scn, got: torch.Tensor, want: torch.Tensor, names, numels, *, step: int,
            opt: int | None = None) -> Divergence | None:
    d = _tensor(scn, f"parameters after step {step}", got, want, None,
                stage="parameters after the update", step=step, opt=opt, tol_name="params")
    if d is not None:
        for w in d.worst:
            w["parameter"], w["offset"] = param_of(names, numels, w["index"][0])
        if d.worst:
            d.message += f" (in {d.worst[0]['parameter']}[{d.worst[0]['offset']}])"
    return d


def _first(found: dict[str, list[Divergence]], step: int, opt: int | None = None
           ) -> StageReport | None:
    for i, stage in enumerate(STAGES):
        if found.get(stage):
            agreed = [s for s in STAGES[:i] if s in found]
            return StageReport(step, stage, found[stage], agreed, opt)
    return None


def first_divergence_in_runs(scn, got: VariantRun, want: VariantRun, mask: torch.Tensor
                             ) -> StageReport | None:
    """The first (step, stage) at which ``got`` leaves ``want``, or None when they agree.

    The comparison is parity's own (:func:`rlaudit.verdict.compare.compare_runs`:
    the same tolerances and noise floors), its failures placed by step and stage: a metric in its
    step and :func:`metric_stage`, a per-token tensor (recorded at step 0) in :data:`TOKEN_STAGE`,
    the parameters in the step after which they were read. Failures of neither kind (metric
    names, tensors present in one run only) are returned as ``structural`` on the report, or make
    a report with ``stage`` None when nothing numeric differs."""

    c = compare_runs(scn, got, want, mask=mask)
    if c.ok:
        return None
    placed: dict[tuple[int, str], list[Divergence]] = {}
    structural = []
    for f in c.details.get("failures", []):
        d = _placed(f)
        if d is None:
            structural.append(f.get("message", ""))
        else:
            placed.setdefault((d.step, d.stage), []).append(d)
    if not placed:
        return StageReport(step=None, stage=None, divergences=[], agreed=[],
                           structural=structural)
    step, stage = min(placed, key=lambda k: (k[0], STAGES.index(k[1])))
    seen = _stages_compared(got, want, step)
    agreed = [s for s in STAGES[:STAGES.index(stage)] if s in seen]
    # per-token tensors (they name the worst rows and tokens) before the metrics they feed
    found = sorted(placed[(step, stage)], key=lambda d: not d.worst)
    return StageReport(step, stage, found, agreed, structural=structural)


def _placed(f: dict) -> Divergence | None:
    """A compare_runs failure record as a Divergence with its step and stage (None: neither)."""
    msg = f.get("message", "")
    if "metric" in f and f.get("step") is not None:
        stage = metric_stage(f["metric"])
        if stage is None:
            return None
        want = f.get("want")
        drift = (abs(f["got"] - want) / max(abs(want), 1e-300)
                 if f.get("got") is not None and want is not None else 0.0)
        return Divergence(f["metric"], stage, int(f["step"]), msg, drift)
    if "tensor" in f and f["tensor"] in TOKEN_STAGE:
        return Divergence(f["tensor"], TOKEN_STAGE[f["tensor"]], 0, msg,
                          f.get("max_abs_diff", 0.0), worst=f.get("worst", []))
    if f.get("step") is not None and "parameters after step" in msg:
        return Divergence(f"parameters after step {f['step']}", "parameters after the update",
                          int(f["step"]), msg, f.get("max_abs_diff", 0.0),
                          worst=f.get("worst", []))
    return None


def _stages_compared(got: VariantRun, want: VariantRun, step: int) -> set[str]:
    """Stages with a quantity both runs carry at ``step``."""
    seen = set()
    if step == 0:
        seen |= {TOKEN_STAGE[n] for n in TOKEN_STAGE if n in got.tokens and n in want.tokens}
    if step < min(len(got.steps), len(want.steps)):
        seen |= {metric_stage(n) for n in golden_names(want.steps[step])
                 if n in got.steps[step]} - {None}
    if step < min(len(got.params), len(want.params)):
        seen.add("parameters after the update")
    return seen


def first_divergence_in_probe(scn, got: dict, want: dict, mask: torch.Tensor
                              ) -> StageReport | None:
    """The first (step, stage, optimizer step) at which the probe records ``got`` and ``want``
    (``run.info["probe"]`` of each side) disagree, or None."""
    names = want.get("param_names") or []
    numels = want.get("param_numels") or []
    for step, (gs, ws) in enumerate(zip(got["steps"], want["steps"])):
        found: dict[str, list[Divergence]] = {}
        for name, stage in TOKEN_STAGE.items():
            if name in ws["prepared"] and name in gs["prepared"]:
                d = _tensor(scn, name, gs["prepared"][name], ws["prepared"][name], mask,
                            stage=stage, step=step)
                found.setdefault(stage, [])
                if d is not None:
                    found[stage].append(d)
        report = _first(found, step)
        if report is not None:
            return report
        agreed = [s for s in STAGES if s in found]
        for k, (go, wo) in enumerate(zip(gs["optimizer_steps"], ws["optimizer_steps"])):
            found = {}
            loss = []
            if "rows" in go and "rows" in wo and torch.equal(go["rows"], wo["rows"]):
                d = _tensor(scn, "update log_probs", go["log_probs"], wo["log_probs"],
                            mask[wo["rows"]], stage="per-micro-batch loss", step=step, opt=k,
                            tol_name="probe_log_probs")
                if d is not None:
                    for entry in d.worst:  # report batch rows, not mini-batch rows
                        entry["index"][0] = int(wo["rows"][entry["index"][0]])
                    loss.append(d)
            loss += _metrics(scn, go.get("stats", {}), wo.get("stats", {}),
                             sorted(wo.get("stats", {})), stage="per-micro-batch loss",
                             step=step, opt=k)
            found["per-micro-batch loss"] = loss
            if go.get("grads") is not None and wo.get("grads") is not None:
                found["gradients"] = grad_divergences(scn, go["grads"], wo["grads"], names,
                                                      numels, step=step, opt=k)
            found["grad norm"] = _metrics(scn, {"actor/grad_norm": go["grad_norm"]},
                                          {"actor/grad_norm": wo["grad_norm"]},
                                          ["actor/grad_norm"], stage="grad norm", step=step,
                                          opt=k)
            hits = _metrics(scn, {"actor/lr": go.get("lr")}, {"actor/lr": wo.get("lr")},
                            ["actor/lr"] if "lr" in go and "lr" in wo else [],
                            stage="parameters after the update", step=step, opt=k)
            if go.get("params") is not None and wo.get("params") is not None:
                d = _params(scn, go["params"], wo["params"], names, numels, step=step, opt=k)
                if d is not None:
                    hits.append(d)
            found["parameters after the update"] = hits
            report = _first(found, step, k)
            if report is not None:
                report.agreed = agreed + [s for s in report.agreed if s not in agreed]
                return report
    return None


def magnitude_bound(want: torch.Tensor, tol: Tolerance) -> tuple[float, float]:
    """(scale, bound): the root-mean-square of ``want`` and ``atol + rtol * scale``, the largest
    |got - want| an entry may have (a tolerance scaled to the tensor's magnitude, so that entries
    near zero are not judged relative to themselves)."""
    w = want.double()
    scale = float(w.pow(2).mean().sqrt()) if w.numel() else 0.0
    return scale, tol.atol + tol.rtol * scale


def relative(max_abs: float, scale: float, tol: Tolerance) -> float:
    """max |diff| relative to the magnitude (or to atol/rtol where that is larger)."""
    return max_abs / max(scale, tol.atol / tol.rtol if tol.rtol > 0 else 0.0, 1e-300)


def grad_divergences(scn, got: torch.Tensor, want: torch.Tensor, names: list[str],
                     numels: list[int], *, step: int, opt: int | None = None
                     ) -> list[Divergence]:
    """Per parameter, its gradient vs the other side's under a tolerance scaled to that
    gradient's magnitude (``scn.tol("grads")``); the divergent ones, in parameter order."""
    tol = scn.tol("grads")
    out, offset = [], 0
    for name, numel in zip(names, numels):
        g, w = got[offset:offset + numel].double(), want[offset:offset + numel].double()
        offset += numel
        scale, bound = magnitude_bound(w, tol)
        diff = (g - w).abs()
        worst = float(diff.max()) if numel else 0.0
        if not worst > bound and bool(torch.isfinite(g).all()):
            continue
        bad = int((diff > bound).sum())
        i = int(diff.argmax())
        out.append(Divergence(
            f"gradient of {name}", "gradients", step,
            f"gradient of {name}: {bad} of {numel} entries out of tolerance (|diff| <= "
            f"{bound:.3g} = atol + rtol x rms {scale:.3g}); worst at [{i}]: {float(g[i]):.6g} vs "
            f"{float(w[i]):.6g}", relative(worst, scale, tol), opt,
            [{"index": [i], "got": float(g[i]), "want": float(w[i]), "parameter": name}]))
    return out
