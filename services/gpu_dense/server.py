"""gpu_dense: the S-part service. A thin gRPC adapter around StepRunner and the shard links."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import torch
from prometheus_client import Counter, Histogram

from fastdecode import codec, convert
from fastdecode.dense import DenseSeq, PipelineChooser, StepRunner
from fastdecode.errors import InvalidInput, Unavailable
from fastdecode.model import DenseModel
from fastdecode.progress import LOADING_WEIGHTS, ProgressFile
from fastdecode.rpc import Server, abort, item_error
from fastdecode.settings import DenseSettings, split_addresses
from fastdecode.v1 import dense_pb2 as pb
from fastdecode.v1 import dense_pb2_grpc as pb_grpc
from services.gpu_dense.exchange import make_plane
from services.gpu_dense.shards import ShardLink, ShardLinks

log = logging.getLogger("fastdecode.gpu_dense")

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_SECONDS = Histogram("fastdecode_dense_step_seconds", "Wall time of one dense step", buckets=_SECONDS)
S_PART_SECONDS = Histogram(
    "fastdecode_dense_s_part_seconds", "S-part compute time per step (both mini-batches)", buckets=_SECONDS
)
SHARD_WAIT_SECONDS = Histogram(
    "fastdecode_dense_shard_wait_seconds",
    "Time per step the dense half spent waiting on the shards (not hidden by S-part work)",
    buckets=_SECONDS,
)
OVERLAP_RATIO = Histogram(
    "fastdecode_dense_pipeline_overlap_ratio",
    "Per step, the share of the shorter half (S-part or attention) hidden behind the other",
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
STEPS = Counter(
    "fastdecode_dense_steps_total",
    "Dense steps, by mode: piped (two mini-batches) or plain (what --pipeline auto chose shows here)",
    ["mode"],
)
STEP_SEQUENCES = Counter(
    "fastdecode_dense_sequences_total", "Sequences computed in steps, by outcome", ["outcome"]
)


Settings = DenseSettings  # the one settings class: fastdecode.settings


class DenseService(pb_grpc.DenseServicer):
    def __init__(self, settings: Settings, links: ShardLinks) -> None:
        self.settings = settings
        self.links = links
        self.model: DenseModel | None = None  # set by load(); calls before that get UNAVAILABLE
        self.runner: StepRunner | None = None

    async def load(self) -> None:
        s = self.settings
        progress = ProgressFile(s.progress_file, LOADING_WEIGHTS) if s.progress_file else None
        self.model = await asyncio.to_thread(
            DenseModel.from_pretrained, s.model, s.device, codec.DTYPE_NAMES[s.dtype], progress
        )
        chooser = PipelineChooser() if s.pipeline_mode == "auto" else None
        self.runner = StepRunner(self.model, self.links, chooser)

    async def _ready(self, context: grpc.aio.ServicerContext) -> tuple[DenseModel, StepRunner]:
        if self.model is None or self.runner is None:
            await abort(context, Unavailable("gpu_dense is still loading its weights"))
        return self.model, self.runner  # type: ignore[return-value]

    def model_info(self, model: DenseModel) -> pb.ModelInfo:
        c = model.config
        info = pb.ModelInfo(
            model_type=c.model_type,
            model_path=str(self.settings.model),
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            max_position_embeddings=c.max_position_embeddings,
            eos_token_ids=list(c.eos_token_ids),
            dtype=self.settings.dtype,
            device=str(model.device),
            num_shards=self.links.num_shards,
            shards=[link.address for link in self.links.links],
        )
        if c.bos_token_id is not None:
            info.bos_token_id = c.bos_token_id
        return info

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        model, _ = await self._ready(context)
        return self.model_info(model)

    async def AddShard(
        self, request: pb.AddShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.AddShardResponse:
        address = request.address.strip()
        if not address or ":" not in address:
            await abort(context, InvalidInput(f"shard address must be HOST:PORT, got {request.address!r}"))
        for link in self.links.links:
            if link.address == address:
                return pb.AddShardResponse(shard=link.index)
        link = ShardLink(self.links.num_shards, address, self.settings.tls, self.settings.shard_timeout)
        self.links.add(link)
        log.info("added %s", link.name)
        return pb.AddShardResponse(shard=link.index)

    @staticmethod
    def _seq(p: pb.PlannedSequence) -> DenseSeq:
        return DenseSeq(
            seq_id=p.seq_id,
            shard=p.shard,
            mini_batch=p.mini_batch,
            token_ids=list(p.token_ids),
            start_pos=p.start_pos,
            sampling=convert.sampling_from_proto(p.sampling),
            sample=p.sample,
            sample_index=p.sample_index,
        )

    async def step(self, runner: StepRunner, plan: pb.StepPlan) -> pb.StepResult:
        result = pb.StepResult(step=plan.step)
        try:
            outcomes, t = await runner.run([self._seq(p) for p in plan.sequences], plan.pipeline)
        except Exception as e:  # noqa: BLE001 - a failed step is reported in-band
            result.error.CopyFrom(item_error(e))
            return result
        for sid, o in outcomes.items():
            r = result.results.add(seq_id=sid, token_id=o.token_id, logprob=o.logprob)
            if o.error is not None:
                r.error.CopyFrom(item_error(o.error))
                log.warning("step %d failed: %s", plan.step, o.error, extra={"request_id": sid})
        failed = sum(1 for o in outcomes.values() if o.error is not None)
        STEP_SEQUENCES.labels("ok").inc(len(outcomes) - failed)
        STEP_SEQUENCES.labels("error").inc(failed)
        result.timings.s_part_seconds = t.s_part_seconds
        result.timings.shard_wait_seconds = t.shard_wait_seconds
        result.timings.step_seconds = t.step_seconds
        result.timings.attend_seconds = t.attend_seconds
        result.timings.overlap_ratio = t.overlap_ratio
        STEPS.labels("piped" if t.pipelined else "plain").inc()
        STEP_SECONDS.observe(t.step_seconds)
        S_PART_SECONDS.observe(t.s_part_seconds)
        SHARD_WAIT_SECONDS.observe(t.shard_wait_seconds)
        OVERLAP_RATIO.observe(t.overlap_ratio)  # 0 with the pipeline off: nothing overlaps
        return result

    async def Run(
        self, request_iterator: AsyncIterator[pb.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        _, runner = await self._ready(context)
        async for plan in request_iterator:
            for p in plan.sequences:
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
            yield await self.step(runner, plan)


async def serve(settings: Settings) -> None:
    log = settings.configure_logging("gpu_dense")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    addresses = split_addresses(settings.shards)
    if not addresses:
        raise InvalidInput("gpu_dense needs at least one shard (--shards HOST:PORT,...)")
    server = Server(
        [pb.DESCRIPTOR.services_by_name["Dense"].full_name],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
    )
    server.install_signal_handlers(settings.supervisor_pid)
    links = await make_plane(settings, addresses)  # in process, or exchange worker processes
    service = DenseService(settings, links)
    pb_grpc.add_DenseServicer_to_server(service, server.server)
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
    await links.close()
