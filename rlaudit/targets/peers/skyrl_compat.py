"""What differs between SkyRL releases (the ``skyrl`` package from 0.1), read from the installed
release's functions, for the SkyRL adapter (``skyrl.py``).

- :func:`batch_tensors`: the trainer's ``convert_prompts_responses_to_batch_tensors``. From 0.4 it
  takes the pad token id; before, a tokenizer, of which it reads only ``pad_token_id`` (a
  stand-in carrying it is handed). The adapter lays the per-token fields out right-aligned, as
  the function does from 0.2; the 0.1 function right-pads responses instead (left-aligned), so
  before using it the layout is read off the function itself on a two-row probe, and a release
  laying responses out otherwise is ``unsupported`` for the stages built on it.
- :func:`require_advantage_scaling`: the adapter's ``policy_loss`` mirrors the trainer's
  mini-batch advantage scaling (``ppo_utils.apply_loss_reduction_to_advantages_minibatch``,
  present from 0.2); a release without it reduces inside its loss functions, which the adapter
  does not mirror: ``unsupported``.
- :func:`require_microbatch_iterator`: ``worker_utils.get_microbatch_iterator`` (sample- and
  token-based micro-batching, present from 0.3); 0.2 has only ``BatchIterator`` (by sample
  count), which the adapter's ``make_microbatches`` does not drive: ``unsupported``.
"""

from __future__ import annotations

from types import SimpleNamespace

from rlaudit.targets.contract import UnsupportedFeature
from rlaudit.targets.contract.adapter import accepts

#: the pad token id rlaudit's conversion uses (any id: padded positions are masked)
PAD_ID = 0
#: what the trainer's conversion returns that the adapter reads, in order
KEPT = 6


def release(sky) -> str:
    return f"skyrl-{sky.version}"


def right_aligned(convert, pad) -> bool:
    """Whether ``convert`` puts a short response at the right edge of the response columns
    (a probe: rows with responses of 1 and 2 tokens)."""
    out = convert(pad, [[1], [1]], [[2], [2, 3]], [[0.0], [0.0, 0.0]], [[1.0], [1.0, 1.0]])
    return bool(out[2][0, -1])


def batch_tensors(sky, prompts, responses, rewards, loss_masks, logprobs):
    """``(sequences, attention_mask, response_mask, rewards, loss_mask, rollout_logprobs)`` from
    the release's own conversion (module docstring)."""
    convert = sky.preprocess.convert_prompts_responses_to_batch_tensors
    pad = PAD_ID if accepts(convert, "pad_token_id") else SimpleNamespace(pad_token_id=PAD_ID)
    if not right_aligned(convert, pad):
        raise UnsupportedFeature(
            "right-aligned response tensors from convert_prompts_responses_to_batch_tensors "
            "(this release right-pads responses)", release=release(sky),
            reason="the adapter converts per-token fields for SkyRL >= 0.2's layout")
    return convert(pad, prompts, responses, rewards, loss_masks, logprobs)[:KEPT]


def require_advantage_scaling(sky) -> None:
    """UnsupportedFeature unless the release scales advantages per mini-batch as the adapter's
    ``policy_loss`` mirrors (module docstring)."""
    if not hasattr(sky.ppo, "apply_loss_reduction_to_advantages_minibatch"):
        raise UnsupportedFeature(
            "ppo_utils.apply_loss_reduction_to_advantages_minibatch (the mini-batch advantage "
            "scaling the adapter's policy_loss mirrors)", release=release(sky),
            reason="this release reduces inside its loss functions; supported from SkyRL 0.2")


def require_microbatch_iterator(sky) -> None:
    """UnsupportedFeature unless the release has the micro-batch iterator factory the adapter's
    ``make_microbatches`` calls (module docstring)."""
    if not hasattr(sky.workers, "get_microbatch_iterator"):
        raise UnsupportedFeature(
            "worker_utils.get_microbatch_iterator (sample- and token-based micro-batching)",
            release=release(sky), reason="this release cuts by sample count only "
                                         "(BatchIterator); supported from SkyRL 0.3")


#: the releases SkyRL's train_step is mapped on: skyrl_cpu names 0.4's CUDA call sites by
#: file:line and skyrl_train calls 0.4's trainer steps
TRAIN_STEP_RELEASES = ("0.4.",)
#: why an earlier release's worker or trainer is not mapped (read off each release's code)
TRAIN_STEP_BLOCKERS = {
    "0.1.": "its trainer right-pads responses and its worker reduces the loss inside the loss "
            "functions (no mini-batch advantage scaling before 0.2)",
    "0.2.": "its worker cuts micro-batches by sample count only (BatchIterator; "
            "get_microbatch_iterator arrived in 0.3)",
    "0.3.": "its worker calls CUDA at other lines (workers/worker.py:844,1111,1191,1349,1421,"
            "1495) than the 0.4 sites skyrl_cpu answers, and its peer directory lacks the "
            "trainer's imports (peft, accelerate, datasets, torchdata, orjson)",
}


def train_step_unsupported(version: str) -> str:
    """Why SkyRL ``version``'s own training step is not mapped ("" when it is)."""
    if version.startswith(TRAIN_STEP_RELEASES):
        return ""
    why = next((w for v, w in TRAIN_STEP_BLOCKERS.items() if version.startswith(v)),
               "a release train_step was not written against")
    return f"train_step is mapped on SkyRL 0.4 only; skyrl-{version}: {why}"


__all__ = ["batch_tensors", "release", "require_advantage_scaling",
           "require_microbatch_iterator", "right_aligned",
           "train_step_unsupported"]
