"""The scheduler's driver: the step loop around SchedulerCore, in parts along its seams: its ports
(fastdecode.scheduling.ports: gpu_dense and the shards are reached through `DenseLink` and
`ShardLink`, the gRPC ones are in services/scheduler/links.py, unit tests use in-process fakes),
shard health and speed (health), drains and rebalancing moves (moves). Imports no gRPC.

One loop runs the steps: core.next_step() -> release/reserve on the shards -> the plan to gpu_dense
-> core.apply(results) -> token events to each request's stream. With plan_ahead, step n+1 is
planned and sent before step n's results are awaited (gpu_dense starts it the moment step n ends, its
decoding sequences fed the tokens step n sampled): the scheduler's planning, applying and event
fan-out run while gpu_dense computes, off the critical path. At most two steps are out.
Shard loss (an item failing with UNAVAILABLE, a failed reservation or health check) hands the
shard's sequences back to the core, which re-prefills them on the survivors. gpu_dense holds no
state between steps (the KV is on the shards, the tokens are here), so losing it only pauses the
loop: the unfinished step is aborted, the driver reconnects with backoff and plans it again;
requests see a pause, not an error.
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

from fastdecode.contract import TokenLogprob
from fastdecode.runtime.errors import (
    DependencyDown,
    InvalidInput,
    ServiceError,
    Status,
    Unavailable,
)
from fastdecode.runtime.logs import Throttle
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling.admission import NaiveAdmission, StabilizedAdmission
from fastdecode.scheduling.core import SchedulerCore
from fastdecode.scheduling.health import REFUSAL_BACKOFF_MAX, ShardHealth, ShardTrack
from fastdecode.scheduling.moves import Migrations
from fastdecode.scheduling.ports import (
    DEFAULT_BLOCK_SIZE,
    DenseInfo,
    DenseLink,
    SchedulerMetrics,
    ShardLink,
    StepOutcome,
    capacity_tokens,
)
from fastdecode.scheduling.tables import SHARD_REMOVED
from fastdecode.scheduling.types import (
    DenseAnswer,
    Request,
    Reservation,
    Sampled,
    ShardSpec,
    Step,
    TokenEvent,
)
from fastdecode.spec import proposer_for

log = logging.getLogger("fastdecode.scheduler")

# Reconnecting to a lost gpu_dense: first wait, doubled after each failed try, up to the cap.
DENSE_RETRY_FIRST_S = 0.1
DENSE_RETRY_MAX_S = 2.0
# The state gauges (running, waiting, each shard's KV) at most this often while steps run, and once
# when the loop goes idle: a scrape every few seconds reads no difference, and the report at every
# step, request opened and request closed was a sixth of the scheduler's fixed CPU a step at a fast
# pace (py-spy, B=8).
REPORT_INTERVAL_S = 0.1


class Mailbox(Protocol):
    """Where the step loop delivers a request's events, and its terminal error."""

    def put(self, item: TokenEvent | ServiceError) -> None: ...


@dataclass
class _Sent:
    """A step at gpu_dense: its result to come."""

    step: Step
    result: asyncio.Future[StepOutcome]
    t0: float


@dataclass
class _Mailbox:
    """One caller's queue (`generate`): its task wakes once per event."""

    queue: asyncio.Queue[TokenEvent | ServiceError] = field(default_factory=asyncio.Queue)

    def put(self, item: TokenEvent | ServiceError) -> None:
        self.queue.put_nowait(item)


class SchedulerDriver(Migrations, ShardHealth):
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
        self.streams: dict[str, Mailbox] = {}  # running requests: Submit calls and session requests
        self.wake = asyncio.Event()
        self.draining = False
        self._ids = itertools.count()
        self._decisions_seen: dict[str, int] = {}
        self._report_at = 0.0  # time.perf_counter() from which the next step reports the state
        self.dense_down: str | None = None  # why gpu_dense is unreachable; None while it serves
        self._moves: set[asyncio.Task[None]] = set()  # live migrations under way
        self._rebalance_after = 0.0  # monotonic time before which no rebalancing move starts
        self._waiting_to_move: dict[int, int] = {}  # per draining shard, as drain_moves said
        self.migrated_bytes = 0
        self.migration_seconds = 0.0
        self.migrations_failed = 0
        # Set once gpu_dense has been down past dense_down_timeout: what every request gets meanwhile.
        self.dense_dead: DependencyDown | None = None
        self.shards_down_since: float | None = None  # ShardHealth._check_shards_down
        self.shards_dead: DependencyDown | None = None
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
            # a row with drafts in flight leaves its next position unknown: no planning ahead
            plan_ahead=s.plan_ahead == "on" and s.speculative == "off",
            decode_steps=s.decode_steps,
            proposer=proposer_for(
                s.speculative, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max
            ),
            speculative_k=s.speculative_k,
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
        self.shards[shard].persistent = state.persistent
        block = state.block_size or DEFAULT_BLOCK_SIZE
        return ShardSpec(capacity_tokens(state, self.info.geometry), block_size=block)

    # ---- requests ----------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"seq-{next(self._ids)}"

    def open_stream(self, req: Request, mailbox: Mailbox) -> None:
        """Queue `req`; its events go to `mailbox` until it finishes. Refusals raise a ServiceError."""
        core = self.core
        if core is None or self.draining:
            raise Unavailable("scheduler is draining" if self.draining else "scheduler not ready")
        if req.seq_id in self.streams:
            raise InvalidInput(f"request id {req.seq_id!r} is already running")
        if self.dense_dead is not None:  # admission refuses while gpu_dense stays down
            raise self.dense_dead
        if self.shards_dead is not None:  # and while every shard stays down
            raise self.shards_dead
        core.submit(req)
        self.streams[req.seq_id] = mailbox
        log.info(
            "queued: %d prompt tokens, max_tokens %d",
            len(req.prompt),
            req.max_tokens,
            extra={"request_id": req.seq_id},
        )
        self.wake.set()
        self._report(due=True)

    def close_stream(self, seq_id: str, finished: bool) -> None:
        """The request's stream is over. Not `finished` (the caller cancelled, its deadline passed,
        its session ended): the sequence is cancelled and its KV freed with the next step."""
        self.streams.pop(seq_id, None)
        if not finished and self.core is not None:
            try:
                self.core.cancel(seq_id)
                self.wake.set()
            except ServiceError:  # it may have just finished
                pass
        self._report(due=True)

    async def generate(self, req: Request) -> AsyncIterator[TokenEvent]:
        """Queue `req` and yield its token events until it finishes; its failure is raised as a
        ServiceError. Closing early (a cancelled caller) frees the sequence's KV now."""
        stream = _Mailbox()
        self.open_stream(req, stream)
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
            self.close_stream(req.seq_id, finished)

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
            stream.put(Unavailable("scheduler is draining: retry the request"))

    async def drain(self) -> None:
        """Stop admitting; let running sequences finish."""
        self.draining = True
        while self.streams:
            await asyncio.sleep(0.05)

    # ---- the step loop -----------------------------------------------------------------------------
    async def step_loop(self) -> None:
        core = self.core
        assert core is not None
        ahead = self.s.plan_ahead == "on"
        out: list[_Sent] = []  # steps at gpu_dense, oldest first
        while True:
            self._start_moves()
            step = core.next_step()
            if step is None and not out:
                self._report()  # what the last steps left, before the loop sleeps
                self.wake.clear()
                await self.wake.wait()
                continue
            if step is not None and (sent := await self._send(step)) is not None:
                out.append(sent)
            if out and (len(out) > 1 or not ahead or step is None):
                await self._finish(out)

    async def run_step(self, step: Step) -> None:
        """One step, sent and applied (no step planned ahead of it)."""
        sent = await self._send(step)
        if sent is not None:
            await self._finish([sent])

    async def _send(self, step: Step) -> _Sent | None:
        """Release and reserve on the shards, then the plan to gpu_dense (None: it had no sequences)."""
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
            return None
        return _Sent(step, asyncio.ensure_future(self.dense.run(step, self.s.pipeline)), t0)

    async def _finish(self, out: list[_Sent]) -> None:
        """Await the oldest step out and apply it. gpu_dense lost: every step out is aborted, newest
        first (nothing of them is applied; planned again once gpu_dense is back)."""
        core = self.core
        assert core is not None
        step, t0 = out[0].step, out[0].t0
        try:
            outcome = await out[0].result
        except Unavailable as e:
            for sent in reversed(out):
                sent.result.cancel()
                await asyncio.gather(sent.result, return_exceptions=True)
                core.abort(sent.step)
            out.clear()
            await self._reconnect_dense(e)
            return
        out.pop(0)
        # (a decode step's answer goes to apply as it came: (token, logprob) per sequence)
        results: dict[str, DenseAnswer | ServiceError] = dict(outcome.sampled or {})
        scored: dict[str, list[TokenLogprob]] = {}
        lost: set[int] = set()
        full: list[str] = []
        shard_of: dict[str, int] | None = None  # built at the first failed item: most steps have none
        for r in outcome.items:
            if r.error is not None:
                if shard_of is None:
                    shard_of = {p.seq_id: p.shard for p in step.seqs}
                shard = shard_of.get(r.seq_id)
                if r.error.status is Status.UNAVAILABLE and shard is not None:
                    lost.add(shard)  # not this sequence's fault: recover it
                    continue
                if r.error.status is Status.RESOURCE_EXHAUSTED and shard is not None:
                    full.append(r.seq_id)  # no free KV block: retried, the core preempts
                    continue
                results[r.seq_id] = r.error
            else:
                if r.run is not None:  # several decode steps (--decode-steps)
                    results[r.seq_id] = r.run
                elif r.token_id >= 0:
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
        if core.drafting is not None:  # the step's costs choose the next steps' k (spec/controller.py)
            core.drafting.stepped(step, outcome.timings, time.perf_counter() - t0)
        self.metrics.step(time.perf_counter() - t0, len(step.seqs))
        self._report(due=True)

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
        self._fail_all(self.dense_dead)  # their KV is freed with the first step after the reconnect

    def _fail_all(self, error: DependencyDown) -> None:
        assert self.core is not None
        for sid, stream in list(self.streams.items()):
            stream.put(error)
            try:
                self.core.cancel(sid)  # its KV is freed with the next step
            except ServiceError:
                pass
        self.wake.set()

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
                    reason = f"it refused a reservation: {e.status.name}: {e.message}"
                    self._shard_lost(shard, reason, recoverable=False)
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

    def _shard_lost(self, shard: int, reason: str, recoverable: bool = True) -> None:
        assert self.core is not None
        track = self.shards[shard]
        if not track.healthy:
            return
        track.healthy = False
        if recoverable and track.persistent and self.s.shard_restart_grace > 0:
            # Its KV pool outlives the process: its sequences wait for it (shard_resumed), not a re-prefill.
            held = self.core.membership.shard_suspended(shard)
            track.suspended_at = time.monotonic()
            log.warning(
                "shard %d (%s) lost (%s): its KV pool outlives it; %d sequences wait up to %.0fs for it",
                shard,
                track.link.address,
                reason,
                len(held),
                self.s.shard_restart_grace,
            )
            self.wake.set()
            return
        moved = self._reprefill_elsewhere(shard)
        log.warning(
            "shard %d (%s) lost (%s): re-prefilling %d sequences elsewhere",
            shard,
            track.link.address,
            reason,
            moved,
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
                stream.put(ev)

    def _log_preempted(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            log.info("preempted: KV freed, requeued to recompute from its history", extra={"request_id": sid})
        if seq_ids:
            self.metrics.preempted(len(seq_ids))

    def _report(self, due: bool = False) -> None:
        """The state gauges and the admission decisions since the last report; `due`: only when
        REPORT_INTERVAL_S has passed since it (per step, per request opened or closed)."""
        assert self.core is not None
        now = time.perf_counter()
        if due and now < self._report_at:
            return
        self._report_at = now + REPORT_INTERVAL_S
        delta = {d: n - self._decisions_seen.get(d, 0) for d, n in self.core.decisions.items()}
        self._decisions_seen = dict(self.core.decisions)
        self.metrics.state(self.core.stats(loads=False), delta)  # the metrics show no load model
