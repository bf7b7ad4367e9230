"""Shared prompt prefixes: full KV blocks found by the content they hold.

A full block is named by a chained hash (fastdecode.contract.chain_hashes, the names the scheduler
gives them too): the hash of the previous block's name and this block's token ids, seeded with
what else decides its content (model, KV dtype, geometry, block size). Two
sequences whose first i blocks hold the same tokens of the same model therefore name them alike, and
the second reads the first's blocks instead of computing and storing its own (vLLM's automatic
prefix caching, in the KV store of a shard). A cached block is reference-counted by the sequences
whose block tables hold it; they read it and never write it. At zero references it stays cached,
in least-recently-used order, until the store needs its room. Imports no gRPC.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class PrefixCache:
    """Which physical blocks hold which named prefix blocks, their readers, and the LRU of the idle.

    The store owns the blocks; this only says which of them the cache owns (`holds`): those go back
    here on release (and stay readable) instead of to the free list.
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # zero readers, least recently used first
        self.queries = 0  # reservations that asked
        self.hits = 0  # ... and found at least one block
        self.hit_blocks = 0
        self.evictions = 0
        # a persistent pool's journal (fastdecode/kv/persist.py): ("P", name, block) on insert,
        # ("U", None, block) when a block leaves the cache
        self.on_change: Callable[[str, bytes | None, int], None] | None = None

    def match(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks of the longest cached run of these names (no reference taken)."""
        blocks: list[int] = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        self.queries += 1
        self.hits += bool(blocks)
        self.hit_blocks += len(blocks)
        return blocks

    def lookup(self, h: bytes) -> int | None:
        return self._block_of.get(h)

    def acquire(self, block: int) -> None:
        """One more reader of a cached block (it is no longer evictable)."""
        self._refs[block] += 1
        self._idle.pop(block, None)

    def insert(self, h: bytes, block: int) -> None:
        """Hand a freshly written, full block to the cache, with its writer as the one reader."""
        if h in self._block_of or block in self._hash_of:
            raise ValueError("block or name already cached")
        self._block_of[h], self._hash_of[block], self._refs[block] = block, h, 1
        if self.on_change is not None:
            self.on_change("P", h, block)

    def restore(self, h: bytes, block: int, readers: int) -> None:
        """A cached block found in a persistent pool, with the sequences that read it."""
        self._block_of[h], self._hash_of[block], self._refs[block] = block, h, readers
        if not readers:
            self._idle[block] = None

    def entries(self) -> list[tuple[int, bytes]]:
        """(block, name) of every cached block, idle ones least recently used first, then the read."""
        idle = [(b, self._hash_of[b]) for b in self._idle]
        return idle + [(b, h) for b, h in self._hash_of.items() if b not in self._idle]

    def release(self, block: int) -> None:
        """One reader fewer; at none the block stays cached, most recently used."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._idle[block] = None

    def forget(self, block: int) -> None:
        """Take a block with a single reader out of the cache: it is that reader's own again."""
        if self._refs.get(block) != 1:
            raise ValueError("only a block with one reader can leave the cache")
        del self._block_of[self._hash_of.pop(block)], self._refs[block]
        if self.on_change is not None:
            self.on_change("U", None, block)

    def evict(self, n: int) -> list[int]:
        """Up to n idle blocks, least recently used first, no longer cached: free for any use."""
        out: list[int] = []
        while self._idle and len(out) < n:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)], self._refs[block]
            if self.on_change is not None:
                self.on_change("U", None, block)
            out.append(block)
        self.evictions += len(out)
        return out

    def holds(self, block: int) -> bool:
        return block in self._hash_of

    def readers(self, block: int) -> int:
        return self._refs.get(block, 0)

    @property
    def cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def idle_blocks(self) -> int:
        return len(self._idle)

    @property
    def read_blocks(self) -> int:
        """Cached blocks with at least one reader."""
        return len(self._hash_of) - len(self._idle)

    @property
    def extra_readers(self) -> int:
        """Block reads served by a copy that is not theirs: sum over blocks of (readers - 1)."""
        return sum(r - 1 for r in self._refs.values() if r > 1)
