"""Reasoning parsers through the gateway's HTTP app in process (the real GatewayCore, an in-process
scheduler fake scripting the model's text): reasoning_content apart from content, whole and streamed,
with tools, with thinking turned off, and chat_template_kwargs reaching the template."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastdecode.gateway.core import GatewayCore, UpstreamEvent
from tests.integration.test_openai_usage_tokenize_http import _app, call, events
from tests.support.fakes import FakeScheduler
from tests.unit.test_gateway_adapters import make_core

THOUGHT = "<think>\nThe user wants a city.\n</think>\n\n"


def _script(core: GatewayCore, link: FakeScheduler, text: str) -> list[Any]:
    """Every submitted request, answering `text` a token at a time."""
    ids = core.tokenizer.encode(text, False)
    assert core.tokenizer.decode(ids) == text
    seen: list[Any] = []

    def script(rid: str, req: Any) -> list:
        seen.append(req)
        return [UpstreamEvent([t]) for t in ids[:-1]] + [UpstreamEvent(ids[-1:], "stop")]

    link.script = script
    return seen


def _streamed(raw: bytes) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """(reasoning, content, tool call deltas, finish reason) of a chat stream."""
    reasoning, content, calls, finish = "", "", [], None
    for ev in events(raw):
        for choice in ev["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
            finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


def test_qwen3_reasoning_whole_and_streamed(llama_dir: Path) -> None:
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link, http_port=0, reasoning_parser="qwen3")
    app = _app(core)
    chat = {"messages": [{"role": "user", "content": "A city?"}]}

    async def run() -> None:
        _script(core, link, THOUGHT + "Paris.")
        status, raw = await call(app, "/v1/chat/completions", chat)
        assert status == 200, raw
        message = json.loads(raw)["choices"][0]["message"]
        assert message["reasoning_content"] == "\nThe user wants a city.\n"
        assert message["content"] == "Paris."
        status, raw = await call(app, "/v1/chat/completions", chat | {"stream": True})
        assert _streamed(raw)[:2] == ("\nThe user wants a city.\n", "Paris.")
        assert b"<think>" not in raw and b"</think>" not in raw  # no tag leaks into any delta
        # an answer without a think block is all content, with no reasoning_content at all
        _script(core, link, "Paris.")
        status, raw = await call(app, "/v1/chat/completions", chat)
        message = json.loads(raw)["choices"][0]["message"]
        assert message["content"] == "Paris." and "reasoning_content" not in message
        # thinking off: the template gets enable_thinking, and nothing is split off
        seen = _script(core, link, THOUGHT + "Paris.")
        off = chat | {"chat_template_kwargs": {"enable_thinking": False}}
        message = json.loads((await call(app, "/v1/chat/completions", off))[1])["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"] == THOUGHT + "Paris."
        assert seen, "the request reached the scheduler"
        # a previous turn's reasoning_content is accepted (the template decides what to do with it)
        history = {
            "messages": [
                {"role": "user", "content": "A city?"},
                {"role": "assistant", "content": "Paris.", "reasoning_content": "Think of France."},
                {"role": "user", "content": "Another?"},
            ]
        }
        status, raw = await call(app, "/v1/chat/completions", history)
        assert status == 200, raw
        # completions are never split (a prompt, not a chat)
        status, raw = await call(app, "/v1/completions", {"prompt": "A city?"})
        assert json.loads(raw)["choices"][0]["text"] == THOUGHT + "Paris."

    asyncio.run(run())


def test_reasoning_then_a_tool_call(llama_dir: Path) -> None:
    """The thinking goes to reasoning_content; the tool parser sees the content only."""
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link, http_port=0, reasoning_parser="qwen3")
    app = _app(core)
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [tool]}

    async def run() -> None:
        _script(core, link, THOUGHT + call_text)
        try:
            status, raw = await call(app, "/v1/chat/completions", body)
            assert status == 200, raw
            choice = json.loads(raw)["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["reasoning_content"] == "\nThe user wants a city.\n"
            assert not choice["message"]["content"]
            (tc,) = choice["message"]["tool_calls"]
            assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
            status, raw = await call(app, "/v1/chat/completions", body | {"stream": True})
            reasoning, content, calls, finish = _streamed(raw)
            assert reasoning == "\nThe user wants a city.\n" and not content and finish == "tool_calls"
            args = "".join(c["function"].get("arguments") or "" for c in calls)
            assert json.loads(args) == {"city": "Paris"}
        finally:
            await core.grammars.close()

    asyncio.run(run())


def test_deepseek_r1_and_template_kwargs(llama_dir: Path, tmp_path: Path) -> None:
    """deepseek_r1: all before </think> is reasoning. chat_template_kwargs reach the template; the
    variables the gateway sets itself are refused."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if mood %}[{{ mood }}]{% endif %}<think>\n{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    link = FakeScheduler()
    core, _ = make_core(model, link, http_port=0, reasoning_parser="deepseek_r1")
    app = _app(core)
    chat = {"messages": [{"role": "user", "content": "A city?"}]}

    async def run() -> None:
        seen = _script(core, link, "The user wants a city.</think>\n\nParis.")
        status, raw = await call(
            app, "/v1/chat/completions", chat | {"chat_template_kwargs": {"mood": "calm"}}
        )
        assert status == 200, raw
        message = json.loads(raw)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("The user wants a city.", "Paris.")
        assert core.tokenizer.decode(seen[-1].prompt_ids).endswith("<assistant>[calm]<think>\n")
        status, raw = await call(app, "/v1/chat/completions", chat | {"stream": True})
        assert _streamed(raw)[:2] == ("The user wants a city.", "Paris.")
        for bad in ({"messages": []}, {"add_generation_prompt": False}, {"bos_token": "x"}, {"a b": 1}):
            status, raw = await call(app, "/v1/chat/completions", chat | {"chat_template_kwargs": bad})
            assert status == 400, raw
            assert json.loads(raw)["error"]["param"] == "chat_template_kwargs"
        status, raw = await call(app, "/v1/chat/completions", chat | {"chat_template_kwargs": "x"})
        assert status == 400 and json.loads(raw)["error"]["param"] == "chat_template_kwargs"

    asyncio.run(run())
