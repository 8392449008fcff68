"""How much fuzzing finds each deliberately broken adapter, and how much finds nothing on the
correct ones: ``rlaudit fuzz`` at its default budgets on every adapter of
tests/targets/broken_adapters.py, the reference adapter and the toy trainer.

    python benchmarks/fuzz_broken.py                   # everything (run level: ~1 min/adapter)
    python benchmarks/fuzz_broken.py --stage-only      # the stage-level adapters only
    python benchmarks/fuzz_broken.py --only per-micro-norm --only toy

Prints one line per adapter: the check found (or "clean"), examples until the first failure,
scenario runs (run level), wall seconds including shrinking and writing the case; then totals.
Stage-level broken adapters are fuzzed on their own stage (every check of it); train_step ones
at run level. Findings go to a temporary directory. torch runs one intra-op thread
($RLAUDIT_TEST_THREADS, as the test suite): on a small shared machine more threads contend and
a run-level example gets ~30x slower. Figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "targets")]

# adapter attribute of broken_adapters -> stages fuzzed; None: the correct adapters (all stages)
STAGE_LEVEL = {
    "RewardsAliasScores": ["apply_kl_in_reward"], "StoredKLInPlace": ["apply_kl_in_reward"],
    "PerMicroBatchNorm": ["agg_loss", "policy_loss"], "IgnoresClipHigh": ["policy_loss"],
    "HardCodedPaddingKeys": ["make_microbatches"],
    "NoPaddingMicrobatches": ["make_microbatches"], "DropsLastRow": ["make_microbatches"],
    "NestedIndexingDistill": ["distill_loss"], "GroupsByPosition": ["compute_advantages"],
    "MaskedValuesLeak": ["policy_loss"], "MutatesRewards": ["compute_advantages"],
    "MetricsViewBuffer": ["policy_loss"], "NaNAdvantages": ["compute_advantages"],
    "FilterDropsSingletons": ["filter_groups"], "FilterMisalignsScores": ["filter_groups"],
    "NoPaddingToy": ["make_microbatches"],
    "AliasedAdvantagesReturns": ["compute_advantages"],        # not a bug: must stay clean
}
RUN_LEVEL = ["EntropyNotLogged", "GradNormAfterClip", "PerMicroMeanTrainer",
             "MetricsReusedBuffer", "IgnoresAggModeTrainer", "MutatesInputBatch",
             "IgnoresTemperature", "ScoreOnLastTrainedToken", "IgnoresEpochs", "RefFromActor",
             "FilterMisalignsScores", "KLLossSignFlipped", "CPMetricsReducedTwice",
             "CPLossScaledBySize", "SequenceISFromMean", "SequenceISPerToken"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage-only", action="store_true")
    ap.add_argument("--run-only", action="store_true")
    ap.add_argument("--only", action="append", help="adapter name (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import os

    import torch
    torch.set_num_threads(int(os.environ.get("RLAUDIT_TEST_THREADS", "1")))
    import broken_adapters as broken
    from examples.toy_trainer.adapter import ToyAdapter
    from rlaudit.targets.fuzz.stage_fuzz import DEFAULT_BUDGET, fuzz_target
    from rlaudit.targets.fuzz.train_step import DEFAULT_RUN_BUDGET
    from rlaudit.targets.contract.own_adapters import ReferenceAdapter

    plan = []
    if not args.run_only:
        plan += [(getattr(broken, n)(), stages, 0) for n, stages in STAGE_LEVEL.items()]
        plan += [(ReferenceAdapter(), None, 0), (ToyAdapter(), None, 0)]
    if not args.stage_only:
        plan += [(getattr(broken, n)(), ["train_step"], None) for n in RUN_LEVEL]
        plan += [(ReferenceAdapter(), ["train_step"], None), (ToyAdapter(), ["train_step"], None)]
    if args.only:
        plan = [p for p in plan if p[0].name in args.only]
    print(f"budget {DEFAULT_BUDGET} examples per stage check, run budget {DEFAULT_RUN_BUDGET} "
          f"scenarios, seed {args.seed}")
    print(f"{'adapter':30s} {'level':6s} {'result':44s} {'examples':>8s} {'runs':>5s} "
          f"{'seconds':>8s}")
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for adapter, stages, run_budget in plan:
            t0 = time.perf_counter()
            report = fuzz_target(adapter, stages=stages, run_budget=run_budget,
                                 found_dir=Path(tmp) / "found", report_dir=tmp,
                                 rng_seed=args.seed)
            level = "run" if stages == ["train_step"] else "stage"
            runs = next((o.note.split()[0] for o in report.outcomes
                         if o.check == "train_step:run-level" and "scenario runs" in o.note), "")
            found = ", ".join(sorted({f.check for f in report.findings})) or "clean"
            first = min((f.examples for f in report.findings), default=0)
            print(f"{adapter.name:30s} {level:6s} {found:44s} {first:8d} {runs:>5s} "
                  f"{time.perf_counter() - t0:8.1f}", flush=True)
    print(f"total {time.perf_counter() - t_all:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
