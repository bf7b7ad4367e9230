"""`fastdecode serve ...`: run one service of the fleet (each is a separate process)."""

from __future__ import annotations

from typing import Any

import click

from fastdecode.cli.common import run_service, settings_options
from fastdecode.settings import DenseSettings, GatewaySettings, SchedulerSettings, ShardSettings


@click.group()
def serve() -> None:
    """Run one service of the fleet (each is a separate process)."""


@serve.command("kv-attention")
@settings_options(ShardSettings)
def serve_kv_attention(**flags: Any) -> None:
    """The R-part: a KV-cache shard that computes attention for its sequences."""
    from services.kv_attention.server import serve

    run_service(serve, ShardSettings, flags)


@serve.command("gpu-dense")
@settings_options(DenseSettings)
def serve_gpu_dense(**flags: Any) -> None:
    """The S-part: all weights; runs step plans layer by layer against the shards."""
    from services.gpu_dense.server import serve

    run_service(serve, DenseSettings, flags)


@serve.command("scheduler")
@settings_options(SchedulerSettings)
def serve_scheduler(**flags: Any) -> None:
    """The brain: admits, places sequences on shards, forms steps, streams tokens."""
    from services.scheduler.server import serve

    run_service(serve, SchedulerSettings, flags)


@serve.command("gateway")
@settings_options(GatewaySettings)
def serve_gateway(**flags: Any) -> None:
    """The public API: validates, tokenizes, authenticates, streams text from the scheduler."""
    from services.gateway.server import serve

    run_service(serve, GatewaySettings, flags)
