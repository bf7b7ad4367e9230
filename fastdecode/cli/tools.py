"""`fastdecode health`, `make-model` and `run` (LocalEngine in-process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command()
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

    from fastdecode.runtime.rpc import TLSFiles, sync_channel

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


@click.command("make-model")
@click.option(
    "--arch",
    type=click.Choice(["llama", "mistral", "qwen2", "qwen3_moe"]),
    default="llama",
    show_default=True,
)
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
    from fastdecode.tools.checkpoint import make_model

    path = make_model(arch, preset, Path(out), seed=seed, chat_template=chat_template)
    click.echo(str(path))


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers", param_hint="--prompt-ids") from None


@click.command()
@click.option(
    "--model",
    type=click.Path(),
    default=None,
    help="Checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct, fetched once).",
)
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Send --prompt as a user message through the chat template.")
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
    chat: bool,
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
    from fastdecode.cli.gguf import chat_token_ids, resolve_model
    from fastdecode.contract import SamplingParams
    from fastdecode.dense.engine import LocalEngine
    from fastdecode.model import ModelConfig
    from fastdecode.runtime.errors import ServiceError
    from fastdecode.runtime.tokenizer import Tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    if chat and prompt is None:
        raise click.UsageError("--chat needs --prompt")
    given_ids = _parse_ids(prompt_ids) if prompt_ids is not None else None  # arguments before the model
    path = resolve_model(model)
    tok = Tokenizer.from_pretrained(path)
    if chat:
        ids = chat_token_ids(path, [{"role": "user", "content": prompt or ""}])
    else:
        ids = given_ids if given_ids is not None else tok.encode(prompt or "")
    try:
        # KV for this one request (the engine's default room, 64 full contexts, is tens of GB
        # for a 32k-context model)
        per_token = ModelConfig.from_pretrained(path).kv_bytes_per_token(4)
        engine = LocalEngine.from_pretrained(
            path, device=device, kv_capacity_bytes=per_token * (len(ids) + max_tokens + 64)
        )
        params = SamplingParams(temperature, top_p, top_k, seed)
        out_ids: list[int] = []
        finish = None
        stream = tok.stream()
        if not as_json and prompt is not None and not chat:
            click.echo(prompt, nl=False)
        for events in engine.generate_stream([ids], max_tokens, params):
            for _, token, _, fin in events:
                out_ids.append(token)
                finish = fin
                if not as_json:
                    click.echo(stream.push(token), nl=False)
    except ServiceError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"token_ids": out_ids, "text": tok.decode(out_ids), "finish_reason": finish}))
    else:
        click.echo(stream.flush())
        click.echo(f"[{len(out_ids)} tokens, finish_reason={finish}]", err=True)
