"""Anthropic's Messages API (/v1/messages) against the running fleet, through the official `anthropic`
package: a plain message, the same streamed, a tool_use round trip, count_tokens, and greedy text
equal to the chat endpoint's for the same conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest

from fastdecode.tools.fleet import UpProcess
from tests.e2e.test_openai import HTTP_TIMEOUT
from tests.support import TOKEN

SYSTEM = "You are terse."
# The SDK (2.x) no longer types the sampling parameters; the API takes them, as body fields.
GREEDY = {"temperature": 0}
QUESTION = "Name the capital of France."
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(fleet: UpProcess) -> Iterator[anthropic.Anthropic]:
    assert fleet.http
    with anthropic.Anthropic(
        base_url=f"http://{fleet.http}", api_key=TOKEN, timeout=HTTP_TIMEOUT, max_retries=0
    ) as c:
        yield c


def test_a_message_plain_and_streamed(client: anthropic.Anthropic, fleet: UpProcess) -> None:
    kw = {
        "model": fleet.model.name,
        "max_tokens": 12,
        "extra_body": GREEDY,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    msg = client.messages.create(**kw)  # type: ignore[call-overload]
    assert msg.type == "message" and msg.role == "assistant" and msg.model == fleet.model.name
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 12
    with client.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.input_tokens == msg.usage.input_tokens
    count = client.messages.count_tokens(
        model=fleet.model.name, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    assert count.input_tokens == msg.usage.input_tokens


def test_greedy_text_equals_the_chat_endpoints(client: anthropic.Anthropic, fleet: UpProcess) -> None:
    msg = client.messages.create(
        model=fleet.model.name,
        max_tokens=16,
        extra_body=GREEDY,
        system=SYSTEM,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": QUESTION},
        ],
    )
    with openai.OpenAI(base_url=f"http://{fleet.http}/v1", api_key=TOKEN, max_retries=0) as oa:
        chat = oa.chat.completions.create(
            model=fleet.model.name,
            max_tokens=16,
            extra_body=GREEDY,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": QUESTION},
            ],
        )
    assert msg.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert msg.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert msg.usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]


def test_a_tool_use_round_trip(client: anthropic.Anthropic, fleet: UpProcess) -> None:
    """A named tool_choice makes the random model call the tool (its input fits the schema); the
    result goes back as a tool_result block and the model answers in text."""
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(
        model=fleet.model.name,
        max_tokens=48,
        extra_body=GREEDY,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=messages,  # type: ignore[arg-type]
    )
    assert msg.stop_reason == "tool_use", msg
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city"} and isinstance(use.input["city"], str)  # type: ignore[arg-type]
    with client.messages.stream(
        model=fleet.model.name,
        max_tokens=48,
        extra_body=GREEDY,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=messages,  # type: ignore[arg-type]
    ) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temp_c": 21})}
            ],
        },
    ]
    answer = client.messages.create(
        model=fleet.model.name,
        max_tokens=8,
        extra_body=GREEDY,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=messages,  # type: ignore[arg-type]
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    assert answer.usage.input_tokens > msg.usage.input_tokens  # the call and its result are in the prompt


def test_errors_reach_the_sdk_as_its_exceptions(client: anthropic.Anthropic, fleet: UpProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=fleet.model.name,
            max_tokens=8,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
            ],  # type: ignore[list-item]
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert fleet.http
    with (
        anthropic.Anthropic(base_url=f"http://{fleet.http}", api_key="wrong", max_retries=0) as bad,
        pytest.raises(anthropic.AuthenticationError),
    ):
        bad.messages.create(
            model=fleet.model.name, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
