"""Pure tensor math: the reference semantics every backend calls. No model, no distributed code.

Modules: logprob (chunked log-probs/entropy from logits), kl (KL estimators), agg (loss
aggregation with global denominators), policy_loss, value_loss, advantages, reward (KL in reward),
rollout_corr (rollout IS weights, rollout-KL loss, mismatch metrics), distill, dapo.
"""
