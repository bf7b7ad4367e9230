"""The shard plane gpu_dense's servicer drives, declared once.

Three planes implement it: ShardLinks (the Attend streams in this process, links.py),
ExchangePlane (the streams in K exchange worker processes, plane.py) and HostShardPlane (one shard
served in this process, the rest behind either of the others, host_shard.py). The step runner sees
the narrower `fastdecode.dense.LayerPlane` it extends (num_shards, attend_layer and the declared
capabilities attend_layer_at, attend_layer_blocking, staging); the servicer also adds, removes and
restores shards and reports their addresses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fastdecode.dense import AttendItem, LayerPlane


@dataclass(frozen=True)
class ShardAddress:
    """What the servicer reports of a shard (Info): its index, address, and whether it was removed."""

    index: int
    address: str
    removed: bool = False  # RemoveShard: its items fail UNAVAILABLE, its streams are closed

    @property
    def name(self) -> str:
        return f"shard {self.index} ({self.address})"


class ShardEntry(Protocol):
    """A plane's entry for one shard: ShardAddress, or an in-process AttendLink."""

    @property
    def index(self) -> int: ...
    @property
    def address(self) -> str: ...
    @property
    def removed(self) -> bool: ...
    @property
    def name(self) -> str: ...


class ShardPlaneService(LayerPlane[AttendItem], Protocol):
    """What gpu_dense's servicer asks of its shard plane (and the step runner, through LayerPlane)."""

    @property
    def num_shards(self) -> int: ...

    @property
    def links(self) -> Sequence[ShardEntry]:
        """Every shard ever added, by index (a removed one keeps its index)."""
        ...

    async def add_shard(self, address: str) -> int:
        """A new shard at the next index; returns the index."""
        ...

    async def remove(self, index: int) -> None:
        """Its items fail UNAVAILABLE from now on; no other shard's index moves."""
        ...

    async def restore(self, index: int) -> None:
        """A removed shard back on its address (a restarted pod)."""
        ...

    async def attend_layer(
        self,
        slot: int,
        layer: int,
        items: Sequence[AttendItem],
        between: Callable[[], None] | None = None,
    ) -> list[torch.Tensor | BaseException]: ...

    async def close(self) -> None: ...
