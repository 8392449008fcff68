"""SkyRL 0.4's FSDP policy worker on CPU: what its Ray actor group and GPUs would provide, given
in-process to a rank of rlaudit's launcher (gloo, float32). SkyRL has no device or platform
abstraction: its worker and FSDP strategy call ``torch.cuda`` by name. Nothing of SkyRL is edited;
while :func:`cuda_as_cpu` is active, the few ``torch`` entry points those calls reach answer for
the CPU. Every call it serves, at the skyrl-v0.4.0 tag (``skyrl/backends/skyrl_train/``):

- ``workers/worker.py:134`` (``init_worker_process_group``) and ``distributed/fsdp_utils.py:256``
  (``create_device_mesh``): ``init_device_mesh("cuda", ...)`` -> the same mesh on ``"cpu"``.
- ``distributed/fsdp_strategy.py:109`` (``setup_distributed``): ``torch.cuda.set_device(rank)``
  -> nothing to select.
- ``distributed/fsdp_utils.py:125`` (``_sync_non_persistent_buffers``, rank 0): ``buf.cuda()``
  before the broadcast of rotary ``inv_freq`` -> the CPU tensor itself.
- ``workers/worker.py:1090`` (``_forward_backward_micro``), ``:1473`` (``_forward_micro_batch``),
  ``distributed/strategy.py:84`` (``all_reduce``), ``distributed/fsdp_utils.py:249``
  (``fsdp2_clip_grad_norm_``): ``torch.cuda.current_device()`` as the target of ``.to()`` ->
  ``"cpu"``.
- ``distributed/fsdp_strategy.py:132-146`` (offload / backload) and the worker's
  ``empty_cache``: ``torch.cuda.synchronize`` / ``empty_cache`` -> nothing to wait for.

What degrades on CPU by itself: ``torch.autocast(device_type="cuda")`` around the forward
(worker.py:1126, 1406, 1483) is disabled with a warning when CUDA is absent (float32 throughout,
as the worker's config asks); ``logprobs_from_logits`` takes its torch path when the logits are not
CUDA tensors (utils/torch_utils.py:137). flash-attn is absent: ``workers/model_wrapper.py:13``
imports ``flash_attn.bert_padding`` at module level (used only with
``remove_microbatch_padding``, which needs flash_attention_2 and is off here), so the worker module
is imported under :func:`~rlaudit.targets.peers.openrlhf_import.flash_attn_placeholders`.

Not served (so ``dp = 1``): ``distributed/fsdp_utils.py:127`` allocates the broadcast buffer of
ranks > 0 with ``torch.empty(..., device="cuda")``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed.device_mesh as device_mesh

#: the device SkyRL's hard-coded ``"cuda"`` is answered with
DEVICE = "cpu"


def _mesh_on_cpu(real):
    def init_device_mesh(device_type, *args, **kwargs):
        return real(DEVICE if device_type == "cuda" else device_type, *args, **kwargs)
    return init_device_mesh


def _nothing():
    """A fresh do-nothing function (one per stood-in name: torch.compile's rule table, built on
    first use, refuses one object under two torch names)."""
    def nothing(*args, **kwargs) -> None:
        return None
    return nothing


def _tensor_cuda(self, *args, **kwargs):
    return self.to(DEVICE)


@contextlib.contextmanager
def cuda_as_cpu(*modules: Any):
    """Within the block, the ``torch.cuda`` calls the module docstring lists answer for the CPU;
    ``modules`` (SkyRL modules that imported ``init_device_mesh`` by name) see the CPU mesh
    too. Everything is restored on exit."""
    if torch.cuda.is_available():       # a real GPU: nothing to stand in for
        yield
        return
    saved: list[tuple[Any, str, Any]] = []

    def put(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    real_mesh = device_mesh.init_device_mesh
    put(device_mesh, "init_device_mesh", _mesh_on_cpu(real_mesh))
    for mod in modules:
        if getattr(mod, "init_device_mesh", None) is real_mesh:
            put(mod, "init_device_mesh", _mesh_on_cpu(real_mesh))
    put(torch.cuda, "current_device", lambda: DEVICE)
    for name in ("set_device", "synchronize", "empty_cache"):
        put(torch.cuda, name, _nothing())
    put(torch.Tensor, "cuda", _tensor_cuda)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


__all__ = ["DEVICE", "cuda_as_cpu"]
