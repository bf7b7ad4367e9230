import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.runtime import codec
from fastdecode.runtime.codec import TensorCodecError
from fastdecode.runtime.errors import InvalidInput
from fastdecode.v1 import kv_attention_pb2, tensor_pb2

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8,
    torch.float8_e4m3fn,
]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact(dtype: torch.dtype, shape: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(dtype)  # e4m3 tops at 448
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g).to(dtype)
    msg = tensor_pb2.Tensor.FromString(codec.encode(t).SerializeToString())
    back = codec.decode(msg)
    assert back.dtype == dtype and tuple(back.shape) == tuple(shape)
    raw = t.element_size() == 1  # bytes: float8 codes compare as their bits
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8)) if raw else torch.equal(back, t)
    assert len(msg.data) == math.prod(shape) * t.element_size()


@settings(max_examples=100, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    ids=st.lists(st.text(max_size=4), max_size=3),
    big=st.integers(0, 2**62),
    transpose=st.booleans(),
)
def test_serialize_with_parses_as_encode_then_serialize(
    dtype: torch.dtype, shape: list[int], ids: list[str], big: int, transpose: bool
) -> None:
    """The hot path's wire bytes parse to the message encode + SerializeToString would have sent."""
    t = (torch.arange(math.prod(shape)).reshape(shape) % 100).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    fields = dict(request_id=big, layer=3, seq_ids=ids, num_tokens=[1] * len(ids), start_pos=[big] * len(ids))
    want = kv_attention_pb2.AttendRequest(**fields)
    for name in ("q", "v"):
        codec.encode(t, getattr(want, name))
    wire = codec.serialize_with(kv_attention_pb2.AttendRequest(**fields), q=t, v=t)
    got = kv_attention_pb2.AttendRequest.FromString(wire)
    assert got == want and not got.HasField("k")
    assert len(wire) == len(want.SerializeToString())
    assert torch.equal(codec.decode(got.v).float(), t.float())


def test_non_contiguous_and_bf16_bit_patterns() -> None:
    t = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # non-contiguous view
    assert torch.equal(codec.decode(codec.encode(t)), t)
    b = torch.tensor([1.0, -2.5, float("inf"), 3.1415], dtype=torch.bfloat16)
    msg = codec.encode(b)
    assert msg.dtype == tensor_pb2.BFLOAT16 and msg.data == b.view(torch.uint8).numpy().tobytes()
    assert torch.equal(codec.decode(msg), b)


def test_decode_aliases_message_bytes_unless_copied() -> None:
    msg = codec.encode(torch.ones(1000))
    view = codec.decode(msg)
    copied = codec.decode(msg, copy=True)
    copied += 1  # writable copy
    assert torch.equal(view, torch.ones(1000))
    assert view.data_ptr() != copied.data_ptr()


@pytest.mark.parametrize(
    "msg, match",
    [
        (tensor_pb2.Tensor(dtype=99, shape=[1], data=b"\0" * 4), "unknown tensor dtype"),
        (
            tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4),
            "unknown tensor dtype",
        ),
        (tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[-1, 4], data=b""), "negative dimension"),
        (
            tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[2, 3], data=b"\0" * 23),
            "needs 24 bytes, got 23",
        ),
        (tensor_pb2.Tensor(dtype=tensor_pb2.BFLOAT16, shape=[3], data=b"\0" * 4), "needs 6 bytes"),
    ],
)
def test_malformed_tensors_raise_one_typed_error(msg: tensor_pb2.Tensor, match: str) -> None:
    with pytest.raises(TensorCodecError, match=match) as info:
        codec.decode(msg)
    assert isinstance(info.value, InvalidInput)  # the services map it to INVALID_ARGUMENT


def test_unsupported_dtype_cannot_be_encoded() -> None:
    with pytest.raises(TensorCodecError):
        codec.encode(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_wire_reads_o_in_place_as_fromstring_would(dtype: torch.dtype) -> None:
    from fastdecode.v1 import kv_attention_pb2 as kv_pb
    from fastdecode.wire.kv import parse_response

    o = torch.randn(5, 12).to(dtype)
    wire = codec.serialize_with(kv_pb.AttendResponse(request_id=7, attend_seconds=0.5), o=o)
    head, got = parse_response(wire)
    assert head.request_id == 7 and head.attend_seconds == 0.5 and not head.HasField("o")
    assert got is not None and got.dtype == dtype and torch.equal(got, o)
    # the same bytes as protobuf's own parse, in any field order
    resp = kv_pb.AttendResponse(request_id=7)
    codec.encode(o, resp.o)
    head, got = parse_response(resp.SerializeToString())
    assert torch.equal(got, codec.decode(kv_pb.AttendResponse.FromString(resp.SerializeToString()).o))
    # an error answer has no o
    err = kv_pb.AttendResponse(request_id=8)
    err.error.code, err.error.message = 3, "bad"
    head, got = parse_response(err.SerializeToString())
    assert got is None and head.error.message == "bad"


def test_split_field_refuses_truncated_bytes() -> None:
    from fastdecode.v1 import kv_attention_pb2 as kv_pb

    wire = codec.serialize_with(kv_pb.AttendResponse(request_id=7), o=torch.zeros(4, 4))
    with pytest.raises(codec.TensorCodecError, match="truncated"):
        codec.split_field(wire[:-3], 2)
    with pytest.raises(codec.TensorCodecError):
        codec.decode_wire(codec.encode(torch.zeros(4)).SerializeToString()[:-1])


def test_the_schedulers_kv_itemsizes_are_the_codecs() -> None:
    """The scheduler reads a shard's KV dtype without torch (wire.kv_control): every dtype a KV pool
    holds has the element size torch gives it, and a dtype no pool holds is refused in one line."""
    from fastdecode.kv import KV_DTYPES
    from fastdecode.wire.kv_control import WIRE_ITEMSIZE, shard_state_from_proto

    for dtype in KV_DTYPES.values():
        wire = codec.wire_dtype(dtype)
        assert WIRE_ITEMSIZE[wire] == dtype.itemsize
        state = shard_state_from_proto(kv_attention_pb2.ShardStats(kv_dtype=wire))
        assert state.kv_itemsize == dtype.itemsize
    with pytest.raises(InvalidInput, match="KV dtype 4"):
        shard_state_from_proto(kv_attention_pb2.ShardStats(kv_dtype=tensor_pb2.INT64))


def test_ups_kv_row_bytes_are_the_pools() -> None:
    """`fastdecode up` sizes a KV row without torch (runtime.geometry): every KV dtype a pool holds
    costs there what the pool stores, its float32 row scale included, and no other is listed."""
    from fastdecode.kv.memory import KV_DTYPES, kv_bytes_per_element
    from fastdecode.runtime.geometry import KV_DTYPE_BYTES, kv_row_bytes

    assert set(KV_DTYPE_BYTES) == set(KV_DTYPES)
    for name, dtype in KV_DTYPES.items():
        for head_dim in (64, 128):
            assert kv_row_bytes(name, head_dim) == kv_bytes_per_element(dtype, head_dim) * head_dim
