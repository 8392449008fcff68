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


IMPORTING = """
import gc, sys, threading
sys.path[:0] = [%r]
from rlaudit import heap
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full.append(1))
if sys.argv[1] == "importing":
    with heap.importing():
        inside = gc.isenabled()
        with heap.importing():  # a nested block: leaving it neither collects nor freezes
            import torch  # the heap grows several times over: CPython collects on its own
        import json.tool
        during = len(full)
    after = len(full)
else:
    inside = gc.isenabled()
    import torch
    during = after = len(full)
print(inside, during, after, gc.isenabled(), gc.get_freeze_count() > 10000)
"""


NO_COLLECT = """
import gc, sys
sys.path[:0] = [%r]
from rlaudit import heap
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full.append(1))
inner = {"default": None, "collect": True}[sys.argv[1]]
with heap.importing(collect=False):  # the forkserver's preload
    import torch
    with heap.importing(collect=inner):  # the model-code import inside it (hf_import)
        import json.tool
print(len(full), gc.get_freeze_count() > 10000, gc.isenabled())
"""


def test_an_import_only_process_freezes_without_a_collection_unless_a_block_asks_for_one():
    def run(inner):
        out = subprocess.run([sys.executable, "-c", NO_COLLECT % str(REPO), inner],
                             capture_output=True, text=True, timeout=300)
        return out.stdout.split() or [out.stderr[-2000:]]

    # the nested block follows the outer one: frozen, no full collection at all
    assert run("default") == ["0", "True", "True"]
    # a block that asks for the collection gets it, once, at the end
    assert run("collect") == ["1", "True", "True"]


def _importing(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", IMPORTING % str(REPO), mode],
                         capture_output=True, text=True, timeout=300)
    return out.stdout.split() or [out.stderr[-2000:]]


def test_importing_keeps_full_collections_off_the_imports_and_freezes_them_once():
    # the same import without it: full collections on the way, nothing frozen
    inside, during, _, enabled, frozen = _importing("plain")
    assert inside == "True" and int(during) >= 2 and frozen == "False"
    # with it: none during the blocks, the one of the freeze at the outer one's end, collection
    # back on
    assert _importing("importing") == ["False", "0", "1", "True", "True"]


def test_importing_blocks_nest_across_threads_and_leave_a_disabled_collector_disabled():
    import gc
    import threading

    from rlaudit import heap

    was = gc.isenabled()
    try:
        gc.enable()
        entered, release, seen = threading.Event(), threading.Event(), {}

        def other():
            with heap.importing():
                entered.set()
                release.wait(30)
                seen["during"] = gc.isenabled()

        t = threading.Thread(target=other)
        with heap.importing():
            t.start()
            assert entered.wait(30)
        seen["first left"] = gc.isenabled()   # the other block still runs: still off
        release.set()
        t.join(30)
        assert seen == {"first left": False, "during": False} and gc.isenabled()
        gc.disable()
        with heap.importing():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
