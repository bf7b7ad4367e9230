"""gateway: the gRPC front of fastdecode.gateway.core.GatewayCore, bearer-token auth, and `serve()`
(which also starts the OpenAI-compatible HTTP front, services.gateway.openai_api, when asked)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from fastdecode.gateway.auth import Tenants, bearer_token, tenant_scope
from fastdecode.gateway.core import GatewayCore
from fastdecode.model import ModelConfig
from fastdecode.protocol import ERROR_TRAILER, REQUEST_ID_KEY
from fastdecode.runtime.errors import InvalidInput, Unauthenticated
from fastdecode.runtime.internal_auth import handler_like
from fastdecode.runtime.rpc import BadRequest, Server, guarded_parser, handles_errors, request_id_of
from fastdecode.runtime.settings import GatewaySettings
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.v1 import gateway_pb2 as pb
from fastdecode.wire.gateway import chunk_to_proto, model_card_to_proto, params_from_proto
from services.gateway.fleet_load import fleet_watch
from services.gateway.metrics import GATEWAY_REQUESTS, PrometheusGatewayMetrics
from services.gateway.scheduler_link import GrpcSchedulerLink

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gateway"].full_name  # fastdecode.v1.Gateway
Settings = GatewaySettings  # the one settings class: fastdecode.runtime.settings
__all__ = ["ERROR_TRAILER", "SERVICE_NAME", "GatewayServicer", "Settings", "serve"]


# ---- requests that fail to parse ------------------------------------------------------------------
def _parser(cls: type[Message]) -> Callable[[bytes], Message | BadRequest]:
    """The gateway's handlers take a BadRequest for bytes that do not parse (rpc's one guard)."""
    return guarded_parser(cls.FromString, cls.DESCRIPTOR.full_name)


# ---- bearer-token auth ---------------------------------------------------------------------------
EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"


def _deny(handler: grpc.RpcMethodHandler, message: str, api_request: bool) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    @handles_errors(trailers=ERROR_TRAILER)
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        if api_request:
            GATEWAY_REQUESTS.labels(grpc.StatusCode.UNAUTHENTICATED.name, "grpc").inc()
        raise Unauthenticated(message)

    return handler_like(handler, deny, parse_request=True)


def tenant_of(tenants: Tenants, metadata: Any) -> str | None:
    """The caller's tenant from `authorization: Bearer <key>` metadata; None: not a known key."""
    if not tenants.enabled:
        return ""
    for key, value in metadata or ():
        if key.lower() == "authorization" and bearer_token(value) is not None:
            return tenants.tenant_of(value)
    return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` on every call but health and reflection; constant-time compare
    against each key (--auth-token, --api-keys-file)."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    def __repr__(self) -> str:
        return "BearerAuthInterceptor(keys=**********)"

    def authorized(self, metadata: Any) -> bool:
        return tenant_of(self.tenants, metadata) is not None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _deny(
            handler,
            "missing or invalid bearer token (metadata authorization: Bearer <token>)",
            api_request=method == GENERATE_METHOD,
        )


# ---- the servicer ------------------------------------------------------------------------------
def _parsed(request: Message | BadRequest) -> Any:
    if isinstance(request, BadRequest):
        raise InvalidInput(request.message)
    return request


class GatewayServicer:
    """fastdecode.v1.Gateway over one GatewayCore. Errors leave through `handles_errors`, marked
    with ERROR_TRAILER so a client can tell them from transport failures."""

    def __init__(self, core: GatewayCore, tenants: Tenants | None = None) -> None:
        self.core = core
        self.tenants = tenants or Tenants()

    def handlers(self) -> grpc.GenericRpcHandler:
        """Method handlers whose deserializers turn unparseable bytes into BadRequest."""
        methods = {
            "Generate": (
                grpc.unary_stream_rpc_method_handler,
                self.Generate,
                pb.GenerateRequest,
                pb.GenerateResponse,
            ),
            "Tokenize": (
                grpc.unary_unary_rpc_method_handler,
                self.Tokenize,
                pb.TokenizeRequest,
                pb.TokenizeResponse,
            ),
            "GetModelInfo": (
                grpc.unary_unary_rpc_method_handler,
                self.GetModelInfo,
                pb.GetModelInfoRequest,
                pb.GetModelInfoResponse,
            ),
        }
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                name: kind(fn, request_deserializer=_parser(req), response_serializer=resp.SerializeToString)
                for name, (kind, fn, req, resp) in methods.items()
            },
        )

    @handles_errors(trailers=ERROR_TRAILER)
    async def Generate(
        self, request: pb.GenerateRequest | BadRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Writer style (context.write) rather than an async-generator handler: a cancel lands here
        # wherever we wait, and `aclosing` shuts the producer, whose finally cancels the upstream call.
        tenant = tenant_of(self.tenants, context.invocation_metadata()) or ""  # the interceptor checked it
        asked = request_id_of(context)
        with self.core.request_scope(asked) as rid, tenant_scope(tenant):
            await context.send_initial_metadata(((REQUEST_ID_KEY, self.core.public_id(asked, rid)),))
            if isinstance(request, BadRequest):
                err = InvalidInput(request.message)
                self.core.rejected("grpc", err)
                raise err
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            producer = self.core.generate(params_from_proto(request), rid, deadline, "grpc")
            try:
                async with contextlib.aclosing(producer) as chunks:
                    async for chunk in chunks:
                        await context.write(chunk_to_proto(chunk))
            except asyncio.CancelledError:
                cut = self.core.cut_off_error()  # the drain's cancel landed in our write
                if cut is not None:
                    raise cut from None
                raise

    @handles_errors(trailers=ERROR_TRAILER)
    async def Tokenize(
        self, request: pb.TokenizeRequest | BadRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        ids, tokens = await self.core.tokenize(_parsed(request).text)
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    @handles_errors(trailers=ERROR_TRAILER)
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | BadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        _parsed(request)
        return model_card_to_proto(await self.core.model_card(context.time_remaining()))


async def _readiness(server: Server, core: GatewayCore, interval: float) -> None:
    """gRPC health (readiness) follows whether the fleet can generate; `liveness` stays SERVING."""
    while True:
        await server.set_readiness(await core.check_readiness())
        await asyncio.sleep(interval)


async def serve(settings: GatewaySettings) -> None:
    log = settings.configure_logging("gateway")
    tokenizer = Tokenizer.from_pretrained(settings.model)
    config = ModelConfig.from_pretrained(settings.model)
    token = settings.auth_token if settings.auth_token and settings.auth_token.get_secret_value() else None
    tenants = Tenants(token.get_secret_value().encode() if token else None, settings.api_keys_file)
    server = Server(
        [SERVICE_NAME],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
        require_client_cert=False,  # public port: clients authenticate with bearer tokens
        interceptors=[BearerAuthInterceptor(tenants)] if tenants.enabled else (),
        max_message_bytes=settings.max_message_bytes,
        guard_requests=False,  # its handlers parse with their own guard (BadRequest, counted as rejected)
        internal=False,  # public: clients need the bearer token, not the fleet secret
    )
    link = GrpcSchedulerLink(settings.scheduler, settings.tls, settings.stream_interval)
    metrics = PrometheusGatewayMetrics()
    metrics.tenants(tenants.names())
    core = GatewayCore(settings, tokenizer, config, link, metrics)
    server.server.add_generic_rpc_handlers((GatewayServicer(core, tenants).handlers(),))
    server.install_signal_handlers(settings.supervisor_pid)
    if settings.api_keys_file is not None:  # from the start, even while the file holds no keys

        def reload_keys() -> None:  # SIGHUP: the keys file again (a bad or empty one keeps the old keys)
            try:
                tenants.reload()
            except InvalidInput as e:  # unreadable while no key was ever read: nobody admitted still
                log.error("%s; no request is admitted until it reads", e.message)
            metrics.tenants(tenants.names())

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
    http = None
    if settings.http_port is not None:
        # Imported only when asked for: FastAPI adds start-up time the gRPC-only gateway need not pay.
        from services.gateway.http_server import HTTPServer

        http = HTTPServer(core, settings, tenants, link.channel)
    await server.start()
    if http is not None:
        await http.start()
    await core.check_scheduler()
    watch = fleet_watch(core)
    await watch.refresh()  # the load gauges are right from the first scrape
    core.ready = True
    await server.announce(
        settings.host, settings.metrics_port, settings.ready_file, http_port=http.port if http else None
    )
    log.info(
        "serving %s on %s:%d%s (scheduler %s, TLS %s, bearer auth %s)",
        settings.model,
        settings.host,
        server.port,
        f", OpenAI HTTP on port {http.port}" if http else "",
        settings.scheduler,
        "on" if settings.tls.enabled else "off",
        f"on, {len(tenants.names())} tenants" if tenants.enabled else "off",
    )
    readiness = asyncio.create_task(_readiness(server, core, settings.readiness_interval))
    load_watch = asyncio.create_task(watch.run())
    await server.stopping.wait()
    readiness.cancel()
    load_watch.cancel()
    log.info("draining %d requests in flight", core.inflight)
    await server.stop(drain=core.drain, cut_off=core.cut_off)
    if http is not None:
        await http.stop()
    await core.close()
    log.info("stopped")
