"""verl >= 0.9's Megatron engine (verl/workers/engine/megatron) on the CPU: where it stops.

The engine cannot train in float32 on the CPU without patching verl, so its column of
``--target verl`` is *unsupported* (never red), and the message names the call that stops it,
found by running verl's own code here:

1. ``McoreEngineConfig.__post_init__`` accepts only bf16 / fp16 (workers/config/engine.py:218 in
   0.9.1): :func:`blocked` builds the engine config as the worker would, in float32, and reports
   the assertion with its file and line;
2. past it (in bf16, on a GPU), the model goes through mbridge, which moves it with ``.cuda()``
   (mbridge/core/util.py:151), and megatron-core's DDP allocates its gradient buffers on
   ``torch.cuda.current_device()`` (param_and_grad_buffer.py:783).

On CUDA the engine runs as verl runs it (:func:`train_steps`): verl_train's rank body with the
Megatron trainer config (``strategy: megatron``, bf16, tp = pp = 1, NCCL), verl's own worker,
``fit`` step and metric reduction; the ``gpu``-marked test (tests/targets/peers/
test_verl_mcore_gpu.py) compares it with rlaudit's reference within bf16 tolerances.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

from rlaudit.backends.launch import launch
from rlaudit.targets.peers import verl_train
from rlaudit.targets.peers.registry import peers_dir
from rlaudit.targets.peers.verl_layout import verl_tensors
from rlaudit.verdict.unsupported import UnsupportedFeature

#: verl's Megatron trainer defaults, inside the installed package
MEGATRON_CONFIG = "trainer/config/_generated_ppo_megatron_trainer.yaml"
#: rlaudit's optimizer -> megatron-core's OptimizerConfig.optimizer
OPTIMIZERS = {"adamw": "adam", "sgd": "sgd"}

#: what stops the engine after its config, on a host without CUDA (module docstring)
LATER = ("past it, mbridge moves the model with .cuda() (mbridge/core/util.py:151) and "
         "megatron-core's DDP allocates its buffers on torch.cuda.current_device() "
         "(megatron/core/distributed/param_and_grad_buffer.py:783)")


def config_error(dtype: str = "float32") -> str | None:
    """What verl's ``McoreEngineConfig`` says to ``dtype`` (None: accepted), with the file and
    line of verl that refused it."""
    try:
        # lazy: verl is an optional peer, imported when audited
        from verl.workers.config.engine import McoreEngineConfig
    except ImportError as e:       # a release without it: said, never a crash of the column
        return f"verl.workers.config.engine.McoreEngineConfig cannot be imported ({e})"
    try:
        McoreEngineConfig(dtype=dtype)
    except (AssertionError, ValueError) as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = "/".join(Path(frame.filename).parts[-4:])
        return f"{where}:{frame.lineno}: {frame.line} ({type(e).__name__}: {e})"
    return None


def blocked(version: str) -> None:
    """Raise the :class:`UnsupportedFeature` that says why the Megatron engine of verl
    ``version`` does not run here (module docstring)."""
    refused = config_error("float32")
    first = (f"McoreEngineConfig refuses float32: {refused}" if refused
             else "McoreEngineConfig accepts float32")
    raise UnsupportedFeature("the Megatron engine in float32 on the CPU",
                             release=f"verl {version}", reason=f"{first}; {LATER}")


def cuda(device) -> bool:
    """Whether ``device`` is a CUDA one, the only kind the engine runs on (module docstring)."""
    return str(device).startswith("cuda")


def overrides(fsdp: dict[str, Any], optimizer: str, eps: float) -> dict[str, Any]:
    """verl_train's overrides (the FSDP engine's) for the Megatron engine: the FSDP keys
    dropped, ``strategy: megatron``, bf16 (all McoreEngineConfig accepts), tp = pp = 1 without
    sequence parallelism or the distributed optimizer (one rank), and megatron-core's
    optimizer names (``optimizer`` is rlaudit's, ``eps`` its Adam epsilon)."""
    actor = "actor_rollout_ref.actor"
    out = {k: v for k, v in fsdp.items()
           if not k.startswith(f"{actor}.fsdp_config.") and k != f"{actor}.use_torch_compile"}
    out.update({
        f"{actor}.strategy": "megatron",
        f"{actor}.megatron.dtype": "bfloat16",
        f"{actor}.megatron.tensor_model_parallel_size": 1,
        f"{actor}.megatron.pipeline_model_parallel_size": 1,
        f"{actor}.megatron.sequence_parallel": False,
        f"{actor}.megatron.use_distributed_optimizer": False,
        f"{actor}.optim.optimizer": OPTIMIZERS[optimizer],
        # megatron-core's SGD has momentum 0.9 by default; rlaudit's (torch's) has none
        f"{actor}.optim.override_optimizer_config": (
            {"adam_eps": eps} if optimizer == "adamw" else {"sgd_momentum": 0.0}),
    })
    return out


def train_steps(model_path, jobs: list, *, peer: str | None = None, version: str = "0.9.1",
                device: str = "cuda", backend: str | None = None,
                timeout: float = 600.0) -> list[dict]:
    """verl_train.train_steps on the Megatron engine (one rank; ``device`` must be a CUDA one:
    on the CPU :func:`blocked` says why not). Parameters are not gathered (the engine holds
    megatron-core modules, not Hugging Face ones): ``params`` is empty."""
    if not cuda(device):
        blocked(version)
    for _batch, cfg, _steps in jobs:
        bad = verl_train.unsupported(cfg)
        if bad:
            raise NotImplementedError(f"verl train_step does not map: {'; '.join(bad)}")
    request = {"peer": peer or str(peers_dir() / f"verl-{version}"), "params": False,
               "device": device,
               "jobs": [{"steps": steps,
                         "tensors": verl_tensors(
                             batch, width=cfg.rollout.response_length),
                         "overrides": overrides(
                             verl_train.verl_overrides(cfg, model_path=str(model_path), dp=1,
                                                       rows=len(batch), device=device),
                             cfg.actor.optim.name, cfg.actor.optim.eps)}
                        for batch, cfg, steps in jobs]}
    return launch(train_rank, 1, args=(request,), env={"TOKENIZERS_PARALLELISM": "false"},
                  timeout=timeout * len(jobs), device=device, backend=backend)[0]


def train_rank(info, request: dict) -> list[dict]:
    """verl_train.train_rank with verl's Megatron trainer config for the defaults."""
    peer = request["peer"]
    sys.path[:] = [p for p in sys.path if p == peer or Path(p).parent != Path(peer).parent]
    if peer not in sys.path:
        sys.path.insert(0, peer)
    # Megatron workers need verl's Megatron trainer config (the FSDP one lacks actor.megatron
    # and McoreActorConfig)
    return [verl_train.train_job(info, job, params=False, config_file=MEGATRON_CONFIG)
            for job in request["jobs"]]


__all__ = ["LATER", "MEGATRON_CONFIG", "OPTIMIZERS", "blocked", "config_error", "cuda",
           "overrides", "train_rank", "train_steps"]
