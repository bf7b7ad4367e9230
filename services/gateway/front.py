"""What the routes beside the OpenAI app (tokenize_api.py, messages_api.py) use of it: its FastAPI
app, the gateway core, the chat template and the parsers it chose. A Protocol, so those modules need
not import openai_api.py, which registers them."""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI

from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.core import GatewayCore

# every streamed answer's headers: no cache, and no buffering by a proxy (nginx) in front
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIFront(Protocol):
    app: FastAPI
    core: GatewayCore
    template: ChatTemplate | None
    template_error: str
    tool_parser: str
    reasoning_parser: str

    def check_model(self, model: str | None) -> None:
        """NotFound for a model this gateway does not serve."""
        ...
