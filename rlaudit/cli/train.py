"""``rlaudit train CONFIG``: run the reference trainer on a toy task.

    rlaudit train examples/train_digits_grpo.yaml --steps 20 --metrics-out reports/train.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from rlaudit.cli.argcheck import check_train_options
from rlaudit.errors import InputError
from rlaudit.yaml_load import load_yaml


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train with the reference trainer (config file with verl "
                                     "key names)")
    p.add_argument("config", help="YAML file: model, task, and the algorithm/actor/... sections")
    p.add_argument("--steps", type=int, help="override trainer.total_steps")
    p.add_argument("--checkpoint-dir", help="override checkpoint_dir")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    p.add_argument("--metrics-out", help="write one JSON line of metrics per step here")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")
    p.add_argument("--export", metavar="DIR", help="write the trained actor as an HF snapshot")
    p.set_defaults(func=run)


def load_job(path: str):
    # lazy: torch and transformers: kept out of CLI start-up
    from rlaudit.trainer.trainer import TrainJob
    p = Path(path)
    if not p.exists():
        raise InputError("config file does not exist", source=path)
    try:
        data = load_yaml(p.read_text())
    except yaml.YAMLError as e:
        raise InputError(f"not valid YAML: {e}", source=path) from None
    return TrainJob.from_dict(data or {}, source=path, base_dir=p.parent)


def run(args) -> int:
    # lazy: torch and transformers: kept out of CLI start-up
    from rlaudit.trainer.trainer import Trainer
    check_train_options(args)  # an output path that cannot be written: before any training
    job = load_job(args.config)
    if args.steps is not None:
        if args.steps < 1:
            raise InputError("must be >= 1", key="--steps")
        job.config.trainer.total_steps = args.steps
    if args.checkpoint_dir:
        job.checkpoint_dir = args.checkpoint_dir
    if args.resume:
        job.resume = True
    if job.resume and not job.checkpoint_dir:
        raise InputError("resuming needs a checkpoint directory (checkpoint_dir in the config or "
                         "--checkpoint-dir)", source=None if args.resume else args.config,
                         key="--resume" if args.resume else "resume")
    if args.metrics_out:
        Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
    out = open(args.metrics_out, "a") if args.metrics_out else None

    def on_step(step, metrics):
        if out is not None:
            out.write(json.dumps({"step": step, **metrics}) + "\n")
            out.flush()
        if not args.quiet:
            print(f"step {step}: score {metrics['critic/score/mean']:.4f} "
                  f"pg_loss {metrics.get('actor/pg_loss', float('nan')):.4f} "
                  f"grad_norm {metrics.get('actor/grad_norm', float('nan')):.3f}", file=sys.stderr)

    try:
        trainer = Trainer(job)
        trainer.train(progress=not args.quiet, on_step=on_step)
        if job.checkpoint_dir:
            print(f"checkpoint: {trainer.save()}", file=sys.stderr)
        if args.export:
            print(f"exported: {trainer.export(args.export)}", file=sys.stderr)
    finally:
        if out is not None:
            out.close()
    return 0
