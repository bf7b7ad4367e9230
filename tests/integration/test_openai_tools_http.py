"""Tool calls and the logit processors through the gateway's HTTP app (the real GatewayCore, its grammar
worker processes, an in-process scheduler fake scripting the model's text): the whole answer and the
streamed deltas, a named choice's grammar, the 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastdecode.gateway.core import GatewayCore, UpstreamEvent
from services.gateway.http_server import _Front
from services.gateway.openai_api import OpenAIApp
from tests.support.fakes import FakeScheduler
from tests.unit.test_gateway_adapters import make_core, post


def test_tool_calls_and_logit_processors_over_http(llama_dir: Path) -> None:
    """The model's hermes text becomes tool_calls (whole, and as deltas that add up to them); the
    logit processors reach the scheduler's request; a named choice sends its schema as the grammar."""
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link, http_port=0)

    async def run() -> None:
        try:
            await _tool_calls_and_logit_processors(core, link)
        finally:
            await core.grammars.close()  # the workers live on this loop

    asyncio.run(run())


async def _tool_calls_and_logit_processors(core: GatewayCore, link: FakeScheduler) -> None:
    seen: list = []
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    ids = core.tokenizer.encode(text, False)
    assert core.tokenizer.decode(ids) == text

    def script(rid: str, req: object) -> list:
        seen.append(req)
        return [UpstreamEvent([t]) for t in ids[:-1]] + [UpstreamEvent(ids[-1:], "stop")]

    link.script = script
    core.ready = True
    app = _Front(OpenAIApp(core, core.settings).app, core, None, 1 << 20)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {
        "model": core.model_id,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [tool],
        "logit_bias": {"5": -100},
        "min_p": 0.2,
        "allowed_token_ids": ids,
        "bad_words": ["zebra"],
    }
    status, raw = await post(app, "/v1/chat/completions", body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    req = seen[0]
    assert (req.logit_bias, req.min_p, req.allowed_token_ids) == (
        ((5, -100.0),),
        0.2,
        tuple(dict.fromkeys(ids)),
    )
    assert req.bad_words and all(w for w in req.bad_words) and req.grammar == ""
    status, raw = await post(app, "/v1/chat/completions", {**body, "stream": True})
    events = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    parts = [t for d in deltas for t in d.get("tool_calls", [])]
    assert content == "Sure." and parts[0]["function"]["name"] == "get_weather" and parts[0]["id"]
    assert "".join(p["function"]["arguments"] for p in parts) == '{"city": "Paris"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    named = {"type": "function", "function": {"name": "get_weather"}}
    status, raw = await post(
        app, "/v1/chat/completions", {**body, "tool_choice": named, "allowed_token_ids": None}
    )
    assert status == 200 and seen[-1].grammar  # the function's schema, compiled
    status, raw = await post(
        app, "/v1/chat/completions", {**body, "tool_choice": {"type": "function", "function": {"name": "x"}}}
    )
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice"
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    status, raw = await post(app, "/v1/chat/completions", {**body, "tools": [tool, broken]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tools[1].function.parameters"
