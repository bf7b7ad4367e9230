"""Layering checks: no module imports a layer above its own, the cores never see a proto (both drawn
from the source), and, in a fresh interpreter, the domain cores import with gRPC unimportable, the
gateway and the scheduler load no torch and the SDK loads no server module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.imports import import_graph

REPO = Path(__file__).resolve().parents[2]

# The house, bottom to top: a module imports its own group and groups of a lower rank only (groups of
# one rank never import each other). The floor is plumbing and the generated stubs; the contract is
# what crosses between services; then the cores; the wire layer converts between the cores and the
# protos; tools, the SDK, the benchmarks, the CLI and the service adapters stand on all of it.
RANK = {
    "fastdecode": 0,  # the package's own __init__
    "protocol": 0,  # wire constants the SDK shares
    "v1": 0,  # generated
    "runtime": 1,
    "contract": 2,
    "model": 3,
    "kv": 3,
    "spec": 3,  # speculative decoding: proposers and verification, under dense/ and scheduling/
    "dense": 4,
    "gateway": 4,
    "scheduling": 4,
    "wire": 5,
    "planning": 5,
    "tools": 6,
    "client": 6,
    "benchmarks": 7,
    "services": 7,
    "cli": 8,
}
# The domain cores: they see domain objects only, never a generated message (fastdecode.wire converts).
CORES = ("contract", "model", "kv", "spec", "dense", "gateway", "scheduling", "planning")


def _group(module: str) -> str:
    parts = module.split(".")
    return "services" if parts[0] == "services" else (parts[1] if len(parts) > 1 else parts[0])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _group(m) != _group(d) and RANK[_group(d)] >= RANK[_group(m)]
    )


def proto_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if _group(m) in CORES
        for d in deps
        if d.startswith("fastdecode.v1")
    )


def test_no_upward_import() -> None:
    graph = import_graph()
    assert {_group(m) for m in graph} <= set(RANK), "a new top-level module needs its place in RANK"
    assert upward_imports(graph) == []
    # the checks see what they are for: the old upward imports, put back
    graph["fastdecode.runtime.geometry"] = graph["fastdecode.runtime.geometry"] | {"fastdecode.gateway.core"}
    graph["fastdecode.dense.runner"] = graph["fastdecode.dense.runner"] | {"fastdecode.scheduling.types"}
    assert upward_imports(graph) == [
        "fastdecode.dense.runner -> fastdecode.scheduling.types",
        "fastdecode.runtime.geometry -> fastdecode.gateway.core",
    ]


def test_cores_import_no_protos() -> None:
    graph = import_graph()
    assert proto_imports(graph) == []
    graph["fastdecode.kv.shard"] = graph["fastdecode.kv.shard"] | {"fastdecode.v1.kv_attention_pb2"}
    assert proto_imports(graph) == ["fastdecode.kv.shard -> fastdecode.v1.kv_attention_pb2"]


LOADS_NO_TORCH = """
import importlib, json, pkgutil, sys
packages = [importlib.import_module(p) for p in json.loads(sys.argv[1])]
names = [m.name for pkg in packages for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
names += json.loads(sys.argv[2])
for name in names:
    importlib.import_module(name)
heavy = sorted(
    m for m in sys.modules if m == "torch" or m.startswith(("torch.", "fastdecode.kv", "fastdecode.dense"))
)
print(json.dumps({"imported": names, "heavy": heavy}))
"""


@pytest.mark.parametrize(
    "packages, modules, entry",
    [
        # the gateway validates, tokenizes and relays (its core and its gRPC and HTTP fronts)
        (
            ["fastdecode.gateway", "services.gateway"],
            ["fastdecode.wire.gateway", "fastdecode.contract", "fastdecode.model"],
            "services.gateway.server",
        ),
        # the scheduler plans steps and speaks to the shards' control plane: a fleet starts it at
        # every `up`, and torch alone was a second of its start-up
        (
            ["fastdecode.scheduling", "services.scheduler"],
            ["fastdecode.wire.kv_control", "fastdecode.wire.dense", "fastdecode.contract"],
            "services.scheduler.server",
        ),
        # `fastdecode up` checks its flags against the model and supervises the services: torch was
        # 1.1-1.3 s of its CPU at every start (1.5-1.8 s against 0.46 s), only for flag and checkpoint checks
        (
            [],
            [
                *("fastdecode.cli.up", "fastdecode.cli.gguf", "fastdecode.cli.progress"),
                *("fastdecode.model.config", "fastdecode.tools.checkpoint", "fastdecode.tools.fleet"),
                "fastdecode.tools.supervisor",
            ],
            "fastdecode.cli.up",
        ),
    ],
    ids=["gateway", "scheduler", "up"],
)
def test_a_service_that_does_no_math_loads_no_torch(
    packages: list[str], modules: list[str], entry: str
) -> None:
    """Importing every one of the service's modules loads no torch and no model or KV code."""
    out = subprocess.run(
        [sys.executable, "-c", LOADS_NO_TORCH, json.dumps(packages), json.dumps(modules)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert entry in result["imported"]
    assert result["heavy"] == []


# Modules under fastdecode/ that speak gRPC by design (adapters and tools); every other one is a core
# or a plain helper and must import without it.
GRPC_MODULES = {
    "fastdecode.runtime.rpc",
    "fastdecode.runtime.internal_auth",  # the fleet secret on gRPC calls (interceptor, channel wrapper)
    "fastdecode.client",
    "fastdecode.benchmarks.transport",
    "fastdecode.benchmarks.fleet_bench",
    "fastdecode.benchmarks.load_bench",
    "fastdecode.benchmarks.chaos",
    "fastdecode.benchmarks.migrate",  # drives a fleet (RemoveShard, GetStats)
    "fastdecode.benchmarks.shard_kill",  # kills a shard, reads its Stats
    "fastdecode.benchmarks.chaos_probes",
    "fastdecode.benchmarks.chaos_attacks",  # Reserve and Release on the shards, with the secret
    "fastdecode.benchmarks.breakdown",  # times gRPC itself (echo yardsticks, the dense links)
    "fastdecode.benchmarks.exchange",  # the same, at a model's shapes
    "fastdecode.benchmarks.split",  # drives gpu_dense and the shards over gRPC
    "fastdecode.benchmarks.split_fleet",  # starts them and fills their KV over gRPC
    "fastdecode.benchmarks.split_spec",  # drives gpu_dense (emulated) with drafts over gRPC
    "fastdecode.benchmarks.pace",  # drives a fleet and a bare gRPC echo
}

BLOCK_GRPC = """
import importlib, importlib.abc, json, pkgutil, sys
class NoGrpc(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith(("grpc.", "grpc_")) or name.endswith("_pb2_grpc"):
            raise ImportError(f"gRPC is unimportable here: {name}")
        return None
sys.meta_path.insert(0, NoGrpc())
import fastdecode
skip = set(json.loads(sys.argv[1]))
failed, checked = {}, []
for m in pkgutil.walk_packages(fastdecode.__path__, "fastdecode."):
    if m.name in skip or m.name.startswith("fastdecode.v1.") or m.name.endswith(".__main__"):
        continue
    checked.append(m.name)
    try:
        importlib.import_module(m.name)
    except ImportError as e:
        failed[m.name] = str(e)
print(json.dumps({"checked": checked, "failed": failed}))
"""


def test_cores_import_without_grpc() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_GRPC, json.dumps(sorted(GRPC_MODULES))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    cores = {
        "fastdecode.scheduling.core",
        "fastdecode.scheduling.driver",
        "fastdecode.gateway.core",
        "fastdecode.gateway.openai",
        "fastdecode.kv.store",
        "fastdecode.model.dense",
        "fastdecode.dense.engine",
        "fastdecode.dense.sampling",
        "fastdecode.runtime.errors",
        "fastdecode.runtime.settings",
    }
    assert cores <= set(result["checked"])
    assert result["failed"] == {}


def test_the_sdk_loads_no_server_module() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import fastdecode.client"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "fastdecode.client" in loaded
    # grpc's own __init__ imports the empty top-level grpc_health/grpc_reflection packages; the
    # servers live in their submodules.
    forbidden = [
        m
        for m in loaded
        if m.startswith(
            ("prometheus_client", "grpc_reflection.", "torch", "fastdecode.runtime.rpc", "pydantic")
        )
        or m == "grpc_health.v1.health"
    ]
    assert forbidden == []


def test_module_sizes() -> None:
    """No module holds more than 600 lines (the generated stubs and the SDK's one-file client
    aside), and a service adapter no more than 300: a module past that holds more than one topic."""
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for pkg in ("fastdecode", "services")
        for p in (REPO / pkg).rglob("*.py")
        if "v1" not in p.relative_to(REPO).parts
    }
    assert [f for f, n in sizes.items() if n > 600 and f != "fastdecode/client.py"] == []
    over = {f for f, n in sizes.items() if n > 300 and f.startswith("services/")}
    assert over == set()
