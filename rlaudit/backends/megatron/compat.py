"""Running megatron-core 0.16.1 without CUDA: a few targeted patches, process-group setup, teardown.

megatron-core assumes a GPU in a handful of places that our CPU/gloo runs go through (listed
below). :func:`apply_cpu_patches` fixes exactly those, and only when
``torch.cuda.is_available()`` is False; on a GPU machine it does nothing and megatron runs as
shipped. Every patch is one of three kinds, each as narrow as we could make it:

1. *Method replacements*: megatron's RNG tracker (``CudaRNGStatesTracker.add/fork``) keeps CPU
   generator states instead of CUDA ones.
2. *Module-scoped torch views*: in a named list of megatron modules the global name ``torch`` is
   replaced by a view that forwards everything to torch except ``torch.cuda.current_device()``
   (-> cpu), ``torch.cuda.synchronize()``/``empty_cache()`` (-> no-ops) and factory calls with a
   ``device="cuda"`` literal (-> cpu). torch itself and every other module are untouched. (With
   ``synchronize`` a no-op in p2p_communication, ``batch_p2p_sync=False`` is not needed.)
3. *Call-scoped type strings*: a few optimizer functions check ``tensor.type() ==
   "torch.cuda.FloatTensor"``; while (and only while) one of them runs, the no-argument form of
   ``Tensor.type()`` reports CPU tensors with the ``torch.cuda.`` prefix (process-wide for the
   duration of the call: megatron's optimizer runs on the calling thread).

Each applied patch is described by one line in :data:`APPLIED` (for run reports), and
:data:`REDIRECTS` counts what each torch view actually redirected. The patches are written against
megatron-core's source, so any other version is refused (:data:`TESTED_VERSIONS`).

Usage, inside every rank after ``torch.distributed`` is initialised (gloo on CPU)::

    from rlaudit.backends.megatron import compat
    compat.init_megatron(tp=2, pp=1, seed=1234)   # patches + parallel_state + RNG tracker
    ...
    compat.teardown_megatron()
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
from importlib import metadata
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from rlaudit.backends.launch.pool import register_task_reset
from rlaudit.backends.megatron.imports import import_megatron
from rlaudit.errors import InputError

TESTED_VERSIONS = ("0.16.1",)
"""megatron-core versions the patches were written and tested against (0.17+ needs Python 3.12)."""

APPLIED: list[str] = []
"""One line per applied patch: what was changed and why. Empty on a CUDA machine."""

REDIRECTS: collections.Counter[str] = collections.Counter()
"""Per patched module: how many CUDA references its torch view redirected to the CPU so far
(shows which patches a run actually needed)."""

# Modules whose global ``torch`` gets the CPU view, with the reason (what they allocate on CUDA).
_TORCH_VIEW_MODULES: dict[str, str] = {
    "megatron.core.utils":
        "GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device()",
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on first use",
    "megatron.core.tensor_parallel.mappings":
        "all-gather output buffer on torch.cuda.current_device() (logits gathered over TP)",
    "megatron.core.pipeline_parallel.schedules":
        'total_num_tokens = torch.zeros(..., device="cuda") in every schedule',
    "megatron.core.pipeline_parallel.p2p_communication":
        "PP receive buffers on torch.cuda.current_device(); torch.cuda.synchronize() after p2p",
    "megatron.core.distributed.param_and_grad_buffer":
        "DDP param/grad buffers on torch.cuda.current_device()",
    "megatron.core.optimizer.optimizer":
        "found_inf/_scale_one/_dummy_overflow_buf created with device='cuda'",
    "megatron.core.optimizer.clip_grads":
        "grad-norm and overflow scalars created with device='cuda'",
}

_FACTORIES = frozenset({
    "arange", "empty", "empty_like", "full", "full_like", "ones", "ones_like", "rand", "randn",
    "tensor", "zeros", "zeros_like",
})

_state = {"applied": False}


# --------------------------------------------------------------------------- torch views

def _is_cuda_device(device: Any) -> bool:
    return device is not None and str(device).startswith("cuda")


class _CpuCudaView:
    """``torch.cuda`` as seen from a patched module: a CPU stand-in for the calls megatron makes."""

    def __init__(self, module_name: str):
        self._module_name = module_name

    def __getattr__(self, name: str) -> Any:  # everything not defined below: the real torch.cuda
        return getattr(torch.cuda, name)

    def current_device(self) -> torch.device:
        REDIRECTS[self._module_name] += 1
        return torch.device("cpu")

    def synchronize(self, device: Any = None) -> None:  # CPU collectives are synchronous already
        REDIRECTS[self._module_name] += 1

    def empty_cache(self) -> None:
        REDIRECTS[self._module_name] += 1


class _CpuTorchView:
    """Stands in for ``torch`` inside one megatron module (see the module docstring, kind 2)."""

    def __init__(self, module_name: str):
        self._module_name = module_name
        self.cuda = _CpuCudaView(module_name)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if _is_cuda_device(kwargs.get("device")):
                REDIRECTS[self._module_name] += 1
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory

    def __repr__(self) -> str:
        return f"<rlaudit CPU view of torch in {self._module_name}>"


def _install_torch_view(module_name: str, reason: str) -> None:
    module = importlib.import_module(module_name)
    if not isinstance(module.torch, _CpuTorchView):
        module.torch = _CpuTorchView(module_name)
    APPLIED.append(f"{module_name}: module-global torch -> CPU view ({reason})")


# --------------------------------------------------------------------------- RNG tracker

def _patch_rng_tracker() -> None:
    # lazy: megatron-core: optional, 4 s import
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = mrandom.CudaRNGStatesTracker
    default_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

    def add(self, name: str, seed: int) -> None:
        """Track a CPU generator state seeded with ``seed`` under ``name``."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = default_name) -> Iterator[None]:
        """Run the body with the CPU default generator set to the tracked state ``name``."""
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    tracker_cls.add = add
    tracker_cls.fork = fork
    APPLIED.append("megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add/.fork: track CPU "
                   "generator states (the originals call torch.cuda.get_rng_state/set_rng_state)")


# --------------------------------------------------------------------------- Tensor.type strings

@contextlib.contextmanager
def _cuda_type_strings() -> Iterator[None]:
    """While active, ``t.type()`` (no arguments) on a CPU tensor says ``torch.cuda.<X>Tensor``."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and not self.is_cuda:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_strings(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_strings():
            return fn(*args, **kwargs)

    return wrapper


def _patch_type_checks() -> None:
    # lazy: megatron-core: optional, 4 s import
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer  # lazy: as above

    wrapped = _with_cuda_type_strings(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped
    moptimizer.clip_grad_by_total_norm_fp32 = wrapped  # imported by name there
    for cls in (distrib_optimizer.DistributedOptimizer,
                moptimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = _with_cuda_type_strings(cls.__init__)
    APPLIED.append("megatron.core.optimizer: clip_grad_by_total_norm_fp32, "
                   "DistributedOptimizer.__init__ and Float16OptimizerWithFloat16Params.__init__ "
                   "see 'torch.cuda.<X>Tensor' from Tensor.type() while they run (they assert or "
                   "branch on those strings)")


# --------------------------------------------------------------------------- public API

def megatron_version() -> str:
    """The installed megatron-core version (raises InputError when it is not installed).

    From the package metadata when there is one: importing megatron.core takes seconds and warns
    eight times, and a process that only checks availability (the CLI) should not pay that."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        pass  # a source checkout on the path, perhaps
    try:
        import megatron.core  # lazy: megatron-core: optional, 4 s import
    except ImportError as e:
        raise InputError("megatron-core is not installed; install rlaudit[megatron] "
                         f"(megatron-core=={TESTED_VERSIONS[-1]})", source="megatron-core") from e
    return megatron.core.__version__


def check_version(*, allow_untested: bool = False) -> str:
    """Return the megatron-core version; raise InputError if it is not one of TESTED_VERSIONS."""
    version = megatron_version()
    if version not in TESTED_VERSIONS and not allow_untested:
        raise InputError(
            f"installed version {version} is not supported; rlaudit's CPU patches are tested with "
            f"{', '.join(TESTED_VERSIONS)} (pip install megatron-core=={TESTED_VERSIONS[-1]})",
            source="megatron-core", key="__version__")
    return version


def apply_cpu_patches(*, allow_untested: bool = False) -> list[str]:
    """Apply the CPU patches once per process; a no-op (returning []) when CUDA is available.

    Raises InputError on a megatron-core version the patches were not written against
    (``allow_untested`` skips the check: for trying a new version, never in CI).
    Returns a copy of :data:`APPLIED`.
    """
    if torch.cuda.is_available():  # megatron runs as shipped; nothing here depends on its source
        return []
    if _state["applied"]:
        return list(APPLIED)
    check_version(allow_untested=allow_untested)
    _patch_rng_tracker()
    for module_name, reason in _TORCH_VIEW_MODULES.items():
        _install_torch_view(module_name, reason)
    _patch_type_checks()
    _state["applied"] = True
    return list(APPLIED)


def init_megatron(tp: int = 1, pp: int = 1, *, seed: int = 1234) -> None:
    """Patch (CPU only), build megatron's TP/PP/DP groups and seed its RNG tracker.

    Needs ``torch.distributed`` initialised with ``world_size % (tp * pp) == 0``; data parallel
    size is ``world_size // (tp * pp)``. Rank layout is megatron's default order (tp-cp-ep-dp-pp:
    TP ranks are adjacent). Call :func:`teardown_megatron` before destroying the process group.
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise InputError(f"expected a positive int, got {value!r}", source="init_megatron",
                             key=name)
    if not dist.is_initialized():
        raise InputError("torch.distributed is not initialised (init_process_group first)",
                         source="init_megatron")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise InputError(f"world size {world} is not divisible by tp*pp = {tp * pp}",
                         source="init_megatron", key="tp, pp")

    import_megatron()  # a spawned rank's first import: torch.compile's wrappers deferred
    apply_cpu_patches()
    from megatron.core import parallel_state  # lazy: megatron-core: optional, 4 s import
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # lazy: as above

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def teardown_megatron() -> None:
    """Destroy megatron's parallel state (safe to call when it was never initialised)."""
    try:
        from megatron.core import parallel_state  # lazy: megatron-core: optional, 4 s import
    except ImportError:
        return
    parallel_state.destroy_model_parallel()


# a warm pool's rank resets megatron after every task, even one that did not tear down itself
register_task_reset(teardown_megatron)
