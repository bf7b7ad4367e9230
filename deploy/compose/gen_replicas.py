#!/usr/bin/env python3
"""Write a compose override that runs N whole fleets behind vllm-router, as
`fastdecode up --replicas N --router vllm-router` does on one host (docs/routing.md).

    python3 gen_replicas.py 3 > docker-compose.fleets.yml
    docker compose -f docker-compose.yml -f docker-compose.fleets.yml up -d
    curl http://127.0.0.1:8080/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}' \\
         -H 'Content-Type: application/json'

Fleet 0 is docker-compose.yml's (gateway, scheduler, gpu-dense, kv-attention-0..); fleet r >= 1 is
the same services named r<r>-gateway, r<r>-scheduler, r<r>-gpu-dense, r<r>-kv-attention-<i>, each
fleet wired to its own shards. The router (the image built with EXTRAS=server,router,
FASTDECODE_ROUTER_IMAGE) sends to every gateway's HTTP port with FASTDECODE_ROUTER_POLICY
(cache_aware by default) and publishes its port on FASTDECODE_ROUTER_BIND:FASTDECODE_ROUTER_PORT
(127.0.0.1:8080). Fleet 0's gateway keeps its own ports (gRPC clients go to a gateway: the router
speaks HTTP only); the other gateways publish nothing.

The shards of fleet r >= 1 extend docker-compose.yml's shard 0; its gpu-dense, scheduler and gateway
are written out as docker-compose.yml has them (compose cannot extend a service with depends_on, and
extending the gateway would copy its published ports; tests/deploy checks they stay the same).
--shards S (more than 2) also writes fleet 0's extra shards (what gen_shards.py S writes; do not add
that file too). With docker-compose.kv.yml in use, pass --kv, as for gen_shards.py. Not with
docker-compose.tls.yml yet: the router would have to trust the fleet's CA to reach the gateways over
HTTPS. --gpu gives fleet r's gpu-dense the NVIDIA GPU with index r (the CUDA image,
FASTDECODE_CUDA_IMAGE); use it instead of docker-compose.gpu.yml, whose `count: 1` would hand every
fleet the same first GPU. Two fleets of two shards: docker-compose.replicas.yml, ready-made.
Standard library only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_shards import shard_lines  # noqa: E402

SECRET = (
    '"${FASTDECODE_FLEET_SECRET:?set FASTDECODE_FLEET_SECRET to a random string of 16+ characters, '
    'e.g. in deploy/compose/.env - see docs/internal-auth.md}"'
)
HEALTH = ["interval: 5s", "timeout: 5s", "retries: 5", "start_period: 120s"]
# What every fleet service of docker-compose.yml has (its x-fastdecode block).
COMMON = [
    "image: ${FASTDECODE_IMAGE:-fastdecode:0.1.0}",
    "init: true",
    "restart: on-failure",
    "read_only: true",
    "tmpfs:",
    "  - /tmp",
    "cap_drop:",
    "  - ALL",
    "security_opt:",
    "  - no-new-privileges:true",
    "stop_grace_period: 30s",
]


def prefix(fleet: int) -> str:
    """Service-name prefix of a fleet: none for fleet 0 (docker-compose.yml's names)."""
    return f"r{fleet}-" if fleet else ""


def _indent(lines: list[str], n: int) -> list[str]:
    return [" " * n + ln for ln in lines]


def _service(
    name: str,
    service: str,
    port: int,
    env: list[str],
    model: bool,
    depends: list[str],
    gpu: int | None = None,
) -> list[str]:
    """A fleet service written out as docker-compose.yml has it (compose cannot extend a service
    that has depends_on), with its own environment and dependencies and no published port; on the
    NVIDIA GPU with index `gpu` when given (the CUDA image)."""
    common = COMMON if gpu is None else COMMON[1:]
    out = [
        f"  {name}:",
        *_indent(common, 4),
        *(_gpu(gpu) if gpu is not None else []),
        f'    command: ["serve", "{service}"]',
        "    environment:",
        f'      FASTDECODE_PORT: "{port}"',
        f"      FASTDECODE_FLEET_SECRET: {SECRET}",
        *(f"      {e}" for e in env),
        "      FASTDECODE_LOG_LEVEL: ${FASTDECODE_LOG_LEVEL:-INFO}",
    ]
    if model:
        out += [
            "    volumes:",
            "      - type: bind",
            "        source: ${FASTDECODE_MODEL_DIR:-../../.models/tiny}",
            "        target: /model",
            "        read_only: true",
        ]
    out += ["    networks:", "      - backend", "    depends_on:"]
    for dep in depends:
        out += [f"      {dep}:", "        condition: service_healthy"]
    out += [
        "    healthcheck:",
        *_indent(HEALTH, 6),
        f'      test: ["CMD", "fastdecode", "health", "--target", "127.0.0.1:{port}", "--timeout", "3"]',
    ]
    return out


def _gpu(fleet: int) -> list[str]:
    """The CUDA image and the NVIDIA GPU with index `fleet` (docker-compose.gpu.yml's, one GPU each)."""
    return [
        "    image: ${FASTDECODE_CUDA_IMAGE:-fastdecode:0.1.0-cuda}",
        "    deploy:",
        "      resources:",
        "        reservations:",
        "          devices:",
        "            - driver: nvidia",
        f'              device_ids: ["{fleet}"]',
        "              capabilities: [gpu]",
    ]


def _fleet(fleet: int, shards: int, port: int, kv: bool, gpu: bool) -> list[str]:
    p = prefix(fleet)
    names = [f"{p}kv-attention-{i}" for i in range(shards)]
    addresses = ",".join(f"{n}:{port}" for n in names)
    out: list[str] = []
    for i, name in enumerate(names):
        out += shard_lines(name, i, kv=kv)
    out += _service(
        f"{p}gpu-dense",
        "gpu-dense",
        50060,
        [
            'FASTDECODE_METRICS_PORT: "9100"',
            "FASTDECODE_MODEL: /model",
            f"FASTDECODE_SHARDS: {addresses}",
            "FASTDECODE_DEVICE: cuda" if gpu else "FASTDECODE_DEVICE: ${FASTDECODE_DEVICE:-auto}",
        ],
        model=True,
        depends=names,
        gpu=fleet if gpu else None,
    )
    out += _service(
        f"{p}scheduler",
        "scheduler",
        50052,
        [
            'FASTDECODE_METRICS_PORT: "9100"',
            f"FASTDECODE_DENSE: {p}gpu-dense:50060",
            f"FASTDECODE_SHARDS: {addresses}",
            "FASTDECODE_ADMISSION: ${FASTDECODE_ADMISSION:-stabilized}",
            "FASTDECODE_SPECULATIVE: ${FASTDECODE_SPECULATIVE:-off}",
            "FASTDECODE_NUM_SPECULATIVE_TOKENS: ${FASTDECODE_NUM_SPECULATIVE_TOKENS:-3}",
            "FASTDECODE_SPECULATIVE_K: ${FASTDECODE_SPECULATIVE_K:-auto}",
        ],
        model=False,
        depends=[f"{p}gpu-dense"],
    )
    # The gateway: no published ports (the router is the way in; fleet 0's gateway keeps its own).
    out += _service(
        f"{p}gateway",
        "gateway",
        50051,
        [
            'FASTDECODE_HTTP_PORT: "8000"',
            'FASTDECODE_METRICS_PORT: "9100"',
            f"FASTDECODE_SCHEDULER: {p}scheduler:50052",
            "FASTDECODE_MODEL: /model",
            "FASTDECODE_AUTH_TOKEN:",
        ],
        model=True,
        depends=[f"{p}scheduler"],
    )
    return out


def _router(replicas: int) -> list[str]:
    gateways = [f"{prefix(r)}gateway" for r in range(replicas)]
    command = ["--host", "0.0.0.0", "--port", "8000", "--policy", "${FASTDECODE_ROUTER_POLICY:-cache_aware}"]
    command += ["--worker-urls", *(f"http://{g}:8000" for g in gateways)]
    # a gateway that stops answering /health is routed around after one failed probe (1 s apart), as
    # `fastdecode up --replicas` runs it
    command += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    command += ["--health-success-threshold", "1", "--log-level", "warning"]
    probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"
    out = [
        "  router:",
        *_indent(COMMON[1:], 4),
        "    image: ${FASTDECODE_ROUTER_IMAGE:-fastdecode:0.1.0-router}",
        '    entrypoint: ["vllm-router"]',
        "    command:",
        *(f'      - "{c}"' for c in command),
        "    ports:",
        '      - "${FASTDECODE_ROUTER_BIND:-127.0.0.1}:${FASTDECODE_ROUTER_PORT:-8080}:8000"',
        "    networks:",
        "      - backend",
        "      - frontend",
        "    depends_on:",
    ]
    for g in gateways:
        out += [f"      {g}:", "        condition: service_healthy"]
    out += [
        "    healthcheck:",
        *_indent(HEALTH, 6),
        f'      test: ["CMD", "python3", "-c", "{probe}"]',
    ]
    return out


def render(replicas: int, shards: int = 2, port: int = 50061, kv: bool = False, gpu: bool = False) -> str:
    """The override file's text for `replicas` fleets (at least 2) of `shards` shards each."""
    if replicas < 2:
        raise ValueError("docker-compose.yml already runs one fleet; ask for 2 or more")
    if shards < 2:
        raise ValueError("docker-compose.yml's fleet runs 2 shards; ask for 2 or more")
    out = [
        f"# Generated by gen_replicas.py {replicas}"
        f"{f' --shards {shards}' if shards != 2 else ''}{' --kv' if kv else ''}{' --gpu' if gpu else ''}: "
        f"{replicas} fleets of {shards} kv_attention shards behind vllm-router.",
        "# Use together with docker-compose.yml (and the same other overrides); the router's image is",
        "# built with --build-arg EXTRAS=server,router (deploy/README.md).",
        "services:",
    ]
    # Fleet 0: docker-compose.yml's, plus its shards beyond the first two.
    names = [f"kv-attention-{i}" for i in range(shards)]
    for i in range(2, shards):
        out += shard_lines(names[i], i, kv=kv)
    # Fleet 0's gpu-dense and scheduler: only what changes (one block each: YAML keeps one key).
    addresses = ",".join(f"{n}:{port}" for n in names)
    dense: list[str] = [*_gpu(0)] if gpu else []
    if gpu or shards > 2:
        dense += ["    environment:"]
        dense += ["      FASTDECODE_DEVICE: cuda"] if gpu else []
        dense += [f"      FASTDECODE_SHARDS: {addresses}"] if shards > 2 else []
    if shards > 2:
        dense += ["    depends_on:"]
        for name in names[2:]:
            dense += [f"      {name}:", "        condition: service_healthy"]
    if dense:
        out += ["  gpu-dense:", *dense]
    if shards > 2:
        out += ["  scheduler:", "    environment:", f"      FASTDECODE_SHARDS: {addresses}"]
    for fleet in range(1, replicas):
        out += _fleet(fleet, shards, port, kv, gpu)
    out += _router(replicas)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("replicas", type=int, help="number of fleets (2 or more)")
    parser.add_argument("--shards", type=int, default=2, help="kv_attention shards per fleet (2 or more)")
    parser.add_argument("--port", type=int, default=50061, help="the shards' gRPC port")
    parser.add_argument(
        "--kv", action="store_true", help="also give the new shards a KV folder (docker-compose.kv.yml)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="fleet r's gpu-dense on GPU r (instead of docker-compose.gpu.yml)"
    )
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render(args.replicas, args.shards, args.port, kv=args.kv, gpu=args.gpu))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
