"""The gateway's OpenAI-compatible HTTP front: FastAPI served by uvicorn inside the gateway's asyncio loop.

An adapter, like the gRPC servicer next to it: requests become `GenerateParams`
(fastdecode.gateway.openai) and run through `GatewayCore.generate`, the same path as gRPC Generate.
Errors leave in OpenAI's shape with the HTTP status from fastdecode.gateway.openai.HTTP_STATUS.

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template), GET
/v1/models, GET /v1/models/{id}, GET /health (no token: 200 while serving, 503 otherwise); vLLM's
/tokenize (tokenize_api.py), /v1/messages, /v1/responses, its LoRA endpoints (lora_api.py) register.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.core import GatewayCore, GenerationChunk
from fastdecode.gateway.lora import LoraRegistry
from fastdecode.gateway.openai import (
    STATUS_OF_HTTP,
    APIError,
    ChatBody,
    CompletionBody,
    RequestBody,
    cannot_chat,
    choice_params,
    completion_params,
    error_body,
    validation_error,
)
from fastdecode.gateway.reasoning import ReasoningStream, choose_reasoning_parser
from fastdecode.gateway.responses import LogprobsShape, ResponseShape, merge_choices, sse
from fastdecode.gateway.text import GenerateParams, check_params
from fastdecode.gateway.tools import ToolCallStream, ToolRequest, choose_parser
from fastdecode.runtime.errors import ModelLoadError, ServiceError, Status, Unavailable, as_service_error
from fastdecode.runtime.settings import GatewaySettings
from services.gateway.front import SSE_HEADERS, prepare_chat
from services.gateway.hangup import unless_hung_up
from services.gateway.lora_api import LoraRoutes
from services.gateway.messages_api import MESSAGES_PREFIX, MessagesRoutes, messages_error_response
from services.gateway.responses_api import RESPONSES_PATH, ResponsesRoutes
from services.gateway.router_probes import register_router_probes
from services.gateway.tokenize_api import TokenizeRoutes

log = logging.getLogger("fastdecode.gateway.http")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", MESSAGES_PREFIX, RESPONSES_PATH})
E = TypeVar("E", bound=Exception)


def error_response(e: ServiceError, status_override: int | None = None, path: str = "") -> JSONResponse:
    """OpenAI's error shape; Anthropic's on the Messages API's paths."""
    if path.startswith(MESSAGES_PREFIX):
        return messages_error_response(e, status_override)
    status, body = error_body(e)
    headers = {"WWW-Authenticate": "Bearer"} if e.status is Status.UNAUTHENTICATED else None
    return JSONResponse(body, status_code=status_override or status, headers=headers)


def _on(app: FastAPI, kind: type[E], handle: Callable[[Request, E], Awaitable[Response]]) -> None:
    """Register `handle` for `kind`, typed as the handler of any exception Starlette expects."""

    async def handler(request: Request, e: Exception) -> Response:
        if not isinstance(e, kind):  # Starlette calls it for `kind` only
            raise e
        return await handle(request, e)

    app.add_exception_handler(kind, handler)


# ---- the app -----------------------------------------------------------------------------------
class OpenAIApp:
    """Routes and handlers around one GatewayCore."""

    def __init__(
        self, core: GatewayCore, settings: GatewaySettings, loras: LoraRegistry | None = None
    ) -> None:
        self.core = core
        self.loras = loras or LoraRegistry(None, core.model_id)  # LoRA adapters a `model` may name
        self.template: ChatTemplate | None = None
        self.template_error = ""
        try:
            self.template = ChatTemplate.from_pretrained(settings.model)
        except ModelLoadError as e:  # chat is refused with the reason; completions still work
            self.template_error = str(e)
            log.warning("chat completions are off: %s", e)
        source = self.template.source if self.template is not None else ""
        family = core.config.model_type
        self.tool_parser = choose_parser(settings.tool_call_parser, source, family)
        self.reasoning_parser = choose_reasoning_parser(settings.reasoning_parser, family, source)
        app = FastAPI(
            title="FastDecode gateway (OpenAI-compatible)",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            max_body_size=settings.max_message_bytes,
        )
        _on(app, ServiceError, self._on_error)
        _on(app, RequestValidationError, self._on_validation)
        _on(app, HTTPException, self._on_http)
        app.add_exception_handler(Exception, self._on_internal)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        register_router_probes(app, core)  # /get_load, /get_server_info, /metrics ... (router_probes.py)
        self.app = app
        TokenizeRoutes(self)  # vLLM's /tokenize and /detokenize (tokenize_api.py)
        MessagesRoutes(self)  # Anthropic's Messages API on the same app (messages_api.py)
        ResponsesRoutes(self)  # OpenAI's Responses API, /v1/responses (responses_api.py)
        LoraRoutes(self)  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter (lora_api.py)

    # -- errors (each answered request counted once: generate() counts what it ran)
    def _rejected(self, request: Request, e: ServiceError) -> None:
        if request.url.path in GENERATION_PATHS:
            self.core.rejected("http", e)

    async def _on_error(self, request: Request, e: ServiceError) -> Response:
        self._rejected(request, e)
        return error_response(e, path=request.url.path)

    async def _on_validation(self, request: Request, e: RequestValidationError) -> Response:
        err = validation_error(e.errors())
        self._rejected(request, err)
        return error_response(err, path=request.url.path)  # FastAPI's 422 becomes OpenAI's 400

    async def _on_http(self, request: Request, e: HTTPException) -> Response:
        err = APIError(
            STATUS_OF_HTTP.get(e.status_code, Status.INTERNAL),
            f"{request.method} {request.url.path}: {e.detail}",
        )
        self._rejected(request, err)
        return error_response(err, e.status_code, request.url.path)

    async def _on_internal(self, request: Request, e: Exception) -> Response:
        err = as_service_error(e, log)  # logs the traceback
        self._rejected(request, err)
        return error_response(err, path=request.url.path)

    # -- routes
    async def health(self) -> Response:
        reason = self.core.not_ready_reason()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return error_response(Unavailable(reason))

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.core.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "fastdecode",
            "max_model_len": self.core.limits.max_context,
        }

    async def models(self) -> Response:
        await self.loras.refresh()
        return JSONResponse({"object": "list", "data": [self._model_card(), *self.loras.cards()]})

    async def model(self, model_id: str) -> Response:
        return JSONResponse(self.loras.card(await self.loras.resolve(model_id)) or self._model_card())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.core.model_id and model not in self.loras.loaded:
            raise APIError(
                Status.NOT_FOUND,
                f"the model {model!r} does not exist; this gateway serves {self.core.model_id!r}",
                "model",
                "model_not_found",
            )

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        params = completion_params(body, await self.loras.resolve(body.model))
        echo = None
        if body.echo:  # the prompt as sent, or the text of its token ids
            check_params(params, self.core.limits)  # at most a context of ids to decode here
            echo = (
                params.prompt
                if params.prompt is not None
                else self.core.tokenizer.decode(params.token_ids or [])
            )
        return await self._run(request, params, body, chat=False, echo=echo)

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        lora = await self.loras.resolve(body.model)
        if self.template is None:
            raise cannot_chat(self.core.model_id, self.template_error)
        params, tools = await prepare_chat(self, body, lora)
        return await self._run(request, params, body, chat=True, tools=tools)

    async def _run(  # noqa: PLR0913 - one request's parts
        self,
        request: Request,
        params: GenerateParams,
        body: RequestBody,
        chat: bool,
        echo: str | None = None,
        tools: ToolRequest | None = None,
    ) -> Response:
        rid: str = request.state.request_id
        opts = body.stream_options if body.stream else None
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        n = body.n or 1

        def shape(i: int) -> ResponseShape:
            lp = None
            if params.logprobs is not None:
                tok = self.core.tokenizer
                hidden = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.core.eos_ids))
                lp = LogprobsShape(chat, lambda t: tok.decode([t], skip_special_tokens=False), hidden)
            calls = ToolCallStream.of(tools, self.tool_parser) if tools is not None else None
            # the caller's own id in the response, never the gateway's suffixed one for a reused id
            shown = getattr(request.state, "public_id", rid)
            out = ResponseShape(
                chat, shown, params.lora or self.core.model_id, include_usage, lp, echo, i, calls
            )
            out.continuous_usage = continuous
            if isinstance(body, ChatBody):
                out.reasoning = ReasoningStream.of(self.reasoning_parser, body.chat_template_kwargs)
            return out

        # n choices are n sequences (each prefills the prompt), one seed stream each
        shapes = [shape(i) for i in range(n)]
        producers = [
            self.core.generate(choice_params(params, i), rid if n == 1 else f"{rid}-{i}", None, "http")
            for i in range(n)
        ]
        if not body.stream:
            return await self._whole(request, producers, shapes)
        try:
            # Up to the first token before answering: a request refused up front (invalid, queue
            # full, draining) gets its own status code rather than an error inside a 200 stream.
            firsts = list(await asyncio.gather(*(anext(p) for p in producers)))
        except ServiceError as e:
            await asyncio.gather(*(p.aclose() for p in producers), return_exceptions=True)
            return error_response(e)
        except BaseException:
            await asyncio.gather(*(p.aclose() for p in producers), return_exceptions=True)
            raise
        return StreamingResponse(
            self._events(firsts, producers, shapes), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def _collect(
        self, producer: AsyncGenerator[GenerationChunk], shape: ResponseShape
    ) -> tuple[dict[str, Any], GenerationChunk]:
        async with contextlib.aclosing(producer) as chunks:
            async for c in chunks:
                shape.take(c)
        return shape.collected()

    async def _whole(
        self, request: Request, producers: list[AsyncGenerator[GenerationChunk]], shapes: list[ResponseShape]
    ) -> Response:
        async def collect() -> list[tuple[dict[str, Any], GenerationChunk]]:
            return list(
                await asyncio.gather(*(self._collect(p, s) for p, s in zip(producers, shapes, strict=True)))
            )

        work = await unless_hung_up(request, collect())
        if work is None:
            return Response(status_code=499)  # nobody is listening
        try:
            done = work.result()
        except ServiceError as e:
            return error_response(e)
        return JSONResponse(shapes[0].response([c for c, _ in done], [last for _, last in done]))

    async def _events(
        self,
        firsts: list[GenerationChunk],
        producers: list[AsyncGenerator[GenerationChunk]],
        shapes: list[ResponseShape],
    ) -> AsyncIterator[bytes]:
        lasts = list(firsts)
        async with contextlib.aclosing(merge_choices(firsts, producers)) as chunks:
            try:
                if shapes[0].chat:
                    for shape, first in zip(shapes, firsts, strict=True):
                        yield shape.role_chunk(first)
                async for i, c in chunks:
                    lasts[i] = c
                    if shapes[i].wants_event(c):
                        yield shapes[i].event(c)
                if shapes[0].include_usage:
                    yield shapes[0].usage_chunk(*lasts)
            except ServiceError as e:  # after the 200: the error travels as an event, as OpenAI's do
                yield sse(error_body(e)[1])
        yield b"data: [DONE]\n\n"
