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


#: What every part may use, and which uses no part: the errors and the version.
BASE: Final = {"exceptions", "__about__", "__init__"}


def _part(module: str) -> str:
    """The part a module belongs to: its folder (``store`` for ``store.wire.resp``), or
    itself for a module at the top (``calls``)."""
    return module.split(".", 1)[0]


def _parts() -> dict[str, set[str]]:
    """Which part imports which: the folders, and each module at the top on its own."""
    parts: dict[str, set[str]] = {}
    for name, targets in _graph().items():
        here = _part(name)
        if here in BASE:
            continue
        parts.setdefault(here, set()).update(
            _part(target) for target in targets if _part(target) not in {here, *BASE}
        )
    return parts


def test_no_folder_imports_one_that_imports_it_back() -> None:
    """The parts stand on each other in one direction, through the top's modules too.

    A folder that imported a module at the top which imports the folder back
    (``store`` -> ``calls`` -> ``run`` -> ``store``) is a circle of parts even
    where no module imports another back.
    """
    cycles = _cycles(_parts())
    assert not cycles, f"parts that import each other: {cycles}"


def test_the_check_for_circles_of_parts_finds_one() -> None:
    """The check above can fail: a folder importing a top module that imports it back."""
    parts = _parts()
    assert "run" in parts["calls"]
    parts["run"] = {*parts["run"], "calls"}
    assert _cycles(parts)


def test_the_map_in_the_docs_is_the_code() -> None:
    """``docs/how-it-works.md`` draws the parts and their imports: the same as the code's."""
    page = (PACKAGE.parent.parent / "docs" / "how-it-works.md").read_text("utf-8")
    diagram = page.split("```mermaid\nflowchart TD\n", 1)[1].split("```", 1)[0]
    drawn: dict[str, set[str]] = {}
    for line in diagram.splitlines():
        if "-->" in line:
            source, targets = (side.strip() for side in line.split("-->"))
            drawn.setdefault(source, set()).update(t.strip() for t in targets.split("&"))
    imports = {part: targets for part, targets in _parts().items() if targets}
    assert drawn == imports


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


#: Past this many lines a module is worth a look: is it still one concept?
LONG: Final = 550


def test_long_modules_are_named_as_worth_a_look() -> None:
    """A smell detector, not a shape (issue 33): a warning per long module, never a failure.

    Modules are shaped by meaning; a long one is worth a look (is it still one
    concept?), never a split of one concept in two to get under a number. The
    test fails only if it finds no module to measure.
    """
    sizes = {
        str(path.relative_to(PACKAGE)): len(path.read_text("utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 40, sizes
    for name, lines in sorted(sizes.items()):
        if lines > LONG:
            warnings.warn(f"{name} has {lines} lines: is it still one concept?", stacklevel=1)
