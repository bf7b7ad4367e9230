"""A real gateway process with no scheduler behind it (its pure parts: tests/unit/test_gateway_adapters.py).

Everything checked here is answered by the gateway itself (auth, parsing, validation,
tokenizing, an unreachable scheduler); generation through a whole fleet is the e2e tier's.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fastdecode.benchmarks.chaos_grammar import empty_keys_probe
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.tools.fleet import ServiceProcess, free_port, start_service, stop_processes
from fastdecode.v1 import gateway_pb2 as pb

TOKEN = "t0ps3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
BAD_UTF8_PROMPT = b"\x0a\x02\xff\xfe"  # field 1 (prompt), 2 bytes that are not UTF-8


# ---- a gateway process without a scheduler ----------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("gateway")
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = start_service(
        "gateway",
        ["gateway", "--scheduler", nowhere, "--model", str(llama_dir), "--connect-timeout", "0.5"],
        workdir,
        env={"FASTDECODE_AUTH_TOKEN": TOKEN},
        timeout=60,
    )
    yield proc
    stop_processes([proc], grace=10)
    assert TOKEN not in proc.log_path.read_text()


@pytest.fixture(scope="module")
def channel(gateway: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.address) as ch:
        yield ch


def _tokenize(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = AUTH) -> pb.TokenizeResponse:
    stub = channel.unary_unary(
        "/fastdecode.v1.Gateway/Tokenize",
        request_serializer=pb.TokenizeRequest.SerializeToString,
        response_deserializer=pb.TokenizeResponse.FromString,
    )
    return stub(pb.TokenizeRequest(text="hello world"), metadata=metadata, timeout=10)


def _generate(channel: grpc.Channel, request: bytes, metadata: tuple[tuple[str, str], ...] = AUTH) -> None:
    stub = channel.unary_stream(
        "/fastdecode.v1.Gateway/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    list(stub(request, metadata=metadata, timeout=10))


def test_tokenize_with_token(channel: grpc.Channel, llama_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(llama_dir)
    r = _tokenize(channel)
    assert list(r.token_ids) == tok.encode("hello world")
    assert len(r.tokens) == len(r.token_ids)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)])
def test_missing_or_wrong_token_is_unauthenticated(
    channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]
) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _tokenize(channel, metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        _generate(channel, pb.GenerateRequest(prompt="hi").SerializeToString(), metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_need_no_token(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    # No scheduler behind it: not ready (readiness tells the truth), but the process is alive.
    deadline = time.monotonic() + 15
    while True:
        ready = health.Check(health_pb2.HealthCheckRequest(service="fastdecode.v1.Gateway"), timeout=10)
        if ready.status == health_pb2.HealthCheckResponse.NOT_SERVING or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
    live = health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)
    assert live.status == health_pb2.HealthCheckResponse.SERVING
    answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    names = [s.name for a in answers for s in a.list_services_response.service]
    assert "fastdecode.v1.Gateway" in names


def test_invalid_utf8_is_invalid_argument(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _generate(channel, BAD_UTF8_PROMPT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in e.value.details()


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "no input"),
        (pb.GenerateRequest(prompt=""), "prompt is empty"),  # a oneof member keeps its presence
        (pb.GenerateRequest(prompt="hi", max_tokens=0), "max_tokens"),
        (pb.GenerateRequest(prompt="hi", temperature=float("nan")), "temperature"),
        (pb.GenerateRequest(prompt="hi", top_p=0.0), "top_p"),
        (pb.GenerateRequest(prompt="hi", top_k=-1), "top_k"),
        (pb.GenerateRequest(prompt="hi", max_tokens=1_000_000), "context"),
        (pb.GenerateRequest(prompt="hi", stop=["x"] * 17), "stop strings"),
        (pb.GenerateRequest(prompt="hi", stop=["x" * 257]), "stop string"),
        (pb.GenerateRequest(prompt="hi", stop_token_ids=[1 << 40]), "stop_token_ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 1 << 20])), "vocabulary"),
    ],
)
def test_invalid_requests(channel: grpc.Channel, request_: pb.GenerateRequest, message: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _generate(channel, request_.SerializeToString())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_unreachable_scheduler_is_unavailable(channel: grpc.Channel) -> None:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        _generate(channel, pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 5
    info = channel.unary_unary(
        "/fastdecode.v1.Gateway/GetModelInfo",
        request_serializer=pb.GetModelInfoRequest.SerializeToString,
        response_deserializer=pb.GetModelInfoResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as e:
        info(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_exits_zero(llama_dir: Path, tmp_path: Path) -> None:
    proc = start_service(
        "gateway-term",
        ["gateway", "--scheduler", f"127.0.0.1:{free_port()}", "--model", str(llama_dir)],
        tmp_path,
        env={"FASTDECODE_CONNECT_TIMEOUT": "0.2"},
        timeout=60,
    )
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=30) == 0


def test_a_keys_file_without_keys_never_opens_the_gateway(llama_dir: Path, tmp_path: Path) -> None:
    """bench chaos's empty_keys probe: started with a comments-only keys file, the gateway admits
    nobody (not everybody), takes SIGHUP from the start, then admits the key the file gained;
    emptied again and reloaded, the file keeps the key there was. A WARNING says why each time."""
    report = empty_keys_probe(llama_dir, tmp_path)
    assert report["at_start"] == ["UNAUTHENTICATED"] * 3, report
    assert report["after_keys_added"] == "OK", report
    assert report["after_emptied"] == ["OK", "UNAUTHENTICATED"], report
    assert report["opened"] == 0 and report["alive"] and report["warnings"] == 2, report
    log = Path(report["log"]).read_text()
    assert "holds no keys; no request is admitted" in log and "holds no keys; the old ones stay" in log
    assert "probe-key-0001" not in log
