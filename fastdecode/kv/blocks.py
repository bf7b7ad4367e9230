"""A KV pool's blocks: the free-run allocator and one sequence's block table. Imports no gRPC."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


@dataclass
class SeqBlocks:
    blocks: list[int]  # the block table: blocks[i] holds positions i*block_size .. (i+1)*block_size-1
    capacity: int  # tokens its blocks hold
    lengths: list[int]  # tokens held per layer
    contiguous: bool
    slots: torch.Tensor | None = field(default=None)  # token slot index when scattered (torch path)
    tables: dict[int, torch.Tensor] = field(default_factory=dict)  # int32 block tables per layer group
    hashes: list[bytes] = field(default_factory=list)  # names of the full blocks of its known tokens
    frozen: int = 0  # leading blocks owned by the prefix cache: read, never written
    # Windowed stores: the block tables of layer groups 1.. (group 0's is `blocks`), and per group
    # the leading blocks given back (-1 in the table) because every window has passed them, and the
    # leading blocks the group's prefix cache owns (read, never written; those below `dead` let go).
    more: list[list[int]] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    gfrozen: list[int] = field(default_factory=list)


class BlockAllocator:
    """Free runs of blocks kept as sorted (start, length) intervals; first fit, then scatter."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._starts: list[int] = [0] if num_blocks else []
        self._lens: list[int] = [num_blocks] if num_blocks else []
        self.free = num_blocks

    @classmethod
    def without(cls, num_blocks: int, used: set[int]) -> BlockAllocator:
        """An allocator whose free blocks are all but `used` (a pool found on file)."""
        alloc = cls(0)
        alloc.num_blocks, run = num_blocks, None
        for b in range(num_blocks):
            if b in used:
                run = None
            elif run is not None and alloc._starts[run] + alloc._lens[run] == b:
                alloc._lens[run] += 1
            else:
                alloc._starts.append(b)
                alloc._lens.append(1)
                run = len(alloc._starts) - 1
        alloc.free = num_blocks - len(used)
        return alloc

    def allocate(self, n: int) -> list[int] | None:
        if n > self.free:
            return None
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self.free -= n
                return list(range(start, start + n))
        blocks: list[int] = []  # fragmented: take whole runs until satisfied
        while len(blocks) < n:
            take = min(self._lens[0], n - len(blocks))
            start = self._starts[0]
            blocks.extend(range(start, start + take))
            if take == self._lens[0]:
                del self._starts[0], self._lens[0]
            else:
                self._starts[0] += take
                self._lens[0] -= take
        self.free -= n
        return blocks

    def allocate_after(self, block: int) -> bool:
        """Take block + 1 when it is free (it then starts a free run); False when it is not."""
        nxt = block + 1
        i = bisect.bisect_left(self._starts, nxt)
        if i == len(self._starts) or self._starts[i] != nxt:
            return False
        if self._lens[i] == 1:
            del self._starts[i], self._lens[i]
        else:
            self._starts[i] += 1
            self._lens[i] -= 1
        self.free -= 1
        return True

    def release(self, blocks: list[int]) -> None:
        for b in sorted(blocks):
            i = bisect.bisect_left(self._starts, b)
            self._starts.insert(i, b)
            self._lens.insert(i, 1)
            # merge with the right neighbour, then with the left one
            if i + 1 < len(self._starts) and b + 1 == self._starts[i + 1]:
                self._lens[i] += self._lens[i + 1]
                del self._starts[i + 1], self._lens[i + 1]
            if i > 0 and self._starts[i - 1] + self._lens[i - 1] == b:
                self._lens[i - 1] += self._lens[i]
                del self._starts[i], self._lens[i]
        self.free += len(blocks)
