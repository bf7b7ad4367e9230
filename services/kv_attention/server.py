"""kv_attention: the R-part service. A thin gRPC adapter around fastdecode.kv.shard.ShardCore."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import grpc
import torch

from fastdecode.kv import KV_DTYPES, AttendBatch, native
from fastdecode.kv.shard import AttendResult, ShardCore
from fastdecode.protocol import DATA_PLANE_OPTIONS, MAX_MESSAGE_BYTES
from fastdecode.runtime import codec
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, ResourceExhausted, ServiceError
from fastdecode.runtime.rpc import (
    Server,
    aio_channel,
    code_from_int,
    handles_errors,
    maps_rpc_errors,
    request_id_of,
    request_metadata,
)
from fastdecode.runtime.settings import ShardSettings
from fastdecode.v1 import kv_attention_pb2 as pb
from fastdecode.v1 import kv_attention_pb2_grpc as pb_grpc
from fastdecode.wire import kv as wire
from fastdecode.wire.errors import item_error
from fastdecode.wire.kv_control import geometry_from_proto
from services.kv_attention.metrics import ShardMetrics

log = logging.getLogger("fastdecode.kv_attention")

Settings = ShardSettings  # the one settings class: fastdecode.runtime.settings


class KVAttentionService(pb_grpc.KVAttentionServicer):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.shard = str(settings.shard_id)
        self.core = ShardCore(
            settings.kv_capacity,
            KV_DTYPES[settings.kv_dtype],
            settings.block_size,
            backend=settings.attention_backend,
            pool_file=settings.kv_dir / f"shard-{settings.shard_id}" if settings.kv_dir else None,
        )
        self.metrics = ShardMetrics(self.shard, settings.kv_capacity)
        self.max_reply_bytes = MAX_MESSAGE_BYTES  # what gpu_dense's Attend stream takes
        self.retire: Callable[[], Awaitable[None]] | None = None  # serve(): stop serving and exit
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.pool(self.core.store)

    @handles_errors
    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        seqs = request.sequences
        free, cached = self.core.reserve(
            geometry_from_proto(request.geometry),
            [(s.seq_id, s.max_tokens, list(s.token_ids), s.cache_salt) for s in seqs],
            request.model,
        )
        self._update_gauges()
        for rid, seq in zip(_request_ids(context, [s.seq_id for s in seqs]), seqs, strict=True):
            log.info("reserved %d KV tokens", seq.max_tokens, extra={"request_id": rid})
        return pb.ReserveResponse(free_tokens=free, cached_tokens=cached)

    @handles_errors
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

    @handles_errors
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.ShardStats:
        return wire.shard_stats_to_proto(self.settings.shard_id, self.core)

    @handles_errors
    async def Reattach(
        self, request: pb.ReattachRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReattachResponse:
        r = self.core.reattach(geometry_from_proto(request.geometry), request.model, list(request.keep))
        self._update_gauges()
        log.info(
            "re-attached: %d sequences resume, %d freed, %d positions torn%s",
            len(r.positions),
            r.released,
            r.torn_positions,
            f"; pool discarded: {r.discarded}" if r.discarded else "",
        )
        held = [pb.HeldSequence(seq_id=s, tokens=n) for s, n in r.positions.items()]
        return pb.ReattachResponse(
            sequences=held, released=r.released, torn_positions=r.torn_positions, discarded=r.discarded
        )

    @handles_errors
    async def Fill(self, request: pb.FillRequest, context: grpc.aio.ServicerContext) -> pb.FillResponse:
        # On the loop, like Attend items: a fill never interleaves with a step's attention.
        n = self.core.fill(list(request.seq_ids), request.tokens, request.seed)
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
            r = self.core.attend(req.layer, wire.attend_batch(req))
            self._attended(req.layer, r)
            head = pb.AttendResponse(request_id=req.request_id, attend_seconds=r.seconds)
            reply = codec.serialize_with(head, o=r.o)
            if len(reply) > self.max_reply_bytes:
                # gRPC would fail the whole stream mid-write (a traceback here, every item lost):
                # this item's error instead, in-band, and the stream goes on
                raise ResourceExhausted(
                    f"the reply to item {req.request_id} has {len(reply)} bytes; the limit is "
                    f"{self.max_reply_bytes}: send fewer sequences per item"
                )
            return reply
        except Exception as e:  # noqa: BLE001 - in-band error, the stream goes on
            resp = pb.AttendResponse(request_id=req.request_id)
            resp.error.CopyFrom(item_error(e))
            self.metrics.attend_failed(code_from_int(resp.error.code).name)
            log.debug("attend item %d failed: %s", req.request_id, e)
            return resp

    def attend_tensors(self, layer: int, batch: AttendBatch) -> torch.Tensor:
        """One item handed over in process by the gpu_dense that hosts this shard (no wire): attended
        and accounted as answer() does; a failure is raised, for the caller's item."""
        try:
            r = self.core.attend(layer, batch)
        except Exception as e:
            self.metrics.attend_failed(code_from_int(item_error(e).code).name)
            raise
        self._attended(layer, r)
        return r.o

    def _attended(self, layer: int, r: AttendResult) -> None:
        self.metrics.attended(r.seconds, r.kv_bytes_read, r.cpu_seconds)
        if (store := self.core.store) is not None and layer == store.num_layers - 1:
            # The store counts a token as held once its last layer is in: the gauges follow each
            # mini-batch's step here, not only Reserve/Release (the Attend stream stays open).
            self._update_gauges()

    @handles_errors
    async def Attend(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        # Direct reads and writes on the stream: no async generator between us and gRPC.
        while (req := await context.read()) is not grpc.aio.EOF:
            await context.write(self.answer(req))
        self._update_gauges()

    @handles_errors
    async def MigrateOut(
        self, request: pb.MigrateOutRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateOutResponse:
        t0 = time.perf_counter()
        chunks = wire.export_chunks(self.core, request.seq_id, request.tokens)
        if ":" not in request.target:
            raise InvalidInput(f"migration target must be HOST:PORT, got {request.target!r}")
        resp = await self._send(request.target, request.seq_id, chunks, context.time_remaining())
        seconds = time.perf_counter() - t0
        log.info(
            "migrated %d tokens (%d bytes) to %s in %.3fs",
            resp.tokens,
            resp.bytes,
            request.target,
            seconds,
            extra={"request_id": request.seq_id},
        )
        return pb.MigrateOutResponse(tokens=resp.tokens, bytes=resp.bytes, seconds=seconds)

    @maps_rpc_errors(prefix=lambda self, target, *_: f"migration target {target}: ")
    async def _send(
        self, target: str, seq_id: str, chunks: Iterator[pb.KVChunk], timeout: float | None
    ) -> pb.ImportResponse:
        """One sequence's chunks to the target shard's ImportSequence, on a channel of its own."""
        channel = aio_channel(target, self.settings.tls, DATA_PLANE_OPTIONS)
        try:
            return await pb_grpc.KVAttentionStub(channel).ImportSequence(
                chunks, timeout=timeout, metadata=request_metadata(seq_id)
            )
        finally:
            await channel.close()

    @handles_errors
    async def ImportSequence(
        self, request_iterator: AsyncIterator[pb.KVChunk], context: grpc.aio.ServicerContext
    ) -> pb.ImportResponse:
        tokens, nbytes = await wire.import_chunks(self.core, request_iterator.__aiter__())
        self._update_gauges()
        return pb.ImportResponse(tokens=tokens, bytes=nbytes)

    @handles_errors
    async def Retire(self, request: pb.RetireRequest, context: grpc.aio.ServicerContext) -> pb.RetireResponse:
        held = sum(self.core.release(None))
        log.info("retired by the scheduler (freed %d sequences): stopping", held)
        if self.retire is None:
            raise FailedPrecondition("this shard cannot retire (not run by serve())")
        await self.retire()
        return pb.RetireResponse(sequences=held)


def _request_ids(context: grpc.aio.ServicerContext, seq_ids: Sequence[str]) -> list[str]:
    """The request ids the caller sent in metadata, one per sequence (the sequence ids otherwise)."""
    sent = (request_id_of(context) or "").split(",")
    return sent if len(sent) == len(seq_ids) else list(seq_ids)


def build(settings: Settings) -> tuple[Server, KVAttentionService]:
    """The shard's server (not started) with its service added: serve() below, and a shard that
    gpu_dense hosts in its own process (services/gpu_dense/exchange/host_shard.py)."""
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
    return server, service


async def serve(settings: Settings) -> None:
    log = settings.configure_logging(f"kv_attention[{settings.shard_id}]")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.attention_backend == "native":
        try:  # fail at start with one line, not at the first reservation
            log.info("native attention kernel: %s path", native.isa())
        except native.NativeUnavailable as e:
            raise SystemExit(f"kv_attention: {e}") from None
    try:
        server, service = build(settings)
    except ServiceError as e:  # a pool another process holds: one line, not a traceback
        raise SystemExit(f"kv_attention: {e.message}") from None

    async def retire() -> None:  # NOT_SERVING at once (no probe takes it back), then stop as on SIGTERM
        await server.set_serving(False)
        server.stopping.set()

    service.retire = retire
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
    service.core.close()  # a persistent pool is left consistent and marked clean
