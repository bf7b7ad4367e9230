"""`fastdecode health`, `make-model` and `run` (LocalEngine in-process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fastdecode.protocol import MAX_DRAFTS

if TYPE_CHECKING:
    from fastdecode.spec import Proposer


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
@click.option(
    "--speculative",
    type=click.Choice(["off", "ngram", "suffix"]),
    default="off",
    show_default=True,
    help="Draft tokens without a draft model and verify them in one forward (docs/speculative.md); "
    "greedy tokens are unchanged, sampled ones keep their distribution.",
)
@click.option(
    "--num-speculative-tokens",
    type=click.IntRange(1, MAX_DRAFTS),
    default=None,
    help="Most drafts a step carries (3).",
)
@click.option(
    "--prompt-lookup-min", type=click.IntRange(min=1), default=None, help="ngram: shortest n-gram (1)."
)
@click.option(
    "--prompt-lookup-max", type=click.IntRange(min=1), default=None, help="ngram: longest n-gram (4)."
)
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
    speculative: str,
    num_speculative_tokens: int | None,
    prompt_lookup_min: int | None,
    prompt_lookup_max: int | None,
) -> None:
    """Generate in-process with LocalEngine (no servers)."""
    from fastdecode.cli.gguf import chat_token_ids, resolve_model
    from fastdecode.contract import SamplingParams
    from fastdecode.model import ModelConfig
    from fastdecode.runtime.errors import ServiceError
    from fastdecode.runtime.tokenizer import Tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    if chat and prompt is None:
        raise click.UsageError("--chat needs --prompt")
    given_ids = _parse_ids(prompt_ids) if prompt_ids is not None else None  # arguments before the model
    proposer = _proposer(speculative, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, seed)
    path = resolve_model(model)
    tok = Tokenizer.from_pretrained(path)
    # torch (a second of CPU) only once the arguments and the checkpoint have passed
    from fastdecode.dense.engine import LocalEngine
    from fastdecode.dense.engine_spec import SpecStats

    stats = SpecStats()
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
        for events in engine.generate_stream([ids], max_tokens, params, proposer=proposer, stats=stats):
            for _, token, _, fin in events:
                out_ids.append(token)
                finish = fin
                if not as_json:
                    click.echo(stream.push(token), nl=False)
    except ServiceError as e:
        raise click.ClickException(str(e)) from None
    result: dict[str, Any] = {"token_ids": out_ids, "text": tok.decode(out_ids), "finish_reason": finish}
    if proposer is not None:
        result["speculative"] = {"method": speculative, **stats.as_dict()}
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(stream.flush())
        spec = ""
        if proposer is not None:
            spec = (
                f", tau {stats.tau:.2f}, drafts kept {stats.accepted}/{stats.drafts}"
                if stats.rows
                else ", no drafts found"
            )
        click.echo(f"[{len(out_ids)} tokens, finish_reason={finish}{spec}]", err=True)


def _proposer(
    method: str, k: int | None, lookup_min: int | None, lookup_max: int | None, seed: int | None
) -> Proposer | None:
    """run's drafting method, or a usage error naming the setting that does not fit."""
    from fastdecode.spec import proposer_for

    if method == "off":
        if k is not None or lookup_min is not None or lookup_max is not None:
            raise click.UsageError("--num-speculative-tokens and --prompt-lookup-* need --speculative")
        return None
    if method != "ngram" and (lookup_min is not None or lookup_max is not None):
        raise click.UsageError("--prompt-lookup-min/--prompt-lookup-max apply to --speculative ngram only")
    lo, hi = lookup_min or 1, lookup_max or max(4, lookup_min or 1)
    if lo > hi:
        raise click.UsageError("--prompt-lookup-min must not exceed --prompt-lookup-max")
    if seed is not None:  # the fleet's rule: a seeded request's tokens would depend on its drafts
        raise click.UsageError(
            "--speculative does not draft for a seeded request: drop --seed or --speculative"
        )
    return proposer_for(method, k or 3, lo, hi)
