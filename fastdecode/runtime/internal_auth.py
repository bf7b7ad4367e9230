"""Service-to-service credentials over gRPC: the server interceptor that refuses internal calls
without the fleet secret, and the channel wrapper that adds it to every call a link makes.

Health (grpc.health.v1) and reflection stay open: orchestrators and `fastdecode health` probe them.
Every other method, including ones added later, is refused UNAUTHENTICATED before its request is
parsed (the check is on the method path, not on a list of methods).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from fastdecode.runtime.fleet_secret import FLEET_SECRET_KEY, FleetSecret
from fastdecode.runtime.logs import Throttle

log = logging.getLogger("fastdecode.auth")

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
DENIED = (
    f"missing or wrong fleet credential (call metadata {FLEET_SECRET_KEY}): "
    "internal methods serve the fleet only"
)
_LOG_EVERY_SECONDS = 10.0  # a caller without the credential must not be able to flood the log


def _secret_of(metadata: Any) -> str | bytes | None:
    for key, value in metadata or ():
        if key == FLEET_SECRET_KEY:
            return value
    return None


def handler_like(
    handler: grpc.RpcMethodHandler, behavior: Callable[..., Any], parse_request: bool = False
) -> grpc.RpcMethodHandler:
    """A method handler of `handler`'s kind (unary or streaming each way) that runs `behavior`
    instead: what an auth interceptor answers a refused call with. By default the request's bytes are
    never parsed."""
    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        behavior,
        request_deserializer=handler.request_deserializer if parse_request else None,
        response_serializer=handler.response_serializer,
    )


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED without parsing the request."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    return handler_like(handler, deny)


class FleetAuthInterceptor(grpc.aio.ServerInterceptor):
    """Internal methods need the fleet secret in the call metadata (constant-time compare)."""

    def __init__(self, secret: FleetSecret) -> None:
        self._secret = secret
        self._throttle = Throttle(_LOG_EVERY_SECONDS)

    def __repr__(self) -> str:
        return "FleetAuthInterceptor(secret=**********)"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if self._secret.matches(_secret_of(details.invocation_metadata)):
            return handler
        held = self._throttle("denied")  # one line per interval, with the count
        if held is not None:
            log.warning(
                "refused %d internal call(s) without the fleet credential (last: %s)", held + 1, method
            )
        return _deny_handler(handler)


# ---- the calling side ------------------------------------------------------------------------------
def _with(metadata: Any, extra: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    return (*tuple(metadata or ()), *extra)


class _MultiCallable:
    """A multicallable whose calls (and .with_call / .future) also carry `extra` metadata."""

    def __init__(self, inner: Any, extra: tuple[tuple[str, str], ...]) -> None:
        self._inner, self._extra = inner, extra

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner(*args, metadata=_with(metadata, self._extra), **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in ("with_call", "future"):
            return attr

        def call(*args: Any, metadata: Any = None, **kwargs: Any) -> Any:
            return attr(*args, metadata=_with(metadata, self._extra), **kwargs)

        return call


class CredentialedChannel:
    """A channel (grpc.Channel or grpc.aio.Channel) whose every call carries the fleet secret.

    Metadata is added when a call starts, so a stream costs nothing more per message: no client
    interceptor sits on the data plane (grpc.aio's would relay every Attend message through a queue)."""

    def __init__(self, channel: Any, secret: FleetSecret) -> None:
        self._channel = channel
        self._extra = ((FLEET_SECRET_KEY, secret.send),)

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self._channel.unary_unary(*args, **kwargs), self._extra)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self._channel.unary_stream(*args, **kwargs), self._extra)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self._channel.stream_unary(*args, **kwargs), self._extra)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self._channel.stream_stream(*args, **kwargs), self._extra)

    def __getattr__(self, name: str) -> Any:  # close, channel_ready, get_state, subscribe ...
        return getattr(self._channel, name)

    def __repr__(self) -> str:
        return f"CredentialedChannel({self._channel!r})"

    def __enter__(self) -> CredentialedChannel:
        self._channel.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._channel.__exit__(*exc)

    async def __aenter__(self) -> CredentialedChannel:
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> Any:
        return await self._channel.__aexit__(*exc)
