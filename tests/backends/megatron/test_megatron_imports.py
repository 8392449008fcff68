"""rlaudit.backends.megatron.imports: megatron-core imported with ``torch.compile`` deferred to
each decorated function's first call (its wrappers otherwise import torch's compiler stack at
import: 0.7-1.0 s of megatron-core's 1.1-1.4 s here), the compile itself unchanged."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rlaudit.backends.megatron.imports import deferred_compile

REPO = Path(__file__).resolve().parents[3]


class Spy:
    """A stand-in for torch.compile: records (function, kwargs), returns a function that
    doubles what the compiled function returns (so a result says which one ran)."""

    def __init__(self):
        self.calls = []

    def __call__(self, fn, **kwargs):
        self.calls.append((fn, kwargs))
        return lambda *a, **k: 2 * fn(*a, **k)


def test_the_compile_happens_at_the_first_call_with_the_decorations_arguments():
    spy = Spy()
    deferred = deferred_compile(spy)

    @deferred
    def bare(x, y=1):
        """doc"""
        return x + y

    @deferred(dynamic=True, fullgraph=False)
    def with_args(x):
        return 10 * x

    assert spy.calls == []                          # nothing compiled at decoration
    assert bare.__name__ == "bare" and bare.__doc__ == "doc"
    assert bare(3, y=4) == 14 and with_args(2) == 40   # the compiled functions serve the calls
    assert bare(1) == 4
    assert [(fn.__name__, kw) for fn, kw in spy.calls] == [
        ("bare", {}), ("with_args", {"dynamic": True, "fullgraph": False})]  # once each


def test_concurrent_first_calls_compile_once():
    spy = Spy()
    fn = deferred_compile(spy)(lambda x: x + 1)
    results = []
    threads = [threading.Thread(target=lambda: results.append(fn(1))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [4] * 8 and len(spy.calls) == 1


IMPORT = """
import sys
sys.path[:0] = [%r]
import torch
real = torch.compile
from rlaudit.backends.megatron.imports import import_megatron
import_megatron()
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_geglu
print("megatron.core" in sys.modules,                    # imported
      "torch._inductor.compile_fx" in sys.modules,      # the compiler stack: not imported
      torch.compile is real,                            # restored
      jit.jit_fuser is not real,                        # megatron's decorator stays deferring
      fused_bias_geglu.geglu.__wrapped__.__name__,      # a fused function: megatron's own,
      fused_bias_geglu.geglu.__code__.co_qualname.split(".")[0])  # ... in the deferring wrapper
"""


@pytest.mark.megatron
def test_megatron_is_imported_without_the_compiler_and_torch_compile_is_restored():
    pytest.importorskip("megatron.core")
    out = subprocess.run([sys.executable, "-c", IMPORT % str(REPO)], capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.split() == ["True", "False", "True", "True", "geglu", "deferred_compile"], \
        out.stderr[-3000:]
