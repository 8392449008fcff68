"""Value ranges and exact shapes of a rollout's known fields, checked against the model before
any replay.

:meth:`rlaudit.data.batch.RolloutBatch.validate` checks what a batch is on its own (leading dims,
dtypes, finite floats, lengths against the mask); what depends on the model, and the number of
dims of each field, is checked here: a token id at or above the vocabulary size, or negative,
would index past the embedding (a crash or, on some kernels, a silent wrong row), and a 3-d
log-prob tensor broadcasts into nonsense instead of failing.

    check_rollout_values(batch, vocab_size=264, source="rollouts/run1.safetensors")
"""

from __future__ import annotations

from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.errors import InputError

#: field -> its dims: seq fields [B], token and prompt fields [B, R] / [B, P], the teacher's
#: top-k [B, R, K] (fields not named here keep whatever shape their kind allows)
FIELD_DIMS = {
    "prompt_lengths": 1, "response_lengths": 1, "uid": 1, "scores": 1,
    "teacher_topk_ids": 3, "teacher_topk_log_probs": 3,
    **{name: 2 for name in ("prompt_ids", "response_ids", "response_mask", "rollout_log_probs",
                            "old_log_probs", "ref_log_probs", "entropy", "values",
                            "token_level_scores", "token_level_rewards", "advantages",
                            "returns", "kl", "rollout_is_weights", "teacher_log_probs")},
}

#: fields holding token ids of the model's vocabulary (every position, padding included: the
#: backends embed the padded rows too)
ID_FIELDS = ("prompt_ids", "response_ids", "teacher_topk_ids")


def check_shapes(batch: RolloutBatch, *, source: str | None = None) -> None:
    """Each known field has its number of dims (:data:`FIELD_DIMS`), and the teacher's top-k
    ids and log-probs the same shape."""
    for name, dims in FIELD_DIMS.items():
        t = batch.get(name)
        if t is not None and t.dim() != dims:
            want = {1: "[B]", 2: "[B, P]" if batch.kinds.get(name) == Kind.PROMPT else "[B, R]",
                    3: "[B, R, K]"}[dims]
            raise InputError(f"expected a {dims}-d tensor {want}, got shape {list(t.shape)}",
                             source=source, key=name)
    ids, lps = batch.get("teacher_topk_ids"), batch.get("teacher_topk_log_probs")
    if (ids is None) != (lps is None):
        missing = "teacher_topk_log_probs" if lps is None else "teacher_topk_ids"
        raise InputError("the teacher's top-k needs both teacher_topk_ids and "
                         "teacher_topk_log_probs", source=source, key=missing)
    if ids is not None and ids.shape != lps.shape:
        raise InputError(f"shape {list(lps.shape)} differs from teacher_topk_ids' "
                         f"{list(ids.shape)}", source=source, key="teacher_topk_log_probs")


def check_token_ids(batch: RolloutBatch, *, vocab_size: int, source: str | None = None) -> None:
    """Every id of :data:`ID_FIELDS` is in [0, vocab_size)."""
    for name in ID_FIELDS:
        t = batch.get(name)
        if t is None or not t.numel():
            continue
        bad = (t < 0) | (t >= vocab_size)
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            value = int(t[tuple(at)])
            raise InputError(f"token id {value} at index {at} is outside the model's vocabulary "
                             f"[0, {vocab_size})", source=source, key=name)


def check_rollout_values(batch: RolloutBatch, *, vocab_size: int | None,
                         source: str | None = None) -> RolloutBatch:
    """:func:`check_shapes`, then :func:`check_token_ids` when the vocabulary size is known;
    returns ``batch``."""
    check_shapes(batch, source=source)
    if vocab_size is not None:
        check_token_ids(batch, vocab_size=vocab_size, source=source)
    return batch


def vocab_size_of(*model_configs: dict | None) -> int | None:
    """The smallest ``vocab_size`` of the models' config.json dicts (None when none says)."""
    sizes = [c.get("vocab_size") for c in model_configs if isinstance(c, dict)]
    sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool)]
    return min(sizes) if sizes else None

