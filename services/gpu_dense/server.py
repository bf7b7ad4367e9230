"""gpu_dense: the S-part service. A thin gRPC adapter around StepRunner and its shard plane (the
exchange: services/gpu_dense/exchange/)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch

from fastdecode.contract import PlannedSeq
from fastdecode.dense import PipelineChooser, StepRunner
from fastdecode.dense.emulated import EmulatedModel, load_emulated
from fastdecode.dense.grammar import GrammarBank
from fastdecode.dense.multistep import run_steps, summed
from fastdecode.dense.outcome import Outcome, Timings
from fastdecode.model.config import ModelConfig, check_tensor_parallel
from fastdecode.model.dense import DenseModel
from fastdecode.model.weights import weights_fingerprint
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput, Unavailable
from fastdecode.runtime.progress import LOADING_WEIGHTS, ProgressFile
from fastdecode.runtime.rpc import Server, handles_errors
from fastdecode.runtime.settings import DenseSettings, is_emulated, split_addresses
from fastdecode.v1 import dense_pb2 as pb
from fastdecode.v1 import dense_pb2_grpc as pb_grpc
from fastdecode.wire import dense as wire
from services.gpu_dense import metrics
from services.gpu_dense.exchange.connect import make_plane
from services.gpu_dense.exchange.host_shard import HostShard, HostShardPlane
from services.gpu_dense.exchange.service import ShardPlaneService
from services.gpu_dense.lora import LoraService, check_settings, start_bank
from services.gpu_dense.ranks import Ranks

log = logging.getLogger("fastdecode.gpu_dense")

# a plan's outcomes and each of its decode steps' timings, or why it failed
Ran = tuple[dict[str, Outcome], list[Timings]] | Exception

Settings = DenseSettings  # the one settings class: fastdecode.runtime.settings


class DenseService(pb_grpc.DenseServicer):
    def __init__(self, settings: Settings, links: ShardPlaneService, host: HostShard | None = None) -> None:
        self.settings = settings
        self.links = links
        self.host = host  # the shard this process hosts (--host-shard), if any
        self.model: DenseModel | EmulatedModel | None = (
            None  # set by load(); calls before that get UNAVAILABLE
        )
        self.runner: StepRunner | None = None
        self.weights_id = ""  # the checkpoint's fingerprint: shards keep KV of these weights only
        self.ranks: Ranks | None = None  # --tensor-parallel N: ranks 1..N-1

    async def load(self) -> None:
        s = self.settings
        progress = ProgressFile(s.progress_file, LOADING_WEIGHTS) if s.progress_file else None
        dtype = codec.DTYPE_NAMES[s.dtype]
        if is_emulated(s.device):
            self.model = load_emulated(
                s.model, s.device, dtype, s.geometry, s.emulated_acceptance, s.tensor_parallel
            )
            log.warning(
                "device %s is EMULATED: no weights, synthetic tokens at the profile's roofline pace (%s)",
                s.device,
                self.model.profile,
            )
        elif s.tensor_parallel > 1:
            self.ranks = Ranks(s)
            self.ranks.spawn()  # from the event loop's thread, which lives as long as the process
            self.model = await asyncio.to_thread(self.ranks.load, progress)
            self.weights_id = await asyncio.to_thread(weights_fingerprint, s.model)
        else:
            self.model = await asyncio.to_thread(
                DenseModel.from_pretrained, s.model, s.device, dtype, progress
            )
            self.weights_id = await asyncio.to_thread(weights_fingerprint, s.model)
        chooser = PipelineChooser() if s.pipeline_mode == "auto" else None
        c = self.model.config
        grammars = GrammarBank(
            Path(s.model) / "tokenizer.json", c.vocab_size, c.eos_token_ids, wait_s=s.grammar_wait
        )
        loras = None if isinstance(self.model, EmulatedModel) else await start_bank(s, self.model)
        self.runner = StepRunner(self.model, self.links, chooser, grammars, loras)

    def _ready(self) -> tuple[DenseModel | EmulatedModel, StepRunner]:
        if self.model is None or self.runner is None:
            raise Unavailable("gpu_dense is still loading its weights")
        return self.model, self.runner

    @handles_errors
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        model, _ = self._ready()
        return wire.model_info_to_proto(
            model.served_config if isinstance(model, EmulatedModel) else model.config,
            str(self.settings.model),
            self.settings.dtype,
            model.label if isinstance(model, EmulatedModel) else str(model.device),
            [link.address for link in self.links.links],
            [link.index for link in self.links.links if link.removed],
            self.weights_id,
        )

    @handles_errors
    async def AddShard(
        self, request: pb.AddShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.AddShardResponse:
        address = request.address.strip()
        if not address or ":" not in address:
            raise InvalidInput(f"shard address must be HOST:PORT, got {request.address!r}")
        for link in self.links.links:
            if link.address == address:
                await self.links.restore(link.index)  # a removed shard back on its address (a restarted pod)
                return pb.AddShardResponse(shard=link.index)
        index = await self.links.add_shard(address)
        log.info("added %s", self.links.links[index].name)
        return pb.AddShardResponse(shard=index)

    @handles_errors
    async def RemoveShard(
        self, request: pb.DenseRemoveShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.DenseRemoveShardResponse:
        await self.links.remove(request.shard)
        return pb.DenseRemoveShardResponse()

    async def _execute(
        self, runner: StepRunner, plan: pb.StepPlan, seqs: list[PlannedSeq] | Exception
    ) -> Ran:
        runner.forget(plan.ended)
        try:
            if isinstance(seqs, Exception):
                raise seqs
            return await run_steps(runner, seqs, plan.pipeline)
        except Exception as e:  # noqa: BLE001 - a failed step is reported in-band
            return e

    def _result(self, plan: pb.StepPlan, ran: Ran) -> pb.StepResult:
        if isinstance(ran, Exception):
            return wire.step_result(plan.step, {}, None, ran)
        outcomes, steps = ran
        t = summed(steps)
        for sid, o in outcomes.items():
            if o.error is not None:
                log.warning("step %d failed: %s", plan.step, o.error, extra={"request_id": sid})
        if self.host is not None and t.pipelined:  # the S-part ran on the hosted shard's cores too
            self.host.count_dense_busy(t.s_part_seconds)
        failed = sum(1 for o in outcomes.values() if o.error is not None)
        metrics.plan_done(len(outcomes) - failed, failed)
        for each in steps:
            metrics.step_done(each)
        if isinstance(self.model, EmulatedModel):
            metrics.device_time(self.model.clock.compute_seconds, self.model.clock.copy_seconds)
        return wire.step_result(plan.step, outcomes, t)

    @handles_errors
    async def Run(
        self, request_iterator: AsyncIterator[pb.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        _, runner = self._ready()
        # Plans are read and converted as they come, so one the scheduler planned ahead is ready the
        # moment the step before it ends; they run in order.
        ready: asyncio.Queue[tuple[pb.StepPlan, list[PlannedSeq] | Exception] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for plan in request_iterator:
                    try:
                        ready.put_nowait((plan, wire.planned_seqs_from_proto(plan)))
                    except Exception as e:  # noqa: BLE001 - reported in-band, as a failed step
                        ready.put_nowait((plan, e))
            finally:
                ready.put_nowait(None)

        reader = asyncio.create_task(read())

        def start(
            plan: pb.StepPlan, seqs: list[PlannedSeq] | Exception
        ) -> tuple[pb.StepPlan, asyncio.Future[Ran]]:
            for p in seqs if isinstance(seqs, list) else ():
                # The step stream is shared by every request, so its gRPC metadata cannot name one:
                # each item's seq_id is the request id the gateway gave it.
                if p.start_pos == 0:
                    log.info(
                        "prefill step %d: %d tokens, shard %d",
                        plan.step,
                        len(p.token_ids),
                        p.shard,
                        extra={"request_id": p.seq_id},
                    )
            return plan, asyncio.ensure_future(self._execute(runner, plan, seqs))

        running: list[tuple[pb.StepPlan, asyncio.Future[Ran]]] = []
        more = True
        try:
            while True:
                if not running:
                    item = await ready.get() if more else None
                    if item is None:
                        break
                    running.append(start(*item))
                plan, task = running[0]
                ran = await task
                running.pop(0)
                # A plan already here (planned ahead) starts now: its device time covers this step's
                # result being built and sent, as a GPU computes while its host serializes.
                if more and not ready.empty():
                    item = ready.get_nowait()
                    if item is None:
                        more = False
                    else:
                        running.append(start(*item))
                yield self._result(plan, ran)
            await reader  # what ended the stream, if it failed
        finally:
            reader.cancel()
            for _, task in running:
                task.cancel()


async def serve(settings: Settings) -> None:
    log = settings.configure_logging("gpu_dense")
    if is_emulated(settings.device):  # an unknown profile or a geometry too big: one line, before any port
        dtype = codec.DTYPE_NAMES[settings.dtype]
        load_emulated(
            settings.model,
            settings.device,
            dtype,
            settings.geometry,
            settings.emulated_acceptance,
            settings.tensor_parallel,
        )
    elif settings.geometry:
        raise InvalidInput("--geometry needs an emulated device (--device emulated:NAME)")
    elif settings.tensor_parallel > 1:  # heads the ranks cannot split: one line, before any port
        check_tensor_parallel(ModelConfig.from_pretrained(settings.model), settings.tensor_parallel)
    check_settings(settings, is_emulated(settings.device))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    elif is_emulated(settings.device):  # no math but the sampling stand-in: one thread, as beside a GPU
        torch.set_num_threads(1)
    addresses = split_addresses(settings.shards)
    if not addresses:
        raise InvalidInput("gpu_dense needs at least one shard (--shards HOST:PORT,...)")
    server = Server(
        [pb.DESCRIPTOR.services_by_name[name].full_name for name in ("Dense", "LoraAdapters")],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
    )
    server.install_signal_handlers(settings.supervisor_pid)
    host = _host_shard(settings, addresses)
    remote = len(addresses) - (host is not None)
    links: ShardPlaneService = await make_plane(settings, addresses, remote)  # in process, or workers
    if host is not None:
        links = HostShardPlane(links, host)
        await host.start()
    service = DenseService(settings, links, host)
    pb_grpc.add_DenseServicer_to_server(service, server.server)
    loras = LoraService(settings, lambda: service.runner.loras if service.runner is not None else None)
    pb_grpc.add_LoraAdaptersServicer_to_server(loras, server.server)
    await server.start()  # NOT_SERVING while the weights load
    await service.load()
    await server.announce(settings.host, settings.metrics_port, settings.ready_file)
    log.info(
        "serving %s on %s:%d, device %s, %d shards",
        settings.model,
        settings.host,
        server.port,
        service.model.device if service.model else "?",
        links.num_shards,
    )
    await server.stopping.wait()
    log.info("stopping")
    await server.stop()
    if service.ranks is not None:
        await asyncio.to_thread(service.ranks.close)
    if host is not None:
        await host.stop()
    await links.close()


def _host_shard(settings: Settings, addresses: list[str]) -> HostShard | None:
    index = settings.host_shard
    if index is None:
        return None
    if index >= len(addresses):
        raise InvalidInput(f"--host-shard {index} is not an index into the {len(addresses)} --shards")
    return HostShard(settings, index, addresses[index])
