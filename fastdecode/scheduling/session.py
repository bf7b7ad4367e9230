"""Many requests on one stream: a gateway's submits and cancels in, each step's events for all of
them out together. Imports no gRPC (services/scheduler/server.py `Session` is the adapter).

The driver's step loop delivers every event of a step synchronously (`SchedulerDriver._dispatch`),
so the events of one step for this session's requests collect in `pending` before the loop next
yields; the adapter's writer then takes them as one batch: one message per step, not per request.
A request's failure is an item of the batch and ends only that request.
"""

from __future__ import annotations

import asyncio
import logging

from fastdecode.runtime.errors import InvalidInput, NotFound, ServiceError, as_service_error
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.types import Request, TokenEvent

log = logging.getLogger("fastdecode.scheduler")

Item = TokenEvent | ServiceError
Batch = list[tuple[str, Item]]


class _SessionBox:
    """One request's mailbox inside a session: what the step loop delivers goes to the session."""

    __slots__ = ("session", "seq_id")

    def __init__(self, session: RequestSession, seq_id: str) -> None:
        self.session, self.seq_id = session, seq_id

    def put(self, item: Item) -> None:
        self.session.deliver(self.seq_id, item)


class RequestSession:
    def __init__(self, driver: SchedulerDriver) -> None:
        self.driver = driver
        self.open: set[str] = set()  # requests of this session still running in the driver
        self.pending: Batch = []
        self._ready = asyncio.Event()
        self._input_ended = False
        self._broken = False

    # ---- from the gateway ------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Start `req`; a refusal (draining, duplicate id, bad input) is that request's in-band error."""
        if not req.seq_id:
            self._push("", InvalidInput("a session's submit needs a request_id"))
            return
        try:
            self.driver.open_stream(req, _SessionBox(self, req.seq_id))
        except Exception as e:  # noqa: BLE001 - one request's refusal, never the whole session's end
            self._push(req.seq_id, as_service_error(e, log))
            return
        self.open.add(req.seq_id)

    def refuse(self, seq_id: str, error: ServiceError) -> None:
        """A message for `seq_id` that could not be read (its conversion failed): its in-band error."""
        self._push(seq_id, error)

    def cancel(self, seq_id: str) -> None:
        """The gateway gave up on the request: free its KV now. No event follows for it."""
        if seq_id not in self.open:
            # Also what a cancel crossing the request's last event gets; the gateway drops it then.
            self._push(seq_id, NotFound(f"request id {seq_id!r} is not running in this session"))
            return
        self.open.discard(seq_id)
        self.driver.close_stream(seq_id, finished=False)

    def end_input(self, broken: bool = False) -> None:
        """The gateway half-closed (the session ends once its requests have), or reading its
        messages failed (`broken`: the session ends now)."""
        self._input_ended, self._broken = True, self._broken or broken
        self._ready.set()

    def close(self) -> None:
        """The session is over: every request still running on it is cancelled and frees its KV."""
        for sid in list(self.open):
            self.driver.close_stream(sid, finished=False)
        self.open.clear()

    # ---- from the step loop ----------------------------------------------------------------------
    def deliver(self, seq_id: str, item: Item) -> None:
        if seq_id not in self.open:  # cancelled meanwhile
            return
        self.pending.append((seq_id, item))
        if isinstance(item, ServiceError) or item.error is not None or item.finish_reason:
            self.open.discard(seq_id)
            self.driver.close_stream(seq_id, finished=True)
        self._ready.set()

    def _push(self, seq_id: str, error: ServiceError) -> None:
        self.pending.append((seq_id, error))
        self._ready.set()

    # ---- to the gateway --------------------------------------------------------------------------
    async def next_batch(self) -> Batch | None:
        """Everything delivered since the last batch (waits for something); None once the session
        is over: its input broke, or it ended and every request of the session has finished."""
        while True:
            if self._broken:
                return None
            if self.pending:
                batch, self.pending = self.pending, []
                return batch
            if self._input_ended and not self.open:
                return None
            self._ready.clear()
            await self._ready.wait()
