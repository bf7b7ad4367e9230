"""scheduler: the brain. A gRPC adapter that drives fastdecode.scheduling.SchedulerCore.

One loop runs the steps: core.next_step() -> release/reserve on the shards -> the plan to
gpu_dense over one persistent Run stream -> core.apply(results) -> token events to the
Submit streams. Shard loss (stream error or failed health check) hands the shard's
sequences back to the core, which re-prefills them on the survivors.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field

from fastdecode import codec
from fastdecode.errors import InvalidInput, Unavailable
from fastdecode.logs import bind_request_id
from fastdecode.rpc import (
    Server,
    abort,
    aio_channel,
    code_from_int,
    error_from_status,
    request_id_of,
    request_metadata,
)
from fastdecode.scheduling import (
    NaiveAdmission,
    Request,
    Sampling,
    SchedulerCore,
    ShardSpec,
    StabilizedAdmission,
    Step,
    TokenEvent,
)
from fastdecode.settings import ServiceSettings, split_addresses
from fastdecode.v1 import dense_pb2, dense_pb2_grpc, kv_attention_pb2, kv_attention_pb2_grpc
from fastdecode.v1 import scheduler_pb2 as pb
from fastdecode.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("fastdecode.scheduler")

RUNNING = Gauge("fastdecode_num_requests_running", "Sequences decoding")
WAITING = Gauge("fastdecode_num_requests_waiting", "Sequences queued for admission")
KV_LOAD = Gauge("fastdecode_kv_load_tokens", "Total KV tokens held across shards")
SHARD_TOKENS = Gauge("fastdecode_shard_kv_tokens", "KV tokens held per shard", ["shard"])
SHARD_USAGE = Gauge(
    "fastdecode_kv_cache_usage_ratio", "Reserved share of each shard's KV capacity", ["shard"]
)
SHARD_HEALTHY = Gauge("fastdecode_shard_healthy", "1 while the shard takes sequences", ["shard"])
RECOVERIES = Counter("fastdecode_shard_recoveries_total", "Sequences re-prefilled after a shard loss")
PREEMPTIONS = Counter(
    "fastdecode_preemptions_total",
    "Sequences preempted (KV freed, recomputed later) because a shard was full",
)
SHARD_LOSSES = Counter("fastdecode_shard_losses_total", "Shards detected lost")
ADMISSIONS = Counter(
    "fastdecode_admission_decisions_total",
    "Admission outcomes: sequences admitted or rejected (queue full); steps in which waiting "
    "sequences were deferred by the policy or by shard capacity",
    ["decision"],
)
STEP_SECONDS = Histogram(
    "fastdecode_scheduler_step_seconds",
    "Scheduler step wall time (reservations and the dense run included)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
BATCH_SIZE = Histogram(
    "fastdecode_scheduler_batch_size",
    "Sequences per step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)


class Settings(ServiceSettings):
    dense: str = Field(..., description="HOST:PORT of gpu_dense")
    shards: str = Field(..., description="HOST:PORT of the kv_attention shards, same order as gpu_dense's")
    admission: str = Field("naive", pattern="^(naive|stabilized)$")
    w_limit: float | None = Field(None, gt=0, description="W_lim in KV tokens (stabilized); derived if unset")
    micro_batch: int | None = Field(None, ge=1)
    max_running: int = Field(256, ge=1, description="most sequences decoding at once (the batch B)")
    max_waiting: int = Field(1024, ge=0, description="bounded waiting queue; full = RESOURCE_EXHAUSTED")
    prefill_token_budget: int = Field(2048, ge=1, description="prefill tokens per step (chunked prefill)")
    kv_lookahead: int = Field(
        64, ge=0, description="KV headroom: steps of growth admission leaves room for per running sequence"
    )
    pipeline: bool = True
    health_interval: float = Field(1.0, gt=0)
    step_timeout: float = Field(120.0, gt=0)
    startup_timeout: float = Field(300.0, gt=0)
    ready_file: Path | None = None


@dataclass
class _Stream:
    """A Submit call's mailbox: events from the step loop, or a terminal error."""

    queue: asyncio.Queue[TokenEvent | BaseException] = field(default_factory=asyncio.Queue)


@dataclass
class _Shard:
    address: str
    stub: kv_attention_pb2_grpc.KVAttentionStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = True
    busy: float = 0.0  # last attention_busy_seconds / attended_token_pairs seen
    pairs: float = 0.0
    r: float | None = None  # measured seconds per new token per cached token


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.dense_channel = aio_channel(settings.dense, settings.tls)
        self.dense = dense_pb2_grpc.DenseStub(self.dense_channel)
        self.shards: list[_Shard] = []
        for address in split_addresses(settings.shards):
            self._add_shard_link(address)
        self.info: dense_pb2.ModelInfo | None = None
        self.core: SchedulerCore | None = None
        self.streams: dict[str, _Stream] = {}
        self.wake = asyncio.Event()
        self.draining = False
        self._ids = itertools.count()
        self._run_queue: asyncio.Queue[dense_pb2.StepPlan | None] | None = None
        self._run_call: grpc.aio.StreamStreamCall | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self._decisions_seen: dict[str, int] = {}

    def _add_shard_link(self, address: str) -> int:
        channel = aio_channel(address, self.s.tls)
        self.shards.append(
            _Shard(
                address, kv_attention_pb2_grpc.KVAttentionStub(channel), health_pb2_grpc.HealthStub(channel)
            )
        )
        return len(self.shards) - 1

    # ---- start-up ------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Wait for gpu_dense (it may still be loading weights), then size the core from the shards."""
        deadline = time.monotonic() + self.s.startup_timeout
        while True:
            try:
                self.info = await self.dense.Info(dense_pb2.InfoRequest(), timeout=5, wait_for_ready=True)
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() > deadline:
                    raise Unavailable(f"gpu_dense at {self.s.dense} not ready: {e.details()}") from None
                await asyncio.sleep(0.5)
        if len(self.info.shards) != len(self.shards):
            raise InvalidInput(
                f"gpu_dense has {len(self.info.shards)} shards, the scheduler was given {len(self.shards)}"
            )
        for shard in self.shards:  # KV left by a previous scheduler instance belongs to no one now
            await shard.stub.Release(
                kv_attention_pb2.ReleaseRequest(all=True), timeout=10, wait_for_ready=True
            )
        specs = [await self._shard_spec(i) for i in range(len(self.shards))]
        s = self.s
        admission = (
            StabilizedAdmission(w_limit=s.w_limit, micro_batch=s.micro_batch)
            if s.admission == "stabilized"
            else NaiveAdmission()
        )
        self.core = SchedulerCore(
            specs,
            list(self.info.eos_token_ids),
            max_running=s.max_running,
            max_waiting=s.max_waiting,
            prefill_token_budget=s.prefill_token_budget,
            admission=admission,
            max_context=int(self.info.max_position_embeddings),
            kv_lookahead=s.kv_lookahead,
        )
        log.info(
            "model %s, %d layers; shard capacities (tokens): %s",
            self.info.model_type,
            self.info.num_layers,
            [sp.capacity_tokens for sp in specs],
        )

    def _geometry(self) -> kv_attention_pb2.KVGeometry:
        assert self.info is not None
        return kv_attention_pb2.KVGeometry(
            num_layers=self.info.num_layers, num_kv_heads=self.info.num_kv_heads, head_dim=self.info.head_dim
        )

    async def _shard_spec(self, shard: int) -> ShardSpec:
        """The shard's KV capacity in tokens and its block size (the core mirrors its blocks)."""
        assert self.info is not None
        stats = await self.shards[shard].stub.Stats(
            kv_attention_pb2.StatsRequest(), timeout=10, wait_for_ready=True
        )
        block = stats.block_size or 16  # a shard that predates block_size in Stats used 16
        if stats.configured and stats.free_tokens + stats.tokens_reserved > 0:
            return ShardSpec(int(stats.free_tokens + stats.tokens_reserved), block_size=block)
        itemsize = codec.torch_dtype(stats.kv_dtype).itemsize
        per_token = 2 * self.info.num_layers * self.info.num_kv_heads * self.info.head_dim * itemsize
        # the shard rounds down to whole blocks; stay on the safe side
        return ShardSpec(
            max(0, (stats.bytes_capacity // per_token) // block * block - block), block_size=block
        )

    # ---- the step loop ---------------------------------------------------------------------------
    async def _run(self, plan: dense_pb2.StepPlan) -> dense_pb2.StepResult:
        """One plan over the persistent Run stream to gpu_dense (reopened after a failure)."""
        if self._run_queue is None:
            queue: asyncio.Queue[dense_pb2.StepPlan | None] = asyncio.Queue()

            async def plans() -> AsyncIterator[dense_pb2.StepPlan]:
                while (p := await queue.get()) is not None:
                    yield p

            self._run_call = self.dense.Run(plans())
            self._run_queue = queue
        self._run_queue.put_nowait(plan)
        assert self._run_call is not None
        try:
            result = await asyncio.wait_for(self._run_call.read(), self.s.step_timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._reset_run_stream()
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else "step timed out"
            raise Unavailable(f"gpu_dense at {self.s.dense} unavailable: {detail}") from None
        if result is grpc.aio.EOF:
            self._reset_run_stream()
            raise Unavailable(f"gpu_dense at {self.s.dense} closed the step stream")
        return result

    def _reset_run_stream(self) -> None:
        if self._run_call is not None:
            self._run_call.cancel()
        self._run_call, self._run_queue = None, None

    async def _release(self, releases: list[tuple[str, int]]) -> None:
        by_shard: dict[int, list[str]] = defaultdict(list)
        for sid, shard in releases:
            by_shard[shard].append(sid)
        for shard, ids in by_shard.items():
            try:
                await self.shards[shard].stub.Release(
                    kv_attention_pb2.ReleaseRequest(seq_ids=ids), timeout=10, metadata=request_metadata(*ids)
                )
            except grpc.aio.AioRpcError as e:  # a lost shard has no KV left to free
                log.warning("release on shard %d failed: %s", shard, e.code().name)

    async def _reserve(self, step: Step) -> Step:
        assert self.core is not None
        by_shard: dict[int, list[kv_attention_pb2.SequenceReservation]] = defaultdict(list)
        for r in step.reserve:
            by_shard[r.shard].append(
                kv_attention_pb2.SequenceReservation(seq_id=r.seq_id, max_tokens=r.max_tokens)
            )
        failed: list[str] = []
        for shard, seqs in by_shard.items():
            req = kv_attention_pb2.ReserveRequest(geometry=self._geometry(), sequences=seqs)
            ids = [s.seq_id for s in seqs]
            try:
                await self.shards[shard].stub.Reserve(req, timeout=10, metadata=request_metadata(*ids))
                for s in seqs:
                    log.info(
                        "placed on shard %d: %d KV tokens reserved",
                        shard,
                        s.max_tokens,
                        extra={"request_id": s.seq_id},
                    )
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._shard_lost(shard, f"reserve failed: {e.details()}")
                else:
                    log.warning("reserve of %d seqs on shard %d failed: %s", len(ids), shard, e.details())
                for sid in ids:
                    self.core.reservation_failed(sid)
                failed += ids
        return step.without(failed) if failed else step

    def _plan(self, step: Step) -> dense_pb2.StepPlan:
        plan = dense_pb2.StepPlan(step=step.step, pipeline=self.s.pipeline)
        for p in step.seqs:
            sp = dense_pb2.SamplingParams(
                temperature=p.sampling.temperature, top_p=p.sampling.top_p, top_k=p.sampling.top_k
            )
            if p.sampling.seed is not None:
                sp.seed = p.sampling.seed
            plan.sequences.add(
                seq_id=p.seq_id,
                shard=p.shard,
                mini_batch=p.mini_batch,
                token_ids=p.token_ids,
                start_pos=p.start_pos,
                sampling=sp,
                sample=p.sample,
                sample_index=p.sample_index,
            )
        return plan

    def _shard_lost(self, shard: int, reason: str) -> None:
        assert self.core is not None
        if not self.shards[shard].healthy:
            return
        self.shards[shard].healthy = False
        moved = self.core.shard_lost(shard)
        SHARD_LOSSES.inc()
        RECOVERIES.inc(len(moved))
        log.warning(
            "shard %d (%s) lost (%s): re-prefilling %d sequences elsewhere",
            shard,
            self.shards[shard].address,
            reason,
            len(moved),
        )
        self.wake.set()

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            if ev.error is not None:
                log.warning("failed: %s", ev.error, extra={"request_id": ev.seq_id})
            elif ev.finish_reason:
                log.info(
                    "finished (%s): %d tokens, step %d",
                    ev.finish_reason,
                    ev.completion_tokens,
                    ev.step,
                    extra={"request_id": ev.seq_id},
                )
            stream = self.streams.get(ev.seq_id)
            if stream is not None:
                stream.queue.put_nowait(ev)

    def _fail_all(self, exc: BaseException) -> None:
        """gpu_dense is gone: every running sequence ends with this error (never hangs)."""
        assert self.core is not None
        for sid, stream in list(self.streams.items()):
            stream.queue.put_nowait(exc)
            try:
                self.core.cancel(sid)
            except Exception:  # noqa: BLE001 - already gone from the core
                pass

    async def step_loop(self) -> None:
        core = self.core
        assert core is not None
        while True:
            step = core.next_step()
            if step is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = time.perf_counter()
            self._log_preempted(step.preempted)
            if step.release:
                await self._release(step.release)
            if step.reserve:
                step = await self._reserve(step)
            if not step.seqs:
                core.apply(step, {})
                continue
            try:
                result = await self._run(self._plan(step))
            except Unavailable as e:
                log.error("%s; failing %d in-flight requests", e, len(self.streams))
                core.apply(step, {p.seq_id: str(e) for p in step.seqs})
                self._fail_all(e)
                continue
            results: dict[str, tuple[int, float] | str] = {}
            lost: set[int] = set()
            full: list[str] = []
            shard_of = {p.seq_id: p.shard for p in step.seqs}
            for r in result.results:
                if r.error.code:
                    code = code_from_int(r.error.code)
                    shard = shard_of.get(r.seq_id)
                    if code == grpc.StatusCode.UNAVAILABLE and shard is not None:
                        lost.add(shard)  # not this sequence's fault: recover it
                        continue
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and shard is not None:
                        full.append(r.seq_id)  # no free KV block: retried, the core preempts
                        continue
                    results[r.seq_id] = f"{code.name}: {r.error.message}"
                elif r.token_id >= 0:
                    results[r.seq_id] = (r.token_id, r.logprob)
            if result.error.code:
                msg = f"step failed: {result.error.message}"
                results = {p.seq_id: msg for p in step.seqs}
            for shard in lost:
                self._shard_lost(shard, "attend stream failed")
            if full and not result.error.code:
                core.kv_exhausted(step, full)  # its preemptions are logged with the next step
            self._dispatch(core.apply(step, results))
            STEP_SECONDS.observe(time.perf_counter() - t0)
            BATCH_SIZE.observe(len(step.seqs))
            self._update_gauges()

    def _log_preempted(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            log.info("preempted: KV freed, requeued to recompute from its history", extra={"request_id": sid})
        PREEMPTIONS.inc(len(seq_ids))

    def _update_gauges(self) -> None:
        assert self.core is not None
        st = self.core.stats()
        RUNNING.set(st["running"])
        WAITING.set(st["waiting"])
        KV_LOAD.set(st["kv_load_tokens"])
        for sh in st["shards"]:
            SHARD_TOKENS.labels(str(sh["shard"])).set(sh["tokens"])
            SHARD_HEALTHY.labels(str(sh["shard"])).set(1 if sh["healthy"] else 0)
            if sh["capacity_tokens"]:
                SHARD_USAGE.labels(str(sh["shard"])).set(sh["reserved_tokens"] / sh["capacity_tokens"])
        for decision, count in self.core.decisions.items():  # the core counts; mirror the increase
            ADMISSIONS.labels(decision).inc(count - self._decisions_seen.get(decision, 0))
            self._decisions_seen[decision] = count

    async def health_loop(self) -> None:
        """Probe shards: a lost one gives its sequences back; one that returns takes new work."""
        assert self.core is not None
        while True:
            await asyncio.sleep(self.s.health_interval)
            for i, shard in enumerate(self.shards):
                try:
                    resp = await shard.health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    ok = resp.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.aio.AioRpcError:
                    ok = False
                if ok and shard.healthy:
                    await self._measure(i, shard)
                if not ok and shard.healthy:
                    self._shard_lost(i, "health check failed")
                elif ok and not shard.healthy:
                    stats = await shard.stub.Stats(kv_attention_pb2.StatsRequest(), timeout=5)
                    if stats.sequences == 0:  # a restarted, empty shard
                        shard.healthy = True
                        self.core.shard_recovered(i)
                        log.info("shard %d (%s) is back", i, shard.address)
                        self.wake.set()

    async def _measure(self, index: int, shard: _Shard) -> None:
        """Track each shard's measured R; speed = mean R / own R, so a slower shard gets fewer sequences."""
        assert self.core is not None
        try:
            st = await shard.stub.Stats(kv_attention_pb2.StatsRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return
        d_busy, d_pairs = st.attention_busy_seconds - shard.busy, st.attended_token_pairs - shard.pairs
        shard.busy, shard.pairs = st.attention_busy_seconds, st.attended_token_pairs
        if d_pairs < 1e5 or d_busy <= 0:  # too little work since the last look to say anything
            return
        r = d_busy / d_pairs
        shard.r = r if shard.r is None else 0.7 * shard.r + 0.3 * r
        known = [s.r for s in self.shards if s.r is not None and s.healthy]
        mean = sum(known) / len(known)
        for i, s in enumerate(self.shards):
            if s.r is not None and s.healthy:
                self.core.set_speed(i, max(0.05, mean / s.r))

    # ---- RPCs ----------------------------------------------------------------------------------------
    async def Submit(
        self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TokenEvent]:
        core = self.core
        if core is None or self.draining:
            await abort(
                context, Unavailable("scheduler is draining" if self.draining else "scheduler not ready")
            )
            return
        sid = request.request_id or request_id_of(context) or f"seq-{next(self._ids)}"
        bind_request_id(sid)  # this call's task logs with the request id from here on
        sp = request.sampling
        try:
            if sid in self.streams:
                raise InvalidInput(f"request id {sid!r} is already running")
            req = Request(
                seq_id=sid,
                prompt=list(request.prompt_token_ids),
                max_tokens=request.max_tokens,
                sampling=Sampling(
                    sp.temperature, sp.top_p or 1.0, sp.top_k, sp.seed if sp.HasField("seed") else None
                ),
                stop_token_ids=frozenset(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
            )
            self._validate(req)
            core.submit(req)
        except Exception as e:  # noqa: BLE001 - mapped in one place
            await abort(context, e)
            return
        stream = _Stream()
        self.streams[sid] = stream
        log.info("queued: %d prompt tokens, max_tokens %d", len(req.prompt), req.max_tokens)
        self.wake.set()
        self._update_gauges()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    await abort(context, item)
                    return
                if item.error is not None:
                    finished = True
                    await abort(context, _event_error(item.error))
                    return
                yield pb.TokenEvent(
                    token_ids=item.token_ids,
                    logprobs=item.logprobs,
                    finish_reason=item.finish_reason or "",
                    prompt_tokens=item.prompt_tokens,
                    completion_tokens=item.completion_tokens,
                    step=item.step,
                    shard=item.shard,
                )
                if item.finish_reason:
                    finished = True
                    return
        finally:
            self.streams.pop(sid, None)
            if not finished:  # the client cancelled or its deadline passed: free the KV now
                try:
                    core.cancel(sid)
                    self.wake.set()
                except Exception:  # noqa: BLE001 - it may have just finished
                    pass
            self._update_gauges()

    def _validate(self, req: Request) -> None:
        assert self.info is not None
        if req.max_tokens < 1:
            raise InvalidInput("max_tokens must be >= 1")
        vocab = self.info.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt):
            raise InvalidInput(f"prompt token id outside the vocabulary [0, {vocab})")
        sp = req.sampling
        if not 0 <= sp.temperature <= 100 or sp.temperature != sp.temperature:
            raise InvalidInput("temperature must be in [0, 100]")
        if not 0 < sp.top_p <= 1:
            raise InvalidInput("top_p must be in (0, 1]")
        if sp.top_k < 0:
            raise InvalidInput("top_k must be >= 0")

    async def GetModelInfo(
        self, request: dense_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> dense_pb2.ModelInfo:
        if self.info is None:
            await abort(context, Unavailable("scheduler not ready"))
        return self.info  # type: ignore[return-value]

    async def GetStats(
        self, request: pb.SchedulerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SchedulerStats:
        if self.core is None:
            await abort(context, Unavailable("scheduler not ready"))
        st = self.core.stats()  # type: ignore[union-attr]
        out = pb.SchedulerStats(
            running=st["running"],
            waiting=st["waiting"],
            steps=st["steps"],
            finished=st["finished"],
            recoveries=st["recoveries"],
            preemptions=st["preemptions"],
            kv_load_tokens=st["kv_load_tokens"],
            w_limit=st["w_limit"] or 0.0,
            admission=st["admission"],
        )
        for sh in st["shards"]:
            out.shards.add(
                shard=sh["shard"],
                address=self.shards[sh["shard"]].address,
                healthy=sh["healthy"],
                sequences=sh["sequences"],
                tokens=sh["tokens"],
                expected_tokens=sh["expected_tokens"],
                capacity_tokens=sh["capacity_tokens"],
                block_tokens=sh["reserved_tokens"],
            )
        return out

    async def AddShard(
        self, request: dense_pb2.AddShardRequest, context: grpc.aio.ServicerContext
    ) -> dense_pb2.AddShardResponse:
        if self.core is None:
            await abort(context, Unavailable("scheduler not ready"))
        try:
            resp = await self.dense.AddShard(request, timeout=10)
        except grpc.aio.AioRpcError as e:
            await abort(context, error_from_status(e.code(), e.details() or ""))
        if resp.shard < len(self.shards):
            return resp
        index = self._add_shard_link(request.address.strip())
        try:
            spec = await self._shard_spec(index)
        except grpc.aio.AioRpcError as e:
            self.shards.pop()
            await abort(context, Unavailable(f"shard {request.address} unreachable: {e.details()}"))
        self.core.add_shard(spec)  # type: ignore[union-attr]
        log.info("added shard %d (%s), %d tokens", index, request.address, spec.capacity_tokens)
        self.wake.set()
        return resp

    async def drain(self) -> None:
        """Stop admitting; let running sequences finish."""
        self.draining = True
        while self.streams:
            await asyncio.sleep(0.05)


def _event_error(error: str) -> BaseException:
    """Step-loop errors read "CODE_NAME: message"; give them back their status code."""
    name, _, message = error.partition(": ")
    code = grpc.StatusCode.__members__.get(name)
    return error_from_status(code, message) if code else Unavailable(error)


async def serve(settings: Settings) -> None:
    log = settings.configure_logging("scheduler")
    service = SchedulerService(settings)
    if not service.shards:
        raise InvalidInput("the scheduler needs at least one shard (--shards HOST:PORT,...)")
    server = Server(
        [pb.DESCRIPTOR.services_by_name["Scheduler"].full_name],
        settings.host,
        settings.port,
        settings.tls,
        settings.grace_seconds,
    )
    pb_grpc.add_SchedulerServicer_to_server(service, server.server)
    server.install_signal_handlers()
    await server.start()
    await service.connect()
    service.tasks = [asyncio.create_task(service.step_loop()), asyncio.create_task(service.health_loop())]
    await server.announce(settings.host, settings.metrics_port, settings.ready_file)
    log.info(
        "serving on %s:%d; dense %s; %d shards; admission %s",
        settings.host,
        server.port,
        settings.dense,
        len(service.shards),
        settings.admission,
    )
    stop = asyncio.create_task(server.stopping.wait())
    done, _ = await asyncio.wait([stop, *service.tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not stop and t.exception():
            log.error("scheduler loop died: %r", t.exception())
    log.info("stopping: draining %d requests", len(service.streams))
    await server.stop(drain=service.drain)
    for t in service.tasks:
        t.cancel()
