"""Layers import one way: spaces <- evaluators <- search <- {launch, reports} <- cli.

Walks every module of the package (module-level and function-level imports alike: a lazy import is still a
dependency) and fails on an edge that points up, or sideways between launch and reports. spaces/, evaluators/
and search/ must also not import torch or ray at module level (the analytic path stays light).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stratagem"

LAYER: dict[str, int] = {
    "stratagem": 0,  # the root package (__version__, re-exports): importing any submodule runs it anyway
    "errors": 0,
    "units": 0,
    "quantities": 0,
    "procfs": 0,
    "files": 0,
    "spaces": 1,
    "evaluators": 2,
    "search": 3,
    "launch": 4,
    "reports": 4,
    "cli": 5,
}
"""Top-level part of the package -> its layer; a module may import from its own layer's part and lower layers."""

KNOWN: set[tuple[str, str]] = {("stratagem.files", "stratagem.errors"), ("stratagem.quantities", "stratagem.units")}
"""(importing module, imported module) edges tolerated, each with its reason: files raises errors' StratagemError
(both layer 0, below everything); quantities formats in units' KIB..TIB (both layer 0). (The real-run evaluator moved from evaluators/ to launch/runners/real.py,
issue 11 item 5.)"""

LIGHT = ("spaces", "evaluators", "search")
"""Parts that must not import torch or ray at module level."""
HEAVY = ("torch", "ray")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def _imports(name: str, path: Path, tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in the file; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(n) for n in _module_level(tree.body)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno, id(node) in top_level))
    return found


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run on import: the body, into if/try blocks (not `if TYPE_CHECKING:`), not into defs."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                out += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _module_level(node.body) + _module_level(node.orelse) + _module_level(node.finalbody)
            for handler in node.handlers:
                out += _module_level(handler.body)
        elif isinstance(node, ast.With):
            out += _module_level(node.body)
    return out


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "stratagem"


MODULES = _modules()


def test_every_part_has_a_layer() -> None:
    unknown = sorted({_part(m) for m, _ in MODULES} - set(LAYER))
    assert not unknown, f"stratagem parts without a layer: {unknown}; add them to LAYER in tests/test_layers.py"


def test_imports_point_down() -> None:
    upward = []
    for name, path in MODULES:
        if name == "stratagem":
            continue  # the root package re-exports the public API from every layer: a facade, not a layer
        mine = _part(name)
        for target, line, _ in _imports(name, path, ast.parse(path.read_text(), str(path))):
            if target != "stratagem" and not target.startswith("stratagem."):
                continue
            theirs = _part(target)
            if theirs == mine or (name, target) in KNOWN or theirs not in LAYER or mine not in LAYER:
                continue
            if LAYER[theirs] >= LAYER[mine] and theirs != "stratagem":
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} imports {target} "
                              f"({mine} is layer {LAYER[mine]}, {theirs} layer {LAYER[theirs]})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("part", LIGHT)
def test_light_parts_import_no_torch_or_ray_at_module_level(part: str) -> None:
    heavy = []
    for name, path in MODULES:
        if _part(name) != part:
            continue
        for target, line, top in _imports(name, path, ast.parse(path.read_text(), str(path))):
            if top and target.split(".")[0] in HEAVY:
                heavy.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target} at module level")
    assert not heavy, "\n".join(heavy)


def test_the_walk_sees_an_upward_edge(tmp_path: Path) -> None:
    """The checker itself: a spaces module importing evaluators is reported, a lazy one too."""
    src = "from stratagem.evaluators import evaluate\ndef f():\n    import stratagem.search.records\n"
    path = tmp_path / "stratagem" / "spaces" / "bad.py"
    found = _imports("stratagem.spaces.bad", path, ast.parse(src))
    assert [(t, top) for t, _, top in found] == [("stratagem.evaluators", True), ("stratagem.search.records", False)]
    assert all(LAYER[_part(t)] > LAYER["spaces"] for t, _, _ in found)
    rel = _imports("stratagem.search.runner", tmp_path / "runner.py", ast.parse("from ..launch import x\n"))
    assert rel[0][0] == "stratagem.launch"


# ---- one address per name -------------------------------------------------------------------------------------
ROOT = PACKAGE.parent


def _names(tree: ast.Module) -> tuple[set[str], list[str], dict[str, str]]:
    """(names the module defines at module level, its __all__, name -> module it imports the name from)."""
    defined: set[str] = set()
    exported: list[str] = []
    imported: dict[str, str] = {}
    for node in _module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                exported = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported |= {a.asname or a.name: node.module for a in node.names}
    return defined, exported, imported


TREES = {name: (path, ast.parse(path.read_text(), str(path))) for name, path in MODULES}
NAMES = {name: _names(tree) for name, (_, tree) in TREES.items()}


def test_implementation_modules_export_only_what_they_define() -> None:
    """A module's __all__ names its own definitions; a package's __init__ (its public face) names those of the
    modules under it, never another package's."""
    wrong = []
    for name, (path, _) in TREES.items():
        defined, exported, imported = NAMES[name]
        for x in exported:
            if x in defined:
                continue
            source = imported.get(x, "")
            if path.name == "__init__.py" and source.startswith(name + "."):
                continue
            wrong.append(f"{path.relative_to(ROOT)}: __all__ lists {x} (from {source or '?'})")
    assert not wrong, "names exported from a second address:\n" + "\n".join(wrong)


def _with_code_strings(tree: ast.Module) -> list[ast.Module]:
    """The file and the Python source in its string constants (`python -c` programs a test runs)."""
    out = [tree]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "from stratagem" in node.value:
            try:
                out.append(ast.parse(node.value))
            except SyntaxError:  # prose, or a fragment of a program built in pieces
                continue
    return out


def test_every_import_uses_the_names_own_address() -> None:
    """`from stratagem.X import n` (product, tests, benches) finds n defined in X, or X is a package that lists
    it: no name reached through a module that merely imports it."""
    wrong = []
    files = [p for _, p in MODULES] + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    for path in files:
        for node in (n for tree in _with_code_strings(ast.parse(path.read_text(), str(path))) for n in ast.walk(tree)):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in NAMES):
                continue
            defined, exported, _ = NAMES[node.module]
            package = TREES[node.module][0].name == "__init__.py"
            for a in node.names:
                if a.name in defined or f"{node.module}.{a.name}" in NAMES or (package and a.name in exported):
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} from {node.module}")
    assert not wrong, "names imported through a second address:\n" + "\n".join(wrong)


# ---- no circle between files --------------------------------------------------------------------------------
def _file_edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: at module level, inside functions and under TYPE_CHECKING
    alike (each is an edge a reader follows); `from pkg import sub` points at the submodule."""
    edges: dict[str, set[str]] = {name: set() for name in TREES}
    for name, (path, tree) in TREES.items():
        for target, _, _ in _imports(name, path, tree):
            if target in TREES and target != name:
                edges[name].add(target)
        for node in ast.walk(tree):  # `from pkg import sub`: _imports records pkg; the edge is to pkg.sub
            if isinstance(node, ast.ImportFrom):
                base = next(t for t, line, _ in _imports(name, path, ast.Module(body=[node], type_ignores=[])))
                subs = {f"{base}.{a.name}" for a in node.names} & set(TREES)
                if subs and len(subs) == len(node.names):
                    edges[name].discard(base)
                edges[name] |= subs - {name}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_files() -> None:
    """The modules' import graph (lazy and TYPE_CHECKING imports included) has no circle, inside a package or
    across: every module can be read after the ones it imports."""
    edges = _file_edges()
    circles = _circles(edges)
    lines = [" <-> ".join(c) + ": " + "; ".join(f"{v} -> {w}" for v in c for w in sorted(edges[v] & set(c)))
             for c in circles]
    assert not circles, "import circles:\n" + "\n".join(lines)


def test_the_circle_check_sees_a_lazy_and_a_type_checking_edge() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    lazy = ast.parse("def f():\n    from stratagem.search import session\n")
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stratagem.search.measure import Stopped\n")
    found = _imports("stratagem.search.x", PACKAGE / "search" / "x.py", lazy)
    found += _imports("stratagem.search.x", PACKAGE / "search" / "x.py", typed)
    assert {t for t, _, _ in found} >= {"stratagem.search", "stratagem.search.measure"}
