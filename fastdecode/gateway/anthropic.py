"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translation onto
the OpenAI chat machinery: a Messages body becomes a ChatBody (system, content blocks, tool_use and
tool_result, tools and tool_choice onto fastdecode.gateway.tools), and a generation's chunks become a
Message, whole or as Anthropic's SSE events (message_start, content_block_start/delta/stop,
message_delta, message_stop), thinking blocks included where a reasoning parser applies. Errors leave
in Anthropic's shape. Imports no web framework: services/gateway/messages_api.py serves these.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.openai import (
    APIError,
    ChatBody,
    TextBody,
    chat_body_from,
    error_body,
    validation_error,
)
from fastdecode.gateway.reasoning import ReasoningStream
from fastdecode.gateway.responses import sse_event
from fastdecode.gateway.tools import ToolCallStream
from fastdecode.runtime.errors import ServiceError, Status

# Anthropic's error types by HTTP status (their table); anything else is an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def error_body_of(e: ServiceError, status_override: int | None = None) -> tuple[int, dict[str, Any]]:
    """Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, and its status."""
    status = status_override or error_body(e)[0]
    kind = ERROR_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": e.message}}


def _invalid(message: str, param: str) -> APIError:
    return APIError(Status.INVALID_ARGUMENT, f"{param}: {message}", param)


# ---- request bodies ----------------------------------------------------------------------------
class Block(BaseModel):
    """A content block: text, image, tool_use, tool_result, thinking (others are refused by type)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # cache_control, citations: no meaning here

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; Anthropic's server tools are not served


class CountTokensBody(TextBody):
    model: str
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesBody(CountTokensBody):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None


def parse(kind: type[CountTokensBody], data: Any) -> CountTokensBody:
    """The body checked against Anthropic's shape; a 400 naming the field otherwise."""
    if not isinstance(data, dict):
        raise APIError(Status.INVALID_ARGUMENT, "the request body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


# ---- Messages -> OpenAI chat -------------------------------------------------------------------
def _text_of(blocks: str | list[Block] | None, where: str) -> str:
    """The text of a string or of text blocks (system, tool_result content)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise _invalid(f"a block of type {b.type!r} is not supported here (text only)", f"{where}[{j}]")
        texts.append(b.text)
    return "\n".join(texts)


# a block of a kind served here but missing a field it needs
_NEEDS = {
    ("text", "user"): "text",
    ("text", "assistant"): "text",
    ("tool_result", "user"): "tool_use_id",
    ("tool_use", "assistant"): "id and name",
}


def _messages_of(m: Message, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: a user turn's tool_result blocks become tool
    messages (before its text, as the results answer the previous turn); an assistant turn's
    tool_use blocks become tool_calls and its thinking blocks reasoning_content."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_result" and m.role == "user" and b.tool_use_id:
            text = _text_of(b.content, f"{where}.content")
            results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
        elif b.type == "tool_use" and m.role == "assistant" and b.id and b.name:
            arguments = json.dumps(b.input or {}, ensure_ascii=False)
            calls.append(
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}}
            )
        elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
            thoughts.append(b.thinking or "")
        elif (b.type, m.role) in _NEEDS:
            raise _invalid(f"a {b.type} block needs {_NEEDS[b.type, m.role]}", where)
        else:
            raise _invalid(f"a {b.type!r} block is not supported in a {m.role} message", where)
    out = list(results)
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if thoughts:
            msg["reasoning_content"] = "".join(thoughts)
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as OpenAI's (tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _invalid('one of {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}', "tool_choice")


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """Anthropic's thinking switch as the chat template's enable_thinking (Qwen3's variable)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _invalid("type is one of enabled, disabled, adaptive", "thinking")
    return {"enable_thinking": kind != "disabled"}


def chat_body(body: CountTokensBody) -> ChatBody:
    """The OpenAI chat request of a Messages (or count_tokens) body."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, m in enumerate(body.messages):
        messages += _messages_of(m, i)
    tools = None
    if body.tools:
        for k, t in enumerate(body.tools):
            if t.type not in (None, "custom"):
                raise _invalid(
                    f"the server tool {t.type!r} is not supported; define it as a custom tool", f"tools[{k}]"
                )
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    choice, parallel = _tool_choice(body.tool_choice)
    data: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking(body.thinking),
    }
    if isinstance(body, MessagesBody):
        data |= {
            "max_tokens": body.max_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,  # Anthropic's default
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
        }
    return chat_body_from(data)


# ---- chunks -> a Message -----------------------------------------------------------------------


def error_event(e: ServiceError) -> bytes:
    """An error after the 200: Anthropic's `error` event."""
    return sse_event("error", error_body_of(e)[1])


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessageShape:
    """One request's Message: whole (`whole`) or as SSE events (`start`, `events`). `decode` is the
    tokenizer's, to find which stop sequence ended the text."""

    def __init__(
        self,
        request_id: str,
        model: str,
        stops: Sequence[str],
        decode: Callable[[list[int]], str],
        tools: ToolCallStream | None = None,
        reasoning: ReasoningStream | None = None,
    ) -> None:
        self.id = f"msg_{request_id}"
        self.model = model
        self.stops = list(stops)
        self.decode = decode
        self.tools = tools
        self.reasoning = reasoning
        self.text = ""  # the text as generated (stop sequence cut), before any split
        self.ids: list[int] = []
        self.prompt_tokens = 0
        # streaming: the open content block (its kind and index), tool call index -> block index
        self.block: str | None = None
        self.index = -1
        self.call_blocks: dict[int, int] = {}

    def _stop(self, last: GenerationChunk) -> tuple[str, str | None]:
        if self.tools is not None and self.tools.calls and last.finish_reason == "stop":
            return "tool_use", None
        if last.finish_reason == "stop" and self.stops:
            full = self.decode(self.ids)  # the text with the stop sequence that ended it
            hit = next((s for s in self.stops if full.startswith(s, len(self.text))), None)
            if hit is None:
                at = {s: full.find(s) for s in self.stops if s in full}
                hit = min(at, key=lambda s: at[s]) if at else None
            if hit is not None:
                return "stop_sequence", hit
        return STOP_REASONS.get(last.finish_reason or "", "end_turn"), None

    def _usage(self, last: GenerationChunk | None) -> dict[str, int]:
        out = last.completion_tokens if last is not None else 0
        return {"input_tokens": self.prompt_tokens, "output_tokens": out}

    def _message(self, content: list[dict[str, Any]], last: GenerationChunk | None) -> dict[str, Any]:
        reason, sequence = self._stop(last) if last is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage(last),
        }

    def whole(self, chunks: Sequence[GenerationChunk]) -> dict[str, Any]:
        last = chunks[-1]
        self.prompt_tokens = last.prompt_tokens
        self.text = "".join(c.text for c in chunks)
        self.ids = [t for c in chunks for t in c.token_ids]
        thought, text = self.reasoning.split(self.text) if self.reasoning is not None else (None, self.text)
        content: list[dict[str, Any]] = []
        if thought:
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            self.tools.feed(text)
            self.tools.finish()
            text, calls = self.tools.content, self.tools.calls
        if text or not calls:
            content.append({"type": "text", "text": text})
        for c in calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_id(c["id"]),
                    "name": c["name"],
                    "input": _tool_input(c["arguments"]),
                }
            )
        return self._message(content, last)

    # -- streaming
    def start(self, first: GenerationChunk) -> bytes:
        self.prompt_tokens = first.prompt_tokens
        return sse_event(
            "message_start", {"type": "message_start", "message": self._message([], None)}
        ) + sse_event("ping", {"type": "ping"})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.block, self.index = kind, self.index + 1
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + sse_event("content_block_start", start)

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def events(self, c: GenerationChunk) -> bytes:
        """The SSE events of one generation chunk (the last one closes the message)."""
        self.text += c.text
        self.ids += c.token_ids
        thought, text = "", c.text
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(c.text)
            if c.finish_reason:
                more_thought, more = self.reasoning.finish()
                thought, text = thought + more_thought, text + more
        out = b""
        if thought:
            if self.block != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta(self.index, {"type": "thinking_delta", "thinking": thought})
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if c.finish_reason:
                more, more_calls = self.tools.finish()
                text, calls = text + more, calls + more_calls
        if text:
            if self.block != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += self._delta(self.index, {"type": "text_delta", "text": text})
        for d in calls:
            if "id" in d:
                block = {
                    "type": "tool_use",
                    "id": _tool_id(d["id"]),
                    "name": d["function"]["name"],
                    "input": {},
                }
                out += self._open(f"tool{d['index']}", block)
                self.call_blocks[d["index"]] = self.index
            arguments = d["function"].get("arguments")
            if arguments:
                at = self.call_blocks[d["index"]]
                out += self._delta(at, {"type": "input_json_delta", "partial_json": arguments})
        if c.finish_reason:
            out += self._end(c)
        return out

    def _end(self, last: GenerationChunk) -> bytes:
        if self.index < 0:  # an empty answer is still one (empty) text block
            out = self._open("text", {"type": "text", "text": ""})
        else:
            out = b""
        out += self._close()
        reason, sequence = self._stop(last)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out += sse_event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": self._usage(last)}
        )
        return out + sse_event("message_stop", {"type": "message_stop"})
