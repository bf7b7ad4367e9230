"""kv_attention: the R-part service. A thin gRPC adapter around fastdecode.shard.ShardCore."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram

from fastdecode import codec
from fastdecode.kv import KV_DTYPES, native
from fastdecode.protocol import DATA_PLANE_OPTIONS
from fastdecode.rpc import Server, abort, code_from_int, item_error, request_id_of
from fastdecode.settings import ShardSettings
from fastdecode.shard import ShardCore
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


Settings = ShardSettings  # the one settings class: fastdecode.settings


class KVAttentionService(pb_grpc.KVAttentionServicer):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.shard = str(settings.shard_id)
        self.core = ShardCore(
            settings.kv_capacity,
            KV_DTYPES[settings.kv_dtype],
            settings.block_size,
            backend=settings.attention_backend,
        )
        # per-item metrics, resolved once rather than by label on every item
        self._attention_seconds = ATTENTION_SECONDS.labels(self.shard)
        self._kv_bytes_read = KV_BYTES_READ.labels(self.shard)
        self._update_gauges()

    def _update_gauges(self) -> None:
        s = self.core.store
        if s is None:
            # Visible from the first scrape, before any sequence: an idle shard is empty, not absent.
            # Its pool is sized by the first reservation's geometry; until then the budget is its size.
            for gauge in (KV_USAGE, KV_TOKENS, KV_BYTES_USED, KV_SEQUENCES):
                gauge.labels(self.shard).set(0)
            KV_BYTES_CAPACITY.labels(self.shard).set(self.settings.kv_capacity)
        elif s.capacity_tokens:
            KV_USAGE.labels(self.shard).set(s.tokens_reserved / s.capacity_tokens)
            KV_TOKENS.labels(self.shard).set(s.tokens_held)
            KV_BYTES_USED.labels(self.shard).set(s.bytes_used)
            KV_BYTES_CAPACITY.labels(self.shard).set(s.capacity_bytes)
            KV_SEQUENCES.labels(self.shard).set(len(s.seqs))

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        g, seqs = request.geometry, request.sequences
        try:
            free = self.core.reserve(
                (g.num_layers, g.num_kv_heads, g.head_dim), [(s.seq_id, s.max_tokens) for s in seqs]
            )
        except Exception as e:  # noqa: BLE001 - mapped to a status in one place
            await abort(context, e)
            raise  # unreachable: abort raises
        self._update_gauges()
        for rid, seq in zip(_request_ids(context, [s.seq_id for s in seqs]), seqs, strict=True):
            log.info("reserved %d KV tokens", seq.max_tokens, extra={"request_id": rid})
        return pb.ReserveResponse(free_tokens=free)

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        store = self.core.store
        ids = (list(store.seqs) if store is not None else []) if request.all else list(request.seq_ids)
        freed = self.core.release(None if request.all else ids)
        released = sum(freed)
        if request.all and released:
            log.info("released all %d sequences on request", released)
        elif not request.all:
            for rid, done in zip(_request_ids(context, ids), freed, strict=False):
                if done:
                    log.info("released", extra={"request_id": rid})
        self._update_gauges()
        return pb.ReleaseResponse(released=released)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.ShardStats:
        s = self.core.store
        stats = pb.ShardStats(
            shard_id=self.settings.shard_id,
            kv_dtype=codec.wire_dtype(self.core.dtype),
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
            stats.attended_token_pairs = self.core.attended_pairs
            stats.blocks_in_use, stats.blocks_free = s.blocks_in_use, s.blocks_free
        else:
            stats.bytes_capacity = self.settings.kv_capacity
        return stats

    async def Fill(self, request: pb.FillRequest, context: grpc.aio.ServicerContext) -> pb.FillResponse:
        # On the loop, like Attend items: a fill never interleaves with a step's attention.
        try:
            n = self.core.fill(list(request.seq_ids), request.tokens, request.seed)
        except Exception as e:  # noqa: BLE001 - mapped to a status in one place
            await abort(context, e)
            raise  # unreachable: abort raises
        self._update_gauges()
        log.info("filled %d sequences with %d tokens of random KV", len(request.seq_ids), n)
        return pb.FillResponse(tokens_written=n)

    def answer(self, req: pb.AttendRequest) -> bytes | pb.AttendResponse:
        """One Attend item, run right here on the event loop: a hop to a worker thread and back
        cost more than the item on this path (see `bench transport --breakdown`). Reserve and
        Release run on this loop too, so they never interleave with an item. An answer goes out
        as wire bytes (o copied once, by codec.serialize_with; the server's guard passes bytes
        through), an error as an AttendResponse message."""
        try:
            r = self.core.attend(req)
            self._attention_seconds.observe(r.seconds)
            self._kv_bytes_read.inc(r.kv_bytes_read)
            head = pb.AttendResponse(request_id=req.request_id, attend_seconds=r.seconds)
            return codec.serialize_with(head, o=r.o)
        except Exception as e:  # noqa: BLE001 - in-band error, the stream goes on
            resp = pb.AttendResponse(request_id=req.request_id)
            resp.error.CopyFrom(item_error(e))
            ATTEND_ERRORS.labels(self.shard, code_from_int(resp.error.code).name).inc()
            log.debug("attend item %d failed: %s", req.request_id, e)
            return resp

    async def Attend(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        # Direct reads and writes on the stream: no async generator between us and gRPC.
        while (req := await context.read()) is not grpc.aio.EOF:
            await context.write(self.answer(req))
        self._update_gauges()


def _request_ids(context: grpc.aio.ServicerContext, seq_ids: Sequence[str]) -> list[str]:
    """The request ids the caller sent in metadata, one per sequence (the sequence ids otherwise)."""
    sent = (request_id_of(context) or "").split(",")
    return sent if len(sent) == len(seq_ids) else list(seq_ids)


async def serve(settings: Settings) -> None:
    log = settings.configure_logging(f"kv_attention[{settings.shard_id}]")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.attention_backend == "native":
        try:  # fail at start with one line, not at the first reservation
            log.info("native attention kernel: %s path", native.isa())
        except native.NativeUnavailable as e:
            raise SystemExit(f"kv_attention: {e}") from None
    server = Server(
        [pb.DESCRIPTOR.services_by_name["KVAttention"].full_name],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
        options=DATA_PLANE_OPTIONS,
    )
    service = KVAttentionService(settings)
    pb_grpc.add_KVAttentionServicer_to_server(service, server.server)
    server.install_signal_handlers(settings.supervisor_pid)
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
