"""kv_attention: the R-part service. A thin gRPC adapter around fastdecode.kv.KVStore."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field

from fastdecode import codec
from fastdecode.errors import FailedPrecondition, InvalidInput
from fastdecode.kv import KVStore
from fastdecode.rpc import Server, abort, code_from_int, item_error, request_id_of
from fastdecode.settings import ServiceSettings
from fastdecode.v1 import kv_attention_pb2 as pb
from fastdecode.v1 import kv_attention_pb2_grpc as pb_grpc

log = logging.getLogger("fastdecode.kv_attention")

KV_USAGE = Gauge("fastdecode_kv_usage_ratio", "Reserved share of the shard's KV pool", ["shard"])
KV_TOKENS = Gauge("fastdecode_kv_tokens_held", "Tokens held in the shard's KV-cache", ["shard"])
KV_BYTES_USED = Gauge("fastdecode_kv_bytes_used", "Bytes of the KV pool holding tokens", ["shard"])
KV_BYTES_CAPACITY = Gauge("fastdecode_kv_bytes_capacity", "Bytes of the shard's KV pool", ["shard"])
KV_SEQUENCES = Gauge("fastdecode_kv_sequences", "Sequences with KV on the shard", ["shard"])
ATTENTION_SECONDS = Histogram(
    "fastdecode_kv_attention_seconds",
    "Attention compute time per Attend item (one layer of one mini-batch)",
    ["shard"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
KV_BYTES_READ = Counter(
    "fastdecode_kv_bytes_read_total", "KV-cache bytes read by attention (keys and values)", ["shard"]
)
ATTEND_ERRORS = Counter(
    "fastdecode_kv_attend_errors_total", "Attend items answered with an error", ["shard", "code"]
)


class Settings(ServiceSettings):
    shard_id: int = Field(0, ge=0)
    kv_capacity: int = Field(1 << 30, ge=0, description="KV pool budget in bytes")
    kv_dtype: str = Field("float32", pattern="^(float32|float16|bfloat16)$")
    block_size: int = Field(16, ge=1, le=4096)
    ready_file: Path | None = None


class KVAttentionService(pb_grpc.KVAttentionServicer):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.shard = str(settings.shard_id)
        self.dtype = codec.DTYPE_NAMES[settings.kv_dtype]
        self.store: KVStore | None = None  # built from the geometry of the first reservation
        # One compute thread: items of a stream run in order, and the event loop stays free
        # for health checks and control calls while attention runs.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attend")
        self.lock = asyncio.Lock()
        self.attended_pairs = 0.0

    def _store_for(self, g: pb.KVGeometry) -> KVStore:
        if min(g.num_layers, g.num_kv_heads, g.head_dim) < 1:
            raise InvalidInput("reservation needs a positive KV geometry (layers, kv heads, head dim)")
        if self.store is None:
            self.store = KVStore(
                g.num_layers,
                g.num_kv_heads,
                g.head_dim,
                self.settings.kv_capacity,
                self.dtype,
                self.settings.block_size,
            )
            log.info(
                "KV pool: %d tokens (%d bytes) of geometry %s",
                self.store.capacity_tokens,
                self.store.capacity_bytes,
                (g.num_layers, g.num_kv_heads, g.head_dim),
            )
        elif not self.store.geometry_matches(g.num_layers, g.num_kv_heads, g.head_dim):
            have = (self.store.num_layers, self.store.num_kv_heads, self.store.head_dim)
            raise FailedPrecondition(
                f"shard holds KV of geometry {have}, not {(g.num_layers, g.num_kv_heads, g.head_dim)}"
            )
        return self.store

    def _update_gauges(self) -> None:
        s = self.store
        if s is not None and s.capacity_tokens:
            KV_USAGE.labels(self.shard).set(s.tokens_reserved / s.capacity_tokens)
            KV_TOKENS.labels(self.shard).set(s.tokens_held)
            KV_BYTES_USED.labels(self.shard).set(s.bytes_used)
            KV_BYTES_CAPACITY.labels(self.shard).set(s.capacity_bytes)
            KV_SEQUENCES.labels(self.shard).set(len(s.seqs))

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        try:
            async with self.lock:
                store = self._store_for(request.geometry)
                store.reserve_many([(s.seq_id, s.max_tokens) for s in request.sequences])
            self._update_gauges()
            seqs = request.sequences
            for rid, seq in zip(_request_ids(context, [s.seq_id for s in seqs]), seqs, strict=True):
                log.info("reserved %d KV tokens", seq.max_tokens, extra={"request_id": rid})
            return pb.ReserveResponse(free_tokens=store.free_tokens)
        except Exception as e:  # noqa: BLE001 - mapped to a status in one place
            await abort(context, e)
            raise  # unreachable: abort raises

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        released = 0
        if self.store is not None:
            async with self.lock:
                ids = list(self.store.seqs) if request.all else list(request.seq_ids)
                freed = [self.store.release(s) for s in ids]
            released = sum(freed)
            if request.all and released:
                log.info("released all %d sequences on request", released)
            elif not request.all:
                for rid, done in zip(_request_ids(context, ids), freed, strict=True):
                    if done:
                        log.info("released", extra={"request_id": rid})
        self._update_gauges()
        return pb.ReleaseResponse(released=released)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.ShardStats:
        s = self.store
        stats = pb.ShardStats(
            shard_id=self.settings.shard_id,
            kv_dtype=codec.wire_dtype(self.dtype),
            block_size=self.settings.block_size,
        )
        if s is not None:
            stats.configured = True
            stats.sequences = len(s.seqs)
            stats.tokens_held = s.tokens_held
            stats.tokens_reserved = s.tokens_reserved
            stats.bytes_used = s.bytes_used
            stats.bytes_capacity = s.capacity_bytes
            stats.attention_busy_seconds = s.busy_seconds
            stats.attend_items = s.attend_calls
            stats.free_tokens = s.free_tokens
            stats.attended_token_pairs = self.attended_pairs
            stats.blocks_in_use, stats.blocks_free = s.blocks_in_use, s.blocks_free
        else:
            stats.bytes_capacity = self.settings.kv_capacity
        return stats

    def _attend(self, req: pb.AttendRequest) -> tuple[torch.Tensor, float]:
        if self.store is None:
            raise FailedPrecondition("shard holds no sequences yet (nothing reserved)")
        q, k, v = codec.decode(req.q), codec.decode(req.k), codec.decode(req.v)
        t0 = time.perf_counter()
        o = self.store.attend(
            req.layer, list(req.seq_ids), list(req.num_tokens), list(req.start_pos), q, k, v
        )
        seconds = time.perf_counter() - t0
        # Each new token attends to every cached token of its sequence, its own chunk included.
        context = pairs = 0
        for p, n in zip(req.start_pos, req.num_tokens, strict=True):
            context += p + n
            pairs += n * (p + n)
        self.attended_pairs += pairs
        KV_BYTES_READ.labels(self.shard).inc(context * self.store.bytes_per_token // self.store.num_layers)
        return o, seconds

    async def Attend(
        self, request_iterator: AsyncIterator[pb.AttendRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttendResponse]:
        loop = asyncio.get_running_loop()
        async for req in request_iterator:
            resp = pb.AttendResponse(request_id=req.request_id)
            try:
                async with self.lock:
                    o, seconds = await loop.run_in_executor(self.pool, self._attend, req)
                codec.encode(o, resp.o)
                resp.attend_seconds = seconds
                ATTENTION_SECONDS.labels(self.shard).observe(seconds)
            except Exception as e:  # noqa: BLE001 - in-band error, the stream goes on
                resp.error.CopyFrom(item_error(e))
                ATTEND_ERRORS.labels(self.shard, code_from_int(resp.error.code).name).inc()
                log.debug("attend item %d failed: %s", req.request_id, e)
            yield resp
        self._update_gauges()


def _request_ids(context: grpc.aio.ServicerContext, seq_ids: Sequence[str]) -> list[str]:
    """The request ids the caller sent in metadata, one per sequence (the sequence ids otherwise)."""
    sent = (request_id_of(context) or "").split(",")
    return sent if len(sent) == len(seq_ids) else list(seq_ids)


async def serve(settings: Settings) -> None:
    log = settings.configure_logging(f"kv_attention[{settings.shard_id}]")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    server = Server(
        [pb.DESCRIPTOR.services_by_name["KVAttention"].full_name],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
    )
    service = KVAttentionService(settings)
    pb_grpc.add_KVAttentionServicer_to_server(service, server.server)
    server.install_signal_handlers()
    await server.start()
    await server.announce(settings.host, settings.metrics_port, settings.ready_file)
    log.info(
        "serving on %s:%d (capacity %d bytes, kv dtype %s)",
        settings.host,
        server.port,
        settings.kv_capacity,
        settings.kv_dtype,
    )
    await server.stopping.wait()
    log.info("stopping")
    await server.stop()
    service.pool.shutdown(wait=False)
