"""verl >= 0.9 on CPU: a ``cpu`` platform for verl's platform registry, and verl's own FSDP engine
classes registered for device ``cpu``. Collectives over gloo, float32. Nothing of verl is edited
or wrapped: both registrations go through verl's public decorators.

    VERL_PLATFORM=cpu    # selects it (verl/plugin/platform/platform_manager.py _detect_platform_name)
    select()             # or: register + set_platform(PlatformCPU()) in this process

**Select it before verl's trainer is imported.** ``get_platform()`` is resolved once per process
and cached, and ``verl.trainer.ppo.ray_trainer`` resolves it on import -- to ``nvidia`` on a CPU
box (the fallback); modules also freeze the device name at import
(verl/workers/engine/fsdp/transformer_impl.py:89 ``device_name = get_device_name()``). So a rank
calls :func:`select` first, before importing ``verl.trainer`` or ``verl.workers``.

Why each setting (verl 0.9.1 file:line):

- ``device_name`` ``"cpu"`` and ``communication_backend_name`` ``"gloo"``: no accelerator.
- ``current_device()`` returns ``"cpu"``, not an int: verl passes it straight to ``.to()``,
  ``torch.device()`` and ``device=`` (workers/engine/fsdp/transformer_impl.py:730,1052,1552,
  utils/fsdp_utils.py:59,507), where an int means an accelerator index.
- ``device_count()`` 0: truthful, and verl then skips megatron-core's CUDA-only RNG tracker
  (workers/engine/megatron/utils.py:35).
- ``device_module``: ``torch.cpu`` plus what verl calls on ``get_torch_device()`` that torch.cpu
  lacks: ``get_device_name()`` (utils/flops_counter.py:76-80 recognises CPU only when the module
  *is* torch.cpu), ``max_memory_allocated`` and the other memory statistics (engine_workers.py
  logs them; 0 on CPU), ``mem_get_info`` (the host's memory), ``empty_cache``, ``reset_peak_memory_stats``.
- The FSDP engines are registered for ``cuda``/``npu`` only (transformer_impl.py:1143,1594) and
  ``EngineRegistry.get_engine_cls`` (workers/engine/base.py:399-429) raises for any other device:
  :func:`register_engines` registers the same classes for ``cpu``.

What the platform cannot fix, and the caller must (see ``rlaudit.targets.peers.verl_train``):

- verl's process-group init (utils/distributed.py:89) builds the backend string
  ``"cpu:gloo,{device}:{backend}"`` = ``"cpu:gloo,cpu:gloo"``, which torch rejects (duplicate
  device type); it skips init when a default group exists (line 90), so rlaudit's launcher
  initialises gloo first.
- float32 needs ``fsdp_config.mixed_precision`` fp32 x3: without it the engine defaults to bf16
  params (transformer_impl.py:391-403) and a bf16 autocast of the forward (1559-1563);
  ``fsdp_config.dtype`` does not control either.
- ``attn_implementation`` defaults to flash_attention_2 (workers/config/model.py:185): sdpa.
- hydra-core is a verl dependency the wheel does not pull here (utils/config.py:48).

The Megatron engine is not registered: megatron-core's DDP allocates its grad buffers on
``torch.cuda.current_device()`` unconditionally (megatron/core/distributed/
param_and_grad_buffer.py:783), which no verl setting reaches.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

#: the name ``VERL_PLATFORM`` selects it by
NAME = "cpu"
_registered = {"engines": False}


class CPUDeviceModule:
    """``get_torch_device()`` on CPU: torch.cpu, plus the calls verl makes that it lacks."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(*args, **kwargs) -> str:
        return "CPU"

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def memory_allocated(*args, **kwargs) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(*args, **kwargs) -> tuple[int, int]:
        # (free, total) bytes, as torch.cuda.mem_get_info: the host's memory
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def empty_cache(*args, **kwargs) -> None:
        return None

    reset_peak_memory_stats = set_device = synchronize = empty_cache

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(*args, **kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args, **kwargs) -> None:
        torch.set_rng_state(state)


DEVICE_MODULE = CPUDeviceModule()


@PlatformRegistry.register(platform=NAME)
class PlatformCPU(PlatformBase):
    """CPU, collectives over gloo (the module docstring says why each value)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return DEVICE_MODULE  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # never picked by auto-detection (which probes every registered platform): only by name
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == NAME

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 0

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # only read when verl launches Ray workers itself, which rlaudit does not
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_engines() -> None:
    """verl's FSDP engine classes (the same classes) for device ``cpu``; once per process
    (``EngineRegistry.register`` asserts a key is new)."""
    if _registered["engines"]:
        return
    # lazy: importing verl's engines freezes the device name (module docstring): after select()
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import (  # lazy: after select(), as above
        FSDPEngineWithLMHead, FSDPEngineWithValueHead)
    for model_type, cls in (("language_model", FSDPEngineWithLMHead),
                            ("value_model", FSDPEngineWithValueHead)):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"],
                                device=NAME)(cls)
    _registered["engines"] = True


def select() -> None:
    """Make this process's verl platform the CPU one and register the engines. Call before
    anything imports ``verl.trainer`` or ``verl.workers`` (module docstring)."""
    os.environ["VERL_PLATFORM"] = NAME
    set_platform(PlatformCPU())
    register_engines()
