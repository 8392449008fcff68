"""Does the reference trainer actually train? Mean reward per step on the toy tasks, with GRPO and
DAPO settings, within a CPU time budget.

    python benchmarks/learning_curve.py                 # both settings, <= 10 min each
    python benchmarks/learning_curve.py --budget 120 --setting grpo

Prints, per setting: the reward curve (mean of the first steps as the baseline), the first step
whose mean score is at least twice the baseline, and the wall time. The baseline is the mean of
the first ``--baseline-steps`` steps (a single step is noisy). For DAPO the "score" includes the
overlong penalty, so the rule score (critic/score/mean minus train/overlong_penalty_mean) is
reported as well.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "grpo": ROOT / "examples" / "train_digits_grpo.yaml",
    "dapo": ROOT / "examples" / "train_short_dapo.yaml",
}


def rule_score(metrics: dict) -> float:
    return metrics["critic/score/mean"] - metrics.get("train/overlong_penalty_mean", 0.0)


def run(setting: str, *, budget: float, max_steps: int, baseline_steps: int) -> dict:
    from rlaudit.trainer.trainer import Trainer, TrainJob

    path = SETTINGS[setting]
    job = TrainJob.from_dict(yaml.safe_load(path.read_text()), source=str(path),
                             base_dir=path.parent)
    job.config.trainer.total_steps = max_steps
    trainer = Trainer(job)
    t0 = time.perf_counter()
    curve: list[float] = []

    def on_step(step: int, metrics: dict) -> None:
        curve.append(rule_score(metrics))
        print(f"  {setting} step {step:3d}  score {curve[-1]:.4f}  "
              f"len {metrics['response_length/mean']:.1f}  t={time.perf_counter() - t0:.0f}s",
              flush=True)
        if time.perf_counter() - t0 > budget:
            trainer.job.config.trainer.total_steps = step  # stop after this step

    trainer.train(progress=False, on_step=on_step)
    seconds = time.perf_counter() - t0
    base = sum(curve[:baseline_steps]) / min(baseline_steps, len(curve))
    doubled = next((i + 1 for i, s in enumerate(curve) if s >= 2 * base and base > 0), None)
    tail = curve[-5:]
    return {"setting": setting, "steps": len(curve), "seconds": seconds, "baseline": base,
            "final": sum(tail) / len(tail), "doubled_at_step": doubled}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), action="append")
    p.add_argument("--budget", type=float, default=600.0, help="seconds per setting")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--baseline-steps", type=int, default=2)
    args = p.parse_args(argv)
    rows = [run(s, budget=args.budget, max_steps=args.max_steps,
                baseline_steps=args.baseline_steps) for s in (args.setting or sorted(SETTINGS))]
    print("\nsetting  steps  seconds  baseline  final(last 5)  x baseline  doubled at step")
    for r in rows:
        ratio = r["final"] / r["baseline"] if r["baseline"] > 0 else float("inf")
        print(f"{r['setting']:7s}  {r['steps']:5d}  {r['seconds']:7.0f}  {r['baseline']:8.4f}  "
              f"{r['final']:13.4f}  {ratio:10.1f}  {r['doubled_at_step']}")
    ok = all(r["doubled_at_step"] is not None for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
