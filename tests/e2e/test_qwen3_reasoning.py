"""A Qwen3 checkpoint's thinking through a real fleet (`fastdecode up --http-port`, fp32 KV, the
gateway's default `--reasoning-parser auto`), with the official `openai` package.

The checkpoint is tests.support.qwen3_scripted's: model_type "qwen3" (q_norm/k_norm included),
Qwen3's own chat template, and weights that make greedy decoding think on cue. After
"<|im_start|>assistant\\n" it writes `<think>` "I" " think" `</think>` "\\n\\n" "Answer" `<|im_end|>`;
after the template's `enable_thinking: false` tail ("<think>\\n\\n</think>\\n\\n") it writes "Answer"
`<|im_end|>`. transformers' `generate` on the same files is the oracle: same prompt ids (template and
tokenizer), same tokens, same top logprobs (attention moves them a little, so a wrong KV block
shows, a cached one included).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from fastdecode.client import Client
from fastdecode.runtime.settings import ShardSettings
from fastdecode.tools.fleet import UpProcess
from tests.e2e.test_openai import HTTP_TIMEOUT, call
from tests.support import FleetFactory
from tests.support.qwen3_scripted import CONTENT, REASONING, SCRIPT, save_qwen3_scripted, scripted_ids

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore")]

BLOCK = ShardSettings().block_size  # tokens per KV block (16 unless FASTDECODE_BLOCK_SIZE)
QUESTION = [{"role": "user", "content": "What is two plus two? Please think about it."}]
OFF = {"enable_thinking": False}
TOP = 5


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_qwen3_scripted(tmp_path_factory.mktemp("qwen3") / "Qwen3-scripted")


@pytest.fixture(scope="module")
def qfleet(qwen3: Path, fleet_factory: FleetFactory) -> UpProcess:
    return fleet_factory(qwen3, http=True, private=True)  # this file's alone


@pytest.fixture(scope="module")
def oa(qfleet: UpProcess) -> Iterator[openai.OpenAI]:
    assert qfleet.http
    with openai.OpenAI(
        base_url=f"http://{qfleet.http}/v1", api_key="x", timeout=HTTP_TIMEOUT, max_retries=0
    ) as client:
        yield client


@pytest.fixture(scope="module")
def hf(qwen3: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(qwen3)


def hf_prompt(hf: tuple[Any, Any], messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    text = hf[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return hf[1](text, add_special_tokens=False)["input_ids"]


def hf_greedy(hf: tuple[Any, Any], prompt: list[int], n: int = 12) -> tuple[list[int], list[list[float]]]:
    """transformers' greedy tokens (up to its EOS) and each one's top-TOP logprobs."""
    with torch.no_grad():
        out = hf[0].generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt)),
        )
        logprobs = hf[0](out).logits[0].log_softmax(-1)
    new = out[0, len(prompt) :].tolist()
    tops = [logprobs[len(prompt) - 1 + i].topk(TOP).values.tolist() for i in range(len(new))]
    return new, tops


def fleet_prompt(qfleet: UpProcess, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    body: dict[str, Any] = {"messages": messages, "chat_template_kwargs": template_kwargs or None}
    status, _, out = call(f"http://{qfleet.http}", "/tokenize", body, token=None)
    assert status == 200, out
    return out["tokens"]


def scripted(qwen3: Path, thinking: bool) -> list[int]:
    """The scripted answer's ids, from the prompt's last token ("\\n" thinking, "\\n\\n" not) to EOS."""
    ids, successor = scripted_ids(qwen3), dict(SCRIPT)
    token, out = ("Ċ" if thinking else "ĊĊ"), []
    while token != "<|im_end|>":
        token = successor[token]
        out.append(ids[token])
    return out


def chat(oa: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw = {"model": "Qwen3-scripted", "max_tokens": 16, "temperature": 0} | kw
    return oa.chat.completions.create(messages=messages, **kw)  # type: ignore[call-overload]


def assert_logprobs_match(choice: Any, want: list[list[float]]) -> None:
    got = [[t.logprob for t in c.top_logprobs] for c in choice.logprobs.content]
    assert len(got) in (len(want), len(want) - 1)  # the EOS token may go unlisted
    for g, w in zip(got, want[: len(got)], strict=True):
        assert g == pytest.approx(w, abs=2e-3), (got, want)


def test_the_fleet_and_transformers_follow_the_script(
    qwen3: Path, qfleet: UpProcess, hf: tuple[Any, Any]
) -> None:
    for thinking in (True, False):
        kwargs = {} if thinking else OFF
        prompt = hf_prompt(hf, QUESTION, **kwargs)
        assert fleet_prompt(qfleet, QUESTION, **kwargs) == prompt  # Qwen3's template, rendered alike
        tokens, _ = hf_greedy(hf, prompt)
        assert tokens == scripted(qwen3, thinking)
        with Client(qfleet.target) as client:
            got = client.generate(token_ids=prompt, max_tokens=12, timeout=120)
        assert list(got.token_ids) == tokens


def test_thinking_comes_back_as_reasoning_content(oa: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    reply = chat(oa, QUESTION, logprobs=True, top_logprobs=TOP)
    choice = reply.choices[0]
    assert choice.message.content == CONTENT
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert choice.finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 7
    _, tops = hf_greedy(hf, hf_prompt(hf, QUESTION))
    assert_logprobs_match(choice, tops)


def test_thinking_streams_as_reasoning_deltas(oa: openai.OpenAI) -> None:
    kinds, reasoning, content = [], "", ""
    for chunk in chat(oa, QUESTION, stream=True):
        for choice in chunk.choices:
            r = (choice.delta.model_extra or {}).get("reasoning_content") or ""
            c = choice.delta.content or ""
            assert "<think>" not in c and "</think>" not in c and "think>" not in r, chunk
            kinds += ["r"] * bool(r) + ["c"] * bool(c)
            reasoning, content = reasoning + r, content + c
    assert (reasoning, content) == (REASONING, CONTENT)
    assert kinds == sorted(kinds, reverse=True)  # all the thinking, then the answer


def test_thinking_off_returns_no_reasoning(oa: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    reply = chat(oa, QUESTION, extra_body={"chat_template_kwargs": OFF}, logprobs=True, top_logprobs=TOP)
    message = reply.choices[0].message
    assert message.content == CONTENT
    assert (message.model_extra or {}).get("reasoning_content") is None
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    _, tops = hf_greedy(hf, hf_prompt(hf, QUESTION, **OFF))
    assert_logprobs_match(reply.choices[0], tops)
    reasoning, content = "", ""
    for chunk in chat(oa, QUESTION, stream=True, extra_body={"chat_template_kwargs": OFF}):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("", CONTENT)


def test_a_second_turn_reuses_the_first_turns_kv_blocks(
    oa: openai.OpenAI, qfleet: UpProcess, hf: tuple[Any, Any]
) -> None:
    first = [
        {
            "role": "user",
            "content": "A long first question, so that its prompt fills several whole KV blocks: "
            "which is larger, seven times eight or six times nine?",
        }
    ]
    prompt1 = fleet_prompt(qfleet, first)
    assert len(prompt1) >= 4 * BLOCK
    one = chat(oa, first)
    assert one.usage is not None and one.usage.prompt_tokens == len(prompt1)
    assert one.usage.prompt_tokens_details.cached_tokens == 0  # a prompt no test sent before
    message = one.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (REASONING, CONTENT)

    # the answer goes back as the client got it; Qwen3's template drops an earlier turn's thinking
    second = [
        *first,
        {"role": "assistant", "content": message.content, "reasoning_content": REASONING},
        {"role": "user", "content": "And by how much?"},
    ]
    prompt2 = fleet_prompt(qfleet, second)
    assert prompt2 == hf_prompt(hf, second)
    assert prompt2[: len(prompt1)] == prompt1  # the first turn's prompt is the second's prefix
    two = chat(oa, second, logprobs=True, top_logprobs=TOP)
    assert two.usage is not None and two.usage.prompt_tokens == len(prompt2)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached == len(prompt1) // BLOCK * BLOCK > 0, (cached, len(prompt1))  # whole blocks only
    reply = two.choices[0]
    assert (reply.message.model_extra["reasoning_content"], reply.message.content) == (REASONING, CONTENT)
    # the cached blocks hold what a fresh prefill would: the logprobs are transformers' own
    _, tops = hf_greedy(hf, prompt2)
    assert_logprobs_match(reply, tops)
    # streamed, the usage chunk says the same (the second turn's own blocks are cached by now)
    chunks = list(chat(oa, second, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens >= cached


def test_an_answer_cut_off_while_thinking_is_all_reasoning(oa: openai.OpenAI) -> None:
    whole = chat(oa, QUESTION, max_tokens=3)  # <think> "I" " think"
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.model_extra["reasoning_content"] == REASONING and not choice.message.content
    reasoning, content = "", ""
    for chunk in chat(oa, QUESTION, max_tokens=3, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (REASONING, "")


def test_the_responses_api_returns_a_reasoning_item(oa: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "Qwen3-scripted",
        "input": QUESTION,
        "max_output_tokens": 16,
        "temperature": 0,
    }
    r = oa.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert [part.text for part in r.output[0].content or []] == [REASONING]
    assert r.output_text == CONTENT
    assert r.usage is not None and r.usage.output_tokens == 7
    assert r.usage.output_tokens_details.reasoning_tokens == 2  # "I", " think"
    reasoning, content = "", ""
    for event in oa.responses.create(stream=True, **kw):
        if event.type == "response.reasoning_text.delta":
            reasoning += event.delta
        elif event.type == "response.output_text.delta":
            content += event.delta
    assert (reasoning, content) == (REASONING, CONTENT)
    off = oa.responses.create(**kw, extra_body={"chat_template_kwargs": OFF})
    assert [item.type for item in off.output] == ["message"] and off.output_text == CONTENT


def _sse(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:") and "{" in line]


def test_the_messages_api_returns_a_thinking_block(qfleet: UpProcess) -> None:
    base = f"http://{qfleet.http}"
    body: dict[str, Any] = {"model": "Qwen3-scripted", "max_tokens": 16, "messages": QUESTION}
    status, _, m = call(base, "/v1/messages", body, token=None)
    assert status == 200, m
    assert m["content"] == [
        {"type": "thinking", "thinking": REASONING, "signature": ""},
        {"type": "text", "text": CONTENT},
    ]
    status, _, raw = call(base, "/v1/messages", body | {"stream": True}, token=None)
    assert status == 200, raw
    deltas = [e["delta"] for e in _sse(raw) if e.get("type") == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == REASONING
    assert "".join(d.get("text", "") for d in deltas) == CONTENT
    status, _, m = call(base, "/v1/messages", body | {"thinking": {"type": "disabled"}}, token=None)
    assert status == 200 and m["content"] == [{"type": "text", "text": CONTENT}], m


@pytest.fixture(scope="module")
def thinking_2507(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_qwen3_scripted(
        tmp_path_factory.mktemp("qwen3") / "Qwen3-Thinking-2507-scripted", thinking_2507=True
    )


def test_a_template_that_opens_the_think_block(thinking_2507: Path, fleet_factory: FleetFactory) -> None:
    """Qwen3's Thinking-2507 models: the generation prompt ends "<think>\\n", the answer is
    "I think</think>\\n\\nAnswer" with no "<think>" of its own, and `auto` still splits it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(thinking_2507, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(thinking_2507)
    prompt = hf_prompt((model, tok), QUESTION)
    tokens, _ = hf_greedy((model, tok), prompt)
    assert tok.decode(tokens, skip_special_tokens=True) == f"{REASONING}</think>\n\n{CONTENT}"
    fleet = fleet_factory(thinking_2507, http=True, private=True)
    assert fleet_prompt(fleet, QUESTION) == prompt
    with Client(fleet.target) as client:
        assert list(client.generate(token_ids=prompt, max_tokens=12, timeout=120).token_ids) == tokens
    with openai.OpenAI(
        base_url=f"http://{fleet.http}/v1", api_key="x", timeout=HTTP_TIMEOUT, max_retries=0
    ) as oa:
        kw = {"model": thinking_2507.name}
        message = chat(oa, QUESTION, **kw).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (REASONING, CONTENT)
        reasoning, content = "", ""
        for chunk in chat(oa, QUESTION, stream=True, **kw):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (REASONING, CONTENT)
