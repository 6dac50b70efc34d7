"""The package's imports, read from its source (those inside functions included): no cycle
between modules, not even through imports made for type checking only, and a room imports
only the rooms above it in docs/architecture.md's table (or in its own row)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_grpo"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _nodes(tree: ast.AST, *, type_checking: bool):
    """Every node, those under ``if TYPE_CHECKING:`` (not imports at run time) only with
    ``type_checking``."""
    for node in ast.iter_child_nodes(tree):
        if (
            not type_checking
            and isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            continue
        yield node
        yield from _nodes(node, type_checking=type_checking)


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` (at run time; with ``type_checking``,
    for type checking too)."""
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _nodes(ast.parse(path.read_text()), type_checking=type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                found = owner(target) if target.startswith("megatron_grpo") else None
                if found not in (None, name, "megatron_grpo"):
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def room_rows() -> dict[str, int]:
    """Each room of docs/architecture.md's table (a folder or a top-level module) and its
    row, top first."""
    rows = {}
    table = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
             if line.startswith("| `")]  # fmt: skip
    for number, line in enumerate(table):
        for name in re.findall(r"`([\w.]+/?)`", line.split("|")[1]):
            rows[name.removesuffix("/").removesuffix(".py")] = number
    return rows


def room(module: str) -> str:
    return module.split(".")[1]


def test_no_module_imports_another_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_no_cycle_hides_behind_imports_for_type_checking():
    # A cycle of lazy imports closed by an ``if TYPE_CHECKING:`` one is still two modules
    # that need each other (the stage sender and the weight-sync helpers were one).
    assert cycles(import_graph(type_checking=True)) == []


def upward_imports(graph: dict[str, set[str]], rows: dict[str, int]) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a != "megatron_grpo"  # the package's facade: `from megatron_grpo import train`
        for b in targets
        if rows[room(b)] > rows[room(a)]
    )


def test_a_room_imports_only_the_rooms_above_it():
    rows = room_rows()
    rooms = {room(m) for m in modules() if m != "megatron_grpo"}
    assert rooms <= rows.keys(), f"rooms missing from the table: {sorted(rooms - rows.keys())}"
    assert upward_imports(import_graph(), rows) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    a, b, loop = "megatron_grpo.config.a", "megatron_grpo.config.b", "megatron_grpo.train.loop"
    graph = {a: {b}, b: {a, loop}}
    assert cycles(graph) == [[a, b]]
    assert upward_imports(graph, room_rows()) == [f"{b} -> {loop}"]
