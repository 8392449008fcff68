"""The forward-only memo (rlaudit/update/forward_memo.py): a repeated pass is answered with the same
bits; anything a forward reads that changes makes it recompute; a pass that draws random numbers
is never stored; ranks always agree; and whole backend replays (FSDP dp=2, Megatron tp=2, with a
fault aimed at one variant) give the same results bit for bit with the memo on and off.

The expected values are always a fresh computation with nothing memoised (outside any scope).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types

import pytest
import torch

from rlaudit import switches
from rlaudit.backends.base import ReplayRequest, Variant
from rlaudit.backends.reference import torch_roles
from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.errors import InputError
from rlaudit.update import forward_memo
from rlaudit.update.actor import compute_log_probs

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "scenarios")
MODEL = os.path.abspath(os.path.join(ROOT, "models", "qwen2-tiny-short"))
REF_MODEL = os.path.abspath(os.path.join(ROOT, "models", "qwen2-tiny"))
ROLLOUT = os.path.abspath(os.path.join(ROOT, "rollouts", "short-ref.safetensors"))


def _cfg(**actor):
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                                  "use_kl_loss": True, "kl_loss_type": "kl",
                                  "optim": {"name": "sgd", "lr": 0.05}, **actor},
                        "trainer": {"dtype": "float64"}})


@pytest.fixture(scope="module")
def batch():
    return load_rollout(ROLLOUT)


def _actor(batch):
    return torch_roles(MODEL, Variant("v", _cfg(), batch, steps=1), dtype="float64",
                       device="cpu").actor


def _counts():
    return dict(forward_memo.stats)


def _delta(before):
    return {k: forward_memo.stats[k] - before[k] for k in before}


def _fresh(ctx, batch, cfg, **kw):
    """The pass computed now, outside any memo."""
    return compute_log_probs(ctx, batch, cfg, **kw)


def test_a_repeated_pass_is_answered_with_the_same_bits(batch):
    ctx, cfg = _actor(batch), _cfg()
    want = _fresh(ctx, batch, cfg, calc_entropy=True)
    before = _counts()
    with forward_memo.scope("cpu"):
        first = compute_log_probs(ctx, batch, cfg, calc_entropy=True)
        first[0].add_(1.0)  # a caller that changes what it got does not change the memo
        second = compute_log_probs(ctx, batch, cfg, calc_entropy=True)
        second_copy = [t.clone() for t in second]
        second[1].add_(1.0)  # nor one that changes an answer from the memo
        third = compute_log_probs(ctx, batch, cfg, calc_entropy=True)
    assert _delta(before) == {"hits": 2, "misses": 1, "not_stored": 0}
    for got in (second_copy, third):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # outside a scope nothing is memoised
    before = _counts()
    _fresh(ctx, batch, cfg, calc_entropy=True)
    assert _delta(before) == {"hits": 0, "misses": 0, "not_stored": 0}


def _bump_param(ctx, batch, cfg):
    with torch.no_grad():
        ctx.model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3


def _bump_buffer(ctx, batch, cfg):
    ctx.model.model.rotary_emb.inv_freq.mul_(1.01)


def _eps(ctx, batch, cfg):
    ctx.model.model.layers[1].input_layernorm.variance_epsilon = 1e-2


def _scaling(ctx, batch, cfg):
    ctx.model.model.layers[0].self_attn.scaling *= 1.25


def _config(ctx, batch, cfg):
    ctx.model.config.rms_norm_eps = 0.5  # a config value (read or not, it is in the key)


def _hook(ctx, batch, cfg):
    ctx.model.model.norm.register_forward_hook(lambda module, args, out: out * 1.5)


def _tensor_attribute(ctx, batch, cfg):
    # a tensor the forward reads that is neither a parameter nor a buffer (megatron keeps its
    # rotary inv_freq so): set before the first pass, changed in place after it
    ctx.model.model.norm.scale.mul_(1.5)


def _factor_hook(factor):
    return lambda module, args, out: out * factor


def _scale(module, args, out, factor):
    return out * factor


def _closure_value(ctx, batch, cfg):  # the same hook function, another captured value
    mlp = ctx.model.model.layers[0].mlp
    mlp._forward_hooks.clear()
    mlp.register_forward_hook(_factor_hook(1.5))


def _partial_value(ctx, batch, cfg):
    mlp = ctx.model.model.layers[1].mlp
    mlp._forward_hooks.clear()
    mlp.register_forward_hook(functools.partial(_scale, factor=1.5))


def _instance_forward(ctx, batch, cfg):  # what rlaudit/model/exact.py does to each RMSNorm
    norm = ctx.model.model.layers[0].post_attention_layernorm
    plain = type(norm).forward
    norm.forward = types.MethodType(lambda self, x: plain(self, x) * 1.5, norm)


def _global_hook(ctx, batch, cfg):
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out * 1.5 if module is ctx.model.model.norm else out)
    _CLEANUP.append(handle.remove)


def _matmul_precision(ctx, batch, cfg):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    _CLEANUP.append(lambda: torch.set_float32_matmul_precision(before))


def _train_mode(ctx, batch, cfg):
    ctx.model.train()


def _pad_id(ctx, batch, cfg):
    ctx.pad_id = 1


def _token(ctx, batch, cfg):
    ids = batch["response_ids"].clone()
    ids[0, 0] = (ids[0, 0] + 1) % 16
    return batch.with_fields(response_ids=ids), cfg


def _micro(ctx, batch, cfg):
    return batch, _cfg(ppo_micro_batch_size_per_gpu=1)


def _threads(ctx, batch, cfg):
    torch.set_num_threads(torch.get_num_threads() + 1)


def _config_tensor(ctx, batch, cfg):  # prints like the value set up below (4 decimals)
    ctx.model.config.memo_probe = torch.tensor(2.00004, dtype=torch.float64)


@dataclasses.dataclass
class _ActConfig:  # a dataclass config holding a function, as megatron's TransformerConfig does
    act: object


def _dataclass_closure(ctx, batch, cfg):  # the same function, another value it closes over
    ctx.model.model.norm.act_config = _ActConfig(_factor_hook(1.5))


def _colliding_name(ctx, batch, cfg):  # module "s", tensor "t|w" -- beside module "s|t", "w"
    with torch.no_grad():
        ctx.model.s.get_parameter("t|w").mul_(0.5)


_CLEANUP: list = []  # process-wide changes a case makes, undone after it


#: (what changes, whether the log-probs must change with it)
CHANGES = {"parameter": (_bump_param, True), "buffer": (_bump_buffer, True),
           "rmsnorm epsilon": (_eps, True), "attention scaling": (_scaling, True),
           "config": (_config, False), "forward hook": (_hook, True),
           "tensor attribute": (_tensor_attribute, True),
           "value a hook closes over": (_closure_value, True),
           "a hook partial's argument": (_partial_value, True),
           "instance forward": (_instance_forward, True), "global hook": (_global_hook, True),
           "float32 matmul precision": (_matmul_precision, False),
           "train mode": (_train_mode, False), "context pad id": (_pad_id, False),
           "one token": (_token, True), "micro-batch size": (_micro, False),
           "thread count": (_threads, False), "a config's tensor": (_config_tensor, False),
           "a dataclass config's closure": (_dataclass_closure, False),
           "tensors whose names could run together": (_colliding_name, False)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_whatever_a_forward_reads_is_in_the_key(change, batch):
    fn, changes_output = CHANGES[change]
    ctx, cfg = _actor(batch), _cfg()
    norm = ctx.model.model.norm
    norm.scale = torch.ones((), dtype=torch.float64)  # read by the hook, for "tensor attribute"
    norm.register_forward_hook(lambda module, args, out: out * module.scale)
    ctx.model.model.layers[0].mlp.register_forward_hook(_factor_hook(1.0))
    ctx.model.model.layers[1].mlp.register_forward_hook(functools.partial(_scale, factor=1.0))
    ctx.model.config.memo_probe = torch.tensor(2.00001, dtype=torch.float64)
    ctx.model.model.norm.act_config = _ActConfig(_factor_hook(1.0))
    for name, tensor in (("s", "t|w"), ("s|t", "w")):
        holder = torch.nn.Module()
        holder.register_parameter(tensor, torch.nn.Parameter(torch.ones(2, dtype=torch.float64)))
        ctx.model.add_module(name, holder)
    threads = torch.get_num_threads()
    try:
        with forward_memo.scope("cpu"):
            original = compute_log_probs(ctx, batch, cfg)
            changed = fn(ctx, batch, cfg)
            b2, cfg2 = changed if changed is not None else (batch, cfg)
            before = _counts()
            got = compute_log_probs(ctx, b2, cfg2)
            assert _delta(before)["hits"] == 0, f"a {change} change was answered from the memo"
        want = _fresh(ctx, b2, cfg2)
    finally:
        torch.set_num_threads(threads)
        while _CLEANUP:
            _CLEANUP.pop()()
    assert torch.equal(got[0], want[0])
    if changes_output:  # the change is one the answer depends on: the test can see a stale hit
        assert not torch.equal(want[0], original[0])


@pytest.mark.parametrize("what", ["an object in the config", "a quantized buffer"])
def test_what_has_no_digest_is_computed_every_time(what, batch):
    """An object known only by how it prints (its address may be a freed object's) or a
    quantized tensor (its bytes leave out scale and zero point): never answered from the memo."""
    ctx, cfg = _actor(batch), _cfg()
    if what == "an object in the config":
        ctx.model.config.thing = object()
    else:
        q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, torch.qint8)
        ctx.model.model.norm.register_buffer("q", q)
    with forward_memo.scope("cpu"):
        first = compute_log_probs(ctx, batch, cfg)
        before = _counts()
        again = compute_log_probs(ctx, batch, cfg)
        assert _delta(before)["hits"] == 0
    assert torch.equal(first[0], again[0])


def test_a_pass_that_draws_random_numbers_is_never_stored(batch):
    ctx, cfg = _actor(batch), _cfg()
    ctx.model.model.norm.register_forward_hook(
        lambda module, args, out: out + 1e-3 * torch.rand_like(out))
    before = _counts()
    with forward_memo.scope("cpu"):
        torch.manual_seed(1)
        a = compute_log_probs(ctx, batch, cfg)
        b = compute_log_probs(ctx, batch, cfg)
    assert _delta(before) == {"hits": 0, "misses": 0, "not_stored": 2}
    torch.manual_seed(1)
    want_a, want_b = _fresh(ctx, batch, cfg), _fresh(ctx, batch, cfg)
    assert torch.equal(a[0], want_a[0]) and torch.equal(b[0], want_b[0])
    assert not torch.equal(a[0], b[0])


def _tracked_noise(module, args, out):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork("memo-test"):
        return out + 1e-3 * torch.rand_like(out)


def test_a_pass_drawing_from_megatrons_rng_tracker_is_never_stored(batch):
    """Dropout inside megatron's tensor-parallel regions draws from its RNG tracker, whose fork
    (CPU patch) restores the default generator afterwards: the pass must still count as random."""
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from rlaudit.backends.megatron import compat

    compat.apply_cpu_patches()
    tracker = get_cuda_rng_tracker()
    saved = (dict(tracker.states_), set(tracker.seeds_))
    tracker.reset()
    tracker.add("memo-test", 7)

    ctx, cfg = _actor(batch), _cfg()
    ctx.model.model.norm.register_forward_hook(_tracked_noise)
    try:
        before = _counts()
        with forward_memo.scope("cpu"):
            default = torch.get_rng_state()
            a = compute_log_probs(ctx, batch, cfg)
            assert torch.equal(torch.get_rng_state(), default)  # the tracker hid the draws
            b = compute_log_probs(ctx, batch, cfg)
        assert _delta(before) == {"hits": 0, "misses": 0, "not_stored": 2}
        assert not torch.equal(a[0], b[0])
    finally:
        tracker.reset()
        tracker.states_.update(saved[0])
        tracker.seeds_.update(saved[1])


def test_scopes_that_do_not_memoise(batch, monkeypatch):
    ctx, cfg = _actor(batch), _cfg()
    for scope in (forward_memo.scope("cpu", enabled=False), forward_memo.scope("cuda")):
        before = _counts()
        with scope:
            compute_log_probs(ctx, batch, cfg)
            compute_log_probs(ctx, batch, cfg)
        assert _delta(before) == {"hits": 0, "misses": 0, "not_stored": 0}
    before = _counts()
    with forward_memo.scope("cpu"):
        compute_log_probs(ctx, batch, cfg)
        with forward_memo.paused():  # the drift localisation's probe re-runs
            compute_log_probs(ctx, batch, cfg)
    assert _delta(before) == {"hits": 0, "misses": 1, "not_stored": 0}
    # $RLAUDIT_FORWARD_MEMO, taken when a request is made
    assert ReplayRequest(model=MODEL).forward_memo is True
    monkeypatch.setenv(switches.FORWARD_MEMO, "0")
    assert ReplayRequest(model=MODEL).forward_memo is False
    monkeypatch.setenv(switches.FORWARD_MEMO, "off")
    with pytest.raises(InputError, match="RLAUDIT_FORWARD_MEMO.*expected 0 .off. or 1 .on."):
        ReplayRequest(model=MODEL)


# ---- two ranks ----------------------------------------------------------------------------------

#: (label, rank 0's change, rank 1's change, rank 0 draws random numbers): one weight of each
#: rank's replica moved by that much; what each pass must be answered by, below
SEQUENCE = [("first", 0, 0, False), ("again", 0, 0, False), ("rank 1 changed", 0, 1e-3, False),
            ("rank 1 restored", 0, 0, False), ("both changed", 1e-3, 2e-3, False),
            ("mixed", 0, 2e-3, False), ("rank 0 draws", 0, 0, True),
            ("rank 0 draws again", 0, 0, True), ("rank 0 stopped drawing", 0, 0, False)]
#: hits (either rank): "mixed" pairs rank 0's replica of "first" with rank 1's of "both changed",
#: a combination never computed; after "rank 0 draws" only rank 1 holds that pass
ANSWERED = {"again", "rank 1 restored", "rank 0 stopped drawing"}


def _two_ranks(info):
    """A data-parallel context on each rank (plain module, rows split over the ranks): the
    SEQUENCE with the memo, then each state again with nothing memoised."""
    batch = load_rollout(ROLLOUT)
    cfg = _cfg()
    ctx = torch_roles(MODEL, Variant("v", cfg, batch, steps=1), dtype="float64", device="cpu",
                      distributed=True).actor
    weight = ctx.model.model.layers[0].mlp.up_proj.weight
    original = weight[0, 0].item()

    def pass_at(change, draws):
        with torch.no_grad():
            weight[0, 0] = original + change
        handle = None
        if draws:  # output unchanged, generator advanced
            handle = ctx.model.model.norm.register_forward_hook(
                lambda module, args, out: out + 0.0 * torch.rand_like(out))
        try:
            return compute_log_probs(ctx, batch, cfg)[0]
        finally:
            if handle is not None:
                handle.remove()

    seen = {}
    with forward_memo.scope("cpu"):
        for label, d0, d1, draw0 in SEQUENCE:
            before = _counts()
            got = pass_at(d0 if info.rank == 0 else d1, draw0 and info.rank == 0)
            seen[label] = (_delta(before), got)
    fresh = {label: pass_at(d0 if info.rank == 0 else d1, False)
             for label, d0, d1, draw0 in SEQUENCE}
    return {"seen": seen, "fresh": fresh}


@pytest.mark.slow
def test_ranks_agree_on_every_answer():
    from rlaudit.backends.launch import launch

    outs = launch(_two_ranks, 2, timeout=120)
    for label, *_ in SEQUENCE:
        hits = [o["seen"][label][0]["hits"] for o in outs]
        assert hits == ([1, 1] if label in ANSWERED else [0, 0]), label
        for o in outs:
            assert torch.equal(o["seen"][label][1], o["fresh"][label]), label
    not_stored = [[o["seen"][label][0]["not_stored"] for o in outs]
                  for label in ("rank 0 draws", "rank 0 draws again")]
    assert not_stored == [[1, 0], [1, 0]]
    # the changes show in the answers (both ranks get every row)
    fresh = outs[0]["fresh"]
    assert not torch.equal(fresh["mixed"], fresh["first"])
    assert not torch.equal(fresh["mixed"], fresh["both changed"])


# ---- whole replays, memo on and off -------------------------------------------------------------

def _replays(info, requests, backend):
    """Each request's replay in this rank group, with the memo's counts for it."""
    if backend == "fsdp":
        from rlaudit.backends.fsdp import _rank_main as replay
    else:
        from rlaudit.backends.megatron.backend import replay_in_rank as replay
    out = []
    for req in requests:
        before = _counts()
        out.append((replay(info, req), _delta(before)))
    return out


def _variants(batch):
    from rlaudit.scenarios.variants import build_variants
    from rlaudit.scenarios.spec import load_scenario

    scn = load_scenario(os.path.join(ROOT, "kl_k1.yaml"))
    keep = ("base", "kl-in-reward", "cfg:kl0", "microbatch:1")
    return [v for v in build_variants(scn, batch) if v.name in keep]


def _same_run(a, b) -> list[str]:
    diffs = []
    untimed = [[{k: v for k, v in s.items() if not k.startswith("timing/")} for s in r.steps]
               for r in (a, b)]
    if untimed[0] != untimed[1]:
        diffs.append("metrics")
    if a.tokens.keys() != b.tokens.keys() or not all(torch.equal(a.tokens[k], b.tokens[k])
                                                     for k in a.tokens):
        diffs.append("tokens")
    if len(a.params) != len(b.params) or not all(map(torch.equal, a.params, b.params)):
        diffs.append("params")
    for f in ("param_norms", "micro_log", "info", "inputs_unchanged", "param_names"):
        if getattr(a, f) != getattr(b, f):
            diffs.append(f)
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize("backend,layout,fault", [
    ("fsdp", {"dp": 2}, "fsdp/kl-in-reward:rmsnorm_eps:layer=1,eps=1e-2"),
    ("megatron", {"tp": 2}, "megatron/kl-in-reward:softmax_scale:layer=0,factor=1.25"),
])
def test_replays_are_the_same_with_the_memo_on_and_off(backend, layout, fault, batch):
    """A fault aimed at one variant changes only that variant's forwards (a module attribute, not
    a weight): the memo must not answer them from the other variants' passes."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    from rlaudit.backends.launch.pool import run_ranks

    variants = _variants(batch)
    base = ReplayRequest(model=MODEL, ref_model=REF_MODEL, variants=variants, layout=layout,
                         dtype="float64", timeout=600, faults=fault, forward_memo=True)
    requests = [base, dataclasses.replace(base, forward_memo=False)]
    per_rank = run_ranks(_replays, 2, pool=backend, args=(requests, backend), timeout=600)
    (on, on_counts), (off, off_counts) = per_rank[0]
    assert off_counts == {"hits": 0, "misses": 0, "not_stored": 0}
    # by hand: base computes its probe, old and ref log-probs at step 0, old at step 1 and has
    # ref at step 1 (the reference policy does not train); kl-in-reward (the fault's) computes
    # all of its own; cfg:kl0 has its probe, step-0 old and ref from base; microbatch:1 (other
    # micro-batches) computes all but its step-1 ref: 1 + 0 + 3 + 1 answered from the memo
    assert on_counts["hits"] == 5, on_counts
    for v in variants:
        assert _same_run(on[v.name], off[v.name]) == [], v.name
    # the fault really changed its variant's forward-only passes (else this proves nothing)
    assert not torch.equal(on["kl-in-reward"].tokens["probe_log_probs"],
                           on["base"].tokens["probe_log_probs"])


def _mixed_precision_roles(info):
    """One FSDP2 rank: the same weights wrapped with a bf16 compute policy and without one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    batch, cfg = load_rollout(ROLLOUT), _cfg()

    def wrap_with(policy):
        def wrap(model):
            kw = {"mesh": mesh} | ({"mp_policy": policy} if policy else {})
            for layer in model.model.layers:
                fully_shard(layer, **kw)
            return fully_shard(model, **kw)
        return wrap

    def roles(policy):
        return torch_roles(MODEL, Variant("v", cfg, batch, steps=1), dtype="float32",
                           device="cpu", wrap=wrap_with(policy), distributed=True).actor

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed, full = roles(bf16), roles(None)
    with forward_memo.scope("cpu"):
        compute_log_probs(mixed, batch, cfg)
        before = _counts()
        got = compute_log_probs(full, batch, cfg)[0]
        hits = _delta(before)["hits"]
    return {"hits": hits, "got": got, "fresh": compute_log_probs(full, batch, cfg)[0],
            "mixed": compute_log_probs(mixed, batch, cfg)[0]}


@pytest.mark.slow
def test_an_fsdp_mixed_precision_policy_is_in_the_key():
    """FSDP2 keeps the policy in its per-module state, read by its forward hooks: a model
    wrapped without it must not be answered by the bf16 one's pass (same weights)."""
    from rlaudit.backends.launch import launch

    (out,) = launch(_mixed_precision_roles, 1, timeout=300)
    assert out["hits"] == 0
    assert torch.equal(out["got"], out["fresh"])
    assert not torch.equal(out["fresh"], out["mixed"])
