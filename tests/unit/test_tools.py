"""Tool calling's pure parts (fastdecode.gateway.tools): request checks, the prompts (a template that
renders tools, and the fallback), the schema that enforces required and named choices, and the
parsers, whose streamed deltas must add up to the whole answer's calls. The running API is
tests/e2e/test_openai_tools.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.openai import ChatBody, chat_request
from fastdecode.gateway.tools import (
    FALLBACK_PROMPT,
    ToolCallStream,
    ToolError,
    check_tool_schemas,
    choose_parser,
    tool_request,
)
from fastdecode.runtime.grammar import Structured, compile_grammar
from fastdecode.tools.checkpoint import CHATML_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}

# A template that renders tools itself, in the style of Qwen2.5's (hermes markers).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}
{%- else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _deep(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# ---- requests ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": _deep(200)}}],
            None,
            "tools[0].function.parameters",
        ),
        ([WEATHER, WEATHER], None, "tools[1]"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(ToolError) as e:
        tool_request(tools, choice, None)
    assert e.value.param == param, e.value.message


def test_a_schema_llguidance_refuses_names_its_tool() -> None:
    """The compile itself runs where the caller says (the gateway's grammar workers); here in process."""

    async def compile_(s: Structured) -> str:
        return compile_grammar(s)

    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    req = tool_request([WEATHER, bad], "auto", None)
    with pytest.raises(ToolError) as e:
        asyncio.run(check_tool_schemas(req, compile_))
    assert e.value.param == "tools[1].function.parameters"
    asyncio.run(check_tool_schemas(tool_request([WEATHER, TIME], "auto", None), compile_))


def test_choices() -> None:
    assert tool_request(None, None, None) is None
    assert tool_request([WEATHER], "none", None) is None
    assert tool_request([WEATHER], None, None).choice == "auto"
    r = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert (r.choice, r.named, r.parallel) == ("named", "get_time", False)
    named = json.loads(r.structured().spec)
    assert named.pop("x-guidance")["whitespace_flexible"] is False
    assert named == TIME["function"]["parameters"]
    req = tool_request([WEATHER, TIME], "required", False)
    schema = json.loads(req.structured().spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    compile_grammar(req.structured())  # llguidance takes it
    assert tool_request([WEATHER], "auto", None).structured() is None


def test_parser_choice() -> None:
    assert choose_parser("auto", CHATML_TEMPLATE, "llama") == "hermes"  # no tools: the fallback's format
    assert choose_parser("auto", TOOL_TEMPLATE, "qwen2") == "hermes"
    assert choose_parser("auto", "{{ tools }}[TOOL_CALLS]", "llama") == "mistral"
    assert choose_parser("auto", "{{ tools }}<|python_tag|>", "llama") == "llama3_json"
    assert choose_parser("mistral", CHATML_TEMPLATE, "llama") == "mistral"


# ---- prompts -------------------------------------------------------------------------------------
AGENT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_fallback_prompt_for_a_template_without_tools() -> None:
    template = ChatTemplate(CHATML_TEMPLATE, {})
    params, tools = chat_request(ChatBody(messages=AGENT, tools=[WEATHER]), template, 1024)
    assert tools is not None and tools.choice == "auto"
    prompt = params.prompt or ""
    listed = json.dumps(WEATHER, ensure_ascii=False)
    assert prompt.startswith("<|im_start|>system\n" + FALLBACK_PROMPT.format(tools=listed))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call>" in prompt
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert params.structured is None
    # a system message keeps its text, the tools follow it
    sys = [{"role": "system", "content": "Be brief."}, *AGENT[:1]]
    p2, _ = chat_request(ChatBody(messages=sys, tools=[WEATHER], tool_choice="required"), template, 1024)
    assert (p2.prompt or "").startswith("<|im_start|>system\nBe brief.\n\nYou may call")
    assert p2.structured is not None and p2.structured.kind == "json_schema"
    # tool_choice none: no tools in the prompt, free text
    p3, t3 = chat_request(ChatBody(messages=AGENT[:1], tools=[WEATHER], tool_choice="none"), template, 1024)
    assert t3 is None and "<tools>" not in (p3.prompt or "")


def test_a_template_with_tools_renders_them() -> None:
    template = ChatTemplate(TOOL_TEMPLATE, {})
    params, _ = chat_request(ChatBody(messages=AGENT, tools=[WEATHER]), template, 1024)
    prompt = params.prompt or ""
    assert prompt.startswith("<|im_start|>system\n<tools>" + json.dumps(WEATHER, ensure_ascii=False))
    # the arguments reach the template as an object
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in prompt


def test_named_choice_and_a_structured_output_conflict() -> None:
    body = ChatBody(
        messages=AGENT[:1],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={"type": "json_object"},
    )
    with pytest.raises(Exception) as e:  # noqa: PT011 - APIError, checked by its param
        chat_request(body, ChatTemplate(CHATML_TEMPLATE, {}), 1024)
    assert getattr(e.value, "param", None) == "tool_choice"


# ---- parsing -------------------------------------------------------------------------------------
def _whole(stream: ToolCallStream, text: str) -> dict[str, Any]:
    stream.feed(text)
    stream.finish()
    return stream.message()


def _streamed(stream: ToolCallStream, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls as a client reassembles them from the deltas of `text` fed in pieces."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        got, deltas = stream.feed(piece)
        if i == len(pieces) - 1:
            more, more_deltas = stream.finish()
            got, deltas = got + more, deltas + more_deltas
        content += got
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["function"]["name"], d  # id and name come first
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"city": "Rome, \\"IT\\" {x}"}, "name": "get_weather"}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome, \\"IT\\" {x}"}')],
    ),
    (
        "hermes",
        "No tools needed: <tool and </tool> are text.",
        "No tools needed: <tool and </tool> are text.",
        [],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    ("llama3_json", "Plain answer.", "Plain answer.", []),
    (
        "mistral",
        'Sure[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}]',
        "Sure",
        [("get_weather", '{"city": "Lima"}')],
    ),
    (
        "required",
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Kyiv"}}]',
        None,
        [("get_time", "{}"), ("get_weather", '{"city": "Kyiv"}')],
    ),
]


@pytest.mark.parametrize(("mode", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_parsers_stream_what_they_answer_whole(
    mode: str, text: str, content: str | None, calls: list, step: int
) -> None:
    whole = _whole(ToolCallStream(mode), text)
    assert whole["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])] == calls
    for c in whole.get("tool_calls", []):
        json.loads(c["function"]["arguments"])
        assert c["id"].startswith("call_") and c["type"] == "function"
    got_content, got_calls = _streamed(ToolCallStream(mode), text, step)
    assert got_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls


def test_named_streams_its_arguments_and_finish_reasons() -> None:
    s = ToolCallStream("named", "get_weather")
    content, deltas = s.feed("")
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and content == ""
    content, got = _streamed(ToolCallStream("named", "get_weather"), '{"city": "Paris"}  ', 2)
    assert got[0]["arguments"] == '{"city": "Paris"}'
    assert s.finish_reason("stop") == "tool_calls" and s.finish_reason("length") == "length"
    assert ToolCallStream("hermes").finish_reason("stop") == "stop"


def test_text_streams_as_it_comes() -> None:
    """An answer in text is not held back to the end: only what could still start a call waits."""
    s = ToolCallStream("llama3_json")
    assert s.feed(" ")[0] == "" and s.feed("Hi")[0] == " Hi" and s.feed(" there")[0] == " there"
    h = ToolCallStream("hermes")
    assert h.feed("Hello <tool")[0] == "Hello " and h.feed("s are fun")[0] == "<tools are fun"
    j = ToolCallStream("llama3_json")
    assert j.feed('{"answer": 4')[0] == ""  # may be a call: held
    assert j.finish()[0] == '{"answer": 4' and not j.calls  # it was not


def test_not_parallel_keeps_the_first_call() -> None:
    call = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>'
    text = call % "a" + call % "b"
    msg = _whole(ToolCallStream("hermes", parallel=False), text)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["a"]
