"""The FSDP2 backend through the real multi-rank path (gloo, 2 ranks), against the reference backend.

One launch runs every variant (spawning costs seconds); the comparisons are float64, where the
two must agree to rounding: the update step is the same code, only sharding and reductions differ.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rlaudit.backends.base import ReplayRequest, Variant
from rlaudit.backends.fsdp import FSDPBackend, _rank_main
from rlaudit.backends.launch import launch
from rlaudit.backends.reference import ReferenceBackend
from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.errors import RankFailure
from rlaudit.metrics import golden_names

pytestmark = [pytest.mark.slow]

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "scenarios")
MODEL = os.path.abspath(os.path.join(ROOT, "models", "qwen2-tiny-short"))
ROLLOUT = os.path.abspath(os.path.join(ROOT, "rollouts", "short-ref.safetensors"))
#: float64 end to end: the only differences are summation orders of gradient reductions
ATOL = 1e-10


def _cfg(**sections):
    base = {"rollout": {"n": 4, "response_length": 12},
            "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                      "optim": {"name": "sgd", "lr": 0.05}},
            "trainer": {"dtype": "float64"}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return load_config(base)


def _variants():
    batch = load_rollout(ROLLOUT)
    return [
        Variant("grpo", _cfg(actor={"calculate_entropy": True}), batch, steps=2),
        Variant("dynamic-uneven", _cfg(actor={"use_dynamic_bsz": True,
                                              "ppo_max_token_len_per_gpu": 24,
                                              "loss_agg_mode": "seq-mean-token-mean",
                                              "rollout_correction": {"use_rollout_kl_loss": True}},
                                       # whether the two shards' token budgets give unequal
                                       # counts depends on the rows: one extra padding
                                       # micro-batch per step makes padding certain
                                       trainer={"extra_padding_microbatches": 1}),
                batch, steps=1),
        Variant("entropy-coeff0", _cfg(actor={"entropy_coeff": 0.0, "calculate_entropy": True,
                                              "use_kl_loss": True, "kl_loss_type": "k3"}),
                batch, steps=1),
        Variant("gae", _cfg(algorithm={"adv_estimator": "gae", "gamma": 0.99, "lam": 0.95},
                            critic={"optim": {"name": "sgd", "lr": 0.05}}), batch, steps=1),
        Variant("adamw-clip", _cfg(actor={"grad_clip": 0.5, "ppo_epochs": 2,
                                          "optim": {"name": "adamw", "lr": 1e-3}}),
                batch, steps=1),
    ]


@pytest.fixture(scope="module")
def runs():
    variants = _variants()
    request = ReplayRequest(model=MODEL, variants=variants, layout={"dp": 2}, dtype="float64",
                            timeout=600)
    t0 = time.perf_counter()
    fsdp = FSDPBackend().replay(request)
    seconds = time.perf_counter() - t0
    ref = ReferenceBackend().replay(request)
    return fsdp, ref, seconds


@pytest.mark.parametrize("variant", [v.name for v in _variants()])
def test_parity_with_reference(runs, variant):
    fsdp, ref, _ = runs
    f, r = fsdp[variant], ref[variant]
    mask = load_rollout(ROLLOUT).mask
    assert len(f.steps) == len(r.steps)
    for step, (fm, rm) in enumerate(zip(f.steps, r.steps)):
        assert set(golden_names(fm)) == set(golden_names(rm)), step
        for name in golden_names(rm):
            assert abs(fm[name] - rm[name]) <= ATOL + 1e-9 * abs(rm[name]), (step, name, fm[name],
                                                                            rm[name])
    for name, want in r.tokens.items():
        got = f.tokens[name]
        if want.dtype == torch.bool:
            assert torch.equal(got, want)
            continue
        diff = (got.double() - want.double()).abs()
        assert float(diff[mask].max()) <= ATOL if diff.dim() == 2 else float(diff.max()) <= ATOL, name
    for step in range(len(r.params)):
        assert float((f.params[step] - r.params[step]).abs().max()) <= ATOL


def test_dp1_parity_with_reference():
    """FSDP2 on one rank (fully_shard with a 1-device mesh) is the reference, bit for bit."""
    variants = [v for v in _variants() if v.name in ("grpo", "gae")]
    request = ReplayRequest(model=MODEL, variants=variants, layout={"dp": 1}, dtype="float64",
                            timeout=600)
    fsdp = FSDPBackend().replay(request)
    ref = ReferenceBackend().replay(request)
    for name in fsdp:
        for step in range(len(ref[name].params)):
            assert float((fsdp[name].params[step] - ref[name].params[step]).abs().max()) <= ATOL
        for metric in golden_names(ref[name].steps[-1]):
            assert abs(fsdp[name].steps[-1][metric] - ref[name].steps[-1][metric]) <= ATOL, metric


def test_every_rank_runs_equally_many_passes(runs):
    fsdp, _, _ = runs
    for name, run in fsdp.items():
        for step, ranks in enumerate(run.micro_log):
            assert len(ranks) == 2, "one micro-batch log per rank"
            counts = [[len(opt) for opt in rank] for rank in ranks]
            assert counts[0] == counts[1], (name, step, counts)
    # padding micro-batches ran on every rank and carry exactly the real ones' fields
    padded = [m for rank in fsdp["dynamic-uneven"].micro_log[0] for opt in rank for m in opt
              if m["padding"]]
    assert len(padded) >= 2 * 2, "one extra padding micro-batch per optimizer step and rank"
    real = [m for rank in fsdp["dynamic-uneven"].micro_log[0] for opt in rank for m in opt
            if not m["padding"]]
    assert all(p["fields"] == real[0]["fields"] for p in padded)
    assert all(p["tokens"] == 0 for p in padded)


def test_entropy_logged_with_zero_coefficient(runs):
    fsdp, ref, _ = runs
    assert "actor/entropy" in fsdp["entropy-coeff0"].steps[0]
    assert "actor/entropy" in ref["entropy-coeff0"].steps[0]


# ---- failures surface with rank and traceback ---------------------------------------------------

def _faulty_rank(info, request, mode):
    """The FSDP backend's rank function with rank 1's loss replaced by a failing one."""
    import rlaudit.update.actor as actor

    original = actor.actor_loss

    def loss(micro, out, **kw):
        if info.rank == 1:
            if mode == "raise":
                raise ValueError("injected failure inside rank 1's loss")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(micro, out, **kw)

    actor.actor_loss = loss
    return _rank_main(info, request)


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_rank_is_reported_not_hung(mode):
    batch = load_rollout(ROLLOUT)
    request = ReplayRequest(model=MODEL, variants=[Variant("v", _cfg(), batch)], layout={"dp": 2},
                            dtype="float64")
    t0 = time.perf_counter()
    with pytest.raises(RankFailure) as e:
        launch(_faulty_rank, 2, args=(request, mode), timeout=120)
    elapsed = time.perf_counter() - t0
    text = str(e.value)
    assert "rank 1" in text
    if mode == "raise":
        assert "injected failure inside rank 1's loss" in text and "Traceback" in text
    else:
        assert "SIGKILL" in text or "signal 9" in text or "-9" in text
    assert elapsed < 120


def test_available_by_torch_version(monkeypatch):
    from torch.torch_version import TorchVersion

    assert FSDPBackend().available() == (True, "")
    from torch.distributed.fsdp import fully_shard  # what "available" promises the ranks
    assert callable(fully_shard)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.5.1+cpu"))
    ok, why = FSDPBackend().available()
    assert not ok and "torch 2.5.1+cpu" in why and ">= 2.6" in why
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.6.0"))
    assert FSDPBackend().available() == (True, "")
