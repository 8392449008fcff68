"""rlaudit.heap.freeze_long_lived: one collection and gc.freeze() per process, and one more
after modules were imported (a trainer importing its framework in its first step); a reference
cycle made afterwards is still freed by a collection. In a fresh process: the test session's
own heap is already frozen (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CODE = """
import gc, sys, weakref
sys.path[:0] = [%r]
from rlaudit import heap
calls = []
real = gc.collect
gc.collect = lambda *a: calls.append(1) or real(*a)
import torch  # something long-lived to freeze
heap.freeze_long_lived(); heap.freeze_long_lived()
frozen = gc.get_freeze_count()
assert "xml.dom.minidom" not in sys.modules
import xml.dom.minidom  # a late import: frozen by the next call, and only by it
heap.freeze_long_lived(); heap.freeze_long_lived()
late = gc.get_freeze_count() - frozen
class Node: pass
a, b = Node(), Node(); a.b, b.a = b, a
alive = weakref.ref(a); del a, b
real()
print(len(calls), frozen > 10000, late > 100, alive() is None)
"""


def test_the_long_lived_heap_is_frozen_once_per_import_and_later_garbage_is_still_collected():
    out = subprocess.run([sys.executable, "-c", CODE % str(REPO)], capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.split() == ["2", "True", "True", "True"], out.stderr[-2000:]
