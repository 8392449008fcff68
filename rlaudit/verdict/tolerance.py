"""Comparison tolerances: a metric or tensor agrees when |got - want| <= atol + rtol * |want|,
with defaults by compute dtype, and the one question every comparison asks of what it checks
(:class:`Tolerances`: "which tolerance for this name?")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

#: default comparison tolerances by compute dtype (what parity/golden checks use unless a
#: scenario says otherwise). fp64 on CPU is near-exact; fp32 leaves room for reduction order.
DEFAULT_TOLERANCES = {
    "float64": {"rtol": 1e-7, "atol": 1e-9},
    "float32": {"rtol": 1e-4, "atol": 1e-5},
    "bfloat16": {"rtol": 2e-2, "atol": 2e-2},
}


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def close(self, got: float, want: float) -> bool:
        return abs(got - want) <= self.atol + self.rtol * abs(want)


class Tolerances(Protocol):
    """What a run comparison reads its bounds from (a scenario: :meth:`Scenario.tol`)."""

    def tol(self, name: str) -> Tolerance: ...
