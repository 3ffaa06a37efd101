"""The layers, read from the imports (CONTRIBUTING.md): every import points down, and no two
modules import each other, however far round. Every import counts, wherever it stands (inside
a function or under `if TYPE_CHECKING:` too): a circle of files that name each other is a
circle for a reader."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("controller", "worker", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project's modules `path` imports (a name imported from a package that is a module
    of its own counts as that module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for inner in ast.iter_child_nodes(node):
            visit(inner)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    known = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, known) - {module_name(p)} for p in paths}


def test_no_two_modules_import_each_other_however_far_round() -> None:
    edges = graph()
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    counter = [0]

    def strongconnect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                strongconnect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            strongconnect(node)
    assert circles == []


def test_imports_only_point_down() -> None:
    edges = graph()
    top = {"controller.app", "controller.main", "controller.__main__"}
    for module, imported in edges.items():
        if module.startswith("bench"):
            continue
        if module not in top:
            assert not imported & {"controller.app", "controller.main"}, module
        below_doors = not module.startswith(("controller.doors", "controller.client")) and (
            module not in top
        )
        if below_doors:
            assert not {m for m in imported if m.startswith("controller.doors")}, module
        if module.startswith("controller.core"):
            assert not {
                m for m in imported if m.startswith(("controller.shell", "controller.jobs"))
            }, module
        if module.startswith(("controller.client", "worker")):
            heavy = {m for m in imported if m.startswith(("controller.core", "controller.shell"))}
            assert heavy | ({"controller.jobs"} & imported) == set(), module
