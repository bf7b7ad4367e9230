"""`fastdecode serve ...`: run one service of the fleet (each is a separate process)."""

from __future__ import annotations

from typing import Any

import click

from fastdecode.cli.common import common_serve_options, run_service


@click.group()
def serve() -> None:
    """Run one service of the fleet (each is a separate process)."""


@serve.command("kv-attention")
@common_serve_options
@click.option("--shard-id", type=int, default=None, help="This shard's index (FASTDECODE_SHARD_ID).")
@click.option("--kv-capacity", type=int, default=None, help="KV pool budget in bytes (default 1 GiB).")
@click.option("--kv-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@click.option("--block-size", type=int, default=None, help="Tokens per KV block (default 16).")
def serve_kv_attention(**flags: Any) -> None:
    """The R-part: a KV-cache shard that computes attention for its sequences."""
    from services.kv_attention.server import Settings, serve

    run_service(serve, Settings, flags)


@serve.command("gpu-dense")
@common_serve_options
@click.option("--model", type=click.Path(file_okay=False), default=None, help="HuggingFace checkpoint dir.")
@click.option("--shards", default=None, help="HOST:PORT,HOST:PORT of the shards in shard-id order.")
@click.option("--device", default=None, help="auto | cpu | cuda[:N] (default auto).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@click.option("--shard-timeout", type=float, default=None, help="Seconds to wait for a shard's answer.")
def serve_gpu_dense(**flags: Any) -> None:
    """The S-part: all weights; runs step plans layer by layer against the shards."""
    from services.gpu_dense.server import Settings, serve

    run_service(serve, Settings, flags)


@serve.command("scheduler")
@common_serve_options
@click.option("--dense", default=None, help="HOST:PORT of gpu_dense.")
@click.option("--shards", default=None, help="HOST:PORT,HOST:PORT of the shards, in gpu_dense's order.")
@click.option("--admission", type=click.Choice(["naive", "stabilized"]), default=None)
@click.option("--w-limit", type=float, default=None, help="W_lim in KV tokens for stabilized admission.")
@click.option("--micro-batch", type=int, default=None, help="Sequences per admitted micro-batch.")
@click.option("--max-running", type=int, default=None, help="Most sequences decoding at once (default 256).")
@click.option("--max-waiting", type=int, default=None, help="Waiting queue bound (default 1024).")
@click.option(
    "--prefill-token-budget", type=int, default=None, help="Prefill tokens per step (default 2048)."
)
@click.option("--pipeline/--no-pipeline", default=None, help="Two-mini-batch pipeline (default on).")
@click.option("--health-interval", type=float, default=None, help="Seconds between shard health probes.")
def serve_scheduler(**flags: Any) -> None:
    """The brain: admits, places sequences on shards, forms steps, streams tokens."""
    from services.scheduler.server import Settings, serve

    run_service(serve, Settings, flags)


@serve.command("gateway")
@common_serve_options
@click.option("--scheduler", default=None, help="HOST:PORT of the scheduler (FASTDECODE_SCHEDULER).")
@click.option(
    "--model",
    type=click.Path(file_okay=False),
    default=None,
    help="Checkpoint dir with tokenizer.json and config.json (FASTDECODE_MODEL).",
)
@click.option(
    "--auth-token",
    default=None,
    help="Bearer token clients must send. Prefer env FASTDECODE_AUTH_TOKEN (argv shows in ps).",
)
@click.option(
    "--max-concurrent-requests", type=int, default=None, help="Generate calls in flight (default 4096)."
)
@click.option("--max-prompt-chars", type=int, default=None, help="Longest prompt text (default 1 Mi).")
@click.option("--max-stop", type=int, default=None, help="Most stop strings per request (default 16).")
@click.option("--max-stop-chars", type=int, default=None, help="Longest stop string (default 256).")
@click.option(
    "--connect-timeout", type=float, default=None, help="Seconds to wait for the scheduler (default 5)."
)
@click.option(
    "--served-model-name",
    default=None,
    help="Model id of the HTTP API (FASTDECODE_SERVED_MODEL_NAME; default: the checkpoint dir name).",
)
@click.option(
    "--http-port",
    type=int,
    default=None,
    help="OpenAI-compatible HTTP API on this port; 0 picks one (FASTDECODE_HTTP_PORT; off if unset).",
)
def serve_gateway(**flags: Any) -> None:
    """The public API: validates, tokenizes, authenticates, streams text from the scheduler."""
    from services.gateway.server import Settings, serve

    run_service(serve, Settings, flags)
