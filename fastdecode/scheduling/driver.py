"""The scheduler's driver: the step loop, shard health and speed measurement, around SchedulerCore.
Imports no gRPC: gpu_dense and the shards are reached through `DenseLink` and `ShardLink` (the gRPC
ones are in services/scheduler/links.py; unit tests use in-process fakes).

One loop runs the steps: core.next_step() -> release/reserve on the shards -> the plan to gpu_dense
-> core.apply(results) -> token events to each request's stream. Shard loss (an item failing with
UNAVAILABLE, a failed reservation or health check) hands the shard's sequences back to the core,
which re-prefills them on the survivors. gpu_dense holds no state between steps (the KV is on the
shards, the tokens are here), so losing it only pauses the loop: the unfinished step is aborted,
the driver reconnects with backoff and plans it again; requests see a pause, not an error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastdecode.dense.sampling import TokenLogprob
from fastdecode.runtime.errors import (
    DeadlineExceeded,
    DependencyDown,
    InvalidInput,
    NotFound,
    ServiceError,
    Status,
    Unavailable,
)
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.logs import Throttle
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling.admission import NaiveAdmission, StabilizedAdmission
from fastdecode.scheduling.core import SHARD_REMOVED, Move, SchedulerCore
from fastdecode.scheduling.types import (
    RemoveResult,
    Request,
    Reservation,
    Sampled,
    SchedulerStats,
    ShardSpec,
    Step,
    TokenEvent,
)

log = logging.getLogger("fastdecode.scheduler")

# Tokens per KV block of a shard that does not report its own (ShardStats.block_size 0).
DEFAULT_BLOCK_SIZE = 16
# Reconnecting to a lost gpu_dense: first wait, doubled after each failed try, up to the cap.
DENSE_RETRY_FIRST_S = 0.1
DENSE_RETRY_MAX_S = 2.0
# Each step's R estimate needs this many attended token pairs since the last look to mean anything.
MIN_PAIRS_FOR_SPEED = 1e5
SPEED_SMOOTHING = 0.3


# ---- what the driver sees of gpu_dense and the shards ------------------------------------------------
@dataclass(frozen=True)
class DenseInfo:
    model_type: str
    geometry: KVGeometry
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    num_shards: int
    shard_addresses: tuple[str, ...] = ()  # in shard order, as gpu_dense dials them
    model: str = ""  # names the weights (path and dtype): shards match prefix blocks of this model only
    removed_shards: tuple[int, ...] = ()  # indices taken out by RemoveShard (never attended again)


@dataclass(frozen=True)
class ItemResult:
    """One sequence's outcome of a step: a sampled token, nothing (a prefill chunk), or an error."""

    seq_id: str
    token_id: int = -1
    logprob: float = 0.0
    error: ServiceError | None = None
    top: tuple[tuple[int, float], ...] = ()  # the sampled position's alternatives, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the chunk's, when asked


@dataclass(frozen=True)
class StepOutcome:
    items: list[ItemResult]
    error: ServiceError | None = None  # the whole step failed (a bad plan)


@dataclass(frozen=True)
class ShardState:
    """A shard's Stats, in the driver's terms."""

    sequences: int
    configured: bool
    free_tokens: int
    tokens_reserved: int
    bytes_capacity: int
    kv_itemsize: int
    block_size: int  # 0: the shard does not say
    busy_seconds: float  # its cores' busy time: attention (and a hosted shard's S-part, see links)
    attended_pairs: float


class DenseLink(Protocol):
    async def info(self, timeout: float) -> DenseInfo:
        """Waits for a (re)starting gpu_dense up to `timeout`; ServiceError when it does not answer."""

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        """One step at gpu_dense; Unavailable when gpu_dense is gone or the step timed out."""

    async def add_shard(self, address: str, timeout: float) -> int:
        """Tell gpu_dense about a new shard; returns its index."""

    async def remove_shard(self, index: int, timeout: float) -> None:
        """gpu_dense closes its streams to a removed shard (its index stays taken)."""


class ShardLink(Protocol):
    address: str

    async def healthy(self, timeout: float) -> bool:
        """True when the shard reports SERVING; False on NOT_SERVING or any failure to answer."""

    async def stats(self, timeout: float) -> ShardState: ...
    async def reserve(
        self, geometry: KVGeometry, seqs: list[Reservation], timeout: float, model: str = ""
    ) -> list[int]:
        """Reserve all or none; each sequence's first tokens the shard found cached (prefix sharing)."""
        ...

    async def release(self, seq_ids: list[str] | None, timeout: float) -> None:
        """Free the named sequences (None: all)."""

    async def migrate_out(self, seq_id: str, target: str, timeout: float) -> MigrationResult:
        """The shard copies the sequence's KV to the shard at `target` and keeps its own copy."""

    async def retire(self, timeout: float) -> None:
        """The shard was removed: it stops serving and exits."""


@dataclass(frozen=True)
class MigrationResult:
    tokens: int
    bytes: int
    seconds: float


class SchedulerMetrics:
    """What the driver reports; the no-op base is for tests, services/scheduler/metrics.py exports it."""

    def shard_lost(self, recovered_sequences: int) -> None: ...
    def step(self, seconds: float, batch: int) -> None: ...
    def state(self, stats: SchedulerStats, decisions_delta: dict[str, int]) -> None: ...
    def dense_reconnected(self) -> None: ...
    def preempted(self, sequences: int) -> None: ...
    def migrated(self, nbytes: int, seconds: float, ok: bool) -> None: ...


def capacity_tokens(state: ShardState, geometry: KVGeometry) -> int:
    """KV tokens a shard holds: what it reports once configured, else from its byte budget, rounded
    down to its own block size less one block (the shard rounds down to whole blocks)."""
    if state.configured and state.free_tokens + state.tokens_reserved > 0:
        return int(state.free_tokens + state.tokens_reserved)
    block = state.block_size or DEFAULT_BLOCK_SIZE
    per_token = geometry.bytes_per_token(state.kv_itemsize)
    return max(0, (state.bytes_capacity // per_token) // block * block - block)


REFUSAL_BACKOFF_MAX = 60.0  # seconds a shard that refused reservations waits, at most, to be taken back


@dataclass
class ShardTrack:
    """The driver's view of one shard: its link, health, and measured speed."""

    link: ShardLink
    healthy: bool = True
    busy: float = 0.0  # last attention busy seconds / attended token pairs seen
    pairs: float = 0.0
    r: float | None = None  # measured seconds per new token per cached token
    moved_out: int = 0  # sequences migrated off it
    moved_bytes: int = 0
    # Reservations refused in a row (its wrong answers), and when a probe may take it back: a shard
    # that keeps refusing waits longer each time instead of flapping every probe.
    refusals: int = 0
    retry_at: float = 0.0


@dataclass
class _Mailbox:
    """A request's events from the step loop, or a terminal error."""

    queue: asyncio.Queue[TokenEvent | ServiceError] = field(default_factory=asyncio.Queue)


class SchedulerDriver:
    def __init__(
        self,
        settings: SchedulerSettings,
        dense: DenseLink,
        shards: Sequence[ShardLink],
        metrics: SchedulerMetrics | None = None,
        make_shard_link: Callable[[str], ShardLink] | None = None,
    ) -> None:
        self.s = settings
        self.make_shard_link = make_shard_link  # for shards gpu_dense knows and we were not given
        self.dense = dense
        self.shards = [ShardTrack(link) for link in shards]
        self.metrics = metrics or SchedulerMetrics()
        self.info: DenseInfo | None = None
        self.core: SchedulerCore | None = None
        self.streams: dict[str, _Mailbox] = {}
        self.wake = asyncio.Event()
        self.draining = False
        self._ids = itertools.count()
        self._decisions_seen: dict[str, int] = {}
        self.dense_down: str | None = None  # why gpu_dense is unreachable; None while it serves
        self._moves: set[asyncio.Task[None]] = set()  # live migrations under way
        self._rebalance_after = 0.0  # monotonic time before which no rebalancing move starts
        self._waiting_to_move: dict[int, int] = {}  # per draining shard, as drain_moves said
        self.migrated_bytes = 0
        self.migration_seconds = 0.0
        self.migrations_failed = 0
        # Set once gpu_dense has been down past dense_down_timeout: what every request gets meanwhile.
        self.dense_dead: DependencyDown | None = None
        self._throttle = Throttle(10.0)  # conditions that repeat every step or probe: one line per 10 s

    def not_ready_reason(self) -> str | None:
        """Why the fleet behind this scheduler cannot generate now (None: it can): readiness."""
        if self.core is None:
            return "scheduler is starting"
        if self.draining:
            return "scheduler is draining"
        if self.dense_down is not None:
            return f"gpu_dense unavailable: {self.dense_down}"
        if not any(t.healthy for t in self.shards):
            return "no healthy kv_attention shard"
        return None

    # ---- start-up ----------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Wait for gpu_dense (it may still be loading weights), then size the core from the shards."""
        deadline = time.monotonic() + self.s.startup_timeout
        while True:
            try:
                self.info = await self.dense.info(self.s.control_timeout)
                break
            except ServiceError as e:
                if time.monotonic() > deadline:
                    raise Unavailable(f"gpu_dense not ready: {e.message}") from None
                await asyncio.sleep(0.5)
        await self._reconcile_shards(self.info)
        removed = set(self.info.removed_shards)
        for i, shard in enumerate(self.shards):  # KV left by a previous scheduler belongs to no one now
            if i not in removed:
                await shard.link.release(None, self.s.control_timeout)
        # a removed shard's process is gone: a placeholder spec, taken out right after
        specs = [ShardSpec(1) if i in removed else await self._shard_spec(i) for i in range(len(self.shards))]
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
            max_context=self.info.max_position_embeddings,
            vocab_size=self.info.vocab_size,
            kv_lookahead=s.kv_lookahead,
            prefix_sharing=s.prefix_sharing == "on",
            prefix_affinity=s.prefix_affinity,
            kv_geometry=self.info.geometry,
        )
        for i in removed:
            self.core.remove_shard(i)
            self.shards[i].healthy = False
        self._report()  # every shard's and decision's metric exists from the first scrape
        log.info(
            "model %s, %d layers; shard capacities (tokens): %s",
            self.info.model_type,
            self.info.geometry.num_layers,
            [sp.capacity_tokens for sp in specs],
        )

    async def _reconcile_shards(self, info: DenseInfo) -> None:
        """Make gpu_dense's shard list and ours the same, index for index, after either restarted:
        shards added at run time (AddShard) are known to the survivor only. A restarted scheduler
        adopts gpu_dense's extra shards; a restarted gpu_dense is given ours again, in order."""
        extra = info.shard_addresses[len(self.shards) :]
        if info.num_shards > len(self.shards):
            if self.make_shard_link is None or len(info.shard_addresses) != info.num_shards:
                raise InvalidInput(
                    f"gpu_dense has {info.num_shards} shards, the scheduler was given {len(self.shards)}"
                )
            for address in extra:
                self.shards.append(ShardTrack(self.make_shard_link(address)))
                log.info("adopted shard %d (%s) from gpu_dense", len(self.shards) - 1, address)
        for i in range(info.num_shards, len(self.shards)):
            await self.dense.add_shard(self.shards[i].link.address, self.s.control_timeout)
        if self.core is not None:  # a restarted gpu_dense forgets removals: remove them again
            for i in range(len(self.shards)):
                if self.core.shard_state(i) == SHARD_REMOVED and i not in info.removed_shards:
                    await self.dense.remove_shard(i, self.s.control_timeout)

    async def _shard_spec(self, shard: int) -> ShardSpec:
        """The shard's KV capacity in tokens and its block size (the core mirrors its blocks)."""
        assert self.info is not None
        state = await self.shards[shard].link.stats(self.s.control_timeout)
        block = state.block_size or DEFAULT_BLOCK_SIZE
        return ShardSpec(capacity_tokens(state, self.info.geometry), block_size=block)

    # ---- requests ----------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"seq-{next(self._ids)}"

    async def generate(self, req: Request) -> AsyncIterator[TokenEvent]:
        """Queue `req` and yield its token events until it finishes; its failure is raised as a
        ServiceError. Closing early (a cancelled caller) frees the sequence's KV now."""
        core = self.core
        if core is None or self.draining:
            raise Unavailable("scheduler is draining" if self.draining else "scheduler not ready")
        if req.seq_id in self.streams:
            raise InvalidInput(f"request id {req.seq_id!r} is already running")
        if self.dense_dead is not None:  # admission refuses while gpu_dense stays down
            raise self.dense_dead
        core.submit(req)
        stream = self.streams[req.seq_id] = _Mailbox()
        log.info("queued: %d prompt tokens, max_tokens %d", len(req.prompt), req.max_tokens)
        self.wake.set()
        self._report()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, ServiceError):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise item.error
                yield item
                if item.finish_reason:
                    finished = True
                    return
        finally:
            self.streams.pop(req.seq_id, None)
            if not finished:  # the client cancelled or its deadline passed: free the KV now
                try:
                    core.cancel(req.seq_id)
                    self.wake.set()
                except ServiceError:  # it may have just finished
                    pass
            self._report()

    async def add_shard(self, address: str, make_link: Callable[[str], ShardLink]) -> int:
        """Register a shard at gpu_dense, then take it into placement. `make_link(address)` builds
        the link (the adapter's)."""
        if self.core is None:
            raise Unavailable("scheduler not ready")
        index = await self.dense.add_shard(address, self.s.control_timeout)
        if index < len(self.shards):
            return index
        self.shards.append(ShardTrack(make_link(address)))
        try:
            spec = await self._shard_spec(len(self.shards) - 1)
        except ServiceError as e:
            self.shards.pop()
            raise Unavailable(f"shard {address} unreachable: {e.message}") from None
        self.core.add_shard(spec)
        log.info("added shard %d (%s), %d tokens", index, address, spec.capacity_tokens)
        self.wake.set()
        return index

    def cut_off(self) -> None:
        """The drain's grace period is over: every request still running ends with UNAVAILABLE (the
        gateway resubmits it to the next scheduler from the tokens it already has)."""
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(Unavailable("scheduler is draining: retry the request"))

    async def drain(self) -> None:
        """Stop admitting; let running sequences finish."""
        self.draining = True
        while self.streams:
            await asyncio.sleep(0.05)

    # ---- live migration: drain and rebalance -------------------------------------------------------
    def _resolve_shard(self, shard: int | None, address: str) -> int:
        if address:
            found = [i for i, t in enumerate(self.shards) if t.link.address == address]
            if not found:
                raise NotFound(f"no shard at {address!r}")
            return found[-1]
        if shard is None or not 0 <= shard < len(self.shards):
            raise NotFound(f"unknown shard {shard}")
        return shard

    async def remove_shard(self, shard: int | None, address: str = "", timeout: float = 0.0) -> RemoveResult:
        """Drain a shard and take it out: no new placements; its sequences migrate to the others as
        room allows (the rest keep decoding there until room frees up); once empty it leaves
        gpu_dense's and our tables and is told to exit. DeadlineExceeded (still draining) after
        `timeout` (0: the drain_timeout setting); calling again picks up where it left off."""
        core = self.core
        if core is None:
            raise Unavailable("scheduler not ready")
        index = self._resolve_shard(shard, address)
        track = self.shards[index]
        if core.shard_state(index) == SHARD_REMOVED:
            return RemoveResult(index, track.moved_out, 0, 0.0, track.moved_bytes)
        t0 = time.monotonic()
        deadline = t0 + (timeout or self.s.drain_timeout)
        core.drain_shard(index)
        log.info(
            "draining shard %d (%s): %d sequences to move",
            index,
            track.link.address,
            len(core.seqs_on(index)),
        )
        self.wake.set()
        while not core.drained(index):
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"shard {index} still holds {len(core.seqs_on(index))} sequences "
                    f"({self.waiting_to_move(index)} wait for room elsewhere); drain again to continue"
                )
            await asyncio.sleep(0.02)
            self.wake.set()
        if track.healthy:
            try:
                await track.link.release(None, self.s.control_timeout)
            except ServiceError as e:
                log.warning("release on removed shard %d failed: %s", index, e.message)
        await self.dense.remove_shard(index, self.s.control_timeout)
        reprefilled = core.left_by_recompute(index)
        core.remove_shard(index)
        was_healthy, track.healthy = track.healthy, False
        if was_healthy:
            try:
                await track.link.retire(self.s.control_timeout)
            except ServiceError as e:  # already gone: nothing to stop
                log.warning("retiring shard %d failed: %s", index, e.message)
        result = RemoveResult(index, track.moved_out, reprefilled, time.monotonic() - t0, track.moved_bytes)
        log.info(
            "removed shard %d (%s) in %.2fs: %d sequences migrated (%d bytes), %d re-prefilled",
            index,
            track.link.address,
            result.seconds,
            result.migrated,
            result.bytes,
            result.reprefilled,
        )
        self._report()
        return result

    def waiting_to_move(self, shard: int) -> int:
        """Sequences on this draining shard that wait for room elsewhere (0 when it is not draining)."""
        assert self.core is not None
        return self._waiting_to_move.get(shard, 0)

    def _start_moves(self) -> None:
        """At a step boundary: start moves off draining shards, else one rebalancing move when the
        busiest shard is over the factor and the last move's time is paid for."""
        core = self.core
        assert core is not None
        room = self.s.max_concurrent_migrations - len(self._moves)
        if room <= 0:
            return
        moves, waiting = core.drain_moves(room)
        if waiting != self._waiting_to_move and any(waiting.values()):
            log.info("sequences on draining shards wait for room elsewhere: %s", waiting)
        self._waiting_to_move = waiting
        rebalance = not moves and not self._moves and self.s.rebalance_factor > 0
        if rebalance and time.monotonic() >= self._rebalance_after:
            move = core.rebalance_move(self.s.rebalance_factor)
            moves = [move] if move is not None else []
        for move in moves:
            task = asyncio.get_running_loop().create_task(self._move(move, rebalance))
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)

    async def _move(self, move: Move, rebalance: bool) -> None:
        assert self.core is not None
        source, target = self.shards[move.source], self.shards[move.target]
        t0 = time.perf_counter()
        try:
            r = await source.link.migrate_out(move.seq_id, target.link.address, self.s.migrate_timeout)
            ok, nbytes = True, r.bytes
        except ServiceError as e:
            ok, nbytes = False, 0
            log.warning(
                "moving to shard %d failed, stays on shard %d: %s",
                move.target,
                move.source,
                e.message,
                extra={"request_id": move.seq_id},
            )
        seconds = time.perf_counter() - t0
        if self.core.end_move(move, ok):
            source.moved_out += 1
            source.moved_bytes += nbytes
            self.migrated_bytes += nbytes
            self.migration_seconds += seconds
            log.info(
                "moved from shard %d to %d: %d tokens, %d bytes in %.3fs",
                move.source,
                move.target,
                move.tokens,
                nbytes,
                seconds,
                extra={"request_id": move.seq_id},
            )
        else:
            self.migrations_failed += not ok
            try:  # whatever the target took (a copy finished after all, or half of one) is no one's
                await target.link.release([move.seq_id], self.s.control_timeout)
            except ServiceError:
                pass
        self.metrics.migrated(nbytes, seconds, ok)
        if rebalance:  # keep moving time within its share of the wall time
            self._rebalance_after = time.monotonic() + seconds / self.s.migrate_share
        self.wake.set()

    # ---- the step loop -----------------------------------------------------------------------------
    async def step_loop(self) -> None:
        core = self.core
        assert core is not None
        while True:
            self._start_moves()
            step = core.next_step()
            if step is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            await self.run_step(step)

    async def run_step(self, step: Step) -> None:
        core = self.core
        assert core is not None
        t0 = time.perf_counter()
        self._log_preempted(step.preempted)
        if step.release:
            await self._release(step.release)
        if step.reserve:
            step = await self._reserve(step)
        if not step.seqs:
            core.apply(step, {})
            return
        try:
            outcome = await self.dense.run(step, self.s.pipeline)
        except Unavailable as e:
            core.abort(step)  # nothing of it is applied; planned again once gpu_dense is back
            await self._reconnect_dense(e)
            return
        results: dict[str, Sampled | ServiceError] = {}
        scored: dict[str, list[TokenLogprob]] = {}
        lost: set[int] = set()
        full: list[str] = []
        shard_of = {p.seq_id: p.shard for p in step.seqs}
        for r in outcome.items:
            if r.error is not None:
                shard = shard_of.get(r.seq_id)
                if r.error.status is Status.UNAVAILABLE and shard is not None:
                    lost.add(shard)  # not this sequence's fault: recover it
                    continue
                if r.error.status is Status.RESOURCE_EXHAUSTED and shard is not None:
                    full.append(r.seq_id)  # no free KV block: retried, the core preempts
                    continue
                results[r.seq_id] = r.error
            else:
                if r.token_id >= 0:
                    results[r.seq_id] = Sampled(r.token_id, r.logprob, r.top)
                if r.prompt_logprobs:
                    scored[r.seq_id] = r.prompt_logprobs
        if outcome.error is not None:
            failed = Unavailable(f"step failed: {outcome.error.message}")
            results = {p.seq_id: failed for p in step.seqs}
        for shard in lost:
            self._shard_lost(shard, "attend stream failed")
        if full and outcome.error is None:
            core.kv_exhausted(step, full)  # its preemptions are logged with the next step
        self._dispatch(core.apply(step, results, scored))
        self.metrics.step(time.perf_counter() - t0, len(step.seqs))
        self._report()

    async def _reconnect_dense(self, error: ServiceError) -> None:
        """Pause the step loop until gpu_dense answers again (a restart on the same address), with
        backoff. A restarted gpu_dense knows only the shards it was started with: shards added at
        run time are registered again, in order, so shard indices stay the same."""
        assert self.info is not None
        self.dense_down = error.message
        log.warning("%s; pausing %d requests until gpu_dense is back", error.message, len(self.streams))
        since, wait = time.monotonic(), DENSE_RETRY_FIRST_S
        while True:
            await asyncio.sleep(wait)
            wait = min(DENSE_RETRY_MAX_S, wait * 2)
            left = since + self.s.dense_down_timeout - time.monotonic()
            if self.dense_dead is None and left <= 0:
                self._fail_paused(since)
            # info() waits for gpu_dense to answer: never past the moment the paused requests must end.
            timeout = (
                self.s.control_timeout if self.dense_dead else max(0.05, min(self.s.control_timeout, left))
            )
            try:
                info = await self.dense.info(timeout)
                if info.geometry != self.info.geometry or info.num_shards > len(self.shards):
                    # A different model or shard list behind the same address: nothing here fits it.
                    self.dense_down = "gpu_dense came back with a different model or shard list"
                    log.error("%s; still paused", self.dense_down)
                    continue
                await self._reconcile_shards(info)
            except ServiceError as e:
                self.dense_down = e.message
                continue
            break
        self.dense_down = None
        self.dense_dead = None
        self.metrics.dense_reconnected()
        log.info(
            "gpu_dense is back after %.2fs; resuming %d requests", time.monotonic() - since, len(self.streams)
        )
        self.wake.set()

    def _fail_paused(self, since: float) -> None:
        """gpu_dense stayed down past the bound: every paused request ends now with UNAVAILABLE
        naming it, and new ones are refused until it is back (the reconnect loop goes on)."""
        assert self.core is not None
        self.dense_dead = DependencyDown(
            f"gpu_dense down for {time.monotonic() - since:.0f}s ({self.dense_down}); retry once it is back"
        )
        log.error("%s: failing %d requests", self.dense_dead.message, len(self.streams))
        for sid, stream in list(self.streams.items()):
            stream.queue.put_nowait(self.dense_dead)
            try:
                self.core.cancel(sid)  # its KV is freed with the first step after the reconnect
            except ServiceError:
                pass

    async def _release(self, releases: list[tuple[str, int]]) -> None:
        by_shard: dict[int, list[str]] = defaultdict(list)
        for sid, shard in releases:
            by_shard[shard].append(sid)
        for shard, ids in by_shard.items():
            try:
                await self.shards[shard].link.release(ids, self.s.control_timeout)
            except ServiceError as e:  # a lost shard has no KV left to free
                log.warning("release on shard %d failed: %s", shard, e.status.name)

    async def _reserve(self, step: Step) -> Step:
        assert self.core is not None and self.info is not None
        by_shard: dict[int, list[Reservation]] = defaultdict(list)
        for r in step.reserve:
            by_shard[r.shard].append(r)
        failed: list[str] = []
        cached: dict[str, int] = {}
        for shard, seqs in by_shard.items():
            ids = [s.seq_id for s in seqs]
            try:
                found = await self.shards[shard].link.reserve(
                    self.info.geometry, seqs, self.s.control_timeout, self.info.model
                )
                self.shards[shard].refusals = 0
                for s, c in zip(seqs, found, strict=False):
                    cached[s.seq_id] = int(c)
                    log.info(
                        "placed on shard %d: %d KV tokens reserved, %d found cached",
                        shard,
                        s.max_tokens,
                        c,
                        extra={"request_id": s.seq_id},
                    )
            except ServiceError as e:
                if e.status in (Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED):
                    self._shard_lost(shard, f"reserve failed: {e.message}")
                elif e.status is not Status.RESOURCE_EXHAUSTED:
                    # The fleet's own reservation refused (a geometry or state the shard should not
                    # have): that shard's fault. Out of placement until a probe finds it empty and
                    # SERVING, instead of placing the same sequences on it again every step.
                    track = self.shards[shard]
                    track.refusals += 1
                    wait = min(REFUSAL_BACKOFF_MAX, self.s.health_interval * 2**track.refusals)
                    track.retry_at = time.monotonic() + wait
                    self._shard_lost(shard, f"it refused a reservation: {e.status.name}: {e.message}")
                elif (held := self._throttle(("reserve", shard))) is not None:
                    log.warning(
                        "reserve of %d seqs on shard %d failed: %s (%d more since the last line)",
                        len(ids),
                        shard,
                        e.message,
                        held,
                    )
                for sid in ids:
                    self.core.reservation_failed(sid)
                failed += ids
        step = step.without(failed) if failed else step
        return self.core.prefix_cached(step, cached) if any(cached.values()) else step

    def _shard_lost(self, shard: int, reason: str) -> None:
        assert self.core is not None
        track = self.shards[shard]
        if not track.healthy:
            return
        track.healthy = False
        moved = self.core.shard_lost(shard)
        self.metrics.shard_lost(len(moved))
        log.warning(
            "shard %d (%s) lost (%s): re-prefilling %d sequences elsewhere",
            shard,
            track.link.address,
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

    def _log_preempted(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            log.info("preempted: KV freed, requeued to recompute from its history", extra={"request_id": sid})
        if seq_ids:
            self.metrics.preempted(len(seq_ids))

    def _report(self) -> None:
        assert self.core is not None
        delta = {d: n - self._decisions_seen.get(d, 0) for d, n in self.core.decisions.items()}
        self._decisions_seen = dict(self.core.decisions)
        self.metrics.state(self.core.stats(), delta)

    # ---- shard health and speed --------------------------------------------------------------------
    async def health_loop(self) -> None:
        """Probe shards every health_interval until cancelled; a probe's failure never ends the loop."""
        while True:
            await asyncio.sleep(self.s.health_interval)
            await self.probe_shards()

    async def probe_shards(self) -> None:
        """A lost shard gives its sequences back; one that returns (SERVING and empty) takes new work."""
        assert self.core is not None
        for i, track in enumerate(self.shards):
            try:
                if self.core.shard_state(i) == SHARD_REMOVED:
                    await self._probe_removed(i, track)
                    continue
                await self._probe(i, track)
            except Exception:  # noqa: BLE001 - one shard's odd answer must not stop the others' probes
                if self._throttle(("probe", i)) is not None:
                    log.exception("probing shard %d (%s) failed", i, track.link.address)

    async def _probe_removed(self, index: int, track: ShardTrack) -> None:
        """A removed shard answering SERVING again, empty, is a restarted process on its address (a
        StatefulSet pod's restart drains it in preStop too): it takes its index and new work back."""
        assert self.core is not None
        if not await track.link.healthy(self.s.probe_timeout):
            return
        try:
            state = await track.link.stats(self.s.probe_timeout)
            if state.sequences:
                return
            if await self.dense.add_shard(track.link.address, self.s.control_timeout) != index:
                return  # gpu_dense knows the address under another index: leave it removed
        except ServiceError:
            return
        self.core.shard_rejoined(index)
        track.healthy, track.r = True, None
        log.info("removed shard %d (%s) answers again: it serves again", index, track.link.address)
        self.wake.set()

    async def _probe(self, index: int, track: ShardTrack) -> None:
        assert self.core is not None
        ok = await track.link.healthy(self.s.probe_timeout)
        if ok and track.healthy:
            await self._measure(index, track)
        elif not ok and track.healthy:
            self._shard_lost(index, "health check failed")
        elif ok and not track.healthy and time.monotonic() >= track.retry_at:
            try:
                state = await track.link.stats(self.s.probe_timeout)
            except ServiceError as e:  # SERVING but cannot say what it holds: still lost, ask again later
                if self._throttle(("stats", index)) is not None:
                    log.warning(
                        "shard %d answers health but not Stats (%s); still lost", index, e.status.name
                    )
                return
            if state.sequences:
                # Alive but marked lost (its stream failed, not the process): every sequence it holds
                # was moved away when it was lost, so free them and take the shard back. Waiting for it
                # to empty itself would wait forever, and with every shard lost, stall the fleet.
                try:
                    await track.link.release(None, self.s.control_timeout)
                    held, state = state.sequences, await track.link.stats(self.s.probe_timeout)
                except ServiceError as e:  # gone again: still lost, ask again later
                    if self._throttle(("release", index)) is not None:
                        log.warning(
                            "shard %d answers health but not Release (%s); still lost", index, e.status.name
                        )
                    return
                log.info(
                    "shard %d (%s) answers again: freed the %d sequences it held",
                    index,
                    track.link.address,
                    held,
                )
            if state.sequences == 0:  # a restarted or freed, empty shard
                track.healthy = True
                self.core.shard_recovered(index)
                log.info("shard %d (%s) is back", index, track.link.address)
                self.wake.set()

    async def _measure(self, index: int, track: ShardTrack) -> None:
        """Track each shard's measured R; speed = mean R / own R, so a slower shard gets fewer sequences."""
        assert self.core is not None
        try:
            st = await track.link.stats(self.s.probe_timeout)
        except ServiceError:
            return
        d_busy, d_pairs = st.busy_seconds - track.busy, st.attended_pairs - track.pairs
        track.busy, track.pairs = st.busy_seconds, st.attended_pairs
        if d_pairs < MIN_PAIRS_FOR_SPEED or d_busy <= 0:  # too little work since the last look
            return
        r = d_busy / d_pairs
        track.r = r if track.r is None else (1 - SPEED_SMOOTHING) * track.r + SPEED_SMOOTHING * r
        known = [t.r for t in self.shards if t.r is not None and t.healthy]
        mean = sum(known) / len(known)
        for i, t in enumerate(self.shards):
            if t.r is not None and t.healthy:
                self.core.set_speed(i, max(0.05, mean / t.r))
