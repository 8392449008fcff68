"""The Megatron backend vs the reference backend (an independent engine: HF model, torch autograd
and torch optimizers in one process) on the same weights and rollout, float64.

One group per world size (the session's warm pool) runs the layouts (tp, pp, dp) in (1,1,1),
(2,1,1), (1,2,1), (1,1,2); each replays
the variants of megatron_backend_ranks.VARIANTS (all at TP, a subset at PP/DP) and is checked by a
single test item, so pytest-xdist can never launch a layout twice. Per variant: per-token
log-probs/entropy/derived fields, every golden metric per step, the exact metric-name set,
updated parameters after every step, no input mutation, identical metrics on every rank, equal
micro-batch counts on every rank, megatron's own float32 grad norm vs the float64 one. Plus the
seed invariants on megatron's own runs (entropy logged with coefficient 0 and not changing the
update; padding micro-batches complete and without effect) and a control showing the tolerance
resolves a config change. Extra requests in the same groups: the tiny Llama as the actor at
(1,1,1), float32 with megatron's own norm/clipping and the DistributedOptimizer at DP=2.

Measured (float64): per-token <= 2e-14, parameters <= 1.1e-13 (AdamW; SGD ~1e-15), metrics ~1e-14
relative; bounds below leave 100x. float32 (DP=2): per-token 0, parameters 9e-6 after AdamW on
one host, 1.8e-5 on another -- where a parameter's true gradient is 0 (a key projection's bias:
softmax ignores a shift shared by a query's logits), AdamW turns rounding into an update, and
which way depends on the CPU's float32 kernels. So the float32 runs' parameters are compared as
`rlaudit run --target` compares a float32 trainer's: per tensor in L2, with the spread of the
reference replayed with its weights perturbed at float32's unit roundoff as a floor
(rlaudit.targets.run.runner); metrics and per-token tensors stay elementwise, with no floor.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import time

import pytest
import torch
import yaml

import megatron_backend_ranks as R
from rlaudit.backends.base import ReplayRequest
from rlaudit.backends.megatron.backend import (UNSUPPORTED_CRITIC, MegatronBackend, check_request,
                                               merge_ranks, parse_layout)
from rlaudit.errors import InputError
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.tolerance import DEFAULT_TOLERANCES, Tolerance
from rlaudit.targets.contract.declare import NOISE_SCALE

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                    "(pip install rlaudit[megatron])")

FP64 = Tolerance(rtol=1e-9, atol=1e-11)
FP32 = Tolerance(**DEFAULT_TOLERANCES["float32"])
NORM_FP32_RTOL = 1e-6      # megatron's float32 grad norm vs the float64 one (measured 5e-8)
LAUNCH_TIMEOUT_S = 900.0

LAYOUTS = {"tp1_pp1_dp1": {"tp": 1, "pp": 1, "dp": 1}, "tp2": {"tp": 2}, "pp2": {"pp": 2},
           "dp2": {"dp": 2}}
#: PP/DP skip variants whose path through megatron another variant already takes
SKIPPED_AT_PP_DP = ("seq-mean-token-sum-norm", "entropy-coef", "rollout-corr", "kl-in-reward")
REDUCED = [n for n in R.VARIANTS if n not in SKIPPED_AT_PP_DP]
LAYOUT_VARIANTS = {"tp1_pp1_dp1": list(R.VARIANTS), "tp2": list(R.VARIANTS), "pp2": REDUCED,
                   "dp2": REDUCED}


class Tolerances:
    """The part of a Scenario that compare_runs reads: one tolerance for every name."""

    def __init__(self, tol: Tolerance):
        self._tol = tol

    def tol(self, name: str) -> Tolerance:
        return self._tol


@pytest.fixture(scope="module")
def batch():
    return R.rollout()


@pytest.fixture(scope="module")
def reference(batch):
    from rlaudit.backends.reference import ReferenceBackend

    return ReferenceBackend().replay(R.request(batch, {}))


def _extra_requests(layout: str, batch) -> list[tuple[str, ReplayRequest, Tolerance]]:
    if layout == "tp1_pp1_dp1":   # Llama as the actor (no QKV bias), Qwen2 as the reference
        return [("llama-actor", R.request(batch, LAYOUTS[layout], ["base", "kl-loss"],
                                          model=R.REF_MODEL, ref_model=R.MODEL), FP64)]
    if layout == "dp2":           # megatron's own fp32 norm/clip; DistributedOptimizer (adamw)
        return [("float32", R.request(batch, LAYOUTS[layout], ["base", "adamw", "no-clip"],
                                      dtype="float32"), FP32)]
    return []


# ---- checks -------------------------------------------------------------------------------------

def parity_problems(runs, want_runs, mask, tol: Tolerance, world: int) -> list[str]:
    """Everything that must agree between a megatron run and the reference run of each variant."""
    problems = []
    for name, run in runs.items():
        want = want_runs[name]
        if name == "gae":
            if run.info.get("unsupported") != UNSUPPORTED_CRITIC or run.steps:
                problems.append(f"gae: expected an unsupported run, got info={run.info}")
            continue
        problems += compare_runs(Tolerances(tol), run, want, mask=mask, label=name).failures
        if (len(run.steps), len(run.params)) != (len(want.steps), len(want.params)):
            problems.append(f"{name}: {len(run.steps)} steps / {len(run.params)} parameter "
                            f"vectors, reference {len(want.steps)} / {len(want.params)}")
        for step, (g, w) in enumerate(zip(run.steps, want.steps)):
            if set(g) != set(w):
                problems.append(f"{name} step {step}: metric names differ: "
                                f"{sorted(set(g) ^ set(w))}")
        if not run.inputs_unchanged:
            problems.append(f"{name}: the batch was modified in place")
        if not run.info.get("rank_metrics_agree"):
            problems.append(f"{name}: ranks logged different metrics")
        if run.info.get("rank_params_differ") != {} or "after step 0" not in run.info["params_sha"]:
            problems.append(f"{name}: ranks hold different parameters: "
                            f"{run.info.get('rank_params_differ')}")
        for i, entry in enumerate(run.info["norm_log"]):
            rel = abs(entry["megatron_fp32"] - entry["grad_norm"]) / entry["grad_norm"]
            if not rel <= NORM_FP32_RTOL:
                problems.append(f"{name} optimizer step {i}: megatron's grad norm "
                                f"{entry['megatron_fp32']} vs {entry['grad_norm']}")
        for step, ranks in enumerate(run.micro_log):
            counts = [[len(m) for m in r] for r in ranks]
            if len(ranks) != world or any(c != counts[0] for c in counts):
                problems.append(f"{name} step {step}: micro-batches per rank {counts}")
    return problems


def seed_problems(runs, mask) -> list[str]:
    """SEEDS.md §1 and §3 on megatron's own runs."""
    same = Tolerances(FP64)
    base, off, padded = runs["base"], runs["entropy-off"], runs["padding"]
    problems = []
    if "actor/entropy" not in base.steps[0]:
        problems.append("actor/entropy not logged with entropy_coeff 0 and calculate_entropy")
    if "actor/entropy" in off.steps[0]:
        problems.append("actor/entropy logged although no entropy was asked for")
    c = compare_runs(same, base, off, mask=mask, metric_names_equal=False, tokens=(),
                     metrics=["actor/loss", "actor/pg_loss", "actor/grad_norm"], steps=1,
                     label="calculate_entropy on vs off")
    problems += c.failures
    problems += compare_runs(same, padded, base, mask=mask, steps=1,
                             label="2 padding micro-batches vs none").failures
    for rank, opt_steps in enumerate(padded.micro_log[0]):
        for k, micros in enumerate(opt_steps):
            pads = [m for m in micros if m["padding"]]
            real = [m for m in micros if not m["padding"]]
            if len(pads) < 2:
                problems.append(f"rank {rank} optimizer step {k}: {len(pads)} padding "
                                "micro-batches")
            if any(m["fields"] != micros[0]["fields"] for m in pads + real):
                problems.append(f"rank {rank} optimizer step {k}: a micro-batch lacks fields")
    return problems


def diff_summary(runs, want_runs, mask) -> dict[str, tuple[float, float]]:
    """quantity -> (max abs diff, max abs diff / max |reference value|) over all variants."""
    acc: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(key, got, want):
        acc.setdefault(key, []).append((torch.as_tensor(got, dtype=torch.float64).flatten(),
                                        torch.as_tensor(want, dtype=torch.float64).flatten()))

    for name, run in runs.items():
        if run.info.get("unsupported"):
            continue
        want = want_runs[name]
        for key, fields in (("log-probs", ("probe_log_probs", "old_log_probs")),
                            ("entropy", ("probe_entropy",)), ("ref log-probs", ("ref_log_probs",))):
            for f in fields:
                if f in run.tokens:
                    add(key, run.tokens[f][mask], want.tokens[f][mask])
        for g, w in zip(run.steps, want.steps):
            for metric, key in (("actor/pg_loss", "losses"), ("actor/loss", "losses"),
                                ("actor/kl_loss", "losses"), ("actor/entropy", "entropy metric"),
                                ("actor/grad_norm", "grad norm")):
                if metric in w:
                    add(key, [g[metric]], [w[metric]])
        for g, w in zip(run.params, want.params):
            add("params", g, w)
    out = {}
    for key, pairs in acc.items():
        got, want = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        diff = float((got - want).abs().max())
        out[key] = (diff, diff / max(float(want.abs().max()), 1e-300))
    return out


# ---- one test per layout ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.megatron
@needs_megatron
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_matches_reference(layout, batch, reference):
    from rlaudit.backends.launch.pool import run_ranks
    from rlaudit.backends.reference import ReferenceBackend

    sizes = parse_layout(LAYOUTS[layout])
    world = sizes[0] * sizes[1] * sizes[2]
    extra = _extra_requests(layout, batch)
    requests = [R.request(batch, LAYOUTS[layout], LAYOUT_VARIANTS[layout])] + [r for _, r, _ in
                                                                              extra]
    t0 = time.perf_counter()
    # the session's warm megatron pool when there is one (replay_in_rank sets up each layout)
    per_rank = run_ranks(R.replay_many, world, pool="megatron", args=(requests,),
                         timeout=LAUNCH_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    results = [merge_ranks([r["runs"][i] for r in per_rank], sizes) for i in range(len(requests))]
    runs, mask = results[0], batch.mask

    problems = parity_problems(runs, reference, mask, FP64, world)
    problems += seed_problems(runs, mask)
    control = compare_runs(Tolerances(FP64), runs["seq-mean-token-mean"], reference["base"],
                           mask=mask)
    if control.ok:
        problems.append("control: seq-mean-token-mean on megatron agrees with token-mean on the "
                        "reference, so the tolerance cannot see a loss_agg_mode change")
    optimizers = {r.info["optimizer"] for r in runs.values() if "optimizer" in r.info}
    if optimizers != {"FP32Optimizer"}:
        problems.append(f"float64 runs must use megatron's FP32Optimizer, used {optimizers}")
    for label, req, tol in extra:
        got = results[requests.index(req)]
        want = ReferenceBackend().replay(req)
        if req.dtype != "float64":  # parameters against the rounding noise floor (see above)
            noisy = ReferenceBackend().replay(
                dataclasses.replace(req, weight_noise=NOISE_SCALE[req.dtype]))
            for name, run in want.items():  # metrics and tokens as the run's own: no floor
                run.noise = dataclasses.replace(run, params=noisy[name].params)
        problems += [f"[{label}] {p}" for p in parity_problems(got, want, mask, tol, world)]
        if label == "float32":
            optimizers = {n: r.info["optimizer"] for n, r in got.items()}
            if optimizers != {"base": "FP32Optimizer", "adamw": "DistributedOptimizer",
                              "no-clip": "FP32Optimizer"}:
                problems.append(f"[float32] unexpected optimizers {optimizers}")
            if any(e["megatron_fp32"] != e["grad_norm"] for r in got.values()
                   for e in r.info["norm_log"]):
                problems.append("[float32] the grad norm is not megatron's own")
        print(f"{layout} [{label}]", {k: f"{a:.1e} / {r:.1e}"
                                      for k, (a, r) in diff_summary(got, want, mask).items()})
    print(f"{layout}: launch {seconds:.1f} s (in ranks: {per_rank[0]['seconds']}), "
          f"{len(runs)} variants;", {k: f"{a:.1e} / {r:.1e}"
                                     for k, (a, r) in diff_summary(runs, reference, mask).items()})
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:40])


# ---- end to end through the scenario engine -----------------------------------------------------

INVARIANTS = ["backend-parity", "entropy-logged-when-coeff-zero", "padding-microbatches-complete",
              "distributed-health"]


@pytest.mark.slow
@pytest.mark.megatron
@needs_megatron
def test_scenario_passes_on_megatron_tp2(tmp_path, batch):
    from rlaudit.data.io import save_rollout
    from rlaudit.scenarios.engine import run_scenario
    from rlaudit.verdict.result import PASS
    from rlaudit.scenarios.spec import load_scenario

    rollout = tmp_path / "rollout.safetensors"
    save_rollout(batch.without("teacher_topk_ids", "teacher_topk_log_probs"), rollout)
    config = copy.deepcopy(R.BASE)
    del config["trainer"]["dtype"]  # the scenario's dtype key sets it
    spec = {"description": "megatron TP=2 vs reference", "model": str(R.MODEL),
            "rollout": str(rollout), "steps": 2, "dtype": "float64", "config": config,
            "backends": {"reference": {}, "megatron": {"tp": 2}}, "invariants": INVARIANTS}
    path = tmp_path / "megatron_tp2.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = run_scenario(load_scenario(path))
    assert not result.errors, result.errors
    by_key = {(c.invariant, c.backend): c for c in result.checks}
    for name in INVARIANTS:
        check = by_key[(name, "megatron")]
        assert check.status == PASS, (name, check.message)
    assert result.passed, [(c.invariant, c.backend, c.status, c.message) for c in result.checks]


@pytest.mark.slow
@pytest.mark.megatron
@needs_megatron
def test_replicas_that_drift_apart_fail_distributed_health(tmp_path, batch, monkeypatch):
    """Results are read from global rank 0, so a data-parallel replica that steps differently
    (here: rank 1's optimizer with 1.5 x the learning rate) changes nothing rank 0 reports when
    the step is one optimizer step (one mini-batch); distributed-health compares every rank's
    gathered model and names the rank."""
    from rlaudit.data.io import save_rollout
    from rlaudit.scenarios.engine import run_scenario
    from rlaudit.verdict.result import FAIL, PASS
    from rlaudit.scenarios.spec import load_scenario

    rollout = tmp_path / "rollout.safetensors"
    save_rollout(batch.without("teacher_topk_ids", "teacher_topk_log_probs"), rollout)
    config = copy.deepcopy(R.BASE)
    del config["trainer"]["dtype"]
    config["actor"]["ppo_mini_batch_size"] = config["data"]["train_batch_size"]  # one optimizer step
    spec = {"description": "megatron DP=2", "model": str(R.MODEL), "rollout": str(rollout),
            "steps": 1, "dtype": "float64", "config": config,
            "backends": {"reference": {}, "megatron": {"dp": 2}},
            "invariants": ["distributed-health", "backend-parity"]}
    path = tmp_path / "megatron_dp2.yaml"
    path.write_text(yaml.safe_dump(spec))
    clean = {(c.invariant, c.backend): c for c in run_scenario(load_scenario(path)).checks}
    assert clean[("distributed-health", "megatron")].status == PASS
    monkeypatch.setenv("RLAUDIT_FAULT", "megatron:lr_scale:rank=1,factor=1.5")
    faulty = {(c.invariant, c.backend): c for c in run_scenario(load_scenario(path)).checks}
    health = faulty[("distributed-health", "megatron")]
    assert health.status == FAIL
    assert "base after step 0: rank(s) 1 hold other parameters than rank 0" in health.message
    # rank 0's own results are untouched: parity with the reference cannot see it
    assert faulty[("backend-parity", "megatron")].status == PASS


# ---- no spawn -----------------------------------------------------------------------------------

def test_parse_layout_rejects_bad_layouts():
    assert parse_layout({}) == (1, 1, 1)
    assert parse_layout({"tp": 2, "dp": 3}) == (2, 1, 3)
    for layout, key in (({"ep": 2}, "ep"), ({"tp": 0}, "tp"), ({"pp": "2"}, "pp"),
                        ({"dp": True}, "dp")):
        with pytest.raises(InputError) as err:
            parse_layout(layout)
        assert err.value.key == key


def test_check_request_rejects_impossible_splits_before_spawning():
    with pytest.raises(InputError) as err:  # 2 KV heads cannot be split 4 ways
        check_request(ReplayRequest(model=str(R.MODEL), layout={"tp": 4}))
    assert err.value.key == "num_key_value_heads"
    with pytest.raises(InputError) as err:
        check_request(ReplayRequest(model=str(R.MODEL), layout={"pp": 3}))
    assert err.value.key == "num_hidden_layers"
    with pytest.raises(InputError):
        check_request(ReplayRequest(model=str(R.MODEL), dtype="float16"))
    assert check_request(ReplayRequest(model=str(R.MODEL), ref_model=str(R.REF_MODEL),
                                       layout={"tp": 2, "pp": 2})) == (2, 2, 1)


def test_registry_and_availability():
    from rlaudit.backends.registry import get_backend

    backend = get_backend("megatron")
    assert isinstance(backend, MegatronBackend)
    ok, why = backend.available()
    assert ok == HAVE_MEGATRON, why
