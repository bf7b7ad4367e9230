"""Attention over a KV pool, for one Attend item: the native kernel or the torch reference (see
fastdecode/kv/store.py), and `AttendBatch`, the item itself as every attend signature takes it.
Imports no gRPC."""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fastdecode.kv.blocks import SeqBlocks
from fastdecode.kv.memory import quantize
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound


@dataclass(slots=True)
class AttendBatch:
    """One attend call's sequences, packed in order: sequence i brings num_tokens[i] new tokens at
    positions start_pos[i].., their rows of q [T, H, D] and k, v [T, KVH, D] (T = sum(num_tokens))."""

    seq_ids: list[str]
    num_tokens: list[int]
    start_pos: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class Attention:
    """KVStore's attention (a mixin: the pools, block tables and sequences are the store's)."""

    # the store's, set in KVStore.__init__
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    quantized: bool
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    seqs: dict[str, SeqBlocks]
    prefix: Any
    busy_seconds: float
    attend_calls: int
    _native: Any
    journal: Any
    _tables: dict[int, tuple[tuple[str, ...], torch.Tensor, torch.Tensor]]
    # windowed stores (see KVStore._group_layers)
    grouped: bool
    softcap: float
    prefixes: list[Any]
    _group_of: list[int]
    _member: list[int]

    def _grow(self, seqs: list[SeqBlocks], seq_ids: list[str], ends: list[int]) -> None: ...
    def _grow_group(self, seqs: list[SeqBlocks], seq_ids: list[str], ends: list[int], g: int) -> None: ...
    def _recycle(self, seq: SeqBlocks, g: int, start: int) -> None: ...
    def _unfreeze_group(self, seq: SeqBlocks, g: int, start: int) -> None: ...
    def _publish_group(self, seq: SeqBlocks, g: int) -> None: ...
    def _first_key(self, g: int, pos: int) -> int: ...
    def _tab(self, seq: SeqBlocks, g: int) -> list[int]: ...
    def window(self, layer: int) -> int: ...
    def _unfreeze(self, seq: SeqBlocks, start: int) -> None: ...
    def _publish(self, seq: SeqBlocks) -> None: ...

    def _check(self, layer: int, batch: AttendBatch) -> list[SeqBlocks]:
        """Validates one attend call; returns its sequences, in order."""
        seq_ids, num_tokens, start_pos, q, k, v = (
            batch.seq_ids,
            batch.num_tokens,
            batch.start_pos,
            batch.q,
            batch.k,
            batch.v,
        )
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
        seqs: list[SeqBlocks] = []
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

    def attend(self, layer: int, batch: AttendBatch) -> torch.Tensor:
        """Append k, v at start_pos and attend q causally over each sequence's cache.

        q [T, H, D], k/v [T, KVH, D], packed in seq order; returns o [T, H*D] in q's dtype.
        """
        seq_ids, num_tokens, start_pos = batch.seq_ids, batch.num_tokens, batch.start_pos
        seqs = self._check(layer, batch)
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
        if self.journal is not None:  # a persistent pool: the item's appends marked in flight
            self.journal.begin(layer, seqs, ends)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self._native is not None:
                out = self._attend_native(layer, batch)
                # A write at start_pos holds the sequence up to its end, not past it: positions
                # after it were rejected drafts (speculative decoding) and are rolled back, so no
                # count, export or publish reads them; the next write overwrites them.
                for seq, end in zip(seqs, ends, strict=True):
                    seq.lengths[layer] = end
            else:
                out = None
                if self.grouped:
                    out = self._attend_grouped(layer, batch)
                elif not self.quantized and not self.softcap:
                    out = self._attend_uniform(layer, batch)
                if out is None:
                    out = self._attend_each(layer, batch)
        if self.journal is not None:
            self.journal.commit(layer, ends)
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

    def _attend_native(self, layer: int, batch: AttendBatch) -> torch.Tensor:
        q, k, v = batch.q, batch.k, batch.v
        table, offsets = self._block_tables(batch.seq_ids, self._group_of[layer])
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
            torch.from_numpy(np.array(batch.start_pos, dtype=np.int64)),
            torch.from_numpy(np.array(batch.num_tokens, dtype=np.int64)),
            self.block_size,
            1.0 / math.sqrt(self.head_dim),
            self.window(layer),
            self.softcap,
        )
        return o.to(q.dtype)  # attend() records the new lengths

    def _attend_uniform(self, layer: int, batch: AttendBatch) -> torch.Tensor | None:
        """One batched SDPA when every sequence brings the same n new tokens (a decode step, or a
        speculative verification of k + 1 positions) at one position, from evenly spaced runs: one
        pass over all the sequences' keys for all their query rows.

        Returns None (caller loops per sequence) when the call does not have that shape.
        """
        seq_ids, start_pos, q, k, v = batch.seq_ids, batch.start_pos, batch.q, batch.k, batch.v
        rows, n = len(seq_ids), batch.num_tokens[0]
        if rows < 2 or any(m != n for m in batch.num_tokens):
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
        end = start + n
        kvh, dim = self.num_kv_heads, self.head_dim
        views = []
        for pool in (self.k, self.v):
            sh, sslot, sdim = pool.stride(1), pool.stride(2), pool.stride(3)
            views.append(
                pool.as_strided(
                    (kvh, rows, end, dim),
                    (sh, step * sslot, sslot, sdim),
                    pool.storage_offset() + layer * pool.stride(0) + base0 * sslot,
                )
            )
        keys, values = views
        # [B * n, KVH, D] -> [KVH, B, n, D]; copy_ casts to the pool dtype
        keys[:, :, start:end] = k.reshape(rows, n, kvh, dim).permute(2, 0, 1, 3)
        values[:, :, start:end] = v.reshape(rows, n, kvh, dim).permute(2, 0, 1, 3)
        for seq in seqs:
            seq.lengths[layer] = end  # past end: rolled back (attend's note)
        heads = q.shape[1]
        group = heads // kvh
        # The query heads sharing one kv head, at every new position, ride as that head's query
        # rows (group-major): [B, KVH, G * n, D]. A decode needs no mask; n positions see the
        # cache and the new positions up to their own.
        qs = q.to(self.dtype).reshape(rows, n, kvh, group, dim).permute(0, 2, 3, 1, 4)
        mask = None
        if n > 1:
            mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).repeat(group, 1)
        o = F.scaled_dot_product_attention(
            qs.reshape(rows, kvh, group * n, dim),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=1.0 / math.sqrt(dim),
        )
        # [B, KVH, G, n, D] -> [B, n, KVH, G, D] -> [B * n, H * D]
        o = o.reshape(rows, kvh, group, n, dim).permute(0, 3, 1, 2, 4)
        return o.reshape(rows * n, heads * dim).to(q.dtype)

    def _attend_each(self, layer: int, batch: AttendBatch) -> torch.Tensor:
        q, k, v = batch.q, batch.k, batch.v
        total, heads, dim = q.shape
        kvh = self.num_kv_heads
        group = heads // kvh
        out = torch.empty(total, heads * dim, dtype=q.dtype)
        kp, vp = self.k[layer], self.v[layer]  # [KVH, slots, D]
        ksp, vsp = (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)
        compute = torch.float32 if self.quantized else self.dtype
        scale = 1.0 / math.sqrt(dim)
        row = 0
        for sid, n, start in zip(batch.seq_ids, batch.num_tokens, batch.start_pos, strict=True):
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
                    quantize(knew, self.dtype),
                    quantize(vnew, self.dtype),
                )
                keys = kp[:, idx].float() * ksp[:, idx, None]  # type: ignore[index]
                values = vp[:, idx].float() * vsp[:, idx, None]  # type: ignore[index]
            else:
                kp[:, new] = knew.to(self.dtype)
                vp[:, new] = vnew.to(self.dtype)
                keys, values = kp[:, idx], vp[:, idx]
            seq.lengths[layer] = end  # past end: rolled back (attend's note)
            qn = q[row : row + n].to(compute)
            if self.softcap:  # (a store without windows: only the soft-cap)
                o = self._scores_softmax(qn, keys, values, start, 0, scale)
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

    def _attend_grouped(self, layer: int, batch: AttendBatch) -> torch.Tensor:
        """The torch backend on a windowed store: per sequence, gather the keys its chunk sees
        through the layer group's table (from the first query's window start on)."""
        q, k, v = batch.q, batch.k, batch.v
        total, heads, dim = q.shape
        g, m = self._group_of[layer], self._member[layer]
        kp, vp = self.k[m], self.v[m]
        ksp, vsp = (self.k_scale[m], self.v_scale[m]) if self.quantized else (None, None)
        compute = torch.float32 if self.quantized else self.dtype
        window, bs = self.window(layer), self.block_size
        out = torch.empty(total, heads * dim, dtype=q.dtype)
        row = 0
        for sid, n, start in zip(batch.seq_ids, batch.num_tokens, batch.start_pos, strict=True):
            seq, end = self.seqs[sid], start + n
            lo = self._first_key(g, start)
            blocks = torch.tensor(self._tab(seq, g), dtype=torch.int64)
            pos = torch.arange(lo, end)
            idx = blocks[pos // bs] * bs + pos % bs
            new = idx[start - lo :]
            knew, vnew = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            if self.quantized:
                (kp[:, new], ksp[:, new]), (vp[:, new], vsp[:, new]) = (
                    quantize(knew, self.dtype),
                    quantize(vnew, self.dtype),
                )
                keys = kp[:, idx].float() * ksp[:, idx, None]  # type: ignore[index]
                values = vp[:, idx].float() * vsp[:, idx, None]  # type: ignore[index]
            else:
                kp[:, new], vp[:, new] = knew.to(self.dtype), vnew.to(self.dtype)
                keys, values = kp[:, idx], vp[:, idx]
            seq.lengths[layer] = end  # past end: rolled back (attend's note)
            qn = q[row : row + n].to(compute)
            o = self._scores_softmax(qn, keys, values, start, window, 1 / math.sqrt(dim), lo)
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
        scores = qg @ keys.float().transpose(1, 2).unsqueeze(1) * scale  # [KVH, G, n, L]
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
