"""The gateway's adapter parts without a server: request parsing, proto conversion, bearer auth; and
GatewayCore against an in-process scheduler fake."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import grpc
import pytest

from fastdecode.gateway.auth import Tenants
from fastdecode.gateway.core import GatewayCore, GenerationChunk, SchedulerLost, UpstreamEvent
from fastdecode.gateway.text import GenerateParams
from fastdecode.model import ModelConfig
from fastdecode.runtime.errors import InvalidInput, ServiceError, Status, Unavailable
from fastdecode.runtime.settings import GatewaySettings
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.v1 import gateway_pb2 as pb
from fastdecode.wire.gateway import params_from_proto
from services.gateway.http_server import _Front
from services.gateway.openai_api import OpenAIApp
from services.gateway.server import BadRequest, BearerAuthInterceptor, GatewayServicer, _parser
from tests.support.fakes import FakeScheduler

TOKEN = "t0ps3cret-token"
BAD_UTF8_PROMPT = b"\x0a\x02\xff\xfe"  # field 1 (prompt), 2 bytes that are not UTF-8


def test_parser_turns_bad_utf8_into_bad_request() -> None:
    parsed = _parser(pb.GenerateRequest)(BAD_UTF8_PROMPT)
    assert isinstance(parsed, BadRequest)
    assert "fastdecode.v1.GenerateRequest" in parsed.message and "UTF-8" in parsed.message
    ok = _parser(pb.GenerateRequest)(pb.GenerateRequest(prompt="hé").SerializeToString())
    assert isinstance(ok, pb.GenerateRequest) and ok.prompt == "hé"


def test_params_from_proto_keeps_unset_fields_unset() -> None:
    p = params_from_proto(pb.GenerateRequest(prompt="x"))
    assert (p.prompt, p.token_ids, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (
        "x",
        None,
        None,
        None,
        None,
        None,
        None,
    )
    r = pb.GenerateRequest(max_tokens=0, temperature=0.0, top_p=0.0, top_k=0, seed=0, stop=["a"])
    r.token_ids.ids.extend([3, 4])
    p = params_from_proto(r)
    assert (p.prompt, p.token_ids, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (
        None,
        [3, 4],
        0,
        0.0,
        0.0,
        0,
        0,
    )
    assert p.stop == ["a"]
    assert (p.logit_bias, p.min_p, p.allowed_token_ids, p.bad_words) == (None, None, None, [])


def test_logit_processors_cross_every_hop() -> None:
    """The SDK's request -> GenerateParams -> the scheduler's and gpu_dense's SamplingParams."""
    from fastdecode.client import _generate_args
    from fastdecode.contract import SamplingParams
    from fastdecode.wire.dense import sampling_from_proto, sampling_to_proto

    req, _ = _generate_args(
        "x", logit_bias={5: -100.0, 9: 2.5}, min_p=0.1, allowed_token_ids=[5, 9, 11], bad_words=["no way"]
    )
    p = params_from_proto(req)
    assert p.logit_bias == {5: -100.0, 9: 2.5} and p.min_p == pytest.approx(0.1)
    assert (p.allowed_token_ids, p.bad_words) == ([5, 9, 11], ["no way"])
    s = SamplingParams(
        logit_bias=((5, -100.0), (9, 2.5)), min_p=0.25, allowed_token_ids=(5, 9), bad_words=((1, 2), (3,))
    )
    assert sampling_from_proto(sampling_to_proto(s)) == s


@pytest.mark.parametrize(
    ("metadata", "ok"),
    [
        ((("authorization", f"Bearer {TOKEN}"),), True),
        ((("authorization", f"bearer  {TOKEN} "),), True),
        ((("x-other", "1"), ("authorization", f"Bearer {TOKEN}")), True),
        ((), False),
        (None, False),
        ((("authorization", TOKEN),), False),
        ((("authorization", f"Basic {TOKEN}"),), False),
        ((("authorization", f"Bearer {TOKEN}x"),), False),
        ((("authorization", "Bearer "),), False),
    ],
)
def test_bearer_auth(metadata: tuple[tuple[str, str], ...] | None, ok: bool) -> None:
    interceptor = BearerAuthInterceptor(Tenants(TOKEN.encode()))
    assert interceptor.authorized(metadata) is ok
    assert TOKEN not in repr(interceptor)


# ---- GatewayCore against a scheduler fake ------------------------------------------------------------
def make_core(llama_dir: Path, link: FakeScheduler, **settings: object) -> tuple[GatewayCore, list]:
    answered: list[tuple[Status, str]] = []
    core = GatewayCore(
        GatewaySettings(scheduler="fake:1", model=llama_dir, **settings),
        Tokenizer.from_pretrained(llama_dir),
        ModelConfig.from_pretrained(llama_dir),
        link,
    )
    core.metrics.answered = lambda status, api: answered.append((status, api))  # type: ignore[method-assign]
    return core, answered


async def _run(core: GatewayCore, params: GenerateParams, rid: str = "r1") -> list[GenerationChunk]:
    async with contextlib.aclosing(core.generate(params, rid, None, "grpc")) as chunks:
        return [c async for c in chunks]


def test_generate_relays_tokens_as_text_with_usage(llama_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(llama_dir)
    ids = tok.encode("hello world, again")
    link = FakeScheduler(
        lambda rid, req: [UpstreamEvent([t]) for t in ids[:-1]] + [UpstreamEvent([ids[-1]], "length")]
    )
    core, answered = make_core(llama_dir, link)
    chunks = asyncio.run(_run(core, GenerateParams(token_ids=[5, 6, 7], max_tokens=len(ids))))
    assert "".join(c.text for c in chunks) == tok.decode(ids)
    last = chunks[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 3, len(ids))
    ((rid, sent),) = link.submitted
    assert rid == "r1" and sent.prompt_ids == [5, 6, 7] and sent.max_tokens == len(ids)
    assert answered == [(Status.OK, "grpc")] and core.inflight == 0


def test_generate_refuses_while_draining_and_over_the_limit(llama_dir: Path) -> None:
    core, answered = make_core(llama_dir, FakeScheduler(), max_concurrent_requests=1)
    core.draining = True
    with pytest.raises(Unavailable, match="draining"):
        asyncio.run(_run(core, GenerateParams(token_ids=[5])))
    core.draining, core.inflight = False, 1
    with pytest.raises(ServiceError) as e:
        asyncio.run(_run(core, GenerateParams(token_ids=[5])))
    assert e.value.status is Status.RESOURCE_EXHAUSTED
    assert answered == [(Status.UNAVAILABLE, "grpc"), (Status.RESOURCE_EXHAUSTED, "grpc")]


def test_generate_validates_before_calling_the_scheduler(llama_dir: Path) -> None:
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link)
    with pytest.raises(InvalidInput, match="temperature"):
        asyncio.run(_run(core, GenerateParams(token_ids=[5], temperature=float("nan"))))
    assert link.submitted == []


def test_upstream_errors_keep_their_status_and_an_early_close_cancels_upstream(llama_dir: Path) -> None:
    link = FakeScheduler(
        lambda rid, req: [UpstreamEvent([5]), ServiceError("queue full", Status.RESOURCE_EXHAUSTED)]
    )
    core, answered = make_core(llama_dir, link)
    with pytest.raises(ServiceError) as e:
        asyncio.run(_run(core, GenerateParams(token_ids=[5], ignore_eos=True)))
    assert (e.value.status, e.value.message) == (Status.RESOURCE_EXHAUSTED, "queue full")

    link.script = lambda rid, req: [UpstreamEvent([5]), UpstreamEvent([6]), UpstreamEvent([7], "length")]

    async def first_only() -> None:
        async with contextlib.aclosing(
            core.generate(GenerateParams(token_ids=[5], ignore_eos=True), "r2", None, "http")
        ) as chunks:
            async for _ in chunks:
                break

    asyncio.run(first_only())
    assert link.cancelled == ["r2"]
    assert answered[-1] == (Status.CANCELLED, "http")


def test_an_unreachable_scheduler_is_unavailable(llama_dir: Path) -> None:
    core, _ = make_core(llama_dir, FakeScheduler(down=True), connect_timeout=0.01)
    with pytest.raises(Unavailable, match="not reachable"):
        asyncio.run(_run(core, GenerateParams(token_ids=[5])))


# ---- a scheduler lost mid-request: resubmitted from the tokens so far ----------------------------------
def _model(prompt: list[int], n: int) -> list[int]:
    """A deterministic 'greedy model' over the whole history, as a scheduler would continue it."""
    out, hist = [], list(prompt)
    for _ in range(n):
        t = 3 + sum((i + 1) * x for i, x in enumerate(hist)) % 50
        out.append(t)
        hist.append(t)
    return out


def _flaky_scheduler(loses_after: list[int]) -> FakeScheduler:
    """A scheduler that continues any history with `_model`, and is lost (the connection fails)
    after loses_after[k] tokens of its k-th submission."""

    def script(rid: str, req: object) -> list:
        k = len(link.submitted) - 1
        toks = _model(req.prompt_ids, req.max_tokens)  # type: ignore[attr-defined]
        events: list = [UpstreamEvent([t]) for t in toks[:-1]] + [UpstreamEvent([toks[-1]], "length")]
        if k < len(loses_after):
            return [*events[: loses_after[k]], SchedulerLost("scheduler lost: Socket closed")]
        return events

    link = FakeScheduler(script)
    return link


def test_a_lost_scheduler_costs_time_not_the_request(llama_dir: Path) -> None:
    link = _flaky_scheduler([3, 0, 4])  # lost after 3 tokens, refused once while coming back, then 4
    core, answered = make_core(llama_dir, link)
    prompt = [5, 6, 7]
    chunks = asyncio.run(_run(core, GenerateParams(token_ids=prompt, max_tokens=12, ignore_eos=True)))
    assert [t for c in chunks for t in c.token_ids] == _model(prompt, 12)  # as if nothing happened
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 12
    assert chunks[-1].prompt_tokens == 3  # usage counts the client's prompt, not the resubmitted one
    # Each resubmission: prompt + tokens so far, the rest of max_tokens, the next sample index.
    assert [(len(r.prompt_ids), r.max_tokens) for _, r in link.submitted] == [
        (3, 12),
        (6, 9),
        (6, 9),
        (10, 5),
    ]
    assert link.offsets == [0, 3, 3, 7]
    assert link.submitted[3][1].prompt_ids == prompt + _model(prompt, 7)
    assert {rid for rid, _ in link.submitted} == {"r1"}
    assert answered == [(Status.OK, "grpc")]


def test_a_live_schedulers_refusal_is_answered_at_once(llama_dir: Path) -> None:
    link = FakeScheduler(lambda rid, req: [Unavailable("scheduler is draining")])
    core, _ = make_core(llama_dir, link)
    with pytest.raises(Unavailable, match="draining"):
        asyncio.run(_run(core, GenerateParams(token_ids=[5], max_tokens=4)))
    assert len(link.submitted) == 1  # not resubmitted


def test_a_scheduler_that_stays_lost_fails_after_the_recovery_timeout(llama_dir: Path) -> None:
    link = _flaky_scheduler([2] + [0] * 1000)
    core, _ = make_core(llama_dir, link, scheduler_recovery_timeout=0.3)
    with pytest.raises(Unavailable, match="scheduler lost"):
        asyncio.run(_run(core, GenerateParams(token_ids=[5], max_tokens=8, ignore_eos=True)))
    assert 2 <= len(link.submitted) < 50  # it kept trying, with backoff, then gave up


def test_readiness_tells_why_the_fleet_cannot_generate(llama_dir: Path) -> None:
    link = FakeScheduler()
    core, _ = make_core(llama_dir, link)
    assert asyncio.run(core.check_readiness()) == "gateway is starting"
    core.ready = True
    assert asyncio.run(core.check_readiness()) is None
    link.down = True
    assert asyncio.run(core.check_readiness()) == "scheduler fake:0 not reachable"
    assert core.not_ready_reason() == "scheduler fake:0 not reachable"  # what /health answers
    link.down = False
    assert asyncio.run(core.check_readiness()) is None
    core.draining = True
    assert asyncio.run(core.check_readiness()) == "gateway is draining"


def test_cut_off_ends_running_generations_with_unavailable(llama_dir: Path) -> None:
    """After the drain's grace period, what still runs ends with UNAVAILABLE (retry), not CANCELLED."""

    class Stuck(FakeScheduler):
        async def submit(self, request_id, request, timeout, sample_offset=0):  # type: ignore[override]
            self.submitted.append((request_id, request))
            yield UpstreamEvent([5])
            await asyncio.Event().wait()  # never finishes on its own

    core, answered = make_core(llama_dir, Stuck())

    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async with contextlib.aclosing(
                core.generate(
                    GenerateParams(token_ids=[5], max_tokens=50, ignore_eos=True), "r1", None, "grpc"
                )
            ) as chunks:
                async for _ in chunks:
                    first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        core.cut_off()
        with pytest.raises(Unavailable, match="draining"):
            await task

    asyncio.run(main())
    assert answered == [(Status.UNAVAILABLE, "grpc")]
    assert core.inflight == 0


def test_cut_off_while_the_servicer_writes_still_ends_with_unavailable(llama_dir: Path) -> None:
    """The drain's cancel can land in the servicer's write to a slow client instead of in the
    producer: the call must still end UNAVAILABLE "draining" (retry), not be cancelled (a client then
    saw the server's "Cancelling all calls" once the stop's tail ran out)."""

    class Forever(FakeScheduler):
        async def submit(self, request_id, request, timeout, sample_offset=0):  # type: ignore[override]
            for _ in range(1000):
                yield UpstreamEvent([5])

    class SlowClientContext:
        def __init__(self) -> None:
            self.writes, self.aborted = 0, None
            self.blocked = asyncio.Event()

        def invocation_metadata(self) -> tuple:
            return ()

        def time_remaining(self) -> None:
            return None

        async def send_initial_metadata(self, metadata: object) -> None:
            pass

        async def write(self, message: object) -> None:
            self.writes += 1
            if self.writes > 1:  # the client stops reading: flow control holds the write
                self.blocked.set()
                await asyncio.Event().wait()

        async def abort(self, code: grpc.StatusCode, details: str, trailers: object = ()) -> None:
            self.aborted = (code, details)
            raise grpc.aio.AbortError()

    core, answered = make_core(llama_dir, Forever())
    context = SlowClientContext()

    async def main() -> None:
        call = asyncio.create_task(GatewayServicer(core).Generate(pb.GenerateRequest(prompt="hi"), context))
        await context.blocked.wait()
        core.cut_off()
        with pytest.raises(grpc.aio.AbortError):
            await call

    asyncio.run(main())
    assert context.aborted is not None
    assert context.aborted[0] == grpc.StatusCode.UNAVAILABLE and "draining" in context.aborted[1]
    assert answered == [(Status.UNAVAILABLE, "grpc")]
    assert core.inflight == 0


def test_cut_off_ends_an_http_stream_with_an_error_event_then_done(llama_dir: Path) -> None:
    """The same cut-off on the OpenAI HTTP port, after the 200 went out: the SSE stream ends with an
    error event (service unavailable: retry) and then [DONE], not silently mid-stream, and the
    request's task ends without an error (uvicorn would log a traceback and drop the connection)."""

    class Forever(FakeScheduler):
        async def submit(self, request_id, request, timeout, sample_offset=0):  # type: ignore[override]
            while True:
                await asyncio.sleep(0.005)
                yield UpstreamEvent([5])

    core, answered = make_core(llama_dir, Forever(), http_port=0)
    core.ready = True
    app = _Front(OpenAIApp(core, core.settings).app, core, Tenants(), 1 << 20)
    body = json.dumps({"model": core.model_id, "prompt": [5], "max_tokens": 500, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # what uvicorn gives
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {"request_id": "r1"},
    }
    sent: list[dict] = []

    async def main() -> None:
        requests = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await asyncio.Event().wait()  # the client stays connected
            raise AssertionError

        async def send(message: dict) -> None:
            sent.append(message)

        call = asyncio.create_task(app(scope, receive, send))
        while sum(m["type"] == "http.response.body" for m in sent) < 3:
            await asyncio.sleep(0.01)
        core.cut_off()
        await asyncio.wait_for(call, 10)  # ends normally: a planned stop, not an ASGI exception

    asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    events = b"".join(m.get("body", b"") for m in sent[1:]).split(b"\n\n")
    events = [e for e in events if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "service_unavailable_error" and "draining" in error["message"]
    assert answered == [(Status.UNAVAILABLE, "http")]


def _post(app: object, path: str, body: dict) -> tuple[int, bytes]:
    """One POST through the ASGI app (no socket): (status, body bytes)."""
    return asyncio.run(post(app, path, body))


async def post(app: object, path: str, body: dict) -> tuple[int, bytes]:
    """_post on the running loop (for a core whose workers live on one loop)."""
    raw = json.dumps(body).encode()
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
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {"request_id": "r1"},
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

    await app(scope, receive, send)  # type: ignore[operator]
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_n_choices_logprobs_and_usage_over_http(llama_dir: Path) -> None:
    """n choices are n sequences, each with its own seed (seed + index); usage counts the prompt once;
    streamed, every chunk names its choice; logprobs come in OpenAI's completions shape."""
    link = FakeScheduler()
    seen: list[tuple[str, int | None]] = []

    def script(rid: str, req: object) -> list:
        seen.append((rid, req.seed))  # type: ignore[attr-defined]
        return [
            UpstreamEvent([5], logprobs=[-0.5], top=[((5, -0.5), (6, -1.5))]),
            UpstreamEvent([6], "length", [-0.25], [((6, -0.25), (5, -2.0))]),
        ]

    link.script = script
    core, _ = make_core(llama_dir, link, http_port=0)
    core.ready = True
    app = _Front(OpenAIApp(core, core.settings).app, core, Tenants(), 1 << 20)
    body = {"model": core.model_id, "prompt": [5, 7, 9], "max_tokens": 2, "n": 3, "seed": 10, "logprobs": 2}
    status, raw = _post(app, "/v1/completions", body)
    assert status == 200, raw
    out = json.loads(raw)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert sorted(seed for _, seed in seen) == [10, 11, 12] and len({rid for rid, _ in seen}) == 3
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0, "choices_cached_tokens": [0, 0, 0]},
    }
    lp = out["choices"][1]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -0.25] and len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"][0] == 0
    status, raw = _post(
        app, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert sorted({c["index"] for e in events for c in e["choices"]}) == [0, 1, 2]
    assert events[-1]["usage"]["completion_tokens"] == 6
