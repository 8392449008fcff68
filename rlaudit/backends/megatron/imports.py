"""Import megatron-core without building its fused kernels' ``torch.compile`` wrappers up front.

megatron-core decorates its fused elementwise functions (bias-GeLU, bias-SwiGLU, RoPE, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. ``torch.compile(fn)``
compiles nothing until ``fn`` is first called, but it builds its wrapper at decoration, and the
first one imports torch's compiler stack (``torch._inductor.compile_fx`` and what it pulls in).
Measured here on 2 cores: importing megatron-core's modules after torch and transformers takes
1.1-1.4 s, of which 0.7-1.0 s is that, in every process that imports megatron -- the forkserver
that CPU ranks are forked from (no rank of any group can start before its preload ends), each
spawned rank. rlaudit's GPT models never call those functions: every fusion is off
(``rlaudit.backends.megatron.model.gpt_config_from_hf``).

:func:`import_megatron` imports megatron-core with ``torch.compile`` standing in as
:func:`deferred_compile`: a decorated function is handed to the real ``torch.compile`` (same
arguments) on its first call, and the compiled function serves that call and every later one --
what torch.compile's own wrapper does, built later. ``torch.compile`` is restored when the import
ends; megatron's ``jit_fuser`` keeps the deferring decorator, so a function megatron decorates
later is treated the same way.
"""

from __future__ import annotations

import functools
import sys
import threading

def deferred_compile(compile_fn):
    """A stand-in for ``compile_fn`` (``torch.compile``) that calls it on the decorated
    function's first call instead of at decoration; used bare (``@deferred``) or with arguments
    (``@deferred(dynamic=True)``), like ``torch.compile``."""

    def deferred(model=None, **kwargs):
        if model is None:
            return lambda fn: deferred(fn, **kwargs)
        compiled = []
        lock = threading.Lock()

        @functools.wraps(model)
        def call(*args, **kw):
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(compile_fn(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    return deferred


def import_megatron() -> None:
    """Import megatron-core with ``torch.compile`` deferred while it loads (see the module
    docstring); nothing to do when it is imported already."""
    if "megatron.core" in sys.modules:
        return
    import torch  # lazy: only to import megatron-core, which needs torch anyway

    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        # lazy: importing megatron-core under the deferred compile is this function's job
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real
