"""Usage in streams (stream_options.continuous_usage_stats), an aborted stream's tokens in the
metrics, and vLLM's /tokenize and /detokenize, through the gateway's HTTP app in process (the real
GatewayCore and _Front, an in-process scheduler fake scripting the model's tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from fastdecode.gateway.auth import Tenants
from fastdecode.gateway.core import GatewayCore, GatewayMetrics, UpstreamEvent
from fastdecode.gateway.text import GenerateParams
from services.gateway.http_server import _Front
from services.gateway.openai_api import OpenAIApp
from tests.support.fakes import FakeScheduler
from tests.unit.test_gateway_adapters import make_core

TOKEN = "tok"


async def call(
    app: Any, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One POST through the ASGI app: (status, the body as sent)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", "content-length": str(len(raw)), **(headers or {})}
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    sent: list[dict] = []
    requests = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def events(raw: bytes) -> list[dict[str, Any]]:
    lines = [x[len(b"data: ") :] for x in raw.split(b"\n\n") if x.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _app(core: GatewayCore, keys: bytes | None = None) -> Any:
    core.ready = True
    return _Front(OpenAIApp(core, core.settings).app, core, Tenants(keys) if keys else None, 8 << 20)


def _scripted(core: GatewayCore, link: FakeScheduler, text: str) -> list[int]:
    ids = core.tokenizer.encode(text, False)

    def script(rid: str, req: object) -> list:
        return [UpstreamEvent([t]) for t in ids[:-1]] + [UpstreamEvent(ids[-1:], "length")]

    link.script = script
    return ids


# ---- usage in streams ----------------------------------------------------------------------------
def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(llama_dir: Path) -> None:
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link, http_port=0)
    ids = _scripted(core, link, "one two three four five")
    app = _app(core)
    prompt = core.tokenizer.encode("count:", True)

    async def run() -> None:
        for path, body in (
            ("/v1/completions", {"prompt": "count:"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count:"}]}),
        ):
            opts = {"include_usage": True, "continuous_usage_stats": True}
            status, raw = await call(app, path, body | {"stream": True, "stream_options": opts})
            assert status == 200, raw
            chunks = events(raw)
            assert all(c["usage"] is not None for c in chunks), chunks
            completions = [c["usage"]["completion_tokens"] for c in chunks]
            assert completions == sorted(completions), "the running count never goes back"
            final = chunks[-1]
            assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(ids)
            assert chunks[-2]["usage"]["completion_tokens"] == len(ids)
            p = chunks[0]["usage"]["prompt_tokens"]
            assert p > 0 and all(c["usage"]["prompt_tokens"] == p for c in chunks)
            assert all(c["usage"]["total_tokens"] == p + c["usage"]["completion_tokens"] for c in chunks)
            if path == "/v1/completions":
                assert p == len(prompt)
            # include_usage alone: null on every chunk but the final one (OpenAI's shape), as before
            opts = {"include_usage": True}
            status, raw = await call(app, path, body | {"stream": True, "stream_options": opts})
            chunks = events(raw)
            assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
            # continuous_usage_stats without include_usage: no usage at all (vLLM's rule)
            opts = {"continuous_usage_stats": True}
            status, raw = await call(app, path, body | {"stream": True, "stream_options": opts})
            assert all("usage" not in c for c in events(raw))
            status, raw = await call(app, path, body | {"stream": True, "stream_options": {"x": 1}})
            assert status == 200
            status, raw = await call(
                app, path, body | {"stream": True, "stream_options": {"continuous_usage_stats": "yes"}}
            )
            assert status == 400 and b"continuous_usage_stats" in raw

    asyncio.run(run())


class _Counted(GatewayMetrics):
    def __init__(self) -> None:
        self.prompt = 0
        self.generated_tokens = 0

    def accepted(self, prompt_tokens: int) -> None:
        self.prompt += prompt_tokens

    def generated(self, tokens: int) -> None:
        self.generated_tokens += tokens


def test_an_aborted_stream_counts_its_prompt_and_the_tokens_generated_so_far(llama_dir: Path) -> None:
    """A client gone mid-stream: its prompt and every token relayed before it left are in the metrics
    (Prometheus counts what was used, not only finished requests)."""
    link = FakeScheduler(lambda rid, req: [UpstreamEvent([5 + i]) for i in range(50)])
    core, answered = make_core(llama_dir, link)
    metrics = _Counted()
    core.metrics = metrics
    core.metrics.answered = lambda status, api: answered.append((status, api))  # type: ignore[method-assign]

    async def run() -> int:
        got = 0
        params = GenerateParams(token_ids=[1, 2, 3, 4], max_tokens=100, ignore_eos=True)
        async with contextlib.aclosing(core.generate(params, "r1", None, "http")) as chunks:
            async for c in chunks:
                got += len(c.token_ids)
                if got >= 7:
                    break
        return got

    got = asyncio.run(run())
    assert metrics.prompt == 4
    assert metrics.generated_tokens == got >= 7
    assert answered[-1][0].name == "CANCELLED"


# ---- /tokenize and /detokenize -------------------------------------------------------------------
def test_tokenize_and_detokenize(llama_dir: Path) -> None:
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link, http_port=0)
    tok = core.tokenizer
    app = _app(core, TOKEN.encode())
    auth = {"authorization": f"Bearer {TOKEN}"}
    max_len = core.limits.max_context
    seen: list = []

    def script(rid: str, req: Any) -> list:
        seen.append(req.prompt_ids)
        return [UpstreamEvent([5], "length")]

    link.script = script

    async def run() -> None:
        status, raw = await call(app, "/tokenize", {"prompt": "Hello world"}, auth)
        assert status == 200, raw
        want = tok.encode("Hello world", True)
        assert json.loads(raw) == {"count": len(want), "max_model_len": max_len, "tokens": want}
        body = {"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}
        out = json.loads((await call(app, "/tokenize", body, auth))[1])
        assert out["tokens"] == tok.encode("Hello world", False)
        assert out["token_strs"] == [tok.id_to_token(i) for i in out["tokens"]]
        # a chat's ids are those the chat endpoint gives the scheduler, for the same messages
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"}]
        out = json.loads((await call(app, "/tokenize", {"messages": messages}, auth))[1])
        status, raw = await call(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, auth)
        assert status == 200, raw
        assert out["tokens"] == seen[-1] and out["count"] == len(seen[-1])
        no_prompt = {"messages": messages, "add_generation_prompt": False}
        shorter = json.loads((await call(app, "/tokenize", no_prompt, auth))[1])
        assert shorter["tokens"] == out["tokens"][: shorter["count"]] and shorter["count"] < out["count"]
        with_bos = json.loads(
            (await call(app, "/tokenize", {"messages": messages, "add_special_tokens": True}, auth))[1]
        )
        assert with_bos["tokens"] == tok.encode("", True) + out["tokens"]
        # detokenize: the ids' text, special tokens written out
        ids = tok.encode("Hello world", True)
        status, raw = await call(app, "/detokenize", {"tokens": ids}, auth)
        assert status == 200 and json.loads(raw) == {"prompt": tok.decode(ids, False)}
        assert "Hello world" in json.loads(raw)["prompt"]
        # bad input: one 400 naming the field, never a 500
        vocab = core.config.vocab_size
        for path, body, param in (
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"messages": []}, "messages"),
            ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
            ("/tokenize", {"prompt": "x" * (core.limits.max_prompt_chars + 1)}, None),
            ("/tokenize", {"messages": messages, "chat_template_kwargs": {"messages": []}}, None),
            ("/detokenize", {}, "tokens"),
            ("/detokenize", {"tokens": [vocab]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
            ("/detokenize", {"tokens": [1] * (max_len + 1)}, "tokens"),
        ):
            status, raw = await call(app, path, body, auth)
            assert status == 400, (path, body, raw)
            err = json.loads(raw)["error"]
            assert err["type"] == "invalid_request_error", err
            if param is not None:
                assert err["param"] == param, (body, err)
        status, raw = await call(app, "/tokenize", b"{not json", auth)
        assert status == 400, raw
        status, raw = await call(app, "/tokenize", {"prompt": "a", "model": "other"}, auth)
        assert status == 404, raw
        # behind the token, as /v1/ is; Anthropic's x-api-key header is taken too
        for path in ("/tokenize", "/detokenize"):
            status, raw = await call(app, path, {"prompt": "a", "tokens": [1]})
            assert status == 401, raw
            status, raw = await call(app, path, {"prompt": "a", "tokens": [1]}, {"x-api-key": "nope"})
            assert status == 401, raw
        status, raw = await call(app, "/tokenize", {"prompt": "a"}, {"x-api-key": TOKEN})
        assert status == 200, raw

    asyncio.run(run())
