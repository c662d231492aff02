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
NAME: Final = "taskiq_deduplication"

#: Private names of other libraries that the package uses on purpose, each
#: with the one module allowed to and the reason.
FOREIGN_PRIVATE: Final = {
    # A namedtuple's documented method, underscored so as not to clash with fields.
    ("store.client", "_replace"),
    ("cli.commands", "_replace"),
    # taskiq's own way of building the message kiq sends (`taskiq dedup key`).
    ("cli.commands", "_prepare_message"),
    ("testing", "_prepare_message"),
    ("locks", "_prepare_message"),
    # redis-py's connection internals, behind the one door that probes for them.
    ("store.wire.connection", "_parser"),
    ("store.wire.connection", "_host_error"),
    ("store.wire.connection", "_writer"),
    ("store.wire.connection", "_reader"),
}


def _name(path: Path) -> str:
    """The dotted name of the module at ``path``, under the package (``store.pipeline``)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _modules() -> dict[str, ast.Module]:
    """Every module of the package, its folders' included, by dotted name."""
    return {_name(path): ast.parse(path.read_text("utf-8")) for path in PACKAGE.rglob("*.py")}


def _runtime_imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The package modules ``tree`` imports at run time (not for type checking only)."""
    found: set[str] = set()
    checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking.update(id(inner) for inner in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(NAME):
            module = (node.module or "").removeprefix(NAME).removeprefix(".") or "__init__"
            # `from folder import module` imports that module (its folder is
            # being imported already, or is imported for it).
            inner = {f"{module}.{alias.name}".removeprefix("__init__.") for alias in node.names}
            found.update(inner & known if inner <= known else {module})
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.removeprefix(f"{NAME}.")
                for alias in node.names
                if alias.name.startswith(f"{NAME}.")
            )
    return found & known


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(graph.get(name, ())):
            if target in path:
                cycles.add(" -> ".join([*path[path.index(target) :], target]))
            elif len(path) < len(graph):
                visit(target, [*path, target])

    for start in sorted(graph):
        visit(start, [start])
    return sorted(cycles)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _runtime_imports(tree, set(modules)) - {name} for name, tree in modules.items()}
    graph["__init__"] = set()  # the package's lazy exports import everything on demand
    return graph


def test_no_module_imports_one_that_imports_it_back() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def _folder(module: str) -> str:
    """The folder a module lives in (``store`` for ``store.wire.resp``), or ``""`` at the top."""
    return module.split(".", 1)[0] if "." in module or (PACKAGE / module).is_dir() else ""


def test_no_folder_imports_one_that_imports_it_back() -> None:
    """The folders stand on each other in one direction: the top, then send, run, store, model."""
    folders: dict[str, set[str]] = {}
    for name, targets in _graph().items():
        here = _folder(name)
        folders.setdefault(here, set()).update(
            _folder(target) for target in targets if _folder(target) != here
        )
    folders.pop("", None)  # the public face imports the folders; they may use it
    cycles = _cycles({name: targets - {""} for name, targets in folders.items()})
    assert not cycles, f"folders that import each other: {cycles}"


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
        folder = PACKAGE.joinpath(*name.split(".")).parent
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "taskiq_deduplication"
            ):
                uses += (
                    f"{name}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                    and not alias.name.startswith("__")
                    and not (folder / f"{alias.name}.py").exists()  # a private module: ours
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


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(PACKAGE))
)
def test_no_module_is_longer_than_a_reader_holds_at_once(path: Path) -> None:
    """A smell detector, not a shape (issue 33): past 550 lines a warning, past 900 a failure.

    Modules are shaped by meaning; a long one is worth a look (is it still one
    concept?), never a split of one concept in two to get under a number.
    """
    lines = len(path.read_text("utf-8").splitlines())
    if lines > 550:
        warnings.warn(
            f"{path.relative_to(PACKAGE)} has {lines} lines: is it still one concept?", stacklevel=1
        )
    assert lines <= 900, (
        f"{path.relative_to(PACKAGE)} has {lines} lines: more than one concept lives there"
    )
