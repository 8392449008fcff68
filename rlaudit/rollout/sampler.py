"""The reference sampler: plain-torch autoregressive sampling from an HF causal LM.

:func:`sample` turns token-id prompts into a :class:`~rlaudit.data.batch.RolloutBatch`:

- Rows: prompt j gives rows ``j*n .. j*n+n-1``, all with ``uid = j + uid_offset``.
- ``prompt_ids`` ``[B, P]``: left-aligned, right-padded with ``pad_token_id``; P = longest prompt.
- ``response_ids`` ``[B, R]`` with **R = max_new_tokens** (a fixed width, whatever was sampled):
  a response stops at the first ``eos_token_id`` and **includes** it (the EOS token is trained on
  and counted in ``response_lengths`` / ``response_mask``); a response that never samples EOS is
  ``max_new_tokens`` long (truncated). Padding after the response is ``pad_token_id``.
- ``response_mask`` ``[B, R]`` bool: ``t < response_lengths[i]``.
- ``rollout_log_probs`` ``[B, R]``: log-prob of each sampled token under the **processed**
  distribution the token was drawn from, i.e. vLLM's ``logprobs_mode="processed_logprobs"``:
  logits / temperature, then top-k, then top-p, renormalised (a truncated-away token has -inf).
  With ``top_k`` disabled and ``top_p=1`` this is ``log_softmax(logits / temperature)``, what a
  trainer recomputes; with truncation it differs from that by ``-log(kept probability mass)``.
  ``temperature == 0`` is greedy, and then (as in vLLM) the log-probs are ``log_softmax(logits)``.
  0 past the response. dtype: the model's, promoted to at least float32.

Randomness: row r draws its tokens from its own CPU ``torch.Generator`` seeded with
``seed + r`` (inverse-CDF on float64 probabilities), so the same seed gives an identical batch
(on another device the uniforms are the same; tokens then differ only where the logits' rounding
moves a draw across a CDF boundary), the global RNG is not used, and a row does not depend on
the other rows' draws. vLLM uses the same ``seed + r`` per row (see
:mod:`rlaudit.rollout.vllm_engine`) but its own noise, so the two engines agree in distribution
(and token for token under greedy decoding), not token for token when sampling.

Speed: the n rows of one prompt run as one batch with a KV cache (no padding inside a batch,
so no attention mask or position-id bookkeeping); prompts run one after another. That is
``len(prompt_ids) * (max_new_tokens + 1)`` forward calls plus one Python-level draw per row and
step: 8 prompts x 4 rows x 32 tokens take ~2.5 s for the tiny models on a busy 2-core CPU.

Precision: stock HF eager attention computes its softmax in float32 even in a float64 model, and
a float32 sum over a KV-cache step's row rounds differently from the same row inside a full
sequence, so float64 log-probs here match a full-sequence recompute to ~6e-7, not ~1e-14
(tests/rollout/test_sampler.py shows both).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError
from rlaudit.rollout.prompts import check_prompt_ids

#: The logprobs mode both engines use (vLLM's name): log-probs after temperature and top-k/top-p.
LOGPROBS_MODE = "processed_logprobs"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every engine (vLLM's semantics).

    ``top_k``: keep the k most likely tokens (ties at the k-th value kept); 0 or -1 disables.
    ``top_p``: keep the most likely tokens whose preceding mass is < top_p (at least one).
    ``temperature``: 0 means greedy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    seed: int = 0

    def validated(self) -> "SamplingParams":
        """A checked copy with ``top_k=-1`` normalised to 0; :class:`InputError` names the field."""
        def bad(key: str, expected: str):
            return InputError(f"expected {expected}, got {getattr(self, key)!r}", key=key)

        for key in ("n", "top_k", "max_new_tokens", "seed"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(key, "an int")
        if self.n < 1:
            raise bad("n", "n >= 1")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", "max_new_tokens >= 1")
        if self.top_k < -1:
            raise bad("top_k", "0 or -1 (disabled) or k >= 1")
        if self.seed < 0:
            raise bad("seed", "seed >= 0")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise bad("temperature", "a finite temperature >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise bad("top_p", "0 < top_p <= 1")
        return SamplingParams(n=self.n, temperature=float(self.temperature),
                              top_p=float(self.top_p), top_k=max(self.top_k, 0),
                              max_new_tokens=self.max_new_tokens, seed=self.seed)

    def to_meta(self) -> dict:
        return asdict(self)


def processed_log_probs(logits: torch.Tensor, *, temperature: float, top_k: int = 0,
                        top_p: float = 1.0) -> torch.Tensor:
    """Log-probs of the distribution tokens are sampled from (vLLM's "processed" log-probs).

    ``logits``: ``[N, V]``. Returns ``[N, V]`` (new tensor, dtype promoted to >= float32):
    ``log_softmax`` over the tokens kept by top-k then top-p of ``logits / temperature``
    (-inf elsewhere; the normaliser is the kept tokens' mass). ``temperature == 0``: greedy, the
    log-probs are ``log_softmax(logits)`` (no scaling, no truncation).
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature == 0:
        return torch.log_softmax(x, -1)
    x = x / temperature
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = torch.where(x < kth, neg_inf, x)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, -1)
        mass_before = torch.cumsum(probs, -1) - probs          # mass of strictly likelier tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False                             # always keep the most likely
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = torch.where(drop, neg_inf, x)
    return torch.log_softmax(x, -1)


def draw(log_probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``exp(log_probs)`` (``[V]``) by inverse CDF with one float64 uniform from
    ``generator`` (CPU). A token with probability 0 is never drawn."""
    probs = log_probs.detach().to("cpu", torch.float64).exp()
    cdf = torch.cumsum(probs, 0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    # first index whose cdf exceeds u * total: never a zero-probability token
    idx = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    if idx == probs.shape[0]:  # u * total rounded up to total (u within 2**-53 of 1)
        idx = int(torch.nonzero(probs).max())
    return idx


def assemble_batch(prompts: list[list[int]], responses: list[list[int]],
                   log_probs: list[list[float]], *, n: int, max_new_tokens: int,
                   pad_token_id: int, uid_offset: int, log_prob_dtype: torch.dtype,
                   meta: dict) -> RolloutBatch:
    """Lay out per-row results in rlaudit's batch format (see the module docstring).

    ``prompts``: one list per prompt; ``responses``/``log_probs``: one list per row (``len(prompts)
    * n`` rows, prompt-major), responses already cut after EOS. Validates the result.
    """
    rows = len(prompts) * n
    if len(responses) != rows or len(log_probs) != rows:
        raise ValueError(f"expected {rows} rows, got {len(responses)} responses and "
                         f"{len(log_probs)} log-prob lists")
    width_p = max(len(p) for p in prompts)
    prompt_ids = torch.full((rows, width_p), pad_token_id, dtype=torch.long)
    prompt_lengths = torch.empty(rows, dtype=torch.long)
    response_ids = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long)
    response_lengths = torch.empty(rows, dtype=torch.long)
    lp = torch.zeros((rows, max_new_tokens), dtype=log_prob_dtype)
    for r in range(rows):
        prompt, resp = prompts[r // n], responses[r]
        if len(resp) != len(log_probs[r]) or len(resp) > max_new_tokens:
            raise ValueError(f"row {r}: {len(resp)} tokens, {len(log_probs[r])} log-probs")
        prompt_ids[r, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        prompt_lengths[r] = len(prompt)
        response_ids[r, :len(resp)] = torch.tensor(resp, dtype=torch.long)
        response_lengths[r] = len(resp)
        lp[r, :len(resp)] = torch.tensor(log_probs[r], dtype=torch.float64).to(log_prob_dtype)
    mask = torch.arange(max_new_tokens).unsqueeze(0) < response_lengths.unsqueeze(1)
    uid = torch.arange(len(prompts), dtype=torch.long).repeat_interleave(n) + uid_offset
    return RolloutBatch.from_tensors(
        dict(prompt_ids=prompt_ids, prompt_lengths=prompt_lengths, response_ids=response_ids,
             response_lengths=response_lengths, response_mask=mask, uid=uid,
             rollout_log_probs=lp),
        meta=meta, source=f"{meta.get('engine', 'rollout')} engine output")


def _config_id(model, key: str, given: int | None) -> int:
    value = given if given is not None else getattr(model.config, key, None)
    if isinstance(value, (list, tuple)):  # some configs list several EOS ids: take the first
        value = value[0] if value else None
    if value is None:
        raise InputError(f"model config has no {key}; pass it explicitly", key=key)
    return int(value)


@torch.no_grad()
def sample(model, prompt_ids: Sequence[Sequence[int]], *, n: int = 1, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 32, seed: int = 0,
           eos_token_id: int | None = None, pad_token_id: int | None = None,
           uid_offset: int = 0) -> RolloutBatch:
    """Sample ``n`` responses per prompt from an HF causal LM (reference engine).

    ``prompt_ids``: one token-id list per prompt. ``eos_token_id`` / ``pad_token_id`` default to
    the model config's. Returns a validated batch with ``B = len(prompt_ids) * n`` rows; the layout,
    the log-prob semantics and the seeding are in the module docstring. ``meta``: engine
    ``"reference"``, ``sampling`` (the normalised params), ``logprobs_mode``, token ids, dtype,
    model name. The model is not modified (put it in eval mode: dropout would add noise).
    """
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=max_new_tokens, seed=seed).validated()
    vocab = int(model.config.vocab_size)
    prompts = check_prompt_ids(prompt_ids, vocab_size=vocab)
    eos = _config_id(model, "eos_token_id", eos_token_id)
    pad = _config_id(model, "pad_token_id", pad_token_id)
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + params.max_new_tokens > limit:
        raise InputError(f"longest prompt ({longest}) + max_new_tokens "
                         f"({params.max_new_tokens}) exceeds max_position_embeddings={limit}",
                         key="max_new_tokens")
    device = next(model.parameters()).device
    responses: list[list[int]] = []
    log_probs: list[list[float]] = []
    for j, prompt in enumerate(prompts):
        gens = [torch.Generator().manual_seed(params.seed + j * params.n + i)
                for i in range(params.n)]
        rows_tok, rows_lp = _sample_group(model, prompt, gens, params, eos, device)
        responses += rows_tok
        log_probs += rows_lp
    lp_dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    meta = {
        "engine": "reference", "sampling": params.to_meta(), "logprobs_mode": LOGPROBS_MODE,
        "eos_token_id": eos, "pad_token_id": pad, "uid_offset": uid_offset,
        "model": str(getattr(model.config, "name_or_path", "") or ""),
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
    }
    return assemble_batch(prompts, responses, log_probs, n=params.n,
                          max_new_tokens=params.max_new_tokens, pad_token_id=pad,
                          uid_offset=uid_offset, log_prob_dtype=lp_dtype, meta=meta)


def _sample_group(model, prompt: list[int], gens: list[torch.Generator], params: SamplingParams,
                  eos: int, device) -> tuple[list[list[int]], list[list[float]]]:
    """The n rows of one prompt, batched with a KV cache. Rows that have emitted EOS keep being
    computed (their tokens are discarded) until every row is done or ``max_new_tokens``."""
    n = len(gens)
    input_ids = torch.tensor([prompt] * n, dtype=torch.long, device=device)
    out = model(input_ids=input_ids, use_cache=True)
    tokens: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    for step in range(params.max_new_tokens):
        logp = processed_log_probs(out.logits[:, -1, :], temperature=params.temperature,
                                   top_k=params.top_k, top_p=params.top_p)
        nxt = []
        for i in range(n):
            tok = (int(torch.argmax(logp[i])) if params.temperature == 0
                   else draw(logp[i], gens[i]))
            nxt.append(tok)
            if not done[i]:
                tokens[i].append(tok)
                lps[i].append(float(logp[i, tok]))
                done[i] = tok == eos
        if all(done) or step == params.max_new_tokens - 1:
            break
        out = model(input_ids=torch.tensor(nxt, device=device).unsqueeze(1),
                    past_key_values=out.past_key_values, use_cache=True)
    return tokens, lps
