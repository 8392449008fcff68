"""verl >= 0.9's Megatron engine (verl/workers/engine/megatron), its column of ``--target verl``:
verl_train's step (verl's ``ActorRolloutRefWorker`` with ``strategy: megatron``, the trainer's own
``_compute_old_log_prob``, ``compute_advantage``, ``_update_actor`` and metric reduction, in
fit's order: verl_train.fit_step) on verl's ``MegatronEngineWithLMHead``: its
``forward_backward_batch`` (prepare_micro_batches, megatron-core's forward_backward_func, verl's
forward_step, ``_lm_head_logits_processor``, postprocess_micro_batch_func /
postprocess_batch_func), verl's loss (workers/utils/losses.py), ``optimizer_step`` (megatron-core's
optimizer from the engine's ``_build_optimizer``) and ``lr_scheduler_step``.

    out = train_steps(model_path, [(batch, cfg, steps)])[0]       # device="cuda" on a GPU
    out["metrics"][step]["actor/pg_loss"], out["params"][step], out["tokens"]["advantages"]

One rank over gloo on the CPU (NCCL on CUDA: ``device`` / ``backend``), tp = pp = dp = 1.
Precision: bf16, the engine's own rule (``McoreEngineConfig.__post_init__`` accepts only bf16 /
fp16, workers/config/engine.py:218 in 0.9.1: :func:`config_error` reports it): the column
declares ``train_precision = "bfloat16"`` (verl_step.VerlEngine). What stands in for the parts
verl's CPU-less state forces (the layer spec without Transformer Engine, the device move of
mbridge's ``get_model``) is verl_mcore_cpu.py, each at its file and line; megatron-core's own
CUDA assumptions go through rlaudit's Megatron backend's CPU views (backends/megatron/compat.py).
The model is mbridge's (``vanilla_mbridge``: mbridge is pinned with the peer; verl's default,
Megatron-Bridge, is not installed), its weights loaded by mbridge from the HF snapshot.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from rlaudit.backends.launch import launch
from rlaudit.targets.peers import verl_train
from rlaudit.targets.peers.verl_kl import reference_policy
from rlaudit.targets.peers.registry import peers_dir
from rlaudit.targets.peers.verl_layout import verl_tensors
from rlaudit.targets.peers.verl_megatron import verl_config

#: verl's Megatron trainer defaults, inside the installed package
MEGATRON_CONFIG = "trainer/config/_generated_ppo_megatron_trainer.yaml"
#: the engine's key in verl's EngineRegistry (verl_mcore_cpu.register), selected with
#: ``VERL_ENGINE_DEVICE``
ENGINE_DEVICE = "rlaudit-mcore-local"
#: rlaudit's optimizer -> megatron-core's OptimizerConfig.optimizer
OPTIMIZERS = {"adamw": "adam", "sgd": "sgd"}
#: why tensor parallelism does not run on the CPU: mbridge turns sequence parallelism on with it
#: (mbridge/core/llm_bridge.py:76), which megatron-core's torch norms refuse
#: (megatron/core/transformer/torch_norm.py:32); TE's or Apex's norms need CUDA
TP_BLOCKER = ("tp > 1: mbridge sets sequence_parallel = tp > 1 (mbridge/core/llm_bridge.py:76) "
              "and megatron-core's torch norm refuses it (transformer/torch_norm.py:32)")


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


def cuda(device) -> bool:
    """Whether ``device`` is a CUDA one (the rank then keeps verl's own platform)."""
    return str(device).startswith("cuda")


def overrides(fsdp: dict[str, Any], optimizer: str, eps: float, steps: int = 1
              ) -> dict[str, Any]:
    """verl_train's overrides (the FSDP engine's) for the Megatron engine: the FSDP keys
    dropped, ``strategy: megatron``, bf16 (all McoreEngineConfig accepts), tp = pp = 1 without
    sequence parallelism or the distributed optimizer (one rank), and megatron-core's
    optimizer names (``optimizer`` is rlaudit's, ``eps`` its Adam epsilon, ``steps`` the run's
    length the trainer would set)."""
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
        # mbridge (verl's legacy bridge) is what is installed; Megatron-Bridge is not
        f"{actor}.megatron.vanilla_mbridge": True,
        # use_cpu_initialization: megatron-core's local layers allocate on
        # torch.cuda.current_device() otherwise (the rank moves the model to its device:
        # verl_mcore_cpu.LocalSpecBridge.get_model); masked_softmax_fusion: the local
        # attention's bf16 softmax would load megatron's CUDA kernel (scaled_masked_softmax_cuda)
        # for sequences longer than 16; unfused it is the same softmax in torch
        f"{actor}.megatron.override_transformer_config": {"use_cpu_initialization": True,
                                                          "masked_softmax_fusion": False},
        f"{actor}.optim.optimizer": OPTIMIZERS[optimizer],
        # what the trainer sets from its data loader (ray_trainer.py _create_dataloader); the
        # scheduler's decay length (verl/utils/megatron/optimizer.py:242), constant lr here
        f"{actor}.optim.total_training_steps": steps,
        # megatron-core's SGD has momentum 0.9 by default; rlaudit's (torch's) has none
        f"{actor}.optim.override_optimizer_config": (
            {"adam_eps": eps} if optimizer == "adamw" else {"sgd_momentum": 0.0}),
    })
    return out


def train_steps(model_path, jobs: list, *, peer: str | None = None, version: str = "0.9.1",
                device: str = "cpu", backend: str | None = None, params: bool | str = True,
                engine: str | None = None, timeout: float = 600.0,
                layout: dict[str, int] | None = None) -> list[dict]:
    """verl_train.train_steps on the Megatron engine (gloo on ``cpu``, NCCL on ``cuda``, or
    ``backend``), one rank or ``layout`` ``{"pp": P, "dp": D}`` (tp > 1: :data:`TP_BLOCKER`):
    per job the reduced metrics per step, step 0's tensors and (when ``params``) the parameters
    after each step by Hugging Face name (mbridge's export): the model's bf16 ones, or with
    ``params="main"`` the optimizer's float32 main weights (verl_mcore_cpu.hf_params). At dp > 1
    lay the rows out first (verl_dp.laid_out): verl's dispatch chunks them per dp rank.
    ``engine``: ``"module:factory"``, a function returning a subclass of
    verl_mcore_cpu.MegatronEngineCPU to run instead (a test's broken engine)."""
    layout = {"pp": 1, "dp": 1, **(layout or {})}
    if set(layout) - {"pp", "dp"}:
        raise ValueError(f"layout keys are pp and dp ({TP_BLOCKER}), got {sorted(layout)}")
    request = mcore_request(model_path, jobs, peer=peer, version=version, device=device,
                            params=params, engine=engine)
    actor = "actor_rollout_ref.actor"
    for job in request["jobs"]:
        job["overrides"].update({f"{actor}.megatron.pipeline_model_parallel_size": layout["pp"],
                                 "trainer.n_gpus_per_node": layout["pp"] * layout["dp"]})
    # no environment of its own: on the CPU the rank is then forked from the launcher's
    # forkserver, torch and megatron-core already imported (rlaudit/backends/launch), and sets
    # what verl reads itself (train_rank)
    return launch(train_rank, layout["pp"] * layout["dp"], args=(request,),
                  timeout=timeout * len(jobs), device=device, backend=backend)[0]


def mcore_request(model_path, jobs: list, *, peer, version, device, params, engine) -> dict:
    """The Megatron rank's request: per job verl's tensors and the overrides (verl_train's,
    through :func:`overrides`)."""
    for _batch, cfg, _steps in jobs:
        bad = verl_train.unsupported(cfg)
        if bad:
            raise NotImplementedError(f"verl train_step does not map: {'; '.join(bad)}")
    return {"peer": peer or str(peers_dir() / f"verl-{version}"), "params": params,
            "device": device, "engine": engine,
            "jobs": [{"steps": steps,
                      "tensors": verl_tensors(batch, width=cfg.rollout.response_length),
                      "overrides": overrides(
                          verl_train.verl_overrides(cfg, model_path=str(model_path), dp=1,
                                                    rows=len(batch), device=device),
                          cfg.actor.optim.name, cfg.actor.optim.eps, steps)}
                     for batch, cfg, steps in jobs]}


def train_rank(info, request: dict) -> list[dict]:
    """The rank body: verl's directory alone on the path (verl_train.train_rank says why), the
    CPU platform (without CUDA: ``VERL_PLATFORM``, set by verl_cpu.select before verl resolves
    its platform; the forkserver the rank comes from never imported verl), then the jobs
    (:func:`run_mcore`)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    peer = request["peer"]
    sys.path[:] = [p for p in sys.path if p == peer or Path(p).parent != Path(peer).parent]
    if peer not in sys.path:
        sys.path.insert(0, peer)
    if not cuda(request["device"]):
        # lazy: verl is an optional peer; the platform must be selected before verl.trainer
        from rlaudit.targets.peers import verl_cpu
        verl_cpu.select()
    return run_mcore(info, request)


def run_mcore(info, request: dict) -> list[dict]:
    """megatron-core's CPU views (rlaudit.backends.megatron.compat: a no-op on CUDA), the engine
    registered (verl_mcore_cpu) and selected with verl's ``VERL_ENGINE_DEVICE`` (read when a
    worker builds its engine, workers/engine/base.py:405), then every job."""
    # lazy: megatron-core, inside the rank only
    from rlaudit.backends.megatron import compat
    from rlaudit.backends.megatron.imports import import_megatron  # lazy: as above
    import_megatron()
    compat.apply_cpu_patches()
    # lazy: imports verl's Megatron engine, after the platform is selected
    from rlaudit.targets.peers import verl_mcore_cpu
    cls = verl_mcore_cpu.MegatronEngineCPU
    if request.get("engine"):
        module, factory = request["engine"].split(":")
        cls = getattr(importlib.import_module(module), factory)()
    verl_mcore_cpu.register(ENGINE_DEVICE, cls)
    os.environ["VERL_ENGINE_DEVICE"] = ENGINE_DEVICE
    try:
        return [train_job(info, job, params=request["params"]) for job in request["jobs"]]
    finally:
        del os.environ["VERL_ENGINE_DEVICE"]
        compat.teardown_megatron()


def train_job(info, job: dict, *, params: bool | str) -> dict:
    """verl_train.train_job on the Megatron trainer config (:data:`MEGATRON_CONFIG`: the FSDP
    one lacks actor.megatron), the parameters through mbridge's export (verl_mcore_cpu.
    hf_params): verl's worker, the trainer's own methods in fit's order (verl_train.fit_step)."""
    # lazy: verl is an optional peer, imported after the platform is selected (train_rank)
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker  # lazy: as above

    from rlaudit.targets.peers.verl_mcore_cpu import hf_params  # lazy: imports verl
    cfg = verl_config(job["overrides"], MEGATRON_CONFIG)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = cfg
    trainer.actor_rollout_wg = verl_train.LocalWorkerGroup(worker, info.rank, info.world_size)
    # fit's flags for KL (none: verl_step.supports refuses KL here) and the in-reward controller
    reference_policy(trainer, None)
    result: dict[str, Any] = {"metrics": [], "raw_metrics": [], "params": []}
    for step in range(job["steps"]):
        metrics, raw, tokens = verl_train.fit_step(
            trainer, verl_train.rollout_proto(job["tensors"], cfg))
        result["metrics"].append(metrics)
        result["raw_metrics"].append(raw)
        if step == 0:
            result["tokens"] = tokens
        if params:
            result["params"].append(hf_params(worker.actor.engine, main=params == "main"))
    return result


__all__ = ["ENGINE_DEVICE", "MEGATRON_CONFIG", "OPTIMIZERS", "TP_BLOCKER", "config_error",
           "cuda", "mcore_request", "overrides", "run_mcore", "train_job", "train_rank",
           "train_steps"]
