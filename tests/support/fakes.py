"""In-process fakes of the interfaces the cores talk through (no process, no port).

A fake follows the interface's contract exactly (what it returns, which ServiceError it raises), so a
core tested against it behaves as it does against the gRPC adapters in services/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastdecode.errors import ServiceError, Unavailable
from fastdecode.gateway.core import BackendInfo, UpstreamEvent
from fastdecode.gateway.text import ValidRequest


@dataclass
class FakeScheduler:
    """The gateway's SchedulerLink: `script(request_id, request)` gives the token events of a request;
    `down` makes every call fail as an unreachable scheduler would. Records what was submitted and
    which streams were closed early (cancelled upstream)."""

    script: Callable[[str, ValidRequest], list[UpstreamEvent | ServiceError]] | None = None
    info: BackendInfo = field(default_factory=lambda: BackendInfo("llama", 0, 2, "cpu"))
    down: bool = False
    submitted: list[tuple[str, ValidRequest]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def wait_connected(self, timeout: float) -> None:
        if self.down:
            await asyncio.sleep(min(timeout, 0.01))
            raise Unavailable("scheduler fake:0 is unreachable")

    async def submit(
        self, request_id: str, request: ValidRequest, timeout: float | None
    ) -> AsyncIterator[UpstreamEvent]:
        self.submitted.append((request_id, request))
        events = self.script(request_id, request) if self.script else []
        finished = False
        try:
            for ev in events:
                if isinstance(ev, ServiceError):
                    finished = True
                    raise ev
                await asyncio.sleep(0)
                yield ev
                finished = bool(ev.finish_reason)
            finished = True
        finally:
            if not finished:
                self.cancelled.append(request_id)

    async def model_info(self, timeout: float, wait_for_ready: bool = False) -> BackendInfo:
        if self.down:
            raise Unavailable("scheduler fake:0 is unreachable")
        return self.info

    async def close(self) -> None:
        pass
