"""Lazy re-exports for launch's packages: a public name loads its module (and torch or ray) on first use, so
importing a package, or the torch-free modules under it, stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package` whose public names live in the modules `table` names
    (name -> module path relative to `package`)."""
    module_globals = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        module_globals[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(module_globals) | set(table))

    return __getattr__, __dir__
