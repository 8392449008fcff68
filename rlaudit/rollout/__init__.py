"""rlaudit.rollout: rollout engines returning :class:`~rlaudit.data.batch.RolloutBatch` objects.

- :func:`sample` (``sampler.py``): the reference sampler, plain torch on an HF model.
- :class:`VllmEngine` (``vllm_engine.py``): real vLLM; ``vllm`` is imported only when an engine
  is created (:func:`vllm_available` checks without importing).
- ``prompts.py``: prompt validation and text encoding.

Both engines share the layout and the log-prob semantics documented in ``sampler.py``.
Names are resolved lazily to keep ``import rlaudit.rollout`` cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "sample": "sampler", "SamplingParams": "sampler", "processed_log_probs": "sampler",
    "LOGPROBS_MODE": "sampler",
    "VllmEngine": "vllm_engine", "vllm_available": "vllm_engine",
    "check_prompt_ids": "prompts", "encode_prompts": "prompts", "DEFAULT_PROMPTS": "prompts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
