"""What the fuzzer reports: per check, whether it ran clean or found a failure, and each finding
(its shrunk input, where it was written).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from rlaudit.targets.inputs.cases import Draw


@dataclass
class Finding:
    """A failure the fuzzer found and shrank."""

    check: str
    message: str
    draw: Draw | None
    path: Path | None
    examples: int           # examples run until the first failure (shrinking not counted)
    seconds: float


@dataclass
class CheckOutcome:
    check: str
    status: str             # "found" | "clean" | "n/a"
    examples: int = 0
    seconds: float = 0.0
    note: str = ""


@dataclass
class FuzzReport:
    target: str
    budget: int
    outcomes: list[CheckOutcome] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.findings


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "target"


def found_name(target: str, check: str) -> str:
    return f"{slug(target)}--{check.replace(':', '--')}"
