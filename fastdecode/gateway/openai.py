"""The OpenAI-compatible API's pure parts: request bodies to GenerateParams (tools included, through
fastdecode.gateway.tools), and OpenAI's error shape with the one Status -> HTTP table; the response
side is fastdecode.gateway.responses. Imports no gRPC and no web framework:
services/gateway/openai_api.py serves these over FastAPI.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fastdecode.contract import MAX_TOP_LOGPROBS
from fastdecode.gateway.chat import ROLES, ChatTemplate, check_template_kwargs
from fastdecode.gateway.text import MAX_LOGIT_BIAS_ENTRIES, GenerateParams, strings_in, unencodable
from fastdecode.gateway.tools import (
    ToolRequest,
    check_tool_calls,
    fallback_messages,
    template_messages,
    template_renders_tools,
    tool_request,
)
from fastdecode.runtime.errors import ServiceError, Status
from fastdecode.runtime.grammar import Structured

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


def chat_body_from(data: dict[str, Any]) -> ChatBody:
    """A chat request another API's body was translated into (Messages, Responses): its unset (None)
    fields dropped, checked as a chat request's (a 400 naming the field)."""
    try:
        return ChatBody.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors: Sequence[Any]) -> APIError:
    """FastAPI's 422 (the body does not parse or fit the types) as OpenAI's 400 naming the field."""
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        param = None
    else:
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid"))
    return APIError(Status.INVALID_ARGUMENT, message, param)


# ---- request bodies ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    # vLLM's extension: with include_usage, the usage so far on every chunk, not just at the end
    continuous_usage_stats: bool = False


class TextBody(BaseModel):
    """What every HTTP API's request body shares (OpenAI's, Anthropic's Messages, Responses).

    Unknown fields are ignored, as vLLM does (SDKs add new ones); the unsupported fields that would
    change the answer are declared and refused when set. Strict: a boolean is not an integer, nor a
    string a number (`max_tokens: true`, `n: "2"` and `logprobs: "yes"` are 400s, as in OpenAI's
    API), where pydantic's lax mode would convert them."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        # JSON may carry lone surrogates ("\ud800"): refused here (400), before any of it reaches the
        # tokenizer (which raised TypeError: HTTP 500) or an error message that echoes it.
        where = unencodable(data)
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode text (a lone surrogate cannot be encoded)")
        return data


class RequestBody(TextBody):
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
    repetition_penalty: float | None = Field(None, description="extension (vLLM)")
    min_tokens: int | None = Field(None, description="extension (vLLM)")
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, description="extension (vLLM)")
    allowed_token_ids: list[int] | None = Field(None, description="extension (vLLM)")
    bad_words: list[str] | None = Field(None, description="extension (vLLM)")
    user: str | None = None
    cache_salt: str | None = Field(None, description="prefix-cache namespace (OpenAI, vLLM)")
    # vLLM's structured-output extras (extra_body in the openai client)
    guided_json: dict[str, Any] | str | None = Field(None, description="extension (vLLM)")
    guided_regex: str | None = Field(None, description="extension (vLLM)")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM)")
    guided_grammar: str | None = Field(None, description="extension (vLLM): a Lark grammar")


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
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: variables for the chat template (e.g. {"enable_thinking": false} for Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


MAX_N = 16  # choices per request
# A conversation's messages (the template renders them on the event loop: 4,096 in about 15 ms,
# 100,000 took 0.4 s) and one message's content parts, bounded far above real chats.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: ASCII digits exactly, no sign or space


def choice_params(params: GenerateParams, index: int) -> GenerateParams:
    """Choice `index` of n: its own seed stream (seed + index), so each choice equals the single
    request with that seed. Without a seed every choice draws its own noise."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + index) % 2**64)


def _invalid(message: str, param: str | None = None) -> APIError:
    return APIError(Status.INVALID_ARGUMENT, message, param)


def refuse_unsupported(body: RequestBody) -> None:
    """Parameters we cannot honour are a clear 400, not silently ignored."""
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise _invalid(f"n={body.n}: n must be in [1, {MAX_N}]", "n")
    if isinstance(body, CompletionBody):
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
            raise _invalid(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}", "logprobs")
        if body.suffix:
            raise _invalid("suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise _invalid("best_of is not supported (only 1)", "best_of")
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise _invalid("top_logprobs needs logprobs set to true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
                raise _invalid(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}",
                    "top_logprobs",
                )


def structured_output(body: RequestBody) -> Structured | None:
    """response_format (chat) or one of vLLM's guided_* extras, as one Structured (or None)."""
    found: list[tuple[str, Structured]] = []
    if isinstance(body, ChatBody) and body.response_format is not None:
        rf = body.response_format
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", Structured("json_object")))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise _invalid(
                    "response_format json_schema needs json_schema.schema, an object", "response_format"
                )
            found.append(("response_format", Structured("json_schema", json.dumps(schema))))
        elif kind != "text":
            raise _invalid(
                f"response_format type {kind!r}: one of text, json_object, json_schema", "response_format"
            )
    if body.guided_json is not None:
        spec = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        found.append(("guided_json", Structured("json_schema", spec)))
    if body.guided_regex is not None:
        found.append(("guided_regex", Structured("regex", body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", Structured("choice", json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", Structured("grammar", body.guided_grammar)))
    if len(found) > 1:
        raise _invalid(f"{' and '.join(n for n, _ in found)}: set one structured output", found[1][0])
    return found[0][1] if found else None


def _logit_bias(body: RequestBody) -> dict[int, float] | None:
    """OpenAI's logit_bias has token ids as JSON keys (strings)."""
    if not body.logit_bias:
        return None
    if len(body.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:  # before converting each of them
        raise _invalid(
            f"logit_bias has {len(body.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}",
            "logit_bias",
        )
    # int() would also take " 5", "+5", "5_0" and other scripts' digits ("٥"): a key is written one way
    bad = next((k for k in body.logit_bias if not _TOKEN_ID_KEY.fullmatch(k)), None)
    if bad is not None:
        raise _invalid(
            f"logit_bias: the keys are token ids (integers as strings, ASCII digits only), got {_shown(bad)}",
            "logit_bias",
        )
    try:
        return {int(k): float(v) for k, v in body.logit_bias.items()}
    except ValueError:  # more digits than int() reads
        raise _invalid("logit_bias: the keys are token ids (integers as strings)", "logit_bias") from None


def _shown(text: str, limit: int = 40) -> str:
    """A client's string in an error message, cut short."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _sampling(body: RequestBody, max_tokens: int | None) -> dict[str, Any]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return {
        "logit_bias": _logit_bias(body),
        "min_p": body.min_p,
        "allowed_token_ids": body.allowed_token_ids,
        "bad_words": list(body.bad_words or []),
        "max_tokens": max_tokens,
        # OpenAI's default is 1.0 (the gRPC API's is greedy): an OpenAI client expects sampling.
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": body.top_p,
        "top_k": 0 if body.top_k == -1 else body.top_k,
        "seed": body.seed,
        "stop": stop,
        "stop_token_ids": list(body.stop_token_ids or []),
        "ignore_eos": body.ignore_eos,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_tokens": body.min_tokens,
        "cache_salt": body.cache_salt,
    }


def completion_params(body: CompletionBody, lora: str = "") -> GenerateParams:
    """The request's GenerateParams; `lora`: the adapter its `model` names (fastdecode.gateway.lora)."""
    refuse_unsupported(body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > 1:
            raise _invalid(f"{len(prompt)} prompts: send one prompt per request", "prompt")
        prompt = prompt[0]
    sampling = _sampling(body, body.max_tokens)
    sampling["logprobs"] = body.logprobs
    sampling["prompt_logprobs"] = bool(body.echo and body.logprobs is not None)
    sampling["structured"] = structured_output(body)
    sampling["lora"] = lora
    if isinstance(prompt, str):
        return GenerateParams(prompt=prompt, **sampling)
    return GenerateParams(token_ids=list(prompt), **sampling)  # type: ignore[arg-type]


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    if m.role not in ROLES:  # the template writes the role outside the content: no text of the caller's
        raise _invalid(
            f"messages[{i}].role {_shown(m.role)}: one of {', '.join(ROLES)}", f"messages[{i}].role"
        )
    d = m.model_dump(exclude_none=True)
    if "tool_calls" in d:
        check_tool_calls(d["tool_calls"], f"messages[{i}].tool_calls")
    if isinstance(m.content, list):  # content parts: the text ones joined, as vLLM does
        if len(m.content) > MAX_CONTENT_PARTS:
            raise _invalid(
                f"messages[{i}].content has {len(m.content)} parts; the limit is {MAX_CONTENT_PARTS}",
                f"messages[{i}].content",
            )
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise _invalid(f"messages[{i}]: content of type {part.type!r} is not supported", "messages")
            texts.append(part.text)
        d["content"] = "\n".join(texts)
    return d


def chat_tools(body: ChatBody) -> ToolRequest | None:
    """The request's tools and tool_choice, checked (a 400 naming the field)."""
    return tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)


def cannot_chat(model_id: str, reason: str) -> APIError:
    """A chat request to a model without a usable chat template."""
    reason = reason or "it has no chat_template (tokenizer_config.json, chat_template.jinja)"
    return _invalid(
        f"the model {model_id!r} cannot chat: {reason}; "
        "use /v1/completions with a prompt you format yourself",
        "messages",
    )


def chat_params(body: ChatBody, template: ChatTemplate, max_context: int) -> GenerateParams:
    return chat_request(body, template, max_context)[0]


def chat_request(
    body: ChatBody, template: ChatTemplate, max_context: int
) -> tuple[GenerateParams, ToolRequest | None]:
    """The request's params and tools (chat_tools). The template renders the tools where it can,
    else the fallback prompt (fastdecode.gateway.tools) does; `required` or a named choice
    constrains the output."""
    refuse_unsupported(body)
    if len(body.messages) > MAX_MESSAGES:
        raise _invalid(f"{len(body.messages)} messages; the limit is {MAX_MESSAGES}", "messages")
    tools = chat_tools(body)
    messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
    # what the template renders outside the contents: special-token strings there are refused
    outside = [
        t for m in messages for k, v in m.items() if k not in ("role", "content") for t in strings_in(v)
    ]
    extra = body.chat_template_kwargs
    if extra is not None:
        why = check_template_kwargs(extra)
        if why is not None:
            raise _invalid(f"chat_template_kwargs: {why}", "chat_template_kwargs")
        outside += strings_in(extra)
    gen = body.add_generation_prompt
    if template_renders_tools(template.source):
        listed = [t.as_openai() for t in tools.tools] if tools is not None else None
        outside += strings_in(listed or [])
        prompt, spans = template.render_spans(template_messages(messages), gen, listed, extra)
    else:
        fallback = fallback_messages(messages, tools.tools if tools is not None else ())
        prompt, spans = template.render_spans(fallback, gen, extra=extra)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    structured = structured_output(body)
    forced = tools.structured() if tools is not None else None
    if tools is not None and forced is not None and structured is not None:
        raise _invalid(f"tool_choice {tools.choice!r} and a structured output: set one", "tool_choice")
    params = GenerateParams(
        prompt=prompt,
        **_sampling(body, max_tokens),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        structured=forced or structured,
        add_special_tokens=False,  # the template writes BOS itself where the model wants one
        # where the contents lie: their special-token strings are text (GenerateParams.text_spans)
        text_spans=spans,
        untrusted=[m["content"] for m in messages if isinstance(m.get("content"), str)],
        outside=outside,
        default_max_tokens=max_context,  # chat without max_tokens: up to the end of the context
    )
    return params, tools
