"""A non-streamed answer's wait: the work, unless the client hangs up first (then it is cancelled,
which cancels the generation and frees its KV instead of letting it run on). Shared by the OpenAI
and Messages routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is already read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_hung_up(request: Request, work: Coroutine[Any, Any, T]) -> asyncio.Future[T] | None:
    """The finished work (its result or exception), or None when the client left first."""
    done = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not done.done():
            done.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await done
    return None if done.cancelled() else done
