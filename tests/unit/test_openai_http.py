"""The HTTP API's pure parts: chat templates (against transformers), OpenAI bodies -> GenerateParams,
the status -> HTTP error mapping, and request-id sanity. The running API is tests/e2e/test_openai.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from fastdecode.gateway.auth import Tenants
from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.core import sane_request_id
from fastdecode.gateway.openai import (
    HTTP_STATUS,
    APIError,
    ChatBody,
    CompletionBody,
    chat_params,
    completion_params,
    error_body,
)
from fastdecode.runtime.errors import InvalidInput, ModelLoadError, ServiceError, Status
from fastdecode.runtime.grammar import Structured
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.tools.checkpoint import CHATML_TEMPLATE

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": 'Ünïcode and "quotes" <b>ok</b>'},
]

# A template in the style of real ones: loop controls, raise_exception, tojson, a namespace-free
# system-message split, whitespace control.
FANCY = """{%- if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}
{%- set rest = messages[1:] %}
{%- else %}{% set sys = '' %}{% set rest = messages %}{% endif %}
{{ bos_token }}[SYS]{{ sys | tojson }}
{% for m in rest %}
  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
  {% if loop.index > 50 %}{% break %}{% endif %}
  <{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>
  {%- if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


def _with_template(src: Path, dst: Path, template: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    if template is None:
        config.pop("chat_template", None)
    else:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


# ---- chat templates --------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [CHATML_TEMPLATE, FANCY], ids=["chatml", "fancy"])
def test_rendering_and_tokens_equal_transformers(llama_dir: Path, tmp_path: Path, template: str) -> None:
    from transformers import AutoTokenizer

    model = _with_template(llama_dir, tmp_path / "m", template)
    hf = AutoTokenizer.from_pretrained(model)
    ours = ChatTemplate.from_pretrained(model)
    assert ours is not None
    for add in (True, False):
        want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=False)
        assert ours.render(CONVERSATION, add_generation_prompt=add) == want
    want_ids = hf.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text = ours.render(CONVERSATION)
    assert Tokenizer.from_pretrained(model).encode(text, add_special_tokens=False) == list(want_ids)
    assert text.count("<s>") == 1, "the template's BOS only: the gateway must not add another"


def test_make_model_writes_a_chatml_template(llama_dir: Path) -> None:
    template = ChatTemplate.from_pretrained(llama_dir)
    assert template is not None and template.source == CHATML_TEMPLATE
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_sources(llama_dir: Path, tmp_path: Path) -> None:
    assert ChatTemplate.from_pretrained(_with_template(llama_dir, tmp_path / "none", None)) is None
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    got = ChatTemplate.from_pretrained(_with_template(llama_dir, tmp_path / "named", named))
    assert got is not None and got.render([]) == "D</s>"
    jinja = _with_template(llama_dir, tmp_path / "jinja", None)
    (jinja / "chat_template.jinja").write_text("J{{ messages | length }}")
    got = ChatTemplate.from_pretrained(jinja)
    assert got is not None and got.render([{"role": "user", "content": "x"}]) == "J1"
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate.from_pretrained(_with_template(llama_dir, tmp_path / "broken", "{% for %}"))


def test_template_errors_are_the_requests_fault(llama_dir: Path, tmp_path: Path) -> None:
    fancy = ChatTemplate.from_pretrained(_with_template(llama_dir, tmp_path / "f", FANCY))
    assert fancy is not None
    with pytest.raises(InvalidInput, match="bad role tool"):
        fancy.render([{"role": "tool", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidInput):
        sandboxed.render([])
    immutable = ChatTemplate("{% set _ = messages.append(1) %}x")
    with pytest.raises(InvalidInput):
        immutable.render([])


# ---- bodies -> GenerateParams ---------------------------------------------------------------------
def test_completion_params() -> None:
    p = completion_params(CompletionBody(prompt="hi"))
    assert (p.prompt, p.token_ids, p.max_tokens, p.temperature, p.stop) == ("hi", None, None, 1.0, [])
    assert p.add_special_tokens and p.default_max_tokens is None
    p = completion_params(CompletionBody(prompt=["hi"], stop="\n", top_k=-1, temperature=0, seed=3))
    assert (p.prompt, p.stop, p.top_k, p.temperature, p.seed) == ("hi", ["\n"], 0, 0.0, 3)
    assert completion_params(CompletionBody(prompt=[5, 6])).token_ids == [5, 6]
    assert completion_params(CompletionBody(prompt=[[5, 6]])).token_ids == [5, 6]
    extras = completion_params(CompletionBody(prompt="x", ignore_eos=True, stop_token_ids=[7], top_k=4))
    assert (extras.ignore_eos, extras.stop_token_ids, extras.top_k) == (True, [7], 4)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ],
)
def test_unsupported_completion_params_are_refused(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        completion_params(CompletionBody(**body))
    assert e.value.status is Status.INVALID_ARGUMENT and e.value.param == param


def test_logprobs_echo_and_penalties_reach_the_params() -> None:
    p = completion_params(CompletionBody(prompt="x", logprobs=3, echo=True, presence_penalty=0.5))
    assert (p.logprobs, p.prompt_logprobs, p.presence_penalty) == (3, True, 0.5)
    p = completion_params(CompletionBody(prompt="x", echo=True))  # echo without logprobs: text only
    assert (p.logprobs, p.prompt_logprobs) == (None, False)
    p = completion_params(
        CompletionBody(prompt="x", frequency_penalty=-1, repetition_penalty=1.3, min_tokens=4)
    )
    assert (p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (-1, 1.3, 4)


def test_chat_params() -> None:
    template = ChatTemplate(CHATML_TEMPLATE, {"bos_token": "<s>"})
    body = ChatBody(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        max_tokens=9,
        max_completion_tokens=5,
    )
    p = chat_params(body, template, max_context=1024)
    assert p.prompt == "<s><|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    assert (p.max_tokens, p.add_special_tokens, p.default_max_tokens) == (5, False, 1024)
    assert (
        chat_params(
            ChatBody(messages=[{"role": "user", "content": "x"}], max_tokens=9), template, 8
        ).max_tokens
        == 9
    )
    for bad, param in [
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
                "guided_regex": "a+",
            },
            "guided_regex",
        ),
    ]:
        with pytest.raises(ServiceError) as e:  # APIError, or the tools' ToolError
            chat_params(ChatBody(**bad), template, 8)
        assert e.value.status is Status.INVALID_ARGUMENT and e.value.param == param
    user = [{"role": "user", "content": "x"}]
    assert chat_params(ChatBody(messages=user, logprobs=True), template, 8).logprobs == 0
    assert chat_params(ChatBody(messages=user, logprobs=True, top_logprobs=5), template, 8).logprobs == 5
    assert chat_params(ChatBody(messages=user), template, 8).logprobs is None
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    assert chat_params(ChatBody(messages=user, response_format=rf), template, 8).structured == Structured(
        "json_schema", '{"type": "integer"}'
    )
    got = chat_params(ChatBody(messages=user, response_format={"type": "json_object"}), template, 8)
    assert got.structured == Structured("json_object")
    got = completion_params(CompletionBody(prompt="x", guided_choice=["a", "b"]))
    assert got.structured == Structured("choice", '["a", "b"]')
    assert completion_params(CompletionBody(prompt="x")).structured is None


# ---- errors and ids -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (Status.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (Status.UNAUTHENTICATED, 401, "authentication_error"),
        (Status.NOT_FOUND, 404, "invalid_request_error"),
        (Status.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (Status.UNAVAILABLE, 503, "service_unavailable_error"),
        (Status.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (Status.INTERNAL, 500, "server_error"),
        (Status.UNKNOWN, 500, "server_error"),
    ],
)
def test_error_shape(code: Status, status: int, kind: str) -> None:
    got_status, body = error_body(ServiceError("why", code, param="max_tokens"))
    assert got_status == status
    assert body == {"error": {"message": "why", "type": kind, "param": "max_tokens", "code": None}}
    assert HTTP_STATUS.get(code, (500, "server_error")) == (status, kind)
    _, body = error_body(APIError(code, "m", error_code="model_not_found"))
    assert body["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("candidate", "kept"),
    [
        ("abc-123", True),
        ("trace:01/ü", False),  # not ASCII
        ("x" * 128, True),
        ("x" * 129, False),
        ("with space", False),
        ("a,b", False),  # commas separate ids in x-request-id metadata
        ("tab\there", False),
        ("", False),
        (None, False),
    ],
)
def test_sane_request_id(candidate: str | None, kept: bool) -> None:
    assert sane_request_id(candidate) == (candidate if kept else None)


def test_front_refuses_before_reading_the_body(llama_dir: Path) -> None:
    """Token and body size are checked from the headers alone; every answer carries the request id."""

    from fastdecode.gateway.core import GatewayCore
    from fastdecode.model import ModelConfig
    from fastdecode.runtime.settings import GatewaySettings
    from services.gateway.http_server import _Front
    from tests.support.fakes import FakeScheduler

    async def app(scope: dict, receive: object, send: object) -> None:
        raise AssertionError("the app must not run")

    async def run(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[bytes, bytes], dict]:
        settings = GatewaySettings(scheduler="127.0.0.1:9", model=llama_dir)
        service = GatewayCore(
            settings,
            Tokenizer.from_pretrained(llama_dir),
            ModelConfig.from_pretrained(llama_dir),
            FakeScheduler(),
        )
        front = _Front(app, service, Tenants(b"tok"), max_body=100)
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await front(scope, receive, send)
        await service.close()
        return sent[0]["status"], dict(sent[0]["headers"]), json.loads(sent[1]["body"])

    auth = (b"authorization", b"Bearer tok")
    status, headers, body = asyncio.run(run("/v1/completions", [(b"x-request-id", b"r-1")]))
    assert (status, body["error"]["code"], headers[b"x-request-id"]) == (401, "invalid_api_key", b"r-1")
    assert headers[b"www-authenticate"] == b"Bearer"
    status, headers, body = asyncio.run(run("/v1/completions", [auth, (b"content-length", b"101")]))
    assert status == 413 and "101 bytes" in body["error"]["message"]
    assert headers[b"x-request-id"].startswith(b"gw-")


@pytest.mark.parametrize(
    ("kind", "raw"),
    [
        ("completion", '{"prompt": "hi \\ud800"}'),
        ("completion", '{"prompt": "hi", "stop": ["\\udfff"]}'),
        ("chat", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("chat", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
        ("chat", '{"messages": [{"role": "user", "content": "x"}], "user": {"\\ud800": 1}}'),
    ],
)
def test_lone_surrogates_in_a_body_are_a_validation_error(kind: str, raw: str) -> None:
    """JSON escapes can carry a lone surrogate: the body is refused (400 through the validation
    handler) with a message that is itself text, never passed on to the tokenizer (HTTP 500)."""
    from pydantic import ValidationError

    from fastdecode.gateway.openai import ChatBody, CompletionBody

    with pytest.raises(ValidationError) as info:
        # FastAPI parses the body with json.loads (which keeps a lone surrogate), then validates
        (ChatBody if kind == "chat" else CompletionBody).model_validate(json.loads(raw))
    message = info.value.errors()[0]["msg"]
    assert "lone surrogate" in message
    message.encode("utf-8")
