"""gateway: the public face. Validates, tokenizes, authenticates, relays the scheduler's token
stream as UTF-8-safe text with stop strings applied (services.gateway.text).

`GatewayService.generate` is the one request path; the gRPC Generate handler here and the optional
OpenAI-compatible HTTP API (services.gateway.openai_api) are thin transports around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field, SecretStr

from fastdecode.errors import FastDecodeError, InvalidInput, ModelLoadError, ResourceExhausted, Unavailable
from fastdecode.logs import request_context
from fastdecode.model import ModelConfig
from fastdecode.rpc import (
    REQUEST_ID_KEY,
    Server,
    aio_channel,
    error_from_status,
    request_id_of,
    request_metadata,
    status_for,
)
from fastdecode.settings import ServiceSettings
from fastdecode.tokenizer import Tokenizer
from fastdecode.v1 import dense_pb2, scheduler_pb2, scheduler_pb2_grpc
from fastdecode.v1 import gateway_pb2 as pb
from services.gateway.text import GenerateParams, Limits, OutputText, ValidRequest, check_params, resolve

log = logging.getLogger("fastdecode.gateway")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gateway"].full_name  # fastdecode.v1.Gateway
# Trailer on every error status the gateway answers itself, so a client can tell them from transport
# failures (a lost connection), which are worth retrying (fastdecode.client).
ERROR_TRAILER = (("fastdecode-error-source", "gateway"),)

TTFT = Histogram(
    "fastdecode_time_to_first_token_seconds",
    "Time from request arrival to the first streamed token",
    buckets=(
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
    ),
)
ITL = Histogram(
    "fastdecode_inter_token_latency_seconds",
    "Time between two token events of one request",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0),
)
E2E = Histogram(
    "fastdecode_e2e_request_latency_seconds",
    "Time from request arrival to its last message",
    buckets=(0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0),
)
REQUESTS = Counter("fastdecode_requests_total", "Requests finished, by finish reason", ["finish_reason"])
GATEWAY_REQUESTS = Counter(
    "fastdecode_gateway_requests_total",
    "Generation requests the gateway answered; status: OK or the gRPC status code name; api: grpc or http",
    ["status", "api"],
)
IN_FLIGHT = Gauge("fastdecode_gateway_requests_in_flight", "Generation requests in flight at the gateway")
PROMPT_TOKENS = Counter("fastdecode_prompt_tokens_total", "Prompt tokens of accepted requests")
GENERATION_TOKENS = Counter("fastdecode_generation_tokens_total", "Tokens streamed to clients")


class Settings(ServiceSettings):
    scheduler: str = Field(..., description="HOST:PORT of the scheduler")
    model: Path = Field(..., description="checkpoint dir: tokenizer.json and config.json")
    auth_token: SecretStr | None = Field(None, description="bearer token clients must send (off if unset)")
    max_concurrent_requests: int = Field(
        4096, ge=1, description="Generate calls in flight; more = RESOURCE_EXHAUSTED"
    )
    max_prompt_chars: int = Field(1 << 20, ge=1)
    max_stop: int = Field(16, ge=0, description="most stop strings per request")
    max_stop_chars: int = Field(256, ge=1, description="longest stop string")
    connect_timeout: float = Field(5.0, gt=0, description="seconds to wait for an unconnected scheduler")
    max_message_bytes: int = Field(4 << 20, ge=1024, description="largest request the public ports accept")
    http_port: int | None = Field(
        None, ge=0, le=65535, description="OpenAI-compatible HTTP port (off if unset; 0 picks a free one)"
    )
    served_model_name: str | None = Field(
        None, min_length=1, max_length=256, description="HTTP API model id (default: checkpoint dir name)"
    )
    ready_file: Path | None = None


# ---- request ids --------------------------------------------------------------------------------
# A client's id is kept when it is 1-128 printable ASCII characters without spaces or commas (commas
# separate ids in x-request-id metadata: fastdecode.rpc.request_metadata); otherwise the gateway makes one.
_SANE_REQUEST_ID = re.compile(r"[!-+\--~]{1,128}")


def new_request_id() -> str:
    return f"gw-{uuid.uuid4().hex}"


def sane_request_id(candidate: str | None) -> str | None:
    return candidate if candidate and _SANE_REQUEST_ID.fullmatch(candidate) else None


# ---- requests that fail to parse ------------------------------------------------------------------
class BadRequest:
    """Stands in for a request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message = f"the request is not a valid {message_type}: {error}"


def _parser(cls: type[Message]) -> Callable[[bytes], Message | BadRequest]:
    def parse(data: bytes) -> Message | BadRequest:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return BadRequest(cls.DESCRIPTOR.full_name, str(e).split(": ")[-1] or "cannot parse")

    return parse


# ---- bearer-token auth ---------------------------------------------------------------------------
EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"


def bearer_matches(header: str | bytes, expected: bytes) -> bool | None:
    """None when `header` is not a Bearer credential, else whether its token equals `expected`
    (constant-time). Shared by the gRPC interceptor and the HTTP port."""
    v = header.decode(errors="replace") if isinstance(header, bytes) else str(header)
    scheme, _, token = v.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return hmac.compare_digest(token.strip().encode(), expected)


def _deny(handler: grpc.RpcMethodHandler, message: str, api_request: bool) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        if api_request:
            GATEWAY_REQUESTS.labels(grpc.StatusCode.UNAUTHENTICATED.name, "grpc").inc()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, ERROR_TRAILER)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <token>` on every call but health and reflection; constant-time compare."""

    def __init__(self, token: SecretStr) -> None:
        self._expected = token.get_secret_value().encode()

    def __repr__(self) -> str:
        return "BearerAuthInterceptor(token=**********)"

    def authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key.lower() == "authorization" and (ok := bearer_matches(value, self._expected)) is not None:
                return ok
        return False

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


# ---- the service ---------------------------------------------------------------------------------
def params_from_proto(r: pb.GenerateRequest) -> GenerateParams:
    which = r.WhichOneof("input")
    return GenerateParams(
        prompt=r.prompt if which == "prompt" else None,
        token_ids=list(r.token_ids.ids) if which == "token_ids" else None,
        max_tokens=r.max_tokens if r.HasField("max_tokens") else None,
        temperature=r.temperature if r.HasField("temperature") else None,
        top_p=r.top_p if r.HasField("top_p") else None,
        top_k=r.top_k if r.HasField("top_k") else None,
        seed=r.seed if r.HasField("seed") else None,
        stop=list(r.stop),
        stop_token_ids=list(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
    )


def submit_request(request_id: str, v: ValidRequest) -> scheduler_pb2.SubmitRequest:
    sampling = dense_pb2.SamplingParams(temperature=v.temperature, top_p=v.top_p, top_k=v.top_k)
    if v.seed is not None:
        sampling.seed = v.seed
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=v.prompt_ids,
        max_tokens=v.max_tokens,
        sampling=sampling,
        stop_token_ids=list(v.stop_token_ids),
        ignore_eos=v.ignore_eos,
    )


@dataclass
class Chunk:
    """One piece of a generation as both APIs send it; the last one has finish_reason and usage."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_proto(self) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(text=self.text, token_ids=self.token_ids)
        if self.finish_reason:
            resp.finish_reason = self.finish_reason
            resp.usage.prompt_tokens = self.prompt_tokens
            resp.usage.completion_tokens = self.completion_tokens
        return resp


class GatewayError(Exception):
    """A request's failure as a status code and message: what both APIs answer with.

    `param` names the offending request field where known (the HTTP API reports it)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return left


class GatewayService:
    def __init__(self, settings: Settings, tokenizer: Tokenizer, config: ModelConfig) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = settings.served_model_name or settings.model.name  # the HTTP API's model id
        self.limits = Limits(
            vocab_size=config.vocab_size,
            max_context=config.max_position_embeddings,
            max_prompt_chars=settings.max_prompt_chars,
            max_stop=settings.max_stop,
            max_stop_chars=settings.max_stop_chars,
        )
        self.eos_ids = frozenset(config.eos_token_ids)
        self.channel = aio_channel(settings.scheduler, settings.tls)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.ready = False  # set once announced; the HTTP /health reads it
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.active_ids: set[str] = set()

    # -- plumbing
    def handlers(self) -> grpc.GenericRpcHandler:
        """Method handlers whose deserializers turn unparseable bytes into BadRequest."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.Generate,
                    request_deserializer=_parser(pb.GenerateRequest),
                    response_serializer=pb.GenerateResponse.SerializeToString,
                ),
                "Tokenize": grpc.unary_unary_rpc_method_handler(
                    self.Tokenize,
                    request_deserializer=_parser(pb.TokenizeRequest),
                    response_serializer=pb.TokenizeResponse.SerializeToString,
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self.GetModelInfo,
                    request_deserializer=_parser(pb.GetModelInfoRequest),
                    response_serializer=pb.GetModelInfoResponse.SerializeToString,
                ),
            },
        )

    @staticmethod
    def failure(exc: BaseException) -> GatewayError:
        """Any exception as the status to answer with (domain errors through rpc.status_for)."""
        if isinstance(exc, GatewayError):
            return exc
        if isinstance(exc, grpc.aio.AioRpcError):
            return GatewayService._upstream_failure(exc)
        return GatewayError(*status_for(exc))

    @staticmethod
    def _upstream_failure(e: grpc.aio.AioRpcError) -> GatewayError:
        """Relay the scheduler's status: mapped codes keep code and message, others become INTERNAL."""
        code, details = e.code(), e.details() or ""
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return GatewayError(code, f"scheduler: {details}")
        exc = error_from_status(code, details)
        if type(exc) is FastDecodeError:  # no domain meaning (INTERNAL, UNKNOWN, UNAUTHENTICATED, ...)
            log.warning("scheduler failed with %s: %s", code.name, details)
            return GatewayError(grpc.StatusCode.INTERNAL, f"scheduler failed ({code.name}): {details}")
        return GatewayError(*status_for(exc))

    @staticmethod
    async def _answer(context: grpc.aio.ServicerContext, failed: GatewayError) -> None:
        await context.abort(failed.code, failed.message, ERROR_TRAILER)

    @staticmethod
    def count(api: str, code: grpc.StatusCode) -> None:
        """Count a generation request answered without entering `generate` (rejected up front)."""
        GATEWAY_REQUESTS.labels(code.name, api).inc()

    @contextlib.contextmanager
    def request_scope(self, candidate: str | None) -> Iterator[str]:
        """The request's id (the client's when sane, else a new one), bound for logging while inside.

        The id also names the sequence at the scheduler, which refuses duplicates: a client id already
        in flight here gets a suffix."""
        rid = sane_request_id(candidate) or new_request_id()
        if rid in self.active_ids:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.active_ids.add(rid)
        try:
            with request_context(rid):
                yield rid
        finally:
            self.active_ids.discard(rid)

    async def _connected(self, remaining: float | None) -> None:
        state = self.channel.get_state(try_to_connect=True)
        if state == grpc.ChannelConnectivity.READY:
            return
        wait = (
            self.settings.connect_timeout
            if remaining is None
            else min(remaining, self.settings.connect_timeout)
        )
        try:
            await asyncio.wait_for(self.channel.channel_ready(), wait)
        except TimeoutError:
            raise Unavailable(f"scheduler {self.settings.scheduler} is unreachable") from None

    async def _validate(self, params: GenerateParams) -> ValidRequest:
        check_params(params, self.limits)
        if params.prompt is not None:
            prompt_ids = await asyncio.to_thread(
                self.tokenizer.encode, params.prompt, params.add_special_tokens
            )
        else:
            prompt_ids = list(params.token_ids or [])
        return resolve(params, prompt_ids, self.limits)

    # -- the one request path of both APIs
    async def generate(
        self, params: GenerateParams, request_id: str, deadline: float | None, api: str
    ) -> AsyncIterator[Chunk]:
        """Admission (draining, concurrency), validation, tokenizing, Submit to the scheduler and
        detokenizing with stop strings, with metrics, logs and drain accounting.

        `deadline`: time.monotonic() by which the request must end (None: no deadline). Yields
        chunks with new text or token ids; the last carries finish_reason and usage. Every failure
        raises GatewayError (already counted and logged); a consumer that stops early counts as
        CANCELLED and must close the generator (contextlib.aclosing), which cancels the upstream call.
        """
        arrival = time.perf_counter()
        status = grpc.StatusCode.OK
        entered = done = False
        try:
            if self.draining:
                raise Unavailable("gateway is draining")
            if self.inflight >= self.settings.max_concurrent_requests:
                raise ResourceExhausted(f"{self.inflight} requests in flight at the gateway")
            self.inflight += 1
            entered = True
            self.idle.clear()
            IN_FLIGHT.inc()

            valid = await self._validate(params)
            hidden = set(valid.stop_token_ids) | (set() if valid.ignore_eos else set(self.eos_ids))
            out = OutputText(self.tokenizer, valid.stop, hidden, valid.prompt_ids)
            await self._connected(_remaining(deadline))
            call = self.scheduler.Submit(
                submit_request(request_id, valid),
                timeout=_remaining(deadline),
                metadata=request_metadata(request_id),
            )
            n_prompt = len(valid.prompt_ids)
            log.info("accepted (%s): %d prompt tokens, max_tokens %d", api, n_prompt, valid.max_tokens)
            PROMPT_TOKENS.inc(n_prompt)
            last: float | None = None
            try:
                async for ev in call:
                    now = time.perf_counter()
                    delta = out.push(ev.token_ids)
                    if delta.token_ids:
                        if last is None:
                            TTFT.observe(now - arrival)
                        else:
                            ITL.observe(now - last)
                        last = now
                        GENERATION_TOKENS.inc(len(delta.token_ids))
                    finish = "stop" if delta.stopped else ev.finish_reason
                    chunk = Chunk(delta.text, list(delta.token_ids))
                    if finish:
                        if not delta.stopped:
                            tail = out.finish()
                            chunk.text += tail.text
                            finish = "stop" if tail.stopped else finish
                        chunk.finish_reason = finish
                        chunk.prompt_tokens = n_prompt
                        chunk.completion_tokens = out.num_tokens
                        elapsed = time.perf_counter() - arrival
                        REQUESTS.labels(finish).inc()
                        E2E.observe(elapsed)
                        log.info(
                            "finished: %s, %d completion tokens in %.3fs", finish, out.num_tokens, elapsed
                        )
                        done = True
                        yield chunk
                        return
                    if chunk.text or chunk.token_ids:
                        yield chunk
            finally:
                call.cancel()  # no-op when finished; otherwise the scheduler frees the sequence's KV
            raise RuntimeError("the scheduler ended the token stream without a finish reason")
        except (asyncio.CancelledError, GeneratorExit):
            if not done:  # the client went away (or its deadline passed) before the end
                status = grpc.StatusCode.CANCELLED
                log.info("cancelled after %.3fs", time.perf_counter() - arrival)
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves as a GatewayError
            failed = self.failure(e)
            status = failed.code
            log.info("failed: %s: %s", failed.code.name, failed.message)
            raise failed from None
        finally:
            GATEWAY_REQUESTS.labels(status.name, api).inc()
            if entered:
                self.inflight -= 1
                IN_FLIGHT.dec()
                if self.inflight == 0:
                    self.idle.set()

    # -- RPCs
    async def Generate(
        self, request: pb.GenerateRequest | BadRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Writer style (context.write) rather than an async-generator handler: a cancel lands here
        # wherever we wait, and `aclosing` shuts the producer, whose finally cancels the upstream call.
        with self.request_scope(request_id_of(context)) as rid:
            await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
            if isinstance(request, BadRequest):
                self.count("grpc", grpc.StatusCode.INVALID_ARGUMENT)
                log.info("failed: INVALID_ARGUMENT: %s", request.message)
                await self._answer(context, GatewayError(grpc.StatusCode.INVALID_ARGUMENT, request.message))
            assert isinstance(request, pb.GenerateRequest)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            failed: GatewayError | None = None
            try:
                producer = self.generate(params_from_proto(request), rid, deadline, "grpc")
                async with contextlib.aclosing(producer) as chunks:
                    async for chunk in chunks:
                        await context.write(chunk.to_proto())
            except GatewayError as e:
                failed = e
            if failed is not None:
                await self._answer(context, failed)

    async def Tokenize(
        self, request: pb.TokenizeRequest | BadRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        if isinstance(request, BadRequest):
            await self._answer(context, GatewayError(grpc.StatusCode.INVALID_ARGUMENT, request.message))
        assert isinstance(request, pb.TokenizeRequest)
        if len(request.text) > self.limits.max_prompt_chars:
            await self._answer(
                context,
                self.failure(
                    InvalidInput(
                        f"text has {len(request.text)} characters; "
                        f"the limit is {self.limits.max_prompt_chars}"
                    )
                ),
            )
        ids = await asyncio.to_thread(self.tokenizer.encode, request.text)
        return pb.TokenizeResponse(token_ids=ids, tokens=[self.tokenizer.id_to_token(i) or "" for i in ids])

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | BadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        if isinstance(request, BadRequest):
            await self._answer(context, GatewayError(grpc.StatusCode.INVALID_ARGUMENT, request.message))
        try:
            info = await self.scheduler.GetModelInfo(
                dense_pb2.InfoRequest(), timeout=context.time_remaining() or self.settings.connect_timeout
            )
        except grpc.aio.AioRpcError as e:
            info = None
            failed = self._upstream_failure(e)
        if info is None:
            await self._answer(context, failed)
            raise AssertionError("unreachable: abort raises")
        return pb.GetModelInfoResponse(
            model_type=info.model_type or self.config.model_type,
            model_name=self.model_id,
            vocab_size=self.config.vocab_size,
            max_context=self.limits.max_context,
            eos_token_ids=list(self.config.eos_token_ids),
            num_shards=info.num_shards,
            device=info.device,
        )

    # -- lifecycle
    async def check_scheduler(self) -> None:
        """The scheduler must serve the same model geometry the gateway tokenizes for."""
        try:
            info = await self.scheduler.GetModelInfo(
                dense_pb2.InfoRequest(), timeout=self.settings.connect_timeout, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as e:
            log.warning(
                "scheduler %s not answering yet (%s); serving anyway", self.settings.scheduler, e.code().name
            )
            return
        if info.vocab_size != self.config.vocab_size:
            raise ModelLoadError(
                f"the scheduler's model has vocab_size {info.vocab_size}, "
                f"the gateway's {self.config.vocab_size}"
            )

    async def drain(self) -> None:
        """New generation requests get UNAVAILABLE; wait for the ones in flight."""
        self.draining = True
        await self.idle.wait()

    async def close(self) -> None:
        await self.channel.close()


async def serve(settings: Settings) -> None:
    log = settings.configure_logging("gateway")
    tokenizer = Tokenizer.from_pretrained(settings.model)
    config = ModelConfig.from_pretrained(settings.model)
    token = settings.auth_token if settings.auth_token and settings.auth_token.get_secret_value() else None
    server = Server(
        [SERVICE_NAME],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
        require_client_cert=False,  # public port: clients authenticate with bearer tokens
        interceptors=[BearerAuthInterceptor(token)] if token else (),
        max_message_bytes=settings.max_message_bytes,
    )
    service = GatewayService(settings, tokenizer, config)
    server.server.add_generic_rpc_handlers((service.handlers(),))
    server.install_signal_handlers()
    http = None
    if settings.http_port is not None:
        # Imported only when asked for: FastAPI adds start-up time the gRPC-only gateway need not pay.
        from services.gateway.openai_api import HTTPServer

        http = HTTPServer(service, settings, token)
    await server.start()
    if http is not None:
        await http.start()
    await service.check_scheduler()
    service.ready = True
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
        "on" if token else "off",
    )
    await server.stopping.wait()
    log.info("draining %d requests in flight", service.inflight)
    await server.stop(drain=service.drain)
    if http is not None:
        await http.stop()
    await service.close()
    log.info("stopped")
