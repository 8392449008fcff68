"""The upstream bug or fix behind each red of the release matrix (``make peers-matrix``).

A :class:`Red` names a peer, a check, the releases it holds for (``before``: every release older
than that version; ``releases``: exactly these, for peers pinned by commit) and the upstream
link: the table links every red cell it matches and lists any red it does not as *untraced*
(a new finding to trace, never silently a bug of the peer). docs/peers.md has the hand-worked
cases behind each.
"""

from __future__ import annotations

from dataclasses import dataclass

_VERL = "https://github.com/verl-project/verl"
_SKYRL = "https://github.com/NovaSky-AI/SkyRL"
_SLIME = "https://github.com/THUDM/slime"
_OPENRLHF = "https://github.com/OpenRLHF/OpenRLHF"


@dataclass(frozen=True)
class Red:
    peer: str
    check: str
    link: str
    what: str
    before: str | None = None
    releases: tuple[str, ...] = ()

    def covers(self, peer: str, release: str, check: str) -> bool:
        if peer != self.peer or check != self.check:
            return False
        if self.releases:
            return release in self.releases
        return self.before is None or version_key(release) < version_key(self.before)


def version_key(version: str) -> tuple:
    """``"0.10.1"`` > ``"0.9.1"``: numeric parts compared as numbers (a local ``+fork`` suffix
    ignored)."""
    return tuple(int(p) if p.isdigit() else p for p in version.split("+")[0].split("."))


#: the run-level checks a per-micro-batch loss normalisation turns red (verl 0.7's legacy actors)
_PER_MICRO_BATCH = ("backend-parity", "microbatch-invariance", "row-permutation",
                    "on-policy-identities", "sanity-bounds")

RED: tuple[Red, ...] = (
    Red("verl", "compute_advantages:parity", f"{_VERL}/pull/7300",
        "REINFORCE++'s return recursion resets at every mask-0 token", before="0.9.0"),
    Red("verl", "policy_loss:parity",
        f"{_VERL}/blob/v0.7.1/verl/trainer/ppo/core_algos.py#L1596",
        "GSPO aggregates with a hard-coded seq-mean-token-mean", before="0.9.1"),
    Red("verl", "make_microbatches:equal-count-per-rank", f"{_VERL}/pull/5591",
        "the legacy actor cuts dynamic micro-batches without its DP group: counts differ per "
        "rank", before="0.8.0"),
    Red("verl", "make_microbatches:within-token-budget", f"{_VERL}/pull/7553",
        "ceil(T / B) balanced micro-batches: one may exceed the token budget", before="0.9.1"),
    Red("verl", "value_loss:global-split", f"{_VERL}/pull/6957",
        "the critic's value loss is normalised per micro-batch", before="0.9.0"),
    Red("verl", "agg_loss:parity", f"{_VERL}/blob/v0.5.0/verl/trainer/ppo/core_algos.py#L707",
        "seq-mean-token-mean divides by a row's own token count: 0/0 = NaN for a row without "
        "a valid token", before="0.6.0"),
    Red("verl", "value_loss:parity", f"{_VERL}/blob/v0.5.0/verl/trainer/ppo/core_algos.py#L707",
        "as agg_loss:parity (compute_value_loss aggregates with agg_loss)", before="0.6.0"),
    # verl's own training step (train_step), one column per engine: the check as
    # "<invariant>@<engine>" (tests/targets/peers/test_verl.py reads them)
    Red("verl", "entropy-logged-when-coeff-zero@megatron", f"{_VERL}/pull/6016",
        "the legacy Megatron actor computes and logs entropy only when entropy_coeff != 0, "
        "whatever calculate_entropy says", before="0.8.0"),
    *(Red("verl", f"{check}@megatron", f"{_VERL}/issues/5863",
          "the legacy Megatron actor normalises each micro-batch's loss by its own token count: "
          "the update depends on the micro-batch cut and the row order, pg_loss is a mean of "
          "micro-batch means, 0/0 for a micro-batch without a valid token", before="0.8.0")
      for check in _PER_MICRO_BATCH),
    *(Red("verl", f"{check}@fsdp", f"{_VERL}/issues/5625",
          "the legacy FSDP actor normalises each micro-batch's loss (and entropy) by its own "
          "token count and scales it by 1 / gradient_accumulation (0/0 for a micro-batch "
          "without a valid token); it logs pg_loss summed over mini-batches and epochs "
          "(PR #5766)", before="0.8.0")
      for check in _PER_MICRO_BATCH),
    Red("verl", "engine-parity@megatron", f"{_VERL}/pull/5766",
        "the legacy FSDP actor sums actor/pg_loss over mini-batches and epochs, the Megatron one "
        "averages it over micro-batches", before="0.8.0"),
    Red("skyrl", "kl_penalty:parity", f"{_SKYRL}/pull/1353",
        "compute_approx_kl runs under torch.no_grad although the worker uses it as the KL "
        "loss: the loss has no gradient (SkyRL issue 1340)", before="0.2.0"),
    Red("slime", "apply_kl_in_reward:stored-kl-unaltered", f"{_SLIME}/pull/2114",
        "the stored KL is shaped into the reward in place", releases=("a0d6d26a2",)),
    Red("slime", "apply_kl_in_reward:rewards-from-stored-kl", f"{_SLIME}/pull/2114",
        "as stored-kl-unaltered: the rewards are built in the stored KL's tensor",
        releases=("a0d6d26a2",)),
    Red("openrlhf", "policy_loss:parity",
        f"{_OPENRLHF}/commit/df78645ec8c461fe1248e92aad1f556b1898e9b1",
        "the sequence-level loss masked_mean(loss, mask, dim=-1).mean() divides a response "
        "without an action token by 0: loss and every gradient NaN", before="0.10.3"),
)


def traced(peer: str, release: str, check: str) -> Red | None:
    """The known red covering ``check`` of ``peer`` at ``release``, or None."""
    return next((r for r in RED if r.covers(peer, release, check)), None)


__all__ = ["RED", "Red", "traced", "version_key"]
