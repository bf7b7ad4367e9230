"""No command ends in a traceback for a user's input or a broken checkpoint.

The `fastdecode` group is an ErrorReportingGroup: a domain error (bad input, a checkpoint that
does not load, a peer that is gone) or an OS error (a missing or unreadable file) becomes one line
on stderr, `error: ...`, and exit status 1. Anything else is a bug and keeps its traceback.
FASTDECODE_DEBUG=1 shows the traceback of those errors too.

The `fastdecode bench` group is a BenchGroup: a benchmark drives whole fleets, and whatever ends it
(a peer's gRPC status, a fleet that does not come up, a bug) is reported as one line naming the
benchmark, never a traceback (FASTDECODE_DEBUG=1 shows it).
"""

from __future__ import annotations

from typing import Any

import click

from fastdecode.runtime.errors import ServiceError
from fastdecode.runtime.settings import LocalSettings


class ErrorReportingGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ServiceError, OSError) as e:
            if LocalSettings().debug:
                raise
            message = " ".join(str(e).split()) or type(e).__name__  # one line
            raise click.ClickException(message) from None


def describe(e: BaseException) -> str:
    """One line for any exception: a gRPC status as `CODE: details`, else its message (or type)."""
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):  # grpc.RpcError, without importing grpc here
        name = getattr(code(), "name", str(code()))
        return f"{name}: {' '.join(str(details() or '').split())}"
    return " ".join(str(e).split()) or type(e).__name__


class BenchGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except Exception as e:  # noqa: BLE001 - every failure of a benchmark ends in one line
            if LocalSettings().debug:
                raise
            name = ctx.invoked_subcommand or "bench"
            raise click.ClickException(f"bench {name} failed: {describe(e)}") from None
