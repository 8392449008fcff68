"""verl >= 0.9's Megatron engine (verl/workers/engine/megatron) on the CPU: where it stops.

The engine cannot train in float32 on the CPU without patching verl, so its column of
``--target verl`` is *unsupported* (never red), and the message names the call that stops it,
found by running verl's own code here:

1. ``McoreEngineConfig.__post_init__`` accepts only bf16 / fp16 (workers/config/engine.py:218 in
   0.9.1): :func:`blocked` builds the engine config as the worker would, in float32, and reports
   the assertion with its file and line;
2. past it (in bf16, on a GPU), the model goes through mbridge, which moves it with ``.cuda()``
   (mbridge/core/util.py:151), and megatron-core's DDP allocates its gradient buffers on
   ``torch.cuda.current_device()`` (param_and_grad_buffer.py:783).

The full path runs in the ``gpu``-marked test (tests/targets/peers/test_verl_mcore.py).
"""

from __future__ import annotations

import traceback
from pathlib import Path

from rlaudit.verdict.unsupported import UnsupportedFeature

#: what stops the engine after its config, on a host without CUDA (module docstring)
LATER = ("past it, mbridge moves the model with .cuda() (mbridge/core/util.py:151) and "
         "megatron-core's DDP allocates its buffers on torch.cuda.current_device() "
         "(megatron/core/distributed/param_and_grad_buffer.py:783)")


def config_error(dtype: str = "float32") -> str | None:
    """What verl's ``McoreEngineConfig`` says to ``dtype`` (None: accepted), with the file and
    line of verl that refused it."""
    try:
        # lazy: verl is an optional peer, imported when audited
        from verl.workers.config.engine import McoreEngineConfig
    except ImportError as e:       # a release without it: said, never a crash of the column
        return f"verl.workers.config.engine.McoreEngineConfig cannot be imported ({e})"
    try:
        McoreEngineConfig(dtype=dtype)
    except (AssertionError, ValueError) as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = "/".join(Path(frame.filename).parts[-4:])
        return f"{where}:{frame.lineno}: {frame.line} ({type(e).__name__}: {e})"
    return None


def blocked(version: str) -> None:
    """Raise the :class:`UnsupportedFeature` that says why the Megatron engine of verl
    ``version`` does not run here (module docstring)."""
    refused = config_error("float32")
    first = (f"McoreEngineConfig refuses float32: {refused}" if refused
             else "McoreEngineConfig accepts float32")
    raise UnsupportedFeature("the Megatron engine in float32 on the CPU",
                             release=f"verl {version}", reason=f"{first}; {LATER}")


__all__ = ["LATER", "blocked", "config_error"]
