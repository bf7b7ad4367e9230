"""The OpenAI-compatible API's pure parts: request bodies to GenerateParams, response objects and SSE
events, and OpenAI's error shape with the one Status -> HTTP table. Imports no gRPC and no web
framework: services/gateway/openai_api.py serves these over FastAPI.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastdecode.errors import ServiceError, Status
from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.text import GenerateParams, unencodable

# The one table from our Status to (HTTP status, OpenAI error type). Anything else is a 500 server_error.
HTTP_STATUS: dict[Status, tuple[int, str]] = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.OUT_OF_RANGE: (400, "invalid_request_error"),
    Status.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Status.UNAUTHENTICATED: (401, "authentication_error"),
    Status.PERMISSION_DENIED: (403, "permission_error"),
    Status.NOT_FOUND: (404, "invalid_request_error"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Status.CANCELLED: (499, "cancelled"),
    Status.UNAVAILABLE: (503, "service_unavailable_error"),
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# An HTTP-level rejection (Starlette's own 404/405/413) back to a Status, for the same shape.
STATUS_OF_HTTP = {
    400: Status.INVALID_ARGUMENT,
    404: Status.NOT_FOUND,
    405: Status.INVALID_ARGUMENT,
    413: Status.INVALID_ARGUMENT,
}


class APIError(ServiceError):
    """A ServiceError with OpenAI's machine-readable `code` (e.g. model_not_found)."""

    def __init__(
        self, status: Status, message: str, param: str | None = None, error_code: str | None = None
    ) -> None:
        super().__init__(message, status, param=param)
        self.error_code = error_code


def error_body(e: ServiceError) -> tuple[int, dict[str, Any]]:
    status, kind = HTTP_STATUS.get(e.status, (500, "server_error"))
    return status, {
        "error": {
            "message": e.message,
            "type": kind,
            "param": e.param,
            "code": getattr(e, "error_code", None),
        }
    }


# ---- request bodies ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestBody(BaseModel):
    # Unknown fields are ignored, as vLLM does (SDKs add new ones); the unsupported fields that would
    # change the answer are declared below and refused when set.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        # JSON may carry lone surrogates ("\ud800"): refused here (400), before any of it reaches the
        # tokenizer (which raised TypeError: HTTP 500) or an error message that echoes it.
        where = unencodable(data)
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode text (a lone surrogate cannot be encoded)")
        return data

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


class CompletionBody(RequestBody):
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


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def _invalid(message: str, param: str | None = None) -> APIError:
    return APIError(Status.INVALID_ARGUMENT, message, param)


def refuse_unsupported(body: RequestBody) -> None:
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


def _sampling(body: RequestBody, max_tokens: int | None) -> dict[str, Any]:
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
    refuse_unsupported(body)
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
    refuse_unsupported(body)
    prompt = template.render([_message_dict(m, i) for i, m in enumerate(body.messages)])
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return GenerateParams(
        prompt=prompt,
        **_sampling(body, max_tokens),
        add_special_tokens=False,  # the template writes BOS itself where the model wants one
        default_max_tokens=max_context,  # chat without max_tokens: up to the end of the context
    )


# ---- responses ---------------------------------------------------------------------------------
def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _usage(c: GenerationChunk) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


class ResponseShape:
    """Response objects of one request: completions or chat, whole or as stream chunks."""

    def __init__(self, chat: bool, request_id: str, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, last: GenerationChunk) -> dict[str, Any]:
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
        return sse(out)

    def usage_chunk(self, last: GenerationChunk) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": _usage(last)})
