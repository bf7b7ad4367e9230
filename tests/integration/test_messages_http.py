"""Anthropic's Messages API through the gateway's HTTP app in process (the real GatewayCore and _Front,
an in-process scheduler fake scripting the model's text): the Message and its SSE events, tool_use
and tool_result mapped onto the chat path, stop sequences, count_tokens, auth and the error shape."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastdecode.gateway.core import GatewayCore
from tests.integration.test_openai_usage_tokenize_http import TOKEN, _app, call
from tests.integration.test_reasoning_http import THOUGHT, _script
from tests.support.fakes import FakeScheduler
from tests.unit.test_gateway_adapters import make_core

AUTH = {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for part in raw.decode().split("\n\n"):
        if not part.strip():
            continue
        name, data = part.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), part
        out.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


def _core(llama_dir: Path, **settings: object) -> tuple[GatewayCore, FakeScheduler, Any]:
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link, http_port=0, **settings)
    return core, link, _app(core, TOKEN.encode())


def test_messages_whole_and_streamed(llama_dir: Path) -> None:
    core, link, app = _core(llama_dir)
    body = {
        "model": core.model_id,
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "A city?"}]}],
        "temperature": 0,
    }

    async def run() -> None:
        seen = _script(core, link, "Paris is nice.")
        status, raw = await call(app, "/v1/messages", body, AUTH)
        assert status == 200, raw
        msg = json.loads(raw)
        assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
        assert msg["content"] == [{"type": "text", "text": "Paris is nice."}]
        assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
        assert msg["usage"]["input_tokens"] == len(seen[-1].prompt_ids)
        assert msg["usage"]["output_tokens"] == len(core.tokenizer.encode("Paris is nice.", False))
        # the prompt is the chat endpoint's for the same conversation
        chat = {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A city?"}],
            "max_tokens": 64,
        }
        status, raw = await call(app, "/v1/chat/completions", chat, AUTH)
        assert status == 200 and seen[-1].prompt_ids == seen[-2].prompt_ids
        # the same, streamed
        status, raw = await call(app, "/v1/messages", body | {"stream": True}, AUTH)
        assert status == 200, raw
        events = sse(raw)
        names = [n for n, _ in events]
        assert names[:3] == ["message_start", "ping", "content_block_start"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert all(n == "content_block_delta" for n in names[3:-3])
        text = "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta")
        assert text == "Paris is nice."
        delta = events[-2][1]
        assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == msg["usage"]["output_tokens"]
        assert events[0][1]["message"]["usage"]["input_tokens"] == msg["usage"]["input_tokens"]
        # a stop sequence: cut there, and named
        status, raw = await call(app, "/v1/messages", body | {"stop_sequences": ["nice"]}, AUTH)
        msg = json.loads(raw)
        assert msg["content"][0]["text"] == "Paris is " and msg["stop_reason"] == "stop_sequence"
        assert msg["stop_sequence"] == "nice"
        # count_tokens: the prompt /v1/messages gives the model
        count = {k: v for k, v in body.items() if k in ("model", "system", "messages")}
        status, raw = await call(app, "/v1/messages/count_tokens", count, AUTH)
        assert status == 200 and json.loads(raw) == {"input_tokens": len(seen[-1].prompt_ids)}

    asyncio.run(run())


def test_tool_use_round_trip(llama_dir: Path) -> None:
    core, link, app = _core(llama_dir)
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body: dict[str, Any] = {
        "model": core.model_id,
        "max_tokens": 64,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }

    async def run() -> None:
        try:
            _script(core, link, "Let me look." + call_text)
            status, raw = await call(app, "/v1/messages", body, AUTH)
            assert status == 200, raw
            msg = json.loads(raw)
            assert msg["stop_reason"] == "tool_use"
            text, use = msg["content"]
            assert text == {"type": "text", "text": "Let me look."}
            assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
            assert (use["name"], use["input"]) == ("get_weather", {"city": "Paris"})
            status, raw = await call(app, "/v1/messages", body | {"stream": True}, AUTH)
            events = sse(raw)
            starts = [e["content_block"] for n, e in events if n == "content_block_start"]
            assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
            partial = "".join(
                e["delta"]["partial_json"]
                for n, e in events
                if n == "content_block_delta" and e["index"] == 1
            )
            assert json.loads(partial) == {"city": "Paris"}
            assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
            # the result goes back as a tool_result block: the template sees a tool message
            seen = _script(core, link, "It is sunny.")
            follow = body | {
                "messages": [
                    *body["messages"],
                    {"role": "assistant", "content": msg["content"]},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": use["id"],
                                "content": [{"type": "text", "text": "sunny, 21 C"}],
                            },
                            {"type": "text", "text": "Thanks."},
                        ],
                    },
                ]
            }
            status, raw = await call(app, "/v1/messages", follow, AUTH)
            assert status == 200, raw
            assert json.loads(raw)["content"] == [{"type": "text", "text": "It is sunny."}]
            prompt = core.tokenizer.decode(seen[-1].prompt_ids, False)
            assert "sunny, 21 C" in prompt and "get_weather" in prompt and "Thanks." in prompt
            # a named tool_choice constrains the output to the tool's arguments
            named = body | {"tool_choice": {"type": "tool", "name": "get_weather"}}
            seen = _script(core, link, '{"city": "Oslo"}')
            status, raw = await call(app, "/v1/messages", named, AUTH)
            assert status == 200, raw
            (use,) = json.loads(raw)["content"]
            assert use["input"] == {"city": "Oslo"} and seen[-1].grammar
        finally:
            await core.grammars.close()

    asyncio.run(run())


def test_thinking_blocks(llama_dir: Path) -> None:
    core, link, app = _core(llama_dir, reasoning_parser="qwen3")
    body = {"model": core.model_id, "max_tokens": 64, "messages": [{"role": "user", "content": "A city?"}]}

    async def run() -> None:
        _script(core, link, THOUGHT + "Paris.")
        msg = json.loads((await call(app, "/v1/messages", body, AUTH))[1])
        assert msg["content"] == [
            {"type": "thinking", "thinking": "\nThe user wants a city.\n", "signature": ""},
            {"type": "text", "text": "Paris."},
        ]
        events = sse((await call(app, "/v1/messages", body | {"stream": True}, AUTH))[1])
        starts = [e["content_block"]["type"] for n, e in events if n == "content_block_start"]
        assert starts == ["thinking", "text"]
        thinking = "".join(e["delta"].get("thinking", "") for n, e in events if n == "content_block_delta")
        assert thinking == "\nThe user wants a city.\n"
        off = body | {"thinking": {"type": "disabled"}}
        msg = json.loads((await call(app, "/v1/messages", off, AUTH))[1])
        assert [b["type"] for b in msg["content"]] == ["text"]
        # an earlier turn's thinking block is accepted
        history = body | {
            "messages": [
                {"role": "user", "content": "A city?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "France.", "signature": ""},
                        {"type": "text", "text": "Paris."},
                    ],
                },
                {"role": "user", "content": "Another?"},
            ]
        }
        assert (await call(app, "/v1/messages", history, AUTH))[0] == 200

    asyncio.run(run())


def test_errors_in_anthropics_shape(llama_dir: Path) -> None:
    core, link, app = _core(llama_dir)
    _script(core, link, "x")
    ok = {"model": core.model_id, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

    async def run() -> None:
        cases: list[tuple[dict[str, Any] | bytes, int, str]] = [
            ({k: v for k, v in ok.items() if k != "max_tokens"}, 400, "max_tokens"),
            (ok | {"max_tokens": 0}, 400, "max_tokens"),
            (ok | {"messages": []}, 400, "messages"),
            (ok | {"messages": [{"role": "system", "content": "x"}]}, 400, "role"),
            (
                ok | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                400,
                "image",
            ),
            (ok | {"tool_choice": {"type": "tool"}}, 400, "tool_choice"),
            (ok | {"tools": [{"name": "x"}]}, 400, "input_schema"),
            (ok | {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "nope"),
            (ok | {"temperature": -1}, 400, "temperature"),
            (ok | {"thinking": {"type": "maybe"}}, 400, "thinking"),
            (ok | {"model": "claude-3-opus"}, 404, "claude-3-opus"),
            (b"{not json", 400, "JSON"),
            (b"[1]", 400, "object"),
        ]
        for body, status, word in cases:
            got, raw = await call(app, "/v1/messages", body, AUTH)
            assert got == status, (body, raw)
            err = json.loads(raw)
            assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
            want = "invalid_request_error" if status == 400 else "not_found_error"
            assert err["error"]["type"] == want and word in err["error"]["message"], (body, err)
        got, raw = await call(app, "/v1/messages/count_tokens", {"model": core.model_id}, AUTH)
        assert got == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
        for headers in ({}, {"x-api-key": "nope"}):
            got, raw = await call(app, "/v1/messages", ok, headers)
            assert got == 401 and json.loads(raw)["error"]["type"] == "authentication_error", raw
        got, raw = await call(app, "/v1/messages", ok, {"authorization": f"Bearer {TOKEN}"})
        assert got == 200, raw
        got, raw = await call(app, "/v1/chat/completions", {"messages": []}, AUTH)
        assert got == 400 and "param" in json.loads(raw)["error"], "the OpenAI paths keep their shape"

    asyncio.run(run())
