"""Windowed layers held as windows: the KV store's layer groups (a mixin over KVStore).

The layers of one window size are cut into groups of `group_size` layers (the gcd of the counts per
window size), as vLLM's hybrid allocator does; each sequence has one block table per group
(SeqBlocks.blocks for group 0, SeqBlocks.more for the rest), the pool is [group_size, KVH, slots, D],
so a block of any group is the same size and all groups draw from one allocator. A windowed group
gives back its leading blocks (-1 in its table, `SeqBlocks.dead`) once every query from then on
starts past them; with prefix sharing each group has its own cache (`prefixes`), and a windowed
group lets go of a cached block the same way (it stays cached, idle). Imports no gRPC.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fastdecode.contract import chain_hashes, prefix_seed
from fastdecode.kv.blocks import SeqBlocks
from fastdecode.runtime.errors import ResourceExhausted


class WindowGroups:
    """KVStore's layer groups (a mixin: the pools, allocator and caches are the store's)."""

    # the store's, set in KVStore.__init__
    num_layers: int
    block_size: int
    dtype: Any
    layer_windows: tuple[int, ...]
    softcap: float
    seqs: dict[str, SeqBlocks]
    prefixes: list[Any]
    alloc: Any
    k: Any
    v: Any
    k_scale: Any
    v_scale: Any
    capacity_tokens: int
    free_tokens: int
    journal: Any
    _geometry: tuple[int, int, int]

    def _allocate(self, n: int) -> list[int] | None: ...
    def _set_blocks(self, seq: SeqBlocks, blocks: list[int]) -> None: ...
    def _blocks_changed(self, seq: SeqBlocks) -> None: ...

    def _group_layers(self) -> None:
        """Layer groups (vLLM's hybrid allocator does the same): the layers of one window size are
        cut into groups of `group_size` layers (the gcd of the counts per window size), and each
        sequence has one block table per group; the pool is [group_size, KVH, slots, D], so a block
        of any group is the same size and all groups draw from one allocator. A windowed group gives
        its leading blocks back once its window has passed them. Without windows: one group of
        every layer, one table per sequence."""
        L = self.num_layers
        windows = self.layer_windows or (0,) * L
        by_window: dict[int, list[int]] = {}
        for layer, w in enumerate(windows):
            by_window.setdefault(w, []).append(layer)
        self.group_size = math.gcd(*(len(ls) for ls in by_window.values()))
        self.grouped = bool(self.layer_windows)
        self._group_of = [0] * L
        self._member = [0] * L
        self.group_windows: list[int] = []
        self.group_first: list[int] = []  # a layer of each group (they hold the same positions)
        for w, layers in by_window.items():
            for i in range(0, len(layers), self.group_size):
                g = len(self.group_windows)
                self.group_windows.append(w)
                self.group_first.append(layers[i])
                for j, layer in enumerate(layers[i : i + self.group_size]):
                    self._group_of[layer], self._member[layer] = g, j
        self.num_groups = len(self.group_windows)

    def _first_key(self, g: int, pos: int) -> int:
        """The first key a query at `pos` sees on group g's layers."""
        w = self.group_windows[g]
        return max(0, pos - w + 1) if w else 0

    def _tab(self, seq: SeqBlocks, g: int) -> list[int]:
        return seq.blocks if g == 0 else seq.more[g - 1]

    # ---- capacity ---------------------------------------------------------------------------
    # A token here is one position on every layer: a windowed store's blocks are 1/num_groups of one.

    def held_of(self, seq: SeqBlocks) -> float:
        """Tokens (each a position on every layer) the sequence holds in a windowed store, its own
        blocks' (blocks read from a prefix cache count once, in tokens_held)."""
        held = 0
        for g, first in enumerate(self.group_first):
            own = max(seq.dead[g], seq.gfrozen[g]) if seq.gfrozen else seq.dead[g]
            held += max(0, seq.lengths[first] - own * self.block_size)
        return held / self.num_groups

    def _reserve_grouped(self, seq_id: str, tokens: int, token_ids: list[int] | None, model: str) -> int:
        """reserve() for a windowed store. With sharing, the longest m cached blocks such that every
        full group holds blocks 0..m-1 cached and every windowed group the ones its first query
        (position m * block_size) still sees; a windowed group's table starts with -1 below those."""
        bs, groups = self.block_size, range(self.num_groups)
        n = math.ceil(tokens / bs)
        hashes: list[bytes] = []
        m = 0
        if self.prefixes and token_ids:
            seed = prefix_seed(
                f"{model}|windows {self.layer_windows}|cap {self.softcap}",
                str(self.dtype),
                self._geometry,
                bs,
            )
            hashes = chain_hashes(seed, token_ids, bs)
            m = (len(token_ids) - 1) // bs
            for g in groups:  # full groups: a prefix run
                if not self.group_windows[g]:
                    run = 0
                    while run < m and self.prefixes[g].lookup(hashes[run]) is not None:
                        run += 1
                    m = run
            while m and not all(  # windowed groups: the blocks the first query sees
                self.prefixes[g].lookup(hashes[i]) is not None
                for g in groups
                for i in range(self._first_key(g, m * bs) // bs, m)
            ):
                m -= 1
            p0 = self.prefixes[0]
            p0.queries, p0.hits, p0.hit_blocks = p0.queries + 1, p0.hits + bool(m), p0.hit_blocks + m
        floors = [self._first_key(g, m * bs) // bs for g in groups]
        shared = [[self.prefixes[g].lookup(hashes[i]) for i in range(floors[g], m)] for g in groups]
        for g in groups:  # taken before allocating, so that eviction cannot pick them
            for b in shared[g]:
                self.prefixes[g].acquire(b)  # type: ignore[arg-type]
        blocks = self._allocate((n - m) * self.num_groups)
        if blocks is None:
            for g in groups:
                for b in shared[g]:
                    self.prefixes[g].release(b)  # type: ignore[arg-type]
            raise ResourceExhausted(
                f"KV pool full: {tokens} tokens requested, {self.free_tokens} free of {self.capacity_tokens}"
            )
        own = n - m
        tables = [[-1] * floors[g] + shared[g] + blocks[g * own : (g + 1) * own] for g in groups]
        seq = SeqBlocks([], 0, [m * bs] * self.num_layers, True, hashes=hashes)
        seq.more, seq.dead, seq.gfrozen = tables[1:], floors, [m] * self.num_groups
        self._set_blocks(seq, tables[0])  # type: ignore[arg-type]
        self.seqs[seq_id] = seq
        if self.journal is not None:
            self.journal.added(seq_id, seq)
        return m * bs

    def _recycle(self, seq: SeqBlocks, g: int, start: int) -> None:
        """Give back group g's leading blocks that no query from position `start` on sees (only a
        windowed group has any); their table entries become -1."""
        floor = self._first_key(g, start) // self.block_size
        dead = seq.dead[g]
        if floor <= dead:
            return
        tab = self._tab(seq, g)
        self._let_go(seq, g, range(dead, min(floor, len(tab))))
        tab[dead : min(floor, len(tab))] = [-1] * (min(floor, len(tab)) - dead)
        tab.extend([-1] * (floor - len(tab)))  # positions never held (a fill straight to `start`)
        seq.dead[g] = floor
        self._blocks_changed(seq)

    def _let_go(self, seq: SeqBlocks, g: int, indices: Iterable[int]) -> None:
        """Group g's blocks at these table indices leave the sequence: a cached one is read no
        more (it stays cached, idle when no one else reads it), its own go back to the free list."""
        tab, cached = self._tab(seq, g), seq.gfrozen[g] if seq.gfrozen else 0
        own = []
        for i in indices:
            b = tab[i]
            if b < 0:
                continue
            if i < cached:
                self.prefixes[g].release(b)
            else:
                own.append(b)
        self.alloc.release(own)

    def _grow_group(self, seqs: list[SeqBlocks], seq_ids: list[str], ends: list[int], g: int) -> None:
        """_grow for one layer group of a windowed store: all or nothing over the sequences."""
        taken: list[tuple[SeqBlocks, list[int]]] = []
        short: list[str] = []
        for seq, sid, end in zip(seqs, seq_ids, ends, strict=True):
            tab = self._tab(seq, g)
            want = -(-end // self.block_size) - len(tab)
            if want <= 0:
                continue
            got = self._allocate(want)
            if got is None:
                short.append(sid)
                continue
            taken.append((seq, got))
        if short:
            for _, got in taken:
                self.alloc.release(got)
            raise ResourceExhausted(
                f"KV pool full: no free block for sequence(s) {', '.join(map(repr, short))} "
                f"({self.capacity_tokens} tokens, all in use)"
            )
        for seq, got in taken:
            if g == 0:
                self._set_blocks(seq, seq.blocks + got)
            else:
                seq.more[g - 1].extend(got)
                self._blocks_changed(seq)

    def _live(self, seq: SeqBlocks) -> list[int]:
        """Every block a sequence of a windowed store holds, in all its groups."""
        return [b for g in range(self.num_groups) for b in self._tab(seq, g) if b >= 0]

    def _publish_group(self, seq: SeqBlocks, g: int) -> None:
        """_publish for one group of a windowed store, once every layer of the group has written
        a full block of known tokens (a block its window already let go is not cached)."""
        if not self.prefixes or seq.gfrozen[g] >= len(seq.hashes):
            return
        lengths = [seq.lengths[layer] for layer in range(self.num_layers) if self._group_of[layer] == g]
        done = min(min(lengths) // self.block_size, len(seq.hashes))
        p, tab, changed = self.prefixes[g], self._tab(seq, g), False
        for i in range(seq.gfrozen[g], done):
            h, mine = seq.hashes[i], tab[i]
            theirs = p.lookup(h)
            if mine < 0:
                continue
            if theirs is None:
                p.insert(h, mine)
            else:
                p.acquire(theirs)
                self.alloc.release([mine])
                tab[i], changed = theirs, True
        if done > seq.gfrozen[g] and self.journal is not None:
            self.journal.changed(seq)
        seq.gfrozen[g] = max(seq.gfrozen[g], done)
        if changed:
            self._blocks_changed(seq)

    def _unfreeze_group(self, seq: SeqBlocks, g: int, start: int) -> None:
        """_unfreeze for one group of a windowed store (a rerun from below its cached blocks)."""
        first = start // self.block_size
        if not seq.gfrozen or first >= seq.gfrozen[g]:
            return
        p, tab = self.prefixes[g], self._tab(seq, g)
        live = [i for i in range(first, seq.gfrozen[g]) if tab[i] >= 0]
        read = [i for i in live if p.readers(tab[i]) > 1]
        copies = self._allocate(len(read))
        if copies is None:
            raise ResourceExhausted("KV pool full: no free block to copy a shared prefix block into")
        bs = self.block_size
        for i, new in zip(read, copies, strict=True):
            b = tab[i]
            for pool in (self.k, self.v, self.k_scale, self.v_scale):
                if pool.dim() > 1:
                    pool[:, :, new * bs : (new + 1) * bs] = pool[:, :, b * bs : (b + 1) * bs]
            p.release(b)
            tab[i] = new
        for i in live:
            if i not in read:
                p.forget(tab[i])
        seq.gfrozen[g] = first
        self._blocks_changed(seq)
