"""Where a self-filtering target's data flow first leaves the reference's.

A target that applies DAPO's group filter in its own ``train_step`` (``filters_groups``) is handed
the unfiltered rows (rlaudit/targets/inputs/dynamic_sampling.py). When its filter keeps other rows
than the reference's, the cause may be the filter itself, or a stage upstream of it whose output
the filter metric reads: a missing or wrong overlong penalty changes which groups have spread.
:class:`~rlaudit.targets.run.target_backend.TargetBackend` then records a :class:`RowsKept` and
replays the variant again on the reference's rows with the filter off, so that every downstream
check still compares row for row; :func:`first_difference` compares the stages upstream of the
filter on that replay, in data-flow order, and names the first that differs as the cause.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlaudit.config import Config
from rlaudit.scenarios.invariants import CheckContext
from rlaudit.scenarios.invariants.base import with_overrides
from rlaudit.scenarios.invariants.parity import ORACLE
from rlaudit.verdict.result import FAIL, CheckResult
from rlaudit.verdict.tensors import compare_tensors

#: the result row naming where the data flow first differs
DATA_FLOW = "data-flow"
#: the stages the filter metric reads, in data-flow order: (stage, the per-token tensor a
#: ``train_step`` returns for it). DAPO's metrics (rlaudit.update.step.filter_metric) are the
#: rule score or the shaped score: nothing after reward shaping feeds the filter
UPSTREAM_OF_FILTER = (("reward-shaping", "token_level_scores"),)


@dataclass(frozen=True)
class RowsKept:
    """A variant on which the target's own group filter kept ``kept`` of the ``handed`` rows,
    where the reference keeps ``want`` (every row of a group whose ``metric`` has spread)."""

    kept: int
    handed: int
    want: int
    metric: str

    def describe(self) -> str:
        return (f"its DAPO group filter (algorithm.filter_groups, metric {self.metric!r}) kept "
                f"{self.kept} of the {self.handed} rows it was handed, where the reference "
                f"keeps {self.want}")


def filter_off(config: Config) -> Config:
    """``config`` with DAPO's group filter off: the replay on the reference's rows, which a
    correct filter keeps in full, so that nothing downstream depends on the target's filter."""
    return with_overrides(config, **{"algorithm.filter_groups.enable": False})


def first_difference(ctx: CheckContext, target: str, diverged: dict[str, RowsKept]
                     ) -> list[CheckResult]:
    """One FAIL row for ``target`` when its filter kept other rows on some variant
    (``diverged``): the first stage upstream of the filter whose output differs from the
    reference's on the reference's rows, or the filter itself when every upstream stage agrees;
    no row when nothing diverged."""
    if not diverged:
        return []
    causes = {name: _cause(ctx, target, name) for name in diverged}
    name = next(iter(diverged))
    what = diverged[name].describe()
    cause = causes[name]
    if cause.startswith("upstream"):
        msg = f"{cause}; filter_groups keeps different rows as a consequence ({what})"
    else:
        msg = f"filter_groups keeps different rows: {what}; {cause}"
    more = len(diverged) - 1
    msg = (f"variant {name}: {msg}" + (f" (+{more} more variant(s))" if more else "")
           + "; the checks downstream ran on the reference's rows, the filter off")
    details = {"variants": {n: {"rows": vars(d), "cause": causes[n]}
                            for n, d in diverged.items()}}
    return [CheckResult(DATA_FLOW, target, FAIL, msg, details)]


def _cause(ctx: CheckContext, target: str, name: str) -> str:
    """What made the target's filter keep other rows on variant ``name``, from its replay on the
    reference's rows (see the module docstring)."""
    got = ctx.runs.get(target, {}).get(name)
    want = ctx.runs.get(ORACLE, {}).get(name)
    if got is None or want is None:
        return ("upstream stages not compared: the replay on the reference's rows did not run "
                f"on {'the target' if got is None else ORACLE}")
    unknown = []
    for stage, tensor in UPSTREAM_OF_FILTER:
        if tensor not in got.tokens or tensor not in want.tokens:
            unknown.append(f"{stage} ({tensor} not returned)")
            continue
        ok, msg, _ = compare_tensors(tensor, got.tokens[tensor], want.tokens[tensor],
                                     ctx.scenario.tol(tensor))
        if not ok:
            return f"upstream: {stage} differs ({msg})"
    if unknown:
        return f"upstream not compared: {', '.join(unknown)}"
    return ("every stage upstream agrees (" + ", ".join(s for s, _ in UPSTREAM_OF_FILTER)
            + "): the filter itself keeps or drops the wrong groups, or reads another metric")


__all__ = ["DATA_FLOW", "RowsKept", "UPSTREAM_OF_FILTER", "filter_off", "first_difference"]
