"""The gateway's HTTP port: uvicorn inside the gateway's asyncio loop, serving the OpenAI app
(services.gateway.openai_api) behind `_Front` (request id, bearer token, body size)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import grpc
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastdecode.gateway.auth import Tenants, tenant_scope
from fastdecode.gateway.core import GatewayCore
from fastdecode.gateway.lora import LoraRegistry
from fastdecode.gateway.openai import APIError
from fastdecode.protocol import REQUEST_ID_KEY
from fastdecode.runtime.errors import Status, Unavailable
from fastdecode.runtime.settings import GatewaySettings
from services.gateway.lora_api import GrpcLoraAdmin
from services.gateway.openai_api import GENERATION_PATHS, OpenAIApp, error_response
from services.gateway.tokenize_api import AUTHENTICATED_PATHS


def _credentials(headers: dict[bytes, bytes]) -> bytes:
    """The Authorization header, or Anthropic's `x-api-key` header as a bearer token."""
    auth = headers.get(b"authorization", b"")
    key = headers.get(b"x-api-key", b"")
    return auth if auth or not key else b"Bearer " + key


class _Front:
    """Outermost ASGI layer: the request id (X-Request-Id in, and on every response) bound for
    logging; before the body is read, the bearer token on /v1/ (/health needs none) and the body
    size by Content-Length (FastAPI's max_body_size still bounds chunked bodies, in plain text)."""

    def __init__(self, app: ASGIApp, core: GatewayCore, tenants: Tenants | None, max_body: int) -> None:
        self.app = app
        self.core = core
        self.tenants = tenants or Tenants()  # None: no keys, every caller the anonymous tenant
        self.max_body = max_body

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[APIError, int] | None:
        path: str = scope.get("path", "")
        if self.tenants.enabled and (path.startswith("/v1/") or path in AUTHENTICATED_PATHS):
            if self.tenants.tenant_of(_credentials(headers)) is None:
                message = (
                    "missing or invalid bearer token (header Authorization: Bearer <token>, or x-api-key)"
                )
                return APIError(Status.UNAUTHENTICATED, message, error_code="invalid_api_key"), 401
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            message = f"the request body has {int(length)} bytes; the limit is {self.max_body}"
            return APIError(Status.INVALID_ARGUMENT, message), 413
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        candidate = headers.get(REQUEST_ID_KEY.encode())
        asked = candidate.decode("latin-1") if candidate else None
        with self.core.request_scope(asked) as rid:
            shown = self.core.public_id(asked, rid)
            scope.setdefault("state", {}).update(request_id=rid, public_id=shown)
            tag = (REQUEST_ID_KEY.encode(), shown.encode())

            started = False

            async def send_with_id(message: Message) -> None:
                nonlocal started
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), tag]
                    started = True
                await send(message)

            refused = self._refusal(scope, headers)
            if refused is not None:
                err, status = refused
                if scope.get("path") in GENERATION_PATHS:
                    self.core.metrics.answered(err.status, "http")
                await error_response(err, status, scope.get("path", ""))(scope, receive, send_with_id)
                return
            tenant = self.tenants.tenant_of(_credentials(headers)) or ""
            with tenant_scope(tenant):  # its metrics and its prefix-cache namespace
                try:
                    await self.app(scope, receive, send_with_id)
                except asyncio.CancelledError:
                    # The drain's cut-off cancels a stream's request task: its SSE stream has already
                    # ended with an error event and [DONE]; before any response, answer 503 (retry).
                    # Either way no "Exception in ASGI application" traceback for a planned stop.
                    cut = self.core.cut_off_error()
                    if cut is None:
                        raise
                    if not started:
                        await error_response(cut, path=scope.get("path", ""))(scope, receive, send_with_id)


# ---- the server --------------------------------------------------------------------------------
class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn in a loop it does not own: the gateway handles SIGTERM/SIGINT (rpc.Server) and stops
    it; uvicorn's own handlers would take the signal from the gRPC side and re-raise it on exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    # proto must be IPPROTO_TCP, not 0 as socket.create_server leaves it: accepted sockets inherit it,
    # and asyncio sets TCP_NODELAY only on sockets that say TCP. Without it, a keep-alive client waits
    # ~40 ms per response (Nagle against delayed ACKs).
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise Unavailable(f"cannot bind HTTP {host}:{port}: {e}") from None
    return sock


class HTTPServer:
    """The HTTP port: bound at construction (so the port is known before start), served as a task."""

    def __init__(
        self, core: GatewayCore, settings: GatewaySettings, tenants: Tenants, scheduler: grpc.aio.Channel
    ) -> None:
        assert settings.http_port is not None
        admin = GrpcLoraAdmin(scheduler, settings.lora_load_timeout, settings.connect_timeout)
        self.api = OpenAIApp(core, settings, LoraRegistry(admin, core.model_id))
        self.sock = _bind(settings.host, settings.http_port)
        self.port: int = self.sock.getsockname()[1]
        tls = settings.tls
        config = uvicorn.Config(
            _Front(self.api.app, core, tenants, settings.max_message_bytes),
            log_config=None,  # the service's logging (fastdecode.runtime.logs) is already set up
            access_log=False,  # the gateway logs each request itself, with its id
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(settings.grace_seconds)),
            ssl_certfile=tls.cert if tls.enabled else None,
            ssl_keyfile=tls.key if tls.enabled else None,
        )
        self.server = _EmbeddedUvicorn(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise Unavailable("the HTTP server stopped during start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Close the port and wait (up to the grace period) for open responses; call after draining."""
        if self.task is None:
            return
        self.server.should_exit = True
        await self.task
