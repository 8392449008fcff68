"""Shared test settings: hypothesis profiles, GPU skipping, torch thread count."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI has 2 cores and runs pytest-xdist with 2 workers: one intra-op thread per worker.
torch.set_num_threads(int(os.environ.get("RLAUDIT_TEST_THREADS", "1")))
# the `rlaudit run`s the tests start share the cores with the other xdist worker, where a rank
# group pinned to a core cannot move off it while that worker keeps it busy -- the case
# RLAUDIT_PIN_RANKS=off is for. Measured once (467 s off, then 487 s on, while the VM was
# slowing): not conclusive, but off keeps the suite as it was timed before placement.
# tests/backends/test_placement.py places on purpose.
os.environ.setdefault("RLAUDIT_PIN_RANKS", "off")
# the reference memo (rlaudit/backends/memo.py) holds the 80 examples of a run-level fuzz
# (~4 MB each: the parameters after each step), which the other run-level fuzz tests on the same
# worker draw again (tests/targets/test_fuzz.py: FUZZ_RUN_GROUP); the default 256 MiB holds ~50
os.environ.setdefault("RLAUDIT_REFERENCE_MEMO_MB", "640")

settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (nightly GPU job)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, megatron, the peers, the test modules)
    lives as long as the session: keep full collections off it (rlaudit/heap.py). accelerate's
    gc.collect() at each Trainer.train() cost TRL's end-to-end tests 9 of their 12 s of
    training without this."""
    from rlaudit.heap import freeze_long_lived
    freeze_long_lived()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """What a test imported on the way (megatron-core's submodules, MLflow, TRL, vLLM, ...) lives
    as long as the session too: frozen once that test is torn down, so that later full
    collections do not walk it (freeze_long_lived does nothing when no module was imported)."""
    from rlaudit.heap import freeze_long_lived
    freeze_long_lived()
