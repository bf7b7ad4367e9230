"""The gateway's OpenAI-compatible HTTP API: FastAPI served by uvicorn inside the gateway's asyncio loop.

A transport adapter, like the gRPC servicer next to it: requests become `GenerateParams` and run
through `GatewayService.generate`, the same path as gRPC Generate (validation, tokenizing, the
scheduler, stop strings, metrics, draining and the concurrency limit). Errors leave in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the HTTP status mapped from the gRPC status
code in one place (`HTTP_STATUS`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template), GET
/v1/models, GET /v1/models/{id}, and GET /health (no token: 200 while serving, 503 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastdecode.errors import ModelLoadError, Unavailable
from fastdecode.rpc import REQUEST_ID_KEY
from services.gateway.chat import ChatTemplate
from services.gateway.server import Chunk, GatewayError, GatewayService, Settings, bearer_matches
from services.gateway.text import GenerateParams

log = logging.getLogger("fastdecode.gateway.http")

_C = grpc.StatusCode
# gRPC status code -> (HTTP status, OpenAI error type). Anything else is a 500 server_error.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    _C.INVALID_ARGUMENT: (400, "invalid_request_error"),
    _C.OUT_OF_RANGE: (400, "invalid_request_error"),
    _C.FAILED_PRECONDITION: (400, "invalid_request_error"),
    _C.UNAUTHENTICATED: (401, "authentication_error"),
    _C.PERMISSION_DENIED: (403, "permission_error"),
    _C.NOT_FOUND: (404, "invalid_request_error"),
    _C.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    _C.CANCELLED: (499, "cancelled"),
    _C.UNAVAILABLE: (503, "service_unavailable_error"),
    _C.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# An HTTP-level rejection (Starlette's own 404/405/413) back to a gRPC code, for the same shape.
_CODE_OF_HTTP = {
    400: _C.INVALID_ARGUMENT,
    404: _C.NOT_FOUND,
    405: _C.INVALID_ARGUMENT,
    413: _C.INVALID_ARGUMENT,
}
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class APIError(GatewayError):
    """A GatewayError with OpenAI's machine-readable `code` (e.g. model_not_found)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, param: str | None = None, error_code: str | None = None
    ) -> None:
        super().__init__(code, message, param)
        self.error_code = error_code


def error_body(e: GatewayError) -> tuple[int, dict[str, Any]]:
    status, kind = HTTP_STATUS.get(e.code, (500, "server_error"))
    return status, {
        "error": {
            "message": e.message,
            "type": kind,
            "param": e.param,
            "code": getattr(e, "error_code", None),
        }
    }


def error_response(e: GatewayError, status_override: int | None = None) -> JSONResponse:
    status, body = error_body(e)
    headers = {"WWW-Authenticate": "Bearer"} if e.code == _C.UNAUTHENTICATED else None
    return JSONResponse(body, status_code=status_override or status, headers=headers)


# ---- request bodies ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does (SDKs add new ones); the unsupported fields that would
    # change the answer are declared below and refused when set.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="extension: -1 or 0 = off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="extension")
    ignore_eos: bool = Field(False, description="extension")
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed on to the template

    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def _invalid(message: str, param: str | None = None) -> APIError:
    return APIError(_C.INVALID_ARGUMENT, message, param)


def _refuse_unsupported(body: _Body) -> None:
    """Parameters we cannot honour are a clear 400, not silently ignored."""
    if body.n not in (None, 1):
        raise _invalid(f"n={body.n}: only one choice per request is supported (n=1)", "n")
    if body.presence_penalty or body.frequency_penalty:
        param = "presence_penalty" if body.presence_penalty else "frequency_penalty"
        raise _invalid(f"{param} is not supported (leave it unset or 0)", param)
    if body.logit_bias:
        raise _invalid("logit_bias is not supported", "logit_bias")
    if isinstance(body, CompletionBody):
        if body.logprobs is not None:
            raise _invalid("logprobs are not supported", "logprobs")
        if body.echo:
            raise _invalid("echo is not supported", "echo")
        if body.suffix:
            raise _invalid("suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise _invalid("best_of is not supported (only 1)", "best_of")
    if isinstance(body, ChatBody):
        if body.logprobs or body.top_logprobs is not None:
            raise _invalid("logprobs are not supported", "logprobs")
        if body.tools:
            raise _invalid("tool calling is not supported", "tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise _invalid("only response_format {'type': 'text'} is supported", "response_format")


def _sampling(body: _Body, max_tokens: int | None) -> dict[str, Any]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return {
        "max_tokens": max_tokens,
        # OpenAI's default is 1.0 (the gRPC API's is greedy): an OpenAI client expects sampling.
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": body.top_p,
        "top_k": 0 if body.top_k == -1 else body.top_k,
        "seed": body.seed,
        "stop": stop,
        "stop_token_ids": list(body.stop_token_ids or []),
        "ignore_eos": body.ignore_eos,
    }


def completion_params(body: CompletionBody) -> GenerateParams:
    _refuse_unsupported(body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > 1:
            raise _invalid(f"{len(prompt)} prompts: send one prompt per request", "prompt")
        prompt = prompt[0]
    sampling = _sampling(body, body.max_tokens)
    if isinstance(prompt, str):
        return GenerateParams(prompt=prompt, **sampling)
    return GenerateParams(token_ids=list(prompt), **sampling)  # type: ignore[arg-type]


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):  # content parts: the text ones joined, as vLLM does
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise _invalid(f"messages[{i}]: content of type {part.type!r} is not supported", "messages")
            texts.append(part.text)
        d["content"] = "\n".join(texts)
    return d


def chat_params(body: ChatBody, template: ChatTemplate, max_context: int) -> GenerateParams:
    _refuse_unsupported(body)
    prompt = template.render([_message_dict(m, i) for i, m in enumerate(body.messages)])
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return GenerateParams(
        prompt=prompt,
        **_sampling(body, max_tokens),
        add_special_tokens=False,  # the template writes BOS itself where the model wants one
        default_max_tokens=max_context,  # chat without max_tokens: up to the end of the context
    )


# ---- responses ---------------------------------------------------------------------------------
def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _usage(c: Chunk) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


class _Shape:
    """Response objects of one request: completions or chat, whole or as stream chunks."""

    def __init__(self, chat: bool, request_id: str, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, last: Chunk) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": last.finish_reason}
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": _usage(last)}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has it, null but in the last one
        return _sse(out)

    def usage_chunk(self, last: Chunk) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse({**self._head(obj), "choices": [], "usage": _usage(last)})


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is already read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the app -----------------------------------------------------------------------------------
class _Front:
    """Outermost ASGI layer: the request id (X-Request-Id in, and on every response) bound for
    logging; before the body is read, the bearer token on /v1/ (/health needs none) and the body
    size by Content-Length (FastAPI's max_body_size still bounds chunked bodies, in plain text)."""

    def __init__(self, app: ASGIApp, service: GatewayService, token: SecretStr | None, max_body: int) -> None:
        self.app = app
        self.service = service
        self.expected = token.get_secret_value().encode() if token else None
        self.max_body = max_body

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[APIError, int] | None:
        path: str = scope.get("path", "")
        if self.expected is not None and path.startswith("/v1/"):
            if not bearer_matches(headers.get(b"authorization", b""), self.expected):
                message = "missing or invalid bearer token (header Authorization: Bearer <token>)"
                return APIError(_C.UNAUTHENTICATED, message, error_code="invalid_api_key"), 401
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            message = f"the request body has {int(length)} bytes; the limit is {self.max_body}"
            return APIError(_C.INVALID_ARGUMENT, message), 413
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        candidate = headers.get(REQUEST_ID_KEY.encode())
        with self.service.request_scope(candidate.decode("latin-1") if candidate else None) as rid:
            scope.setdefault("state", {})["request_id"] = rid
            tag = (REQUEST_ID_KEY.encode(), rid.encode())

            async def send_with_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), tag]
                await send(message)

            refused = self._refusal(scope, headers)
            if refused is not None:
                err, status = refused
                if scope.get("path") in GENERATION_PATHS:
                    self.service.count("http", err.code)
                await error_response(err, status)(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)


class OpenAIApp:
    """Routes and handlers around one GatewayService."""

    def __init__(self, service: GatewayService, settings: Settings) -> None:
        self.service = service
        self.template: ChatTemplate | None = None
        self.template_error = ""
        try:
            self.template = ChatTemplate.from_pretrained(settings.model)
        except ModelLoadError as e:  # chat is refused with the reason; completions still work
            self.template_error = str(e)
            log.warning("chat completions are off: %s", e)
        app = FastAPI(
            title="FastDecode gateway (OpenAI-compatible)",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            max_body_size=settings.max_message_bytes,
        )
        app.add_exception_handler(GatewayError, self._on_error)  # type: ignore[arg-type]
        app.add_exception_handler(RequestValidationError, self._on_validation)  # type: ignore[arg-type]
        app.add_exception_handler(HTTPException, self._on_http)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, self._on_internal)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        self.app = app

    # -- errors (each answered request counted once: generate() counts what it ran)
    def _rejected(self, request: Request, e: GatewayError) -> None:
        if request.url.path in GENERATION_PATHS:
            self.service.count("http", e.code)
            log.info("failed: %s: %s", e.code.name, e.message)

    async def _on_error(self, request: Request, e: GatewayError) -> Response:
        self._rejected(request, e)
        return error_response(e)

    async def _on_validation(self, request: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            param = None
        else:
            message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid"))
        err = _invalid(message, param)
        self._rejected(request, err)
        return error_response(err)  # FastAPI's 422 becomes OpenAI's 400

    async def _on_http(self, request: Request, e: HTTPException) -> Response:
        err = APIError(
            _CODE_OF_HTTP.get(e.status_code, _C.INTERNAL), f"{request.method} {request.url.path}: {e.detail}"
        )
        self._rejected(request, err)
        return error_response(err, status_override=e.status_code)

    async def _on_internal(self, request: Request, e: Exception) -> Response:
        err = self.service.failure(e)  # logs the traceback
        self._rejected(request, err)
        return error_response(err)

    # -- routes
    async def health(self) -> Response:
        if self.service.ready and not self.service.draining:
            return JSONResponse({"status": "ok"})
        reason = "gateway is draining" if self.service.draining else "gateway is starting"
        return error_response(GatewayError(_C.UNAVAILABLE, reason))

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.service.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "fastdecode",
            "max_model_len": self.service.limits.max_context,
        }

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> Response:
        self._check_model(model_id)
        return JSONResponse(self._model_card())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.service.model_id:
            raise APIError(
                _C.NOT_FOUND,
                f"the model {model!r} does not exist; this gateway serves {self.service.model_id!r}",
                "model",
                "model_not_found",
            )

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        self._check_model(body.model)
        return await self._run(request, completion_params(body), body, chat=False)

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        self._check_model(body.model)
        if self.template is None:
            reason = self.template_error or (
                "it has no chat_template (tokenizer_config.json, chat_template.jinja)"
            )
            raise _invalid(
                f"the model {self.service.model_id!r} cannot chat: {reason}; "
                "use /v1/completions with a prompt you format yourself",
                "messages",
            )
        try:
            params = chat_params(body, self.template, self.service.limits.max_context)
        except GatewayError:
            raise
        except Exception as e:  # noqa: BLE001 - the template's InvalidInput and the like
            raise self.service.failure(e) from None
        return await self._run(request, params, body, chat=True)

    async def _run(self, request: Request, params: GenerateParams, body: _Body, chat: bool) -> Response:
        rid: str = request.state.request_id
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        shape = _Shape(chat, rid, self.service.model_id, include_usage)
        producer = self.service.generate(params, rid, None, "http")
        if not body.stream:
            return await self._whole(request, producer, shape)
        try:
            # Up to the first token before answering: a request refused up front (invalid, queue
            # full, draining) gets its own status code rather than an error inside a 200 stream.
            first = await anext(producer)
        except GatewayError as e:
            return error_response(e)
        except BaseException:
            await producer.aclose()
            raise
        return StreamingResponse(
            self._events(first, producer, shape), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def _whole(self, request: Request, producer: AsyncGenerator[Chunk], shape: _Shape) -> Response:
        async def collect() -> tuple[str, Chunk]:
            parts: list[str] = []
            last: Chunk | None = None
            async with contextlib.aclosing(producer) as chunks:
                async for c in chunks:
                    parts.append(c.text)
                    last = c
            assert last is not None and last.finish_reason, "generate() ends with a finish reason"
            return "".join(parts), last

        # A client that hangs up cancels the generation (and frees its KV) instead of letting it run on.
        work = asyncio.ensure_future(collect())
        hangup = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            return Response(status_code=499)  # nobody is listening
        try:
            text, last = work.result()
        except GatewayError as e:
            return error_response(e)
        return JSONResponse(shape.whole(text, last))

    async def _events(
        self, first: Chunk, producer: AsyncGenerator[Chunk], shape: _Shape
    ) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(producer) as chunks:
            try:
                if shape.chat:
                    yield shape.chunk(None, None, role=True)
                last = first
                if first.text or first.finish_reason:
                    yield self._event(shape, first)
                async for c in chunks:
                    last = c
                    if c.text or c.finish_reason:
                        yield self._event(shape, c)
                if shape.include_usage:
                    yield shape.usage_chunk(last)
            except GatewayError as e:  # after the 200: the error travels as an event, as OpenAI's do
                yield _sse(error_body(e)[1])
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _event(shape: _Shape, c: Chunk) -> bytes:
        if shape.chat and c.text and c.finish_reason:  # OpenAI sends the finish on an empty delta
            return shape.chunk(c.text, None) + shape.chunk(None, c.finish_reason)
        return shape.chunk(c.text, c.finish_reason)


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

    def __init__(self, service: GatewayService, settings: Settings, token: SecretStr | None) -> None:
        assert settings.http_port is not None
        self.api = OpenAIApp(service, settings)
        self.sock = _bind(settings.host, settings.http_port)
        self.port: int = self.sock.getsockname()[1]
        tls = settings.tls
        config = uvicorn.Config(
            _Front(self.api.app, service, token, settings.max_message_bytes),
            log_config=None,  # the service's logging (fastdecode.logs) is already set up
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
