"""KV-cache and attention geometry facts every part agrees on (one source). Imports only the error model."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fastdecode.runtime.errors import InvalidInput


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV entry across the model: what a shard must hold per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Attention window per layer (a query at p sees keys p - w + 1 .. p; 0 = full); () = full everywhere.
    layer_windows: tuple[int, ...] = ()
    attn_logit_softcap: float = 0.0  # score = cap * tanh(score / cap); 0 = none

    def __post_init__(self) -> None:
        # Cheap checks only (the count before any window is read); the bounds, which refuse a
        # geometry a pool cannot hold, are check_kv_bounds', after the pool's capacity check.
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise InvalidInput(
                f"KV geometry: {len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if any(w < 0 for w in self.layer_windows):
            raise InvalidInput(f"KV geometry: each layer window must be in [0, {MAX_WINDOW}]")
        if self.attn_logit_softcap < 0:
            raise InvalidInput(
                f"KV geometry: attn_logit_softcap must be finite and >= 0, got {self.attn_logit_softcap}"
            )

    def canonical(self) -> KVGeometry:
        """This geometry spelled one way (windows a tuple, () when no layer has one; the cap a float),
        so that two spellings of one geometry compare equal."""
        windows = tuple(self.layer_windows) if any(self.layer_windows) else ()
        return replace(self, layer_windows=windows, attn_logit_softcap=float(self.attn_logit_softcap))

    def bytes_per_token(self, itemsize: int) -> int:
        """K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def window(self, layer: int) -> int:
        """Keys a query of `layer` sees (0: all before it)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def windowed(self) -> bool:
        return any(self.layer_windows)

    def held_blocks(self, end: int, start: int, block_size: int) -> int:
        """Blocks (each of block_size positions on every layer, so 1/num_layers of one per layer's
        block) a sequence holds while it computes positions start..end-1: a windowed layer gives
        back what the query at `start` no longer sees. Rounded up."""
        total = -(-end // block_size)
        if not self.windowed:
            return total
        dead = sum(max(0, start - w + 1) // block_size for w in self.layer_windows if w)
        return -(-(total * self.num_layers - dead) // self.num_layers)

    def held_tokens(self, context: int, block_size: int = 1) -> float:
        """Tokens of KV (each a token on every layer) a sequence of `context` tokens really holds
        when windowed layers keep only their window: a window w layer holds the blocks of its last w
        positions (in whole blocks: the next query, at `context`, sees context - w + 1 on), a full
        layer all of them."""
        if not self.windowed:
            return float(context)
        held = 0
        for w in self.layer_windows:
            first = max(0, context - w + 1) // block_size if w else 0
            held += context - first * block_size
        return held / self.num_layers


# What a shard accepts of a KV geometry (the proto's fields are int32): generous beside real models
# (Llama 3 405B: 126 layers, 8 KV heads of 128; Gemma 3: head dim 256), small enough that the per-layer
# bookkeeping of a pool (lists and block tables per layer) can never be what exhausts a host.
MAX_KV_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_WINDOW = (1 << 31) - 1


def check_kv_bounds(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    layer_windows: Sequence[int] = (),
    softcap: float = 0.0,
) -> None:
    """InvalidInput naming the first field of a KV geometry out of its range (NaN fails too). The
    windows' count is checked before any of them is read, so a list of millions costs nothing."""
    for name, value, top in (
        ("num_layers", num_layers, MAX_KV_LAYERS),
        ("num_kv_heads", num_kv_heads, MAX_KV_HEADS),
        ("head_dim", head_dim, MAX_HEAD_DIM),
    ):
        if not 1 <= value <= top:
            raise InvalidInput(f"KV geometry: {name} must be in [1, {top}], got {value}")
    if layer_windows and len(layer_windows) != num_layers:
        raise InvalidInput(f"KV geometry: {len(layer_windows)} layer windows for {num_layers} layers")
    if any(not 0 <= w <= MAX_WINDOW for w in layer_windows):
        raise InvalidInput(f"KV geometry: each layer window must be in [0, {MAX_WINDOW}]")
    if not 0.0 <= softcap < math.inf:
        raise InvalidInput(f"KV geometry: attn_logit_softcap must be finite and >= 0, got {softcap}")


def check_windows(windows: list[int], num_layers: int) -> list[int]:
    """Per-layer windows (or none) for a model of num_layers layers, else InvalidInput."""
    if windows and (len(windows) != num_layers or min(windows) < 0):
        raise InvalidInput(f"{len(windows)} layer windows for {num_layers} layers (each >= 0)")
    return windows


def window_held(windows: Sequence[int], tokens: int) -> float:
    """KV tokens (each on every layer) a sequence of `tokens` holds when each layer keeps its
    window (0 = full; () = every layer full), in whole tokens (the planner's view)."""
    if not any(windows):
        return float(tokens)
    return sum(min(tokens, w) if w else tokens for w in windows) / len(windows)


def window_mean_held(windows: Sequence[int], seq_len: int) -> float:
    """What a sequence of seq_len tokens holds on average over its life (seq_len / 2 without windows)."""
    if not any(windows):
        return seq_len / 2
    total = 0.0
    for w in windows:  # a windowed layer grows to w, then stays at w
        total += seq_len / 2 if not w or seq_len <= w else (w * w / 2 + (seq_len - w) * w) / seq_len
    return total / len(windows)


@dataclass(frozen=True)
class Geometry:
    """A model's attention shape: what crosses the wire per token and layer (bench exchange, plan)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    num_layers: int = 1
    intermediate: int = 0  # the MLP's width; 0: unknown (the checkpoint's, where one is given)
    vocab: int = 0  # likewise the LM head's rows

    def payload_bytes(self, batch: int, itemsize: int) -> int:
        """q, k, v out and o back for one decode token of `batch` sequences."""
        return batch * (2 * self.heads + 2 * self.kv_heads) * self.head_dim * itemsize


GEOMETRIES: dict[str, Geometry] = {
    "llama-3-8b": Geometry("llama-3-8b", 4096, 32, 8, 128, 32, 14336, 128256),
    "llama-3-70b": Geometry("llama-3-70b", 8192, 64, 8, 128, 80, 28672, 128256),
    "smollm2": Geometry("smollm2", 576, 9, 3, 64, 30, 1536, 49152),  # SmolLM2-135M, the default model
    "small": Geometry("small", 768, 12, 12, 64, 12),  # the small random-weight preset
}


def geometry(
    name: str | None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> Geometry:
    """A named geometry, or explicit dims (all four, or head_dim derived from hidden / heads)."""
    if name is not None and any(x is not None for x in (hidden, heads, kv_heads, head_dim)):
        raise InvalidInput("give --geometry or explicit dims, not both")
    if name is not None:
        try:
            return GEOMETRIES[name]
        except KeyError:
            raise InvalidInput(f"unknown geometry {name!r}; expected one of {sorted(GEOMETRIES)}") from None
    if heads is None or (hidden is None and head_dim is None):
        raise InvalidInput("explicit geometry needs --heads and --hidden or --head-dim")
    kv_heads = kv_heads or heads
    head_dim = head_dim or (hidden or 0) // heads
    hidden = hidden or heads * head_dim
    if min(hidden, heads, kv_heads, head_dim) < 1 or heads % kv_heads:
        raise InvalidInput("dims must be positive and heads a multiple of kv heads")
    return Geometry(f"h{hidden}-q{heads}-kv{kv_heads}-d{head_dim}", hidden, heads, kv_heads, head_dim)


# What a stored KV row costs by dtype name: the item size, and whether each (token, KV head) row
# carries a float32 scale (int8, float8 e4m3). Torch-free, for the processes that only plan
# (`fastdecode up` checks --kv-capacity with it); fastdecode.kv.memory's dtypes agree (a unit test).
KV_DTYPE_BYTES: dict[str, tuple[int, bool]] = {
    "float32": (4, False),
    "float16": (2, False),
    "bfloat16": (2, False),
    "int8": (1, True),
    "float8_e4m3": (1, True),
}


def kv_row_bytes(dtype: str, head_dim: int) -> int:
    """Bytes of one (token, KV head) row of K or V in the KV dtype named `dtype`, its scale included."""
    itemsize, scaled = KV_DTYPE_BYTES[dtype]
    return head_dim * itemsize + (4 if scaled else 0)


def host_available_bytes() -> int:
    """MemAvailable (what the host can give without swapping), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
