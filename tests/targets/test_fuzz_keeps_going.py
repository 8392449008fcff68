"""The run-level fuzzer goes on after a finding, up to its budget, and reports every distinct
finding (a failing invariant), each shrunk; it says what share of its drawn examples the target
declined, and does not draw knob values the target declines on their own. A scripted probe
stands in for the training runs (which knobs fail which invariant is written below), so the
search itself is what is tested."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.targets.fuzz import train_step
from rlaudit.targets.fuzz.examples import accepted, knobs
from rlaudit.targets.fuzz.findings import FuzzReport


class ScriptedProbe:
    """ppo_epochs 2: declined; entropy_coeff 0.01 fails "A"; use_kl_loss fails "B"."""

    def __init__(self, adapter, scenarios_dir):
        self.adapter, self.name, self.geometry = adapter, "scripted", (8, 2)
        self.tmp = Path("/nonexistent-rlaudit-fuzz-tmp")
        self.runs = self.drawn = self.declined = 0
        #: per failing key, the fewest knobs off their default of an example it failed on
        self.smallest: dict[str, list[str]] = {}
        self.defaults = {k: v[0] for k, v in knobs(adapter).items() if v}

    def run(self, ex):
        self.drawn += 1
        k = ex["knobs"]
        if k["actor.ppo_epochs"] == 2:
            self.declined += 1
            return None
        self.runs += 1
        bad = {}
        if k["actor.entropy_coeff"] == 0.01:
            bad["A"] = "entropy"
        if k["actor.use_kl_loss"]:
            bad["B"] = "kl"
        off = sorted(n for n, v in k.items() if v != self.defaults[n])
        for key in bad:
            if key not in self.smallest or len(off) < len(self.smallest[key]):
                self.smallest[key] = off
        return bad


@pytest.fixture
def scripted(monkeypatch):
    probes = []

    def make(adapter, scenarios_dir):
        probes.append(ScriptedProbe(adapter, scenarios_dir))
        return probes[-1]

    monkeypatch.setattr(train_step, "RunProbe", make)
    return probes


def _fuzz(budget, max_findings=None):
    report = FuzzReport("scripted", 1)
    train_step.fuzz_train_step(ToyAdapter(), report, spec="x:Y", budget=budget, found_dir="/x",
                               database=None, write=False, max_findings=max_findings)
    return report


def test_every_distinct_finding_reported_shrunk(scripted):
    report = _fuzz(40)
    found = sorted(f.message for f in report.findings)
    assert found == ["A: entropy", "B: kl"]
    (o,) = report.outcomes
    assert o.status == "found" and o.note.startswith("2 distinct finding(s) in ")
    # each shrunk to the one knob its invariant needs (halves, then knob by knob)
    probe = scripted[0]
    assert probe.runs > 40 - probe.declined        # the shrinking runs came after the search
    assert all(f.examples >= 1 for f in report.findings)
    assert probe.smallest == {"A": ["actor.entropy_coeff"], "B": ["actor.use_kl_loss"]}


def test_stops_at_max_findings(scripted):
    report = _fuzz(40, max_findings=1)
    assert len(report.findings) == 1


def test_declined_share_is_printed(scripted):
    report = _fuzz(30)
    (o,) = report.outcomes
    m = re.search(r"(\d+) of (\d+) drawn examples declined by the target \((\d+)%\)", o.note)
    assert m, o.note
    declined, drawn, pct = map(int, m.groups())
    assert 0 < declined < drawn and pct == round(100 * declined / drawn)


def test_values_declined_alone_are_not_drawn():
    class NoEntropyBonus(ToyAdapter):
        def supports(self, config):
            if config.actor.entropy_coeff != 0:
                return False, "entropy bonus"
            return super().supports(config)

    table, dropped = accepted(NoEntropyBonus(), knobs(NoEntropyBonus()))
    assert dropped == ["actor.entropy_coeff=0.01"]
    assert table["actor.entropy_coeff"] == [0.0]
    assert accepted(ToyAdapter(), knobs(ToyAdapter())) == (knobs(ToyAdapter()), [])
