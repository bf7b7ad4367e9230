"""KV-cache geometry facts every part agrees on (one source). Imports nothing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV entry across the model: what a shard must hold per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, itemsize: int) -> int:
        """K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize
