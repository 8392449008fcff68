"""Layer and op localisation: compare the probe's hooked pass on two sides module by module
(docs/internals.md, "Drift localisation").

Both sides' records (``run.info["probe"]["layers"]``, rlaudit/backends/probe.py) hold, under HF
module names in depth order — embedding, per decoder layer its input norm, attention, MLP norm,
MLP and the layer's output, final norm, LM head — each module's output ``[b, S, ...]`` on the same
rows and inputs, the gradient that reached it, and every parameter's gradient.

Tolerance scaled to magnitude: a module's output (or a gradient) leaves tolerance when
``max |got - want| > atol + rtol * rms(want)`` over the real (non-pad) positions, with (rtol, atol)
the scenario's ``layers`` tolerance (``grads`` for parameter gradients; both default to the
scenario dtype's). An entry is not judged relative to itself (activations cross zero), and a
module with large activations gets a proportionally larger bound. The drift curve plots
``max |diff| / rms(want)`` per module: its noise floor is the dtype's rounding, and a fault shows
as a jump of many orders of magnitude at the module where it enters.
"""

from __future__ import annotations

import torch

from rlaudit.scenarios.localise_stages import magnitude_bound, relative

#: worst token positions reported at the first module out of tolerance
WORST_TOKENS = 5


def _pair(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor):
    """Both tensors (cut to the rows and positions both recorded: the probe cuts outputs of a
    large model, rlaudit/backends/probe.py) and the valid mask broadcast to them."""
    n = min(got.shape[0], want.shape[0], valid.shape[0])
    s = min(got.shape[1], want.shape[1], valid.shape[1])
    g, w, v = got[:n, :s].double(), want[:n, :s].double(), valid[:n, :s]
    v = v.view(*v.shape, *([1] * (w.dim() - 2))).expand_as(w)
    return g, w, v


def _module_drift(got, want, valid, tol) -> dict:
    if got.shape[2:] != want.shape[2:]:
        return {"max_abs": float("inf"), "scale": 0.0, "drift": float("inf"), "bound": 0.0,
                "out": True, "note": f"shape {tuple(got.shape)} vs {tuple(want.shape)}"}
    g, w, v = _pair(got, want, valid)
    diff = torch.where(v, (g - w).abs(), torch.zeros((), dtype=torch.float64))
    nonfinite = bool((v & ~torch.isfinite(g)).any())
    scale, bound = magnitude_bound(w[v], tol)
    max_abs = float("inf") if nonfinite else (float(diff.max()) if diff.numel() else 0.0)
    return {"max_abs": max_abs, "scale": scale, "drift": relative(max_abs, scale, tol),
            "bound": relative(bound, scale, tol), "out": max_abs > bound}


def _worst_tokens(got, want, layers: dict, n: int = WORST_TOKENS) -> list[dict]:
    valid = layers["attention_mask"].bool()
    g, w, v = _pair(got, want, valid)
    diff = torch.where(v, (g - w).abs(), torch.full_like(g, -1.0))
    per_pos = diff.flatten(2).amax(-1) if diff.dim() > 2 else diff           # [b, S]
    k = min(n, int((per_pos >= 0).sum()))
    out = []
    for flat_i in torch.topk(per_pos.flatten(), k).indices.tolist():
        i, s = divmod(flat_i, per_pos.shape[1])
        pl = int(layers["prompt_lengths"][i])
        out.append({"row": int(layers["rows"][i]), "position": s,
                    "token_id": int(layers["input_ids"][i, s]),
                    "part": "prompt" if s < pl else f"response token {s - pl}",
                    "max_abs_diff": float(per_pos[i, s])})
    return out


def _same_inputs(got: dict, want: dict) -> str | None:
    if list(got["rows"]) != list(want["rows"]):
        return f"the two probes ran different rows ({got['rows']} vs {want['rows']})"
    if not torch.equal(got["input_ids"], want["input_ids"]):
        return "the two probes built different model inputs from the same rows"
    return None


def forward_report(scn, got: dict, want: dict) -> dict:
    """Module outputs in depth order: the drift curve, the first module out of tolerance and the
    worst token positions there."""
    problem = _same_inputs(got, want)
    if problem:
        return {"direction": "forward", "error": problem}
    tol = scn.tol("layers")
    valid = want["attention_mask"].bool()
    curve, first = [], None
    for name, w in want["outputs"].items():
        if name not in got["outputs"]:
            curve.append({"module": name, "note": "not recorded by this backend"})
            continue
        entry = {"module": name, **_module_drift(got["outputs"][name], w, valid, tol)}
        curve.append(entry)
        if first is None and entry["out"]:
            first = entry
    out = {"direction": "forward", "curve": curve, "rtol": tol.rtol, "atol": tol.atol,
           "module": None}
    if first is not None:
        out.update(module=first["module"], what="output", drift=first["drift"],
                   bound=first["bound"])
        if "note" not in first:
            out["worst_tokens"] = _worst_tokens(got["outputs"][first["module"]],
                                                want["outputs"][first["module"]], want)
    return out


def _param_grads(scn, module: str, got: dict | None, want: dict | None) -> list[dict]:
    if not got or not want:
        return []
    tol = scn.tol("grads")
    out = []
    for name, w in want.items():
        if not name.startswith(module + ".") or name not in got:
            continue
        g, w = got[name].double(), w.double()
        scale, bound = magnitude_bound(w, tol)
        diff = (g - w).abs()
        bad = diff > bound
        entry = {"parameter": name, "drift": relative(float(diff.max()), scale, tol),
                 "bound": relative(bound, scale, tol), "out": bool(bad.any()),
                 "entries_out": int(bad.sum()), "numel": w.numel()}
        if bad.any():
            entry["ranges_out"] = _ranges(bad)
        out.append(entry)
    return out


def _ranges(bad: torch.Tensor) -> list[list[int]]:
    """Per dimension, ``[first, last, size]`` of the indices holding an entry out of tolerance
    (a tensor-parallel shard shows as one half of a dimension)."""
    out = []
    for d in range(bad.dim()):
        hit = bad.transpose(0, d).reshape(bad.shape[d], -1).any(-1).nonzero().flatten()
        out.append([int(hit.min()), int(hit.max()), int(bad.shape[d])])
    return out


def _is_container(name: str) -> bool:
    """A decoder layer as a whole: its parameters belong to the modules inside it."""
    return name.startswith("model.layers.") and name.count(".") == 2


def backward_report(scn, got: dict, want: dict) -> dict:
    """In backward order (LM head first): the gradient reaching each module's output and its
    parameters' gradients. The first module whose parameters' gradients leave tolerance while
    the gradient at its output agrees has a wrong backward; a gradient at an output that leaves
    tolerance first points at the backward of the module after it (at the LM head: the loss)."""
    problem = _same_inputs(got, want)
    if problem:
        return {"direction": "backward", "error": problem}
    tol = scn.tol("layers")
    valid = want["attention_mask"].bool()
    curve, first = [], None
    for name in reversed(list(want["outputs"])):
        entry: dict = {"module": name}
        if name in want["output_grads"] and name in got["output_grads"]:
            entry.update(_module_drift(got["output_grads"][name], want["output_grads"][name],
                                       valid, tol))
        else:
            entry.update(out=False, note="no gradient recorded at its output")
        params = [] if _is_container(name) else _param_grads(scn, name, got["param_grads"],
                                                               want["param_grads"])
        entry["params"] = params
        entry["params_out"] = any(p["out"] for p in params)
        curve.append(entry)
        if first is None and (entry["out"] or entry["params_out"]):
            first = entry
    out = {"direction": "backward", "curve": curve, "rtol": tol.rtol, "atol": tol.atol,
           "module": None}
    if first is not None:
        if first["out"]:
            idx = curve.index(first)
            after = curve[idx - 1]["module"] if idx > 0 else None
            what = (f"gradient at its output (the backward of {after} or of the residual "
                    f"stream after it)" if after else
                    "gradient at its output (the loss's gradient w.r.t. the logits)")
            out.update(drift=first["drift"], bound=first["bound"])
            if "note" not in first:
                out["worst_tokens"] = _worst_tokens(got["output_grads"][first["module"]],
                                                    want["output_grads"][first["module"]], want)
        else:
            what = "parameter gradients (its backward; the gradient at its output agrees)"
            worst = max((p for p in first["params"] if p["out"]), key=lambda p: p["drift"])
            out.update(drift=worst["drift"], bound=worst["bound"])
        out.update(module=first["module"], what=what)
    return out
