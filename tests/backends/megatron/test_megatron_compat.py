"""compat: version gate, CUDA no-op, and the two patch mechanisms, without importing megatron;
and (importing it) the blocker that keeps megatron-core's own context parallelism off CPU.

The patches applied to a real megatron-core (idempotency, RNG tracker streams, TP/PP/DP runs that
only work with them) are checked inside the spawned ranks of test_megatron_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from rlaudit.backends.megatron import compat
from rlaudit.errors import InputError


@pytest.fixture
def fresh(monkeypatch):
    """A compat module that has applied nothing yet, in this test only."""
    monkeypatch.setattr(compat, "_state", {"applied": False})
    monkeypatch.setattr(compat, "APPLIED", [])
    return compat


def test_untested_megatron_version_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(compat, "megatron_version", lambda: "0.17.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="0.16.1") as info:
        compat.apply_cpu_patches()
    assert info.value.source == "megatron-core" and "0.17.0" in str(info.value)
    assert compat.check_version(allow_untested=True) == "0.17.0"


def test_nothing_is_patched_or_checked_when_cuda_is_available(fresh, monkeypatch):
    monkeypatch.setattr(compat, "megatron_version", lambda: "0.17.0")  # not refused: no patches
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compat.apply_cpu_patches() == []
    assert compat.APPLIED == [] and not compat._state["applied"]


def test_torch_view_maps_cuda_to_cpu_and_forwards_the_rest():
    view = compat._CpuTorchView("some.module")
    assert view.cuda.current_device() == torch.device("cpu")
    assert view.cuda.synchronize() is None and view.cuda.empty_cache() is None
    t = view.zeros(2, dtype=torch.int, device="cuda")
    assert t.device.type == "cpu" and t.dtype == torch.int and t.tolist() == [0, 0]
    assert view.empty(3, device=view.cuda.current_device()).device.type == "cpu"
    assert view.float32 is torch.float32 and view.distributed is torch.distributed
    assert view.tensor([1.5], device="cuda:0").item() == 1.5
    if not torch.cuda.is_available():  # the real torch is untouched
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()


def test_cuda_type_strings_only_while_the_wrapped_call_runs():
    x32, x64 = torch.zeros(1), torch.zeros(1, dtype=torch.float64)

    @compat._with_cuda_type_strings
    def inside():
        return x32.type(), x64.type(), x32.type(torch.float64).dtype

    assert inside() == ("torch.cuda.FloatTensor", "torch.cuda.DoubleTensor", torch.float64)
    assert x32.type() == "torch.FloatTensor"  # restored afterwards

    @compat._with_cuda_type_strings
    def raises():
        raise ValueError("boom")

    with pytest.raises(ValueError):
        raises()
    assert x32.type() == "torch.FloatTensor"  # restored after an exception too


def test_init_megatron_checks_its_arguments():
    with pytest.raises(InputError, match="tp"):
        compat.init_megatron(tp=0)
    if not torch.distributed.is_initialized():
        with pytest.raises(InputError, match="init_process_group"):
            compat.init_megatron(tp=1, pp=1)


def test_context_parallel_is_refused_without_transformer_engine():
    """docs/internals.md, "Context parallelism": megatron-core 0.16.1's local attention refuses
    CP, and CP attention needs TransformerEngine (no CPU build). Fails when that changes, so the
    Megatron backend can get real CP instead of the shared step's simulation."""
    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("TransformerEngine is installed: megatron CP may run here")
    except ImportError:
        pass
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2,
                            context_parallel_size=2, use_cpu_initialization=True)
    with pytest.raises(AssertionError, match="only supported by TEDotProductAttention"):
        DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                            attention_type="self")
