"""The one tensor codec: torch.Tensor <-> fastdecode.v1.Tensor.

Raw little-endian, C-contiguous bytes with an explicit dtype and shape; bf16 and float8 go
through a uint8 view because numpy has neither. Decoding validates dtype,
shape and byte count and returns a tensor that aliases the message bytes (no copy)
unless the caller asks for a writable copy.

`serialize_with` is the hot path's encoder: a message's wire bytes with Tensor fields whose data
goes from the tensor's memory into the bytes once (encode + SerializeToString copy it three times).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings

import numpy as np
import torch
from google.protobuf.message import Message

from fastdecode.runtime.errors import InvalidInput
from fastdecode.v1 import tensor_pb2

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("fastdecode's wire format assumes a little-endian host")


# torch warns that an array over a bytes buffer is not writable; decoded views are never written to (callers
# that need to write ask for a copy). Filtered once here, not with catch_warnings on the hot path.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class TensorCodecError(InvalidInput):
    """A Tensor message is malformed: unknown dtype, bad shape or wrong byte count."""


_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.FLOAT32,
    torch.float16: tensor_pb2.FLOAT16,
    torch.bfloat16: tensor_pb2.BFLOAT16,
    torch.int64: tensor_pb2.INT64,
    torch.int32: tensor_pb2.INT32,
    torch.int8: tensor_pb2.INT8,
    torch.uint8: tensor_pb2.UINT8,
    torch.float8_e4m3fn: tensor_pb2.FLOAT8_E4M3,
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in _TO_WIRE.items()}
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in _TO_WIRE}
# numpy has no bfloat16 or float8: their bytes travel as uint16 / uint8 and are viewed back in torch.
_NUMPY: dict[torch.dtype, type] = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.float8_e4m3fn: np.uint8,
}
_VIEWED = (torch.bfloat16, torch.float8_e4m3fn)

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise TensorCodecError(f"dtype {dtype} cannot travel as a Tensor") from None


def torch_dtype(wire: int) -> torch.dtype:
    try:
        return _FROM_WIRE[wire]
    except KeyError:
        raise TensorCodecError(f"unknown tensor dtype enum value {wire}") from None


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a C-contiguous numpy array on the host (a view when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype in _VIEWED:
        t = t.reshape(-1).view(torch.uint8)  # flat first: a 0-d or empty view may have stride 0
    return t.numpy()


def encode(t: torch.Tensor, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Serialize a tensor (any device) into a Tensor message; fills `out` when given."""
    msg = out if out is not None else tensor_pb2.Tensor()
    msg.dtype = wire_dtype(t.dtype)
    msg.shape[:] = t.shape
    msg.data = _host_bytes(t).tobytes()
    return msg


def varint(n: int) -> bytes:
    """A protobuf varint (the wire bytes written by hand: here and the exchange's per-layer frame)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_DATA_TAG = b"\x1a"  # Tensor.data: field 3, length-delimited


def serialize_with(msg: Message, prefix: bytes = b"", **tensors: torch.Tensor) -> bytes:
    """`msg`'s wire bytes plus each named Tensor field (left unset in msg) encoded from a tensor.

    What `encode` into msg + `msg.SerializeToString()` give, as the receiver parses it, with one
    copy of each tensor's data instead of three: protobuf fields may come in any order, so each
    Tensor field is appended to msg's own bytes, its data straight from the tensor's memory.
    `prefix`: wire bytes of more fields of the same message type, serialized once by the caller
    (fields that stay the same over many messages).
    """
    parts: list[bytes | memoryview] = [msg.SerializeToString(), prefix]
    fields = msg.DESCRIPTOR.fields_by_name
    for name, t in tensors.items():
        data = memoryview(_host_bytes(t).reshape(-1).view(np.uint8))
        parts += [_field_head(fields[name].number, t.dtype, tuple(t.shape), data.nbytes), data]
    return b"".join(parts)


@functools.lru_cache(maxsize=1024)
def _field_head(number: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    """A Tensor field's bytes up to its data: the field's tag and length, dtype, shape and data's tag
    and length. The same few shapes go out at every layer, so each is built once."""
    head = tensor_pb2.Tensor(dtype=wire_dtype(dtype), shape=shape).SerializeToString()
    head += _DATA_TAG + varint(nbytes) if nbytes else b""  # proto3 omits empty bytes
    return varint((number << 3) | 2) + varint(len(head) + nbytes) + head


def decode(msg: tensor_pb2.Tensor, *, copy: bool = False) -> torch.Tensor:
    """Validate and deserialize. Without copy the result aliases msg.data and is read-only."""
    return _decode(msg.dtype, tuple(msg.shape), msg.data, copy)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise TensorCodecError("truncated or overlong varint in a message")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def split_field(buf: bytes | memoryview, number: int) -> tuple[bytes, memoryview | None]:
    """A message's wire bytes without length-delimited field `number`, and that field's payload as
    a view of `buf` (the last occurrence, as a parser keeps it; None when absent). The rest parses
    with the message's own FromString; the payload is never copied."""
    view = memoryview(buf).cast("B")
    keep: list[memoryview] = []
    found: memoryview | None = None
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _read_varint(view, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _read_varint(view, pos)
            if key >> 3 == number:
                if pos + n > len(view):
                    raise TensorCodecError("truncated field in a message")
                found = view[pos : pos + n]
                pos += n
                continue
            pos += n
        else:
            raise TensorCodecError(f"unsupported wire type {wire} in a message")
        if pos > len(view):
            raise TensorCodecError("truncated field in a message")
        keep.append(view[start:pos])
    return b"".join(keep), found


def decode_wire(buf: bytes | memoryview) -> torch.Tensor:
    """A Tensor message's wire bytes decoded with the data aliasing `buf` (read-only, no copy):
    what FromString + decode give, minus their two copies of the data."""
    head, data = split_field(buf, 3)
    msg = tensor_pb2.Tensor.FromString(head)
    return _decode(msg.dtype, tuple(msg.shape), data if data is not None else b"", False)


def _decode(wire: int, shape: tuple[int, ...], data: bytes | memoryview, copy: bool) -> torch.Tensor:
    dtype = torch_dtype(wire)
    if any(d < 0 for d in shape):
        raise TensorCodecError(f"negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if len(data) != expected:
        raise TensorCodecError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {expected} bytes, got {len(data)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # numpy frombuffer + torch.from_numpy: half the time of torch.frombuffer + view per message
    arr = np.frombuffer(data, dtype=_NUMPY[dtype]).reshape(shape)
    t = torch.from_numpy(arr.copy() if copy else arr)
    return t.view(dtype) if dtype in _VIEWED else t
