"""Layering checks that need a fresh interpreter: the domain cores import with gRPC unimportable, and
the SDK loads no server module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

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
    "fastdecode.benchmarks.chaos_probes",
    "fastdecode.benchmarks.breakdown",  # times gRPC itself (echo yardsticks, the dense links)
    "fastdecode.benchmarks.exchange",  # the same, at a model's shapes
    "fastdecode.benchmarks.split",  # drives gpu_dense and the shards over gRPC
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
