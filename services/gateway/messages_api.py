"""Anthropic's Messages API on the gateway's HTTP port: POST /v1/messages and POST
/v1/messages/count_tokens, thin routes over fastdecode.gateway.anthropic (the translation onto the
OpenAI chat path) and GatewayCore.generate, the one request path. Registered by OpenAIApp, whose
error handlers answer these paths in Anthropic's error shape (messages_error_response)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastdecode.gateway.anthropic import (
    CountTokensBody,
    MessagesBody,
    MessageShape,
    chat_body,
    error_body_of,
    error_event,
    parse,
)
from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.openai import APIError, ChatBody, cannot_chat
from fastdecode.gateway.reasoning import ReasoningStream
from fastdecode.gateway.text import GenerateParams, check_params, tokenize_request
from fastdecode.gateway.tools import ToolCallStream, ToolRequest
from fastdecode.runtime.errors import ServiceError, Status, as_service_error
from services.gateway.front import SSE_HEADERS, prepare_chat
from services.gateway.hangup import unless_hung_up

if TYPE_CHECKING:
    from services.gateway.front import OpenAIFront

log = logging.getLogger("fastdecode.gateway.http")

MESSAGES_PREFIX = "/v1/messages"


def messages_error_response(e: ServiceError, status_override: int | None = None) -> JSONResponse:
    status, body = error_body_of(e, status_override)
    return JSONResponse(body, status_code=status)


class MessagesRoutes:
    def __init__(self, api: OpenAIFront) -> None:
        self.api = api
        api.app.add_api_route(MESSAGES_PREFIX, self.messages, methods=["POST"])
        api.app.add_api_route(f"{MESSAGES_PREFIX}/count_tokens", self.count_tokens, methods=["POST"])

    async def _body(self, request: Request, kind: type[CountTokensBody]) -> CountTokensBody:
        try:
            data = await request.json()
        except ValueError:
            raise APIError(Status.INVALID_ARGUMENT, "the request body is not valid JSON") from None
        body = parse(kind, data)
        await self.api.loras.resolve(body.model)  # the served model or a LoRA adapter
        if self.api.template is None:
            raise cannot_chat(self.api.core.model_id, self.api.template_error)
        return body

    async def _chat(self, body: CountTokensBody) -> tuple[ChatBody, GenerateParams, ToolRequest | None]:
        chat = chat_body(body)
        params, tools = await prepare_chat(self.api, chat, await self.api.loras.resolve(body.model))
        return chat, params, tools

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, as /v1/messages would give them to the model."""
        body = await self._body(request, CountTokensBody)
        _, params, _ = await self._chat(body)
        core = self.api.core
        try:
            check_params(params, core.limits)
            allowed = core.settings.chat_special_tokens
            ids, _ = await asyncio.to_thread(tokenize_request, params, core.tokenizer, allowed)
        except Exception as e:  # noqa: BLE001 - InvalidInput (refused special tokens) and the like
            raise as_service_error(e, log) from None
        return JSONResponse({"input_tokens": len(ids)})

    async def messages(self, request: Request) -> Response:
        body = await self._body(request, MessagesBody)
        assert isinstance(body, MessagesBody)
        chat, params, tools = await self._chat(body)
        core = self.api.core
        shape = MessageShape(
            getattr(request.state, "public_id", request.state.request_id),
            core.model_id,
            params.stop,
            core.tokenizer.decode,
            ToolCallStream.of(tools, self.api.tool_parser) if tools is not None else None,
            ReasoningStream.of(self.api.reasoning_parser, chat.chat_template_kwargs),
        )
        producer = core.generate(params, request.state.request_id, None, "http")
        if not body.stream:
            return await self._whole(request, producer, shape)
        try:  # up to the first token before answering: a refusal gets its own status
            first = await anext(producer)
        except ServiceError as e:
            await producer.aclose()
            return messages_error_response(e)
        except BaseException:
            await producer.aclose()
            raise
        return StreamingResponse(
            self._events(first, producer, shape), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def _whole(
        self, request: Request, producer: AsyncGenerator[GenerationChunk], shape: MessageShape
    ) -> Response:
        async def collect() -> list[GenerationChunk]:
            async with contextlib.aclosing(producer) as chunks:
                return [c async for c in chunks]

        work = await unless_hung_up(request, collect())
        if work is None:
            return Response(status_code=499)  # nobody is listening
        try:
            chunks = work.result()
        except ServiceError as e:
            return messages_error_response(e)
        return JSONResponse(shape.whole(chunks))

    async def _events(
        self, first: GenerationChunk, producer: AsyncGenerator[GenerationChunk], shape: MessageShape
    ) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(producer) as chunks:
            try:
                yield shape.start(first)
                yield shape.events(first)
                async for c in chunks:
                    yield shape.events(c)
            except ServiceError as e:  # after the 200: Anthropic's error event
                yield error_event(e)
