"""What slime's Megatron actor needs on a CPU rank that slime itself leaves open: its imports'
absent packages, a CPU accelerator, Ray's object store, and the packed-sequence attention.

Used only inside the rank of :mod:`rlaudit.targets.peers.slime_train` (a fresh process); no
slime file is changed.

- **Absent packages** (:func:`absent_packages`). slime's Megatron actor module imports, at module
  level, packages of a GPU cluster that the step never calls on this path: SGLang and its router
  (weight sync to the rollout engines), ``torch_memory_saver`` (offloading), wandb (a logging
  sink, off: ``use_wandb`` False) and Megatron-LM's ``megatron.training`` (argument parsing,
  checkpointing, ``get_model``; megatron-core, installed, has no ``training`` package). Those
  names resolve to placeholder modules whose every attribute raises :class:`PlaceholderCalled`
  when called, except the two ``megatron.training`` functions the step does call, which are given
  their meaning: ``global_vars.get_args`` (Megatron-LM keeps the run's argument namespace in a
  global and returns it) and ``training.get_model`` (returns the model chunks built here: the
  tiny model's GPTModel, see :class:`PackedSequences`).
- **CPU accelerator** (:func:`cpu_accelerator`): slime's accelerator registry
  (slime/utils/accelerator, ``register_accelerator``: "a lazily constructed backend without
  changing Slime core") has CUDA and MUSA; a CPU backend is registered and selected.
- **Ray's object store** (:func:`in_process_object_store`): the rollout manager hands each
  data-parallel rank its data as ``Box(ray.put(...))`` and the actor reads it with ``ray.get``
  (slime/ray/rollout.py ``_split_train_data_by_dp``, slime/utils/data.py
  ``process_rollout_data``); in one process a dict stands in (a transport: the same objects).
- **Packed sequences** (:class:`PackedSequences`): slime packs a micro-batch's samples into one
  token stream with ``PackedSeqParams`` (``qkv_format="thd"``, cu_seqlens; data.py
  ``get_batch``), which Transformer Engine's varlen attention keeps apart, each sample with
  positions from 0. Transformer Engine is CUDA-only; megatron's local attention has no thd
  format. The wrapper runs each packed segment through the GPTModel on its own (causal, positions
  from 0) and concatenates the logits: what the varlen kernel computes.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch

from rlaudit.targets.peers.step_config import WrappedGPT

#: module prefixes slime's actor imports that are absent on a CPU environment (module docstring)
ABSENT = ("megatron.training", "sglang", "sglang_router", "torch_memory_saver", "wandb")


class PlaceholderCalled(RuntimeError):
    """slime called into a package that is absent here (module docstring of slime_cpu)."""


class _Placeholder(importlib.abc.Loader):
    def __init__(self, provided: dict[str, dict[str, Any]]):
        self.provided = provided

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__dict__.update(self.provided.get(spec.name, {}))

        def missing(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def call(*args, **kwargs):
                raise PlaceholderCalled(f"{spec.name}.{attr}: not installed on this CPU "
                                        f"environment; slime's CPU train step does not map it")
            return call

        mod.__getattr__ = missing
        return mod

    def exec_module(self, module) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, provided):
        self.loader = _Placeholder(provided)

    def find_spec(self, name, path=None, target=None):
        if any(name == p or name.startswith(p + ".") for p in ABSENT):
            if importlib.machinery.PathFinder.find_spec(name.split(".")[0]) is not None \
                    and not name.startswith("megatron.training"):
                return None     # installed after all: the real package
            return importlib.machinery.ModuleSpec(name, self.loader, is_package=True)
        return None


def absent_packages(*, get_args, get_model) -> None:
    """Install the placeholders for this (rank) process; ``get_args`` and ``get_model`` become
    ``megatron.training.global_vars.get_args`` and ``megatron.training.training.get_model``."""
    sys.meta_path.insert(0, _Finder({
        "megatron.training.global_vars": {"get_args": get_args},
        "megatron.training.training": {"get_model": get_model}}))


def cpu_accelerator() -> None:
    """Register and select slime's CPU backend: :class:`CpuMethods` on slime's ``Accelerator``
    base (its abstract methods and the defaults it leaves to a backend)."""
    # lazy: slime is on sys.path only inside the rank
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator  # lazy: as above
    cls = type("CpuAccelerator", (CpuMethods, Accelerator), {})
    accelerator.register_accelerator("cpu", cls, lambda: True, priority=0,
                                     communication_backends=("gloo",))
    accelerator.set_accelerator(cls())


class CpuMethods:
    """The CPU: one device, no streams, no device memory, no cache; gloo for collectives."""

    name = "cpu"
    device_type = "cpu"
    communication_backend_name = "gloo"

    def is_available(self) -> bool:
        return True

    def device(self, index=None) -> torch.device:
        return torch.device("cpu")

    def device_name(self, index=None) -> str:
        return "cpu"

    def set_device(self, index) -> None:
        return None

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def synchronize(self, device=None) -> None:
        return None

    def current_stream(self, device=None) -> Any:
        return None

    def empty_cache(self) -> None:
        return None

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return 0, 0

    def memory_allocated(self, device=None) -> int:
        return 0

    def memory_reserved(self, device=None) -> int:
        return 0

    def communication_backend(self, default: str = "nccl") -> str:
        return "gloo"

    def distributed_device_id(self, index=None):
        return None

    def accelerator_module(self) -> Any:
        return torch.cpu


@contextlib.contextmanager
def in_process_object_store():
    """``ray.put`` / ``ray.get`` over a dict while the block runs (module docstring)."""
    import ray  # lazy: slime's transport, imported by slime anyway

    store: dict[int, Any] = {}
    real_put, real_get = ray.put, ray.get

    def put(value, **kwargs):
        store[len(store)] = value
        return ("rlaudit-object", len(store) - 1)

    def get(ref, **kwargs):
        if isinstance(ref, list):
            return [get(r) for r in ref]
        return store[ref[1]]

    ray.put, ray.get = put, get
    try:
        yield
    finally:
        ray.put, ray.get = real_put, real_get


class PackedSequences(WrappedGPT):
    """The GPTModel behind slime's packed (thd) micro-batches (module docstring): each segment of
    ``packed_seq_params.cu_seqlens_q`` through the model alone, causal, positions from 0; every
    other attribute is the GPTModel's (``module``: megatron's unwrapping goes through it)."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None,
                packed_seq_params=None, loss_mask=None, **kwargs):
        # lazy: megatron-core pieces of rlaudit's backend, inside the rank only
        from rlaudit.backends.megatron.model import attention_mask_4d
        if position_ids is not None or attention_mask is not None or labels is not None or kwargs:
            raise NotImplementedError("slime's CPU step maps its packed forward only "
                                      "(no position ids, mask, labels or multimodal inputs)")
        if packed_seq_params is None:
            bounds = [0, input_ids.shape[1]]
        else:
            bounds = [int(x) for x in packed_seq_params.cu_seqlens_q.tolist()]
        if input_ids.shape[0] != 1 or bounds[-1] != input_ids.shape[1]:
            raise NotImplementedError(f"expected one packed stream [1, {bounds[-1]}], got "
                                      f"{list(input_ids.shape)}")
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            seg = input_ids[:, lo:hi]
            mask = attention_mask_4d(torch.ones_like(seg, dtype=torch.bool))
            pos = torch.arange(hi - lo, device=seg.device).unsqueeze(0)
            outs.append(self.module(seg, pos, mask))
        return torch.cat(outs, dim=1)
