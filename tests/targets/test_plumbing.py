"""The pieces under the checks: the mutation/aliasing guard, the deterministic cases, the
built-in adapters' wiring."""

from __future__ import annotations

import pytest
import torch

from rlaudit.targets.inputs.cases import default_cases, fixed_permutation, split_rows, with_garbage
from rlaudit.targets.contract.guard import AdapterRaised, Guard


def test_guard_sees_in_place_writes_even_of_equal_values():
    g = Guard()
    x = torch.ones(3)
    out, given = g.call("s", lambda *, x: x.mul_(1.0).sum(), x=x)
    assert torch.equal(x, torch.ones(3)) and given["x"] is not x      # the caller's copy is safe
    assert g.problems["s"] == ["input ['x'] modified in place"]


def test_guard_sees_aliasing_with_inputs_and_between_outputs():
    g = Guard()
    g.call("view", lambda *, x: x[:, :1], x=torch.zeros(2, 3))
    g.call("twice", lambda *, x: (x * 2, ) * 2, x=torch.zeros(2, 3))
    g.call("fresh", lambda *, x: (x * 2, x + 1), x=torch.zeros(2, 3))
    g.call("scalars", lambda *, x: dict(zip("ab", torch.stack([x.sum(), x.mean()]))),
           x=torch.zeros(2, 3))
    assert "shares storage with input" in g.problems["view"][0]
    assert not g.problems["twice"] and "share storage" in g.notes["twice"][0]   # a note only
    assert not g.problems["fresh"] and not g.problems["scalars"]
    assert not g.notes["fresh"] and not g.notes["scalars"]
    assert g.calls == {"view": 1, "twice": 1, "fresh": 1, "scalars": 1}


def test_guard_allows_views_for_microbatches_and_wraps_errors():
    g = Guard()
    g.call("make_microbatches", lambda x, **_: [[x[:1]]], torch.zeros(2, 3))
    assert not g.problems["make_microbatches"]
    with pytest.raises(AdapterRaised, match="s raised ZeroDivisionError"):
        g.call("s", lambda: 1 / 0)
    with pytest.raises(NotImplementedError):
        g.call("s", lambda: (_ for _ in ()).throw(NotImplementedError("no")))


def test_cases_cover_the_edge_cases():
    cases = {c.name: c for c in default_cases()}
    ragged = cases["ragged"]
    lengths = ragged["response_lengths"].tolist()
    assert 0 in lengths and 1 in lengths and ragged.shape[1] in lengths
    uid = ragged["uid"].tolist()
    assert min(uid) < 0 and max(uid) > 2**32 and uid.count(-5) == 1            # a singleton
    firsts = [uid.index(u) for u in set(uid)]
    assert any(uid[i:i + uid.count(uid[i])] != [uid[i]] * uid.count(uid[i]) for i in firsts)
    m = ragged.mask
    assert bool(((~m) & (torch.arange(m.shape[1]) < ragged["response_lengths"].unsqueeze(1)))
                .any())                                                         # holes
    assert bool((~m.any(-1) & (ragged["response_lengths"] > 0)).any())        # all-masked row
    for c in cases.values():
        for name in ("advantages", "log_probs", "token_level_rewards"):
            assert bool((c[name][~c.mask] == 0).all())                        # clean under mask
        g = with_garbage(c)
        assert torch.equal(g["advantages"][c.mask], c["advantages"][c.mask])
        assert bool((g["advantages"][~c.mask] != 0).all())
    ratios = (ragged["log_probs"] - ragged["old_log_probs"])[m].exp()
    assert bool(((ratios > 1.2) & (ratios < 1.28)).any()) and bool((ratios > 3).any())


def test_split_rows_and_permutation():
    for n in range(1, 12):
        parts = split_rows(n)
        assert torch.equal(torch.cat(parts), torch.arange(n)) and all(len(p) for p in parts)
        perm = fixed_permutation(n)
        assert sorted(perm.tolist()) == list(range(n))
        assert n == 1 or not torch.equal(perm, torch.arange(n))


def test_backend_adapters_name_their_backend():
    from rlaudit.targets.contract.own_adapters import BackendAdapter, FSDPAdapter, MegatronAdapter
    assert FSDPAdapter().name == "fsdp" and FSDPAdapter().layout == {"dp": 2}
    assert MegatronAdapter().name == "megatron"
    assert BackendAdapter("megatron", {"tp": 1}).layout == {"tp": 1}
    from rlaudit.errors import InputError
    with pytest.raises(InputError, match="unknown backend"):
        BackendAdapter("nope").available()
