"""Live migration out of and into a KV pool: a sequence's rows a layer at a time (a mixin over
KVStore; fastdecode/kv/shard.py streams them, services/kv_attention serves them). An import takes its
blocks first and is held only once its last layer is in. Imports no gRPC."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fastdecode.kv.blocks import SeqBlocks
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound, ResourceExhausted


class Migration:
    """KVStore's live migration (a mixin: the pools, allocator and sequences are the store's)."""

    # the store's, set in KVStore.__init__
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    quantized: bool
    grouped: bool
    num_groups: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    seqs: dict[str, SeqBlocks]
    alloc: Any
    journal: Any
    free_tokens: int
    capacity_tokens: int
    _importing: dict[str, SeqBlocks]
    _group_of: list[int]
    _member: list[int]

    def _slots(self, seq: SeqBlocks, n: int, g: int = 0) -> torch.Tensor: ...
    def _tab(self, seq: SeqBlocks, g: int) -> list[int]: ...
    def _first_key(self, g: int, pos: int) -> int: ...
    def _allocate(self, n: int) -> list[int] | None: ...
    def _set_blocks(self, seq: SeqBlocks, blocks: list[int]) -> None: ...
    def _live(self, seq: SeqBlocks) -> list[int]: ...

    def export_layer(self, seq_id: str, layer: int) -> tuple[torch.Tensor, ...]:
        """One layer of a sequence as stored: k, v [KVH, n, D] in the pool dtype (copies), plus int8's
        or float8's scales [KVH, n] (empty otherwise). n is what every layer holds at a step boundary."""
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
        seq = SeqBlocks(
            [], 0, [0] * self.num_layers, True, more=tables[1:], dead=dead, gfrozen=[0] * len(dead)
        )
        self._set_blocks(seq, tables[0])
        self._importing[seq_id] = seq

    def import_layer(self, seq_id: str, layer: int, rows: Sequence[torch.Tensor], first: int = 0) -> int:
        """Write one exported layer (k, v and int8's or float8's scales, of positions first..) of an import;
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
            raise InvalidInput(f"{self.dtype} rows need scales of shape {list(shape[:2])}")
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
        if self.journal is not None:
            self.journal.added(seq_id, seq)
        return seq.lengths[0]

    def abort_import(self, seq_id: str) -> None:
        """Free an unfinished import's blocks (the stream broke); unknown ids are ignored."""
        seq = self._importing.pop(seq_id, None)
        if seq is not None:
            self.alloc.release(self._live(seq) if self.grouped else seq.blocks)
