"""Shared gRPC plumbing for the services: the one Status -> gRPC code table, the servicer error
wrapper, server bootstrap (health, reflection, message limits, TLS, graceful SIGTERM), and channels.

Servers only: the SDK (fastdecode.client) never imports this module (it loads the health and
reflection servers and prometheus_client); what both sides share is in fastdecode.protocol.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fastdecode.protocol import CHANNEL_OPTIONS, DEPENDENCY_DOWN_KEY, MAX_MESSAGE_BYTES, REQUEST_ID_KEY
from fastdecode.runtime import errors
from fastdecode.runtime.errors import ServiceError, Status
from fastdecode.runtime.internal_auth import OPEN_PREFIXES, CredentialedChannel, FleetAuthInterceptor
from fastdecode.runtime.logs import Throttle
from fastdecode.runtime.loop import settle_heap
from fastdecode.runtime.metrics import start_metrics_server
from fastdecode.runtime.serving import write_ready_file
from fastdecode.runtime.settings import TLSFiles

log = logging.getLogger("fastdecode.runtime.rpc")

__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "REQUEST_ID_KEY",
    "TLSFiles",
]  # re-exported for old importers

F = TypeVar("F", bound=Callable[..., Any])


# The one table from our Status to gRPC's codes (same names; the values match too, see Status).
GRPC_CODE: dict[Status, grpc.StatusCode] = {s: grpc.StatusCode[s.name] for s in Status}
_STATUS_OF_CODE: dict[grpc.StatusCode, Status] = {code: s for s, code in GRPC_CODE.items()}


def status_of(exc: BaseException) -> tuple[Status, str]:
    """Any exception as (Status, message): domain errors keep theirs; anything else is INTERNAL
    with a generic message, and its traceback goes to the log (never to the caller)."""
    err = errors.as_service_error(exc, log)
    return err.status, err.message


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """`status_of` in gRPC's codes."""
    status, message = status_of(exc)
    return GRPC_CODE[status], message


def status_from_code(code: grpc.StatusCode | None) -> Status:
    return _STATUS_OF_CODE.get(code, Status.UNKNOWN) if code is not None else Status.UNKNOWN


def error_from_status(code: grpc.StatusCode, message: str) -> ServiceError:
    """A peer's gRPC status back into a domain error (for relayed errors)."""
    return errors.error_for(status_from_code(code), message)


def error_from_rpc(e: grpc.aio.AioRpcError | grpc.RpcError, prefix: str = "") -> ServiceError:
    """A failed call to a peer as the domain error of its status."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else str(e)) or ""
    return errors.error_for(status_from_code(code), f"{prefix}{details}")


RpcErrorMapper = Callable[[grpc.aio.AioRpcError], BaseException]


def maps_rpc_errors(
    fn: F | None = None,
    *,
    prefix: str | Callable[..., str] = "",
    mapper: RpcErrorMapper | None = None,
) -> Any:
    """Wrap a client-side async function or method, or an async generator: a grpc.aio.AioRpcError it
    raises leaves as the ServiceError `error_from_rpc` gives (`raise ... from None`: the gRPC frames
    stay out of the log). `prefix` goes before the peer's message: a string, or a function of the
    wrapped call's positional arguments (`lambda self, *_: f"shard {self.address}: "`). `mapper` replaces
    error_from_rpc where a link reads more than the status (the gateway's trailers).

    Use as `@maps_rpc_errors` or `@maps_rpc_errors(prefix=..., mapper=...)`."""

    def mapped(e: grpc.aio.AioRpcError, args: tuple[Any, ...]) -> BaseException:
        if mapper is not None:
            return mapper(e)
        return error_from_rpc(e, prefix(*args) if callable(prefix) else prefix)

    def wrap(f: F) -> F:
        if inspect.isasyncgenfunction(f):

            @functools.wraps(f)
            async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                inner = f(*args, **kwargs)
                try:
                    async for item in inner:
                        yield item
                except grpc.aio.AioRpcError as e:
                    raise mapped(e, args) from None
                finally:  # a consumer that stops early closes the wrapped stream now, not at GC
                    await inner.aclose()

            return cast(F, stream)

        @functools.wraps(f)
        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return await f(*args, **kwargs)
            except grpc.aio.AioRpcError as e:
                raise mapped(e, args) from None

        return cast(F, call)

    return wrap(fn) if fn is not None else wrap


def code_from_int(value: int) -> grpc.StatusCode:
    return GRPC_CODE[Status.from_value(value)]


# ---- request ids --------------------------------------------------------------------------------
def request_metadata(*request_ids: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_KEY, ",".join(request_ids)),) if request_ids else ()


def request_id_of(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's request id from the call metadata, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and value:
            return value
    return None


# ---- servicer errors ----------------------------------------------------------------------------
async def abort(
    context: grpc.aio.ServicerContext, exc: BaseException, trailers: tuple[tuple[str, str], ...] = ()
) -> NoReturn:
    """End the call with `exc`'s status (context.abort raises; this never returns)."""
    code, msg = status_for(exc)
    if isinstance(exc, errors.DependencyDown):
        trailers = (*trailers, (DEPENDENCY_DOWN_KEY, "1"))
    await context.abort(code, msg, trailers)
    raise AssertionError("context.abort returned")  # grpc.aio raises AbortError from abort


def handles_errors(method: F | None = None, *, trailers: tuple[tuple[str, str], ...] = ()) -> Any:
    """Wrap a servicer method (unary, writer-style streaming, or an async-generator streaming one), or
    a bare handler function whose last argument is the call's context: any exception it raises ends
    the call with the status `status_for` maps it to (and `trailers`), so no handler writes its own
    try/abort. Cancellation passes through; a handler's own abort is kept.

    Use as `@handles_errors` or `@handles_errors(trailers=...)`."""

    def wrap(fn: F) -> F:
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream(*args: Any) -> AsyncIterator[Any]:
                try:
                    async for item in fn(*args):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as e:  # noqa: BLE001 - mapped in one place
                    await abort(args[-1], e, trailers)

            return cast(F, stream)

        @functools.wraps(fn)
        async def unary(*args: Any) -> Any:
            try:
                return await fn(*args)
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001 - mapped in one place
                await abort(args[-1], e, trailers)

        return cast(F, unary)

    return wrap(method) if method is not None else wrap


# ---- requests that do not parse -------------------------------------------------------------------
class BadRequest:
    """Stands in for a request whose bytes did not parse (truncated, garbage, invalid UTF-8)."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message = f"the request is not a valid {message_type}: {error}"


def guarded_parser(parse: Callable[[bytes], Any], message_type: str) -> Callable[[bytes], Any]:
    """`parse`, with bytes that fail to parse turned into a BadRequest instead of an exception (which
    gRPC would answer UNKNOWN, with a traceback in the log)."""

    def guarded(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, or a UnicodeDecodeError in a string field
            return BadRequest(message_type, str(e).split(": ")[-1] or "cannot parse")

    return guarded


_BAD_REQUESTS = Throttle(10.0)  # a flood of garbage calls must not flood the log: one line per method


async def _refuse(context: grpc.aio.ServicerContext, method: str, bad: BadRequest) -> NoReturn:
    held = _BAD_REQUESTS(method)
    if held is not None:
        log.warning("%s: %s%s", method, bad.message, f" ({held} more like it held back)" if held else "")
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)
    raise AssertionError("context.abort returned")


class _GuardedContext:
    """The call's context, whose read() refuses a message that did not parse."""

    def __init__(self, context: grpc.aio.ServicerContext, method: str) -> None:
        self._context, self._method = context, method

    async def read(self) -> Any:
        message = await self._context.read()
        if isinstance(message, BadRequest):
            await _refuse(self._context, self._method, message)
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _bytes_or(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """`serialize`, passing through a response the handler already made wire bytes (the shard's
    Attend answers, built by codec.serialize_with)."""
    if serialize is None:
        return None
    return lambda message: message if isinstance(message, bytes) else serialize(message)


class GuardedRequests(grpc.aio.ServerInterceptor):
    """Every method parses its requests with a guarded deserializer: bytes that do not parse end the
    call with INVALID_ARGUMENT naming the message type and one WARNING line; the server goes on.
    A handler may also answer with wire bytes it serialized itself (they go out as they are).
    `only`: guard just the methods under these path prefixes (the gateway guards its own)."""

    def __init__(self, only: tuple[str, ...] = ()) -> None:
        self.only = only

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if self.only and not (details.method or "").startswith(self.only):
            return handler
        method = details.method
        inner = handler.request_deserializer
        message_type = getattr(getattr(inner, "__self__", None), "DESCRIPTOR", None)
        parse = guarded_parser(inner, message_type.full_name if message_type else method)
        serialize = _bytes_or(handler.response_serializer)
        if handler.unary_unary is not None:
            fn = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, BadRequest):
                    await _refuse(context, method, request)
                return await fn(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)
        if handler.unary_stream is not None:
            fn = handler.unary_stream
            if inspect.isasyncgenfunction(fn):

                async def unary_stream_gen(
                    request: Any, context: grpc.aio.ServicerContext
                ) -> AsyncIterator[Any]:
                    if isinstance(request, BadRequest):
                        await _refuse(context, method, request)
                    async for item in fn(request, context):
                        yield item

                return grpc.unary_stream_rpc_method_handler(unary_stream_gen, parse, serialize)

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, BadRequest):
                    await _refuse(context, method, request)
                return await fn(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, parse, serialize)

        def requests(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async def checked() -> AsyncIterator[Any]:
                async for message in iterator:
                    if isinstance(message, BadRequest):
                        await _refuse(context, method, message)
                    yield message

            return checked()

        if handler.stream_unary is not None:
            su = handler.stream_unary

            async def stream_unary(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                return await su(requests(iterator, context), _GuardedContext(context, method))

            return grpc.stream_unary_rpc_method_handler(stream_unary, parse, serialize)
        ss = handler.stream_stream
        if inspect.isasyncgenfunction(ss):

            async def stream_stream_gen(
                iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                async for item in ss(requests(iterator, context), _GuardedContext(context, method)):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream_gen, parse, serialize)

        async def stream_stream(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await ss(requests(iterator, context), _GuardedContext(context, method))

        return grpc.stream_stream_rpc_method_handler(stream_stream, parse, serialize)


# ---- channels -----------------------------------------------------------------------------------
def aio_channel(
    target: str, tls: TLSFiles | None = None, options: Sequence[tuple[str, int]] = ()
) -> grpc.aio.Channel:
    """A channel with CHANNEL_OPTIONS plus `options` (DATA_PLANE_OPTIONS for Attend links); every call
    on it carries the fleet secret when `tls` has one."""
    opts = [*CHANNEL_OPTIONS, *options]
    if tls is not None and (tls.enabled or tls.ca):
        channel = grpc.aio.secure_channel(target, tls.channel_credentials(), options=opts)
    else:
        channel = grpc.aio.insecure_channel(target, options=opts)
    return _credentialed(channel, tls)


def sync_channel(target: str, tls: TLSFiles | None = None) -> grpc.Channel:
    if tls is not None and (tls.enabled or tls.ca):
        channel = grpc.secure_channel(target, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    return _credentialed(channel, tls)


def _credentialed(channel: Any, tls: TLSFiles | None) -> Any:
    if tls is None or tls.secret is None:
        return channel
    return CredentialedChannel(channel, tls.secret)


# ---- server bootstrap ---------------------------------------------------------------------------
# After the grace period, calls still running get this long to send the status they were ended with.
STOP_TAIL_SECONDS = 1.0

# The health service name that says only "this process works" (liveness), apart from readiness
# ("" and the service's own names), which says whether it can do its work now.
LIVENESS_SERVICE = "liveness"


class _Health(health.aio.HealthServicer):
    """grpc.health.v1 with List answered (the stock aio servicer leaves it to the sync base, which
    raised NotImplementedError: a traceback in the log per call)."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._server_status.items()
            }
        )


class Server:
    """A grpc.aio server with health (NOT_SERVING until ready), reflection and graceful stop.

    Readiness is the overall name "" and the service's own names; `liveness` is SERVING while the
    process runs (probes that restart a process must ask that one, not readiness)."""

    def __init__(
        self,
        service_names: Sequence[str],
        host: str,
        port: int,
        tls: TLSFiles | None = None,
        grace_seconds: float = 20.0,
        require_client_cert: bool = True,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        guard_requests: bool = True,
        options: Sequence[tuple[str, int]] = (),
        internal: bool = True,
    ) -> None:
        # Undecodable bytes are INVALID_ARGUMENT everywhere (the gateway parses its own, guarded too:
        # then only health and reflection, which are ours to guard, are).
        guards = [GuardedRequests() if guard_requests else GuardedRequests(only=OPEN_PREFIXES)]
        # An internal service (internal=False: the gateway's public port) refuses callers without the
        # fleet secret, first of all, so their bytes are never parsed.
        fleet_auth = [FleetAuthInterceptor(tls.secret)] if internal and tls and tls.secret else []
        if internal and not fleet_auth:
            log.warning("no fleet secret configured: internal calls are not authenticated")
        self.server = grpc.aio.server(
            interceptors=[*fleet_auth, *interceptors, *guards] or None,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                *options,
            ],
        )
        self.service_names = list(service_names)
        self.health = _Health()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        address = f"{host}:{port}"
        if tls is not None and tls.enabled:
            self.port = self.server.add_secure_port(address, tls.server_credentials(require_client_cert))
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise errors.Unavailable(f"cannot bind {address}")
        self.grace_seconds = grace_seconds
        self.stopping = asyncio.Event()
        self._ready = False

    async def start(self) -> None:
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def set_readiness(self, reason: str | None) -> None:
        """Readiness follows whether the service can do its work now (`reason` None: it can);
        once stopping it stays NOT_SERVING."""
        if self.stopping.is_set():
            return
        if (reason is None) != self._ready:
            if reason is None:
                log.info("ready again")
            else:
                log.warning("not ready: %s", reason)
        self._ready = reason is None
        await self.set_serving(self._ready)

    async def announce(
        self, host: str, metrics_port: int | None, ready_file: Path | None, **extra: object
    ) -> int | None:
        """Ready: start /metrics, health SERVING, then the ready file a supervisor waits for
        (`extra`: more bound ports to announce, e.g. the gateway's http_port). What start-up made
        is frozen out of the cyclic collector first (settle_heap)."""
        settle_heap()
        bound = start_metrics_server(metrics_port, host)
        self._ready = True
        await self.set_serving(True)
        write_ready_file(ready_file, port=self.port, metrics_port=bound, **extra)
        return bound

    def install_signal_handlers(self, supervisor_pid: int | None = None) -> None:
        """SIGTERM/SIGINT stop gracefully; so does the exit of `supervisor_pid` (fastdecode up),
        from ServiceSettings.supervisor_pid."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if supervisor_pid is not None:
            self._watchdog = asyncio.create_task(self._watch_supervisor(supervisor_pid))

    async def _watch_supervisor(self, pid: int) -> None:
        """Stop gracefully when the supervisor that started us (fastdecode up) is gone."""
        while not self.stopping.is_set():
            await asyncio.sleep(1.0)
            if os.getppid() != pid:
                log.warning("supervisor %d is gone: stopping", pid)
                self.stopping.set()

    async def stop(
        self, drain: Callable[[], Awaitable[None]] | None = None, cut_off: Callable[[], None] | None = None
    ) -> None:
        """Health NOT_SERVING and no new work; running calls finish until the grace period ends
        (`drain` returns when they have); then `cut_off` ends the rest with UNAVAILABLE ("draining,
        retry") and the server stops, so the whole stop takes at most grace + about a second (an
        orchestrator's termination grace sized to the setting never has to SIGKILL us)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_seconds
        await self.set_serving(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), self.grace_seconds)
            except TimeoutError:
                log.warning("drain did not finish within %.0fs: ending the rest", self.grace_seconds)
                if cut_off is not None:
                    cut_off()
        # What is still running gets what is left of the grace, at most a second to send its status.
        await self.server.stop(min(STOP_TAIL_SECONDS, max(0.0, deadline - loop.time()) + STOP_TAIL_SECONDS))
