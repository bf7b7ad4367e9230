"""OpenAI's Responses API on the gateway's HTTP port: POST /v1/responses, and with the store on
(`--responses-store N`) GET and DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel. Thin
routes over fastdecode.gateway.openai_responses (the translation onto the chat path),
fastdecode.gateway.response_store and GatewayCore.generate, the one request path. Registered by
OpenAIApp, whose error handlers answer these paths in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastdecode.gateway.auth import current_tenant
from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.openai import APIError, ChatBody, cannot_chat, error_body
from fastdecode.gateway.openai_responses import (
    ResponsesBody,
    ResponseShape,
    chat_body,
    input_items,
    not_found,
    output_items,
    parse,
)
from fastdecode.gateway.reasoning import ReasoningStream
from fastdecode.gateway.response_store import ResponseStore, Stored
from fastdecode.gateway.text import GenerateParams
from fastdecode.gateway.tools import ToolCallStream, ToolRequest
from fastdecode.runtime.errors import ServiceError, Status
from services.gateway.front import SSE_HEADERS, prepare_chat
from services.gateway.hangup import unless_hung_up

if TYPE_CHECKING:
    from services.gateway.front import OpenAIFront

log = logging.getLogger("fastdecode.gateway.http")

RESPONSES_PATH = "/v1/responses"
_END = object()
CANCEL_WAIT_S = 5.0


def _error(e: ServiceError) -> JSONResponse:
    status, body = error_body(e)
    return JSONResponse(body, status_code=status)


class _Run:
    """One generation in a task of its own, its chunks handed over through a queue, so that
    /cancel can stop it whichever way it is answered (the drain's cut-off reaches it the same way)."""

    def __init__(self, producer: AsyncGenerator[GenerationChunk]) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.stopping = False
        self.finished = asyncio.Event()  # set by the consumer once the Response is final
        self.task = asyncio.ensure_future(self._pump(producer))

    async def _pump(self, producer: AsyncGenerator[GenerationChunk]) -> None:
        try:
            async with contextlib.aclosing(producer) as chunks:
                async for c in chunks:
                    self.queue.put_nowait(c)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
        except ServiceError as e:  # already counted and logged by generate()
            self.queue.put_nowait(e)
        finally:
            self.queue.put_nowait(_END)

    async def next(self) -> GenerationChunk | None:
        """The next chunk; None once it was stopped."""
        item = await self.queue.get()
        if isinstance(item, ServiceError):
            raise item
        return None if item is _END else item

    async def stop(self) -> None:
        """/cancel: stop the generation and wait for the consumer to close the Response."""
        self.stopping = True
        self.task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.finished.wait(), CANCEL_WAIT_S)

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class ResponsesRoutes:
    def __init__(self, api: OpenAIFront) -> None:
        self.api = api
        settings = api.core.settings
        on = settings.responses_store > 0
        self.store = ResponseStore(settings.responses_store, settings.responses_store_ttl) if on else None
        app = api.app
        app.add_api_route(RESPONSES_PATH, self.create, methods=["POST"])
        app.add_api_route(f"{RESPONSES_PATH}/{{response_id}}", self.retrieve, methods=["GET"])
        app.add_api_route(f"{RESPONSES_PATH}/{{response_id}}", self.delete, methods=["DELETE"])
        app.add_api_route(f"{RESPONSES_PATH}/{{response_id}}/cancel", self.cancel, methods=["POST"])

    # -- the store's routes
    def _find(self, response_id: str, param: str | None = None) -> Stored:
        found = self.store.get(current_tenant(), response_id) if self.store is not None else None
        if found is None:
            err = not_found(response_id, param)
            if self.store is None:
                err.message += " The gateway stores no responses (--responses-store is 0)."
            raise err
        return found

    async def retrieve(self, response_id: str) -> Response:
        return JSONResponse(self._find(response_id).response)

    async def delete(self, response_id: str) -> Response:
        self._find(response_id)
        assert self.store is not None
        self.store.delete(current_tenant(), response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        stored = self._find(response_id)
        if not stored.running or stored.cancel is None:
            status = stored.response.get("status")
            raise APIError(
                Status.INVALID_ARGUMENT,
                f"Cannot cancel a response with status {status!r}: only a running response can be cancelled.",
            )
        await stored.cancel()
        return JSONResponse(stored.response)

    # -- POST /v1/responses
    async def _chat(
        self, body: ResponsesBody, items: list[dict[str, Any]]
    ) -> tuple[ChatBody, GenerateParams, ToolRequest | None]:
        chat = chat_body(body, items)
        params, tools = await prepare_chat(self.api, chat, await self.api.loras.resolve(body.model))
        return chat, params, tools

    async def create(self, request: Request) -> Response:
        try:
            data = await request.json()
        except ValueError:
            raise APIError(Status.INVALID_ARGUMENT, "the request body is not valid JSON") from None
        body = parse(data)
        await self.api.loras.resolve(body.model)  # the served model or a LoRA adapter
        if self.api.template is None:
            raise cannot_chat(self.api.core.model_id, self.api.template_error)
        items = input_items(body)
        if body.previous_response_id is not None:
            prev = self._find(body.previous_response_id, "previous_response_id")
            if prev.running:
                message = "previous_response_id: that response is still running; wait for it (or cancel it)"
                raise APIError(Status.INVALID_ARGUMENT, message, "previous_response_id")
            items = prev.items + output_items(prev.response) + items
        chat, params, tools = await self._chat(body, items)
        core = self.api.core
        shape = ResponseShape(
            body,
            core.model_id,
            ToolCallStream.of(tools, self.api.tool_parser) if tools is not None else None,
            ReasoningStream.of(self.api.reasoning_parser, chat.chat_template_kwargs),
        )
        run = _Run(core.generate(params, request.state.request_id, None, "http"))
        stored = None
        if self.store is not None and body.store is not False:
            shape.store = True
            stored = Stored(shape.response(), items, run.stop)
            self.store.put(current_tenant(), shape.id, stored)
        if not body.stream:
            return await self._whole(request, run, shape, stored)
        try:  # up to the first token before answering: a refusal gets its own status
            first = await run.next()
        except ServiceError as e:
            self._forget(shape)
            await run.close()
            return _error(e)
        except BaseException:
            await run.close()
            raise
        return StreamingResponse(
            self._events(first, run, shape, stored), media_type="text/event-stream", headers=SSE_HEADERS
        )

    def _forget(self, shape: ResponseShape) -> None:
        if self.store is not None and shape.store:
            self.store.delete(current_tenant(), shape.id)

    @staticmethod
    def _settle(run: _Run, shape: ResponseShape, stored: Stored | None) -> None:
        """The Response is final: stored as it ended (cancelled where it did not)."""
        if stored is not None:
            if shape.status == "in_progress":
                shape.status = "cancelled"
            stored.response, stored.cancel = shape.response(), None
        run.finished.set()

    async def _whole(
        self, request: Request, run: _Run, shape: ResponseShape, stored: Stored | None
    ) -> Response:
        async def collect() -> None:
            while (c := await run.next()) is not None:
                shape.feed(c)
                if c.finish_reason:
                    return
            shape.cancelled()  # stopped by /cancel

        try:
            work = await unless_hung_up(request, collect())
            if work is None:
                return Response(status_code=499)  # nobody is listening
            try:
                work.result()
            except ServiceError as e:
                self._forget(shape)
                return _error(e)
        finally:
            await run.close()
            self._settle(run, shape, stored)
        return JSONResponse(shape.response())

    async def _events(
        self, first: GenerationChunk | None, run: _Run, shape: ResponseShape, stored: Stored | None
    ) -> AsyncIterator[bytes]:
        try:
            yield shape.start()
            c = first
            while c is not None:
                yield shape.feed(c)
                if c.finish_reason:
                    return
                c = await run.next()
            yield shape.cancelled()  # stopped by /cancel
        except ServiceError as e:  # after the 200: Responses' error event
            self._forget(shape)
            yield shape.error_event(e)
        finally:
            await run.close()
            self._settle(run, shape, stored)
