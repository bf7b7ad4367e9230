"""The R-part core: a byte-bounded, block-based KV pool and attention over it.

Layout: one pool per K and V of shape [layers, kv_heads, num_blocks * block_size, head_dim]
(head-major: one head of one sequence is a contiguous [tokens, head_dim] run within a block).
Storage dtypes: float32, float16, bfloat16, and int8 and float8 e4m3 with one float32 scale per
(token, KV head) (pools `k_scale`/`v_scale` of shape [layers, kv_heads, slots]). A sequence's blocks
are its block table (`SeqBlocks.blocks`); token `pos` lives in slot blocks[pos // block_size] *
block_size + pos % block_size. Blocks on demand: a sequence is admitted with the blocks for the
tokens it holds (its prompt) and its block table grows one block at a time as attention appends past
its last block, so the pool holds what sequences really use, not their max_tokens. When no block is
free the call fails with ResourceExhausted and nothing of it is kept; the scheduler then preempts a
sequence (frees its blocks, recomputes it later). A new block extends the sequence's run in place
when the next block is free, so a sequence stays one contiguous run as long as its neighbours allow.

Shared prefixes (fastdecode/kv/prefix.py, on unless prefix_sharing=False): a reservation that brings
its token ids gets the cached blocks of its longest full-block prefix in its block table (read-only,
`SeqBlocks.frozen` leading blocks) and starts with those positions already held; it computes only the
rest. Its own full blocks of the given tokens join the cache once every layer has written them
(`_publish`). On release a cached block goes back to the cache, idle blocks are evicted LRU when an
allocation finds no free block, and a write below `frozen` first makes the block its own again
(`_unfreeze`: private again when no one else reads it, else a copy), so a read block is never
overwritten and never freed.

Two attention backends, one result:
- "native" (default): fastdecode/kv/csrc/attention.cpp, one fused call per Attend item that
  appends k, v and attends every sequence (decode and prefill chunks) through the block tables,
  in place, threads split over (sequence, KV head) by length. Whoever changes how blocks are
  allocated only has to keep `SeqBlocks.blocks` the table and call `_blocks_changed`.
- "torch": the reference. SDPA over a strided view when every sequence decodes one token at the
  same position from contiguous, equally spaced reservations; otherwise per sequence (gathering
  scattered blocks and dequantizing int8 and float8).
Imports no gRPC.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from fastdecode.contract import chain_hashes, prefix_seed
from fastdecode.kv import native
from fastdecode.kv.attend import Attention
from fastdecode.kv.blocks import BlockAllocator, SeqBlocks
from fastdecode.kv.memory import SCALED_DTYPES, huge_page_empty, plan_pool, quantize
from fastdecode.kv.migration import Migration
from fastdecode.kv.persist import Journal, Layout, PoolCorrupt, PoolFile, Reattached, restore
from fastdecode.kv.prefix import PrefixCache
from fastdecode.kv.windows import WindowGroups
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound, ResourceExhausted
from fastdecode.runtime.geometry import KVGeometry

BACKENDS = ("native", "torch")
log = logging.getLogger("fastdecode.kv_attention")

# (seq_id, tokens), with its first token ids for prefix sharing, and with its cache salt
ReserveItem = tuple[str, int] | tuple[str, int, list[int]] | tuple[str, int, list[int], str]


class KVStore(WindowGroups, Attention, Migration):
    def __init__(
        self,
        geometry: KVGeometry,
        capacity_bytes: int,
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        backend: str = "native",
        prefix_sharing: bool = True,
        pool_file: Path | None = None,
    ) -> None:
        # Every field and what the pool takes, in Python integers, before anything is allocated: a
        # geometry of (2^31-1)^3 is refused here, not by the OOM killer.
        plan = plan_pool(geometry, block_size, dtype, capacity_bytes)
        if backend not in BACKENDS:
            raise InvalidInput(f"attention backend must be one of {list(BACKENDS)}, got {backend!r}")
        # Fails here, with one line naming the fix, when the extension is not built.
        self._native = native.load() if backend == "native" else None
        self.backend = backend
        # windows () when no layer has one; the fields below are read from it
        self.geometry = geometry.canonical()
        self.dtype = dtype
        self.block_size = block_size
        self.quantized = dtype in SCALED_DTYPES
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = plan.bytes_per_token
        self._group_layers()  # the plan's group_size, with each layer's group
        # A block holds block_size tokens of the `group_size` layers of one layer group.
        self.num_blocks = plan.num_blocks
        self.capacity_bytes = plan.pool_bytes
        slots = self.num_blocks * block_size
        lg, kvh, dim = self.group_size, self.num_kv_heads, self.head_dim
        scale_shape = (lg, kvh, slots) if self.quantized else (0,)
        shapes = {
            "k": ((lg, kvh, slots, dim), dtype),
            "v": ((lg, kvh, slots, dim), dtype),
            "k_scale": (scale_shape, torch.float32),
            "v_scale": (scale_shape, torch.float32),
        }
        self.pool: PoolFile | None = None
        self.journal: Journal | None = None
        self.reattached = Reattached()
        self.model = ""  # the fleet's model whose KV a persistent pool holds (the journal keeps it)
        if pool_file is not None:  # mapped from a file that outlives the process
            g = self.geometry
            ident = {  # checked in this order: the first difference is the one the log line names
                "version": 1,
                "geometry": [g.num_layers, kvh, dim, list(g.layer_windows), g.attn_logit_softcap],
                "dtype": str(dtype),
                "block_size": block_size,
                "num_blocks": self.num_blocks,
            }
            self.pool = PoolFile(pool_file, Layout(ident, g.num_layers, shapes))
            self.k, self.v = self.pool.tensors["k"], self.pool.tensors["v"]
            self.k_scale, self.v_scale = self.pool.tensors["k_scale"], self.pool.tensors["v_scale"]
        else:  # untouched pages: memory is committed as sequences write (2 MiB at a time, huge pages)
            self.k, self.v, self.k_scale, self.v_scale = (huge_page_empty(*shapes[n]) for n in shapes)
        self.alloc = BlockAllocator(self.num_blocks)
        self.seqs: dict[str, SeqBlocks] = {}
        # One prefix cache per layer group (a windowed store's groups cache their blocks apart: a
        # windowed group lets go of a cached block once its window has passed it); `prefix` is the
        # one cache of a store without windows.
        self.prefixes: list[PrefixCache] = (
            [PrefixCache() for _ in range(self.num_groups)] if prefix_sharing else []
        )
        self.prefix: PrefixCache | None = self.prefixes[0] if prefix_sharing and not self.grouped else None
        self._importing: dict[str, SeqBlocks] = {}  # live migration: blocks taken, not yet held
        self.busy_seconds = 0.0
        self.attend_calls = 0
        self._tables: dict[int, tuple[tuple[str, ...], torch.Tensor, torch.Tensor]] = {}
        if self.pool is not None:
            self._attach(self.pool)

    def _attach(self, pool: PoolFile) -> None:
        """Journal from here on, after taking back what the pool's files hold (a discarded or
        inconsistent pool starts empty, with one log line)."""
        self.journal = Journal(pool, self.num_groups)
        if pool.recovered is not None:
            try:
                self.reattached = restore(self, pool, pool.recovered, self.journal)
            except PoolCorrupt as e:
                log.warning("KV pool %s discarded: %s", pool.path, e)
                pool.discarded = str(e)
                self.seqs.clear()
                self.prefixes = [PrefixCache() for _ in self.prefixes]
                self.prefix = self.prefixes[0] if self.prefixes and not self.grouped else None
                self.alloc, self.model = BlockAllocator(self.num_blocks), ""
                self.journal = Journal(pool, self.num_groups)
                pool.lengths.zero_()
        for g, cache in enumerate(self.prefixes):
            cache.on_change = lambda kind, h, b, g=g: self.journal.prefix(g, kind, h, b)  # type: ignore[union-attr]
        self.journal.compact(self, force=True)
        r = self.reattached
        if r.positions or r.prefix_blocks:
            log.info(
                "KV pool %s re-attached: %d sequences, %d prefix blocks; %d positions of %d sequences torn",
                pool.path,
                len(r.positions),
                r.prefix_blocks,
                r.torn_positions,
                r.torn_sequences,
            )

    def bind_model(self, model: str) -> None:
        """Name the model whose KV this pool holds (a persistent pool keeps it in its journal)."""
        if model != self.model:
            self.model = model
            if self.journal is not None:
                self.journal.model(model)

    def close(self) -> None:
        """A clean stop: a persistent pool's journal rewritten and its files marked clean."""
        if self.journal is not None and self.pool is not None:
            self.journal.compact(self, force=True)
            self.pool.close()
            self.journal = None

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

    @property
    def bytes_used(self) -> int:
        return self.tokens_held * self.bytes_per_token

    # The geometry's fields, as the store's mixins and its readers use them.
    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.geometry.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.geometry.head_dim

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, the keys a query sees (0: all); () when no layer has a window."""
        return self.geometry.layer_windows

    @property
    def softcap(self) -> float:
        return self.geometry.attn_logit_softcap

    def geometry_matches(self, geometry: KVGeometry) -> bool:
        return geometry.canonical() == self.geometry

    def window(self, layer: int) -> int:
        """Keys a query of `layer` sees, itself included (0: every key before it)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def reserve_many(
        self,
        requests: Sequence[ReserveItem],
        model: str = "",
    ) -> list[int]:
        """Reserve all or nothing: on failure every block taken here is given back. Each request is
        (seq_id, tokens), (seq_id, tokens, token_ids) or those and its cache salt (a namespace of its
        own: its blocks match only the same salt's); returns each one's cached tokens."""
        done: list[str] = []
        cached: list[int] = []
        try:
            for seq_id, max_tokens, *rest in requests:
                ids = rest[0] if rest else None
                salt = rest[1] if len(rest) > 1 else ""
                # the salt goes into the hash chain's seed, beside the model
                salted = f"{model}|salt={salt}" if salt else model
                cached.append(self.reserve(seq_id, max_tokens, ids, salted))
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
        seq = SeqBlocks([], 0, [cached] * self.num_layers, True, hashes=hashes, frozen=len(shared))
        self._set_blocks(seq, shared + blocks)
        self.seqs[seq_id] = seq
        if self.journal is not None:
            self.journal.added(seq_id, seq)
        return cached

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

    def _set_blocks(self, seq: SeqBlocks, blocks: list[int]) -> None:
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

    def _grow(self, seqs: list[SeqBlocks], seq_ids: list[str], ends: list[int]) -> None:
        if self.grouped:  # every group (write, tests); attend grows only the group it attends
            for g in range(self.num_groups):
                self._grow_group(seqs, seq_ids, ends, g)
            return
        taken: list[tuple[SeqBlocks, list[int]]] = []
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
        if self.journal is not None:
            self.journal.dropped(seq)
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

    # ---- shared prefixes ------------------------------------------------------------------------

    def _publish(self, seq: SeqBlocks) -> None:
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
        if self.journal is not None:  # frozen changed, tables maybe not
            self.journal.changed(seq)
        if swapped:
            self._set_blocks(seq, seq.blocks)

    def _unfreeze(self, seq: SeqBlocks, start: int) -> None:
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

    def _slots(self, seq: SeqBlocks, n: int, g: int = 0) -> torch.Tensor:
        """Pool slots of positions 0..n-1 in group g's table (-1 blocks give negative slots)."""
        pos = torch.arange(n)
        blocks = torch.tensor(self._tab(seq, g), dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _put(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, KVH, D] of one layer at pool slots (quantizing for int8 and float8)."""
        m = self._member[layer]
        for pool, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            rows = new.transpose(0, 1)  # [KVH, n, D]
            if self.quantized:
                pool[m][:, slots], scales[m][:, slots] = quantize(rows, self.dtype)
            else:
                pool[m][:, slots] = rows.to(self.dtype)

    def _blocks_changed(self, seq: SeqBlocks) -> None:
        """Call after changing a block table: drops the cached int32 tables the native kernel reads."""
        seq.tables.clear()
        self._tables.clear()
        if self.journal is not None:
            self.journal.changed(seq)

    def truncate(self, seq_id: str, tokens: int) -> None:
        """Hold the sequence's first `tokens` positions only (a verified row's rejected drafts lay
        past them). FailedPrecondition when it holds fewer in some layer."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"sequence {seq_id!r} is not held by this shard")
        if tokens < 0 or tokens > min(seq.lengths):
            raise FailedPrecondition(f"sequence {seq_id!r} holds {min(seq.lengths)} positions, not {tokens}")
        seq.lengths[:] = [tokens] * len(seq.lengths)
        if self.journal is not None:
            self.journal.sync(seq)

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
        if self.journal is not None:
            self.journal.sync(seq)
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
                if self.journal is not None:
                    self.journal.sync(seq)
            return tokens
        for sid in seq_ids:
            for layer in range(self.num_layers):
                self.write(layer, sid, 0, k, v)
        return tokens
