"""Arrows point one way: each part of kernelcrew imports only the parts below it, and nothing loops.

Every module of ``kernelcrew/`` is parsed (not imported) and every import statement in it counts,
wherever it stands: at the top, inside a function, under ``TYPE_CHECKING``. A module belongs to the
package named by its first part below ``kernelcrew`` (``kernelcrew.tools.sandbox`` -> ``tools``;
``kernelcrew.config`` -> ``config``). The allowed directions are those of DESIGN.md ("Package
layout"): ``api``, ``web``, ``worker``, ``service`` and ``cli`` use ``agents``; ``agents`` use
``tools`` and ``knowledge_base``; ``tools`` use nothing of ours but ``config`` and the leaves beside
it. A new package, or a new arrow, is a line in :data:`ALLOWED` and a reason in review.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "kernelcrew"

#: Leaves: they import nothing of kernelcrew but each other in this order (config <- task, records).
LEAVES = {"config", "task", "records"}

#: The packages each package may import (its own modules aside), one line per package, lowest first.
ALLOWED: dict[str, set[str]] = {
    "kernelcrew": set(),  # the root package: its version, nothing else
    "config": set(),  # Settings
    "records": {"config"},  # typed records shared by the executor, the crew and the service
    "task": {"config"},  # load and check task and candidate files
    "tools": {"kernelcrew", *LEAVES},  # deterministic tools; the root package only to find its path
    "knowledge_base": {*LEAVES},  # the shared database (Base, engines) and the knowledge base
    "agents": {*LEAVES, "tools", "knowledge_base"},  # the crew's graph; handed an Executor
    "benchmark": {*LEAVES, "tools", "knowledge_base", "agents"},  # the suite runner of `kernelcrew bench`
    "service": {*LEAVES, "tools", "knowledge_base", "agents"},  # the job domain: jobs, users, tokens, auth
    "migrations": {*LEAVES, "knowledge_base", "service"},  # Alembic: sees every table (loaded by path)
    "worker": {*LEAVES, "tools", "knowledge_base", "agents", "service"},  # Celery, orchestrator, inventory
    "web": {*LEAVES, "tools", "knowledge_base", "agents", "service", "worker"},  # the browser UI
    "api": {*LEAVES, "tools", "knowledge_base", "agents", "service", "worker", "web"},  # REST; mounts web
    "cli": {*LEAVES, "tools", "knowledge_base", "agents", "benchmark", "service", "worker", "api"},
    "__main__": {"tools", "cli"},  # `python -m kernelcrew`: the bytecode cache first, then the CLI
}


# ------------------------------------------------------------------------------------------------
# Reading the imports
# ------------------------------------------------------------------------------------------------


def module_name(path: Path, root: Path = PACKAGE_DIR) -> str:
    """``kernelcrew/tools/sandbox.py`` -> ``kernelcrew.tools.sandbox``; a package is its ``__init__``."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def find_modules(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imported_names(module: str, is_package: bool, source: str, known: set[str]) -> Iterator[str]:
    """Every module ``source`` imports, at any depth of the tree, relative imports resolved.

    ``from a.b import c`` names the module ``a.b.c`` when there is one, else ``a.b`` (``c`` is a name
    defined in it).
    """
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(here):
                    raise ValueError(f"{module}: relative import beyond the top-level package")
                base = here[: len(here) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                yield submodule if submodule in known else origin


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_graph(root: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Module -> the kernelcrew modules it imports (a module importing itself left out)."""
    modules = find_modules(root)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        names = imported_names(name, path.name == "__init__.py", path.read_text(), known)
        graph[name] = {n for n in names if n.split(".")[0] == "kernelcrew" and n != name}
    return graph


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in modules.items():
        own = package_of(module)
        graph.setdefault(own, set()).update(package_of(t) for t in targets if package_of(t) != own)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@pytest.fixture(scope="module")
def modules() -> dict[str, set[str]]:
    return module_graph()


# ------------------------------------------------------------------------------------------------
# The reader itself
# ------------------------------------------------------------------------------------------------


def test_imports_are_read_at_every_depth_and_relative_ones_resolved(tmp_path):
    pkg = tmp_path / "kernelcrew"
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("from . import sandbox\n")
    (pkg / "tools" / "sandbox.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import config\n"
        "from . import build\n"
        "if TYPE_CHECKING:\n"
        "    from kernelcrew.task import Task\n"
        "def run():\n"
        "    import kernelcrew.api.app\n"
        "    from ..config import Settings\n"
        "    from kernelcrew.tools.sandbox import run\n"
    )
    (pkg / "tools" / "build.py").write_text("import json\nimport kernelcrew\n")
    graph = module_graph(pkg)
    assert graph == {
        "kernelcrew": set(),
        "kernelcrew.config": set(),
        "kernelcrew.tools": {"kernelcrew.tools.sandbox"},
        "kernelcrew.tools.build": {"kernelcrew"},
        "kernelcrew.tools.sandbox": {
            "kernelcrew.config",
            "kernelcrew.tools.build",
            "kernelcrew.task",
            "kernelcrew.api.app",
        },
    }
    assert package_graph(graph) == {
        "kernelcrew": set(),
        "config": set(),
        "tools": {"kernelcrew", "config", "task", "api"},
    }


def test_cycles_finds_every_loop_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


# ------------------------------------------------------------------------------------------------
# kernelcrew
# ------------------------------------------------------------------------------------------------


def test_the_allowed_table_itself_points_one_way():
    order = list(graphlib.TopologicalSorter(ALLOWED).static_order())  # raises CycleError on a loop
    assert set(order) == set(ALLOWED)
    assert all(ALLOWED[leaf] <= LEAVES for leaf in LEAVES)


def test_every_package_has_a_line_in_the_table(modules):
    assert set(package_graph(modules)) - set(ALLOWED) == set()


def test_each_package_imports_only_what_the_table_allows(modules):
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in modules.items()
        for target in targets
        if package_of(target) != package_of(module) and package_of(target) not in ALLOWED[package_of(module)]
    )
    assert wrong == []


def test_the_package_graph_has_no_cycles(modules):
    assert cycles(package_graph(modules)) == []


def test_no_module_imports_itself_back_through_others(modules):
    assert cycles(modules) == []
