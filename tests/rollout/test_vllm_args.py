"""The vLLM engine module without starting vLLM: lazy import, argument errors raised first."""

from __future__ import annotations

import importlib
import sys

import pytest

from rlaudit.errors import InputError


def test_module_import_does_not_import_vllm():
    if "vllm" in sys.modules:
        pytest.skip("vllm was already imported in this process (a vLLM test ran first)")
    module = importlib.import_module("rlaudit.rollout.vllm_engine")
    import rlaudit.rollout as rollout

    module.vllm_available()
    assert rollout.VllmEngine is module.VllmEngine
    assert "vllm" not in sys.modules


def test_bad_arguments_fail_before_vllm_starts(tmp_path):
    from rlaudit.rollout.vllm_engine import VllmEngine

    with pytest.raises(InputError, match="logprobs_mode cannot be changed"):
        VllmEngine(tmp_path, logprobs_mode="raw_logprobs")
    with pytest.raises(InputError, match=r"missing config\.json"):
        VllmEngine(tmp_path)
