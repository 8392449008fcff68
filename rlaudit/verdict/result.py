"""Results of checking a scenario: one CheckResult per invariant x backend, golden comparisons,
and the ScenarioResult that the CLI table, JSON output, pytest plugin and MLflow report read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, NA, ERROR = "pass", "fail", "n/a", "error"
#: a difference the target declared (rlaudit.targets.Difference): neither pass nor fail
DIFFERS = "differs"
#: the release under audit cannot do what the check needs (rlaudit.verdict.unsupported): not a
#: failure (nothing of the trainer was found wrong) and not a pass (nothing was verified)
UNSUPPORTED = "unsupported"
#: worst first: how a cell holding several checks is summarised
STATUS_ORDER = (ERROR, FAIL, DIFFERS, UNSUPPORTED, PASS, NA)

#: golden comparison statuses (GoldenResult.status): "no golden" = no golden file, or no entry
#: for this backend@device; "refused" = a bless the run's own failures did not allow
GOLDEN_PASS, GOLDEN_FAIL, STALE, NO_GOLDEN, BLESSED, REFUSED = (
    "pass", "fail", "stale", "no golden", "blessed", "refused")

#: scenario states (ScenarioResult.state), worst first. "bad input": an input problem found only
#: while the scenario ran (its own result; the other scenarios still run); "no golden": every
#: check passed but some backend has nothing to compare against (a failure with
#: --require-golden); "blessed": goldens were (re)written by this run (never a pass); "n/a":
#: nothing applied -- every check n/a or unsupported and no golden compared (a target that
#: supports none of what the scenario exercises): not a pass, counted apart
BAD_INPUT, FAILED, BLESSED_STATE, NO_GOLDEN_STATE, NOTHING_APPLIED, PASSED = (
    "bad input", "failed", "blessed", "no golden", "n/a", "passed")
#: a scenario a Ctrl-C stopped before it finished (ScenarioResult.interrupted): whatever it
#: holds, never a pass -- in the table, the JSON, the report and MLflow
INTERRUPTED = "interrupted"
STATES = (INTERRUPTED, BAD_INPUT, FAILED, BLESSED_STATE, NO_GOLDEN_STATE, NOTHING_APPLIED,
          PASSED)


@dataclass
class CheckResult:
    """status: pass | fail | n/a (the check does not apply: a stage not provided, one backend
    only for a parity check, ...) | error (the check itself could not run: a backend crashed) |
    differs (the result departs from the reference exactly where the target declared a semantic
    difference with a reason and a link; ``details["differences"]`` names them) | unsupported
    (the release under audit lacks a feature the check needs: ``details["unsupported"]`` holds
    the feature, the release and the adapter's exception text).

    message: one line; for failures it names the metric/tensor, value, bound, step and backend.
    details: worst rows/tokens and figures (JSON-able).
    drift: the largest relative deviation this check saw (for the "worst drift" column)."""

    invariant: str
    backend: str
    status: str
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    drift: float | None = None

    @property
    def ok(self) -> bool:
        return self.status in (PASS, NA, DIFFERS, UNSUPPORTED)


@dataclass
class GoldenResult:
    backend: str
    status: str                      # pass | fail | stale | no golden | blessed | refused
    message: str = ""
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    worst_drift: float | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Every compared (step, metric): value, golden, rtol, atol, drift, ok."""


@dataclass
class ScenarioResult:
    scenario: str
    path: str
    backends: list[str]
    checks: list[CheckResult] = field(default_factory=list)
    golden: list[GoldenResult] = field(default_factory=list)
    metrics: dict[str, list[dict[str, float]]] = field(default_factory=dict)   # backend -> steps
    errors: dict[str, str] = field(default_factory=dict)                       # backend -> error
    seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)          # flattened scenario config
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)   # backend -> layout
    dtype: str = ""
    device: str = ""
    tags: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)      # model/rollout sha, versions
    input_error: str | None = None
    """An input problem found only while this scenario ran (file and key named): its state is
    "bad input" whatever else it holds."""
    runs: dict[str, Any] = field(default_factory=dict, repr=False)
    """backend -> variant -> VariantRun (in-memory only: per-token tensors for diff artifacts)."""
    localisation: list[dict[str, Any]] = field(default_factory=list)
    """Where each failing parity/golden check first diverged (rlaudit/scenarios/localise.py);
    empty, and absent from the JSON, when nothing failed."""
    interrupted: bool = False
    """A Ctrl-C stopped this scenario before it finished: its state is "interrupted" whatever
    else it holds; absent from the JSON when False."""

    @property
    def state(self) -> str:
        """One of :data:`STATES` (see there)."""
        golden = {g.status for g in self.golden}
        if self.interrupted:
            return INTERRUPTED
        if self.input_error:
            return BAD_INPUT
        if (not all(c.ok for c in self.checks) or self.errors
                or golden & {GOLDEN_FAIL, STALE, REFUSED}):
            return FAILED
        if BLESSED in golden:
            return BLESSED_STATE
        if NO_GOLDEN in golden:
            return NO_GOLDEN_STATE
        if not golden and all(c.status in (NA, UNSUPPORTED) for c in self.checks):
            return NOTHING_APPLIED
        return PASSED

    @property
    def unsupported(self) -> list[CheckResult]:
        """The checks the release under audit could not run (status ``unsupported``)."""
        return [c for c in self.checks if c.status == UNSUPPORTED]

    @property
    def passed(self) -> bool:
        """Every check passed and every backend matched its golden ("no golden" is not a pass)."""
        return self.state == PASSED

    def to_json(self) -> dict[str, Any]:
        runs, self.runs = self.runs, {}
        try:
            out = asdict(self) | {"passed": self.passed, "state": self.state,
                                  "unsupported": len(self.unsupported)}
            if not out["localisation"]:  # a passing scenario's JSON is unchanged
                del out["localisation"]
            if not out["interrupted"]:  # nor is a finished one's
                del out["interrupted"]
            return out
        finally:
            self.runs = runs
