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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdecode import codec
from fastdecode.errors import FailedPrecondition, InvalidInput
from fastdecode.kv import KVStore
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

    def store_for(self, num_layers: int, num_kv_heads: int, head_dim: int) -> KVStore:
        if min(num_layers, num_kv_heads, head_dim) < 1:
            raise InvalidInput("reservation needs a positive KV geometry (layers, kv heads, head dim)")
        geometry = (num_layers, num_kv_heads, head_dim)
        if self.store is None:
            self.store = KVStore(
                *geometry, self.kv_capacity, self.dtype, self.block_size, backend=self.backend
            )
            log.info(
                "KV pool: %d tokens (%d bytes) of geometry %s",
                self.store.capacity_tokens,
                self.store.capacity_bytes,
                geometry,
            )
        elif not self.store.geometry_matches(*geometry):
            s = self.store
            have = (s.num_layers, s.num_kv_heads, s.head_dim)
            if s.seqs:
                raise InvalidInput(f"this shard holds KV of geometry {have}, not {geometry}")
            # Empty: the pool is rebuilt for the new geometry, so one odd reservation on an idle shard
            # (a stray client, a test) cannot pin it to a geometry the fleet does not use.
            log.warning("KV pool holds nothing: rebuilding it from geometry %s for %s", have, geometry)
            self.store = None
            return self.store_for(*geometry)
        return self.store

    def reserve(self, geometry: tuple[int, int, int], sequences: Sequence[tuple[str, int]]) -> int:
        """Reserve every sequence or none; returns the free tokens left."""
        store = self.store_for(*geometry)
        store.reserve_many(list(sequences))
        return store.free_tokens

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
        store = self.store
        if store is None:
            raise FailedPrecondition("shard holds no sequences yet (nothing reserved)")
        q, k, v = codec.decode(req.q), codec.decode(req.k), codec.decode(req.v)
        start_pos, num_tokens = list(req.start_pos), list(req.num_tokens)
        t0 = time.perf_counter()
        o = store.attend(req.layer, list(req.seq_ids), num_tokens, start_pos, q, k, v)
        seconds = time.perf_counter() - t0
        # Each new token attends to every cached token of its sequence, its own chunk included.
        ends = list(map(operator.add, start_pos, num_tokens))
        self.attended_pairs += sum(map(operator.mul, num_tokens, ends))
        return AttendResult(o, seconds, sum(ends) * store.bytes_per_token // store.num_layers)
