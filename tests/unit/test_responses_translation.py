"""The Responses API's pure parts (fastdecode.gateway.openai_responses, .response_store): input items
onto the chat's messages (the prompt equals the chat endpoint's), bad input as a 400 naming the field,
a generation's chunks as a Response and as Responses' SSE events in order, and the store's eviction
and tenant isolation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.openai import APIError, ChatBody, chat_request
from fastdecode.gateway.openai_responses import (
    ResponseShape,
    chat_body,
    input_items,
    output_items,
    parse,
)
from fastdecode.gateway.reasoning import ReasoningStream
from fastdecode.gateway.response_store import ResponseStore, Stored
from fastdecode.gateway.tools import ToolCallStream, tool_request
from fastdecode.runtime.errors import Status

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def _chat(**fields: Any) -> ChatBody:
    body = parse({"model": "m"} | fields)
    return chat_body(body, input_items(body))


def _messages(chat: ChatBody) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_a_reasoning_item_leads_only_its_own_assistant_turn() -> None:
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hm."}]}
    chat = _chat(input=[thought, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}])
    assert _messages(chat) == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]
    chat = _chat(input=[{"role": "user", "content": "Hi"}, thought, {"role": "assistant", "content": "Yo."}])
    assert _messages(chat)[1] == {"role": "assistant", "content": "Yo.", "reasoning_content": "Hm."}


def test_a_string_input_and_instructions() -> None:
    chat = _chat(input="Hi", instructions="Be brief.", max_output_tokens=9, top_p=0.5)
    assert _messages(chat) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (9, 1.0, 0.5)


def test_items_with_a_tool_round_trip_become_the_chat_conversation() -> None:
    chat = _chat(
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Ask."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Oslo"}',
            },
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "?"}],
            },
            {"role": "user", "content": "And now?"},
        ],
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert _messages(chat) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "reasoning_content": "Ask.",
            "tool_calls": [
                {"id": "call_1", **call, "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
                {"id": "call_2", **call, "function": {"name": "get_weather", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "tool", "tool_call_id": "call_2", "content": "?"},
        {"role": "user", "content": "And now?"},
    ]
    assert chat.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert chat.tool_choice == call and chat.parallel_tool_calls is False


def test_the_prompt_is_the_chat_endpoints(llama_dir: Path) -> None:
    template = ChatTemplate.from_pretrained(llama_dir)
    assert template is not None
    ours = _chat(
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": "Name a city."},
        ],
        instructions="Be brief.",
        temperature=0,
    )
    theirs = ChatBody.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a city."},
            ],
            "temperature": 0,
        }
    )
    a, _ = chat_request(ours, template, 2048)
    b, _ = chat_request(theirs, template, 2048)
    assert a.prompt == b.prompt and a.temperature == b.temperature == 0


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ({"format": {"type": "json_object"}}, {"type": "json_object"}),
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        ),
        ({"format": {"type": "text"}}, {"type": "text"}),
    ],
)
def test_text_format_is_a_structured_output(text: dict, want: dict) -> None:
    assert _chat(input="x", text=text).response_format == want


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0]"),
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": []}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        _chat(**fields)
    assert e.value.status is Status.INVALID_ARGUMENT
    assert e.value.param == param or (e.value.param or "").startswith(param), e.value.message


# ---- the Response and its events ---------------------------------------------------------------
def _chunks(*texts: str, reason: str = "stop") -> list[GenerationChunk]:
    out = [GenerationChunk(t, [i], prompt_tokens=7) for i, t in enumerate(texts)]
    out[-1] = GenerationChunk(texts[-1], [0], reason, 7, len(texts), 2)
    return out


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            head, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert head == f"event: {event['type']}"
            out.append(event)
    return out


def _shape(body: dict, **kw: Any) -> ResponseShape:
    return ResponseShape(parse({"input": "x"} | body), "m", **kw)


def test_a_text_answer_streamed_in_order() -> None:
    shape = _shape({"store": False})
    raw = shape.start() + b"".join(shape.feed(c) for c in _chunks("Hel", "lo", "!"))
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final == shape.response()
    assert (
        final["id"].startswith("resp_") and final["object"] == "response" and final["status"] == "completed"
    )
    (message,) = final["output"]
    assert (
        message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    )
    assert message["content"] == [
        {"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}
    ]
    assert final["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    assert events[7]["text"] == "Hello!" and events[7]["item_id"] == message["id"]


def test_max_output_tokens_makes_it_incomplete() -> None:
    shape = _shape({"max_output_tokens": 2})
    events = _events(b"".join(shape.feed(c) for c in _chunks("a", "b", reason="length")))
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_reasoning_and_a_function_call() -> None:
    req = tool_request([{"type": "function", "function": {"name": "f"}}], "auto", None)
    assert req is not None
    shape = _shape({}, tools=ToolCallStream.of(req, "hermes"), reasoning=ReasoningStream("qwen3"))
    texts = [
        "<think>",
        "hmm",
        "</think>",
        "\n\nok ",
        '<tool_call>{"name": "f", ',
        '"arguments": {"a": 1}}',
        "</tool_call>",
    ]
    events = _events(b"".join(shape.feed(c) for c in _chunks(*texts)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    thought, message, call = shape.response()["output"]
    assert thought["type"] == "reasoning" and thought["content"] == [
        {"type": "reasoning_text", "text": "hmm"}
    ]
    assert message["content"][0]["text"] == "ok "
    assert (
        call["type"] == "function_call" and call["name"] == "f" and json.loads(call["arguments"]) == {"a": 1}
    )
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    assert shape.response()["usage"]["output_tokens_details"]["reasoning_tokens"] == 1
    # the output as the next turn's input: the same conversation again
    items = output_items(shape.response())
    messages = [m.model_dump(exclude_none=True) for m in chat_body(parse({"input": items}), items).messages]
    assert messages[0]["reasoning_content"] == "hmm" and messages[0]["content"] == "ok "
    assert messages[0]["tool_calls"][0]["id"] == call["call_id"]


def test_an_empty_answer_is_one_empty_message_and_cancel_closes() -> None:
    shape = _shape({})
    events = _events(b"".join(shape.feed(c) for c in _chunks("")))
    assert shape.response()["output"][0]["content"][0]["text"] == ""
    assert events[-1]["type"] == "response.completed"
    cut = _shape({})
    cut.feed(GenerationChunk("partial", [1], prompt_tokens=3))
    events = _events(cut.cancelled())
    assert [e["type"] for e in events][-1] == "response.failed"
    assert (
        cut.response()["status"] == "cancelled"
        and cut.response()["output"][0]["content"][0]["text"] == "partial"
    )


# ---- the store ---------------------------------------------------------------------------------
def _stored(n: int) -> Stored:
    return Stored({"id": f"resp_{n}", "status": "completed"}, [])


def test_the_store_evicts_by_count_and_age_per_tenant() -> None:
    now = [0.0]
    store = ResponseStore(2, ttl=10, clock=lambda: now[0])
    for n in range(3):
        store.put("a", f"r{n}", _stored(n))
        now[0] += 1
    store.put("b", "r9", _stored(9))
    assert store.get("a", "r0") is None  # the oldest of three, with room for two
    assert store.get("a", "r1") is not None and store.get("a", "r2") is not None
    assert len(store) == 3
    now[0] = 11.5  # r1 was stored at 1, r2 at 2, r9 at 3
    assert store.get("a", "r1") is None and store.get("a", "r2") is not None
    now[0] = 100
    assert store.get("a", "r2") is None and store.get("b", "r9") is None and len(store) == 0


def test_the_store_never_shows_another_tenants_response() -> None:
    store = ResponseStore(4, ttl=60)
    store.put("a", "r1", _stored(1))
    assert store.get("b", "r1") is None and not store.delete("b", "r1")
    assert store.get("", "r1") is None  # the anonymous tenant is a tenant too
    assert store.get("a", "r1") is not None and store.delete("a", "r1") and store.get("a", "r1") is None
