"""The no-mutation check of every stage but train_step (which has its own): across every call
the other checks made through the guard, no input was modified in place and no output aliases an
input.
"""

from __future__ import annotations

from rlaudit.targets.contract.adapter import STAGES
from rlaudit.targets.stages.registry import MAX_QUOTED, StageEnv, stage_check
from rlaudit.verdict.result import FAIL, NA, PASS, CheckResult


def _no_mutation_check(stage: str) -> None:
    @stage_check(stage, "no-mutation", "no-mutation")
    def check(env: StageEnv) -> CheckResult:
        name = f"{stage}:no-mutation"
        calls = env.guard.calls.get(stage, 0)
        if not calls:
            return CheckResult(name, env.name, NA, f"{stage} was not called by any check")
        problems = list(dict.fromkeys(env.guard.problems.get(stage, [])))
        if problems:
            more = len(problems) - MAX_QUOTED
            return CheckResult(name, env.name, FAIL, "; ".join(problems[:MAX_QUOTED]) +
                               (f" (+{more} more)" if more > 0 else ""), {"problems": problems})
        notes = list(dict.fromkeys(env.guard.notes.get(stage, [])))
        note = (f" (note: {'; '.join(notes[:2])}: harmless unless one is later written in "
                f"place)") if notes else ""
        return CheckResult(name, env.name, PASS, f"{calls} calls: inputs unchanged (values and "
                           f"version counters), no output aliases an input{note}",
                           {"notes": notes} if notes else {})
    check.__doc__ = (f"Across every call the other checks made, ``{stage}`` never modified an "
                     f"input in place (values and ``tensor._version``) and returned no output "
                     f"sharing storage with an input (outputs sharing storage with each other "
                     f"are noted).")


for _stage in STAGES:
    if _stage != "train_step":      # train_step has its own no-input-mutation check
        _no_mutation_check(_stage)
