"""Every public function, method and class of the package says in one line what it is for, and the code says why
in its own terms (an engine file, a paper, a measurement), never by an issue number its reader does not have."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stratagem"


def _undocumented(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    out: list[str] = []

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                if ast.get_docstring(node) is None:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {prefix}{node.name}")
                if isinstance(node, ast.ClassDef):
                    walk(node.body, f"{prefix}{node.name}.")

    walk(ast.parse(path.read_text(), str(path)).body, "")
    return out


def test_public_definitions_have_docstrings() -> None:
    missing = [m for p in sorted(PACKAGE.rglob("*.py")) for m in _undocumented(p)]
    assert not missing, "public definitions without a docstring:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_docstring(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text('def f():\n    """Doc."""\n\n\nclass C:\n    def g(self):\n        pass\n\n    def _h(self):\n        pass\n')
    assert _undocumented(path, tmp_path) == ["x.py:5: C", "x.py:6: C.g"]


def test_code_cites_no_issue_numbers() -> None:
    cited = [f"{p.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
             for p in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.js"), *(PACKAGE.parent / "bench").rglob("*.py")])
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bissue\s+\d+", line, re.I)]
    assert not cited, "say why in the code's own terms:\n" + "\n".join(cited)
