"""Memory for the KV pools: the storage dtypes and what an element costs, anonymous memory advised
for transparent huge pages (and how much of a tensor they back), and int8 and float8 e4m3
quantization per row.
Imports no gRPC."""

from __future__ import annotations

import math
import mmap
from collections import Counter
from dataclasses import dataclass

import torch

from fastdecode.runtime.errors import InvalidInput, ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry, check_kv_bounds, host_available_bytes

KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "float8_e4m3": torch.float8_e4m3fn,
}
# Stored as codes times one float32 scale per (token, KV head) row: scale = absmax / code max.
SCALED_DTYPES: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_INT8_MAX = SCALED_DTYPES[torch.int8]
_HUGE_PAGE = 2 << 20
MAX_BLOCK_SIZE = 4096  # ShardSettings.block_size's bound


def kv_bytes_per_element(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one cached element costs, counting int8's and float8's float32 scale per (token, head) row."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize + (4 / head_dim if dtype in SCALED_DTYPES else 0)


@dataclass(frozen=True)
class PoolPlan:
    """What a KV pool of one geometry takes, worked out in Python integers before anything of it
    is allocated (KVStore builds exactly this)."""

    row_bytes: int  # one token of one KV head of one layer, its scale included
    bytes_per_token: int  # K and V of one token on every layer
    group_size: int  # layers per layer group (fastdecode/kv/windows.py)
    block_bytes: int  # block_size tokens of one layer group
    num_blocks: int

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def plan_pool(
    geometry: KVGeometry,
    block_size: int,
    dtype: torch.dtype,
    capacity_bytes: int,
    freed_bytes: int = 0,
) -> PoolPlan:
    """The pool of this geometry in `capacity_bytes`, or the refusal: InvalidInput for a field out
    of range, ResourceExhausted when one block of every layer does not fit the capacity or the pool
    does not fit the host's available memory (plus `freed_bytes`, a pool about to be let go). The
    capacity is checked first, in O(1), so any int32 geometry is answered at once."""
    if dtype not in KV_DTYPES.values():
        raise InvalidInput(f"KV dtype must be one of {sorted(KV_DTYPES)}, got {dtype}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise InvalidInput(f"KV block size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    num_layers, num_kv_heads, head_dim = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
    if min(num_layers, num_kv_heads, head_dim) < 1:
        raise InvalidInput(
            f"KV geometry must be positive: {num_layers} layers, {num_kv_heads} KV heads, head dim {head_dim}"
        )
    row_bytes = head_dim * dtype.itemsize + (4 if dtype in SCALED_DTYPES else 0)  # + the row's scale
    per_token = 2 * num_layers * num_kv_heads * row_bytes
    # A token needs a block of each layer group: block_size tokens of every layer in all.
    if block_size * per_token > capacity_bytes:
        raise ResourceExhausted(
            f"KV geometry ({num_layers} layers, {num_kv_heads} KV heads, head dim {head_dim}) needs "
            f"{block_size * per_token} bytes for one block of {block_size} tokens ({dtype}); this "
            f"shard's KV pool holds {capacity_bytes}"
        )
    windows = geometry.layer_windows
    check_kv_bounds(num_layers, num_kv_heads, head_dim, windows, geometry.attn_logit_softcap)
    counts = Counter(windows).values() if any(windows) else (num_layers,)
    group_size = math.gcd(*counts)
    block_bytes = 2 * group_size * num_kv_heads * row_bytes * block_size
    plan = PoolPlan(row_bytes, per_token, group_size, block_bytes, capacity_bytes // block_bytes)
    available = host_available_bytes() + freed_bytes
    if plan.pool_bytes > available:
        raise ResourceExhausted(
            f"a KV pool of {plan.pool_bytes} bytes does not fit this host's available memory "
            f"({available} bytes): lower the shard's kv_capacity"
        )
    return plan


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on private anonymous memory advised for transparent huge pages
    (MADV_HUGEPAGE; plain torch.empty below 2 MiB or where the OS lacks it). Pages are committed on
    first write, as with torch.empty, but 2 MiB at a time. The kernel walks each KV head's rows a
    block at a time, and on 4 KiB pages each block of a head is a new page whose TLB miss stalls
    the read: with huge pages a layer took 0.75-0.79x the time in bf16 and 0.86-0.90x in fp32 on Zen 4."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE_PAGE or advice is None:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    try:
        buf.madvise(advice)
    except OSError:  # THP not in this kernel: plain pages
        pass
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # keeps buf alive


def mapping_of(t: torch.Tensor) -> dict[str, int]:
    """The /proc/self/smaps fields (Size, Rss, AnonHugePages in kB; THPeligible 0/1) of the
    mapping that holds t's data; {} where there is no smaps (not Linux) or no such mapping."""
    addr, fields, inside = t.data_ptr(), {}, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's header: start-end perms ...
                    if inside:
                        break
                    start, _, end = head.partition("-")
                    inside = int(start, 16) <= addr < int(end, 16)
                elif inside:
                    value = line.split()[1]
                    if value.isdigit():
                        fields[head[:-1]] = int(value)
    except OSError:
        return {}
    return fields


def huge_page_share(t: torch.Tensor) -> float | None:
    """Share of t's mapping, of what is resident, backed by huge pages (None: unknown)."""
    m = mapping_of(t)
    return m["AnonHugePages"] / m["Rss"] if m.get("Rss") and "AnonHugePages" in m else None


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dim: x ~= q * scale. The native kernel does the same."""
    x = x.float()
    scale = x.abs().amax(-1) / _INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, torch.round(x / safe[..., None]), torch.zeros_like(x))
    return q.clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8), scale


_F8_MIN_NORMAL = 2.0**-6  # e4m3's smallest normal


def quantize_float8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 per row of the last dim, scale = absmax / 448 (e4m3's largest finite value):
    x ~= code * scale, the codes rounded to nearest even by torch's cast, as the native kernel does.
    No subnormal codes: below 2^-6 a value rounds to 0 or +-2^-6 (at most 2^-7 * scale off, under
    4e-5 of the row's absmax), because the kernel widens codes to fp32 by bit shifts and flushes
    denormals, which would read a subnormal code as 0."""
    x = x.float()
    top = SCALED_DTYPES[torch.float8_e4m3fn]
    scale = x.abs().amax(-1) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, x / safe[..., None], torch.zeros_like(x)).clamp_(-top, top)
    small = q.abs() < _F8_MIN_NORMAL
    q = torch.where(small, torch.where(q.abs() > _F8_MIN_NORMAL / 2, q.sign() * _F8_MIN_NORMAL, 0.0), q)
    return q.to(torch.float8_e4m3fn), scale


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and per-row scales of x in a scaled KV dtype (SCALED_DTYPES)."""
    return quantize_int8(x) if dtype == torch.int8 else quantize_float8(x)
