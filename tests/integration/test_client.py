"""Client SDK: request building, results, the error classes, the retry policy (against a real
scripted server) and waiting for a gateway that starts late."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from fastdecode import client as sdk
from fastdecode.client import (
    DEFAULT_GENERATE_TIMEOUT,
    DEFAULT_UNARY_TIMEOUT,
    STATUS_FAMILIES,
    AsyncClient,
    AuthenticationError,
    CancelledError,
    Chunk,
    Client,
    Completion,
    DeadlineExceededError,
    FastDecodeError,
    InternalServerError,
    InvalidRequestError,
    ModelInfo,
    NotFoundError,
    ResourceExhaustedError,
    Tokens,
    UnavailableError,
    Usage,
    _chunk,
    _collect,
    _generate_args,
    _Policy,
)
from fastdecode.protocol import ERROR_TRAILER
from fastdecode.runtime.rpc import MAX_MESSAGE_BYTES
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.tools.fleet import free_port, start_service, stop_processes
from fastdecode.v1 import gateway_pb2 as pb


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", trailers: tuple = ()) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailers


def test_request_sets_only_what_is_given() -> None:
    r, timeout = _generate_args("hi", max_tokens=16, stop="\n", timeout=3.0)
    assert timeout == 3.0
    assert r.WhichOneof("input") == "prompt" and r.prompt == "hi"
    assert list(r.stop) == ["\n"]
    assert r.HasField("max_tokens") and not r.HasField("seed")
    r, _ = _generate_args(None, [1, 2], None, None, None, None, 7, ["a", "b"], [3], ignore_eos=True)
    assert r.WhichOneof("input") == "token_ids" and list(r.token_ids.ids) == [1, 2]
    assert not r.HasField("max_tokens") and not r.HasField("temperature") and r.seed == 7
    assert list(r.stop) == ["a", "b"] and list(r.stop_token_ids) == [3] and r.ignore_eos
    with pytest.raises(ValueError, match="not both"):
        _generate_args("hi", [1])


def test_chunks_and_completion() -> None:
    first = _chunk(pb.GenerateResponse(text="he", token_ids=[1, 2]))
    assert first == Chunk("he", [1, 2])
    last = _chunk(
        pb.GenerateResponse(
            text="llo",
            token_ids=[3],
            finish_reason="stop",
            usage=pb.Usage(prompt_tokens=4, completion_tokens=3),
        )
    )
    assert last.finish_reason == "stop" and last.usage == Usage(4, 3)
    assert _collect([first, last]) == Completion("hello", [1, 2, 3], "stop", Usage(4, 3))
    with pytest.raises(FastDecodeError) as e:
        _collect([first])
    assert e.value.code == grpc.StatusCode.INTERNAL


def test_error_carries_code_and_details() -> None:
    e = FastDecodeError.from_rpc_error(_Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    assert type(e) is ResourceExhaustedError and isinstance(e, FastDecodeError)
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details == "queue full"
    assert str(e) == "RESOURCE_EXHAUSTED: queue full" and not e.from_gateway
    answered = FastDecodeError.from_rpc_error(_Status(grpc.StatusCode.UNAVAILABLE, "draining", ERROR_TRAILER))
    assert type(answered) is UnavailableError and answered.from_gateway
    copy = pickle.loads(pickle.dumps(answered))  # errors cross process pools intact
    assert type(copy) is UnavailableError and (copy.code, copy.details, copy.from_gateway) == (
        grpc.StatusCode.UNAVAILABLE,
        "draining",
        True,
    )


STATUS_TABLE = [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
    (grpc.StatusCode.OUT_OF_RANGE, InvalidRequestError),
    (grpc.StatusCode.FAILED_PRECONDITION, InvalidRequestError),
    (grpc.StatusCode.ALREADY_EXISTS, InvalidRequestError),
    (grpc.StatusCode.UNAUTHENTICATED, AuthenticationError),
    (grpc.StatusCode.PERMISSION_DENIED, AuthenticationError),
    (grpc.StatusCode.NOT_FOUND, NotFoundError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
    (grpc.StatusCode.UNAVAILABLE, UnavailableError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
    (grpc.StatusCode.CANCELLED, CancelledError),
    (grpc.StatusCode.INTERNAL, InternalServerError),
    (grpc.StatusCode.UNKNOWN, InternalServerError),
    (grpc.StatusCode.DATA_LOSS, InternalServerError),
    (grpc.StatusCode.UNIMPLEMENTED, InternalServerError),
    (grpc.StatusCode.ABORTED, InternalServerError),
]


@pytest.mark.parametrize(("code", "cls"), STATUS_TABLE, ids=[c.name for c, _ in STATUS_TABLE])
def test_each_status_code_raises_its_family_class(code: grpc.StatusCode, cls: type[FastDecodeError]) -> None:
    e = FastDecodeError.from_rpc_error(_Status(code, "why"))
    assert type(e) is cls and issubclass(cls, FastDecodeError)
    assert (e.code, e.details) == (code, "why")
    assert code in STATUS_FAMILIES[cls]
    assert cls.__name__ in sdk.__all__


def test_every_error_code_has_a_family() -> None:
    mapped = {code for codes in STATUS_FAMILIES.values() for code in codes}
    assert mapped == set(grpc.StatusCode) - {grpc.StatusCode.OK}
    assert sum(len(codes) for codes in STATUS_FAMILIES.values()) == len(mapped)  # one family per code


def test_backoff_grows_exponentially_with_jitter_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _Policy("t", None, None, None, None, max_retries=9, backoff=0.1, max_backoff=1.0)
    ceiling = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    monkeypatch.setattr(sdk.random, "random", lambda: 1.0)
    assert [round(p.backoff_delay(a), 9) for a in range(6)] == ceiling
    monkeypatch.setattr(sdk.random, "random", lambda: 0.0)  # jitter: down to half the step
    assert [round(p.backoff_delay(a), 9) for a in range(6)] == [c / 2 for c in ceiling]


def test_retry_policy() -> None:
    p = _Policy("t", None, None, None, None, max_retries=2, backoff=0.1, max_backoff=1.0)
    options = dict(p.channel_options())
    assert options["grpc.initial_reconnect_backoff_ms"] == 100
    assert options["grpc.max_reconnect_backoff_ms"] == 1000
    assert options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
    later = time.monotonic() + 60
    lost = error_of(grpc.StatusCode.UNAVAILABLE)
    answered = error_of(grpc.StatusCode.UNAVAILABLE, ERROR_TRAILER)  # e.g. the gateway is draining
    for unavailable in (lost, answered):
        assert 0.05 <= (p.retry_delay(unavailable, 0, later) or 0) <= 0.1
        assert 0.1 <= (p.retry_delay(unavailable, 1, later) or 0) <= 0.2
        assert p.retry_delay(unavailable, 2, later) is None  # retries spent
        # the wait would outlast the deadline
        assert p.retry_delay(unavailable, 0, time.monotonic() + 0.01) is None
    for code in set(grpc.StatusCode) - {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}:
        assert p.retry_delay(error_of(code, ERROR_TRAILER), 0, later) is None, code
        assert p.retry_delay(error_of(code), 0, later) is None, code


def test_unary_retries_are_grpcs_retry_policy() -> None:
    p = _Policy("t", None, None, None, None, max_retries=3, backoff=0.25, max_backoff=2.0)
    options = dict(p.channel_options())
    assert options["grpc.enable_retries"] == 1
    (method,) = json.loads(str(options["grpc.service_config"]))["methodConfig"]
    assert {(n["service"], n["method"]) for n in method["name"]} == {
        ("fastdecode.v1.Gateway", "Tokenize"),
        ("fastdecode.v1.Gateway", "GetModelInfo"),
        ("grpc.health.v1.Health", "Check"),
    }  # not Generate: its retry stays by hand (see _Policy.service_config)
    assert method["retryPolicy"] == {
        "maxAttempts": 4,
        "initialBackoff": "0.250000s",
        "maxBackoff": "2.000000s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    for retries in (0, 5):  # none to do, or more than gRPC's 5 attempts allow: the hand loop
        p = _Policy("t", None, None, None, None, max_retries=retries, backoff=0.25, max_backoff=2.0)
        assert "grpc.service_config" not in dict(p.channel_options())


def test_every_call_has_a_deadline() -> None:
    p = _Policy("t", None, None, None, None, max_retries=0, backoff=0.1, max_backoff=1.0)
    now = time.monotonic()
    assert p.deadline(None, DEFAULT_GENERATE_TIMEOUT) - now == pytest.approx(DEFAULT_GENERATE_TIMEOUT, abs=1)
    assert p.deadline(None, DEFAULT_UNARY_TIMEOUT) - now == pytest.approx(DEFAULT_UNARY_TIMEOUT, abs=1)
    assert p.deadline(5, DEFAULT_UNARY_TIMEOUT) - now == pytest.approx(5, abs=1)  # the call's own wins
    p = _Policy("t", None, None, None, 7, max_retries=0, backoff=0.1, max_backoff=1.0)
    assert p.deadline(None, DEFAULT_GENERATE_TIMEOUT) - now == pytest.approx(7, abs=1)  # then the client's
    assert p.deadline(2, DEFAULT_GENERATE_TIMEOUT) - now == pytest.approx(2, abs=1)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            p.deadline(bad, DEFAULT_UNARY_TIMEOUT)
        with pytest.raises(ValueError, match="timeout"):
            Client("127.0.0.1:1", timeout=bad)


def error_of(code: grpc.StatusCode, trailers: tuple = ()) -> FastDecodeError:
    return FastDecodeError.from_rpc_error(_Status(code, "", trailers))


# ---- retries against a real server -----------------------------------------------------------------
class ScriptedGateway:
    """A real gRPC server on 127.0.0.1 serving fastdecode.v1.Gateway and grpc.health.v1.Health through
    generic handlers. Each call takes the next outcome from `script[method]` (the last one repeats)
    and is counted in `calls`:
      ok           the normal answer (Generate: two chunks, the second with finish_reason)
      unavailable  UNAVAILABLE without the gateway trailer (what a lost connection or a proxy gives)
      draining     UNAVAILABLE with the gateway trailer, as the gateway answers while it drains
      invalid      INVALID_ARGUMENT, exhausted RESOURCE_EXHAUSTED (both with the trailer)
      chunk-then-unavailable  (Generate) one chunk, then the gateway's UNAVAILABLE
      not-serving, unknown-service  (Health) NOT_SERVING, NOT_FOUND"""

    FAILURES = {
        "unavailable": (grpc.StatusCode.UNAVAILABLE, ()),
        "draining": (grpc.StatusCode.UNAVAILABLE, ERROR_TRAILER),
        "invalid": (grpc.StatusCode.INVALID_ARGUMENT, ERROR_TRAILER),
        "exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, ERROR_TRAILER),
        "unknown-service": (grpc.StatusCode.NOT_FOUND, ()),
    }

    def __init__(self) -> None:
        self.script: dict[str, list[str]] = {}
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(4))
        unary = grpc.unary_unary_rpc_method_handler
        gateway = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
            "Tokenize": unary(
                self._tokenize,
                request_deserializer=pb.TokenizeRequest.FromString,
                response_serializer=pb.TokenizeResponse.SerializeToString,
            ),
            "GetModelInfo": unary(
                self._model_info,
                request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.GetModelInfoResponse.SerializeToString,
            ),
        }
        health = {
            "Check": unary(
                self._check,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            )
        }
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler("fastdecode.v1.Gateway", gateway),
                grpc.method_handlers_generic_handler("grpc.health.v1.Health", health),
            )
        )
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _next(self, method: str, context: grpc.ServicerContext) -> str:
        with self._lock:
            self.calls[method] += 1
            script = self.script.get(method) or ["ok"]
            outcome = script.pop(0) if len(script) > 1 else script[0]
        if outcome in self.FAILURES:
            self._fail(context, outcome)
        return outcome

    def _fail(self, context: grpc.ServicerContext, outcome: str) -> None:
        code, trailers = self.FAILURES[outcome]
        context.set_trailing_metadata(trailers)
        context.abort(code, outcome)

    def _generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        outcome = self._next("Generate", context)
        yield pb.GenerateResponse(text="a", token_ids=[1])
        if outcome == "chunk-then-unavailable":
            self._fail(context, "draining")
        usage = pb.Usage(prompt_tokens=1, completion_tokens=2)
        yield pb.GenerateResponse(text="b", token_ids=[2], finish_reason="length", usage=usage)

    def _tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        self._next("Tokenize", context)
        return pb.TokenizeResponse(token_ids=[len(request.text)], tokens=[request.text])

    def _model_info(
        self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetModelInfoResponse:
        self._next("GetModelInfo", context)
        return pb.GetModelInfoResponse(model_name="scripted", vocab_size=7, num_shards=1)

    def _check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        outcome = self._next("Check", context)
        serving = outcome != "not-serving"
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )


@pytest.fixture
def scripted() -> Iterator[ScriptedGateway]:
    gw = ScriptedGateway()
    yield gw
    gw.server.stop(0)


def call(kind: str, target: str, op: str, **client_args: Any) -> Any:
    """Run one SDK operation through Client ("sync") or AsyncClient ("async"), with fast backoff."""
    args: dict[str, Any] = {
        "max_retries": 3,
        "backoff": 0.01,
        "max_backoff": 0.05,
        "timeout": 10,
    } | client_args
    if kind == "sync":
        with Client(target, **args) as c:
            return {
                "model_info": c.model_info,
                "tokenize": lambda: c.tokenize("four"),
                "health": c.health,
                "generate": lambda: c.generate("hi"),
                "stream": lambda: [chunk for chunk in c.stream("hi")],
            }[op]()

    async def run() -> Any:
        async with AsyncClient(target, **args) as ac:
            if op == "stream":
                return [chunk async for chunk in ac.stream("hi")]
            return await {
                "model_info": ac.model_info,
                "tokenize": lambda: ac.tokenize("four"),
                "health": ac.health,
                "generate": lambda: ac.generate("hi"),
            }[op]()

    return asyncio.run(run())


METHOD = {"model_info": "GetModelInfo", "tokenize": "Tokenize", "health": "Check", "generate": "Generate"}
UNARY_RESULT = {
    "model_info": ModelInfo("", "scripted", 7, 0, [], 1, ""),
    "tokenize": Tokens([4], ["four"]),
    "health": True,
}
KINDS = ["sync", "async"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["model_info", "tokenize", "health"])
def test_unary_calls_retry_any_unavailable_from_a_real_server(
    scripted: ScriptedGateway, kind: str, op: str
) -> None:
    scripted.script[METHOD[op]] = ["unavailable", "draining", "ok"]
    assert call(kind, scripted.target, op) == UNARY_RESULT[op]
    # two UNAVAILABLEs (transport-like and gateway-answered), then the answer
    assert scripted.calls[METHOD[op]] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_unary_retries_stop_after_max_retries(scripted: ScriptedGateway, kind: str) -> None:
    scripted.script["GetModelInfo"] = ["draining"]
    with pytest.raises(UnavailableError) as e:
        call(kind, scripted.target, "model_info", max_retries=2)
    assert e.value.from_gateway and e.value.details == "draining"
    assert scripted.calls["GetModelInfo"] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_retries_stop_at_the_deadline(scripted: ScriptedGateway, kind: str) -> None:
    scripted.script["Tokenize"] = ["unavailable"]
    t0 = time.monotonic()
    with pytest.raises((UnavailableError, DeadlineExceededError)):
        call(kind, scripted.target, "tokenize", max_retries=1000, backoff=0.05, max_backoff=0.05, timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    assert 3 <= scripted.calls["Tokenize"] < 25  # waits of 25..50 ms fill the 0.5 s, then it gives up


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("outcome", "error"), [("invalid", InvalidRequestError), ("exhausted", ResourceExhaustedError)]
)
@pytest.mark.parametrize("op", ["model_info", "generate"])
def test_other_codes_are_not_retried(
    scripted: ScriptedGateway, kind: str, outcome: str, error: type[FastDecodeError], op: str
) -> None:
    scripted.script[METHOD[op]] = [outcome, "ok"]
    with pytest.raises(error):
        call(kind, scripted.target, op)
    assert scripted.calls[METHOD[op]] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_generate_retries_unavailable_before_the_first_chunk(scripted: ScriptedGateway, kind: str) -> None:
    scripted.script["Generate"] = ["draining", "unavailable", "ok"]
    assert call(kind, scripted.target, "generate") == Completion("ab", [1, 2], "length", Usage(1, 2))
    assert scripted.calls["Generate"] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_generate_is_never_retried_after_the_first_chunk(scripted: ScriptedGateway, kind: str) -> None:
    scripted.script["Generate"] = ["chunk-then-unavailable", "ok"]
    with pytest.raises(UnavailableError) as e:
        call(kind, scripted.target, "stream")
    assert e.value.from_gateway
    assert scripted.calls["Generate"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_health_reports_serving_status(scripted: ScriptedGateway, kind: str) -> None:
    scripted.script["Check"] = ["not-serving"]
    assert call(kind, scripted.target, "health") is False
    scripted.script["Check"] = ["unknown-service"]
    with pytest.raises(NotFoundError):
        call(kind, scripted.target, "health")


def test_token_stays_out_of_reprs() -> None:
    with Client("127.0.0.1:1", "s3cr3t-value") as c:
        assert "s3cr3t" not in repr(c)

    async def async_repr() -> str:  # grpc.aio channels belong to a running event loop
        async with AsyncClient("127.0.0.1:1", "s3cr3t-value") as ac:
            return repr(ac)

    assert "s3cr3t" not in asyncio.run(async_repr())


def test_calls_wait_for_a_gateway_that_starts_late(llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    result: dict[str, object] = {}

    def wait_and_tokenize() -> None:
        with Client(f"127.0.0.1:{port}", "tok", timeout=60) as c:
            try:
                result["tokens"] = c.tokenize("hello world")
            except FastDecodeError as e:
                result["error"] = e

    t = threading.Thread(target=wait_and_tokenize)
    t.start()
    time.sleep(1.0)  # the call is waiting for a connection by now
    proc = start_service(
        "gateway",
        ["gateway", "--scheduler", f"127.0.0.1:{free_port()}", "--model", str(llama_dir)],
        tmp_path,
        port=port,
        env={"FASTDECODE_AUTH_TOKEN": "tok", "FASTDECODE_CONNECT_TIMEOUT": "0.2"},
        timeout=60,
    )
    try:
        t.join(timeout=60)
        assert "error" not in result, result
        assert result["tokens"].token_ids == Tokenizer.from_pretrained(llama_dir).encode("hello world")  # type: ignore[attr-defined]

        async def async_calls() -> None:
            async with AsyncClient(proc.address, "tok", timeout=10) as ac:
                assert (await ac.tokenize("hello world")).token_ids == result["tokens"].token_ids  # type: ignore[attr-defined]
                with pytest.raises(InvalidRequestError) as e:
                    await ac.generate("hello", max_tokens=0)
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(InvalidRequestError) as e:
                    async for _ in ac.stream(token_ids=[1 << 30]):
                        pass
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT

        asyncio.run(async_calls())
        with Client(proc.address, "wrong", timeout=10) as c, pytest.raises(AuthenticationError) as e:
            c.generate("hello")
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and e.value.from_gateway
        # The gateway's own UNAVAILABLE (no scheduler behind it) is refused before any work: it is
        # retried max_retries times within the deadline, then surfaces as that answer.
        with Client(proc.address, "tok", timeout=30, max_retries=0) as c:
            t0 = time.monotonic()
            with pytest.raises(UnavailableError) as e:
                c.generate("hello", max_tokens=2)
            assert e.value.from_gateway and time.monotonic() - t0 < 5
        with Client(proc.address, "tok", timeout=30, max_retries=2, backoff=0.05, max_backoff=0.1) as c:
            t0 = time.monotonic()
            with pytest.raises(UnavailableError) as e:
                c.generate("hello", max_tokens=2)
            assert e.value.from_gateway and time.monotonic() - t0 < 10
            stream = c.stream("hello")
            stream.cancel()
            assert list(stream) == []
    finally:
        stop_processes([proc], grace=10)
