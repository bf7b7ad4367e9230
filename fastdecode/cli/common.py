"""The root `fastdecode` group and the helpers the `serve` commands share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import click


def settings_kwargs(**flags: Any) -> dict[str, Any]:
    """Only flags given on the command line; pydantic-settings fills the rest from FASTDECODE_*."""
    return {k: v for k, v in flags.items() if v is not None}


def common_serve_options(f: Callable[..., Any]) -> Callable[..., Any]:
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


def run_service(serve: Callable[[Any], Any], settings_cls: type, flags: dict[str, Any]) -> None:
    from pydantic import ValidationError

    try:
        settings = settings_cls(**settings_kwargs(**flags))
    except ValidationError as e:
        raise click.UsageError(str(e)) from None
    asyncio.run(serve(settings))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="fastdecode-fleet")
def main() -> None:
    """FastDecode fleet: LLM decoding split into a batched dense half and sharded attention on CPUs."""
