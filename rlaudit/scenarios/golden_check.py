"""What a golden file's values may be, beyond its structure (rlaudit.scenarios.golden.read_golden):
bounded nesting, finite values, sane tolerances, steps and provenance in every backend entry.

A golden is hand-editable, so each of these is an input error naming the file and the key (exit
2, before anything runs), never a comparison that fails (a NaN golden value fails every run) or
passes (an infinite tolerance passes every run) for a reason that is not the trainer's.

    doc = parse_golden_text(text, source="golden/scn.json")
    check_golden_values(doc, source="golden/scn.json")
"""

from __future__ import annotations

import json
import math

from rlaudit.errors import InputError

#: deepest nesting a golden may have: its own layout is 5 levels (backends -> entry -> steps ->
#: step -> metric); a config record's values add one (a list); anything far deeper is not a golden
MAX_DEPTH = 32


def parse_golden_text(text: str, *, source: str):
    """``json.loads(text)`` with nesting bounded by :data:`MAX_DEPTH` (checked on the text, before
    the parser recurses)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise InputError(f"nested deeper than {MAX_DEPTH} levels: not a golden file",
                                 source=source)
        elif ch in "]}":
            depth -= 1
    return json.loads(text)


def check_golden_values(doc: dict, *, source: str) -> None:
    """Every backend entry has steps and a provenance (its own, or the file's), every metric a
    finite value and finite tolerances >= 0."""
    def bad(key, msg):
        raise InputError(msg, source=source, key=key)

    for key, entry in doc.get("backends", {}).items():
        where = f"backends.{key}"
        if not entry["steps"]:
            bad(f"{where}.steps", "no steps: a golden entry without values compares nothing")
        if not entry.get("provenance", doc.get("provenance")):
            bad(f"{where}.provenance", "missing: without it nobody can tell whether the entry "
                "still matches the scenario's model, rollout and config")
        for i, step in enumerate(entry["steps"]):
            for name, w in step.items():
                for k in ("value", "rtol", "atol"):
                    v = w[k]
                    if not math.isfinite(v):
                        bad(f"{where}.steps[{i}].{name}.{k}", f"expected a finite number, got "
                            f"{v!r}" + (": an infinite tolerance passes every run"
                                        if k != "value" else ""))
                    if k != "value" and v < 0:
                        bad(f"{where}.steps[{i}].{name}.{k}", f"expected a number >= 0, got {v!r}")
