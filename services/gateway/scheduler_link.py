"""The gateway's SchedulerLink over gRPC: the scheduler's statuses become domain errors here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from fastdecode.gateway.core import BackendInfo, SchedulerLost, UpstreamEvent
from fastdecode.gateway.text import ValidRequest
from fastdecode.protocol import DEPENDENCY_DOWN_KEY, ERROR_SOURCE_KEY
from fastdecode.runtime.errors import (
    DependencyDown,
    InternalError,
    ServiceError,
    Status,
    Unavailable,
    error_for,
    has_domain_meaning,
)
from fastdecode.runtime.rpc import aio_channel, maps_rpc_errors, request_metadata, status_from_code
from fastdecode.runtime.settings import TLSFiles
from fastdecode.v1 import dense_pb2, scheduler_pb2, scheduler_pb2_grpc
from fastdecode.wire import gateway as wire

log = logging.getLogger("fastdecode.gateway")


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
    status, details = status_from_code(e.code()), e.details() or ""
    if status is Status.UNAVAILABLE and not _answered(e):  # the connection failed, not the scheduler
        return SchedulerLost(f"scheduler lost: {details}")
    if status is Status.UNAVAILABLE and any(k == DEPENDENCY_DOWN_KEY for k, _ in e.trailing_metadata() or ()):
        return DependencyDown(details)  # gpu_dense stayed down: resubmitting would be refused again
    if status in (Status.DEADLINE_EXCEEDED, Status.CANCELLED):
        return error_for(status, f"scheduler: {details}")
    if not has_domain_meaning(status):  # INTERNAL, UNKNOWN, UNAUTHENTICATED, ...
        log.warning("scheduler failed with %s: %s", status.name, details)
        return InternalError(f"scheduler failed ({status.name}): {details}")
    return error_for(status, details)


class GrpcSchedulerLink:
    def __init__(self, target: str, tls: TLSFiles | None) -> None:
        self.target = target
        self.channel = aio_channel(target, tls)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    async def wait_connected(self, timeout: float) -> None:
        if self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except TimeoutError:
            raise Unavailable(f"scheduler {self.target} is not reachable") from None

    @maps_rpc_errors(mapper=upstream_error)
    async def submit(
        self, request_id: str, request: ValidRequest, timeout: float | None, sample_offset: int = 0
    ) -> AsyncIterator[UpstreamEvent]:
        call = self.stub.Submit(
            wire.submit_request(request_id, request, sample_offset),
            timeout=timeout,
            metadata=request_metadata(request_id),
        )
        try:
            async for ev in call:
                yield wire.upstream_event_from_proto(ev)
        finally:
            call.cancel()  # no-op when finished; otherwise the scheduler frees the sequence's KV

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

    @maps_rpc_errors(mapper=_not_ready)
    async def _stats(self, timeout: float) -> scheduler_pb2.SchedulerStats:
        return await self.stub.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()
