"""What the OpenRLHF adapter declares (docs/peers.md, "OpenRLHF"): the conventions rlaudit's
reference computes under for OpenRLHF, the differences that remain, each linked to the line of
the installed release's source it comes from.
"""

from __future__ import annotations


from rlaudit.targets.contract.declare import Difference, source_line

#: OpenRLHF at a release tag
BLOB = "https://github.com/OpenRLHF/OpenRLHF/blob/v{v}/openrlhf/"


#: the problems the value clamp explains: k1 / k2 (and k1+'s value) comparisons, never k3's
KL_CLAMP_CASES = ("k1 on", "k1 gradient on", "k2 on", "k2 gradient on", "k1+ on", "(k1)", "(k2)")


def differences(version: str, orl) -> tuple:
    """OpenRLHF ``version``'s documented, deliberate differences from rlaudit's reference,
    linked to the lines of the installed modules (``orl``: :func:`.openrlhf_import.
    import_openrlhf`)."""
    blob = BLOB.format(v=version)
    maker = orl.maker.RemoteExperienceMaker
    adv_link = blob + "trainer/ppo_utils/experience_maker.py"
    out = [
        Difference(
            "grpo-std-eps-1e-9",
            reason="group_norm divides by (group std + 1e-9); verl and rlaudit by (std + 1e-6)",
            link=adv_link + source_line(maker.compute_advantages_and_returns, "+ 1e-9"),
            checks=("compute_advantages:*",), convention={"grpo_std_eps": 1e-9}),
        Difference(
            "whiten-biased-variance",
            reason="gae, reinforce and reinforce_baseline advantages are whitened over the batch's "
                   "action tokens with the biased variance (sum / N_tok) and rsqrt(max(var, "
                   "1e-8)); verl and rlaudit use the unbiased variance (N_tok - 1) and "
                   "rsqrt(var + 1e-8): every advantage differs by sqrt(N_tok / (N_tok - 1))",
            link=adv_link + source_line(maker.compute_advantages_and_returns, "var = ((all_adv"),
            checks=("compute_advantages:parity",),
            cases=tuple(f"{label} advantages on" for label in (
                "gae gamma=0.9 lam=0.95", "reinforce_plus_plus gamma=0.9",
                "reinforce_plus_plus_baseline"))),
        Difference(
            "recursions-through-masked-tokens",
            reason="gae and reinforce set rewards and values to 0 under action_mask 0 and run "
                   "their recursions through those positions (discounted by gamma there); "
                   "rlaudit (verl) skips them. Only rows with masked positions inside the "
                   "response differ (tool output of an agent rollout)",
            link=adv_link + source_line(maker.get_advantages_and_returns, "values = action_mask"),
            checks=("compute_advantages:parity", "compute_advantages:masked-values"),
            cases=tuple(f"{label} {what} on ragged"
                        for label in ("gae gamma=0.9 lam=0.95", "reinforce_plus_plus gamma=0.9")
                        for what in ("advantages", "returns"))),
        Difference(
            "baseline-returns-before-whitening",
            reason="reinforce_baseline's returns are the group-centred rewards before the "
                   "batch whitening (only the critic reads returns; this estimator has none); "
                   "rlaudit (verl) returns the whitened advantages",
            link=adv_link + source_line(maker.compute_advantages_and_returns,
                                        "experience.returns ="),
            checks=("compute_advantages:parity",),
            cases=("reinforce_plus_plus_baseline returns on",)),
    ]
    out.append(Difference(
        "kl-value-clamp-10",
        reason="every KL estimator's per-token value is clamped to [-10, 10] (k1 and k2 too; "
               "rlaudit, like verl, clamps k3 only), with gradient 0 where the clamp acts; the "
               "fixed stage cases stay far inside it, the fuzzer's log-ratios up to 10 do not",
        link=blob + "models/utils.py" + source_line(orl.utils.compute_approx_kl,
                                                "clamp(min=-10, max=10)"),
        checks=("kl_penalty:parity", "apply_kl_in_reward:parity",
                "apply_kl_in_reward:stored-kl-unaltered"),
        cases=KL_CLAMP_CASES))
    loss = orl.loss
    if hasattr(loss, "aggregate_loss"):
        out.append(Difference(
            "agg-loss-nan-on-empty",
            reason="aggregate_loss without global counts is a masked mean, 0/0 = NaN for a batch "
                   "without a valid token; OpenRLHF's actor always passes global counts "
                   "(utils/loss_utils.py: get_loss_batch_info, iter_grad_accum_global_norm), "
                   "with which such a micro-batch gives 0",
            link=blob + "models/loss.py" + source_line(loss.aggregate_loss, "masked_mean(loss"),
            checks=("agg_loss:parity",), cases=("without a valid token",)))
    out.append(Difference(
        "gspo-sequence-gradient",
        reason="GSPO's sequence ratio exp(mean(log_probs - old_log_probs)) is differentiated "
               "through the mean (GSPO's sequence-level objective), not per token",
        link=blob + "models/loss.py" + source_line(loss.PolicyLoss.forward, "ratio = (log_ratio"),
        checks=("policy_loss:*",), convention={"gspo_gradient": "sequence"}))
    return tuple(out)
