"""The one tensor codec: torch.Tensor <-> fastdecode.v1.Tensor.

Raw little-endian, C-contiguous bytes with an explicit dtype and shape; bf16 goes
through a uint8 view because numpy has no bfloat16. Decoding validates dtype,
shape and byte count and returns a tensor that aliases the message bytes (no copy)
unless the caller asks for a writable copy.
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch

from fastdecode.errors import InvalidInput
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
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in _TO_WIRE.items()}
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in _TO_WIRE}
# numpy has no bfloat16: its bytes travel as uint16 and are viewed back in torch.
_NUMPY: dict[torch.dtype, type] = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
}

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


def encode(t: torch.Tensor, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Serialize a tensor (any device) into a Tensor message; fills `out` when given."""
    msg = out if out is not None else tensor_pb2.Tensor()
    msg.dtype = wire_dtype(t.dtype)
    msg.shape[:] = t.shape
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.reshape(-1).view(torch.uint8)  # flat first: a 0-d or empty view may have stride 0
    msg.data = t.numpy().tobytes()
    return msg


def decode(msg: tensor_pb2.Tensor, *, copy: bool = False) -> torch.Tensor:
    """Validate and deserialize. Without copy the result aliases msg.data and is read-only."""
    dtype = torch_dtype(msg.dtype)
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise TensorCodecError(f"negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    data = msg.data
    if len(data) != expected:
        raise TensorCodecError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {expected} bytes, got {len(data)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # numpy frombuffer + torch.from_numpy: half the time of torch.frombuffer + view per message
    arr = np.frombuffer(data, dtype=_NUMPY[dtype]).reshape(shape)
    t = torch.from_numpy(arr.copy() if copy else arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
