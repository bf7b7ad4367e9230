"""The scheduler driver's live migrations: a shard drained and removed (RemoveShard), and moves
that rebalance load between shards, each sequence's KV copied shard to shard while the step loop
goes on. The core decides the moves (fastdecode.scheduling.migration); this runs them. Imports no
gRPC."""

from __future__ import annotations

import asyncio
import logging
import time

from fastdecode.runtime.errors import DeadlineExceeded, NotFound, ServiceError, Unavailable
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling.core import SchedulerCore
from fastdecode.scheduling.health import ShardTrack
from fastdecode.scheduling.migration import Move
from fastdecode.scheduling.ports import DenseLink, SchedulerMetrics
from fastdecode.scheduling.tables import SHARD_REMOVED
from fastdecode.scheduling.types import RemoveResult

log = logging.getLogger("fastdecode.scheduler")

# Between looks for a rebalancing move that found none: at a GPU's pace (10 ms steps) a look every
# step was 3% of the scheduler's CPU (it sums every shard's KV).
REBALANCE_CHECK_S = 0.05


class Migrations:
    """SchedulerDriver's drains and moves (a mixin: the shard tracks and the core are the driver's)."""

    # the driver's, set in SchedulerDriver.__init__
    s: SchedulerSettings
    core: SchedulerCore | None
    shards: list[ShardTrack]
    metrics: SchedulerMetrics
    wake: asyncio.Event
    dense: DenseLink
    _moves: set[asyncio.Task[None]]
    _rebalance_after: float
    _waiting_to_move: dict[int, int]
    migrated_bytes: int
    migration_seconds: float
    migrations_failed: int

    def _report(self) -> None: ...

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
        if rebalance and (now := time.monotonic()) >= self._rebalance_after:
            move = core.rebalance_move(self.s.rebalance_factor)
            moves = [move] if move is not None else []
            if move is None:  # the balance moves by a token a step: not worth a look every step
                self._rebalance_after = now + REBALANCE_CHECK_S
        for move in moves:
            task = asyncio.get_running_loop().create_task(self._move(move, rebalance))
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)

    async def _move(self, move: Move, rebalance: bool) -> None:
        assert self.core is not None
        source, target = self.shards[move.source], self.shards[move.target]
        t0 = time.perf_counter()
        try:
            r = await source.link.migrate_out(
                move.seq_id, target.link.address, move.tokens, self.s.migrate_timeout
            )
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
