"""The gateway's OpenAI-compatible HTTP front: FastAPI served by uvicorn inside the gateway's asyncio loop.

An adapter, like the gRPC servicer next to it: requests become `GenerateParams`
(fastdecode.gateway.openai) and run through `GatewayCore.generate`, the same path as gRPC Generate.
Errors leave in OpenAI's shape with the HTTP status from fastdecode.gateway.openai.HTTP_STATUS.

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template), GET
/v1/models, GET /v1/models/{id}, and GET /health (no token: 200 while serving, 503 otherwise).
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
from fastdecode.gateway.openai import (
    STATUS_OF_HTTP,
    APIError,
    ChatBody,
    CompletionBody,
    LogprobsShape,
    RequestBody,
    ResponseShape,
    chat_params,
    choice_params,
    completion_params,
    error_body,
    join_logprobs,
    sse,
)
from fastdecode.gateway.text import GenerateParams
from fastdecode.runtime.errors import ModelLoadError, ServiceError, Status, Unavailable, as_service_error
from fastdecode.runtime.settings import GatewaySettings

log = logging.getLogger("fastdecode.gateway.http")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(e: ServiceError, status_override: int | None = None) -> JSONResponse:
    status, body = error_body(e)
    headers = {"WWW-Authenticate": "Bearer"} if e.status is Status.UNAUTHENTICATED else None
    return JSONResponse(body, status_code=status_override or status, headers=headers)


E = TypeVar("E", bound=Exception)


def _on(app: FastAPI, kind: type[E], handle: Callable[[Request, E], Awaitable[Response]]) -> None:
    """Register `handle` for `kind`, typed as the handler of any exception Starlette expects."""

    async def handler(request: Request, e: Exception) -> Response:
        if not isinstance(e, kind):  # Starlette calls it for `kind` only
            raise e
        return await handle(request, e)

    app.add_exception_handler(kind, handler)


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is already read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the app -----------------------------------------------------------------------------------
class OpenAIApp:
    """Routes and handlers around one GatewayCore."""

    def __init__(self, core: GatewayCore, settings: GatewaySettings) -> None:
        self.core = core
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
        _on(app, ServiceError, self._on_error)
        _on(app, RequestValidationError, self._on_validation)
        _on(app, HTTPException, self._on_http)
        app.add_exception_handler(Exception, self._on_internal)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        self.app = app

    # -- errors (each answered request counted once: generate() counts what it ran)
    def _rejected(self, request: Request, e: ServiceError) -> None:
        if request.url.path in GENERATION_PATHS:
            self.core.rejected("http", e)

    async def _on_error(self, request: Request, e: ServiceError) -> Response:
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
        err = APIError(Status.INVALID_ARGUMENT, message, param)
        self._rejected(request, err)
        return error_response(err)  # FastAPI's 422 becomes OpenAI's 400

    async def _on_http(self, request: Request, e: HTTPException) -> Response:
        err = APIError(
            STATUS_OF_HTTP.get(e.status_code, Status.INTERNAL),
            f"{request.method} {request.url.path}: {e.detail}",
        )
        self._rejected(request, err)
        return error_response(err, status_override=e.status_code)

    async def _on_internal(self, request: Request, e: Exception) -> Response:
        err = as_service_error(e, log)  # logs the traceback
        self._rejected(request, err)
        return error_response(err)

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
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> Response:
        self._check_model(model_id)
        return JSONResponse(self._model_card())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.core.model_id:
            raise APIError(
                Status.NOT_FOUND,
                f"the model {model!r} does not exist; this gateway serves {self.core.model_id!r}",
                "model",
                "model_not_found",
            )

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        self._check_model(body.model)
        params = completion_params(body)
        echo = None
        if body.echo:  # the prompt as sent, or the text of its token ids
            echo = (
                params.prompt
                if params.prompt is not None
                else self.core.tokenizer.decode(params.token_ids or [])
            )
        return await self._run(request, params, body, chat=False, echo=echo)

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        self._check_model(body.model)
        if self.template is None:
            reason = self.template_error or (
                "it has no chat_template (tokenizer_config.json, chat_template.jinja)"
            )
            raise APIError(
                Status.INVALID_ARGUMENT,
                f"the model {self.core.model_id!r} cannot chat: {reason}; "
                "use /v1/completions with a prompt you format yourself",
                "messages",
            )
        try:
            params = chat_params(body, self.template, self.core.limits.max_context)
        except Exception as e:  # noqa: BLE001 - the template's InvalidInput and the like
            raise as_service_error(e, log) from None
        return await self._run(request, params, body, chat=True)

    async def _run(
        self, request: Request, params: GenerateParams, body: RequestBody, chat: bool, echo: str | None = None
    ) -> Response:
        rid: str = request.state.request_id
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        n = body.n or 1

        def shape(i: int) -> ResponseShape:
            lp = None
            if params.logprobs is not None:
                tok = self.core.tokenizer
                hidden = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.core.eos_ids))
                lp = LogprobsShape(chat, lambda t: tok.decode([t], skip_special_tokens=False), hidden)
            # the caller's own id in the response, never the gateway's suffixed one for a reused id
            shown = getattr(request.state, "public_id", rid)
            return ResponseShape(chat, shown, self.core.model_id, include_usage, lp, echo, index=i)

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
        parts: list[str] = []
        logprobs: list[dict[str, Any]] = []
        last: GenerationChunk | None = None
        async with contextlib.aclosing(producer) as chunks:
            async for c in chunks:
                parts.append(c.text)
                if shape.logprobs is not None:
                    logprobs += self._logprobs(shape.logprobs, c)
                last = c
        assert last is not None and last.finish_reason, "generate() ends with a finish reason"
        whole = join_logprobs(logprobs) if shape.logprobs is not None else None
        return shape.choice("".join(parts), last, whole), last

    async def _whole(
        self, request: Request, producers: list[AsyncGenerator[GenerationChunk]], shapes: list[ResponseShape]
    ) -> Response:
        async def collect() -> list[tuple[dict[str, Any], GenerationChunk]]:
            return list(
                await asyncio.gather(*(self._collect(p, s) for p, s in zip(producers, shapes, strict=True)))
            )

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
            done = work.result()
        except ServiceError as e:
            return error_response(e)
        return JSONResponse(shapes[0].response([c for c, _ in done], [last for _, last in done]))

    @staticmethod
    def _logprobs(lp: LogprobsShape, c: GenerationChunk) -> list[dict[str, Any]]:
        """The logprobs objects of one chunk: the prompt's first (echo), then its tokens'."""
        out = []
        if c.prompt_first_token is not None:
            out.append(lp.first_prompt_token(c.prompt_first_token))
        if c.prompt_logprobs:
            out.append(lp.of(c.prompt_logprobs))
        out.append(lp.of(c.logprobs))
        return out

    @staticmethod
    async def _merged(
        firsts: list[GenerationChunk], producers: list[AsyncGenerator[GenerationChunk]]
    ) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """(choice, chunk) as each choice's chunks arrive, the first ones first."""
        for i, f in enumerate(firsts):
            yield i, f
        if len(producers) == 1:  # in this task, as before n: the drain's cut-off lands here
            async with contextlib.aclosing(producers[0]) as chunks:
                async for c in chunks:
                    yield 0, c
            return
        queue: asyncio.Queue[tuple[int, GenerationChunk | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, producer: AsyncGenerator[GenerationChunk]) -> None:
            try:
                async with contextlib.aclosing(producer) as chunks:
                    async for c in chunks:
                        await queue.put((i, c))
                await queue.put((i, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(producers)]
        try:
            left = len(tasks)
            while left:
                i, c = await queue.get()
                if c is None:
                    left -= 1
                elif isinstance(c, BaseException):
                    raise c
                else:
                    yield i, c
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _events(
        self,
        firsts: list[GenerationChunk],
        producers: list[AsyncGenerator[GenerationChunk]],
        shapes: list[ResponseShape],
    ) -> AsyncIterator[bytes]:
        lasts = list(firsts)
        async with contextlib.aclosing(self._merged(firsts, producers)) as chunks:
            try:
                if shapes[0].chat:
                    for shape in shapes:
                        yield shape.chunk(None, None, role=True)
                async for i, c in chunks:
                    lasts[i] = c
                    if c.text or c.finish_reason or self._has_logprobs(shapes[i], c):
                        yield self._event(shapes[i], c)
                if shapes[0].include_usage:
                    yield shapes[0].usage_chunk(*lasts)
            except ServiceError as e:  # after the 200: the error travels as an event, as OpenAI's do
                yield sse(error_body(e)[1])
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _has_logprobs(shape: ResponseShape, c: GenerationChunk) -> bool:
        return shape.logprobs is not None and bool(c.logprobs or c.prompt_logprobs or c.prompt_first_token)

    def _event(self, shape: ResponseShape, c: GenerationChunk) -> bytes:
        text = c.text
        if shape.echo is not None:  # the prompt leads the first chunk
            text, shape.echo = shape.echo + text, None
        lp = join_logprobs(self._logprobs(shape.logprobs, c)) if shape.logprobs is not None else None
        if shape.chat and text and c.finish_reason:  # OpenAI sends the finish on an empty delta
            return shape.chunk(text, None, logprobs=lp) + shape.chunk(None, c.finish_reason)
        return shape.chunk(text, c.finish_reason, logprobs=lp)
