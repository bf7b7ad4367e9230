"""The `fastdecode` command line: serve the services, run the fleet, generate, benchmark, plan."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

# ---- helpers ------------------------------------------------------------------------------------


def _settings_kwargs(**flags: Any) -> dict[str, Any]:
    """Only flags given on the command line; pydantic-settings fills the rest from FASTDECODE_*."""
    return {k: v for k, v in flags.items() if v is not None}


def _common_serve_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(
        [
            click.option(
                "--host", default=None, help="Bind address (env FASTDECODE_HOST, default 127.0.0.1)."
            ),
            click.option(
                "--port", type=int, default=None, help="gRPC port; 0 picks a free one (FASTDECODE_PORT)."
            ),
            click.option(
                "--metrics-port", type=int, default=None, help="Prometheus /metrics port (off if unset)."
            ),
            click.option(
                "--grace-seconds", type=float, default=None, help="Graceful stop period (default 20)."
            ),
            click.option(
                "--tls-cert", type=click.Path(dir_okay=False), default=None, help="Server cert (PEM)."
            ),
            click.option(
                "--tls-key", type=click.Path(dir_okay=False), default=None, help="Server key (PEM)."
            ),
            click.option(
                "--tls-ca", type=click.Path(dir_okay=False), default=None, help="CA (PEM): enables mTLS."
            ),
            click.option("--threads", type=int, default=None, help="torch intra-op threads."),
            click.option("--ready-file", type=click.Path(dir_okay=False), default=None, hidden=True),
            click.option("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO)."),
        ]
    ):
        f = opt(f)
    return f


def _run_service(serve: Callable[[Any], Any], settings_cls: type, flags: dict[str, Any]) -> None:
    from pydantic import ValidationError

    try:
        settings = settings_cls(**_settings_kwargs(**flags))
    except ValidationError as e:
        raise click.UsageError(str(e)) from None
    asyncio.run(serve(settings))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="fastdecode-fleet")
def main() -> None:
    """FastDecode fleet: LLM decoding split into a batched dense half and sharded attention on CPUs."""


# ---- serve ------------------------------------------------------------------------------------


@main.group()
def serve() -> None:
    """Run one service of the fleet (each is a separate process)."""


@serve.command("kv-attention")
@_common_serve_options
@click.option("--shard-id", type=int, default=None, help="This shard's index (FASTDECODE_SHARD_ID).")
@click.option("--kv-capacity", type=int, default=None, help="KV pool budget in bytes (default 1 GiB).")
@click.option("--kv-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@click.option("--block-size", type=int, default=None, help="Tokens per KV block (default 16).")
def serve_kv_attention(**flags: Any) -> None:
    """The R-part: a KV-cache shard that computes attention for its sequences."""
    from services.kv_attention.server import Settings, serve

    _run_service(serve, Settings, flags)


@serve.command("gpu-dense")
@_common_serve_options
@click.option("--model", type=click.Path(file_okay=False), default=None, help="HuggingFace checkpoint dir.")
@click.option("--shards", default=None, help="HOST:PORT,HOST:PORT of the shards in shard-id order.")
@click.option("--device", default=None, help="auto | cpu | cuda[:N] (default auto).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@click.option("--shard-timeout", type=float, default=None, help="Seconds to wait for a shard's answer.")
def serve_gpu_dense(**flags: Any) -> None:
    """The S-part: all weights; runs step plans layer by layer against the shards."""
    from services.gpu_dense.server import Settings, serve

    _run_service(serve, Settings, flags)


# ---- tools ------------------------------------------------------------------------------------


@main.command()
@click.option("--target", required=True, help="HOST:PORT of a fleet service.")
@click.option("--service", default="", help="Service name to check ('' = the server as a whole).")
@click.option("--timeout", type=float, default=3.0, show_default=True)
def health(target: str, service: str, timeout: float) -> None:
    """Exit 0 when the gRPC health service at TARGET reports SERVING (for container healthchecks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as e:
        click.echo(f"{target}: {e.code().name}", err=True)
        sys.exit(1)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    click.echo(f"{target}: {status}")
    sys.exit(0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1)


@main.command("make-model")
@click.option("--arch", type=click.Choice(["llama", "mistral", "qwen2"]), default="llama", show_default=True)
@click.option("--preset", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), required=True)
@click.option("--seed", type=int, default=0, show_default=True)
def make_model_cmd(arch: str, preset: str, out: str, seed: int) -> None:
    """Write a random-weight HuggingFace checkpoint with a trained byte-level BPE tokenizer."""
    from fastdecode.checkpoint import make_model

    path = make_model(arch, preset, Path(out), seed=seed)
    click.echo(str(path))


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers", param_hint="--prompt-ids") from None


@main.command()
@click.option(
    "--model", type=click.Path(file_okay=False), default=None, help="Checkpoint dir (default: tiny)."
)
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-ids", default=None, help="Prompt as comma-separated token ids.")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--device", default="cpu", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
def run(
    model: str | None,
    prompt: str | None,
    prompt_ids: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    device: str,
    as_json: bool,
) -> None:
    """Generate in-process with LocalEngine (no servers)."""
    from fastdecode.checkpoint import ensure_default_model
    from fastdecode.engine import LocalEngine
    from fastdecode.errors import FastDecodeError
    from fastdecode.sampling import SamplingParams
    from fastdecode.tokenizer import Tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    path = Path(model) if model else ensure_default_model()
    tok = Tokenizer.from_pretrained(path)
    ids = tok.encode(prompt) if prompt is not None else _parse_ids(prompt_ids or "")
    try:
        engine = LocalEngine.from_pretrained(path, device=device)
        params = SamplingParams(temperature, top_p, top_k, seed)
        out_ids: list[int] = []
        finish = None
        stream = tok.stream()
        if not as_json and prompt is not None:
            click.echo(prompt, nl=False)
        for events in engine.generate_stream([ids], max_tokens, params):
            for _, token, _, fin in events:
                out_ids.append(token)
                finish = fin
                if not as_json:
                    click.echo(stream.push(token), nl=False)
    except FastDecodeError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"token_ids": out_ids, "text": tok.decode(out_ids), "finish_reason": finish}))
    else:
        click.echo(stream.flush())
        click.echo(f"[{len(out_ids)} tokens, finish_reason={finish}]", err=True)


if __name__ == "__main__":
    main()
