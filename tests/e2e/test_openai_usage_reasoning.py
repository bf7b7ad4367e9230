"""Stream usage, /tokenize and /detokenize, and reasoning parsers against a running fleet, through the
official `openai` package where it reaches (plain HTTP for vLLM's extra endpoints). The random model
does not think on its own: a regex (guided_regex) makes its answer `<think>...</think>answer`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest

from fastdecode.tools.fleet import ServiceProcess, UpProcess, start_service, stop_processes
from tests.e2e.test_openai import HTTP_TIMEOUT, call
from tests.support import TOKEN, metric_total, scrape

THINKING = r"<think>[a-z]{2,8}</think>[a-z]{2,8}"
QUESTION = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def base(fleet: UpProcess) -> str:
    assert fleet.http
    return f"http://{fleet.http}"


@pytest.fixture(scope="module")
def oa(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, timeout=HTTP_TIMEOUT, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def thinking_gateway(fleet: UpProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second gateway on the shared fleet's scheduler, with the qwen3 reasoning parser (the tiny
    model is a llama, whose family picks none)."""
    gw: ServiceProcess = start_service(
        "gateway-reasoning",
        [
            "gateway",
            "--scheduler",
            fleet.state["scheduler"]["address"],
            "--model",
            str(fleet.model),
            "--http-port",
            "0",
            "--reasoning-parser",
            "qwen3",
        ],
        tmp_path_factory.mktemp("gw-reasoning"),
        timeout=60,
        env={"FASTDECODE_FLEET_SECRET_FILE": fleet.state["fleet_secret_file"]},
    )
    try:
        assert gw.http
        yield f"http://{gw.http}"
    finally:
        stop_processes([gw], grace=10)


def test_continuous_usage_stats_with_the_sdk(oa: openai.OpenAI, fleet: UpProcess) -> None:
    kw = {"model": fleet.model.name, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chunks = list(
        oa.chat.completions.create(
            messages=QUESTION,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": True},
            **{k: v for k, v in kw.items() if k != "ignore_eos"},
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6
    whole = oa.chat.completions.create(
        messages=QUESTION,
        extra_body={"ignore_eos": True},
        **{k: v for k, v in kw.items() if k != "ignore_eos"},
    )
    assert whole.usage is not None
    assert {c.usage.prompt_tokens for c in chunks if c.usage is not None} == {whole.usage.prompt_tokens}


def test_an_aborted_stream_is_in_the_token_metrics(oa: openai.OpenAI, fleet: UpProcess, base: str) -> None:
    metrics = fleet.state["gateway"]["metrics"]
    before = scrape(metrics)
    status, _, tokenized = call(base, "/tokenize", {"prompt": "count to a thousand"})
    assert status == 200, tokenized
    got = 0
    stream = oa.completions.create(
        model=fleet.model.name,
        prompt="count to a thousand",
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _ in stream:
        got += 1
        if got == 5:
            break
    stream.close()
    after = scrape(metrics)
    assert (
        metric_total(after, "fastdecode_prompt_tokens_total")
        - metric_total(before, "fastdecode_prompt_tokens_total")
        >= tokenized["count"]
    )
    moved = metric_total(after, "fastdecode_generation_tokens_total") - metric_total(
        before, "fastdecode_generation_tokens_total"
    )
    assert moved >= 5, "the tokens streamed before the hang-up are counted"


def test_tokenize_and_detokenize(base: str, oa: openai.OpenAI, fleet: UpProcess) -> None:
    status, _, out = call(base, "/tokenize", {"model": fleet.model.name, "messages": QUESTION})
    assert status == 200, out
    whole = oa.chat.completions.create(model=fleet.model.name, messages=QUESTION, max_tokens=1)
    assert whole.usage is not None and out["count"] == whole.usage.prompt_tokens == len(out["tokens"])
    assert out["max_model_len"] == oa.models.list().data[0].model_extra["max_model_len"]  # type: ignore[index]
    status, _, text = call(base, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and "Think, then answer." in text["prompt"]
    status, _, err = call(base, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"
    assert call(base, "/tokenize", {"prompt": "x"}, token=None)[0] == 401


def test_reasoning_content_whole_and_streamed(thinking_gateway: str, fleet: UpProcess) -> None:
    kw = {
        "model": fleet.model.name,
        "messages": QUESTION,
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"guided_regex": THINKING},
    }
    with openai.OpenAI(
        base_url=f"{thinking_gateway}/v1", api_key="x", timeout=HTTP_TIMEOUT, max_retries=0
    ) as oa:
        whole = oa.chat.completions.create(**kw)  # type: ignore[call-overload]
        message = whole.choices[0].message
        reasoning = message.model_extra["reasoning_content"]  # type: ignore[index]
        assert re.fullmatch("[a-z]{2,8}", reasoning), message
        assert message.content and re.fullmatch("[a-z]{2,8}", message.content), message
        reasoning_s, content_s = "", ""
        for chunk in oa.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
            for choice in chunk.choices:
                reasoning_s += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content_s += choice.delta.content or ""
        assert (reasoning_s, content_s) == (reasoning, message.content)
        # thinking off: no reasoning_content, the tags stay in the content
        off = oa.chat.completions.create(
            **{
                **kw,
                "extra_body": {"guided_regex": THINKING, "chat_template_kwargs": {"enable_thinking": False}},
            }
        )  # type: ignore[call-overload]
        assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
        assert off.choices[0].message.content == f"<think>{reasoning}</think>{message.content}"


def test_the_shared_gateway_does_not_split(oa: openai.OpenAI, fleet: UpProcess) -> None:
    """A llama's gateway picks no reasoning parser: the tags are content."""
    whole = oa.chat.completions.create(
        model=fleet.model.name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        extra_body={"guided_regex": THINKING},
    )
    content = whole.choices[0].message.content or ""
    assert content.startswith("<think>") and "</think>" in content, json.dumps(whole.model_dump())
    assert "reasoning_content" not in (whole.choices[0].message.model_extra or {})
