"""The package's shape: no import cycle, no module using another's private names.

What `docs/how-it-works.md` ("The modules") promises a contributor, checked by
reading the sources: each concern in one module, whose private names stay its
own, and modules that import each other in one direction only.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Final

import pytest

PACKAGE: Final = Path(__file__).parent.parent / "src" / "taskiq_deduplication"

#: Private names of other libraries that the package uses on purpose, each
#: with the one module allowed to and the reason.
FOREIGN_PRIVATE: Final = {
    # A namedtuple's documented method, underscored so as not to clash with fields.
    ("_client", "_replace"),
    ("cli", "_replace"),
    # taskiq's own way of building the message kiq sends (`taskiq dedup key`).
    ("cli", "_prepare_message"),
    ("testing", "_prepare_message"),
    ("locks", "_prepare_message"),
    # redis-py's connection internals, behind the one door that probes for them.
    ("_redis_wire", "_parser"),
    ("_redis_wire", "_host_error"),
    ("_redis_wire", "_writer"),
    ("_redis_wire", "_reader"),
}


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text("utf-8")) for path in PACKAGE.glob("*.py")}


def _runtime_imports(tree: ast.Module) -> set[str]:
    """The package modules ``tree`` imports at run time (not for type checking only)."""
    found: set[str] = set()
    checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking.update(id(inner) for inner in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "taskiq_deduplication"
        ):
            module = node.module or ""
            if module == "taskiq_deduplication":
                found.update(alias.name for alias in node.names)
            else:
                found.add(module.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.rsplit(".", 1)[-1]
                for alias in node.names
                if alias.name.startswith("taskiq_deduplication.")
            )
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = _modules()
    graph = {name: _runtime_imports(tree) & modules.keys() for name, tree in modules.items()}
    graph["__init__"] = set()  # the package's lazy exports import everything on demand
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                cycles.append([*path[path.index(target) :], target])
            elif len(path) < len(graph):
                visit(target, [*path, target])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, f"import cycles: {sorted({' -> '.join(c) for c in cycles})}"


def _own_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions, classes and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if name.startswith("_")}


def test_no_module_uses_another_modules_private_names() -> None:
    uses: list[str] = []
    for name, tree in _modules().items():
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "taskiq_deduplication"
            ):
                uses += (
                    f"{name}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                    and not alias.name.startswith("__")
                    and not (PACKAGE / f"{alias.name}.py").exists()  # a private module: ours
                )
            if not (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in {"self", "cls"}:
                continue
            if node.attr in own or (name, node.attr) in FOREIGN_PRIVATE:
                continue
            uses.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not uses, "private names used across modules:\n" + "\n".join(uses)


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda path: path.name)
def test_no_module_is_longer_than_a_reader_holds_at_once(path: Path) -> None:
    """A smell detector, not a shape (issue 33): past 550 lines a warning, past 900 a failure.

    Modules are shaped by meaning; a long one is worth a look (is it still one
    concept?), never a split of one concept in two to get under a number.
    """
    lines = len(path.read_text("utf-8").splitlines())
    if lines > 550:
        warnings.warn(f"{path.name} has {lines} lines: is it still one concept?", stacklevel=1)
    assert lines <= 900, f"{path.name} has {lines} lines: more than one concept lives there"
