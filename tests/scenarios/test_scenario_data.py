"""What the edited rollouts of scenarios/rollouts/make_masked_rows.py give the scenarios that use
them -- the data a bug needs in order to change a result (a blind audit found both holes):

- a seq-mean scenario sharded over data-parallel ranks must hand them different counts of rows
  with a trained token in some mini-batch, or ``N_seq = local count x ranks`` equals the true
  all-reduced count and a backend computing it so passes every check;
- the DAPO scenario must keep other groups when its filter reads the raw score instead of
  ``seq_reward``, hold a row inside the overlong buffer whose length is not its count of
  trained tokens, and configure a longest response above its batch's padded width, or a filter
  on the wrong metric and a penalty from the wrong length or limit pass;
- some scenario must put a KL term against a reference policy on a rollout sampled at a
  temperature other than 1, or reference log-probs taken without the temperature pass;
- some scenario with a sequence-level aggregation must run Megatron with a data-parallel group
  of more than one rank, or gradients averaged over DP on top of the loss's global denominator
  pass (at TP=2 or PP=2 alone that group is one rank; found by hand, 2026-11-27);
- some GRPO scenario must split its groups over mini-batches and leave one without a response at
  the length limit, and no AdamW scenario may use torch's default settings (a blind audit,
  2026-11-27: advantages per mini-batch, a horizon from the mini-batch, a dropped weight decay);
- some scenario must train a KL loss beside rollout IS weights away from 1, and a mask-mode
  scenario must set a lower bound other than 1 / the upper (a blind audit, 2026-11-27: a KL
  term weighted by them, and a lower bound ignored, passed --all).

And the committed files are what the script writes (byte for byte, sidecars included).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from rlaudit.algo.dapo import filter_groups, overlong_penalty
from rlaudit.data.batching import shard_for_dp, split_minibatches
from rlaudit.data.io import load_rollout
from rlaudit.model.load import snapshot_id
from rlaudit.scenarios.spec import load_scenario, resolve
from rlaudit.update.step import filter_metric

REPO = Path(__file__).resolve().parents[2]
ROLLOUTS = REPO / "scenarios" / "rollouts"


def _scenario(name: str):
    return load_scenario(resolve([name], all_=False, root=str(REPO / "scenarios"))[0])


def _trained_rows_per_rank(batch, cfg, dp: int) -> list[list[int]]:
    """Per mini-batch, per data-parallel rank: rows holding a trained token."""
    rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    out = []
    for mb in split_minibatches(batch, rows, shuffle=cfg.actor.shuffle, seed=cfg.trainer.seed):
        shards = shard_for_dp(mb, dp, balance=cfg.trainer.balance_batch)
        out.append([int(s.mask.any(dim=-1).sum()) for s in shards])
    return out


def test_a_seq_mean_scenario_gives_dp_ranks_different_counts_of_trained_rows():
    seen = {}
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        dp = max([layout.get("dp", 1) for b, layout in scn.backends.items()
                  if b != "reference"], default=1)
        if not scn.config.actor.loss_agg_mode.startswith("seq-mean") or dp < 2:
            continue
        counts = _trained_rows_per_rank(load_rollout(scn.rollout), scn.config, dp)
        seen[scn.name] = counts
    assert "agg_seq_mean_token_mean" in seen, sorted(seen)
    uneven = {n: c for n, c in seen.items() if any(len(set(ranks)) > 1 for ranks in c)}
    assert "agg_seq_mean_token_mean" in uneven, seen
    # the edit made it so: the recorded rollout it comes from is even
    scn = _scenario("agg_seq_mean_token_mean")
    src = load_rollout(ROLLOUTS / "short-ref.safetensors")
    assert all(len(set(r)) == 1 for r in _trained_rows_per_rank(src, scn.config, 2))


def test_a_seq_aggregation_scenario_runs_megatron_with_more_than_one_dp_rank():
    found = {}
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        layout = scn.backends.get("megatron")
        if layout is not None and scn.config.actor.loss_agg_mode.startswith("seq-mean"):
            found[scn.name] = layout.get("dp", 1)
    assert any(dp > 1 for dp in found.values()), found


def test_the_dapo_scenario_separates_seq_reward_from_the_raw_score_and_length_from_tokens():
    scn = _scenario("dapo_filter_overlong")
    cfg = scn.config
    assert cfg.algorithm.filter_groups.metric == "seq_reward"
    raw = load_rollout(scn.rollout)
    on_seq_reward = filter_groups(raw["uid"], filter_metric(raw, cfg))
    on_score = filter_groups(raw["uid"], raw["scores"].double())
    assert not torch.equal(on_seq_reward, on_score)
    ob = cfg.reward.overlong_buffer
    max_len = cfg.rollout.response_length

    def penalty(lengths):
        return overlong_penalty(lengths, max_response_length=max_len, buffer_len=ob.len,
                                penalty_factor=ob.penalty_factor, dtype=torch.float64)

    by_length = penalty(raw["response_lengths"])
    by_tokens = penalty(raw["response_mask"].sum(-1))
    differs = (by_length != by_tokens) & on_seq_reward
    assert differs.any(), "no kept row whose penalty depends on length vs trained tokens"
    # the configured limit is not the batch's padded width (batches pad to their longest row)
    assert max_len > raw.response_width
    at_width = overlong_penalty(raw["response_lengths"], max_response_length=raw.response_width,
                                buffer_len=ob.len, penalty_factor=ob.penalty_factor,
                                dtype=torch.float64)
    assert ((at_width != by_length) & on_seq_reward).any()


def test_a_kl_term_meets_a_rollout_sampled_at_a_temperature():
    found = []
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        cfg = scn.config
        kl = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        if kl and scn.ref_model is not None and cfg.rollout.temperature != 1.0:
            found.append(scn.name)
    assert "rollout_temperature" in found, found


def test_a_kl_loss_meets_rollout_importance_weights_away_from_one():
    """verl weights the policy loss alone by the rollout IS weights; a trainer that weights its
    KL term too computes the same wherever no scenario has both (a blind audit, 2026-11-27). Some
    scenario must train a KL loss against another reference policy (so the term is not 0 at step
    0) with IS weights that are not all 1 on a stale rollout."""
    found = []
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        cfg = scn.config
        sampler = load_rollout(scn.rollout).meta.get("model_snapshot_id")
        stale = sampler is not None and sampler != snapshot_id(scn.model)
        if (cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0 and scn.ref_model is not None
                and scn.ref_model != scn.model and cfg.actor.rollout_correction.rollout_is
                and stale):
            found.append(scn.name)
    assert found


def test_a_mask_mode_scenario_has_a_lower_bound_of_its_own():
    """verl's mask mode keeps weights in [rollout_is_threshold_lower, rollout_is_threshold],
    the lower bound defaulting to 1 / the upper: with the default only, a trainer that ignores
    the configured lower bound passes (a blind audit, 2026-11-27)."""
    found = []
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        rc = scn.config.actor.rollout_correction
        if (rc.rollout_is and rc.rollout_is_mode == "mask" and rc.rollout_is_threshold_lower
                and abs(rc.rollout_is_threshold_lower - 1 / rc.rollout_is_threshold) > 0.05):
            found.append(scn.name)
    assert found


def _make_module():
    spec = importlib.util.spec_from_file_location("make_masked_rows",
                                                  ROLLOUTS / "make_masked_rows.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_rollouts_are_what_the_script_writes(tmp_path):
    mod = _make_module()
    for name in mod.EDITS:
        out = mod.derive(name, tmp_path)
        assert out.read_bytes() == (ROLLOUTS / out.name).read_bytes(), name
        got = json.loads(out.with_suffix(".json").read_text())
        want = json.loads((ROLLOUTS / out.with_suffix(".json").name).read_text())
        assert got == want, name


def test_a_critic_scenario_gives_the_critic_other_optimizer_settings_than_the_actor():
    """Equal settings hide a critic optimizer built from the actor's (a blind audit's miss)."""
    critics = []
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        if scn.config.use_critic:
            critics.append((scn.name, scn.config.critic.optim != scn.config.actor.optim))
    assert critics and all(differ for _, differ in critics), critics


def test_adamw_scenarios_set_nothing_to_torch_defaults():
    """An AdamW setting equal to torch's default hides a trainer that never passes it on (a
    blind audit: weight_decay dropped, so torch's 0.01 -- the scenario's value -- applied). The
    betas only weigh one optimizer step's gradient against the last: with one mini-batch per
    step those are nearly equal and Adam's bias correction leaves the betas moot (second step:
    v = (b2 g1^2 + g2^2) / (1 + b2) ~ g^2 whatever b2), so every AdamW scenario takes several
    optimizer steps per step, on different rows (dropped betas passed otherwise)."""
    import inspect
    defaults = inspect.signature(torch.optim.AdamW).parameters
    adamw = []
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        for role in ("actor", "critic"):
            optim = getattr(scn.config, role).optim
            if (role == "critic" and not scn.config.use_critic) or optim.name != "adamw":
                continue
            adamw.append(scn.name)
            assert optim.weight_decay != defaults["weight_decay"].default, (scn.name, role)
            assert optim.eps != defaults["eps"].default, (scn.name, role)
            assert tuple(optim.betas) != tuple(defaults["betas"].default), (scn.name, role)
            n = scn.config.rollout.n
            rows = min(len(load_rollout(scn.rollout)["uid"]), scn.config.data.train_batch_size * n)
            mini = scn.config.actor.ppo_mini_batch_size * n   # every role's (update/plan.py)
            assert rows >= 2 * mini, (scn.name, role, f"{rows} rows a step, mini-batches of {mini}")
    assert adamw


def test_a_grpo_scenario_splits_its_groups_over_mini_batches():
    """With every group inside one mini-batch, group statistics taken per mini-batch are the
    batch's, and a horizon taken from a mini-batch's longest response is the configured one when
    each group holds a response at the limit (a blind audit: both bugs passed --all). Some GRPO
    scenario with seq-mean-token-sum-norm must split groups and leave a mini-batch without a
    response at the length limit."""
    found = []
    for path in resolve([], all_=True, root=str(REPO / "scenarios")):
        scn = load_scenario(path)
        cfg = scn.config
        if cfg.algorithm.adv_estimator != "grpo":
            continue
        batch = load_rollout(scn.rollout)
        rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        minis = split_minibatches(batch, rows, shuffle=cfg.actor.shuffle, seed=cfg.trainer.seed)
        whole = {int(u): int((batch["uid"] == u).sum()) for u in batch["uid"]}
        split = any(int((mb["uid"] == u).sum()) < n for mb in minis for u, n in whole.items()
                    if bool((mb["uid"] == u).any()))
        short = any(int(mb["response_lengths"].max()) < cfg.rollout.response_length
                    for mb in minis)
        if split and short and cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm":
            found.append(scn.name)
    assert found
