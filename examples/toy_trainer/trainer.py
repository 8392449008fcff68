"""ToyTrainer: a small GRPO/PPO trainer written the way many RL trainers are (verl-like data
layout, dict batches, string group ids, its own metric names). It stands in for "someone else's
trainer" in rlaudit's adapter example and knows nothing about rlaudit.

Data layout (a verl ``DataProto``-like dict):

- ``input_ids`` / ``attention_mask`` / ``position_ids`` ``[B, P + R]``: the prompt **left**-padded
  to P, then the response right-padded to R; ``position_ids = cumsum(attention_mask) - 1``.
- ``responses`` ``[B, R]``, ``response_mask`` ``[B, R]`` float 0/1 (1 = the token is trained on).
- ``index``: a list of B strings, the group (prompt) id of each row.
- ``scores`` ``[B]``: one rule score per response; any other ``[B, R, ...]`` tensor rides along.

One ``step(data)``: old (and reference) log-probs -> scores on the last token, minus KL when KL is
in the reward -> GRPO advantages -> for each epoch, each mini-batch (one optimizer step), each
micro-batch: PPO-clip loss + entropy bonus + KL loss, normalised by the *mini-batch's* token /
sequence counts, backward -> clip grads -> optimizer step. Metrics average over optimizer steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class ToyConfig:
    lr: float = 1e-6
    optimizer: str = "adamw"            # adamw | sgd
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0                 # dual clip for negative advantages
    loss_agg_mode: str = "token-mean"   # token-mean | seq-mean-token-sum | seq-mean-token-mean
    norm_len: float | None = None       # | seq-mean-token-sum-norm (None: R)
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"    # kl | low_var_kl
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001
    kl_penalty: str = "kl"
    norm_adv_by_std: bool = True
    mini_batch_rows: int = 8
    micro_batch_rows: int = 2
    max_tokens_per_micro: int | None = None   # set: cut micro-batches by token budget
    padding_micros: int = 0             # extra all-masked micro-batches per optimizer step
    epochs: int = 1
    grad_clip: float = 1.0
    temperature: float = 1.0
    rollout_is: str | None = None       # token | sequence | geometric: importance weights
    rollout_is_threshold: float = 2.0   # pi_train / pi_rollout of the sampler's log-probs
    rollout_is_mode: str = "truncate"   # truncate (cap) | mask (0 outside [lower, threshold])
    rollout_is_threshold_lower: float | None = None
    cp_size: int = 1                    # context-parallel ranks each sequence is split over


# ---- algorithms --------------------------------------------------------------------------------

def grpo_advantages(token_level_rewards, response_mask, index, norm_by_std=True, eps=1e-6):
    """verl-style GRPO: row score = sum of its rewards; (score - group mean) / (group std + eps);
    a group of one row keeps its score (mean 0, std 1)."""
    scores = (token_level_rewards * response_mask).sum(-1)
    groups = defaultdict(list)
    for i, idx in enumerate(index):
        groups[idx].append(scores[i])
    mean, std = {}, {}
    for idx, vals in groups.items():
        v = torch.stack(vals)
        mean[idx] = v.mean() if len(vals) > 1 else torch.zeros((), dtype=v.dtype)
        std[idx] = v.std() if len(vals) > 1 else torch.ones((), dtype=v.dtype)
    out = torch.stack([(scores[i] - mean[idx]) / (std[idx] + eps) if norm_by_std
                       else scores[i] - mean[idx] for i, idx in enumerate(index)])
    return out.unsqueeze(-1) * response_mask


def kl_penalty(logp, ref_logp, kind):
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind in ("low_var_kl", "k3"):
        d = (ref_logp - logp).clamp(-20, 20)
        return (torch.exp(d) - d - 1).clamp(-10, 10)
    raise NotImplementedError(f"kl penalty {kind}")


def importance_weights(old_logp, rollout_logp, mask, cfg):
    """Rollout importance weights (verl's rollout correction): per token exp(old - rollout), per
    sequence the product of a row's token ratios, or their geometric mean; capped at the
    threshold (truncate) or zeroed outside [lower, threshold] (mask); 0 past the response."""
    log_ratio = (old_logp - rollout_logp) * mask
    if cfg.rollout_is == "token":
        log_w = log_ratio
    else:
        row = log_ratio.sum(-1, keepdim=True)
        if cfg.rollout_is == "geometric":
            row = row / mask.sum(-1, keepdim=True).clamp(min=1)
        log_w = row.expand_as(log_ratio)
    w = torch.exp(log_w.clamp(-20, 20))
    if cfg.rollout_is_mode == "truncate":
        w = w.clamp(max=cfg.rollout_is_threshold)
    else:
        lower = cfg.rollout_is_threshold_lower or 1.0 / cfg.rollout_is_threshold
        w = w * ((w >= lower) & (w <= cfg.rollout_is_threshold))
    return w * mask


def aggregate(loss_mat, mask, mode, *, num_tokens, num_seqs, norm_len, row_tokens=None):
    """Sum this micro-batch's share and divide by the *mini-batch's* counts (so the micro-batch
    results add up to the mini-batch value). ``row_tokens``: each row's token count when
    ``mask`` holds only part of the row (a context-parallel rank's share)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / max(num_tokens, 1)
    if mode == "seq-mean-token-mean":
        n = mask.sum(-1) if row_tokens is None else row_tokens
        per_row = (loss_mat * mask).sum(-1) / n.clamp(min=1)
        return per_row.sum() / max(num_seqs, 1)
    row_sums = (loss_mat * mask).sum()
    if mode == "seq-mean-token-sum":
        return row_sums / max(num_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return row_sums / (max(num_seqs, 1) * norm_len)
    raise NotImplementedError(f"loss_agg_mode {mode}")


def ppo_loss(old_logp, logp, advantages, mask, cfg, counts, weights=None):
    """Dual-clip PPO per token (times the rollout importance weights, if given); returns
    (aggregated loss, {clipfrac, clipfrac_lower, ppo_kl}) with the metrics as this micro-batch's
    share of token-means over the mini-batch."""
    log_ratio = (logp - old_logp).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    clipped = torch.maximum(l1, l2)
    dual = torch.minimum(clipped, -advantages * cfg.clip_c)
    loss_mat = torch.where(advantages < 0, dual, clipped)
    if weights is not None:
        loss_mat = loss_mat * weights
    n_tok = max(counts["tokens"], 1)
    stats = {"pg_clipfrac": ((l2 > l1).double() * mask).sum() / n_tok,
             "pg_clipfrac_lower": (((clipped > -advantages * cfg.clip_c) & (advantages < 0))
                                   .double() * mask).sum() / n_tok,
             "ppo_kl": (-log_ratio.detach() * mask).sum() / n_tok}
    return aggregate(loss_mat, mask, cfg.loss_agg_mode, num_tokens=counts["tokens"],
                     num_seqs=counts["seqs"], norm_len=counts["norm_len"],
                     row_tokens=counts.get("row_tokens")), stats


def cp_ranks(data, cp):
    """``[b, R]``: the context-parallel rank holding each response token's logit. Each row's
    tokens (prompt + response, without padding) are padded to a multiple of 2 * cp and cut into
    2 * cp chunks; rank r holds chunks r and 2 * cp - 1 - r (the load-balanced split of Megatron
    and verl). Response token t is predicted at position prompt_length - 1 + t."""
    width = data["responses"].shape[1]
    attn = data["attention_mask"]
    prompt_len = attn[:, :-width].sum(-1, keepdim=True)
    length = attn.sum(-1, keepdim=True)
    chunk_len = ((length + 2 * cp - 1) // (2 * cp)).clamp(min=1)
    chunk = (prompt_len - 1 + torch.arange(width).unsqueeze(0)) // chunk_len
    return torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)


# ---- batching ----------------------------------------------------------------------------------

def take(data, rows):
    """Rows ``rows`` (a list of ints) of every field."""
    idx = torch.tensor(rows, dtype=torch.long)
    return {k: [v[i] for i in rows] if isinstance(v, list) else v[idx] for k, v in data.items()}


def split_micro_batches(data, *, rows=None, max_tokens=None):
    """By row count, or greedily in order under a token budget (attention_mask tokens)."""
    n = len(data["index"])
    if max_tokens is None:
        return [take(data, list(range(i, min(i + rows, n)))) for i in range(0, n, rows)]
    lengths = data["attention_mask"].sum(-1).tolist()
    pieces, current, used = [], [], 0
    for i, length in enumerate(lengths):
        if current and used + length > max_tokens:
            pieces.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    if current:
        pieces.append(current)
    return [take(data, p) for p in pieces]


def padding_micro_batch(template):
    """One all-masked row with every field of ``template`` (a one-token prompt: the model runs)."""
    pad = {k: ["__pad__"] if isinstance(v, list) else torch.zeros_like(v[:1])
           for k, v in template.items()}
    prompt_width = template["input_ids"].shape[1] - template["responses"].shape[1]
    pad["attention_mask"][0, prompt_width - 1] = 1
    return pad


def pad_to(x, width):
    """Right-pad a 1-D tensor with zeros to ``width`` (stays on the autograd graph)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[0]))


def counts_of(data, norm_len):
    m = data["response_mask"]
    return {"tokens": int(m.sum()), "seqs": int((m.sum(-1) > 0).sum()), "norm_len": norm_len}


# ---- the trainer -------------------------------------------------------------------------------

class ToyTrainer:
    def __init__(self, model, cfg: ToyConfig, ref_model=None):
        self.model, self.cfg, self.ref_model = model, cfg, ref_model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = (torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
                          if cfg.optimizer == "sgd" else
                          torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                            weight_decay=cfg.weight_decay, foreach=False))
        self.micro_batches_seen = []      # per optimizer step, the micro-batches it ran

    def forward(self, model, data, with_entropy):
        """Log-prob (and entropy) of each response token: ``[b, R]`` each, 0 past a response.

        Rows run one at a time without their padding (verl's "remove padding" idea, minus the
        packing): a left-padded batch through eager attention gives NaN on the padded rows."""
        resp = data["responses"]
        width = resp.shape[1]
        prompt_width = data["input_ids"].shape[1] - width
        logps, ents = [], []
        for i in range(resp.shape[0]):
            keep = data["attention_mask"][i] > 0
            ids = data["input_ids"][i][keep]
            pl = int(keep[:prompt_width].sum())
            rl = ids.shape[0] - pl
            logits = model(input_ids=ids.unsqueeze(0), use_cache=False).logits[0]
            logits = logits[pl - 1:pl - 1 + rl].double() / self.cfg.temperature
            logp_all = torch.log_softmax(logits, -1)
            logps.append(pad_to(logp_all.gather(-1, ids[pl:].unsqueeze(-1)).squeeze(-1), width))
            if with_entropy:
                ents.append(pad_to(-(logp_all.exp() * logp_all).sum(-1), width))
        return torch.stack(logps), torch.stack(ents) if with_entropy else None

    def no_grad_forward(self, model, data, with_entropy=False):
        with torch.no_grad():
            outs = [self.forward(model, mb, with_entropy)
                    for mb in split_micro_batches(data, rows=self.cfg.micro_batch_rows)]
        logp = torch.cat([o[0] for o in outs])
        return logp, torch.cat([o[1] for o in outs]) if with_entropy else None

    def last_token(self, data):
        """``[B, R]`` bool: the last token of each response (where the score goes), found from
        the attention mask: the loss mask may exclude tokens inside a response (tool output)."""
        width = data["responses"].shape[1]
        resp_len = data["attention_mask"][:, -width:].sum(-1, keepdim=True)
        return torch.arange(width).unsqueeze(0) == resp_len - 1

    def step(self, data):
        """One training step; returns (metrics, data with the derived fields)."""
        cfg, mask = self.cfg, data["response_mask"]
        old_logp, entropy = self.no_grad_forward(self.model, data, with_entropy=True)
        data = {**data, "old_log_probs": old_logp, "entropy": entropy}
        data["token_level_scores"] = data["scores"].unsqueeze(-1) * self.last_token(data)
        metrics = {}
        if cfg.use_kl_loss or cfg.use_kl_in_reward:
            data["ref_log_probs"], _ = self.no_grad_forward(self.ref_model, data)
        if cfg.use_kl_in_reward:
            kl = kl_penalty(old_logp, data["ref_log_probs"], cfg.kl_penalty) * mask
            data["kl"] = kl
            data["token_level_rewards"] = data["token_level_scores"] - cfg.kl_coef * kl
            metrics["rollout_kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
        else:
            data["token_level_rewards"] = data["token_level_scores"]
        data["advantages"] = grpo_advantages(data["token_level_rewards"], mask, data["index"],
                                             cfg.norm_adv_by_std)
        if cfg.rollout_is is not None:
            data["rollout_is_weights"] = self.importance_weights(data)
            metrics["is_weight_mean"] = float((data["rollout_is_weights"] * mask).sum()
                                              / mask.sum().clamp(min=1))
        metrics.update(self.update(data))
        metrics["score_mean"] = float(data["token_level_scores"].sum(-1).mean())
        metrics["adv_mean"] = float((data["advantages"] * mask).sum() / mask.sum().clamp(min=1))
        return metrics, data

    def update(self, data):
        cfg = self.cfg
        n = len(data["index"])
        per_step = defaultdict(list)
        norm_len = cfg.norm_len or data["responses"].shape[1]
        with_entropy = self.wants_entropy()
        for _ in range(cfg.epochs):
            for start in range(0, n, cfg.mini_batch_rows):
                mini = take(data, list(range(start, min(start + cfg.mini_batch_rows, n))))
                counts = counts_of(mini, norm_len)
                micros = split_micro_batches(mini, rows=cfg.micro_batch_rows,
                                             max_tokens=cfg.max_tokens_per_micro)
                micros += [padding_micro_batch(mini) for _ in range(cfg.padding_micros)]
                self.micro_batches_seen.append(micros)
                self.optimizer.zero_grad(set_to_none=True)
                sums = defaultdict(float)
                for mb in micros:
                    stats = self.micro_step(mb, self.normaliser(counts, mb, len(micros)),
                                            with_entropy)
                    for k, v in stats.items():
                        sums[k] += float(v)
                sums["grad_norm"] = self.clip_gradients()
                self.optimizer.step()
                sums["lr"] = self.optimizer.param_groups[0]["lr"]
                if cfg.use_kl_loss:
                    sums["kl_coef"] = cfg.kl_loss_coef
                for k, v in sums.items():
                    per_step[k].append(v)
        return {k: sum(v) / len(v) for k, v in per_step.items()}

    # ---- policies a trainer might change --------------------------------------------------------
    def importance_weights(self, data):
        return importance_weights(data["old_log_probs"], data["rollout_log_probs"],
                                  data["response_mask"], self.cfg)

    def wants_entropy(self):
        """Entropy is computed (and logged) when it is asked for or when it is in the loss."""
        return self.cfg.calculate_entropy or self.cfg.entropy_coeff != 0

    def normaliser(self, mini_counts, micro, num_micros):
        """The counts a micro-batch's loss is divided by: the whole mini-batch's."""
        return mini_counts

    def clip_gradients(self):
        """Clip to cfg.grad_clip (<= 0: no clipping); returns the norm *before* clipping."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def micro_step(self, mb, counts, with_entropy):
        logp, ent = self.forward(self.model, mb, with_entropy)
        if self.cfg.cp_size == 1:
            loss, stats = self.loss_terms(mb, logp, ent, mb["response_mask"], counts,
                                          with_entropy)
        else:
            loss, stats = self.context_parallel_loss(mb, logp, ent, counts, with_entropy)
        loss.backward()
        return stats

    def loss_terms(self, mb, logp, ent, mask, counts, with_entropy):
        """The loss of the tokens under ``mask`` and its metrics (shares of mini-batch values)."""
        cfg = self.cfg
        agg = dict(num_tokens=counts["tokens"], num_seqs=counts["seqs"],
                   norm_len=counts["norm_len"], row_tokens=counts.get("row_tokens"))
        loss, stats = ppo_loss(mb["old_log_probs"], logp, mb["advantages"], mask, cfg, counts,
                               mb.get("rollout_is_weights"))
        stats["pg_loss"] = loss.detach()
        if with_entropy:
            entropy = aggregate(ent, mask, cfg.loss_agg_mode, **agg)
            stats["entropy"] = entropy.detach()
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy
        if cfg.use_kl_loss:
            ref = torch.where(mask > 0, mb["ref_log_probs"], logp.detach())
            kl = aggregate(kl_penalty(logp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode,
                           **agg)
            stats["kl_loss"] = kl.detach()
            loss = self.with_kl_penalty(loss, kl)
        stats["loss"] = loss.detach()
        return loss, stats

    def context_parallel_loss(self, mb, logp, ent, counts, with_entropy):
        """Megatron-style context parallelism, simulated: each CP rank sums the loss terms of the
        response tokens it holds (divided by the mini-batch's counts; a row's token count is the
        whole row's), and the CP group all-reduces the partial losses and metrics."""
        cp, mask = self.cfg.cp_size, mb["response_mask"]
        ranks = cp_ranks(mb, cp)
        counts = {**counts, "row_tokens": mask.sum(-1)}
        parts = [self.loss_terms(mb, logp, ent, mask * (ranks == r), counts, with_entropy)
                 for r in range(cp)]
        loss = self.cp_all_reduce([p[0] for p in parts])
        stats = {k: self.cp_all_reduce_metric([p[1][k] for p in parts]) for k in parts[0][1]}
        return loss, stats

    def with_kl_penalty(self, loss, kl):
        """The KL loss term pulls the policy towards the reference: added, times its coef."""
        return loss + self.cfg.kl_loss_coef * kl

    def cp_all_reduce(self, partial_losses):
        """Sum over the CP group (the gradient of each rank's share adds up)."""
        return sum(partial_losses[1:], partial_losses[0])

    def cp_all_reduce_metric(self, partial_values):
        return sum(partial_values[1:], partial_values[0])
