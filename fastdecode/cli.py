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
            click.option(
                "--log-json/--no-log-json", default=None, help="JSON log lines (FASTDECODE_LOG_JSON)."
            ),
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


@serve.command("scheduler")
@_common_serve_options
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
@click.option(
    "--kv-lookahead",
    type=int,
    default=None,
    help="KV headroom per running sequence, in steps of growth that admission leaves room for (default 64).",
)
def serve_scheduler(**flags: Any) -> None:
    """The brain: admits, places sequences on shards, forms steps, streams tokens."""
    from services.scheduler.server import Settings, serve

    _run_service(serve, Settings, flags)


# ---- tools ------------------------------------------------------------------------------------


@main.command()
@click.option("--target", required=True, help="HOST:PORT of a fleet service.")
@click.option("--service", default="", help="Service name to check ('' = the server as a whole).")
@click.option("--timeout", type=float, default=3.0, show_default=True)
@click.option("--tls-cert", envvar="FASTDECODE_TLS_CERT", default=None, help="Client cert for mTLS.")
@click.option("--tls-key", envvar="FASTDECODE_TLS_KEY", default=None, help="Client key for mTLS.")
@click.option("--tls-ca", envvar="FASTDECODE_TLS_CA", default=None, help="CA that signed the server cert.")
def health(
    target: str, service: str, timeout: float, tls_cert: str | None, tls_key: str | None, tls_ca: str | None
) -> None:
    """Exit 0 when the gRPC health service at TARGET reports SERVING (for container healthchecks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fastdecode.rpc import TLSFiles, sync_channel

    tls = TLSFiles(*(Path(p) if p else None for p in (tls_cert, tls_key, tls_ca)))
    try:
        with sync_channel(target, tls) as ch:
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
@click.option(
    "--chat-template/--no-chat-template",
    default=True,
    show_default=True,
    help="A ChatML chat_template in tokenizer_config.json (for /v1/chat/completions).",
)
def make_model_cmd(arch: str, preset: str, out: str, seed: int, chat_template: bool) -> None:
    """Write a random-weight HuggingFace checkpoint with a trained byte-level BPE tokenizer."""
    from fastdecode.checkpoint import make_model

    path = make_model(arch, preset, Path(out), seed=seed, chat_template=chat_template)
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


# ---- the fleet ----------------------------------------------------------------------------------


def _fleet_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(
        [
            click.option(
                "--model",
                type=click.Path(file_okay=False),
                default=None,
                help="Checkpoint dir (default: the embedded tiny model, made on first use).",
            ),
            click.option("--shards", type=click.IntRange(1, 64), default=2, show_default=True),
            click.option("--device", default="auto", show_default=True, help="gpu_dense device."),
            click.option(
                "--kv-capacity", type=int, default=1 << 30, show_default=True, help="KV bytes per shard."
            ),
            click.option(
                "--kv-dtype",
                type=click.Choice(["float32", "float16", "bfloat16"]),
                default="float32",
                show_default=True,
            ),
            click.option(
                "--admission", type=click.Choice(["naive", "stabilized"]), default="naive", show_default=True
            ),
            click.option(
                "--pipeline",
                type=click.Choice(["auto", "on", "off"]),
                default="auto",
                show_default=True,
                help="Two-mini-batch pipeline. auto: on when gpu_dense runs on CUDA, off when it shares "
                "these CPU cores with the shards (the two halves would only compete for them).",
            ),
        ]
    ):
        f = opt(f)
    return f


def _make_fleet(
    model: str | None,
    shards: int,
    port: int,
    device: str,
    kv_capacity: int,
    kv_dtype: str,
    admission: str,
    pipeline: str = "auto",
    auth_token: str | None = None,
    http_port: int | None = None,
) -> Any:
    from fastdecode.checkpoint import ensure_default_model
    from fastdecode.fleet import Fleet

    path = Path(model) if model else ensure_default_model()
    return Fleet(
        model=path,
        shards=shards,
        port=port,
        device=device,
        kv_capacity=kv_capacity,
        kv_dtype=kv_dtype,
        auth_token=auth_token,
        http_port=http_port,
        pipeline={"auto": None, "on": True, "off": False}[pipeline],
        scheduler_args=["--admission", admission],
    )


@main.command()
@_fleet_options
@click.option("--port", type=int, default=50051, show_default=True, help="Gateway port on 127.0.0.1.")
@click.option(
    "--state-file", type=click.Path(dir_okay=False), default=None, help="Write pids and addresses here."
)
@click.option("--auth-token", envvar="FASTDECODE_AUTH_TOKEN", default=None, help="Require this bearer token.")
@click.option("--log-json", is_flag=True, help="Services log JSON lines (sets FASTDECODE_LOG_JSON).")
@click.option(
    "--http-port", type=int, default=None, help="Gateway's OpenAI-compatible HTTP port on 127.0.0.1 (0: any)."
)
def up(
    model: str | None,
    shards: int,
    device: str,
    kv_capacity: int,
    kv_dtype: str,
    admission: str,
    pipeline: str,
    port: int,
    state_file: str | None,
    auth_token: str | None,
    log_json: bool,
    http_port: int | None,
) -> None:
    """Start gateway, scheduler, gpu_dense and N kv_attention shards as processes; stop on SIGINT/SIGTERM."""
    import os
    import signal
    import threading

    if log_json:
        os.environ["FASTDECODE_LOG_JSON"] = "1"  # the services inherit it

    from fastdecode.cli_progress import startup_progress
    from fastdecode.errors import FastDecodeError

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet = _make_fleet(
        model, shards, port, device, kv_capacity, kv_dtype, admission, pipeline, auth_token, http_port
    )
    try:
        with startup_progress() as on_progress:  # None (no output) when stderr is not a terminal
            fleet.start(on_progress=on_progress)
    except FastDecodeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    try:
        if state_file:
            Path(state_file).write_text(json.dumps(fleet.state(), indent=2))
        click.echo(f"gateway listening on {fleet.gateway.address}", err=False)
        if fleet.gateway.http:
            click.echo(f"OpenAI-compatible HTTP on http://{fleet.gateway.http}/v1", err=False)
        click.echo(f"logs in {fleet.workdir}; Ctrl-C to stop", err=True)
        sys.stdout.flush()
        reported: set[str] = set()
        while not stop.wait(0.5):
            for svc in fleet.services:
                if svc.proc.poll() is not None and svc.name not in reported:
                    reported.add(svc.name)
                    click.echo(
                        f"warning: {svc.name} exited with code {svc.proc.returncode}:\n{svc.log_tail(10)}",
                        err=True,
                    )
    finally:
        click.echo("stopping the fleet", err=True)
        fleet.stop()
        if state_file:
            Path(state_file).unlink(missing_ok=True)


@main.command()
@click.option("--prompt", default="The KV-cache never leaves the CPU shards, so", show_default=True)
@click.option("--max-tokens", type=int, default=48, show_default=True)
def demo(prompt: str, max_tokens: int) -> None:
    """Start the fleet on the embedded tiny model, stream one generation through the SDK, stop."""
    import time

    from fastdecode.client import Client
    from fastdecode.errors import FastDecodeError

    t0 = time.monotonic()
    fleet = _make_fleet(None, 2, 0, "auto", 256 << 20, "float32", "naive")
    try:
        fleet.start()
    except FastDecodeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    try:
        click.echo(
            f"fleet up in {time.monotonic() - t0:.1f}s: gateway {fleet.gateway.address}, "
            f"{len(fleet.kv)} kv_attention shards (random-weight model: the text is gibberish)",
            err=True,
        )
        with Client(fleet.gateway.address) as client:
            click.echo(prompt, nl=False)
            last = None
            for chunk in client.stream(prompt=prompt, max_tokens=max_tokens):
                click.echo(chunk.text, nl=False)
                last = chunk
            click.echo()
        if last is not None:
            click.echo(f"[finish_reason={last.finish_reason}, usage={last.usage}]", err=True)
    finally:
        fleet.stop()
    click.echo(f"fleet stopped; demo took {time.monotonic() - t0:.1f}s", err=True)


# Subcommands that live in their own modules (they import nothing from this one: the services
# run as `python -m fastdecode.cli`, so importing it back would load a second copy).
from fastdecode.cli_bench import bench  # noqa: E402
from fastdecode.cli_client import gateway_command, generate_cmd  # noqa: E402
from fastdecode.cli_policy import plan_cmd, simulate_cmd  # noqa: E402

serve.add_command(gateway_command(_common_serve_options, _run_service))
for _command in (generate_cmd, bench, simulate_cmd, plan_cmd):
    main.add_command(_command)

if __name__ == "__main__":
    main()
