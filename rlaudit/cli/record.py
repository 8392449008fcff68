"""``rlaudit record``: write a fixed rollout (reference sampler or real vLLM).

    rlaudit record --model scenarios/models/qwen2-tiny --engine vllm --task digits \\
        --prompts 4 --n 4 --out scenarios/rollouts/qwen2-digits-vllm.safetensors
"""

from __future__ import annotations

import sys

from rlaudit.cli.argcheck import check_record_options
from rlaudit.errors import InputError


def add_parser(sub) -> None:
    p = sub.add_parser("record", help="sample and save a fixed rollout")
    p.add_argument("--model", required=True, help="HF snapshot directory")
    p.add_argument("--out", required=True, help="output .safetensors path (sidecar .json beside)")
    p.add_argument("--engine", default="reference", choices=["reference", "vllm"])
    p.add_argument("--task", default="digits", help="rule reward (see `rlaudit list algorithms`)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--teacher", help="add a teacher's top-k log-probs (distillation scenarios)")
    p.add_argument("--topk", type=int, default=4)
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: torch and transformers: kept out of CLI start-up
    from rlaudit.rollout.record import RecordSpec, record_to_file
    if not args.out.endswith(".safetensors"):
        raise InputError("expected a path ending in .safetensors", key="--out")
    for key in ("prompts", "n", "max_new_tokens", "topk"):
        if getattr(args, key) < 1:
            raise InputError("must be >= 1", key=f"--{key.replace('_', '-')}")
    check_record_options(args)  # before the model loads and samples
    spec = RecordSpec(model=args.model, task=args.task, engine=args.engine, prompts=args.prompts,
                      n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, top_k=args.top_k, seed=args.seed, dtype=args.dtype,
                      teacher=args.teacher, topk=args.topk)
    batch = record_to_file(spec, args.out)
    print(f"wrote {len(batch)} trajectories ({batch.num_tokens()} response tokens) to {args.out}",
          file=sys.stderr)
    return 0
