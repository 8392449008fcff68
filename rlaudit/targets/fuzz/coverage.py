"""Which scenarios and fuzz draws vary each of a target's config knobs (docs/targets.md, "Knob
coverage").

A knob is a key of the trainer's own config that the adapter sets from rlaudit's (TRL: a
``GRPOConfig`` keyword, through ``trl_config_kwargs``). A knob left at one value in everything a
release audit runs is a knob whose bugs are invisible, so the table lists, per knob, where it
takes a value other than in the target's built-in scenario:

- the shipped scenarios (``rlaudit run --target X --all``): each scenario's config and the
  config of every variant its invariants ask for, where the target supports it (``supports``);
  the built-in target scenario's variants too;
- the run-level fuzzer's draws (:mod:`rlaudit.targets.fuzz.train_step`): each knob value of its
  table (as :func:`~rlaudit.targets.fuzz.examples.accepted` leaves it for the target) set alone
  on the default example.

The knob values are computed by the adapter's own mapping (``knobs_of(config, rows, width,
steps, batch=batch) -> {knob: value}``) on each config with the geometry of the batch it runs on
(and the batch, for knobs the rollout sets: TRL's ``reward_weights``), so the table follows the
mapping as it is, not as it was written down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.errors import InputError
from rlaudit.scenarios.invariants import INVARIANTS
from rlaudit.scenarios.spec import discover, load_scenario
from rlaudit.targets.contract.adapter import supports
from rlaudit.targets.fuzz.examples import accepted, config_of, knobs
from rlaudit.targets.inputs import builtin
from rlaudit.update.step import select_groups

#: (config, rows, response width, steps, batch=batch) -> {knob: value}
KnobsOf = Callable[..., dict]
#: the baseline value of a knob the built-in scenario's mapping does not set
NOT_SET = "<not set>"


@dataclass
class Coverage:
    """Per knob: its value in the built-in scenario, and the sources (scenario[:variant] or
    "fuzz: key=value") where it takes another."""

    baseline: dict[str, object]
    varied_by: dict[str, list[str]] = field(default_factory=dict)

    def unvaried(self, fixed: set[str]) -> list[str]:
        """Knobs not in ``fixed`` that nothing varies."""
        return sorted(k for k in self.baseline if k not in fixed and not self.varied_by.get(k))


def _configs(scn, batch):
    """(label, config, rows, width, steps, batch) of a scenario and of every variant its
    invariants ask for."""
    yield scn.name, scn.config, len(batch), batch.response_width, scn.steps, batch
    seen = set()
    for inv in scn.invariants:
        for v in INVARIANTS.get(inv).variants(scn, batch):
            if v.name not in seen:
                seen.add(v.name)
                yield (f"{scn.name}:{v.name}", v.config, len(v.batch), v.batch.response_width,
                       v.steps, v.batch)


def exercised(adapter, scenarios_dir: str | Path):
    """Every config a release audit and the run-level fuzzer give ``adapter``'s train_step (see
    the module docstring), as (label, config, rows, width, steps, batch); the built-in scenario
    first."""
    model = builtin.tiny_model_path(scenarios_dir)
    batch = builtin.rollout(model)
    yield from _configs(builtin.scenario(model), batch)
    for path in discover(scenarios_dir):
        scn = load_scenario(path)
        rows, _ = select_groups(load_rollout(scn.rollout), scn.config)
        yield from _configs(scn, rows)
    table, _ = accepted(adapter, knobs(adapter))
    defaults = {k: v[0] for k, v in table.items() if v}
    for key, values in table.items():
        for value in values[1:]:
            cfg, steps = config_of({**defaults, key: value})
            try:
                config = load_config(cfg, source="rlaudit fuzz")
            except InputError:
                continue
            yield f"fuzz: {key}={value}", config, len(batch), batch.response_width, steps, batch


def coverage(adapter, knobs_of: KnobsOf, scenarios_dir: str | Path) -> Coverage:
    """Where each knob of ``adapter`` takes a value other than in the built-in scenario."""
    out = None
    for label, config, rows, width, steps, batch in exercised(adapter, scenarios_dir):
        if not supports(adapter, config)[0]:
            continue
        try:
            values = knobs_of(config, rows, width, steps, batch=batch)
        except (InputError, NotImplementedError, ValueError, ZeroDivisionError):
            continue            # a geometry the adapter cannot lay out: not run there either
        if out is None:
            out = Coverage(baseline=dict(values))
            continue
        for k, v in values.items():
            out.baseline.setdefault(k, NOT_SET)    # a key the built-in scenario does not set
            if v != out.baseline[k]:
                sources = out.varied_by.setdefault(k, [])
                if label not in sources:
                    sources.append(label)
    if out is None:
        raise InputError("the target supports none of the configs its audit runs",
                         key="supports")
    return out


def markdown_rows(cov: Coverage, fixed: dict[str, str], *, shown: int = 4) -> list[str]:
    """The docs table's rows: knob | varied by (scenarios, variants collapsed per scenario, and
    fuzz draws; ``shown`` of each kind, then a count) | or why it is not varied (``fixed``)."""
    rows = []
    for k in sorted(cov.baseline):
        if k in fixed:
            rows.append(f"| `{k}` | not varied: {fixed[k]} |")
            continue
        src = cov.varied_by.get(k, [])
        scen = list(dict.fromkeys(s.split(":")[0] for s in src if not s.startswith("fuzz: ")))
        fuzz = [s[len("fuzz: "):] for s in src if s.startswith("fuzz: ")]
        parts = []
        if scen:
            more = f" (+{len(scen) - shown})" if len(scen) > shown else ""
            parts.append(", ".join(scen[:shown]) + more)
        if fuzz:
            more = f" (+{len(fuzz) - shown})" if len(fuzz) > shown else ""
            parts.append("fuzz " + ", ".join(f"`{f}`" for f in fuzz[:shown]) + more)
        rows.append(f"| `{k}` | {'; '.join(parts) or '**varied nowhere**'} |")
    return rows
