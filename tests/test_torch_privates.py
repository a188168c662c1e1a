"""Every private torch name meshstate uses, in one list per compatibility module, checked
against the running torch: a torch that moves one fails here, naming it.

The names are read from the source (each ``torch.…`` attribute chain or import with a part
that starts with ``_``); outside the compatibility modules there must be none.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "meshstate"
COMPATIBILITY = ("core/compat.py", "simulation/local_compat.py", "testing/torch_internals.py")
"""The library's, the simulation's, and the harness's and benchmark's (docs/design.md)."""


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def private_torch_names(path: Path) -> set[str]:
    """The private torch names ``path`` reaches: imported, or read from an imported torch module."""
    tree = ast.parse(path.read_text())
    torch_names: dict[str, str] = {}
    found_imports: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    if _private(alias.name):  # ``import torch._dynamo`` names it without a use
                        found_imports.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                torch_names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = found_imports | {name for name in torch_names.values() if _private(name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (chain := _dotted(node)):
            head, *rest = chain.split(".")
            if head in torch_names and _private(full := ".".join([torch_names[head], *rest])):
                found.add(full)
    return found


def resolves(name: str) -> bool:
    """Whether ``name`` is there on the running torch: a module, or a chain of attributes of one."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                value = getattr(value, part)
        except AttributeError:
            return False
        return True
    return False


def test_no_private_torch_name_outside_the_compatibility_modules():
    outside = {str(path.relative_to(PACKAGE)): sorted(names)
               for path in sorted(PACKAGE.rglob("*.py"))
               if str(path.relative_to(PACKAGE)) not in COMPATIBILITY
               and (names := private_torch_names(path))}
    assert outside == {}


@pytest.mark.parametrize("module", COMPATIBILITY)
def test_every_private_torch_name_exists_on_this_torch(module):
    names = private_torch_names(PACKAGE / module)
    assert names, module  # the reader found the module's names
    assert sorted(name for name in names if not resolves(name)) == []
