"""Tool calling and the last logit processors on the real model (SmolLM2-135M-Instruct, whose chat
template has no tool support: the fallback prompt) through the official `openai` client and the SDK,
on one fleet: an agent loop, `required` and named choices enforced by the grammar engine, streamed
deltas that reassemble to the whole answer's calls, and logit_bias, min_p, allowed_token_ids and
bad_words changing the output as they say."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from fastdecode.client import Client
from fastdecode.tools.fleet import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def fleet(real_fleet: UpProcess) -> UpProcess:
    # The session's SmolLM2 fleet (tests/e2e/conftest.py). Its fp32 KV: a request that reads a
    # cached prompt draws the same seeded tokens as one that computed it.
    return real_fleet


@pytest.fixture(scope="module")
def oa(fleet: UpProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{fleet.http}/v1", api_key="x", timeout=300, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(fleet: UpProcess) -> str:
    return fleet.model.name


def _at_once(oa: openai.OpenAI, seeds: int, model_id: str, **kw: Any) -> list[Any]:
    """The same chat request with seeds 0..seeds-1, sent concurrently; the replies in seed order."""
    with concurrent.futures.ThreadPoolExecutor(seeds) as pool:
        calls = [pool.submit(oa.chat.completions.create, model=model_id, seed=s, **kw) for s in range(seeds)]
        return [c.result() for c in calls]


def _valid_call(call: Any) -> tuple[str, dict[str, Any]]:
    name = call.function.name
    assert name in SCHEMAS, name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[name])
    assert call.id and call.type == "function"
    return name, args


# ---- tools ---------------------------------------------------------------------------------------
def test_agent_loop_through_the_openai_client(oa, model_id) -> None:
    """required: the model calls get_weather(city); the client answers with a tool message; the model
    then replies in text."""
    first = oa.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    name, args = _valid_call(call)
    assert name == "get_weather" and args["city"]
    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": args["city"], "sky": "sunny", "celsius": 21}),
        },
    ]
    reply = oa.chat.completions.create(
        model=model_id, messages=messages, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=40
    )
    answer = reply.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_required_with_two_tools_always_yields_a_valid_call(oa, model_id) -> None:
    t0 = time.perf_counter()
    names = []
    ask = [{"role": "user", "content": "What time is it in Tokyo, and is it raining in Oslo?"}]
    # the ten seeds at once, as clients send them: one batch, and each seed's draw is its own
    for seed, r in enumerate(
        _at_once(
            oa,
            10,
            model_id=model_id,
            messages=ask,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=0.7,
            max_tokens=200,
        )
    ):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, c)
        assert c.message.tool_calls
        names += [_valid_call(call)[0] for call in c.message.tool_calls]
    print(f"10/10 valid calls in {time.perf_counter() - t0:.1f} s; names: {names}")


def test_a_named_choice_always_calls_that_function(oa, model_id) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    # ASK is a weather question, and yet get_time is called
    for r in _at_once(
        oa,
        4,
        model_id=model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        temperature=1.0,
        max_tokens=60,
    ):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        assert [_valid_call(call)[0] for call in c.message.tool_calls] == ["get_time"]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_deltas_reassemble_to_the_whole_calls(oa, model_id, tool_choice) -> None:
    kw: dict[str, Any] = {
        "model": model_id,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "temperature": 0.7,
        "seed": 11,
        "max_tokens": 80,
    }
    whole = oa.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict[str, str]] = {}
    fragments = 0
    finish = None
    for chunk in oa.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                if d.id:
                    assert d.index not in calls and d.function.name  # id and name first, once
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                if d.function and d.function.arguments:
                    calls[d.index]["arguments"] += d.function.arguments
                    fragments += 1
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert fragments > 1  # the arguments arrive in pieces, not at the end


# ---- logit processors ----------------------------------------------------------------------------
def test_logit_bias_over_http(oa, model_id, smollm2_hf) -> None:
    prompt = "The capital of France is"
    greedy = oa.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    tok = smollm2_hf[1]
    first = tok.encode(greedy.choices[0].logprobs.tokens[0], add_special_tokens=False)
    assert len(first) == 1
    banned = oa.completions.create(
        model=model_id, prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(first[0]): -100}
    )
    assert banned.choices[0].text != greedy.choices[0].text
    assert not banned.choices[0].text.startswith(greedy.choices[0].logprobs.tokens[0])
    forced_id = tok.encode(" banana", add_special_tokens=False)[0]
    forced = oa.completions.create(
        model=model_id, prompt=prompt, max_tokens=3, temperature=0.8, seed=1, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == tok.decode([forced_id] * 3)


def test_min_p_allowed_token_ids_and_bad_words_through_the_sdk(fleet) -> None:
    prompt = "Once upon a time, in a small village, there lived"
    with Client(fleet.target) as client:
        greedy = client.generate(prompt, max_tokens=8, timeout=120)
        # min_p = 1 keeps only the most likely token: the hottest sampling is greedy again
        hot = [client.generate(prompt, max_tokens=8, temperature=5.0, seed=s, timeout=120) for s in range(3)]
        assert any(h.token_ids != greedy.token_ids for h in hot)
        for s in range(3):
            kept = client.generate(prompt, max_tokens=8, temperature=5.0, seed=s, min_p=1.0, timeout=120)
            assert kept.token_ids == greedy.token_ids
        allowed = sorted(set(greedy.token_ids[1:4]))
        only = client.generate(
            prompt, max_tokens=6, temperature=1.0, seed=3, allowed_token_ids=allowed, timeout=120
        )
        assert set(only.token_ids) <= set(allowed) and len(only.token_ids) == 6
        word = greedy.text.split()[0]
        without = client.generate(prompt, max_tokens=8, bad_words=[word], timeout=120)
        assert word not in without.text.split() and without.token_ids != greedy.token_ids
