"""The one error model: Status <-> gRPC in one table, typed item errors, the servicer wrapper, and
the gateway's relay of the scheduler's statuses."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator

import grpc
import pytest

from fastdecode.gateway.core import SchedulerLost
from fastdecode.protocol import SCHEDULER_ERROR_TRAILER
from fastdecode.runtime import errors
from fastdecode.runtime.errors import InvalidInput, ResourceExhausted, ServiceError, Status, Unavailable
from fastdecode.runtime.rpc import GRPC_CODE, handles_errors, maps_rpc_errors, status_for
from fastdecode.wire.errors import error_from_item, item_error
from services.gateway.scheduler_link import upstream_error


def test_every_status_has_its_grpc_code() -> None:
    assert set(GRPC_CODE) == set(Status)
    for status, code in GRPC_CODE.items():
        assert code.value[0] == status.value and code.name == status.name


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidInput("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.OutOfRange("x"), grpc.StatusCode.OUT_OF_RANGE),
        (errors.ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ModelLoadError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (ServiceError("x", Status.ABORTED), grpc.StatusCode.ABORTED),
    ],
)
def test_domain_errors_keep_status_and_message(exc: ServiceError, code: grpc.StatusCode) -> None:
    assert status_for(exc) == (code, "x")


def test_anything_else_is_internal_without_details() -> None:
    assert status_for(KeyError("secret path")) == (grpc.StatusCode.INTERNAL, "internal error (KeyError)")


def test_item_errors_are_typed_both_ways() -> None:
    back = error_from_item(item_error(ResourceExhausted("pool full")))
    assert type(back) is ResourceExhausted and back.message == "pool full"
    odd = error_from_item(item_error(ServiceError("?", Status.DATA_LOSS)))
    assert odd.status is Status.DATA_LOSS
    again = pickle.loads(pickle.dumps(InvalidInput("bad", param="top_p")))
    assert (type(again), again.message, again.param) == (InvalidInput, "bad", "top_p")


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    async def abort(self, code: grpc.StatusCode, details: str, trailers: tuple = ()) -> None:
        self.aborted = (code, details, trailers)
        raise grpc.aio.AbortError()


class Servicer:
    @handles_errors(trailers=(("k", "v"),))
    async def Unary(self, request: object, context: FakeContext) -> str:
        if request == "bad":
            raise InvalidInput("bad request")
        if request == "own":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "mine")
        return "ok"

    @handles_errors
    async def Stream(self, request: object, context: FakeContext) -> AsyncIterator[int]:
        yield 1
        raise Unavailable("gone")


def test_handles_errors_maps_every_failure_in_one_place() -> None:
    async def main() -> None:
        s = Servicer()
        ctx = FakeContext()
        assert await s.Unary("fine", ctx) == "ok" and ctx.aborted is None
        with pytest.raises(grpc.aio.AbortError):
            await s.Unary("bad", ctx)
        assert ctx.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "bad request", (("k", "v"),))
        with pytest.raises(grpc.aio.AbortError):
            await s.Unary("own", ctx)
        assert ctx.aborted[:2] == (grpc.StatusCode.PERMISSION_DENIED, "mine")  # kept, not re-mapped
        got: list[int] = []
        with pytest.raises(grpc.aio.AbortError):
            async for x in s.Stream(None, ctx):
                got.append(x)
        assert got == [1] and ctx.aborted == (grpc.StatusCode.UNAVAILABLE, "gone", ())

    asyncio.run(main())


def _rpc_error(code: grpc.StatusCode, details: str, answered: bool = True) -> grpc.aio.AioRpcError:
    """An RpcError as the gateway's link sees it: `answered` by the scheduler (its Submit trailer),
    or a failed connection."""
    trailers = grpc.aio.Metadata(*SCHEDULER_ERROR_TRAILER) if answered else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details)


@pytest.mark.parametrize(
    ("code", "status", "message"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Status.RESOURCE_EXHAUSTED, "queue full"),
        (grpc.StatusCode.UNAVAILABLE, Status.UNAVAILABLE, "queue full"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, Status.DEADLINE_EXCEEDED, "scheduler: queue full"),
        (grpc.StatusCode.UNKNOWN, Status.INTERNAL, "scheduler failed (UNKNOWN): queue full"),
        (grpc.StatusCode.UNAUTHENTICATED, Status.INTERNAL, "scheduler failed (UNAUTHENTICATED): queue full"),
    ],
)
def test_the_gateway_relays_the_schedulers_status(
    code: grpc.StatusCode, status: Status, message: str
) -> None:
    err = upstream_error(_rpc_error(code, "queue full"))
    assert (err.status, err.message) == (status, message)
    assert not isinstance(err, SchedulerLost)


def test_a_failed_connection_to_the_scheduler_is_a_lost_scheduler() -> None:
    err = upstream_error(_rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed", answered=False))
    assert isinstance(err, SchedulerLost) and err.status is Status.UNAVAILABLE
    assert err.message == "scheduler lost: Socket closed"


class _Link:
    """A client link whose calls fail as a peer would."""

    address = "10.0.0.7:50061"

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error
        self.closed_early = False

    @maps_rpc_errors(prefix=lambda self, *_: f"shard {self.address}: ")
    async def call(self, fail: bool) -> int:
        if fail:
            raise self.error
        return 7

    @maps_rpc_errors
    async def stream(self, fail_after: int) -> AsyncIterator[int]:
        try:
            for i in range(fail_after):
                yield i
            raise self.error
        finally:
            self.closed_early = True

    @maps_rpc_errors(mapper=upstream_error)
    async def relayed(self) -> None:
        raise self.error


def test_maps_rpc_errors_turns_a_failed_call_into_its_domain_error() -> None:
    link = _Link(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free block"))
    assert asyncio.run(link.call(False)) == 7
    with pytest.raises(ResourceExhausted) as info:
        asyncio.run(link.call(True))
    assert info.value.message == "shard 10.0.0.7:50061: no free block"
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no gRPC frames in the log

    async def read(link: _Link, n: int) -> list[int]:
        return [i async for i in link.stream(n)]

    with pytest.raises(ResourceExhausted, match="^no free block$"):
        asyncio.run(read(link, 2))

    async def first(link: _Link) -> int:  # a consumer that stops early closes the wrapped stream
        gen = link.stream(5)
        item = await anext(gen)
        await gen.aclose()
        return item

    early = _Link(link.error)
    assert asyncio.run(first(early)) == 0 and early.closed_early
    lost = _Link(_rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed", answered=False))
    with pytest.raises(SchedulerLost, match="scheduler lost: Socket closed"):
        asyncio.run(lost.relayed())
