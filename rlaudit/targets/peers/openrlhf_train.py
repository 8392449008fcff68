"""OpenRLHF's own actor training step, on CUDA: ``PolicyModelActor.init_model_from_pretrained``
(its DeepSpeed strategy, ``Actor``, optimizer and ``ActorPPOTrainer``), ``forward`` for the old
log-probs, ``append`` and ``fit`` (``ppo_train`` -> ``training_step`` per micro-batch), in a
rank of rlaudit's launcher (one rank; NCCL on ``cuda``, or ``backend``).

    out = train_step(model_path, batch, advantages, version="0.11.2", device="cuda")
    out["metrics"]["policy_loss"], out["params"]

It does not run on CPU: OpenRLHF calls CUDA by name on this path (:data:`BLOCKERS`), so
``--target openrlhf`` reports its run-level checks n/a with those lines, and the path is the
``gpu`` test tests/targets/peers/test_openrlhf_train_gpu.py. OpenRLHF's arguments are its own
command line's (``cli/train_ppo_ray.py``'s parser, :func:`ppo_args`), defaults included; the
parameters are bf16 (its ``--ds.param_dtype`` allows bf16 or fp16 only) under fp32 master weights.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import textwrap
from typing import Any

import torch

from rlaudit.backends.launch import launch
from rlaudit.data.batch import RolloutBatch

#: OpenRLHF at a release tag
BLOB = "https://github.com/OpenRLHF/OpenRLHF/blob/v{v}/openrlhf/"
#: (file under openrlhf/, line at v0.11.2, what is called there): where the step calls CUDA by
#: name, in the order the step reaches them (on CPU it stops at the first: the cpu test)
BLOCKERS = (
    ("utils/deepspeed/deepspeed.py", 97,
     "DeepspeedStrategy.setup_distributed: torch.cuda.set_device(local_rank)"),
    ("utils/deepspeed/deepspeed.py", 105,
     'DeepspeedStrategy.setup_distributed: init_device_mesh("cuda", ...)'),
    ("trainer/ray/ppo_actor.py", 106,
     "ActorPPOTrainer.__init__: torch_dist_barrier_and_cuda_sync() (torch.cuda.synchronize)"),
    ("trainer/ray/ppo_actor.py", 171, "ActorPPOTrainer.ppo_train: torch.cuda.current_device()"),
)


def blockers(version: str = "0.11.2") -> str:
    """Why the step cannot run on CPU, each call with its line (lines as at 0.11.2)."""
    calls = "; ".join(f"{what} ({BLOB.format(v=version)}{path}#L{line})"
                      for path, line, what in BLOCKERS)
    return (f"OpenRLHF {version}'s actor step calls CUDA by name: {calls}; it runs on CUDA "
            f"only (the gpu test tests/targets/peers/test_openrlhf_train_gpu.py)")


def ppo_args(argv: list[str]):
    """OpenRLHF's own PPO arguments for ``argv``: the parser that ``cli/train_ppo_ray.py``
    builds under ``if __name__ == "__main__"`` (every default as a user gets it), hierarchized
    as the script does, with its default for ``actor.eps_clip_low_high``."""
    from openrlhf.cli import train_ppo_ray  # lazy: OpenRLHF exists only in its own rank
    from openrlhf.utils.config import hierarchize  # lazy: as above
    src = inspect.getsource(train_ppo_ray)
    start = src.index("    parser = argparse.ArgumentParser()")
    end = src.index("    args = parser.parse_args()")
    scope = dict(vars(train_ppo_ray), argparse=argparse)
    exec(textwrap.dedent(src[start:end]), scope)  # noqa: S102  OpenRLHF's own parser code
    args = hierarchize(scope["parser"].parse_args(argv))
    if args.actor.eps_clip_low_high is None:
        args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    return args


def experience_tensors(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """rlaudit's batch in OpenRLHF's layout: ``sequences`` each row's prompt left-padded to the
    prompt width then its response right-padded (the tokenizer pads prompts on the left;
    ``Actor.forward`` takes the log-probs of the last ``action_mask.shape[1]`` positions),
    ``attention_mask`` on the real tokens, ``action_mask`` the response mask."""
    t = batch.tensors
    b, p = t["prompt_ids"].shape
    r = t["response_ids"].shape[1]
    seq = torch.zeros(b, p + r, dtype=torch.long)
    attn = torch.zeros(b, p + r, dtype=torch.long)
    for i in range(b):
        n, m = int(t["prompt_lengths"][i]), int(t["response_lengths"][i])
        seq[i, p - n:p] = t["prompt_ids"][i, :n]
        seq[i, p:p + m] = t["response_ids"][i, :m]
        attn[i, p - n:p + m] = 1
    return {"sequences": seq, "attention_mask": attn,
            "action_mask": t["response_mask"].bool().clone()}


def train_step(model_path, batch: RolloutBatch, advantages: torch.Tensor, *, argv: list[str],
               steps: int = 1, version: str = "0.11.2", device: str = "cuda",
               backend: str | None = None, timeout: float = 600.0) -> dict:
    """``steps`` of OpenRLHF's actor update on ``batch`` with the given per-token
    ``advantages`` (its own old log-probs from ``PolicyModelActor.forward``), ``argv`` added to
    the model path on its command line. Returns {"metrics": [fit()'s status per step],
    "params": [every parameter after each step, by HF name], "old_log_probs": step 0's}."""
    request = {"version": version, "model": str(model_path), "argv": list(argv),
               "steps": steps, "tensors": experience_tensors(batch),
               "advantages": advantages.to(torch.float32)}
    return launch(train_rank, 1, args=(request,), device=device, backend=backend,
                  timeout=timeout, env={"TOKENIZERS_PARALLELISM": "false"})[0]


def train_rank(info, request: dict) -> dict:
    """The rank body: OpenRLHF's peer directory first on ``sys.path``, then its actor.
    ``PolicyModelActor`` is a Ray actor class; the class Ray would instantiate in its worker is
    built here directly (this rank is the worker; the process group is the launcher's, which
    DeepSpeed's ``init_distributed`` finds initialised and keeps)."""
    del info
    # lazy: OpenRLHF is an optional peer, activated inside the rank only
    from rlaudit.targets.peers.openrlhf_import import flash_attn_placeholders, import_openrlhf
    from rlaudit.targets.peers.registry import activate  # lazy: as above
    activate("openrlhf", request["version"])
    import_openrlhf()
    with flash_attn_placeholders():
        ppo_actor = importlib.import_module("openrlhf.trainer.ray.ppo_actor")
        experience = importlib.import_module("openrlhf.trainer.ppo_utils.experience")
        utils = importlib.import_module("openrlhf.utils")
    args = ppo_args(["--actor.model_name_or_path", request["model"], *request["argv"]])
    strategy = utils.get_strategy(args)
    actor_cls = ppo_actor.PolicyModelActor.__ray_metadata__.modified_class.__ray_actor_class__
    actor = actor_cls(1, 0, "127.0.0.1", None)
    actor.init_model_from_pretrained(strategy, request["model"], max_steps=request["steps"])
    t = request["tensors"]
    out: dict[str, Any] = {"metrics": [], "params": []}
    for step in range(request["steps"]):
        old = actor.forward(t["sequences"], t["action_mask"], t["attention_mask"])
        if step == 0:
            out["old_log_probs"] = old.clone()
        adv = request["advantages"]
        actor.append(experience.Experience(
            sequences=t["sequences"], attention_mask=t["attention_mask"],
            action_mask=t["action_mask"], action_log_probs=old, advantages=adv,
            returns=adv.clone(), index=list(range(len(adv))), info={}))
        status = actor.fit(kl_ctl=0.0)
        out["metrics"].append({k: float(v) for k, v in status.items()
                               if isinstance(v, (int, float, torch.Tensor))})
        module = actor.actor.model.module    # the Actor wraps DeepSpeed's engine of the HF model
        out["params"].append({n: p.detach().float().cpu().clone()
                              for n, p in module.named_parameters()})
    return out
