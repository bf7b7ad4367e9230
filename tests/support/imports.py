"""The project's import graph, drawn from the source (no import runs): for the cycle test
(tests/unit/test_import_cycles.py) and the layering test (tests/integration/test_layering.py)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("fastdecode", "services")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_stub(path: Path) -> bool:
    return "v1" in path.relative_to(REPO).parts  # generated stubs import only each other


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in its body (lazy imports included).

    Importing `a.b.c` runs the `__init__` of packages `a` and `a.b` first, so an import from outside
    a package draws an edge to each of its enclosing packages the importer is not inside of: a
    package whose `__init__` imports heavy or cyclic code shows up at every importer. The generated
    stubs (fastdecode.v1) are nodes, so that an import of them is seen, but their own imports are not
    drawn."""
    files = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    packages = {module_name(p) for p in files.values() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        if _is_stub(path):
            graph[name] = set()
            continue
        edges: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                    ).strip(".")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in files:  # `from a.b import c`: c may be a name, not a module
                    t = t.rpartition(".")[0]
                if not t or t == name:
                    continue
                edges.add(t)
                parent = t.rpartition(".")[0]
                while parent:  # the enclosing packages' __init__ run first
                    if parent in packages and not (name + ".").startswith(parent + "."):
                        edges.add(parent)
                    parent = parent.rpartition(".")[0]
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that comes back to its start), or None. A package's import of its
    own submodules is not a cycle through them unless a submodule imports the package back."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if node.startswith(nxt + "."):  # a submodule importing its parent package's __init__
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None
