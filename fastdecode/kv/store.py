"""The R-part core: a byte-bounded, block-based KV pool and attention over it.

Layout: one pool per K and V of shape [layers, kv_heads, num_blocks * block_size, head_dim]
(head-major: one head of one sequence is a contiguous [tokens, head_dim] run within a block).
Storage dtypes: float32, float16, bfloat16, and int8 with one float32 scale per (token, KV head)
(pools `k_scale`/`v_scale` of shape [layers, kv_heads, slots]). A sequence's blocks are its
block table (`_Seq.blocks`); token `pos` lives in slot blocks[pos // block_size] * block_size +
pos % block_size. Blocks on demand: a sequence is admitted with the blocks for the tokens it holds
(its prompt) and its block table grows one block at a time as attention appends past its last
block, so the pool holds what sequences really use, not their max_tokens. When no block is free
the call fails with ResourceExhausted and nothing of it is kept; the scheduler then preempts a
sequence (frees its blocks, recomputes it later). A new block extends the sequence's run in place
when the next block is free, so a sequence stays one contiguous run as long as its neighbours allow.

Shared prefixes (fastdecode/kv/prefix.py, on unless prefix_sharing=False): a reservation that brings
its token ids gets the cached blocks of its longest full-block prefix in its block table (read-only,
`_Seq.frozen` leading blocks) and starts with those positions already held; it computes only the
rest. Its own full blocks of the given tokens join the cache once every layer has written them
(`_publish`). On release a cached block goes back to the cache, idle blocks are evicted LRU when an
allocation finds no free block, and a write below `frozen` first makes the block its own again
(`_unfreeze`: private again when no one else reads it, else a copy), so a read block is never
overwritten and never freed.

Two attention backends, one result:
- "native" (default): fastdecode/kv/csrc/attention.cpp, one fused call per Attend item that
  appends k, v and attends every sequence (decode and prefill chunks) through the block tables,
  in place, threads split over (sequence, KV head) by length. Whoever changes how blocks are
  allocated only has to keep `_Seq.blocks` the table and call `_blocks_changed`.
- "torch": the reference. SDPA over a strided view when every sequence decodes one token at the
  same position from contiguous, equally spaced reservations; otherwise per sequence (gathering
  scattered blocks and dequantizing int8).
Imports no gRPC.
"""

from __future__ import annotations

import bisect
import math
import mmap
import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fastdecode.kv import native
from fastdecode.kv.prefix import PrefixCache, chain_hashes, prefix_seed
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound, ResourceExhausted

KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
BACKENDS = ("native", "torch")
_INT8_MAX = 127.0
_HUGE_PAGE = 2 << 20


def kv_bytes_per_element(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one cached element costs, counting int8's float32 scale per (token, head) row."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize + (4 / head_dim if dtype == torch.int8 else 0)


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


@dataclass
class _Seq:
    blocks: list[int]  # the block table: blocks[i] holds positions i*block_size .. (i+1)*block_size-1
    capacity: int  # tokens its blocks hold
    lengths: list[int]  # tokens held per layer
    contiguous: bool
    slots: torch.Tensor | None = field(default=None)  # token slot index when scattered (torch path)
    tables: dict[int, torch.Tensor] = field(default_factory=dict)  # int32 block tables per layer group
    hashes: list[bytes] = field(default_factory=list)  # names of the full blocks of its known tokens
    frozen: int = 0  # leading blocks owned by the prefix cache: read, never written
    # Windowed stores: the block tables of layer groups 1.. (group 0's is `blocks`), and per group
    # the leading blocks given back (-1 in the table) because every window has passed them.
    more: list[list[int]] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    # ... and per group, the leading blocks the group's prefix cache owns (read, never written; those
    # below `dead` were let go)
    gfrozen: list[int] = field(default_factory=list)


class BlockAllocator:
    """Free runs of blocks kept as sorted (start, length) intervals; first fit, then scatter."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._starts: list[int] = [0] if num_blocks else []
        self._lens: list[int] = [num_blocks] if num_blocks else []
        self.free = num_blocks

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


class KVStore:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity_bytes: int,
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        backend: str = "native",
        prefix_sharing: bool = True,
        layer_windows: Sequence[int] = (),
        softcap: float = 0.0,
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, block_size) < 1:
            raise InvalidInput("KV geometry must be positive")
        if layer_windows and len(layer_windows) != num_layers or any(w < 0 for w in layer_windows):
            raise InvalidInput(f"layer windows {list(layer_windows)} do not fit {num_layers} layers")
        if softcap < 0:
            raise InvalidInput(f"the logit soft-cap must be >= 0, got {softcap}")
        if dtype not in KV_DTYPES.values():
            raise InvalidInput(f"KV dtype must be one of {sorted(KV_DTYPES)}, got {dtype}")
        if backend not in BACKENDS:
            raise InvalidInput(f"attention backend must be one of {list(BACKENDS)}, got {backend!r}")
        # Fails here, with one line naming the fix, when the extension is not built.
        self._native = native.load() if backend == "native" else None
        self.backend = backend
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # per layer: keys a query sees (0: all); () when no layer has a window
        self.layer_windows: tuple[int, ...] = tuple(layer_windows) if any(layer_windows) else ()
        self.softcap = float(softcap)
        self.dtype = dtype
        self.block_size = block_size
        self.quantized = dtype == torch.int8
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        row_bytes = head_dim * self.itemsize + (4 if self.quantized else 0)  # + int8's scale
        self.bytes_per_token = 2 * num_layers * num_kv_heads * row_bytes
        self._group_layers()
        # A block holds block_size tokens of the `group_size` layers of one layer group.
        block_bytes = 2 * self.group_size * num_kv_heads * row_bytes * block_size
        self.num_blocks = max(0, capacity_bytes // block_bytes)
        self.capacity_bytes = self.num_blocks * block_bytes
        slots = self.num_blocks * block_size
        # Untouched pages: memory is committed as sequences write (2 MiB at a time, huge pages).
        lg = self.group_size
        self.k = huge_page_empty((lg, num_kv_heads, slots, head_dim), dtype)
        self.v = huge_page_empty((lg, num_kv_heads, slots, head_dim), dtype)
        scale_shape = (lg, num_kv_heads, slots) if self.quantized else (0,)
        self.k_scale = huge_page_empty(scale_shape, torch.float32)
        self.v_scale = huge_page_empty(scale_shape, torch.float32)
        self.alloc = BlockAllocator(self.num_blocks)
        self.seqs: dict[str, _Seq] = {}
        # One prefix cache per layer group (a windowed store's groups cache their blocks apart: a
        # windowed group lets go of a cached block once its window has passed it); `prefix` is the
        # one cache of a store without windows.
        self.prefixes: list[PrefixCache] = (
            [PrefixCache() for _ in range(self.num_groups)] if prefix_sharing else []
        )
        self.prefix: PrefixCache | None = self.prefixes[0] if prefix_sharing and not self.grouped else None
        self._importing: dict[str, _Seq] = {}  # live migration: blocks taken, not yet held
        self.busy_seconds = 0.0
        self.attend_calls = 0
        self._tables: dict[int, tuple[tuple[str, ...], torch.Tensor, torch.Tensor]] = {}

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

    def _tab(self, seq: _Seq, g: int) -> list[int]:
        return seq.blocks if g == 0 else seq.more[g - 1]

    # ---- capacity ---------------------------------------------------------------------------
    # A token here is one position on every layer: a windowed store's blocks are 1/num_groups of one.
    @property
    def free_tokens(self) -> int:
        return self.blocks_free * self.block_size // self.num_groups

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size // self.num_groups

    @property
    def tokens_held(self) -> int:
        """Distinct tokens the sequences hold: a shared prefix block counts once, a windowed layer
        counts the positions it still holds (its window, in whole blocks)."""
        if self.grouped:
            read = sum(p.read_blocks for p in self.prefixes) * self.block_size / self.num_groups
            return round(sum(map(self.held_of, self.seqs.values())) + read)
        own = sum(s.lengths[-1] - s.frozen * self.block_size for s in self.seqs.values())
        return own + (self.prefix.read_blocks * self.block_size if self.prefix is not None else 0)

    @property
    def blocks_in_use(self) -> int:
        """Blocks sequences hold (each shared block once); idle cached blocks count as free."""
        return self.num_blocks - self.blocks_free

    @property
    def blocks_free(self) -> int:
        return self.alloc.free + sum(p.idle_blocks for p in self.prefixes)

    @property
    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's counters and sizes (all 0 with sharing off)."""
        if not self.prefixes:
            return dict.fromkeys(
                ("queries", "hits", "hit_tokens", "evictions", "cached_blocks", "shared_bytes"), 0
            )
        p, g = self.prefixes[0], self.num_groups  # a windowed store counts queries on group 0's cache
        return {
            "queries": p.queries,
            "hits": p.hits,
            "hit_tokens": p.hit_blocks * self.block_size,
            "evictions": sum(c.evictions for c in self.prefixes) // g,
            "cached_blocks": sum(c.cached_blocks for c in self.prefixes) // g,
            # KV memory sharing saves now: every reader past the first of a block reads no copy
            "shared_bytes": sum(c.extra_readers for c in self.prefixes)
            * self.block_size
            * self.bytes_per_token
            // g,
        }

    @property
    def tokens_reserved(self) -> int:
        """Tokens the blocks in use hold (tokens held, rounded up to whole blocks per sequence)."""
        return self.capacity_tokens - self.free_tokens

    def held_of(self, seq: _Seq) -> float:
        """Tokens (each a position on every layer) the sequence holds in a windowed store, its own
        blocks' (blocks read from a prefix cache count once, in tokens_held)."""
        held = 0
        for g, first in enumerate(self.group_first):
            own = max(seq.dead[g], seq.gfrozen[g]) if seq.gfrozen else seq.dead[g]
            held += max(0, seq.lengths[first] - own * self.block_size)
        return held / self.num_groups

    @property
    def bytes_used(self) -> int:
        return self.tokens_held * self.bytes_per_token

    def geometry_matches(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        layer_windows: Sequence[int] = (),
        softcap: float = 0.0,
    ) -> bool:
        windows = tuple(layer_windows) if any(layer_windows) else ()
        return (num_layers, num_kv_heads, head_dim, windows, float(softcap)) == (
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.layer_windows,
            self.softcap,
        )

    def window(self, layer: int) -> int:
        """Keys a query of `layer` sees, itself included (0: every key before it)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def reserve_many(
        self,
        requests: list[tuple[str, int]] | list[tuple[str, int, list[int]]],
        model: str = "",
    ) -> list[int]:
        """Reserve all or nothing: on failure every block taken here is given back. Each request is
        (seq_id, tokens) or (seq_id, tokens, token_ids); returns each one's cached tokens."""
        done: list[str] = []
        cached: list[int] = []
        try:
            for seq_id, max_tokens, *ids in requests:
                cached.append(self.reserve(seq_id, max_tokens, ids[0] if ids else None, model))
                done.append(seq_id)
        except Exception:
            for seq_id in done:
                self.release(seq_id)
            raise
        return cached

    def reserve(self, seq_id: str, tokens: int, token_ids: list[int] | None = None, model: str = "") -> int:
        """Admit a sequence with the blocks for `tokens` (its prompt); it grows on demand after that.

        With token_ids (the first tokens it holds) and sharing on, the longest run of cached full
        blocks of them starts its block table, and it already holds those positions on every layer.
        The block of its last given token is always its own (the dense side computes that token to
        sample from it). Returns the tokens it found cached (a multiple of block_size, or 0).
        """
        if not seq_id:
            raise InvalidInput("empty sequence id")
        if tokens < 1:
            raise InvalidInput(f"max_tokens must be >= 1, got {tokens}")
        if seq_id in self.seqs or seq_id in self._importing:
            raise FailedPrecondition(f"sequence {seq_id!r} is already reserved on this shard")
        if token_ids is not None and len(token_ids) > tokens:
            raise InvalidInput(f"{len(token_ids)} token ids for a reservation of {tokens} tokens")
        if self.grouped:
            return self._reserve_grouped(seq_id, tokens, token_ids, model)
        hashes: list[bytes] = []
        shared: list[int] = []
        if self.prefix is not None and token_ids:
            seed = prefix_seed(model, str(self.dtype), self._geometry, self.block_size)
            hashes = chain_hashes(seed, token_ids, self.block_size)
            shared = self.prefix.match(hashes[: (len(token_ids) - 1) // self.block_size])
            for b in shared:  # taken before allocating, so that eviction cannot pick them
                self.prefix.acquire(b)
        n = math.ceil(tokens / self.block_size)
        blocks = self._allocate(n * self.num_groups - len(shared))
        if blocks is None:
            for b in shared:
                self.prefix.release(b)  # type: ignore[union-attr]
            raise ResourceExhausted(
                f"KV pool full: {tokens} tokens requested, {self.free_tokens} free of {self.capacity_tokens}"
            )
        cached = len(shared) * self.block_size
        seq = _Seq([], 0, [cached] * self.num_layers, True, hashes=hashes, frozen=len(shared))
        self._set_blocks(seq, shared + blocks)
        self.seqs[seq_id] = seq
        return cached

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
        seq = _Seq([], 0, [m * bs] * self.num_layers, True, hashes=hashes)
        seq.more, seq.dead, seq.gfrozen = tables[1:], floors, [m] * self.num_groups
        self._set_blocks(seq, tables[0])  # type: ignore[arg-type]
        self.seqs[seq_id] = seq
        return m * bs

    @property
    def _geometry(self) -> tuple[int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    def _allocate(self, n: int) -> list[int] | None:
        """n free blocks, evicting idle cached prefix blocks (least recently used first) when the
        free list is short; None, with nothing evicted, when even that is not enough."""
        short = n - self.alloc.free
        if short > 0:
            if sum(p.idle_blocks for p in self.prefixes) < short:
                return None
            for p in sorted(self.prefixes, key=lambda p: -p.idle_blocks):  # the idlest cache first
                got = p.evict(short)
                self.alloc.release(got)
                short -= len(got)
                if short <= 0:
                    break
        return self.alloc.allocate(n)

    def _set_blocks(self, seq: _Seq, blocks: list[int]) -> None:
        seq.blocks = blocks
        seq.capacity = len(blocks) * self.block_size
        # a grown table need not ascend: compare every block, not just the ends
        seq.contiguous = all(b == blocks[0] + i for i, b in enumerate(blocks))
        seq.slots = None
        if not seq.contiguous and not self.grouped:
            b = torch.tensor(blocks, dtype=torch.int64)
            seq.slots = (b[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)
        self._blocks_changed(seq)

    def grow(self, seq_ids: list[str], ends: list[int]) -> None:
        """Give each sequence the blocks to hold `ends` tokens, a block at a time; all or nothing.

        ResourceExhausted (naming the sequences left short) when the pool runs out: every block taken
        here is given back, so a failed call leaves the pool as it was.
        """
        self._grow([self.seqs[sid] for sid in seq_ids], seq_ids, ends)

    def _recycle(self, seq: _Seq, g: int, start: int) -> None:
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

    def _let_go(self, seq: _Seq, g: int, indices: Iterable[int]) -> None:
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

    def _grow_group(self, seqs: list[_Seq], seq_ids: list[str], ends: list[int], g: int) -> None:
        """_grow for one layer group of a windowed store: all or nothing over the sequences."""
        taken: list[tuple[_Seq, list[int]]] = []
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

    def _grow(self, seqs: list[_Seq], seq_ids: list[str], ends: list[int]) -> None:
        if self.grouped:  # every group (write, tests); attend grows only the group it attends
            for g in range(self.num_groups):
                self._grow_group(seqs, seq_ids, ends, g)
            return
        taken: list[tuple[_Seq, list[int]]] = []
        short: list[str] = []
        for seq, sid, end in zip(seqs, seq_ids, ends, strict=True):
            if end <= seq.capacity:
                continue
            blocks = list(seq.blocks)
            while len(blocks) * self.block_size < end:
                if self.alloc.allocate_after(blocks[-1]):
                    blocks.append(blocks[-1] + 1)
                    continue
                one = self._allocate(1)
                if one is None:
                    break
                blocks.extend(one)
            taken.append((seq, blocks))
            if len(blocks) * self.block_size < end:
                short.append(sid)
        if short:
            for seq, blocks in taken:
                self.alloc.release(blocks[len(seq.blocks) :])
            raise ResourceExhausted(
                f"KV pool full: no free block for sequence(s) {', '.join(map(repr, short))} "
                f"({self.capacity_tokens} tokens, all in use)"
            )
        for seq, blocks in taken:
            self._set_blocks(seq, blocks)

    def release(self, seq_id: str) -> bool:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        self._tables.clear()
        if self.grouped:  # the last block first: an idle prefix's tail is evicted before its head
            for g in range(self.num_groups):
                self._let_go(seq, g, reversed(range(len(self._tab(seq, g)))))
            return True
        own = seq.blocks
        if self.prefix is not None and seq.frozen:
            # the last block first: an idle prefix's tail is evicted before the blocks leading to it
            for b in reversed(seq.blocks[: seq.frozen]):
                self.prefix.release(b)
            own = seq.blocks[seq.frozen :]
        self.alloc.release(own)
        return True

    def _live(self, seq: _Seq) -> list[int]:
        """Every block a sequence of a windowed store holds, in all its groups."""
        return [b for g in range(self.num_groups) for b in self._tab(seq, g) if b >= 0]

    # ---- shared prefixes ------------------------------------------------------------------------
    def _publish_group(self, seq: _Seq, g: int) -> None:
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
        seq.gfrozen[g] = max(seq.gfrozen[g], done)
        if changed:
            self._blocks_changed(seq)

    def _unfreeze_group(self, seq: _Seq, g: int, start: int) -> None:
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

    def _publish(self, seq: _Seq) -> None:
        """Hand the sequence's full blocks of known tokens to the prefix cache once every layer has
        written them. A block someone cached meanwhile (the same prefix computed twice) replaces the
        sequence's copy, which is freed."""
        p = self.prefix
        if p is None or seq.frozen >= len(seq.hashes):
            return
        done = min(min(seq.lengths) // self.block_size, len(seq.hashes))
        if seq.frozen >= done:
            return
        swapped = False
        for i in range(seq.frozen, done):
            h, mine = seq.hashes[i], seq.blocks[i]
            theirs = p.lookup(h)
            if theirs is None:
                p.insert(h, mine)
            else:
                p.acquire(theirs)
                self.alloc.release([mine])
                seq.blocks[i], swapped = theirs, True
        seq.frozen = done
        if swapped:
            self._set_blocks(seq, seq.blocks)

    def _unfreeze(self, seq: _Seq, start: int) -> None:
        """Make the blocks from position `start` on the sequence's own before it writes there (an
        aborted step rerun from an earlier position): a cached block that only it reads leaves the
        cache; one that others read is copied first (copy-on-write), so theirs stays as it was."""
        first = start // self.block_size
        if first >= seq.frozen:
            return
        p = self.prefix
        assert p is not None  # frozen blocks exist only with sharing on
        blocks = list(seq.blocks)
        read = [i for i in range(first, seq.frozen) if p.readers(blocks[i]) > 1]
        copies = self._allocate(len(read))  # all first: a failure leaves the sequence as it was
        if copies is None:
            raise ResourceExhausted("KV pool full: no free block to copy a shared prefix block into")
        for i, new in zip(read, copies, strict=True):
            b = blocks[i]
            src = slice(b * self.block_size, (b + 1) * self.block_size)
            dst = slice(new * self.block_size, (new + 1) * self.block_size)
            for pool in (self.k, self.v, self.k_scale, self.v_scale):
                if pool.dim() > 1:
                    pool[:, :, dst] = pool[:, :, src]
            p.release(b)
            blocks[i] = new
        for i in range(first, seq.frozen):
            if i not in read:
                p.forget(blocks[i])
        seq.frozen = first
        self._set_blocks(seq, blocks)

    # ---- live migration: a sequence's rows out of one pool and into another --------------------
    def export_layer(self, seq_id: str, layer: int) -> tuple[torch.Tensor, ...]:
        """One layer of a sequence as stored: k, v [KVH, n, D] in the pool dtype (copies), plus
        int8's scales [KVH, n] (empty otherwise). n is what every layer holds at a step boundary."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"sequence {seq_id!r} is not held by this shard")
        if not 0 <= layer < self.num_layers:
            raise InvalidInput(f"layer {layer} outside [0, {self.num_layers})")
        g, m = self._group_of[layer], self._member[layer]
        slots = self._slots(seq, min(seq.lengths), g)[self.layer_first(seq_id, layer) :]
        out = [self.k[m][:, slots].clone(), self.v[m][:, slots].clone()]
        if self.quantized:
            out += [self.k_scale[m][:, slots].clone(), self.v_scale[m][:, slots].clone()]
        else:
            out += [torch.empty(0), torch.empty(0)]
        return tuple(out)

    def layer_first(self, seq_id: str, layer: int) -> int:
        """The first position export_layer sends: 0, or where a windowed layer's blocks begin."""
        seq = self.seqs[seq_id]
        return seq.dead[self._group_of[layer]] * self.block_size if self.grouped else 0

    def _slots(self, seq: _Seq, n: int, g: int = 0) -> torch.Tensor:
        """Pool slots of positions 0..n-1 in group g's table (-1 blocks give negative slots)."""
        pos = torch.arange(n)
        blocks = torch.tensor(self._tab(seq, g), dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _put(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, KVH, D] of one layer at pool slots (quantizing for int8)."""
        m = self._member[layer]
        for pool, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            rows = new.transpose(0, 1)  # [KVH, n, D]
            if self.quantized:
                pool[m][:, slots], scales[m][:, slots] = quantize_int8(rows)
            else:
                pool[m][:, slots] = rows.to(self.dtype)

    def begin_import(self, seq_id: str, tokens: int) -> None:
        """Take the blocks for an incoming sequence of `tokens`; it is not held (no Attend, no
        Stats) until commit_import. ResourceExhausted when the pool has no room."""
        if seq_id in self.seqs or seq_id in self._importing:
            raise FailedPrecondition(f"sequence {seq_id!r} is already held by this shard")
        if tokens < 1:
            raise InvalidInput(f"an imported sequence holds >= 1 token, got {tokens}")
        n = math.ceil(tokens / self.block_size)
        # a windowed group takes only the blocks the next query (at `tokens`) sees
        dead = [self._first_key(g, tokens) // self.block_size for g in range(self.num_groups)]
        blocks = self._allocate(  # idle cached prefix blocks make room too
            sum(n - d for d in dead)
        )
        if blocks is None:
            raise ResourceExhausted(
                f"KV pool full: {tokens} tokens to import, {self.free_tokens} free of {self.capacity_tokens}"
            )
        tables, i = [], 0
        for d in dead:
            tables.append([-1] * d + blocks[i : i + n - d])
            i += n - d
        seq = _Seq([], 0, [0] * self.num_layers, True, more=tables[1:], dead=dead, gfrozen=[0] * len(dead))
        self._set_blocks(seq, tables[0])
        self._importing[seq_id] = seq

    def import_layer(self, seq_id: str, layer: int, rows: Sequence[torch.Tensor], first: int = 0) -> int:
        """Write one exported layer (k, v and int8's scales, of positions first..) of an import;
        returns its bytes. A windowed layer keeps the rows its window still sees."""
        seq = self._importing.get(seq_id)
        if seq is None:
            raise NotFound(f"no import of sequence {seq_id!r} in progress")
        if not 0 <= layer < self.num_layers or seq.lengths[layer]:
            raise InvalidInput(f"layer {layer} outside [0, {self.num_layers}) or sent twice")
        k, v, ks, vs = rows
        n = k.shape[1] if k.dim() == 3 else -1
        shape = (self.num_kv_heads, n, self.head_dim)
        if n < 1 or tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != self.dtype:
            raise InvalidInput(
                f"layer rows must be {self.dtype} [{self.num_kv_heads}, n, {self.head_dim}], "
                f"got {k.dtype} {list(k.shape)}"
            )
        g, m = self._group_of[layer], self._member[layer]
        keep = (seq.dead[g] if self.grouped else 0) * self.block_size  # first position it holds
        if v.dtype != self.dtype or first + n > len(self._tab(seq, g)) * self.block_size:
            raise InvalidInput(f"v rows of {v.dtype} or {first + n} tokens do not fit the import")
        if not 0 <= first <= keep:
            raise InvalidInput(f"layer {layer} rows start at position {first}, the import needs {keep} on")
        if self.quantized and (tuple(ks.shape) != shape[:2] or tuple(vs.shape) != shape[:2]):
            raise InvalidInput(f"int8 rows need scales of shape {list(shape[:2])}")
        slots = self._slots(seq, first + n, g)[keep:]
        cut = keep - first
        self.k[m][:, slots], self.v[m][:, slots] = k[:, cut:], v[:, cut:]
        if self.quantized:
            self.k_scale[m][:, slots], self.v_scale[m][:, slots] = ks[:, cut:].float(), vs[:, cut:].float()
        seq.lengths[layer] = first + n
        return sum(t.numel() * t.element_size() for t in rows)

    def commit_import(self, seq_id: str) -> int:
        """The last layer arrived: the sequence is held from now on. Returns its tokens."""
        seq = self._importing.get(seq_id)
        if seq is None:
            raise NotFound(f"no import of sequence {seq_id!r} in progress")
        if len(set(seq.lengths)) != 1 or not seq.lengths[0]:
            raise InvalidInput(f"import of {seq_id!r} is missing layers (tokens per layer {seq.lengths})")
        self.seqs[seq_id] = self._importing.pop(seq_id)
        return seq.lengths[0]

    def abort_import(self, seq_id: str) -> None:
        """Free an unfinished import's blocks (the stream broke); unknown ids are ignored."""
        seq = self._importing.pop(seq_id, None)
        if seq is not None:
            self.alloc.release(self._live(seq) if self.grouped else seq.blocks)

    def _blocks_changed(self, seq: _Seq) -> None:
        """Call after changing a block table: drops the cached int32 tables the native kernel reads."""
        seq.tables.clear()
        self._tables.clear()

    def write(self, layer: int, seq_id: str, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, KVH, D] at positions start.. of one sequence without attending
        (benchmarks and tests fill long caches this way; decode appends through attend)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"sequence {seq_id!r} is not held by this shard")
        n = k.shape[0]
        shape = (n, self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise InvalidInput(f"k/v must have shape {list(shape)}")
        if not 0 <= layer < self.num_layers or not 0 <= start <= seq.lengths[layer]:
            raise InvalidInput(f"layer {layer} / start {start} outside what sequence {seq_id!r} holds")
        g = self._group_of[layer]
        if self.grouped:
            if start < seq.dead[g] * self.block_size:
                raise FailedPrecondition(f"positions before {seq.dead[g] * self.block_size} left the window")
            self._unfreeze_group(seq, g, start)
            self._grow_group([seq], [seq_id], [start + n], g)
        else:
            self.grow([seq_id], [start + n])
            self._unfreeze(seq, start)
        self._put(layer, self._slots(seq, start + n, g)[start:], k, v)
        seq.lengths[layer] = max(seq.lengths[layer], start + n)
        if self.grouped and self.prefixes:
            self._publish_group(seq, g)
        elif layer == self.num_layers - 1:  # as attend: the last layer completes a position
            self._publish(seq)

    def fill_synthetic(self, seq_ids: list[str], tokens: int, seed: int = 0) -> int:
        """Give each sequence `tokens` tokens of random K/V in every layer, written straight into
        the pool (no attention: linear in `tokens`, where a causal prefill is quadratic). Values do
        not change what a decode step costs, so one random block serves every layer and sequence.
        Returns the tokens written per sequence."""
        if tokens < 1:
            raise InvalidInput("fill needs tokens >= 1")
        missing = [s for s in seq_ids if s not in self.seqs]
        if missing:
            raise NotFound(f"sequences not held by this shard: {missing[:3]}")
        gen = torch.Generator().manual_seed(seed)
        k = torch.randn(tokens, self.num_kv_heads, self.head_dim, generator=gen)
        v = torch.randn(tokens, self.num_kv_heads, self.head_dim, generator=gen)
        if self.grouped:  # a windowed group takes only the blocks its window still sees
            for sid in seq_ids:
                seq = self.seqs[sid]
                for g in range(self.num_groups):
                    self._recycle(seq, g, tokens)
                    self._grow_group([seq], [sid], [tokens], g)
                    first = seq.dead[g] * self.block_size
                    slots = self._slots(seq, tokens, g)[first:]
                    for layer in range(self.num_layers):
                        if self._group_of[layer] == g:
                            self._put(layer, slots, k[first:], v[first:])
                            seq.lengths[layer] = tokens
            return tokens
        for sid in seq_ids:
            for layer in range(self.num_layers):
                self.write(layer, sid, 0, k, v)
        return tokens

    # ---- attention --------------------------------------------------------------------------
    def _check(
        self,
        layer: int,
        seq_ids: list[str],
        num_tokens: list[int],
        start_pos: list[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> list[_Seq]:
        """Validates one attend call; returns its sequences, in order."""
        if not 0 <= layer < self.num_layers:
            raise InvalidInput(f"layer {layer} outside [0, {self.num_layers})")
        if not (len(seq_ids) == len(num_tokens) == len(start_pos)):
            raise InvalidInput("seq_ids, num_tokens and start_pos differ in length")
        if any(n < 1 for n in num_tokens):
            raise InvalidInput("every sequence needs at least one new token")
        total = sum(num_tokens)
        kv_shape = (total, self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape:
            raise InvalidInput(f"k/v must have shape {list(kv_shape)}, got {list(k.shape)} / {list(v.shape)}")
        if (
            q.dim() != 3
            or q.shape[0] != total
            or q.shape[2] != self.head_dim
            or q.shape[1] % self.num_kv_heads
        ):
            raise InvalidInput(
                f"q must have shape [{total}, a multiple of {self.num_kv_heads}, {self.head_dim}], "
                f"got {list(q.shape)}"
            )
        for t in (q, k, v):
            if not t.is_floating_point():
                raise InvalidInput(f"q/k/v must be floating point, got {t.dtype}")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidInput("a sequence appears twice in one attend call")
        seqs: list[_Seq] = []
        # Messages name a sequence by its place in the call, not its id: the error reaches every
        # request of the batch, which must not learn the others' ids.
        for i, (sid, start) in enumerate(zip(seq_ids, start_pos, strict=True)):
            seq = self.seqs.get(sid)
            if seq is None:
                raise NotFound(f"sequence {i} of {len(seq_ids)} in this call is not held by this shard")
            if not 0 <= start <= seq.lengths[layer]:
                raise InvalidInput(
                    f"sequence {i} of {len(seq_ids)} layer {layer}: start_pos {start} leaves a gap "
                    f"(holds {seq.lengths[layer]} tokens)"
                )
            if self.grouped:
                g = self._group_of[layer]
                if self._first_key(g, start) // self.block_size < seq.dead[g]:
                    raise FailedPrecondition(
                        f"sequence {i} of {len(seq_ids)} layer {layer}: start_pos {start} needs keys "
                        f"its window gave back (it holds positions {seq.dead[g] * self.block_size} on)"
                    )
            seqs.append(seq)
        return seqs

    def attend(
        self,
        layer: int,
        seq_ids: list[str],
        num_tokens: list[int],
        start_pos: list[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Append k, v at start_pos and attend q causally over each sequence's cache.

        q [T, H, D], k/v [T, KVH, D], packed in seq order; returns o [T, H*D] in q's dtype.
        """
        seqs = self._check(layer, seq_ids, num_tokens, start_pos, q, k, v)
        ends = list(map(operator.add, start_pos, num_tokens))
        if self.grouped:  # this layer's group only: give back what its window passed, then grow
            g = self._group_of[layer]
            for seq, start in zip(seqs, start_pos, strict=True):
                self._recycle(seq, g, start)
                self._unfreeze_group(seq, g, start)
            self._grow_group(seqs, seq_ids, ends, g)
        else:
            self._grow(seqs, seq_ids, ends)
        for seq, start in zip(seqs, start_pos, strict=True):
            if start < seq.frozen * self.block_size:
                self._unfreeze(seq, start)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self._native is not None:
                out = self._attend_native(layer, seq_ids, num_tokens, start_pos, q, k, v)
                for seq, end in zip(seqs, ends, strict=True):
                    held = seq.lengths
                    if held[layer] < end:
                        held[layer] = end
            else:
                out = None
                if self.grouped:
                    out = self._attend_grouped(layer, seq_ids, num_tokens, start_pos, q, k, v)
                elif not self.quantized and not self.softcap:
                    out = self._attend_uniform_decode(layer, seq_ids, num_tokens, start_pos, q, k, v)
                if out is None:
                    out = self._attend_each(layer, seq_ids, num_tokens, start_pos, q, k, v)
        if self.prefix is not None and layer == self.num_layers - 1:
            for seq in seqs:
                self._publish(seq)
        elif self.grouped and self.prefixes:
            for seq in seqs:
                self._publish_group(seq, self._group_of[layer])
        self.busy_seconds += time.perf_counter() - t0
        self.attend_calls += 1
        return out

    def _block_tables(self, seq_ids: list[str], g: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated int32 block tables of layer group g and their offsets; reused while the
        call's sequences and their blocks stay the same (every layer of a step asks for the same ones)."""
        key = tuple(seq_ids)
        cached = self._tables.get(g)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        parts = []
        for sid in seq_ids:
            seq = self.seqs[sid]
            part = seq.tables.get(g)
            if part is None:
                part = seq.tables[g] = torch.tensor(self._tab(seq, g), dtype=torch.int32)
            parts.append(part)
        offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(p) for p in parts], dtype=torch.int64), 0, out=offsets[1:])
        table = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
        self._tables[g] = (key, table, offsets)
        return table, offsets

    def _attend_native(
        self,
        layer: int,
        seq_ids: list[str],
        num_tokens: list[int],
        start_pos: list[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        table, offsets = self._block_tables(seq_ids, self._group_of[layer])
        m = self._member[layer]
        scales = (self.k_scale[m], self.v_scale[m]) if self.quantized else (None, None)
        o = self._native.attend(  # type: ignore[union-attr]
            q.float().contiguous(),
            k.float().contiguous(),
            v.float().contiguous(),
            self.k[m],
            self.v[m],
            *scales,
            table,
            offsets,
            # through numpy: a third of torch.tensor's time for a list of ints
            torch.from_numpy(np.array(start_pos, dtype=np.int64)),
            torch.from_numpy(np.array(num_tokens, dtype=np.int64)),
            self.block_size,
            1.0 / math.sqrt(self.head_dim),
            self.window(layer),
            self.softcap,
        )
        return o.to(q.dtype)  # attend() records the new lengths

    def _attend_uniform_decode(
        self,
        layer: int,
        seq_ids: list[str],
        num_tokens: list[int],
        start_pos: list[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor | None:
        """One batched SDPA when all sequences decode at one position from evenly spaced runs.

        Returns None (caller loops per sequence) when the call does not have that shape.
        """
        batch = len(seq_ids)
        if batch < 2 or q.shape[0] != batch:  # every sequence brings exactly one token
            return None
        start = start_pos[0]
        seqs = [self.seqs[sid] for sid in seq_ids]
        base0 = seqs[0].blocks[0] * self.block_size
        step = seqs[1].blocks[0] * self.block_size - base0
        if step <= 0:
            return None
        for i, (seq, pos) in enumerate(zip(seqs, start_pos, strict=True)):
            if pos != start or not seq.contiguous or seq.blocks[0] * self.block_size != base0 + i * step:
                return None
        # Block runs are disjoint and each holds >= end tokens (grown above), so step >= end: no overlap.
        end = start + 1
        kvh, dim = self.num_kv_heads, self.head_dim
        views = []
        for pool in (self.k, self.v):
            sh, sslot, sdim = pool.stride(1), pool.stride(2), pool.stride(3)
            views.append(
                pool.as_strided(
                    (kvh, batch, end, dim),
                    (sh, step * sslot, sslot, sdim),
                    pool.storage_offset() + layer * pool.stride(0) + base0 * sslot,
                )
            )
        keys, values = views
        keys[:, :, start] = k.transpose(0, 1)  # [KVH, B, D]; copy_ casts to the pool dtype
        values[:, :, start] = v.transpose(0, 1)
        for seq in seqs:
            seq.lengths[layer] = max(seq.lengths[layer], end)
        heads = q.shape[1]
        # Decode needs no mask; the query heads sharing one kv head ride as that head's query rows.
        qs = q.to(self.dtype).reshape(batch, kvh, heads // kvh, dim)
        o = F.scaled_dot_product_attention(
            qs, keys.transpose(0, 1), values.transpose(0, 1), scale=1.0 / math.sqrt(dim)
        )
        return o.reshape(batch, heads * dim).to(q.dtype)

    def _attend_each(
        self,
        layer: int,
        seq_ids: list[str],
        num_tokens: list[int],
        start_pos: list[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        total, heads, dim = q.shape
        kvh = self.num_kv_heads
        group = heads // kvh
        out = torch.empty(total, heads * dim, dtype=q.dtype)
        kp, vp = self.k[layer], self.v[layer]  # [KVH, slots, D]
        ksp, vsp = (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)
        compute = torch.float32 if self.quantized else self.dtype
        scale = 1.0 / math.sqrt(dim)
        window = self.window(layer)
        row = 0
        for sid, n, start in zip(seq_ids, num_tokens, start_pos, strict=True):
            seq = self.seqs[sid]
            end = start + n
            if seq.contiguous:
                base = seq.blocks[0] * self.block_size
                idx = slice(base, base + end)
                new = slice(base + start, base + end)
            else:
                idx = seq.slots[:end]  # type: ignore[index]
                new = idx[start:end]
            knew, vnew = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            if self.quantized:
                (kp[:, new], ksp[:, new]), (vp[:, new], vsp[:, new]) = (
                    quantize_int8(knew),
                    quantize_int8(vnew),
                )
                keys = kp[:, idx].float() * ksp[:, idx, None]  # type: ignore[index]
                values = vp[:, idx].float() * vsp[:, idx, None]  # type: ignore[index]
            else:
                kp[:, new] = knew.to(self.dtype)
                vp[:, new] = vnew.to(self.dtype)
                keys, values = kp[:, idx], vp[:, idx]
            seq.lengths[layer] = max(seq.lengths[layer], end)
            qn = q[row : row + n].to(compute)
            if window or self.softcap:
                o = self._scores_softmax(qn, keys, values, start, window, scale)
            elif n == 1:  # decode: no mask; query heads of one kv head become its query rows
                o = F.scaled_dot_product_attention(
                    qn.reshape(1, kvh, group, dim), keys.unsqueeze(0), values.unsqueeze(0), scale=scale
                )
            else:  # causal within the chunk, full view of the cached prefix
                mask = None
                if start:
                    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
                o = F.scaled_dot_product_attention(
                    qn.transpose(0, 1).unsqueeze(0),
                    keys.unsqueeze(0),
                    values.unsqueeze(0),
                    attn_mask=mask,
                    is_causal=not start,  # top-left aligned: right when the chunk starts the cache
                    scale=scale,
                    enable_gqa=group > 1,
                )
                o = o.transpose(1, 2)  # [1, n, H, D]
            out[row : row + n] = o.reshape(n, heads * dim).to(q.dtype)
            row += n
        return out

    def _attend_grouped(
        self,
        layer: int,
        seq_ids: list[str],
        num_tokens: list[int],
        start_pos: list[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """The torch backend on a windowed store: per sequence, gather the keys its chunk sees
        through the layer group's table (from the first query's window start on)."""
        total, heads, dim = q.shape
        g, m = self._group_of[layer], self._member[layer]
        kp, vp = self.k[m], self.v[m]
        ksp, vsp = (self.k_scale[m], self.v_scale[m]) if self.quantized else (None, None)
        compute = torch.float32 if self.quantized else self.dtype
        window, bs = self.window(layer), self.block_size
        out = torch.empty(total, heads * dim, dtype=q.dtype)
        row = 0
        for sid, n, start in zip(seq_ids, num_tokens, start_pos, strict=True):
            seq, end = self.seqs[sid], start + n
            lo = self._first_key(g, start)
            blocks = torch.tensor(self._tab(seq, g), dtype=torch.int64)
            pos = torch.arange(lo, end)
            idx = blocks[pos // bs] * bs + pos % bs
            new = idx[start - lo :]
            knew, vnew = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            if self.quantized:
                (kp[:, new], ksp[:, new]), (vp[:, new], vsp[:, new]) = (
                    quantize_int8(knew),
                    quantize_int8(vnew),
                )
                keys = kp[:, idx].float() * ksp[:, idx, None]  # type: ignore[index]
                values = vp[:, idx].float() * vsp[:, idx, None]  # type: ignore[index]
            else:
                kp[:, new], vp[:, new] = knew.to(self.dtype), vnew.to(self.dtype)
                keys, values = kp[:, idx], vp[:, idx]
            seq.lengths[layer] = max(seq.lengths[layer], end)
            o = self._scores_softmax(
                q[row : row + n].to(compute), keys, values, start, window, 1 / math.sqrt(dim), lo
            )
            out[row : row + n] = o.reshape(n, heads * dim).to(q.dtype)
            row += n
        return out

    def _scores_softmax(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        window: int,
        scale: float,
        key0: int = 0,
    ) -> torch.Tensor:
        """Attention written out (SDPA has no soft-cap): q [n, H, D] at positions start.., keys and
        values [KVH, L, D] of positions key0..key0+L-1 -> o [n, H, D]. Scores are q . k * scale,
        then the soft-cap, then the causal and window mask and the softmax, in float32."""
        n, heads, dim = q.shape
        kvh = keys.shape[0]
        qg = q.float().reshape(n, kvh, heads // kvh, dim).permute(1, 2, 0, 3)  # [KVH, G, n, D]
        scores = qg @ keys.float().transpose(1, 2).unsqueeze(1) * scale  # [KVH, G, n, end]
        if self.softcap:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        pos = torch.arange(start, start + n)[:, None]
        key = torch.arange(key0, key0 + keys.shape[1])[None, :]
        visible = key <= pos
        if window:
            visible &= key > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.softmax(scores, -1) @ values.float().unsqueeze(1)  # [KVH, G, n, D]
        return o.permute(2, 0, 1, 3).reshape(n, heads, dim).to(q.dtype)
