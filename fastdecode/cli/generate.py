"""`fastdecode generate`: a gateway client on the command line."""

from __future__ import annotations

import json
import sys
from typing import Any

import click


@click.command("generate")
@click.argument("prompt")
@click.option("--target", required=True, envvar="FASTDECODE_TARGET", help="HOST:PORT of the gateway.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable); not part of the output.")
@click.option(
    "--stop-token-id", "stop_token_ids", type=int, multiple=True, help="Stop token id (repeatable)."
)
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@click.option(
    "--token", envvar="FASTDECODE_AUTH_TOKEN", default=None, help="Bearer token (FASTDECODE_AUTH_TOKEN)."
)
@click.option(
    "--tls-ca", type=click.Path(dir_okay=False, exists=True), default=None, help="CA (PEM): use TLS."
)
@click.option("--timeout", type=float, default=None, help="Deadline in seconds (default 600).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@click.option(
    "--chat",
    is_flag=True,
    help="Send PROMPT as a user message through the model's chat template (read from --model).",
)
@click.option(
    "--model",
    type=click.Path(),
    envvar="FASTDECODE_MODEL",
    default=None,
    help="With --chat: the fleet's checkpoint dir or .gguf, for its template (default: the default model).",
)
def generate_cmd(
    prompt: str,
    target: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: tuple[str, ...],
    stop_token_ids: tuple[int, ...],
    ignore_eos: bool,
    token: str | None,
    tls_ca: str | None,
    timeout: float | None,
    as_json: bool,
    chat: bool,
    model: str | None,
) -> None:
    """Generate from PROMPT through the gateway at --target, streaming the text as it arrives."""
    from fastdecode.cli.gguf import chat_token_ids, resolve_model
    from fastdecode.client import Client, Completion, FastDecodeError

    text_or_ids: dict[str, Any] = {"prompt": prompt}
    if chat:  # rendered and tokenized here, as the gateway's /v1/chat/completions does
        messages = [{"role": "user", "content": prompt}]
        text_or_ids = {"token_ids": chat_token_ids(resolve_model(model), messages)}
    args: dict[str, Any] = dict(
        **text_or_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        timeout=timeout,
        ignore_eos=ignore_eos,
    )
    try:
        with Client(target, token, tls_ca=tls_ca) as client:
            if as_json:
                c: Completion = client.generate(**args)
                click.echo(
                    json.dumps(
                        {
                            "text": c.text,
                            "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                            "usage": {
                                "prompt_tokens": c.usage.prompt_tokens,
                                "completion_tokens": c.usage.completion_tokens,
                            },
                        },
                        ensure_ascii=False,
                    )
                )
                return
            last = None
            for chunk in client.stream(**args):
                if chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                last = chunk
            sys.stdout.write("\n")
            sys.stdout.flush()
            if last is not None and last.usage is not None:
                click.echo(
                    f"[finish_reason={last.finish_reason}, prompt_tokens={last.usage.prompt_tokens}, "
                    f"completion_tokens={last.usage.completion_tokens}]",
                    err=True,
                )
    except FastDecodeError as e:
        click.echo(f"error: {e.code.name}: {e.details}", err=True)
        sys.exit(1)
    except ValueError as e:
        click.echo(f"error: INVALID_ARGUMENT: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
