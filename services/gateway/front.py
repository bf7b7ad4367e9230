"""What the routes beside the OpenAI app (tokenize_api.py, messages_api.py) use of it: its FastAPI
app, the gateway core, the chat template and the parsers it chose. A Protocol, so those modules need
not import openai_api.py, which registers them."""

from __future__ import annotations

import logging
from typing import Protocol

from fastapi import FastAPI

from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.core import GatewayCore
from fastdecode.gateway.lora import LoraRegistry
from fastdecode.gateway.openai import ChatBody, chat_request
from fastdecode.gateway.text import GenerateParams
from fastdecode.gateway.tools import ToolRequest, check_tool_schemas
from fastdecode.runtime.errors import as_service_error

# every streamed answer's headers: no cache, and no buffering by a proxy (nginx) in front
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("fastdecode.gateway.http")


class OpenAIFront(Protocol):
    app: FastAPI
    core: GatewayCore
    template: ChatTemplate | None
    template_error: str
    tool_parser: str
    reasoning_parser: str
    loras: LoraRegistry  # the LoRA adapters a request's `model` may name

    def check_model(self, model: str | None) -> None:
        """NotFound for a model this gateway does not serve."""
        ...


async def prepare_chat(
    api: OpenAIFront, body: ChatBody, lora: str = ""
) -> tuple[GenerateParams, ToolRequest | None]:
    """A chat request (from any of the HTTP APIs) as the prompt its template renders, with its tools
    checked, run with LoRA adapter `lora` ("" the base); the caller has checked that the template exists."""
    try:
        assert api.template is not None
        params, tools = chat_request(body, api.template, api.core.limits.max_context)
        if tools is not None:
            await check_tool_schemas(tools, api.core.grammars.compile)
    except Exception as e:  # noqa: BLE001 - the template's InvalidInput and the like
        raise as_service_error(e, log) from None
    params.lora = lora
    return params, tools
