"""A trainer's reward logging against the rollout's reward functions (rlaudit/data/rewards.py),
recomputed by loops."""

from __future__ import annotations

import json

from rlaudit.data.io import sidecar_path
from rlaudit.data.rewards import MASK, SCORES, metric_name, reward_functions
from rlaudit.scenarios.invariants.base import (CheckContext, invariant, not_applicable,
                                               result)

COMBINED = "critic/score/mean"


def several_functions_off(scn) -> str | None:
    """reward-logging's trigger: a rollout scored by several reward functions (the sidecar's
    ``meta.reward_functions``)."""
    try:
        meta = json.loads(sidecar_path(scn.rollout).read_text(encoding="utf-8")).get("meta", {})
    except (OSError, ValueError):
        meta = {}
    if meta.get("reward_functions"):
        return None
    return "needs a rollout scored by several reward functions (meta.reward_functions)"


def naive_expected(batch) -> dict[str, float]:
    """Per function, its mean over the rows it scored; and the mean over rows of each row's
    weighted sum over the functions that scored it -- by loops over the batch's rows."""
    funcs = reward_functions(batch.tensors, batch.meta)
    scores = batch[SCORES].tolist()
    mask = batch[MASK].tolist() if MASK in batch else [[True] * len(funcs.names)] * len(scores)
    out = {}
    for f, name in enumerate(funcs.names):
        scored = [row[f] for row, m in zip(scores, mask) if m[f]]
        if scored:
            out[metric_name(name)] = sum(scored) / len(scored)
    combined = [sum(w * s for w, s, m in zip(funcs.weights, row, ms) if m)
                for row, ms in zip(scores, mask)]
    out[COMBINED] = sum(combined) / len(combined)
    return out


def _problems(scn, run, want: dict[str, float]) -> tuple[list[str], list[str]]:
    """(problems, names checked) of one run's logged rewards at every step."""
    per_function = [n for n in want if n != COMBINED]
    problems, checked = [], []
    for step, metrics in enumerate(run.steps):
        logged = [n for n in per_function if n in metrics]
        if logged and len(logged) < len(per_function):
            missing = sorted(set(per_function) - set(logged))
            problems.append(f"step {step}: logs {logged} but not {missing}")
        for name in ([COMBINED] if COMBINED in metrics else []) + logged:
            got = float(metrics[name])
            if name not in checked:
                checked.append(name)
            if not scn.tol(name).close(got, want[name]):
                problems.append(f"step {step}: {name} = {got:.8g}, expected {want[name]:.8g} "
                                f"from the rollout's reward functions")
    return problems, checked


@invariant("reward-logging", "identity", trigger=several_functions_off)
def reward_logging(ctx: CheckContext):
    """With a rollout scored by several reward functions with weights (TRL's ``reward_funcs``
    and ``reward_weights``), what each backend logs about rewards is what the rollout says,
    recomputed by loops over the rows it trained on: each function's mean over the rows it
    scored (``critic/score/<func>/mean``, TRL's ``rewards/<func>/mean``: a row the function did
    not score is left out, not counted as 0) and the mean of each row's weighted sum over the
    functions that scored it (``critic/score/mean``, TRL's ``reward``), at every step. A trainer
    that logs some functions' means and not others fails; one that logs none of them is checked
    on the combined mean alone (the message says so)."""
    want = naive_expected(ctx.batch_of("base"))
    out = []
    for b in ctx.backends():
        runs, na = ctx.need("reward-logging", b, "base")
        if na:
            out.append(na)
            continue
        problems, checked = _problems(ctx.scenario, runs[0], want)
        if not checked:
            out.append(not_applicable("reward-logging", b, "logs no reward metric "
                                      f"({COMBINED} or critic/score/<func>/mean)"))
            continue
        unlogged = "" if len(checked) > 1 else " (no per-function means logged)"
        out.append(result("reward-logging", b, not problems, "; ".join(problems) or
                          f"{', '.join(checked)} as the rollout's reward functions give"
                          f"{unlogged}"))
    return out
