"""Property-based fuzzing of the public Generate API and the internal Attend stream (bounded).

Whatever arrives, the answer is tokens or a status from the invalid-input family, never
INTERNAL or UNKNOWN, and the servers stay healthy.
"""

from __future__ import annotations

import math

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import UpProcess
from fastdecode.v1 import gateway_pb2, kv_attention_pb2, kv_attention_pb2_grpc, tensor_pb2
from tests.support import TOKEN

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
AUTH = (("authorization", f"Bearer {TOKEN}"),)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _raw_generate(channel: grpc.Channel, payload: bytes) -> grpc.StatusCode:
    call = channel.unary_stream(
        "/fastdecode.v1.Gateway/Generate",
        request_serializer=lambda b: b,
        response_deserializer=gateway_pb2.GenerateResponse.FromString,
    )
    try:
        for _ in call(payload, metadata=AUTH, timeout=30):
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


requests = st.builds(
    dict,
    prompt=st.one_of(st.none(), st.text(max_size=64), st.text(min_size=5000, max_size=6000)),
    token_ids=st.one_of(
        st.none(), st.lists(INT64, max_size=8), st.lists(st.integers(0, 2047), min_size=1500, max_size=1600)
    ),
    max_tokens=st.one_of(
        st.none(), st.integers(-5, 6), st.integers(2000, 2**31 - 1), st.integers(-(2**31), -1)
    ),
    temperature=st.one_of(st.none(), FLOATS),
    top_p=st.one_of(st.none(), FLOATS),
    top_k=st.one_of(st.none(), INT32),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(max_size=300), max_size=20),
    stop_token_ids=st.lists(INT64, max_size=5),
)


@FUZZ
@given(req=requests)
def test_generate_fuzz_answers_tokens_or_invalid_input(fleet: UpProcess, req: dict) -> None:
    msg = gateway_pb2.GenerateRequest(stop=req["stop"], stop_token_ids=req["stop_token_ids"])
    if req["prompt"] is not None:
        msg.prompt = req["prompt"]
    elif req["token_ids"] is not None:
        msg.token_ids.ids.extend(req["token_ids"])
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if req[name] is not None:
            setattr(msg, name, req[name])
    with sync_channel(fleet.target) as channel:
        code = _raw_generate(channel, msg.SerializeToString())
    assert code == grpc.StatusCode.OK or code in ALLOWED, (code, req)
    if code == grpc.StatusCode.OK:  # only a valid request may succeed
        assert req["prompt"] or req["token_ids"]
        assert req["temperature"] is None or (0 <= req["temperature"] and not math.isnan(req["temperature"]))


@FUZZ
@given(stop=st.binary(min_size=1, max_size=40), garbage=st.binary(max_size=200))
def test_generate_invalid_utf8_and_garbage_bytes(fleet: UpProcess, stop: bytes, garbage: bytes) -> None:
    bad_utf8 = b"\xff" + stop  # 0xff never occurs in UTF-8
    payload = _field(1, b"hello") + _field(8, bad_utf8)
    with sync_channel(fleet.target) as channel:
        assert _raw_generate(channel, payload) in ALLOWED
        code = _raw_generate(channel, garbage)
    assert code == grpc.StatusCode.OK or code in ALLOWED


def test_oversized_request_hits_the_message_limit(fleet: UpProcess) -> None:
    payload = _field(1, b"a" * (5 << 20))  # over the gateway's 4 MiB public limit
    with sync_channel(fleet.target) as channel:
        assert _raw_generate(channel, payload) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_servers_healthy_after_public_fuzz(fleet: UpProcess) -> None:
    for svc in [
        fleet.state["gateway"],
        fleet.state["scheduler"],
        fleet.state["gpu_dense"],
        *fleet.state["kv_attention"],
    ]:
        status = (
            health_pb2_grpc.HealthStub(sync_channel(svc["address"]))
            .Check(health_pb2.HealthCheckRequest(), timeout=5)
            .status
        )
        assert status == health_pb2.HealthCheckResponse.SERVING


tensors = st.builds(
    tensor_pb2.Tensor,
    dtype=st.integers(-3, 12),
    shape=st.lists(st.integers(-4, 40), max_size=4),
    data=st.binary(max_size=6000),
)


@FUZZ
@given(
    q=tensors,
    k=tensors,
    v=tensors,
    layer=st.integers(-3, 8),
    num_tokens=st.lists(st.integers(-2, 50), max_size=3),
    start_pos=st.lists(st.integers(-5, 5000), max_size=3),
)
def test_attend_fuzz_in_band_invalid_input(
    fleet: UpProcess,
    q: tensor_pb2.Tensor,
    k: tensor_pb2.Tensor,
    v: tensor_pb2.Tensor,
    layer: int,
    num_tokens: list[int],
    start_pos: list[int],
) -> None:
    address = fleet.state["kv_attention"][0]["address"]
    stub = kv_attention_pb2_grpc.KVAttentionStub(sync_channel(address, fleet.peer_credentials))
    geometry = kv_attention_pb2.KVGeometry(num_layers=4, num_kv_heads=8, head_dim=32)  # the tiny llama
    try:
        stub.Reserve(
            kv_attention_pb2.ReserveRequest(
                geometry=geometry,
                sequences=[kv_attention_pb2.SequenceReservation(seq_id="fuzz", max_tokens=64)],
            ),
            timeout=5,
        )
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION  # already reserved by an earlier example
    req = kv_attention_pb2.AttendRequest(
        request_id=1,
        layer=layer,
        seq_ids=["fuzz"] * len(num_tokens),
        num_tokens=num_tokens,
        start_pos=start_pos,
        q=q,
        k=k,
        v=v,
    )
    (resp,) = list(stub.Attend(iter([req]), timeout=30))
    codes = {c.value[0] for c in ALLOWED} | {0}
    assert resp.error.code in codes, resp.error


def test_shard_healthy_after_attend_fuzz(fleet: UpProcess) -> None:
    address = fleet.state["kv_attention"][0]["address"]
    channel = sync_channel(address, fleet.peer_credentials)
    kv_attention_pb2_grpc.KVAttentionStub(channel).Release(
        kv_attention_pb2.ReleaseRequest(seq_ids=["fuzz"]), timeout=5
    )
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
