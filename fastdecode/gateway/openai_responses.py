"""OpenAI's Responses API (`POST /v1/responses`) as a translation onto the chat machinery: a Responses
body's `input` items (messages, function_call and function_call_output, reasoning), `instructions`,
flat function `tools`, `tool_choice` and `text.format` become a ChatBody, so the prompt is the chat
endpoint's for the same conversation; a generation's chunks become a Response object, whole or as
Responses' SSE events (response.created ... response.completed), each with its sequence_number.
Output items: reasoning (where a reasoning parser applies), message (output_text), function_call.
Imports no web framework: services/gateway/responses_api.py serves these.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import Field, ValidationError

from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.openai import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    APIError,
    ChatBody,
    TextBody,
    chat_body_from,
    validation_error,
)
from fastdecode.gateway.reasoning import ReasoningStream
from fastdecode.gateway.responses import sse_event
from fastdecode.gateway.tools import ToolCallStream
from fastdecode.runtime.errors import ServiceError, Status

# The content parts read as text; any other (input_image, input_file, ...) is a 400 naming it.
TEXT_PARTS = ("input_text", "output_text", "text")


def _invalid(message: str, param: str) -> APIError:
    return APIError(Status.INVALID_ARGUMENT, f"{param}: {message}", param)


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's 404 for a response id it does not hold (or that is another tenant's)."""
    code = "previous_response_not_found" if param else None
    return APIError(Status.NOT_FOUND, f"Response with id {response_id!r} not found.", param, code)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request bodies ----------------------------------------------------------------------------
class ResponsesBody(TextBody):
    """The fields served; unknown ones are ignored (SDKs add new ones), the ones that would change the
    answer and are not served are declared and refused when set (refuse_unserved)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # OpenAI's default is true
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # effort and summary: accepted, no effect
    truncation: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    user: str | None = None
    # extensions, as on the chat endpoint
    seed: int | None = None
    top_k: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def parse(data: Any) -> ResponsesBody:
    """The body checked against the Responses shape; a 400 naming the field otherwise."""
    if not isinstance(data, dict):
        raise APIError(Status.INVALID_ARGUMENT, "the request body must be a JSON object")
    try:
        body = ResponsesBody.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    if body.background:
        raise _invalid("background responses are not served; leave it out or false", "background")
    if body.conversation is not None:
        raise _invalid("conversations are not served; use previous_response_id", "conversation")
    if body.prompt is not None:
        raise _invalid("prompt templates are not served; send the input", "prompt")
    if body.truncation not in (None, "disabled"):
        raise _invalid("only 'disabled' is served (an over-long input is a 400)", "truncation")
    if body.top_logprobs:
        raise _invalid("logprobs are not served on /v1/responses (use /v1/chat/completions)", "top_logprobs")
    return body


def input_items(body: ResponsesBody) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


# ---- items -> chat messages --------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as text; other parts are a 400 naming them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid("a string or a list of input_text/output_text parts", where)
    if len(content) > MAX_CONTENT_PARTS:
        raise _invalid(f"{len(content)} parts; the limit is {MAX_CONTENT_PARTS}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _invalid(
                f"a content part of type {kind!r} is not served (text parts only)", f"{where}[{j}]"
            )
    return "\n".join(texts) if len(texts) != 1 else texts[0]


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        return ""
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Responses items as the chat's messages: an assistant message and the function_call items after
    it are one assistant turn (its content and tool_calls); a reasoning item is the next assistant
    turn's reasoning_content; function_call_output is a tool message; developer is system."""
    if len(items) > MAX_MESSAGES:
        raise _invalid(f"{len(items)} items; the limit is {MAX_MESSAGES}", "input")
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    thought: str | None = None
    turn: dict[str, Any] | None = None  # the open assistant turn, which function calls join

    def assistant() -> dict[str, Any]:
        nonlocal turn, thought
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        if thought is not None:
            turn["reasoning_content"] = (turn.get("reasoning_content") or "") + thought
            thought = None
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _invalid("an input item is an object", where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _invalid(f"role {role!r}: one of user, system, developer, assistant", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                if turn is not None and (turn.get("content") is not None or "tool_calls" in turn):
                    turn = None  # a second assistant message is a turn of its own
                assistant()["content"] = text
            else:
                turn, thought = None, None  # a reasoning item belongs to the assistant turn it leads
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not (isinstance(name, str) and isinstance(call_id, str) and isinstance(arguments, str)):
                raise _invalid("a function_call needs call_id, name and arguments (strings)", where)
            fn = {"name": name, "arguments": arguments}
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": fn}
            )
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _invalid("a function_call_output needs call_id (a string)", f"{where}.call_id")
            turn, thought = None, None
            text = _text(item.get("output", ""), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            thought = (thought or "") + _reasoning_text(item)
        else:
            raise _invalid(f"an item of type {kind!r} is not served", where)
    if not out:
        raise _invalid("the input holds no message", "input")
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({type, name, description, parameters, strict}) as the chat's."""
    if not tools:
        return None
    out = []
    for k, t in enumerate(tools):
        if t.get("type") != "function":
            raise _invalid(
                f"the tool type {t.get('type')!r} is not served (function tools only)", f"tools[{k}]"
            )
        fn = {key: t[key] for key in ("name", "description", "parameters") if t.get(key) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid('one of "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat's response_format (our structured outputs)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _invalid("json_schema needs schema, an object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
    raise _invalid(f"type {kind!r}: one of text, json_object, json_schema", "text.format")


def chat_body(body: ResponsesBody, items: list[dict[str, Any]]) -> ChatBody:
    """The chat request of a Responses body whose input (the previous response's turns included) is
    `items`."""
    data: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(items, body.instructions),
        "tools": _chat_tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "max_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,  # OpenAI's default
        "top_p": body.top_p,
        "seed": body.seed,
        "top_k": body.top_k,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    return chat_body_from(data)


# ---- chunks -> a Response ----------------------------------------------------------------------
def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return sse_event(kind, {"type": kind} | obj)


class ResponseShape:
    """One request's Response: fed its generation chunks (`feed`), which return the SSE events; the
    whole (non-streamed) Response is the same state machine's `response()`, so both agree."""

    def __init__(
        self,
        body: ResponsesBody,
        model: str,
        tools: ToolCallStream | None = None,
        reasoning: ReasoningStream | None = None,
        response_id: str | None = None,
    ) -> None:
        self.id = response_id or new_id("resp")
        self.body = body
        self.model = model
        self.tools = tools
        self.reasoning = reasoning
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.call_items: dict[int, dict[str, Any]] = {}  # tool call index -> its item
        self.status = "in_progress"
        self.last: GenerationChunk | None = None
        self.prompt_tokens = 0
        self.reasoning_tokens = 0
        self.completed_at: int | None = None
        self.store = False  # whether the store holds it (store: true, with the store on)

    # -- the Response object
    def _usage(self) -> dict[str, Any] | None:
        if self.last is None:
            return None
        i, o = self.last.prompt_tokens, self.last.completion_tokens
        return {
            "input_tokens": i,
            "input_tokens_details": {"cached_tokens": self.last.cached_tokens},
            "output_tokens": o,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": i + o,
        }

    def response(self) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        fmt = (b.text or {}).get("format") or {"type": "text"}
        choice = b.tool_choice if b.tool_choice is not None else "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "background": False,
            "completed_at": self.completed_at,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt},
            "tool_choice": choice,
            "tools": list(b.tools or []),
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": self._usage(),
            "user": b.user,
        }

    def _e(self, kind: str, **fields: Any) -> bytes:
        out = _event(kind, fields | {"sequence_number": self.seq})
        self.seq += 1
        return out

    # -- streaming
    def start(self) -> bytes:
        """response.created and response.in_progress."""
        return self._e("response.created", response=self.response()) + self._e(
            "response.in_progress", response=self.response()
        )

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.output) if it is item)

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> bytes:
        out = self._close()
        item["status"] = "in_progress"
        self.output.append(item)
        out += self._e("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))
        if part is not None:
            self.open = item
            at = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
            out += self._e("response.content_part.added", **at, part=dict(part))
            item["content"] = [part]
        return out

    def _close(self) -> bytes:
        """The open message or reasoning item's done events."""
        item, self.open = self.open, None
        if item is None:
            return b""
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        if item["type"] == "reasoning":
            out = self._e("response.reasoning_text.done", **at, text=part["text"])
        else:
            out = self._e("response.output_text.done", **at, text=part["text"], logprobs=[])
        out += self._e("response.content_part.done", **at, part=dict(part))
        return out + self._e("response.output_item.done", output_index=at["output_index"], item=dict(item))

    def _text(self, kind: str, delta: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._add(item, part)
        assert self.open is not None
        part = self.open["content"][0]
        part["text"] += delta
        at = {"item_id": self.open["id"], "output_index": self._index(self.open), "content_index": 0}
        if kind == "reasoning":
            return out + self._e("response.reasoning_text.delta", **at, delta=delta)
        return out + self._e("response.output_text.delta", **at, delta=delta, logprobs=[])

    def _call(self, d: dict[str, Any]) -> bytes:
        out = b""
        if "id" in d:
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": d["id"],
                "name": d["function"]["name"],
                "arguments": "",
            }
            out += self._add(item)
            self.call_items[d["index"]] = item
        arguments = d["function"].get("arguments")
        if arguments:
            item = self.call_items[d["index"]]
            item["arguments"] += arguments
            at = {"item_id": item["id"], "output_index": self._index(item)}
            out += self._e("response.function_call_arguments.delta", **at, delta=arguments)
        return out

    def feed(self, c: GenerationChunk) -> bytes:
        """The SSE events of one generation chunk; the last one closes the Response."""
        self.last = c
        thought, text = "", c.text
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(c.text)
            if c.finish_reason:
                more_thought, more = self.reasoning.finish()
                thought, text = thought + more_thought, text + more
            if thought and not text:
                self.reasoning_tokens += len(c.token_ids)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if c.finish_reason:
                more, more_calls = self.tools.finish()
                text, calls = text + more, calls + more_calls
        out = self._text("reasoning", thought) if thought else b""
        if text:
            out += self._text("message", text)
        for d in calls:
            out += self._call(d)
        if c.finish_reason:
            out += self._end(c)
        return out

    def _end(self, last: GenerationChunk) -> bytes:
        self.status = "incomplete" if last.finish_reason == "length" else "completed"
        out = b""
        if not self.output:  # an empty answer is still one (empty) message
            out += self._text("message", "")
        out += self._close()
        for item in self.call_items.values():
            item["status"] = "completed"
            at = {"item_id": item["id"], "output_index": self._index(item)}
            out += self._e("response.function_call_arguments.done", **at, arguments=item["arguments"])
            out += self._e("response.output_item.done", output_index=at["output_index"], item=dict(item))
        if self.status == "completed":
            self.completed_at = int(time.time())
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return out + self._e(kind, response=self.response())

    def cancelled(self) -> bytes:
        """Stopped by POST /v1/responses/{id}/cancel: what was open closes, the status is cancelled."""
        self.status = "cancelled"
        out = self._close()
        return out + self._e("response.failed", response=self.response())

    def error_event(self, e: ServiceError) -> bytes:
        """An error after the 200 (the drain's cut-off): Responses' `error` event."""
        code = getattr(e, "error_code", None) or e.status.name.lower()
        return self._e("error", code=code, message=e.message, param=e.param)


def output_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output as input items of the next turn (previous_response_id)."""
    items = []
    for item in response.get("output", []):
        if item.get("type") == "function_call":
            keep = ("type", "call_id", "name", "arguments")
            items.append({k: item[k] for k in keep})
        elif item.get("type") in ("message", "reasoning"):
            items.append({k: v for k, v in item.items() if k not in ("id", "status")})
    return items
