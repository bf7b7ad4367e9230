"""`fastdecode serve ...`: run one service of the fleet (each is a separate process)."""

from __future__ import annotations

from typing import Any

import click

from fastdecode.cli.common import run_service, settings_options
from fastdecode.runtime.serving import SERVICES, registered
from fastdecode.runtime.settings import DenseSettings, GatewaySettings, SchedulerSettings, ShardSettings

# Each command runs the `serve()` the services package registers under the command's name (the entry
# points in pyproject.toml): fastdecode never imports services (fastdecode/runtime/serving.py).


@click.group()
def serve() -> None:
    """Run one service of the fleet (each is a separate process)."""


@serve.command("kv-attention")
@settings_options(ShardSettings)
def serve_kv_attention(**flags: Any) -> None:
    """The R-part: a KV-cache shard that computes attention for its sequences."""
    run_service(registered(SERVICES, "kv-attention"), ShardSettings, flags)


@serve.command("gpu-dense")
@settings_options(DenseSettings)
def serve_gpu_dense(**flags: Any) -> None:
    """The S-part: all weights; runs step plans layer by layer against the shards."""
    run_service(registered(SERVICES, "gpu-dense"), DenseSettings, flags)


@serve.command("scheduler")
@settings_options(SchedulerSettings)
def serve_scheduler(**flags: Any) -> None:
    """The brain: admits, places sequences on shards, forms steps, streams tokens."""
    run_service(registered(SERVICES, "scheduler"), SchedulerSettings, flags)


@serve.command("gateway")
@settings_options(GatewaySettings)
def serve_gateway(**flags: Any) -> None:
    """The public API: validates, tokenizes, authenticates, streams text from the scheduler."""
    run_service(registered(SERVICES, "gateway"), GatewaySettings, flags)
