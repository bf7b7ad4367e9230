"""Client SDK: request building, results, errors and retries; waiting for a gateway that starts late."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest

from fastdecode.client import (
    AsyncClient,
    Chunk,
    Client,
    Completion,
    FastDecodeError,
    Usage,
    _chunk,
    _collect,
    _Policy,
    _request,
)
from fastdecode.fleet import free_port, start_service, stop_processes
from fastdecode.rpc import MAX_MESSAGE_BYTES
from fastdecode.tokenizer import Tokenizer
from fastdecode.v1 import gateway_pb2 as pb
from services.gateway.server import ERROR_TRAILER


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
    r = _request("hi", None, 16, 0.0, 1.0, 0, None, "\n", None, False)
    assert r.WhichOneof("input") == "prompt" and r.prompt == "hi"
    assert list(r.stop) == ["\n"]
    assert r.HasField("max_tokens") and not r.HasField("seed")
    r = _request(None, [1, 2], None, None, None, None, 7, ["a", "b"], [3], True)
    assert r.WhichOneof("input") == "token_ids" and list(r.token_ids.ids) == [1, 2]
    assert not r.HasField("max_tokens") and not r.HasField("temperature") and r.seed == 7
    assert list(r.stop) == ["a", "b"] and list(r.stop_token_ids) == [3] and r.ignore_eos
    with pytest.raises(ValueError, match="not both"):
        _request("hi", [1], 16, 0.0, 1.0, 0, None, None, None, False)


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
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details == "queue full"
    assert str(e) == "RESOURCE_EXHAUSTED: queue full"


def test_retry_policy() -> None:
    p = _Policy("t", None, None, None, None, max_retries=2, backoff=0.1, max_backoff=1.0)
    options = dict(p.channel_options())
    assert options["grpc.initial_reconnect_backoff_ms"] == 100
    assert options["grpc.max_reconnect_backoff_ms"] == 1000
    assert options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
    unavailable = _Status(grpc.StatusCode.UNAVAILABLE)
    assert 0.05 <= (p.retry_delay(unavailable, 0, None) or 0) <= 0.1
    assert 0.1 <= (p.retry_delay(unavailable, 1, None) or 0) <= 0.2
    assert p.retry_delay(unavailable, 2, None) is None  # retries spent
    assert p.retry_delay(_Status(grpc.StatusCode.INVALID_ARGUMENT), 0, None) is None
    assert p.retry_delay(unavailable, 0, time.monotonic() + 0.01) is None  # no time left to wait
    # an UNAVAILABLE the gateway answered itself (draining, scheduler down) is the answer
    answered = _Status(grpc.StatusCode.UNAVAILABLE, "gateway is draining", ERROR_TRAILER)
    assert p.retry_delay(answered, 0, None) is None


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

    def call() -> None:
        with Client(f"127.0.0.1:{port}", "tok", timeout=60) as c:
            try:
                result["tokens"] = c.tokenize("hello world")
            except FastDecodeError as e:
                result["error"] = e

    t = threading.Thread(target=call)
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
                with pytest.raises(FastDecodeError) as e:
                    await ac.generate("hello", max_tokens=0)
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(FastDecodeError) as e:
                    async for _ in ac.stream(token_ids=[1 << 30]):
                        pass
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT

        asyncio.run(async_calls())
        with Client(proc.address, "wrong", timeout=10) as c, pytest.raises(FastDecodeError) as e:
            c.generate("hello")
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(proc.address, "tok", timeout=30) as c:
            # the gateway's own UNAVAILABLE (no scheduler behind it) comes back at once, not retried
            t0 = time.monotonic()
            with pytest.raises(FastDecodeError) as e:
                c.generate("hello", max_tokens=2)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5
            stream = c.stream("hello")
            stream.cancel()
            assert list(stream) == []
    finally:
        stop_processes([proc], grace=10)
