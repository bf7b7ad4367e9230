"""The kv_attention shard's core: one KV store built from the first reservation's geometry, and
one Attend item attended and accounted, and a sequence's KV exported or imported a layer at a time
(live migration). Imports no gRPC and no protos: fastdecode.wire.kv carries these over the wire and
services/kv_attention serves them.

Attend items run where the service reads them (no hop to another thread): an item is one
layer of one mini-batch, a few milliseconds at most, and the round trip it answers is the
latency every decode step pays once per layer.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastdecode.kv.attend import AttendBatch
from fastdecode.kv.memory import plan_pool
from fastdecode.kv.persist import PoolFile, pool_header, take_room
from fastdecode.kv.store import KVStore, ReserveItem
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound
from fastdecode.runtime.geometry import KVGeometry

log = logging.getLogger("fastdecode.kv_attention")


@dataclass
class AttendResult:
    o: torch.Tensor
    seconds: float  # attention compute time
    kv_bytes_read: int  # keys and values read by this item
    cpu_seconds: float = 0.0  # the serving thread's CPU in it (bench pace: shards' work outside attention)


@dataclass(frozen=True)
class SequenceHeader:
    """What a migrated sequence's KV is: its geometry, storage dtype and the tokens it holds."""

    seq_id: str
    geometry: KVGeometry
    dtype: torch.dtype
    tokens: int


@dataclass
class Reattachment:
    """Reattach's answer: where each kept sequence resumes, what was let go, what was torn."""

    positions: dict[str, int] = field(default_factory=dict)
    released: int = 0
    torn_positions: int = 0
    discarded: str = ""


@dataclass
class LayerRows:
    """One layer of a migrated sequence: k, v, k_scale, v_scale (the scales empty unless int8), of
    positions first.. (a windowed layer sends the blocks its window still sees; 0 otherwise)."""

    seq_id: str
    layer: int
    rows: list[torch.Tensor]
    first: int = 0


class ShardCore:
    def __init__(
        self,
        kv_capacity: int,
        kv_dtype: torch.dtype,
        block_size: int,
        backend: str = "native",
        pool_file: Path | None = None,
    ) -> None:
        self.kv_capacity = kv_capacity
        self.backend = backend
        self.dtype = kv_dtype
        self.block_size = block_size
        self.pool_file = pool_file  # --kv-dir: the pool outlives this process
        self.store: KVStore | None = None  # built from the geometry of the first reservation
        self.discarded = ""  # why a pool found on file was not reused (until a Reattach reports it)
        self.torn_positions = 0  # what the restart found torn (until a Reattach reports it)
        self.attended_pairs = 0.0
        # hosted in gpu_dense (--host-shard): its pipelined S-part's seconds on the cores this shard
        # attends on (services/gpu_dense/exchange/host_shard.py); they count in its measured speed
        self.host_busy_seconds = 0.0
        if pool_file is not None:
            self._reopen(pool_file)

    def _reopen(self, pool_file: Path) -> None:
        """A pool left on file by an earlier process: mapped again, from the geometry it names."""
        header = pool_header(pool_file)
        if header is None:
            take_room(pool_file, self.kv_capacity)
            return
        try:
            layers, heads, dim, windows, cap = header["geometry"]
            geometry = KVGeometry(layers, heads, dim, tuple(windows), float(cap))
            self.store_for(geometry)
        except Exception as e:  # noqa: BLE001 - any unreadable header: the pool goes, the shard starts
            self.discarded = f"unreadable header: {e}"
            log.warning("KV pool %s discarded: %s", pool_file, self.discarded)
            PoolFile.remove_files(pool_file)
            self.store = None
            return
        assert self.store is not None
        self.discarded = self.store.pool.discarded if self.store.pool is not None else ""
        self.torn_positions = self.store.reattached.torn_positions

    @property
    def persistent(self) -> bool:
        return self.pool_file is not None

    def store_for(self, geometry: KVGeometry) -> KVStore:
        if self.store is None:
            self.store = KVStore(
                geometry,
                self.kv_capacity,
                self.dtype,
                self.block_size,
                backend=self.backend,
                pool_file=self.pool_file,
            )
            log.info(
                "KV pool: %d tokens (%d bytes) of geometry %s",
                self.store.capacity_tokens,
                self.store.capacity_bytes,
                self.store.geometry,
            )
        elif not self.store.geometry_matches(geometry):
            s = self.store
            # A geometry out of range or whose pool does not fit is refused first, the same way
            # whether this shard is busy or idle, and leaves the pool it has as it was.
            plan_pool(geometry, self.block_size, self.dtype, self.kv_capacity, s.capacity_bytes)
            if s.seqs:
                raise InvalidInput(f"this shard holds KV of geometry {s.geometry}, not {geometry}")
            # Empty: the pool is rebuilt for the new geometry, so one odd reservation on an idle shard
            # (a stray client, a test) cannot pin it to a geometry the fleet does not use.
            log.warning("KV pool holds nothing: rebuilding it from geometry %s for %s", s.geometry, geometry)
            s.close()
            self.store = None
            return self.store_for(geometry)
        return self.store

    def _store_of(self, geometry: KVGeometry, model: str) -> KVStore:
        """The store for this geometry holding KV of `model`: a persistent pool of another model's
        weights is discarded (one log line), never read."""
        store = self.store_for(geometry)
        if store.pool is not None and model and store.model and store.model != model:
            if store.seqs:
                raise InvalidInput(f"this shard holds KV of model {store.model!r}, not {model!r}")
            self.discarded = f"it holds KV of model {store.model!r}, the fleet serves {model!r}"
            log.warning("KV pool %s discarded: %s", store.pool.path, self.discarded)
            store.close()
            PoolFile.remove_files(self.pool_file)  # type: ignore[arg-type]
            self.store = None
            store = self.store_for(geometry)
        if model:
            store.bind_model(model)
        return store

    def reattach(self, geometry: KVGeometry, model: str, keep: Sequence[str]) -> Reattachment:
        """After a restart: keep the named sequences this shard still holds, free the rest, and say
        where each kept one resumes (every layer holds it up to there)."""
        store = self._store_of(geometry, model)
        wanted = set(keep)
        gone = [sid for sid in store.seqs if sid not in wanted]
        for sid in gone:
            store.release(sid)
        out = Reattachment(released=len(gone), torn_positions=self.torn_positions, discarded=self.discarded)
        out.positions = {sid: min(store.seqs[sid].lengths) for sid in keep if sid in store.seqs}
        self.discarded, self.torn_positions = "", 0  # reported once
        self.flush()
        return out

    def flush(self) -> None:
        """Put what the last call changed on a persistent pool's journal."""
        if self.store is not None and self.store.journal is not None:
            self.store.journal.flush()
            self.store.journal.compact(self.store)

    def close(self) -> None:
        """A clean stop: a persistent pool is left consistent and marked clean."""
        if self.store is not None:
            self.store.close()

    def reserve(
        self, geometry: KVGeometry, sequences: Sequence[ReserveItem], model: str = ""
    ) -> tuple[int, list[int]]:
        """Reserve every sequence or none: (seq_id, tokens), (seq_id, tokens, token_ids), the token ids
        for prefix sharing, or (seq_id, tokens, token_ids, cache_salt). Returns the free tokens left
        and each one's cached tokens."""
        store = self._store_of(geometry, model)
        try:
            cached = store.reserve_many(list(sequences), model)
        finally:
            self.flush()
        return store.free_tokens, cached

    def release(self, seq_ids: Sequence[str] | None) -> list[bool]:
        """Release the named sequences (all with None); one flag per id: whether it was held."""
        if self.store is None:
            return []
        ids = list(self.store.seqs) if seq_ids is None else list(seq_ids)
        freed = [self.store.release(s) for s in ids]
        self.flush()
        return freed

    def fill(self, seq_ids: Sequence[str], tokens: int, seed: int) -> int:
        """Random KV for held sequences, written straight into the pool (benchmarks)."""
        if self.store is None:
            raise FailedPrecondition("shard holds no sequences yet (nothing reserved)")
        try:
            return self.store.fill_synthetic(list(seq_ids), tokens, seed)
        finally:
            self.flush()

    def attend(self, layer: int, batch: AttendBatch) -> AttendResult:
        """One item: append k and v, attend; raises domain errors. The wire's items arrive as views
        of the message's bytes (fastdecode.wire.kv.attend_batch); a shard hosted in gpu_dense's own
        process (services/gpu_dense/exchange/host_shard.py) hands its items over without touching the wire."""
        store = self.store
        if store is None:
            raise FailedPrecondition("shard holds no sequences yet (nothing reserved)")
        t0, c0 = time.perf_counter(), time.thread_time()
        o = store.attend(layer, batch)
        seconds = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        # Each new token attends to every cached token of its sequence, its own chunk included (on
        # a windowed layer, to its window: the keys from the chunk's first query's window start on).
        ends = list(map(operator.add, batch.start_pos, batch.num_tokens))
        w = store.window(layer)
        keys = [e - max(0, s - w + 1) for s, e in zip(batch.start_pos, ends, strict=True)] if w else ends
        self.attended_pairs += sum(map(operator.mul, batch.num_tokens, keys))
        return AttendResult(o, seconds, sum(keys) * store.bytes_per_token // store.num_layers, cpu)

    # ---- live migration ----------------------------------------------------------------------
    def export_sequence(self, seq_id: str, tokens: int = 0) -> tuple[SequenceHeader, Iterator[LayerRows]]:
        """One sequence's KV: its header, and its layers, each copied out of the pool only when
        asked for (one layer in memory at a time). NotFound at once, before any layer, when the
        sequence is not held here. `tokens` > 0: the positions the scheduler counts; what lies past
        them (a verified row's rejected drafts) is rolled back first, so it never moves."""
        store = self.store
        if store is None or seq_id not in store.seqs:
            raise NotFound(f"sequence {seq_id!r} is not held by this shard")
        if tokens:
            store.truncate(seq_id, tokens)
        header = SequenceHeader(seq_id, store.geometry, store.dtype, min(store.seqs[seq_id].lengths))
        return header, self._layers(store, seq_id)

    @staticmethod
    def _layers(store: KVStore, seq_id: str) -> Iterator[LayerRows]:
        for layer in range(store.num_layers):
            rows = list(store.export_layer(seq_id, layer))
            yield LayerRows(seq_id, layer, rows, store.layer_first(seq_id, layer))

    async def import_sequence(
        self, header: SequenceHeader, layers: AsyncIterator[LayerRows]
    ) -> tuple[int, int]:
        """Receive one sequence, every layer; it is held only once the last layer is in, and an
        import that fails or ends early frees its blocks. Returns (tokens, bytes)."""
        store = self.store_for(header.geometry)
        if header.dtype != store.dtype:
            raise FailedPrecondition(f"KV arrives as {header.dtype}, this shard stores {store.dtype}")
        seq_id, nbytes, count = header.seq_id, 0, 0
        store.begin_import(seq_id, header.tokens)
        try:
            async for layer in layers:
                if layer.seq_id != seq_id:
                    raise InvalidInput(f"chunk for {layer.seq_id!r} in the import of {seq_id!r}")
                nbytes += store.import_layer(seq_id, layer.layer, layer.rows, layer.first)
                count += 1
            if count != store.num_layers:
                raise InvalidInput(f"import of {seq_id!r} ended after {count} of {store.num_layers} layers")
            tokens = store.commit_import(seq_id)
            self.flush()
            return tokens, nbytes
        except BaseException:
            store.abort_import(seq_id)
            raise
