"""The house keeps its shape: every import of the package points down the rooms of docs/architecture.md, and no
chain of imports comes back to where it started.

Every import counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``): a lower room
that reaches up only at call time still depends on the room above it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "oneblock"
DOC = ROOT / "docs" / "architecture.md"


def _rooms() -> list[set[str]]:
    """The floors of the house, bottom first, read from the fenced block of docs/architecture.md: each line
    ``N  room, room  what they own``; rooms on one line share a floor."""
    block = DOC.read_text().split("```text", 1)[1].split("```", 1)[0]
    floors: dict[int, set[str]] = defaultdict(set)
    for line in block.splitlines():
        found = re.match(r"\s*(\d+)\s+([\w/.]+(?:,\s*[\w/.]+)*)\s{2,}", line)
        if found:
            names = {n.strip().removesuffix("/").removesuffix(".py") for n in found.group(2).split(",")}
            floors[int(found.group(1))] |= names
    return [floors[k] for k in sorted(floors)]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(source: str, name: str, modules: dict[str, Path], *, is_package: bool = False) -> set[str]:
    """The package's modules that module ``name`` imports (``from pkg import x`` names the submodule where x is
    one)."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
    return {m for m in found if m in modules and m != name}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imports(path.read_text(), name, modules, is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }


def test_every_room_of_the_package_is_on_a_floor_of_the_document():
    placed = set().union(*_rooms())
    rooms = {_room(m) for m in _modules()}
    assert rooms - placed == set(), f"rooms missing from docs/architecture.md: {sorted(rooms - placed)}"
    assert placed - rooms == set(), f"docs/architecture.md names rooms that do not exist: {sorted(placed - rooms)}"


def test_every_import_points_down_or_across_its_own_room():
    floor = {room: i for i, rooms in enumerate(_rooms()) for room in rooms}
    up = []
    for module, imported in sorted(_graph().items()):
        for target in sorted(imported):
            a, b = _room(module), _room(target)
            if a != b and floor[b] >= floor[a]:
                up.append(f"{module} (floor {floor[a]}) imports {target} (floor {floor[b]})")
    assert up == [], "imports that run up or across floors:\n" + "\n".join(up)


def test_no_chain_of_imports_comes_back_to_its_start():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from oneblock.io import limits\n", {"oneblock.io.limits"}),
        ("from . import formats\n", {"oneblock.kernels.formats"}),
        ("def f():\n    from oneblock.layers.block import Block\n", {"oneblock.layers.block"}),
        ("import importlib\nimportlib.import_module('oneblock.io.files')\n", {"oneblock.io.files"}),
    ],
)
def test_the_walker_sees_every_form_of_import(source, expected):
    assert _imports(source, "oneblock.kernels.probe", _modules()) == expected
