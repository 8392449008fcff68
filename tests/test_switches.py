"""Every ``RLAUDIT_*`` environment switch is named in rlaudit/switches.py only, and listed in
docs/internals.md's "Switches" table (read from the source with ``ast``: nothing is imported).

A switch named anywhere else (``os.environ.get("RLAUDIT_X")``) would be read with its own
default and its own error message; one missing from the table is a switch nobody can find.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlaudit"
SWITCHES = PACKAGE / "switches.py"
DOCS = ROOT / "docs" / "internals.md"
NAME = re.compile(r"^RLAUDIT_[A-Z0-9_]+$")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the module, class and function docstring nodes (prose may mention a switch)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _named_switches(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every string literal in ``path`` that is a switch's name, or that reads
    one from ``os.environ`` (docstrings and help text may mention a switch: they do not read it)."""
    src = path.read_text()
    tree = ast.parse(src)
    skip = _docstrings(tree)
    found = [(n.lineno, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
             and NAME.match(n.value)]
    found += [(i, line.strip()) for i, line in enumerate(src.splitlines(), 1)
              if re.search(r"environ\S*\(?\s*[\[(]?[\"']RLAUDIT_", line)]
    return found


def _switches() -> list[str]:
    tree = ast.parse(SWITCHES.read_text())
    return [node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str) and NAME.match(node.value.value)]


def test_switches_are_named_in_switches_py_only():
    elsewhere = [f"{path.relative_to(ROOT)}:{line}: {name}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path != SWITCHES
                 for line, name in _named_switches(path)]
    assert not elsewhere, ("RLAUDIT_* switches named outside rlaudit/switches.py (add an "
                           "accessor there and call it):\n" + "\n".join(elsewhere))


def test_every_switch_is_in_the_docs_table():
    docs = DOCS.read_text()
    section = docs.split("## Switches", 1)[1].split("\n## ", 1)[0] if "## Switches" in docs else ""
    rows = set(re.findall(r"^\| `(RLAUDIT_[A-Z0-9_]+)` \|", section, re.MULTILINE))
    names = _switches()
    assert len(names) >= 14
    assert set(names) == rows, (f"missing from docs/internals.md's Switches table: "
                                f"{sorted(set(names) - rows)}; in the table but not in "
                                f"rlaudit/switches.py: {sorted(rows - set(names))}")


def test_the_checker_catches_a_switch_read_elsewhere(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Mentions RLAUDIT_X in prose."""\nimport os\n'
                   'X = os.environ.get("RLAUDIT_X", "1")\n')
    assert [line for line, _ in _named_switches(bad)] == [3, 3]
