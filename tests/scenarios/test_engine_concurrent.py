"""run_scenario(concurrent_backends=True): every backend's replay is handed over at once, and the
result is the sequential one -- same runs in the same order, a crashed backend reported as its
own error, bad input raised only once every replay has come back.

Every backend's replay here is the reference backend's (real runs, identical by construction),
behind a barrier that only opens when all of them are in flight at the same time."""

from __future__ import annotations

import threading

import pytest

from rlaudit.backends.reference import ReferenceBackend
from rlaudit.errors import InputError
from rlaudit.scenarios.engine import run_scenario
from rlaudit.scenarios.spec import load_scenario
from test_engine_golden import write_scenario

BACKENDS = {"reference": {}, "fsdp": {"dp": 1}, "megatron": {"tp": 1}}


def _scenario(tmp_path):
    pytest.importorskip("megatron.core")
    return load_scenario(write_scenario(tmp_path / "concurrent.yaml", backends=BACKENDS,
                                        invariants=["sanity-bounds", "backend-parity"]))


class _Replay:
    """Replays on the reference backend; ``parties`` calls must be in flight together before any
    proceeds; ``fail`` maps a backend name to the exception its replay raises."""

    def __init__(self, parties: int, fail=None):
        self.barrier = threading.Barrier(parties, timeout=60)
        self.lock = threading.Lock()  # reference replays seed the process RNG: one at a time
        self.fail = fail or {}
        self.threads = set()

    def __call__(self, backend, request):
        self.threads.add(threading.get_ident())
        self.barrier.wait()  # BrokenBarrierError unless every backend's replay is running
        if backend.name in self.fail:
            raise self.fail[backend.name]
        with self.lock:
            runs = ReferenceBackend().replay(request)
        for run in runs.values():  # the runs are identical: say whose they are
            run.info["replayed_for"] = backend.name
        return runs


def _untimed(steps):
    return [{k: v for k, v in s.items() if not k.startswith("timing/")} for s in steps]


@pytest.mark.slow
def test_concurrent_backends_give_the_sequential_result(tmp_path):
    scn = _scenario(tmp_path)
    replay = _Replay(len(BACKENDS))
    together = run_scenario(scn, replay=replay, concurrent_backends=True)
    assert len(replay.threads) == len(BACKENDS)
    alone = run_scenario(scn, replay=lambda b, r: ReferenceBackend().replay(r))
    assert list(together.runs) == list(alone.runs) and set(alone.runs) == set(BACKENDS)
    for b, runs in together.runs.items():  # each backend got its own replay's runs back
        assert {r.info["replayed_for"] for r in runs.values()} == {b}
    for b in BACKENDS:
        assert _untimed(together.metrics[b]) == _untimed(alone.metrics[b])
    assert [(c.invariant, c.backend, c.status) for c in together.checks] == \
        [(c.invariant, c.backend, c.status) for c in alone.checks]
    assert together.passed and not together.errors


@pytest.mark.slow
def test_a_crashed_backend_is_its_own_error_and_bad_input_waits_for_the_others(tmp_path):
    scn = _scenario(tmp_path)
    res = run_scenario(scn, replay=_Replay(3, fail={"fsdp": RuntimeError("rank 1 died")}),
                       concurrent_backends=True)
    assert list(res.errors) == ["fsdp"] and "rank 1 died" in res.errors["fsdp"]
    assert "Traceback" in res.errors["fsdp"]
    assert set(res.runs) == {"reference", "megatron"} and not res.passed
    assert res.runs["megatron"]["base"].info["replayed_for"] == "megatron"
    replay = _Replay(3, fail={"megatron": InputError("bad layout", key="tp")})
    with pytest.raises(InputError, match="bad layout"):
        run_scenario(scn, replay=replay, concurrent_backends=True)
    # the barrier let all three through: the others ran before the error was raised
    assert len(replay.threads) == 3
