"""The reference sampler: layout, log-probs vs a full-sequence recompute, truncation, EOS,
seeding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.errors import InputError
from rlaudit.model.tiny import build_tiny_model
from rlaudit.rollout.sampler import draw, processed_log_probs, sample

PROMPTS = [[257, 49, 43, 50, 61], [257, 104], [257, 72, 105, 33, 32, 120, 121, 122]]


@pytest.fixture(scope="module")
def model64():
    return build_tiny_model("qwen2", seed=11, dtype=torch.float64)


@pytest.fixture
def fp64_softmax(monkeypatch):
    """Let HF's eager attention softmax run in float64 for float64 inputs.

    Stock HF computes it in float32, and a float32 sum over a row of different length (KV-cache
    step vs full sequence) rounds differently: ~6e-7 between the two paths in float64. With it in
    float64 the two paths agree to ~1e-14, so the sampler's own logic can be checked at 1e-10.
    """
    original = torch.nn.functional.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return original(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)


@pytest.fixture(scope="module")
def model32():
    return build_tiny_model("llama", seed=12)


def _full_logits(model, batch, i):
    """[R_i, V] logits predicting row i's response tokens, from one full-sequence forward."""
    p, r = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
    seq = torch.cat([batch["prompt_ids"][i, :p], batch["response_ids"][i, :r]])
    with torch.no_grad():
        logits = model(seq.unsqueeze(0)).logits[0]
    return logits[p - 1:p - 1 + r]


def _naive_processed(logits_row: list[float], temperature: float, top_k: int, top_p: float):
    """vLLM's processed log-probs for one position, as a Python loop (float64)."""
    x = [v / temperature for v in logits_row]
    order = sorted(range(len(x)), key=lambda j: -x[j])
    keep = set(order)
    if 0 < top_k < len(x):
        kth = x[order[top_k - 1]]
        keep = {j for j in keep if x[j] >= kth}
    if top_p < 1:
        kept_order = [j for j in order if j in keep]
        z = sum(math.exp(x[j]) for j in kept_order)
        mass, new_keep = 0.0, set()
        for j in kept_order:
            if mass < top_p or not new_keep:
                new_keep.add(j)
            mass += math.exp(x[j]) / z
        keep = new_keep
    z = math.log(sum(math.exp(x[j]) for j in keep))
    return [x[j] - z if j in keep else -math.inf for j in range(len(x))]


# ---- layout ------------------------------------------------------------------------------------
def test_layout(model32):
    batch = sample(model32, PROMPTS, n=3, max_new_tokens=7, seed=5, uid_offset=10)
    b = len(PROMPTS) * 3
    assert batch.batch_size == b and batch.response_width == 7 and batch.prompt_width == 8
    batch.validate()
    for r in range(b):
        prompt = PROMPTS[r // 3]
        assert batch["prompt_ids"][r, :len(prompt)].tolist() == prompt
        assert (batch["prompt_ids"][r, len(prompt):] == 256).all()
        assert int(batch["prompt_lengths"][r]) == len(prompt)
        n = int(batch["response_lengths"][r])
        assert batch["response_mask"][r].tolist() == [t < n for t in range(7)]
        assert (batch["response_ids"][r, n:] == 256).all()
        assert (batch["rollout_log_probs"][r, n:] == 0).all()
        assert (batch["rollout_log_probs"][r, :n] < 0).all()
    assert batch["uid"].tolist() == [10, 10, 10, 11, 11, 11, 12, 12, 12]
    assert batch["rollout_log_probs"].dtype == torch.float32
    assert batch.meta["engine"] == "reference"
    assert batch.meta["logprobs_mode"] == "processed_logprobs"
    assert batch.meta["sampling"] == dict(n=3, temperature=1.0, top_p=1.0, top_k=0,
                                          max_new_tokens=7, seed=5)


# ---- log-probs ---------------------------------------------------------------------------------
def _worst_recompute_error(model, batch, temperature):
    worst = 0.0
    for i in range(batch.batch_size):
        r = int(batch["response_lengths"][i])
        expected = torch.log_softmax(_full_logits(model, batch, i) / temperature, -1)
        expected = expected.gather(-1, batch["response_ids"][i, :r].unsqueeze(-1))[:, 0]
        worst = max(worst, float((expected - batch["rollout_log_probs"][i, :r]).abs().max()))
    return worst


def test_log_probs_equal_full_sequence_recompute_float64(model64, fp64_softmax):
    batch = sample(model64, PROMPTS, n=2, max_new_tokens=10, temperature=0.7, seed=3)
    assert batch["rollout_log_probs"].dtype == torch.float64
    assert _worst_recompute_error(model64, batch, 0.7) < 1e-10


def test_log_probs_vs_recompute_with_stock_hf_softmax(model64):
    """Stock HF: the float32 softmax leaves ~6e-7 between KV-cache and full-sequence paths."""
    batch = sample(model64, PROMPTS, n=2, max_new_tokens=10, temperature=0.7, seed=3)
    assert _worst_recompute_error(model64, batch, 0.7) < 1e-5


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (20, 0.6)])
def test_truncated_log_probs_match_a_naive_loop(model64, fp64_softmax, top_k, top_p):
    batch = sample(model64, PROMPTS[:2], n=2, max_new_tokens=6, temperature=1.3, top_k=top_k,
                   top_p=top_p, seed=9)
    for i in range(batch.batch_size):
        logits = _full_logits(model64, batch, i)
        for t in range(int(batch["response_lengths"][i])):
            naive = _naive_processed(logits[t].tolist(), 1.3, top_k, top_p)
            tok = int(batch["response_ids"][i, t])
            assert naive[tok] > -math.inf  # never a truncated-away token
            assert abs(naive[tok] - float(batch["rollout_log_probs"][i, t])) < 1e-10


def test_top_k_one_is_greedy(model64):
    batch = sample(model64, PROMPTS, n=2, max_new_tokens=6, top_k=1, seed=0)
    for i in range(batch.batch_size):
        r = int(batch["response_lengths"][i])
        argmax = _full_logits(model64, batch, i).argmax(-1)
        assert batch["response_ids"][i, :r].tolist() == argmax.tolist()
        assert (batch["rollout_log_probs"][i, :r] == 0).all()  # one kept token: log 1
    # rows of a prompt are identical
    assert torch.equal(batch["response_ids"][0], batch["response_ids"][1])


def test_temperature_zero_is_greedy_with_raw_log_probs(model64, fp64_softmax):
    batch = sample(model64, PROMPTS[:1], max_new_tokens=5, temperature=0.0)
    logits = _full_logits(model64, batch, 0)
    assert batch["response_ids"][0].tolist() == logits.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1).max(-1).values
    assert (raw - batch["rollout_log_probs"][0]).abs().max() < 1e-10


# ---- EOS ---------------------------------------------------------------------------------------
def test_eos_stops_and_is_included(model64):
    greedy = sample(model64, PROMPTS, top_k=1, max_new_tokens=4)
    # make the 3rd greedy token of prompt 0 the "EOS": its row stops there, EOS included
    eos = int(greedy["response_ids"][0, 2])
    batch = sample(model64, PROMPTS, top_k=1, max_new_tokens=4, eos_token_id=eos)
    first = greedy["response_ids"][0].tolist().index(eos)
    assert int(batch["response_lengths"][0]) == first + 1
    assert int(batch["response_ids"][0, first]) == eos
    assert batch["response_mask"][0].tolist() == [t <= first for t in range(4)]
    assert batch.meta["eos_token_id"] == eos


def test_eos_invariants_under_sampling(model32):
    eos = 101  # a byte id, so that some rows stop
    batch = sample(model32, PROMPTS, n=8, max_new_tokens=12, seed=2, eos_token_id=eos)
    lengths = batch["response_lengths"].tolist()
    assert any(n < 12 for n in lengths)
    for i, n in enumerate(lengths):
        resp = batch["response_ids"][i, :n].tolist()
        assert eos not in resp[:-1]
        assert n == 12 or resp[-1] == eos


# ---- seeding -----------------------------------------------------------------------------------
def test_same_seed_same_batch_and_global_rng_irrelevant(model32):
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = sample(model32, PROMPTS, n=2, max_new_tokens=8, seed=4)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not used
    torch.manual_seed(999)
    b = sample(model32, PROMPTS, n=2, max_new_tokens=8, seed=4)
    c = sample(model32, PROMPTS, n=2, max_new_tokens=8, seed=5)
    for key in a.keys():
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["response_ids"], c["response_ids"])
    assert not torch.equal(a["response_ids"][0], a["response_ids"][1])  # rows differ


def test_inputs_not_modified(model32):
    prompts = [list(p) for p in PROMPTS]
    before = {k: v.clone() for k, v in model32.state_dict().items()}
    sample(model32, prompts, n=2, max_new_tokens=3)
    assert prompts == PROMPTS
    assert all(torch.equal(before[k], v) for k, v in model32.state_dict().items())


@pytest.mark.parametrize("kwargs, key", [
    (dict(prompt_ids=[]), "prompt_ids"), (dict(prompt_ids=[[257], []]), r"prompt_ids\[1\]"),
    (dict(prompt_ids=[[264]]), r"prompt_ids\[0\]"), (dict(prompt_ids="abc"), "prompt_ids"),
    (dict(n=0), "n"), (dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=600), "max_new_tokens"),
])
def test_bad_arguments(model32, kwargs, key):
    args = dict(prompt_ids=[[257, 1]]) | kwargs
    with pytest.raises(InputError, match=key):
        sample(model32, **args)


# ---- the pieces --------------------------------------------------------------------------------
@given(st.lists(st.integers(-40, 40), min_size=2, max_size=12, unique=True),
       st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 13), st.sampled_from([0.3, 0.7, 0.95, 1.0]))
def test_processed_log_probs_vs_naive(values, temperature, top_k, top_p):
    logits = torch.tensor([values], dtype=torch.float64) / 8
    got = processed_log_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)[0]
    naive = _naive_processed((logits[0]).tolist(), temperature, top_k, top_p)
    for g, e in zip(got.tolist(), naive):
        assert (g == e == -math.inf) or abs(g - e) < 1e-12
    assert logits.dtype == torch.float64  # input untouched, output is a new tensor


def test_draw_frequencies_and_zero_probability():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = [0] * 4
    draws = 4000
    for _ in range(draws):
        counts[draw(probs.log(), gen)] += 1
    assert counts[1] == 0
    for c, p in zip(counts, probs.tolist()):
        # 5 standard deviations of a binomial count
        assert abs(c - draws * p) <= 5 * math.sqrt(draws * p * (1 - p)) + 1e-9
