"""The package's shape, checked from its source: floors that import one way, no import circle,
no private name crossing a file, function-level imports only where tagged ``# lazy: why``, and
modules and functions a reader can hold in their head (docs/internals.md, "Layers").

Each check reads ``rlaudit/`` with ``ast`` (nothing is imported), so it runs in well under a
second and fails naming the file, the line and the rule.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlaudit"

#: Floors, lowest first: a module may import from its own floor (when that makes no circle) and
#: from floors below it, never from one above. The longest matching prefix names a module's floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("rlaudit", "rlaudit.errors", "rlaudit.stamps", "rlaudit.heap", "rlaudit.metrics",
     "rlaudit.switches", "rlaudit.quiet", "rlaudit.dicts", "rlaudit.config", "rlaudit.catalogue",
     "rlaudit.algo.registry"),
    ("rlaudit.algo", "rlaudit.data"),
    ("rlaudit.model", "rlaudit.strategies"),
    ("rlaudit.update",),
    ("rlaudit.rollout", "rlaudit.backends"),
    ("rlaudit.trainer",),
    ("rlaudit.verdict",),
    ("rlaudit.scenarios",),
    ("rlaudit.targets",),
    ("rlaudit.report", "rlaudit.executors"),
    ("rlaudit.cli", "rlaudit.pytest_plugin"),
)

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
#: Functions allowed past MAX_FUNCTION_LINES, each with what makes it long.
LONG_FUNCTIONS: dict[str, str] = {}
#: What a package face may define besides imports: a lazy re-export (PEP 562).
LAZY_FACE = frozenset({"__getattr__", "__dir__"})
#: Import circles allowed, each named in docs/internals.md with why it is right.
ALLOWED_CIRCLES: tuple[frozenset[str], ...] = ()


@dataclass(frozen=True)
class Import:
    source: str          # importing module
    target: str          # imported rlaudit module (longest existing prefix)
    names: tuple[str, ...]
    line: int
    in_function: bool
    tagged: bool         # "# lazy:" on the statement's lines or the line above


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, mods: dict[str, Path]) -> str | None:
    while name:
        if name in mods:
            return name
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


def imports() -> list[Import]:
    """Every import statement of the package (module-level and function-level)."""
    return _imports_of(PACKAGE)


@functools.lru_cache(maxsize=2)
def _imports_of(package: Path) -> list[Import]:
    mods = modules()
    out = []
    for mod, path in mods.items():
        src = path.read_text()
        lines = src.splitlines()
        tree = ast.parse(src)
        in_func: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_func.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            span = lines[max(node.lineno - 2, 0): node.end_lineno]
            tagged = any("# lazy:" in s for s in span)
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names]
            else:
                base = _resolve(mod, path, node)
                targets = [(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base, (a.name,))
                           for a in node.names]
                if any(t != base for t, _ in targets) and base in mods:
                    # ``from pkg import sub`` runs pkg's face first: a face that imports this
                    # module back makes a circle, which ``import pkg.sub as sub`` does not
                    targets.append((base, ()))
            for name, names in targets:
                target = _known(name, mods) if name.startswith("rlaudit") else None
                out.append(Import(mod, target or name, names, node.lineno, id(node) in in_func,
                                  tagged))
    return out


def floor(mod: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{mod} is on no floor: add it to FLOORS and docs/internals.md"
    return level


def internal(imps: list[Import]) -> list[Import]:
    return [i for i in imps if i.target.startswith("rlaudit") and i.target != i.source]


def circles(imps: list[Import]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for i in internal(imps):
        graph.setdefault(i.source, set()).add(i.target)
        graph.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


# ---- the tests ------------------------------------------------------------------------------------

def test_the_checker_sees_the_package():
    imps = imports()
    assert len(modules()) > 100
    assert any(i.target == "rlaudit.errors" for i in imps)


def test_no_import_circle():
    found = [c for c in circles(imports()) if frozenset(c) not in ALLOWED_CIRCLES]
    assert not found, "import circles:\n" + "\n".join(" -> ".join(sorted(c)) for c in found)


def test_imports_flow_down_the_floors():
    upward = [f"{i.source}:{i.line} imports {i.target} (floor {floor(i.source)} -> "
              f"{floor(i.target)})"
              for i in internal(imports()) if floor(i.target) > floor(i.source)]
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_no_private_name_crosses_a_file():
    crossing = [f"{i.source}:{i.line} imports {n} from {i.target}"
                for i in internal(imports()) for n in i.names
                if n.startswith("_") and not n.startswith("__")]
    crossing += [f"{i.source}:{i.line} imports the private module {i.target}"
                 for i in internal(imports())
                 if any(p.startswith("_") and not p.startswith("__")
                        for p in i.target.split(".")[1:])
                 and not i.source.startswith(i.target.rsplit(".", 1)[0] + ".")]
    crossing += private_attributes()
    assert not crossing, "private names imported across files:\n" + "\n".join(crossing)


def private_attributes() -> list[str]:
    """``mod._name`` where ``mod`` is an rlaudit module imported under a name (``import
    rlaudit.x as mod``, ``from rlaudit.scenarios import localise as mod``): a private name
    crossing a file by attribute instead of by import."""
    mods = modules()
    found = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names
                                if a.asname and a.name in mods})
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, path, node)
                aliases.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names
                                if f"{base}.{a.name}" in mods})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != mod
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{mod}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_function_level_imports_say_why():
    untagged = [f"{i.source}:{i.line} imports {i.target}" for i in imports()
                if i.in_function and not i.tagged]
    assert not untagged, ("function-level imports without a '# lazy: why' tag (hoist them, or "
                          "say why they must wait):\n" + "\n".join(sorted(set(untagged))))


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function, its docstring not counted."""
    lines = fn.end_lineno - fn.lineno + 1
    first = fn.body[0] if fn.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_modules_and_functions_fit_in_a_head():
    long = []
    for mod, path in modules().items():
        src = path.read_text()
        n = len(src.splitlines())
        if n > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {n} lines")
        for fn in ast.walk(ast.parse(src)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{mod}.{fn.name}"
                if _body_lines(fn) > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{fn.lineno} {fn.name}: "
                                f"{_body_lines(fn)} lines")
    assert not long, "too long to hold in a head:\n" + "\n".join(long)


def test_package_faces_only_re_export():
    """A package's ``__init__`` imports its modules and re-exports names (a module ``__getattr__``
    may re-export lazily, to keep torch out of ``rlaudit list``); code lives in its modules."""
    heavy = []
    for mod, path in modules().items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and node.name not in LAZY_FACE):
                heavy.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not heavy, "code in package faces:\n" + "\n".join(heavy)


def test_the_checker_catches_what_it_claims(tmp_path, monkeypatch):
    """The rules fail on a package that breaks them (so a green here means something)."""
    pkg = tmp_path / "rlaudit"
    (pkg / "algo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("from rlaudit.algo.kl import _private\n")
    (pkg / "algo" / "__init__.py").write_text("")
    (pkg / "algo" / "kl.py").write_text(
        "from rlaudit.errors import x\n"
        "def f():\n    import json\n    return json\n"
        "def g():\n    # lazy: heavy\n    import torch\n    return torch\n")
    (pkg / "algo" / "use.py").write_text("from rlaudit.algo import kl as K\nK._hidden()\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    imps = imports()
    assert circles(imps) == [{"rlaudit.errors", "rlaudit.algo.kl"}]
    up = [i for i in internal(imps) if floor(i.target) > floor(i.source)]
    assert [(i.source, i.target) for i in up] == [("rlaudit.errors", "rlaudit.algo.kl")]
    untagged = [i.target for i in imps if i.in_function and not i.tagged]
    assert untagged == ["json"]
    assert [n for i in internal(imps) for n in i.names if n.startswith("_")] == ["_private"]
    assert private_attributes() == ["rlaudit.algo.use:2 uses rlaudit.algo.kl._hidden"]


#: Words that narrate the project's history instead of explaining the code: which audit found a
#: bug, on which date, under which issue. History lives in commit messages and docs/findings.md.
HISTORY = re.compile(
    r"blind audit|audit round|(first|second|third|fourth|fifth|sixth|seventh|eighth) audit"
    r"|\bissue #\d+|\(#\d+\)|found (it|this|them) on \d{4}-\d\d-\d\d|audit, \d{4}-\d\d-\d\d",
    re.IGNORECASE)


def test_comments_explain_the_code_not_its_history():
    narrating = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                narrating.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not narrating, ("comments that narrate history (say why in the code's terms, name the "
                           "bug class):\n" + "\n".join(narrating))


def test_documents_the_code_points_to_exist():
    """A docstring or comment naming a ``.md`` page names one in the repository (``docs/...``,
    ``README.md``, ...), not a design note that lives elsewhere."""
    repo = PACKAGE.parent
    # what rlaudit writes (the run report, the release matrix), not pages to read
    generated = {"report.md", "peers-matrix.md"}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for page in re.findall(r"[\w./-]*\w\.md\b", line):
                inside = not page.startswith("..")
                if page not in generated and not (inside and ((repo / page).exists()
                                                              or (repo / "docs" / page).exists())):
                    missing.append(f"{path.relative_to(repo)}:{n}: {page}")
    assert not missing, "pages named in the code that the repository lacks:\n" + "\n".join(missing)
