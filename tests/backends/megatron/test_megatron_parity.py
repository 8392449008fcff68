"""megatron-core on CPU/gloo vs the HF model: logits, log-probs, grads, weights, an optimizer step.

Two spawned groups run every check once (spawning costs seconds), see megatron_ranks.py:
a 2-rank group running the layouts TP=2, PP=2 and TP=1 (DP=2) one after the other, and a 4-rank
group running TP=2 x PP=2. Tests below only read their results. Tolerances:

- fp32 logits: |logit| <= ~10, and the two implementations round differently over two layers;
  measured 0.9e-5..1.8e-5 abs, bound 1e-4. The negative controls (wrong rotary base, [q; k; v]
  concatenated instead of interleaved per group) miss by > 3, so the bound cannot hide them.
- fp64 (HF with its float32 islands removed): measured ~3e-14, bound 1e-11.
- vocab-parallel log-prob/entropy and their gradients, fp64: measured ~5e-15, bound 1e-12.
"""

from __future__ import annotations

import importlib.util

import pytest

import megatron_ranks as ranks

pytestmark = [
    pytest.mark.slow, pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (pip install rlaudit[megatron])"),
]

FP32_ATOL = 1e-4
FP64_ATOL = 1e-11
VP_ATOL = 1e-12
CONTROL_MIN = 0.1      # a broken layout must miss by far more than FP32_ATOL
GRAD_ATOL = 2e-5       # fp32 gradients of magnitude ~1 (measured ~2e-6)
SGD_ATOL = 1e-5        # params after an SGD step that moves them by up to ~0.2 (measured 5e-7)
ADAM_ATOL = 1e-6       # params after an Adam step of ~1e-3, where |grad| > 1e-3 (measured 1.5e-8)
GRAD_NORM_RTOL = 1e-5  # megatron's reported pre-clip grad norm vs torch's (measured 4e-7)
LAUNCH_TIMEOUT_S = 600.0

PARITY_LAYOUTS = ["tp2_pp1", "tp1_pp1"]
PIPELINE_LAYOUTS = [("world2", "tp1_pp2"), ("world4", "tp2_pp2")]
VARIANTS = [ranks.variant_name(a, o) for a, o in ranks.MODEL_VARIANTS]


@pytest.fixture(scope="module")
def world2():
    from rlaudit.backends.launch.pool import run_ranks

    # the session's warm megatron pool, shared with the backend tests (layout_checks sets up and
    # tears down each layout, and counts the CPU redirects of its own run only)
    return run_ranks(ranks.layout_checks, 2, pool="megatron", args=([(2, 1), (1, 2), (1, 1)],),
                     timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def world4():
    from rlaudit.backends.launch import launch

    return launch(ranks.layout_checks, 4, args=([(2, 2)],), timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture
def results(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("layout", PARITY_LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf_on_non_pad_positions(world2, layout, variant):
    for rank_result in world2:
        res = rank_result[layout][variant]
        assert res["fp32"] < FP32_ATOL, res
        assert res["fp64"] < FP64_ATOL, res
        assert res["ref_absmax"] > 1.0  # the comparison is not between near-zero logits
        assert res["runtime_gather_equal"]  # megatron's gather (parallel_output=False) agrees


@pytest.mark.parametrize("variant", VARIANTS)
def test_vocab_parallel_logprobs_entropy_and_grads_match_full_vocab(world2, variant):
    for rank_result in world2:
        for layout in PARITY_LAYOUTS:
            vp = rank_result[layout][variant]["vp"]
            for key in ("logp", "entropy", "log_probs_at", "grad"):
                assert vp[key] < VP_ATOL, (layout, key, vp)
            assert vp["grad_scale"] > 0.1  # gradients are not trivially zero
            assert vp["input_unchanged"] and not vp["aliases_input"]
        assert rank_result["tp2_pp1"]["all_padding_shard"] < VP_ATOL


def test_padded_vocab_columns_are_zero_and_excluded(world2):
    for rank_result in world2:
        res = rank_result["tp2_pp1"]["qwen2_vocab_size=265"]
        assert res["local_width"] == 133  # 265 padded to 266, split in two
        assert res["padding_columns_zero"]


def test_negative_controls_are_caught_by_the_parity_check(world2):
    for rank_result in world2:
        for arch in ("qwen2", "llama"):
            controls = rank_result["tp2_pp1"][arch]["controls"]
            assert controls["wrong_rotary_base"] > CONTROL_MIN, controls
            assert controls["naive_qkv_concat"] > CONTROL_MIN, controls


@pytest.mark.parametrize("layout", PARITY_LAYOUTS)
def test_gathered_weights_equal_the_hf_weights_exactly(world2, layout):
    for rank_result in world2:
        for variant in VARIANTS:
            assert rank_result[layout][variant]["round_trip_exact"], variant


@pytest.mark.parametrize("kind,atol", [("sgd", SGD_ATOL), ("adam", ADAM_ATOL)])
def test_one_optimizer_step_matches_torch_after_gathering_to_hf_names(world2, kind, atol):
    for rank_result in world2:
        res = rank_result["tp2_pp1"][kind]
        assert res["step_ok"]
        assert res["grad_norm"] < GRAD_NORM_RTOL, res
        assert res["params"] < atol, res
        assert res["param_change"] > 100 * atol  # the step did move the parameters


@pytest.mark.parametrize("results,layout", PIPELINE_LAYOUTS, indirect=["results"])
def test_pipeline_forward_and_backward_match_hf(results, layout):
    last_stages = 0
    for rank_result in results:
        res = rank_result[layout]
        for arch in ("qwen2", "llama"):
            r = res[arch]
            if res["last"]:
                assert r["fp32"] < FP32_ATOL and r["logp"] < FP32_ATOL, r
            else:
                assert tuple(r["outputs_on_other_stage"]) == (None, None)
            assert r["grads"] < GRAD_ATOL and r["grad_scale"] > 0.1, r
            assert r["round_trip_exact"]
        last_stages += res["last"]
    assert last_stages == len(results) // 2


@pytest.mark.parametrize("results", ["world2", "world4"], indirect=True)
def test_cpu_patches_are_applied_once_and_rng_streams_are_megatrons(results):
    for rank_result in results:
        for layout, res in rank_result.items():
            if layout in ("seconds", "redirects"):
                continue
            patches = res["patches"]
            assert patches and len(patches) == len(set(patches))  # idempotent: no duplicates
            assert res["rng"] == {"tp_stream": True, "outer_restored": True}


def test_every_torch_view_patch_is_exercised(world2):
    from rlaudit.backends.megatron.compat import _TORCH_VIEW_MODULES

    for rank_result in world2:  # TP, PP, DDP and both optimizers ran: each view redirected calls
        assert set(rank_result["redirects"]) == set(_TORCH_VIEW_MODULES), rank_result["redirects"]
