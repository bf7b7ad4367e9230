"""scheduler: the gRPC front of fastdecode.scheduling.driver.SchedulerDriver, and `serve()`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from fastdecode.protocol import SCHEDULER_ERROR_TRAILER
from fastdecode.runtime.errors import InvalidInput, Unavailable, as_service_error
from fastdecode.runtime.logs import bind_request_id
from fastdecode.runtime.rpc import Server, handles_errors, request_id_of
from fastdecode.runtime.settings import SchedulerSettings, split_addresses
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.session import RequestSession
from fastdecode.v1 import dense_pb2, dense_pb2_grpc
from fastdecode.v1 import scheduler_pb2 as pb
from fastdecode.v1 import scheduler_pb2_grpc as pb_grpc
from fastdecode.wire import scheduler as wire
from services.scheduler.links import GrpcDenseLink, GrpcShardLink
from services.scheduler.lora import LoraForward
from services.scheduler.metrics import PrometheusSchedulerMetrics

Settings = SchedulerSettings  # the one settings class: fastdecode.runtime.settings


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.dense = GrpcDenseLink(settings.dense, settings.tls, settings.step_timeout)
        shards = [GrpcShardLink(a, settings.tls) for a in split_addresses(settings.shards)]
        self._links: list[GrpcDenseLink | GrpcShardLink] = [self.dense, *shards]
        self.driver = SchedulerDriver(
            settings,
            self.dense,
            shards,
            PrometheusSchedulerMetrics(),
            make_shard_link=lambda address: GrpcShardLink(address, settings.tls),
        )

    async def close(self) -> None:
        """Close the links it made (gpu_dense and the shards it was started with)."""
        for link in self._links:
            await link.close()

    @handles_errors(trailers=SCHEDULER_ERROR_TRAILER)
    async def Submit(
        self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TokenEvent]:
        sid = request.request_id or request_id_of(context) or self.driver.new_id()
        bind_request_id(sid)  # this call's task logs with the request id from here on
        async for ev in self.driver.generate(wire.request_from_submit(sid, request)):
            yield wire.token_event_to_proto(ev)

    @handles_errors(trailers=SCHEDULER_ERROR_TRAILER)
    async def Session(
        self, requests: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvents]:
        session = RequestSession(self.driver)
        reader = asyncio.create_task(_read_session(session, requests))
        try:
            while (batch := await session.next_batch()) is not None:
                yield wire.session_events_to_proto(batch)
            await reader  # what broke the input, if anything, ends the call with its status
        finally:
            reader.cancel()
            session.close()  # a broken or cancelled session: what still runs on it is cancelled

    @handles_errors
    async def GetModelInfo(
        self, request: dense_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> dense_pb2.ModelInfo:
        if self.dense.model_info is None:
            raise Unavailable("scheduler not ready")
        return self.dense.model_info

    @handles_errors(trailers=SCHEDULER_ERROR_TRAILER)
    async def GetStats(
        self, request: pb.SchedulerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SchedulerStats:
        if self.driver.core is None:
            raise Unavailable("scheduler not ready")
        return wire.scheduler_stats_to_proto(self.driver)

    @handles_errors
    async def AddShard(
        self, request: dense_pb2.AddShardRequest, context: grpc.aio.ServicerContext
    ) -> dense_pb2.AddShardResponse:
        address = request.address.strip()
        index = await self.driver.add_shard(address, lambda a: GrpcShardLink(a, self.settings.tls))
        return dense_pb2.AddShardResponse(shard=index)

    @handles_errors
    async def RemoveShard(
        self, request: pb.RemoveShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.RemoveShardResponse:
        r = await self.driver.remove_shard(
            request.shard, request.address.strip(), max(0.0, request.timeout_seconds)
        )
        return wire.remove_result_to_proto(r)


async def _read_session(session: RequestSession, requests: AsyncIterator[pb.SessionRequest]) -> None:
    broken = True
    try:
        async for m in requests:
            kind = m.WhichOneof("kind")
            if kind == "submit":
                try:
                    req = wire.request_from_submit(m.submit.request_id, m.submit)
                except Exception as e:  # noqa: BLE001 - that request's in-band error, not the session's end
                    session.refuse(m.submit.request_id, as_service_error(e))
                    continue
                session.submit(req)
            elif kind == "cancel":
                session.cancel(m.cancel.request_id)
            else:
                session.refuse("", InvalidInput("a session message must be a submit or a cancel"))
        broken = False
    finally:
        session.end_input(broken)


async def _readiness(server: Server, driver: SchedulerDriver, interval: float) -> None:
    """Health says whether the fleet behind this scheduler can generate (gpu_dense reachable, a
    healthy shard); the gateway mirrors it."""
    while True:
        await server.set_readiness(driver.not_ready_reason())
        await asyncio.sleep(interval)


async def serve(settings: SchedulerSettings) -> None:
    log = settings.configure_logging("scheduler")
    service = SchedulerServicer(settings)
    driver = service.driver
    if not driver.shards:
        raise InvalidInput("the scheduler needs at least one shard (--shards HOST:PORT,...)")
    events = None
    if settings.kv_events:  # a bad address is one clear error, before anything starts
        from services.scheduler.kv_events import KVEventPublisher

        events = KVEventPublisher(settings.kv_events, settings.kv_events_topic, settings.kv_events_seed)
    server = Server(
        [pb.DESCRIPTOR.services_by_name["Scheduler"].full_name, "fastdecode.v1.LoraAdapters"],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
    )
    pb_grpc.add_SchedulerServicer_to_server(service, server.server)
    lora = LoraForward(service.dense.channel, settings.control_timeout)
    dense_pb2_grpc.add_LoraAdaptersServicer_to_server(lora, server.server)
    server.install_signal_handlers(settings.supervisor_pid)
    await server.start()
    await driver.connect()
    if events is not None and driver.core is not None:
        driver.core.prefixes.listener = events
        events.flush()
        log.info("KV events on %s", events.endpoint)
    tasks = [asyncio.create_task(driver.step_loop()), asyncio.create_task(driver.health_loop())]
    await server.announce(settings.host, settings.metrics_port, settings.ready_file)
    tasks.append(asyncio.create_task(_readiness(server, driver, settings.health_interval)))
    log.info(
        "serving on %s:%d; dense %s; %d shards; admission %s",
        settings.host,
        server.port,
        settings.dense,
        len(driver.shards),
        settings.admission,
    )
    stop = asyncio.create_task(server.stopping.wait())
    done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not stop and t.exception():
            log.error("scheduler loop died: %r", t.exception())
    log.info("stopping: draining %d requests", len(driver.streams))
    await server.stop(drain=driver.drain, cut_off=driver.cut_off)
    for t in tasks:
        t.cancel()
    if events is not None:
        events.flush()
        events.close()
