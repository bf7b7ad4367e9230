"""/v1/responses' routes in process (the ASGI app, no socket) over the scheduler fake: the store's
GET, DELETE and cancel, previous_response_id, tenant isolation, and OpenAI's error shape. The running
API through the `openai` package is tests/e2e/test_openai_responses.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastdecode.gateway.auth import Tenants
from fastdecode.gateway.core import GatewayCore, UpstreamEvent
from fastdecode.model import ModelConfig
from fastdecode.runtime.settings import GatewaySettings
from fastdecode.runtime.tokenizer import Tokenizer
from services.gateway.http_server import _Front
from services.gateway.openai_api import OpenAIApp
from tests.support.fakes import FakeScheduler

KEYS = {"alpha": "alpha-key-123", "beta": "beta-key-4567"}


def _app(llama_dir: Path, tmp_path: Path, link: FakeScheduler, store: int = 4) -> tuple[Any, GatewayCore]:
    core = GatewayCore(
        GatewaySettings(scheduler="fake:1", model=llama_dir, http_port=0, responses_store=store),
        Tokenizer.from_pretrained(llama_dir),
        ModelConfig.from_pretrained(llama_dir),
        link,
    )
    core.ready = True
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    return _Front(OpenAIApp(core, core.settings).app, core, Tenants(keys_file=keys), 1 << 20), core


async def call(
    app: Any, method: str, path: str, body: dict | None = None, tenant: str = "alpha"
) -> tuple[int, bytes]:
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [
        (b"authorization", f"Bearer {KEYS[tenant]}".encode()),
        (b"content-length", str(len(raw)).encode()),
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
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


def _words(rid: str, req: object) -> list[UpstreamEvent]:
    return [UpstreamEvent([5]), UpstreamEvent([6]), UpstreamEvent([7], "stop")]


def test_stored_responses_get_delete_and_chain(llama_dir: Path, tmp_path: Path) -> None:
    link = FakeScheduler(_words)
    app, core = _app(llama_dir, tmp_path, link)

    async def main() -> None:
        status, raw = await call(app, "POST", "/v1/responses", {"input": "Hi", "instructions": "Be brief."})
        assert status == 200, raw
        first = json.loads(raw)
        assert (
            first["store"] is True and first["status"] == "completed" and first["usage"]["output_tokens"] == 3
        )
        status, raw = await call(app, "GET", f"/v1/responses/{first['id']}")
        assert status == 200 and json.loads(raw) == first
        # another tenant: not found, in OpenAI's shape
        status, raw = await call(app, "GET", f"/v1/responses/{first['id']}", tenant="beta")
        assert status == 404 and json.loads(raw)["error"]["type"] == "invalid_request_error"
        status, raw = await call(
            app, "POST", "/v1/responses", {"input": "x", "previous_response_id": first["id"]}, "beta"
        )
        error = json.loads(raw)["error"]
        assert status == 404 and error["param"] == "previous_response_id"
        assert error["code"] == "previous_response_not_found"
        # the chain: the earlier input and output lead this turn's prompt (its instructions do not)
        status, raw = await call(
            app, "POST", "/v1/responses", {"input": "More", "previous_response_id": first["id"]}
        )
        assert status == 200, raw
        prompt = core.tokenizer.decode(link.submitted[-1][1].prompt_ids)
        text = first["output"][0]["content"][0]["text"]
        assert "Be brief." not in prompt and prompt.index("Hi") < prompt.index(text) < prompt.index("More")
        status, raw = await call(app, "DELETE", f"/v1/responses/{first['id']}")
        assert status == 200 and json.loads(raw)["deleted"] is True
        assert (await call(app, "GET", f"/v1/responses/{first['id']}"))[0] == 404
        # store: false is not kept
        status, raw = await call(app, "POST", "/v1/responses", {"input": "Hi", "store": False})
        assert json.loads(raw)["store"] is False
        assert (await call(app, "GET", f"/v1/responses/{json.loads(raw)['id']}"))[0] == 404
        # a completed response cannot be cancelled
        status, raw = await call(app, "POST", "/v1/responses", {"input": "Hi"})
        status, raw = await call(app, "POST", f"/v1/responses/{json.loads(raw)['id']}/cancel")
        assert status == 400 and "completed" in json.loads(raw)["error"]["message"]

    asyncio.run(main())


def test_cancel_stops_a_running_stream(llama_dir: Path, tmp_path: Path) -> None:
    class Forever(FakeScheduler):
        async def submit(self, request_id, request, timeout, sample_offset=0):  # type: ignore[override]
            while True:
                await asyncio.sleep(0.005)
                yield UpstreamEvent([5])

    app, core = _app(llama_dir, tmp_path, Forever())

    async def main() -> None:
        stream = asyncio.create_task(call(app, "POST", "/v1/responses", {"input": "Hi", "stream": True}))
        while not core.inflight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        (held,) = [s for s in _store(app)._tenants["alpha"].values()]
        rid = held.response["id"]
        assert (await call(app, "GET", f"/v1/responses/{rid}"))[0] == 200
        assert (await call(app, "POST", f"/v1/responses/{rid}/cancel", tenant="beta"))[0] == 404
        status, raw = await call(app, "POST", "/v1/responses", {"input": "x", "previous_response_id": rid})
        assert status == 400 and json.loads(raw)["error"]["param"] == "previous_response_id"
        status, raw = await call(app, "POST", f"/v1/responses/{rid}/cancel")
        assert status == 200, raw
        cancelled = json.loads(raw)
        assert cancelled["status"] == "cancelled" and cancelled["output"][0]["content"][0]["text"]
        status, raw = await asyncio.wait_for(stream, 10)
        events = [json.loads(b.split(b"\ndata: ")[1]) for b in raw.split(b"\n\n") if b]
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["status"] == "cancelled"
        assert core.inflight == 0

    asyncio.run(main())


def _store(app: Any) -> Any:
    for route in app.app.router.routes:
        owner = getattr(getattr(route, "endpoint", None), "__self__", None)
        if owner is not None and hasattr(owner, "store"):
            return owner.store
    raise AssertionError("no store")


def test_store_off_and_bad_input(llama_dir: Path, tmp_path: Path) -> None:
    app, core = _app(llama_dir, tmp_path, FakeScheduler(_words), store=0)

    async def main() -> None:
        # store defaults to true, as OpenAI's: with the store off it is false, silently
        status, raw = await call(app, "POST", "/v1/responses", {"input": "Hi"})
        first = json.loads(raw)
        assert status == 200 and first["store"] is False
        status, raw = await call(app, "GET", f"/v1/responses/{first['id']}")
        assert status == 404 and "--responses-store" in json.loads(raw)["error"]["message"]
        status, raw = await call(
            app, "POST", "/v1/responses", {"input": "x", "previous_response_id": first["id"]}
        )
        assert status == 404 and json.loads(raw)["error"]["param"] == "previous_response_id"
        for body, param in [
            ({"input": [{"type": "computer_call"}]}, "input[0]"),
            ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
            ({"input": "x", "model": "other"}, "model"),
        ]:
            status, raw = await call(app, "POST", "/v1/responses", body)
            error = json.loads(raw)["error"]
            assert status in (400, 404) and error["param"] == param, (status, error)
        status, raw = await call(app, "POST", "/v1/responses", {"input": "x", "max_output_tokens": 10**7})
        assert status == 400, raw
        long = core.limits.max_context * "hello "  # more tokens than the context holds
        status, raw = await call(app, "POST", "/v1/responses", {"input": long, "stream": True})
        assert status == 400 and "context" in json.loads(raw)["error"]["message"], raw

    asyncio.run(main())


def test_the_drains_cut_off_ends_a_stream_with_an_error_event(llama_dir: Path, tmp_path: Path) -> None:
    class Forever(FakeScheduler):
        async def submit(self, request_id, request, timeout, sample_offset=0):  # type: ignore[override]
            while True:
                await asyncio.sleep(0.005)
                yield UpstreamEvent([5])

    app, core = _app(llama_dir, tmp_path, Forever(), store=0)

    async def main() -> None:
        stream = asyncio.create_task(call(app, "POST", "/v1/responses", {"input": "Hi", "stream": True}))
        while not core.inflight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        core.cut_off()
        status, raw = await asyncio.wait_for(stream, 10)  # ends normally: a planned stop
        assert status == 200
        events = [json.loads(b.split(b"\ndata: ")[1]) for b in raw.split(b"\n\n") if b]
        assert events[-1]["type"] == "error" and events[-1]["code"] == "unavailable"
        assert "draining" in events[-1]["message"] and core.inflight == 0

    asyncio.run(main())
