"""The OpenAI parameters vLLM users send, on the real model (SmolLM2-135M-Instruct, fp32 KV) through
the official `openai` client: logprobs and top_logprobs (completions, chat, streamed or not) and echo
equal transformers' log-softmax of the same positions; the penalties and min_tokens change the output
as OpenAI defines them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from fastdecode.client import Client, InvalidRequestError
from fastdecode.tools.fleet import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TOL = 1e-3
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def oa(real_fleet: UpProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{real_fleet.http}/v1", api_key="x", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(real_fleet: UpProcess) -> str:
    return real_fleet.model.name


def hf_logprobs(smollm2_hf: tuple, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids` (row i scores the token after i)."""
    model = smollm2_hf[0]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def chat_prompt(smollm2_hf: tuple, question: str) -> list[int]:
    tok = smollm2_hf[1]
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False).input_ids


def greedy(smollm2_hf: tuple, prompt: list[int], n: int) -> list[int]:
    model = smollm2_hf[0]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def tok_str(smollm2_hf: tuple, t: int) -> str:
    return smollm2_hf[1].decode([t])


def check_top(smollm2_hf: tuple, row: torch.Tensor, got: dict[str, float], k: int) -> None:
    """The alternatives are the row's k best, by value (token strings may collide, so values first)."""
    vals, ids = row.topk(k)
    want = sorted(vals.tolist(), reverse=True)
    assert len(got) <= k
    for t, v in zip(ids.tolist(), vals.tolist(), strict=True):
        s = tok_str(smollm2_hf, t)
        if s in got:
            assert abs(got[s] - v) < TOL or any(abs(got[s] - w) < TOL for w in want), (s, got[s], v)
    assert all(any(abs(g - w) < TOL for w in want) for g in got.values())


# ---- logprobs ------------------------------------------------------------------------------------
def test_completion_logprobs_equal_transformers(oa, model_id, smollm2_hf) -> None:
    prompt = chat_prompt(smollm2_hf, QUESTION)
    want = greedy(smollm2_hf, prompt, 8)
    lp = hf_logprobs(smollm2_hf, prompt + want)
    r = oa.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
    got = r.choices[0].logprobs
    shown = [t for t in want if t != smollm2_hf[1].eos_token_id]
    assert got.tokens == [tok_str(smollm2_hf, t) for t in shown]
    for i, t in enumerate(shown):
        row = lp[len(prompt) + i - 1]
        assert abs(got.token_logprobs[i] - row[t].item()) < TOL, i
        assert len(got.top_logprobs[i]) == 5
        check_top(smollm2_hf, row, got.top_logprobs[i], 5)
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    # streamed: the same numbers, chunk by chunk. This second request reads the first one's prompt
    # blocks from the shard's prefix cache, so gpu_dense computes only the prompt's tail, in another
    # shape: fp32 rounding moves the logprobs by ~1e-5 (the tokens are the same).
    parts = list(
        oa.completions.create(
            model=model_id, prompt=prompt, max_tokens=8, temperature=0, logprobs=5, stream=True
        )
    )
    streamed = [
        v for c in parts if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(got.token_logprobs, abs=1e-4)


def test_echo_scores_the_prompt(oa, model_id, smollm2_hf) -> None:
    text = "The capital of France is Paris. The capital of Germany is"
    r = oa.completions.create(model=model_id, prompt=text, max_tokens=3, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith(text)
    ids = smollm2_hf[1](text).input_ids
    n = len(ids)
    got = c.logprobs
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.tokens[:n] == [tok_str(smollm2_hf, t) for t in ids]
    gen = greedy(smollm2_hf, ids, 3)
    lp = hf_logprobs(smollm2_hf, ids + gen)
    for pos in range(1, n + len(gen)):
        t = (ids + gen)[pos]
        assert abs(got.token_logprobs[pos] - lp[pos - 1, t].item()) < TOL, pos
        check_top(smollm2_hf, lp[pos - 1], got.top_logprobs[pos], 2)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 3
    # echo without logprobs: the text only
    plain = oa.completions.create(model=model_id, prompt=text, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None


def test_echo_over_several_prefill_chunks(oa, model_id, smollm2_hf) -> None:
    """A prompt longer than the prefill budget (512) is scored across chunks, each position once."""
    text = " ".join(f"word{i}" for i in range(400))
    ids = smollm2_hf[1](text).input_ids
    assert len(ids) > 600
    r = oa.completions.create(model=model_id, prompt=ids, max_tokens=1, temperature=0, logprobs=0, echo=True)
    got = r.choices[0].logprobs.token_logprobs
    assert len(got) == len(ids) + 1 and got[0] is None
    lp = hf_logprobs(smollm2_hf, ids)
    want = [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got[1 : len(ids)], want, strict=True)) < TOL


def test_chat_logprobs_equal_transformers(oa, model_id, smollm2_hf) -> None:
    prompt = chat_prompt(smollm2_hf, QUESTION)
    want = greedy(smollm2_hf, prompt, 8)
    lp = hf_logprobs(smollm2_hf, prompt + want)
    msgs = [{"role": "user", "content": QUESTION}]
    r = oa.chat.completions.create(
        model=model_id, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    shown = [t for t in want if t != smollm2_hf[1].eos_token_id]
    assert [e.token for e in content] == [tok_str(smollm2_hf, t) for t in shown]
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for i, (e, t) in enumerate(zip(content, shown, strict=True)):
        row = lp[len(prompt) + i - 1]
        assert abs(e.logprob - row[t].item()) < TOL
        assert bytes(e.bytes).decode() == e.token
        check_top(smollm2_hf, row, {a.token: a.logprob for a in e.top_logprobs}, 3)
        assert [a.logprob for a in e.top_logprobs] == sorted(
            (a.logprob for a in e.top_logprobs), reverse=True
        )
    stream = oa.chat.completions.create(
        model=model_id, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [
        e.logprob
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # (the second request reads the first's cached prompt blocks: fp32 rounding, see above)
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-4)
    # logprobs=True alone: the sampled token's, no alternatives; sampled at temperature 1: still the model's
    r = oa.chat.completions.create(model=model_id, messages=msgs, max_tokens=6, seed=3, logprobs=True)
    content = r.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in content)
    assert all(e.logprob <= 0 and math.isfinite(e.logprob) for e in content)


def test_sdk_carries_logprobs_and_prompt_logprobs(real_fleet, smollm2_hf) -> None:
    prompt = chat_prompt(smollm2_hf, QUESTION)
    with Client(real_fleet.target) as client:
        r = client.generate(token_ids=prompt, max_tokens=6, logprobs=4, prompt_logprobs=True, timeout=120)
        plain = client.generate(token_ids=prompt, max_tokens=6, timeout=120)
        choice = client.generate(
            token_ids=prompt, max_tokens=8, temperature=1.0, seed=3, structured={"choice": ["Paris", "Lyon"]}
        )
        regex = client.generate(
            prompt="Digits:", max_tokens=8, temperature=1.0, structured={"regex": "[0-9]{4}"}
        )
        with pytest.raises(InvalidRequestError, match="cannot be compiled"):
            client.generate(prompt="x", structured={"json_schema": {"$ref": "#/nope"}})
    assert choice.text in {"Paris", "Lyon"} and regex.text.isdigit() and len(regex.text) == 4
    assert plain.logprobs == [] and plain.prompt_logprobs == [] and plain.token_ids == r.token_ids
    lp = hf_logprobs(smollm2_hf, prompt + r.token_ids)
    assert [e.token_id for e in r.logprobs] == r.token_ids
    assert [e.token_id for e in r.prompt_logprobs] == prompt[1:]
    for pos, e in enumerate(r.prompt_logprobs + r.logprobs, start=1):
        assert abs(e.logprob - lp[pos - 1, e.token_id].item()) < TOL, pos
        want = lp[pos - 1].topk(4)
        assert [t for t, _ in e.top] == want.indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(want.values.tolist(), abs=TOL)


# ---- n ------------------------------------------------------------------------------------------
def test_n_choices_each_equal_the_single_request_with_its_seed(oa, model_id) -> None:
    msgs = [{"role": "user", "content": "Name a color."}]
    kw = {"model": model_id, "max_tokens": 8, "temperature": 1.0}
    r = oa.chat.completions.create(messages=msgs, n=4, seed=100, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        alone = oa.chat.completions.create(messages=msgs, seed=100 + c.index, **kw)
        assert c.message.content == alone.choices[0].message.content
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == sum(
        oa.chat.completions.create(messages=msgs, seed=100 + i, **kw).usage.completion_tokens
        for i in range(4)
    )
    stream = oa.chat.completions.create(messages=msgs, n=4, seed=100, stream=True, **kw)
    texts = ["", "", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in r.choices]


# ---- penalties -----------------------------------------------------------------------------------
def _count(text: str, word: str) -> int:
    return text.split().count(word)


def test_penalties_act_on_a_repeated_token(oa, model_id) -> None:
    prompt = "Repeat the word 'dog' forever: dog dog dog dog dog"
    base = oa.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
    assert _count(base.choices[0].text, "dog") >= 8, base.choices[0].text  # the model repeats it
    for kw in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 3.0}},  # vLLM's extra
    ):
        r = oa.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0, **kw)
        assert _count(r.choices[0].text, "dog") < _count(base.choices[0].text, "dog"), (kw, r.choices[0].text)
    # a negative frequency penalty makes the repetition stronger, never weaker
    r = oa.completions.create(
        model=model_id, prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=-2.0
    )
    assert _count(r.choices[0].text, "dog") >= _count(base.choices[0].text, "dog"), r.choices[0].text


def test_min_tokens_holds_back_eos(oa, model_id) -> None:
    msgs = [{"role": "user", "content": QUESTION}]
    short = oa.chat.completions.create(model=model_id, messages=msgs, max_tokens=40, temperature=0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 30
    r = oa.chat.completions.create(
        model=model_id, messages=msgs, max_tokens=40, temperature=0, extra_body={"min_tokens": n + 6}
    )
    assert r.usage.completion_tokens >= n + 6


# ---- structured outputs --------------------------------------------------------------------------
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "height_m", "role", "address", "skills"],
    "additionalProperties": False,
}


def test_json_schema_outputs_parse_and_validate(oa, model_id) -> None:
    import json

    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "Invent a person and describe them as JSON."}]

    def ask(i: int) -> str:
        r = oa.chat.completions.create(
            model=model_id, messages=msgs, max_tokens=300, temperature=0.8, seed=i, response_format=rf
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        return r.choices[0].message.content

    with ThreadPoolExecutor(20) as pool:  # batched together, as a client fleet would send them
        texts = list(pool.map(ask, range(20)))
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON_SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one answer forced


def test_json_object_choice_and_regex(oa, model_id) -> None:
    import json
    import re

    # a 135M model can loop inside an open-ended object: a short one asked for, repetition damped
    msgs = [{"role": "user", "content": 'Reply with a JSON object {"name": ..., "age": ...} for a cat.'}]
    r = oa.chat.completions.create(
        model=model_id,
        messages=msgs,
        max_tokens=200,
        temperature=0,
        frequency_penalty=1.0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    r = oa.chat.completions.create(
        model=model_id,
        messages=q,
        max_tokens=10,
        temperature=1.0,
        seed=5,
        extra_body={"guided_choice": ["Berlin", "Paris", "Rome"]},
    )
    assert r.choices[0].message.content in {"Berlin", "Paris", "Rome"}
    r = oa.completions.create(
        model=model_id,
        prompt="A US phone number:",
        max_tokens=20,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    # streamed: the joined deltas match too
    stream = oa.chat.completions.create(
        model=model_id,
        messages=q,
        max_tokens=10,
        temperature=1.0,
        stream=True,
        extra_body={"guided_choice": ["Berlin", "Paris"]},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in {"Berlin", "Paris"}


def test_a_schema_that_does_not_compile_is_a_400(oa, model_id) -> None:
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
    }
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        oa.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "x"}], response_format=bad
        )
    with pytest.raises(openai.BadRequestError, match="regex"):
        oa.completions.create(model=model_id, prompt="x", extra_body={"guided_regex": "(a"})
    # a tool's parameters are a schema too: one that does not compile names the field
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": bad["json_schema"]["schema"]}}
    with pytest.raises(openai.BadRequestError, match="cannot be compiled") as e:
        oa.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "x"}], tools=[bad_tool]
        )
    assert e.value.body["param"] == "tools[0].function.parameters"
