"""The Messages API's pure parts (fastdecode.gateway.anthropic): a Messages body onto the OpenAI chat
body, and a generation's chunks as a Message and as Anthropic's SSE events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fastdecode.gateway.anthropic import MessagesBody, MessageShape, chat_body, error_body_of, parse
from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.openai import APIError
from fastdecode.gateway.reasoning import ReasoningStream
from fastdecode.runtime.errors import ResourceExhausted, Status, Unavailable

TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


def _body(**fields: Any) -> MessagesBody:
    data = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]} | fields
    body = parse(MessagesBody, data)
    assert isinstance(body, MessagesBody)
    return body


def test_a_conversation_with_tools_becomes_the_chat_request() -> None:
    body = _body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_k=5,
        thinking={"type": "disabled"},
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"},
                    {"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
    )
    chat = chat_body(body)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
            "reasoning_content": "Use the tool.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "cold"},
        {"role": "user", "content": "And now?"},
    ]
    assert chat.tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "", "parameters": {"type": "object"}},
        }
    ]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert (chat.stop, chat.top_k, chat.max_tokens, chat.temperature) == (["END"], 5, 8, 1.0)
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    named = chat_body(_body(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}))
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "y"}]}]},
            "tool_use",
        ),
        ({"tools": [TOOL | {"type": "web_search_20250305"}]}, "tools[0]"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "tool_use_id",
        ),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "x"}]}]}, "id and name"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "needs text"),
    ],
)
def test_what_cannot_be_translated_is_a_400_naming_it(fields: dict[str, Any], word: str) -> None:
    with pytest.raises(APIError) as info:
        chat_body(_body(**fields))
    assert info.value.status is Status.INVALID_ARGUMENT and word in info.value.message


def test_error_shape() -> None:
    assert error_body_of(APIError(Status.INVALID_ARGUMENT, "bad")) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}},
    )
    assert error_body_of(ResourceExhausted("full"))[1]["error"]["type"] == "rate_limit_error"
    assert error_body_of(Unavailable("draining"))[:1] == (503,)
    assert error_body_of(Unavailable("x"))[1]["error"]["type"] == "overloaded_error"


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for part in raw.decode().split("\n\n"):
        if part:
            name, data = part.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_streamed_message_with_thinking_split_across_chunks() -> None:
    shape = MessageShape("r1", "m", [], lambda ids: "", reasoning=ReasoningStream("qwen3"))
    pieces = ["<thi", "nk>plan", " it</th", "ink>\n\nDo", "ne."]
    chunks = [GenerationChunk(p, [i], prompt_tokens=3) for i, p in enumerate(pieces)]
    chunks[-1].finish_reason, chunks[-1].completion_tokens = "stop", 5
    raw = shape.start(chunks[0]) + b"".join(shape.events(c) for c in chunks)
    events = _events(raw)
    assert [n for n, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    deltas = [e["delta"] for n, e in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "plan it"
    assert "".join(d.get("text", "") for d in deltas) == "Done."
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"input_tokens": 3, "output_tokens": 5}
    whole = MessageShape("r1", "m", [], lambda ids: "", reasoning=ReasoningStream("qwen3")).whole(chunks)
    assert whole["content"] == [
        {"type": "thinking", "thinking": "plan it", "signature": ""},
        {"type": "text", "text": "Done."},
    ]


def test_an_empty_answer_is_one_empty_text_block() -> None:
    last = GenerationChunk("", [], "length", prompt_tokens=2, completion_tokens=1)
    shape = MessageShape("r1", "m", [], lambda ids: "")
    names = [n for n, _ in _events(shape.start(last) + shape.events(last))]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    whole = MessageShape("r1", "m", [], lambda ids: "").whole([last])
    assert whole["content"] == [{"type": "text", "text": ""}] and whole["stop_reason"] == "max_tokens"
