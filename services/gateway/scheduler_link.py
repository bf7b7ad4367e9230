"""The gateway's SchedulerLink over gRPC: the scheduler's statuses become domain errors here.

Every request goes over one Session call (scheduler.proto): a submit or cancel message each way
out, and one message per scheduler step back with that step's events for all of this gateway's
requests, instead of a Submit call (and a gRPC message) per request per token."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from fastdecode.gateway.core import BackendInfo, SchedulerLost, UpstreamEvent
from fastdecode.gateway.text import ValidRequest
from fastdecode.protocol import DEPENDENCY_DOWN_KEY, ERROR_SOURCE_KEY
from fastdecode.runtime.errors import (
    DeadlineExceeded,
    DependencyDown,
    InternalError,
    ServiceError,
    Status,
    Unavailable,
    error_for,
    has_domain_meaning,
)
from fastdecode.runtime.rpc import aio_channel, maps_rpc_errors, status_from_code
from fastdecode.runtime.settings import TLSFiles
from fastdecode.v1 import dense_pb2, scheduler_pb2, scheduler_pb2_grpc
from fastdecode.wire import gateway as wire

log = logging.getLogger("fastdecode.gateway")

# What the Session call buffers ahead of the gateway's reading: a fixed window, not one grown by gRPC's
# bandwidth probe (megabytes: hundreds of steps). A gateway short of CPU reads a message per turn of
# its loop, so what it cannot keep up with waits in this window; once it is full, the scheduler's
# Session writes everything its steps delivered meanwhile as one message, several tokens a request,
# which the gateway writes on as one stream message each. Measured with its CPU held to 0.15 cores at
# B=256: 3.2 tokens a message, every token delivered in 15.8 s for a 15.3 s decode, against 35.2 s
# for a 16.8 s one (docs/benchmarks/2026-12-05-gateway-stream-interval.md). 256 KiB is ~16 steps of
# events at B=256.
SESSION_WINDOW_BYTES = 256 << 10
SESSION_CHANNEL_OPTIONS = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", SESSION_WINDOW_BYTES))


def _answered(e: grpc.aio.AioRpcError) -> bool:
    """Whether the scheduler itself gave this status (its trailer), not a failed connection."""
    return any(key == ERROR_SOURCE_KEY for key, _ in (e.trailing_metadata() or ()))


def _not_ready(e: grpc.aio.AioRpcError) -> ServiceError:
    """Why GetStats failed, for readiness: a lost connection, or the status the scheduler gave."""
    if e.code() == grpc.StatusCode.UNAVAILABLE and not _answered(e):
        return SchedulerLost("")
    return Unavailable(f"scheduler: {e.details()}")


def upstream_error(e: grpc.aio.AioRpcError) -> ServiceError:
    """Relay the scheduler's status: domain codes keep code and message, others become INTERNAL."""
    trailers = e.trailing_metadata() or ()
    return scheduler_failure(
        status_from_code(e.code()),
        e.details() or "",
        answered=_answered(e),
        dependency_down=any(k == DEPENDENCY_DOWN_KEY for k, _ in trailers),
    )


def scheduler_failure(status: Status, details: str, answered: bool, dependency_down: bool) -> ServiceError:
    """A request's end as the gateway core sees it, from a call's status and trailers or a session's
    in-band error (always `answered`: the scheduler said it)."""
    if status is Status.UNAVAILABLE and not answered:  # the connection failed, not the scheduler
        return SchedulerLost(f"scheduler lost: {details}")
    if status is Status.UNAVAILABLE and dependency_down:
        return DependencyDown(details)  # gpu_dense stayed down: resubmitting would be refused again
    if status in (Status.DEADLINE_EXCEEDED, Status.CANCELLED):
        return error_for(status, f"scheduler: {details}")
    if not has_domain_meaning(status):  # INTERNAL, UNKNOWN, UNAUTHENTICATED, ...
        log.warning("scheduler failed with %s: %s", status.name, details)
        return InternalError(f"scheduler failed ({status.name}): {details}")
    return error_for(status, details)


def session_lost(e: BaseException | None) -> ServiceError:
    """What the requests still waiting on a session get when it ends. A status the scheduler gave
    (its trailer: auth, a malformed message) is relayed; anything else (the connection broke, the
    scheduler stopped and cancelled the call, the stream just ended) lost them: SchedulerLost, and
    the gateway core resubmits them."""
    if isinstance(e, grpc.aio.AioRpcError) and (_answered(e) or e.code() == grpc.StatusCode.UNAUTHENTICATED):
        return upstream_error(e)
    if isinstance(e, grpc.aio.AioRpcError):
        return SchedulerLost(f"scheduler lost: {e.code().name}: {e.details() or ''}")
    return SchedulerLost("scheduler lost: the session ended")


class _Session:
    """One Session call carrying every request of this gateway: submits and cancels go out through
    a queue (gRPC writes them in order), one reader routes each step's events to their requests."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._out: asyncio.Queue[scheduler_pb2.SessionRequest | None] = asyncio.Queue()
        self.waiting: dict[str, asyncio.Queue[UpstreamEvent | ServiceError]] = {}
        self.lost: ServiceError | None = None  # set once the call is over
        self.call = stub.Session(self._requests())
        self._reader = asyncio.create_task(self._read())

    async def _requests(self) -> AsyncIterator[scheduler_pb2.SessionRequest]:
        while (m := await self._out.get()) is not None:
            yield m

    async def _read(self) -> None:
        ended: BaseException | None = None
        try:
            async for msg in self.call:
                for sid, item in wire.session_events_from_proto(msg):
                    events = self.waiting.get(sid)
                    if events is None:  # cancelled here meanwhile (or a NotFound for that cancel)
                        continue
                    if isinstance(item, wire.UpstreamFailure):
                        del self.waiting[sid]  # its last item: a resubmission may reuse the id
                        events.put_nowait(
                            scheduler_failure(item.status, item.message, True, item.dependency_down)
                        )
                    else:
                        if item.finish_reason:
                            del self.waiting[sid]
                        events.put_nowait(item)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            ended = e
        except Exception:  # noqa: BLE001 - a message we cannot read: its requests are lost, not hung
            log.exception("scheduler session failed")
        finally:
            self.lost = session_lost(ended)
            self.call.cancel()  # no-op once it ended; else the scheduler frees what still runs on it
            for events in self.waiting.values():
                events.put_nowait(self.lost)
            self.waiting.clear()
            self._out.put_nowait(None)

    def start(self, request_id: str, message: scheduler_pb2.SessionRequest) -> asyncio.Queue:
        events: asyncio.Queue[UpstreamEvent | ServiceError] = asyncio.Queue()
        if self.lost is not None:
            events.put_nowait(self.lost)
        elif request_id in self.waiting:  # the gateway core never runs one id twice at once
            events.put_nowait(InternalError(f"request id {request_id!r} is already waiting"))
        else:
            self.waiting[request_id] = events
            self._out.put_nowait(message)
        return events

    def stop(self, request_id: str, events: asyncio.Queue) -> None:
        """The caller is done with the request: cancel it upstream unless it ended there."""
        if self.waiting.get(request_id) is events:
            del self.waiting[request_id]
            if self.lost is None:
                self._out.put_nowait(wire.session_cancel(request_id))

    async def close(self) -> None:
        self._out.put_nowait(None)
        self.call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class GrpcSchedulerLink:
    def __init__(self, target: str, tls: TLSFiles | None, stream_interval: int = 1) -> None:
        self.target = target
        self.stream_interval = stream_interval  # tokens an event holds after the first (its end aside)
        self.channel = aio_channel(target, tls, SESSION_CHANNEL_OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.session: _Session | None = None  # every request's submit and events; opened on first use

    async def wait_connected(self, timeout: float) -> None:
        if self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except TimeoutError:
            raise Unavailable(f"scheduler {self.target} is not reachable") from None

    def _session(self) -> _Session:
        """The live session, or a new one after the last ended (the scheduler restarted)."""
        if self.session is None or self.session.lost is not None:
            self.session = _Session(self.stub)
        return self.session

    async def submit(
        self, request_id: str, request: ValidRequest, timeout: float | None, sample_offset: int = 0
    ) -> AsyncIterator[UpstreamEvent]:
        session = self._session()
        events = session.start(request_id, wire.session_submit(request_id, request, sample_offset))
        expired = None  # the deadline ends the request here and cancels it upstream
        if timeout is not None:
            late = DeadlineExceeded("scheduler: Deadline Exceeded")
            expired = asyncio.get_running_loop().call_later(max(0.0, timeout), events.put_nowait, late)
        try:
            held: ServiceError | None = None
            interval, first = self.stream_interval, True
            while True:
                item = await events.get()
                if isinstance(item, ServiceError):
                    raise item
                # Events that came while the last one was being written (a slow client, or several
                # steps in one Session message: SESSION_WINDOW_BYTES) go out as one event, one
                # message to write. After the first token, an event also waits for stream_interval
                # tokens.
                while not item.finish_reason and (
                    not events.empty() or (not first and len(item.token_ids) < interval)
                ):
                    later = events.get_nowait() if not events.empty() else await events.get()
                    if isinstance(later, ServiceError):
                        held = later  # after the tokens that came before it
                        break
                    item = item.then(later)
                first = first and not item.token_ids
                yield item
                if item.finish_reason:
                    return
                if held is not None:
                    raise held
        finally:
            if expired is not None:
                expired.cancel()
            session.stop(request_id, events)

    @maps_rpc_errors(mapper=upstream_error)
    async def model_info(self, timeout: float, wait_for_ready: bool = False) -> BackendInfo:
        info = await self.stub.GetModelInfo(
            dense_pb2.InfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready
        )
        return wire.backend_info_from_proto(info)

    async def not_ready_reason(self, timeout: float) -> str | None:
        try:
            st = await self._stats(timeout)
        except SchedulerLost:
            return f"scheduler {self.target} not reachable"
        except ServiceError as e:  # a reason, not an error: readiness reports it
            return e.message
        return st.not_ready_reason or None

    async def stats(self, timeout: float) -> scheduler_pb2.SchedulerStats:
        """The scheduler's GetStats: the fleet's load for the router probes and gauges (router_probes.py)."""
        return await self._stats(timeout)

    @maps_rpc_errors(mapper=_not_ready)
    async def _stats(self, timeout: float) -> scheduler_pb2.SchedulerStats:
        return await self.stub.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=timeout)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await self.channel.close()
