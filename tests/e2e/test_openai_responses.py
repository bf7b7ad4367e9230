"""OpenAI's Responses API (/v1/responses) against the running fleet, through the official `openai`
package: a plain response, the same streamed, greedy text equal to the chat endpoint's, and a
function-call round trip by passing the items back and by previous_response_id, on a second gateway
with the store on (and two tenants, who never see each other's responses)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fastdecode.tools.fleet import ServiceProcess, UpProcess, start_service, stop_processes
from tests.e2e.test_openai import HTTP_TIMEOUT
from tests.support import TOKEN

SYSTEM = "You are terse."
QUESTION = "Name the capital of France."
KEYS = {"alpha": "alpha-key-123", "beta": "beta-key-4567"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
# a JSON answer the random model finishes (the grammar ends it), so the response completes
CHOICE = {
    "format": {
        "type": "json_schema",
        "name": "pick",
        "schema": {
            "type": "object",
            "properties": {"pick": {"enum": ["a", "b"]}},
            "required": ["pick"],
            "additionalProperties": False,
        },
    }
}


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=HTTP_TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def oa(fleet: UpProcess) -> Iterator[openai.OpenAI]:
    assert fleet.http
    with _client(f"http://{fleet.http}", TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def store_gateway(fleet: UpProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second gateway on the shared fleet's scheduler, with the Responses store on and two tenants."""
    workdir: Path = tmp_path_factory.mktemp("gw-responses")
    keys = workdir / "keys"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    gw: ServiceProcess = start_service(
        "gateway-responses",
        [
            "gateway",
            "--scheduler",
            fleet.state["scheduler"]["address"],
            "--model",
            str(fleet.model),
            "--http-port",
            "0",
            "--responses-store",
            "8",
            "--api-keys-file",
            str(keys),
        ],
        workdir,
        timeout=60,
        env={"FASTDECODE_FLEET_SECRET_FILE": fleet.state["fleet_secret_file"]},
    )
    try:
        assert gw.http
        yield f"http://{gw.http}"
    finally:
        stop_processes([gw], grace=10)


def test_a_response_plain_and_streamed(oa: openai.OpenAI, fleet: UpProcess) -> None:
    kw = {"model": fleet.model.name, "input": QUESTION, "instructions": SYSTEM, "temperature": 0}
    resp = oa.responses.create(max_output_tokens=64, text=CHOICE, **kw)  # type: ignore[call-overload]
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.status == "completed"
    assert resp.model == fleet.model.name and resp.store is False  # this gateway stores nothing
    assert json.loads(resp.output_text)["pick"] in ("a", "b")
    assert resp.usage is not None and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    with oa.responses.stream(max_output_tokens=64, text=CHOICE, **kw) as stream:  # type: ignore[call-overload]
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == resp.output_text
    assert final.usage is not None and final.usage.output_tokens == resp.usage.output_tokens
    # create(stream=True): the raw events, numbered; cut short by max_output_tokens: incomplete
    events = list(oa.responses.create(max_output_tokens=4, stream=True, **kw))  # type: ignore[call-overload]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    last = events[-1].response  # type: ignore[union-attr]
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert last.usage is not None and last.usage.output_tokens == 4


def test_greedy_text_equals_the_chat_endpoints(oa: openai.OpenAI, fleet: UpProcess) -> None:
    resp = oa.responses.create(
        model=fleet.model.name,
        instructions=SYSTEM,
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        max_output_tokens=16,
        temperature=0,
    )
    chat = oa.chat.completions.create(
        model=fleet.model.name,
        max_tokens=16,
        temperature=0,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": QUESTION},
        ],
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage is not None and chat.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )


def _call_the_tool(
    client: openai.OpenAI, model: str, stream: bool = False
) -> openai.types.responses.Response:
    kw = {
        "model": model,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 48,
        "temperature": 0,
    }
    if not stream:
        return client.responses.create(**kw)  # type: ignore[call-overload]
    with client.responses.stream(**kw) as s:  # type: ignore[call-overload]
        arguments = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.arguments == arguments
    return final


def test_a_function_call_round_trip_by_passing_the_items_back(oa: openai.OpenAI, fleet: UpProcess) -> None:
    """A named tool_choice makes the random model call the tool; the call and its output go back as
    items and the model answers in text."""
    resp = _call_the_tool(oa, fleet.model.name)
    (call,) = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    assert _call_the_tool(oa, fleet.model.name, stream=True).output[-1].arguments == call.arguments  # type: ignore[union-attr]
    answer = oa.responses.create(
        model=fleet.model.name,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *resp.output,  # type: ignore[list-item]
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=8,
        temperature=0,
    )
    assert answer.output[0].type == "message" and answer.status in ("completed", "incomplete")


def test_previous_response_id_and_the_store(store_gateway: str, fleet: UpProcess) -> None:
    model = fleet.model.name
    with _client(store_gateway, KEYS["alpha"]) as alpha, _client(store_gateway, KEYS["beta"]) as beta:
        first = _call_the_tool(alpha, model)
        assert first.store is True
        (call,) = [o for o in first.output if o.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
        chained = alpha.responses.create(
            model=model,
            previous_response_id=first.id,
            input=[result],  # type: ignore[list-item]
            tools=[WEATHER],  # type: ignore[list-item]
            max_output_tokens=8,
            temperature=0,
        )
        by_hand = alpha.responses.create(
            model=model,
            input=[{"role": "user", "content": "What is the weather in Paris?"}, *first.output, result],  # type: ignore[list-item]
            tools=[WEATHER],  # type: ignore[list-item]
            max_output_tokens=8,
            temperature=0,
            store=False,
        )
        assert chained.previous_response_id == first.id
        assert chained.output_text == by_hand.output_text
        assert chained.usage is not None and by_hand.usage is not None
        assert chained.usage.input_tokens == by_hand.usage.input_tokens
        assert alpha.responses.retrieve(first.id).output[0].model_dump() == first.output[0].model_dump()
        with pytest.raises(openai.NotFoundError):
            beta.responses.retrieve(first.id)  # another tenant's id is not there
        with pytest.raises(openai.NotFoundError):
            beta.responses.create(model=model, previous_response_id=first.id, input="x")
        with pytest.raises(openai.BadRequestError):
            alpha.responses.cancel(first.id)  # completed: nothing to cancel
        alpha.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            alpha.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as bad:
            alpha.responses.create(model=model, input=[{"type": "file_search_call", "id": "x"}])  # type: ignore[list-item]
        assert bad.value.body["param"] == "input[0]"  # type: ignore[index]
