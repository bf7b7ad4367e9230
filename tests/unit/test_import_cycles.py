"""Guards of the layering: the unit tier's no-process/no-port fixture works, and the project's
imports form no cycle. (Importing the cores with gRPC unimportable, and what `import
fastdecode.client` loads, need a fresh interpreter: tests/integration/test_layering.py.)"""

from __future__ import annotations

import ast
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.guards import ProcessOrPortInUnitTest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("fastdecode", "services")


def test_the_guard_refuses_processes_and_ports() -> None:
    with pytest.raises(ProcessOrPortInUnitTest):
        subprocess.run(["true"], check=False)
    with socket.socket() as s, pytest.raises(ProcessOrPortInUnitTest):
        s.bind(("127.0.0.1", 0))
    import grpc

    with pytest.raises(ProcessOrPortInUnitTest):
        grpc.aio.server()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in its body (lazy imports included)."""
    files = {
        _module_name(p): p
        for pkg in PACKAGES
        for p in (REPO / pkg).rglob("*.py")
        if "v1" not in p.relative_to(REPO).parts  # generated stubs import only each other
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
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
                if t and t != name:
                    edges.add(t)
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


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "fastdecode.gateway.core" in graph and "services.gateway.server" in graph
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _dynamic_imports(path: Path) -> list[str]:
    """Module names given as string constants to importlib.import_module or __import__."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append(node.args[0].value)
    return found


def test_fastdecode_never_imports_services() -> None:
    """The dependency goes one way: services -> fastdecode. fastdecode's tools reach the adapters
    through the entry points the distribution declares (fastdecode/runtime/serving.py `registered`)."""
    back = sorted(
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        if name.split(".")[0] == "fastdecode"
        for dep in deps
        if dep.split(".")[0] == "services"
    )
    assert back == [], back
    dynamic = sorted(
        f"{p.relative_to(REPO)}: {m}"
        for p in (REPO / "fastdecode").rglob("*.py")
        for m in _dynamic_imports(p)
        if m.split(".")[0] == "services"
    )
    assert dynamic == [], dynamic


def test_the_direction_check_sees_an_import_back(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import importlib\nimportlib.import_module('services.gateway.server')\n")
    assert _dynamic_imports(bad) == ["services.gateway.server"]
    graph = import_graph()
    graph["fastdecode.cli.serve"] = graph["fastdecode.cli.serve"] | {"services.gateway.server"}
    assert any(
        d.startswith("services.") for n, ds in graph.items() if n.startswith("fastdecode.") for d in ds
    )
