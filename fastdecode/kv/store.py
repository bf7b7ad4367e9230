"""The R-part core: a byte-bounded, block-based KV pool and attention over it.

Layout: one pool per K and V of shape [layers, kv_heads, num_blocks * block_size, head_dim]
(head-major: one head of one sequence is a contiguous [tokens, head_dim] run, which CPU
attention streams ~1.3-1.6x faster than token-major rows strided by kv_heads * head_dim).
Blocks on demand: a sequence is admitted with the blocks for the tokens it holds (its prompt)
and its block table grows one block at a time as attention appends past its last block, so
the pool holds what sequences really use, not their max_tokens. When no block is free the
call fails with ResourceExhausted and nothing of it is kept; the scheduler then preempts a
sequence (frees its blocks, recomputes it later). A new block extends the sequence's run
in place when the next block is free, so a sequence stays one contiguous run (read in place
as a strided view) as long as its neighbours allow; otherwise its slots are gathered.

Decode fast path: when every sequence of a call decodes one token at the same position from
contiguous, equally spaced reservations (a batch reserved together), the whole call is one
batched SDPA over a strided view of the pool: no per-sequence Python loop.
Imports no gRPC.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fastdecode.errors import FailedPrecondition, InvalidInput, NotFound, ResourceExhausted


@dataclass
class _Seq:
    blocks: list[int]  # the block table: blocks[i] holds positions i*block_size .. (i+1)*block_size-1
    capacity: int  # tokens its blocks hold
    lengths: list[int]  # tokens held per layer
    contiguous: bool
    slots: torch.Tensor | None = field(default=None)  # token slot index when scattered


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
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, block_size) < 1:
            raise InvalidInput("KV geometry must be positive")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.block_size = block_size
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.itemsize
        self.num_blocks = max(0, capacity_bytes // (self.bytes_per_token * block_size))
        self.capacity_bytes = self.num_blocks * block_size * self.bytes_per_token
        slots = self.num_blocks * block_size
        # torch.empty does not touch the pages: memory is committed as sequences write.
        self.k = torch.empty(num_layers, num_kv_heads, slots, head_dim, dtype=dtype)
        self.v = torch.empty(num_layers, num_kv_heads, slots, head_dim, dtype=dtype)
        self.alloc = BlockAllocator(self.num_blocks)
        self.seqs: dict[str, _Seq] = {}
        self.busy_seconds = 0.0
        self.attend_calls = 0

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def free_tokens(self) -> int:
        return self.alloc.free * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def tokens_held(self) -> int:
        return sum(s.lengths[-1] for s in self.seqs.values())

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.alloc.free

    @property
    def blocks_free(self) -> int:
        return self.alloc.free

    @property
    def tokens_reserved(self) -> int:
        """Tokens the blocks in use hold (tokens held, rounded up to whole blocks per sequence)."""
        return self.blocks_in_use * self.block_size

    @property
    def bytes_used(self) -> int:
        return self.tokens_held * self.bytes_per_token

    def geometry_matches(self, num_layers: int, num_kv_heads: int, head_dim: int) -> bool:
        return (num_layers, num_kv_heads, head_dim) == (self.num_layers, self.num_kv_heads, self.head_dim)

    def reserve_many(self, requests: list[tuple[str, int]]) -> None:
        """Reserve all or nothing: on failure every block taken here is given back."""
        done: list[str] = []
        try:
            for seq_id, max_tokens in requests:
                self.reserve(seq_id, max_tokens)
                done.append(seq_id)
        except Exception:
            for seq_id in done:
                self.release(seq_id)
            raise

    def reserve(self, seq_id: str, tokens: int) -> None:
        """Admit a sequence with the blocks for `tokens` (its prompt); it grows on demand after that."""
        if not seq_id:
            raise InvalidInput("empty sequence id")
        if tokens < 1:
            raise InvalidInput(f"max_tokens must be >= 1, got {tokens}")
        if seq_id in self.seqs:
            raise FailedPrecondition(f"sequence {seq_id!r} is already reserved on this shard")
        n = math.ceil(tokens / self.block_size)
        blocks = self.alloc.allocate(n)
        if blocks is None:
            raise ResourceExhausted(
                f"KV pool full: {tokens} tokens requested, {self.free_tokens} free of {self.capacity_tokens}"
            )
        seq = _Seq([], 0, [0] * self.num_layers, True)
        self._set_blocks(seq, blocks)
        self.seqs[seq_id] = seq

    def _set_blocks(self, seq: _Seq, blocks: list[int]) -> None:
        seq.blocks = blocks
        seq.capacity = len(blocks) * self.block_size
        # a grown table need not ascend: compare every block, not just the ends
        seq.contiguous = all(b == blocks[0] + i for i, b in enumerate(blocks))
        seq.slots = None
        if not seq.contiguous:
            b = torch.tensor(blocks, dtype=torch.int64)
            seq.slots = (b[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)

    def grow(self, seq_ids: list[str], ends: list[int]) -> None:
        """Give each sequence the blocks to hold `ends` tokens, a block at a time; all or nothing.

        ResourceExhausted (naming the sequences left short) when the pool runs out: every block taken
        here is given back, so a failed call leaves the pool as it was.
        """
        taken: list[tuple[_Seq, list[int]]] = []
        short: list[str] = []
        for sid, end in zip(seq_ids, ends, strict=True):
            seq = self.seqs[sid]
            if end <= seq.capacity:
                continue
            blocks = list(seq.blocks)
            while len(blocks) * self.block_size < end:
                if self.alloc.allocate_after(blocks[-1]):
                    blocks.append(blocks[-1] + 1)
                    continue
                one = self.alloc.allocate(1)
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
        self.alloc.release(seq.blocks)
        return True

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
    ) -> None:
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
        for sid, start in zip(seq_ids, start_pos, strict=True):
            seq = self.seqs.get(sid)
            if seq is None:
                raise NotFound(f"sequence {sid!r} is not held by this shard")
            if not 0 <= start <= seq.lengths[layer]:
                raise InvalidInput(
                    f"sequence {sid!r} layer {layer}: start_pos {start} leaves a gap "
                    f"(holds {seq.lengths[layer]} tokens)"
                )

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
        self._check(layer, seq_ids, num_tokens, start_pos, q, k, v)
        self.grow(seq_ids, [s + n for s, n in zip(start_pos, num_tokens, strict=True)])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self._attend_uniform_decode(layer, seq_ids, num_tokens, start_pos, q, k, v)
            if out is None:
                out = self._attend_each(layer, seq_ids, num_tokens, start_pos, q, k, v)
        self.busy_seconds += time.perf_counter() - t0
        self.attend_calls += 1
        return out

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
        scale = 1.0 / math.sqrt(dim)
        row = 0
        for sid, n, start in zip(seq_ids, num_tokens, start_pos, strict=True):
            seq = self.seqs[sid]
            end = start + n
            if seq.contiguous:
                base = seq.blocks[0] * self.block_size
                kp[:, base + start : base + end] = k[row : row + n].transpose(0, 1)
                vp[:, base + start : base + end] = v[row : row + n].transpose(0, 1)
                keys, values = kp[:, base : base + end], vp[:, base : base + end]
            else:
                idx = seq.slots[:end]  # type: ignore[index]
                kp[:, idx[start:end]] = k[row : row + n].transpose(0, 1).to(self.dtype)
                vp[:, idx[start:end]] = v[row : row + n].transpose(0, 1).to(self.dtype)
                keys, values = kp[:, idx], vp[:, idx]
            seq.lengths[layer] = max(seq.lengths[layer], end)
            qn = q[row : row + n].to(self.dtype)
            if n == 1:  # decode: no mask; query heads of one kv head become its query rows
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
