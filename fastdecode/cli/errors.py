"""No command ends in a traceback for a user's input or a broken checkpoint.

The `fastdecode` group is an ErrorReportingGroup: a domain error (bad input, a checkpoint that
does not load, a peer that is gone) or an OS error (a missing or unreadable file) becomes one line
on stderr, `error: ...`, and exit status 1. Anything else is a bug and keeps its traceback.
FASTDECODE_DEBUG=1 shows the traceback of those errors too.
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
