"""The gateway's OpenAI-compatible HTTP API against the running fleet, through the official `openai`
package (and plain HTTP for the error shapes, headers and hang-ups the SDK hides)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from fastdecode.client import Client
from fastdecode.runtime.rpc import REQUEST_ID_KEY, sync_channel
from fastdecode.tools.fleet import ServiceProcess, UpProcess, start_service, stop_processes
from fastdecode.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support import TOKEN, metric_total, scrape

HTTP_TIMEOUT = 60.0
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name the capital of France."},
]


# ---- helpers -------------------------------------------------------------------------------------
def call(
    base: str,
    path: str,
    body: dict[str, Any] | None = None,
    token: str | None = TOKEN,
    headers: dict[str, str] | None = None,
    timeout: float = HTTP_TIMEOUT,
) -> tuple[int, dict[str, str], Any]:
    """(status, lower-cased headers, JSON body or raw text) of one HTTP call."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, headers=hdrs, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, h, raw = resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, h, raw = e.code, e.headers, e.read().decode()
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        payload = raw
    return status, {k.lower(): v for k, v in h.items()}, payload


def assert_error(status: int, payload: Any, want_status: int, want_type: str, *words: str) -> dict:
    assert status == want_status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == want_type, err
    for w in words:
        assert w in err["message"], err
    return err


def requests_total(fleet: UpProcess, **labels: str) -> float:
    return metric_total(
        scrape(fleet.state["gateway"]["metrics"]), "fastdecode_gateway_requests_total", **labels
    )


def wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture(scope="module")
def base(fleet: UpProcess) -> str:
    assert fleet.http, "the session fleet must serve HTTP (tests/e2e/conftest.py: --http-port)"
    return f"http://{fleet.http}"


@pytest.fixture(scope="module")
def oa(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, timeout=HTTP_TIMEOUT, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(fleet: UpProcess) -> str:
    return fleet.model.name


# ---- completions ---------------------------------------------------------------------------------
def test_completion_equals_the_grpc_generation(fleet: UpProcess, oa: openai.OpenAI, model_id: str) -> None:
    with Client(fleet.target, token=TOKEN) as client:
        want = client.generate(prompt="The KV-cache never", max_tokens=16)  # greedy
    t0 = time.perf_counter()
    got = oa.completions.create(model=model_id, prompt="The KV-cache never", max_tokens=16, temperature=0)
    seconds = time.perf_counter() - t0
    print(f"\nnon-streaming completion of 16 tokens over HTTP: {seconds * 1000:.0f} ms")
    assert got.object == "text_completion" and got.model == model_id and got.id.startswith("cmpl-")
    assert len(got.choices) == 1
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens,
        want.usage.completion_tokens,
    )
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompts(fleet: UpProcess, oa: openai.OpenAI, model_id: str) -> None:
    ids = [0, 17, 300, 45]
    with Client(fleet.target, token=TOKEN) as client:
        want = client.generate(token_ids=ids, max_tokens=8)
    for prompt in (ids, [ids]):
        got = oa.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == want.text
        assert got.usage is not None and got.usage.prompt_tokens == len(ids)


def test_streamed_completion_joins_to_the_whole_one(oa: openai.OpenAI, model_id: str) -> None:
    kw: dict[str, Any] = {"model": model_id, "prompt": "Batching many sequences", "max_tokens": 20}
    whole = oa.completions.create(**kw, temperature=0)
    chunks = list(
        oa.completions.create(**kw, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "the completion must arrive in several events"
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)


def test_stop_strings_seed_and_sampling(oa: openai.OpenAI, model_id: str) -> None:
    greedy = oa.completions.create(model=model_id, prompt="Once upon", max_tokens=24, temperature=0)
    text = greedy.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = oa.completions.create(model=model_id, prompt="Once upon", max_tokens=24, temperature=0, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kw: dict[str, Any] = {"model": model_id, "prompt": "Once upon", "max_tokens": 12}
    a = oa.completions.create(**kw, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 50})
    b = oa.completions.create(**kw, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 50})
    assert a.choices[0].text == b.choices[0].text  # a seed makes sampling repeatable
    eos = oa.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True})
    assert eos.usage is not None and eos.usage.completion_tokens == 12


# ---- chat ----------------------------------------------------------------------------------------
def test_chat_applies_the_checkpoint_template(fleet: UpProcess, oa: openai.OpenAI, model_id: str) -> None:
    from transformers import AutoTokenizer

    # transformers renders and tokenizes the checkpoint's template: the oracle for the prompt ids.
    tok = AutoTokenizer.from_pretrained(fleet.model)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with Client(fleet.target, token=TOKEN) as client:
        want = client.generate(token_ids=list(ids), max_tokens=12)
        want5 = client.generate(token_ids=list(ids), max_tokens=5)
    got = oa.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert got.usage is not None and got.usage.prompt_tokens == len(ids)
    assert got.choices[0].finish_reason == want.finish_reason
    # max_completion_tokens is the newer name of max_tokens
    newer = oa.chat.completions.create(
        model=model_id,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=5,
        temperature=0,
    )
    # Greedy: the same first tokens as the gRPC API's 5-token completion, exactly.
    assert newer.usage is not None and newer.usage.completion_tokens == want5.usage.completion_tokens >= 1
    assert newer.choices[0].message.content == want5.text
    assert newer.choices[0].finish_reason == want5.finish_reason


def test_streamed_chat(oa: openai.OpenAI, model_id: str) -> None:
    kw: dict[str, Any] = {"model": model_id, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    whole = oa.chat.completions.create(**kw)
    chunks = list(oa.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choice = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choice)
    assert text == whole.choices[0].message.content
    assert with_choice[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens  # type: ignore[union-attr]
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_a_multi_turn_chat_reports_cached_prompt_tokens_from_its_second_turn(
    fleet: UpProcess, oa: openai.OpenAI, model_id: str
) -> None:
    """Each turn resends the conversation: from the second on, the shard holding the first turn's
    prompt blocks serves them from its prefix cache, and usage says how many (OpenAI's field)."""
    messages: list[dict[str, str]] = [
        {
            "role": "system",
            "content": "You are a careful assistant for a multi-turn prefix test. Answer briefly, "
            "in plain words, and keep every reply under twenty words whatever the user asks of you.",
        },
        {"role": "user", "content": "What is a prefix cache?"},
    ]
    cached = []
    for question in ("And why does it help a chat?", "Give one more reason."):
        got = oa.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert got.usage is not None and got.usage.prompt_tokens_details is not None
        cached.append(got.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < got.usage.prompt_tokens
        messages += [
            {"role": "assistant", "content": got.choices[0].message.content or ""},
            {"role": "user", "content": question},
        ]
    # the first turn may share the template's opening block with earlier chats; the second reads
    # the first turn's whole prompt (its full blocks) from the cache
    assert cached[1] > cached[0] and cached[1] >= 32
    # the gRPC API reports the same field
    with Client(fleet.target, token=TOKEN) as client:
        ids = [1] + list(range(200, 260))
        client.generate(token_ids=ids, max_tokens=2)
        again = client.generate(token_ids=ids + [7], max_tokens=2)
    assert again.usage.cached_tokens >= 48


def test_models_and_health(base: str, oa: openai.OpenAI, model_id: str) -> None:
    models = oa.models.list()
    assert [m.id for m in models.data] == [model_id]
    assert oa.models.retrieve(model_id).id == model_id
    status, _, payload = call(base, "/health", token=None)  # no token: it is for probes
    assert (status, payload) == (200, {"status": "ok"})


# ---- errors --------------------------------------------------------------------------------------
def test_wrong_or_missing_token_is_401(base: str, model_id: str) -> None:
    for token in (None, "wrong-token"):
        status, headers, payload = call(
            base, "/v1/completions", {"model": model_id, "prompt": "hi"}, token=token
        )
        err = assert_error(status, payload, 401, "authentication_error", "bearer token")
        assert err["code"] == "invalid_api_key" and headers.get("www-authenticate") == "Bearer"
        status, _, payload = call(base, "/v1/models", token=token)
        assert_error(status, payload, 401, "authentication_error")
    with (
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", timeout=HTTP_TIMEOUT, max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.completions.create(model=model_id, prompt="hi", max_tokens=2)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", ["valid integer"]),  # FastAPI's 422
        ({"prompt": "hi", "max_tokens": 0}, None, ["max_tokens"]),  # the gateway's own validation
        ({"prompt": "hi", "temperature": -1}, None, ["temperature"]),
        ({"prompt": "hi", "max_tokens": 1_000_000}, None, ["context"]),
        ({"prompt": ""}, None, ["prompt is empty"]),
        ({"prompt": ["a", "b"]}, "prompt", ["one prompt per request"]),
        ({"prompt": [5, 1 << 20]}, None, ["vocabulary"]),
        ({"prompt": "hi", "n": 17}, "n", ["n=17"]),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", ["logprobs must be in [0, 20]"]),
        ({"prompt": "hi", "presence_penalty": 3}, None, ["presence_penalty"]),
        ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias", ["token ids"]),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, None, ["logit_bias", "[-100, 100]"]),
        ({"prompt": "hi", "min_p": 2}, None, ["min_p"]),
        ({"prompt": "hi", "allowed_token_ids": [1 << 20]}, None, ["allowed_token_ids", "vocabulary"]),
        ({"prompt": "hi", "stop": ["x"] * 17}, None, ["stop strings"]),
        ({}, "prompt", ["Field required"]),
    ],
)
def test_bad_completion_params_are_400(
    base: str, model_id: str, body: dict[str, Any], param: str | None, words: list[str]
) -> None:
    status, _, payload = call(base, "/v1/completions", {"model": model_id, **body})
    err = assert_error(status, payload, 400, "invalid_request_error", *words)
    assert err["param"] == param


def test_bad_chat_params_are_400(base: str, model_id: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        (
            {
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
            },
            "tools[0].function.parameters",
        ),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ]
    for body, param in cases:
        status, _, payload = call(base, "/v1/chat/completions", {"model": model_id, **body})
        assert assert_error(status, payload, 400, "invalid_request_error")["param"] == param, body
    status, _, payload = call(base, "/v1/chat/completions", {"model": model_id, "messages": "hi"})
    assert_error(status, payload, 400, "invalid_request_error")


def test_malformed_json_unknown_model_and_route(base: str, oa: openai.OpenAI, model_id: str) -> None:
    req = urllib.request.Request(
        f"{base}/v1/completions",
        data=b'{"prompt": "hi",',
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=HTTP_TIMEOUT)
    assert_error(e.value.code, json.loads(e.value.read()), 400, "invalid_request_error", "not valid JSON")
    status, _, payload = call(base, "/v1/completions", {"model": "gpt-17", "prompt": "hi"})
    err = assert_error(status, payload, 404, "invalid_request_error", "gpt-17", model_id)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-17", messages=MESSAGES)  # type: ignore[arg-type]
    status, _, payload = call(base, "/v1/embeddings", {"input": "x"})
    assert_error(status, payload, 404, "invalid_request_error", "Not Found")
    with pytest.raises(openai.BadRequestError) as bad:
        oa.completions.create(model=model_id, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(bad.value)


# ---- request ids, metrics, hang-ups --------------------------------------------------------------
def test_request_ids(fleet: UpProcess, base: str, model_id: str) -> None:
    body = {"model": model_id, "prompt": "hi", "max_tokens": 2}
    status, headers, payload = call(base, "/v1/completions", body, headers={"X-Request-Id": "client-42"})
    assert status == 200 and headers[REQUEST_ID_KEY] == "client-42" and payload["id"] == "cmpl-client-42"
    for insane in ("has spaces", "a,b", "x" * 129):
        _, headers, _ = call(base, "/v1/completions", body, headers={"X-Request-Id": insane})
        assert headers[REQUEST_ID_KEY].startswith("gw-"), insane
    _, headers, _ = call(base, "/v1/completions", body)
    assert headers[REQUEST_ID_KEY].startswith("gw-")
    # The same client id twice at once: both run (internally one sequence gets a suffix), and each
    # caller gets its id back exactly as sent: a suffix would tell it that someone else uses the id.
    results: list[tuple[int, dict[str, str], Any]] = []
    slow = {"model": model_id, "prompt": "hi", "max_tokens": 40, "ignore_eos": True}
    threads = [
        threading.Thread(
            target=lambda: results.append(
                call(base, "/v1/completions", slow, headers={"X-Request-Id": "twin"})
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HTTP_TIMEOUT)
    assert [r[0] for r in results] == [200, 200], results
    assert [r[1][REQUEST_ID_KEY] for r in results] == ["twin", "twin"]
    # gRPC: the id comes back as initial metadata; a generated one when the client sent none.
    stub = gateway_pb2_grpc.GatewayStub(sync_channel(fleet.target))
    grpc_call = stub.Generate(
        gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[0, 5]), max_tokens=2),
        metadata=(("authorization", f"Bearer {TOKEN}"),),
        timeout=HTTP_TIMEOUT,
    )
    list(grpc_call)
    assert grpc_call.code() == grpc.StatusCode.OK
    assert dict(grpc_call.initial_metadata())[REQUEST_ID_KEY].startswith("gw-")


def test_http_requests_are_counted_in_gateway_metrics(fleet: UpProcess, base: str, model_id: str) -> None:
    metrics = fleet.state["gateway"]["metrics"]
    before = scrape(metrics)
    call(base, "/v1/completions", {"model": model_id, "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    call(base, "/v1/completions", {"model": model_id, "prompt": "hi", "n": 17})
    call(base, "/v1/completions", {"model": model_id, "prompt": "hi"}, token="nope")
    after = scrape(metrics)

    def moved(name: str, **labels: str) -> float:
        return metric_total(after, name, **labels) - metric_total(before, name, **labels)

    assert moved("fastdecode_gateway_requests_total", api="http", status="OK") >= 1
    assert moved("fastdecode_gateway_requests_total", api="http", status="INVALID_ARGUMENT") >= 1
    assert moved("fastdecode_gateway_requests_total", api="http", status="UNAUTHENTICATED") >= 1
    assert moved("fastdecode_generation_tokens_total") >= 3
    assert moved("fastdecode_time_to_first_token_seconds_count") >= 1
    assert moved("fastdecode_e2e_request_latency_seconds_count") >= 1
    assert ("fastdecode_gateway_requests_in_flight", ()) in after
    assert not any(n == "fastdecode_num_requests_running" for n, _ in after), "the scheduler's name"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_cancels_its_generation(
    fleet: UpProcess, base: str, model_id: str, stream: bool
) -> None:
    """The generation stops (CANCELLED, in-flight back to 0) instead of running to max_tokens."""
    metrics = fleet.state["gateway"]["metrics"]
    cancelled = requests_total(fleet, api="http", status="CANCELLED")
    tokens = metric_total(scrape(metrics), "fastdecode_generation_tokens_total")
    body = json.dumps(
        {"model": model_id, "prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": stream}
    ).encode()
    host, port = fleet.http.rsplit(":", 1)  # type: ignore[union-attr]
    with socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        if stream:
            assert s.recv(4096).startswith(b"HTTP/1.1 200"), "the stream should have started"
        else:
            time.sleep(0.5)
    assert wait_for(lambda: requests_total(fleet, api="http", status="CANCELLED") > cancelled)
    assert wait_for(lambda: metric_total(scrape(metrics), "fastdecode_gateway_requests_in_flight") == 0)
    generated = metric_total(scrape(metrics), "fastdecode_generation_tokens_total") - tokens
    assert generated < 900, "the generation must stop when its client is gone"


# ---- a gateway of its own: a model without a chat template; draining -------------------------------
def _gateway(fleet: UpProcess, model: Path, workdir: Path, name: str, *extra: str) -> ServiceProcess:
    return start_service(
        name,
        [
            "gateway",
            "--scheduler",
            fleet.state["scheduler"]["address"],
            "--model",
            str(model),
            "--http-port",
            "0",
            *extra,
        ],
        workdir,
        metrics=True,
        timeout=60,
        env={"FASTDECODE_FLEET_SECRET_FILE": fleet.state["fleet_secret_file"]},  # a member of the fleet
    )


def test_a_model_without_chat_template_refuses_chat(fleet: UpProcess, tmp_path: Path) -> None:
    model = tmp_path / "no-template"
    shutil.copytree(fleet.model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    gw = _gateway(fleet, model, tmp_path, "gateway-no-template")
    try:
        assert gw.http
        base = f"http://{gw.http}"
        status, _, payload = call(base, "/v1/chat/completions", {"messages": MESSAGES}, token=None)
        err = assert_error(status, payload, 400, "invalid_request_error", "chat_template", "/v1/completions")
        assert err["param"] == "messages"
        status, _, payload = call(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None)
        assert status == 200 and payload["model"] == "no-template", payload  # completions still work
    finally:
        stop_processes([gw], grace=10)


def test_sigterm_drains_http_requests(fleet: UpProcess, tmp_path: Path) -> None:
    """SIGTERM: /health turns 503 and new requests get 503 while the one in flight runs to its end."""
    gw = _gateway(fleet, fleet.model, tmp_path, "gateway-drain", "--served-model-name", "org/served-name")
    try:
        assert gw.http
        base = f"http://{gw.http}"
        assert call(base, "/health", token=None)[0] == 200
        status, _, models = call(base, "/v1/models", token=None)
        assert status == 200 and [m["id"] for m in models["data"]] == ["org/served-name"]
        result: list[tuple[int, dict[str, str], Any]] = []
        long = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}
        worker = threading.Thread(
            target=lambda: result.append(call(base, "/v1/completions", long, token=None))
        )
        worker.start()
        assert wait_for(
            lambda: metric_total(scrape(gw.metrics or ""), "fastdecode_gateway_requests_in_flight") == 1
        )
        gw.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: call(base, "/health", token=None)[0] == 503, timeout=10)
        status, _, payload = call(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None)
        assert_error(status, payload, 503, "service_unavailable_error", "draining")
        worker.join(timeout=HTTP_TIMEOUT)
        assert result and result[0][0] == 200, result
        assert result[0][2]["usage"]["completion_tokens"] == 300
        assert gw.proc.wait(timeout=30) == 0
    finally:
        stop_processes([gw], grace=10)
