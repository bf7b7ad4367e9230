"""The kv_attention shard's core: one KV store built from the first reservation's geometry, and
one Attend item decoded, attended and accounted. Imports no gRPC (services/kv_attention adapts it).

Attend items run where the service reads them (no hop to another thread): an item is one
layer of one mini-batch, a few milliseconds at most, and the round trip it answers is the
latency every decode step pays once per layer.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import torch

from fastdecode.kv import KVStore
from fastdecode.runtime import codec
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound
from fastdecode.v1 import kv_attention_pb2 as pb

log = logging.getLogger("fastdecode.kv_attention")


@dataclass
class AttendResult:
    o: torch.Tensor
    seconds: float  # attention compute time
    kv_bytes_read: int  # keys and values read by this item


class ShardCore:
    def __init__(
        self, kv_capacity: int, kv_dtype: torch.dtype, block_size: int, backend: str = "native"
    ) -> None:
        self.kv_capacity = kv_capacity
        self.backend = backend
        self.dtype = kv_dtype
        self.block_size = block_size
        self.store: KVStore | None = None  # built from the geometry of the first reservation
        self.attended_pairs = 0.0
        # hosted in gpu_dense (--host-shard): its pipelined S-part's seconds on the cores this shard
        # attends on (services/gpu_dense/host_shard.py); they count in its measured speed
        self.host_busy_seconds = 0.0

    def store_for(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        layer_windows: Sequence[int] = (),
        softcap: float = 0.0,
    ) -> KVStore:
        if min(num_layers, num_kv_heads, head_dim) < 1:
            raise InvalidInput("reservation needs a positive KV geometry (layers, kv heads, head dim)")
        geometry = (num_layers, num_kv_heads, head_dim)
        windows = tuple(layer_windows)
        if self.store is None:
            self.store = KVStore(
                *geometry,
                self.kv_capacity,
                self.dtype,
                self.block_size,
                backend=self.backend,
                layer_windows=windows,
                softcap=softcap,
            )
            log.info(
                "KV pool: %d tokens (%d bytes) of geometry %s",
                self.store.capacity_tokens,
                self.store.capacity_bytes,
                geometry,
            )
        elif not self.store.geometry_matches(*geometry, windows, softcap):
            s = self.store
            have = (s.num_layers, s.num_kv_heads, s.head_dim, s.layer_windows, s.softcap)
            if s.seqs:
                raise InvalidInput(
                    f"this shard holds KV of geometry {have}, not {(*geometry, windows, softcap)}"
                )
            # Empty: the pool is rebuilt for the new geometry, so one odd reservation on an idle shard
            # (a stray client, a test) cannot pin it to a geometry the fleet does not use.
            log.warning("KV pool holds nothing: rebuilding it from geometry %s for %s", have, geometry)
            self.store = None
            return self.store_for(*geometry, windows, softcap)
        return self.store

    def reserve(
        self,
        geometry: tuple[int, int, int] | tuple[int, int, int, Sequence[int], float],
        sequences: Sequence[tuple[str, int]] | Sequence[tuple[str, int, list[int]]],
        model: str = "",
    ) -> tuple[int, list[int]]:
        """Reserve every sequence or none: (seq_id, tokens) or (seq_id, tokens, token_ids), the
        token ids for prefix sharing. Returns the free tokens left and each one's cached tokens."""
        store = self.store_for(*geometry)
        cached = store.reserve_many(list(sequences), model)
        return store.free_tokens, cached

    def release(self, seq_ids: Sequence[str] | None) -> list[bool]:
        """Release the named sequences (all with None); one flag per id: whether it was held."""
        if self.store is None:
            return []
        ids = list(self.store.seqs) if seq_ids is None else list(seq_ids)
        return [self.store.release(s) for s in ids]

    def fill(self, seq_ids: Sequence[str], tokens: int, seed: int) -> int:
        """Random KV for held sequences, written straight into the pool (benchmarks)."""
        if self.store is None:
            raise FailedPrecondition("shard holds no sequences yet (nothing reserved)")
        return self.store.fill_synthetic(list(seq_ids), tokens, seed)

    def attend(self, req: pb.AttendRequest) -> AttendResult:
        """Decode q, k, v (views of the message bytes), append k and v, attend; raises domain errors."""
        q, k, v = codec.decode(req.q), codec.decode(req.k), codec.decode(req.v)
        return self.attend_tensors(
            req.layer, list(req.seq_ids), list(req.num_tokens), list(req.start_pos), q, k, v
        )

    def attend_tensors(
        self,
        layer: int,
        seq_ids: list[str],
        num_tokens: list[int],
        start_pos: list[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> AttendResult:
        """One item from tensors in hand: the wire's path above, and a shard hosted in gpu_dense's
        own process (services/gpu_dense/host_shard.py), whose items never touch the wire."""
        store = self.store
        if store is None:
            raise FailedPrecondition("shard holds no sequences yet (nothing reserved)")
        t0 = time.perf_counter()
        o = store.attend(layer, seq_ids, num_tokens, start_pos, q, k, v)
        seconds = time.perf_counter() - t0
        # Each new token attends to every cached token of its sequence, its own chunk included (on
        # a windowed layer, to its window: the keys from the chunk's first query's window start on).
        ends = list(map(operator.add, start_pos, num_tokens))
        w = store.window(layer)
        keys = [e - max(0, s - w + 1) for s, e in zip(start_pos, ends, strict=True)] if w else ends
        self.attended_pairs += sum(map(operator.mul, num_tokens, keys))
        return AttendResult(o, seconds, sum(keys) * store.bytes_per_token // store.num_layers)

    # ---- live migration ----------------------------------------------------------------------
    def export_chunks(self, seq_id: str) -> Iterator[pb.KVChunk]:
        """One sequence's KV as ImportSequence chunks: a header, then one chunk per layer, each
        copied out of the pool only when asked for (one layer in memory at a time). NotFound at
        once, before any chunk, when the sequence is not held here."""
        store = self.store
        if store is None or seq_id not in store.seqs:
            raise NotFound(f"sequence {seq_id!r} is not held by this shard")
        return self._chunks(store, seq_id)

    def _chunks(self, store: KVStore, seq_id: str) -> Iterator[pb.KVChunk]:
        yield pb.KVChunk(
            seq_id=seq_id,
            geometry=pb.KVGeometry(
                num_layers=store.num_layers,
                num_kv_heads=store.num_kv_heads,
                head_dim=store.head_dim,
                layer_windows=store.layer_windows,
                attn_logit_softcap=store.softcap,
            ),
            kv_dtype=codec.wire_dtype(store.dtype),
            tokens=min(store.seqs[seq_id].lengths),
        )
        for layer in range(store.num_layers):
            k, v, ks, vs = store.export_layer(seq_id, layer)
            chunk = pb.KVChunk(seq_id=seq_id, layer=layer, first_token=store.layer_first(seq_id, layer))
            for name, t in (("k", k), ("v", v), ("k_scale", ks), ("v_scale", vs)):
                if t.numel():
                    codec.encode(t, getattr(chunk, name))
            yield chunk

    async def import_chunks(self, chunks: AsyncIterator[pb.KVChunk]) -> tuple[int, int]:
        """Receive one sequence (header, then every layer); it is held only once the last layer is
        in, and an import that fails or ends early frees its blocks. Returns (tokens, bytes)."""
        header = await anext(chunks, None)
        if header is None or not header.seq_id or header.tokens < 1:
            raise InvalidInput("an import starts with a header chunk naming the sequence and its tokens")
        g = header.geometry
        store = self.store_for(
            g.num_layers, g.num_kv_heads, g.head_dim, list(g.layer_windows), g.attn_logit_softcap
        )
        if codec.torch_dtype(header.kv_dtype) != store.dtype:
            raise FailedPrecondition(
                f"KV arrives as {codec.torch_dtype(header.kv_dtype)}, this shard stores {store.dtype}"
            )
        seq_id, nbytes, layers = header.seq_id, 0, 0
        store.begin_import(seq_id, header.tokens)
        try:
            async for c in chunks:
                if c.seq_id != seq_id:
                    raise InvalidInput(f"chunk for {c.seq_id!r} in the import of {seq_id!r}")
                rows = [
                    codec.decode(t) if t.ByteSize() else torch.empty(0)
                    for t in (c.k, c.v, c.k_scale, c.v_scale)
                ]
                nbytes += store.import_layer(seq_id, c.layer, rows, c.first_token)
                layers += 1
            if layers != store.num_layers:
                raise InvalidInput(f"import of {seq_id!r} ended after {layers} of {store.num_layers} layers")
            return store.commit_import(seq_id), nbytes
        except BaseException:
            store.abort_import(seq_id)
            raise
