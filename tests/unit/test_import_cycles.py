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
from tests.support.imports import REPO, find_cycle, import_graph


def test_the_guard_refuses_processes_and_ports() -> None:
    with pytest.raises(ProcessOrPortInUnitTest):
        subprocess.run(["true"], check=False)
    with socket.socket() as s, pytest.raises(ProcessOrPortInUnitTest):
        s.bind(("127.0.0.1", 0))
    import grpc

    with pytest.raises(ProcessOrPortInUnitTest):
        grpc.aio.server()


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "fastdecode.gateway.core" in graph and "services.gateway.server" in graph
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_draws_package_init_edges() -> None:
    """An import of a package's module from outside it runs the package's __init__ first: the loop
    dense/__init__ -> runner -> scheduling/__init__ -> core -> dense.sampling (-> dense/__init__)
    worked only by import order, and drew no cycle while these edges were missing."""
    graph = import_graph()
    assert "fastdecode.wire" in graph["services.gateway.server"]  # from fastdecode.wire.gateway import ...
    assert "fastdecode.kv" in graph["fastdecode.dense.runner"]
    assert "fastdecode.dense" not in graph["fastdecode.dense.runner"]  # its own package: already running
    graph = {k: set(v) for k, v in graph.items()}
    # the old loop, put back (with the package edges each of its imports draws)
    graph["fastdecode.scheduling.core"] |= {"fastdecode.dense.sampling", "fastdecode.dense"}
    graph["fastdecode.dense.runner"] |= {"fastdecode.scheduling.types", "fastdecode.scheduling"}
    cycle = find_cycle(graph)
    assert cycle is not None and "fastdecode.dense" in cycle and "fastdecode.scheduling" in cycle


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
