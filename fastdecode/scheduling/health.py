"""The scheduler driver's shard health and speed: a probe per shard every health interval (a lost
shard gives its sequences back, one that returns empty takes new work), and each shard's attention
speed measured from its busy time (the R estimate the load model plans with). Imports no gRPC."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastdecode.runtime.errors import DependencyDown, ServiceError
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling.core import SchedulerCore
from fastdecode.scheduling.ports import DenseLink, SchedulerMetrics, ShardLink
from fastdecode.scheduling.tables import SHARD_REMOVED

log = logging.getLogger("fastdecode.scheduler")

# Each step's R estimate needs this many attended token pairs since the last look to mean anything.
MIN_PAIRS_FOR_SPEED = 1e5
SPEED_SMOOTHING = 0.3
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
    persistent: bool = False  # its KV pool outlives its process (--kv-dir): a crash is waited out
    suspended_at: float | None = None  # lost at (monotonic), its sequences waiting for it to re-attach


class ShardHealth:
    """SchedulerDriver's probes (a mixin: the shard tracks and the core are the driver's)."""

    # the driver's, set in SchedulerDriver.__init__
    s: SchedulerSettings
    core: SchedulerCore | None
    shards: list[ShardTrack]
    metrics: SchedulerMetrics
    wake: asyncio.Event
    dense: DenseLink
    _throttle: Any
    streams: dict[str, Any]
    # Since when no shard serves, and once that lasted past shards_down_timeout, what every request
    # gets until one serves again (set in SchedulerDriver.__init__; _check_shards_down keeps them).
    shards_down_since: float | None
    shards_dead: DependencyDown | None
    info: Any

    def _shard_lost(self, shard: int, reason: str, recoverable: bool = True) -> None: ...
    def _fail_all(self, error: DependencyDown) -> None: ...

    # ---- shard health and speed --------------------------------------------------------------------
    async def health_loop(self) -> None:
        """Probe shards every health_interval until cancelled; a probe's failure never ends the loop."""
        while True:
            await asyncio.sleep(self.s.health_interval)
            await self.probe_shards()
            self._check_shards_down()

    def _check_shards_down(self) -> None:
        """No shard serving past shards_down_timeout: the waiting requests end UNAVAILABLE naming the
        shards, and new ones are refused until one serves again (probes go on meanwhile)."""
        assert self.core is not None
        if any(t.healthy and self.core.shard_state(i) != SHARD_REMOVED for i, t in enumerate(self.shards)):
            if self.shards_down_since is not None:
                log.info("a shard serves again after %.1fs", time.monotonic() - self.shards_down_since)
            self.shards_down_since, self.shards_dead = None, None
            return
        now = time.monotonic()
        if self.shards_down_since is None:
            self.shards_down_since = now
            log.warning("no kv_attention shard serves: %d requests wait", len(self.streams))
            return
        if self.shards_dead is not None or now - self.shards_down_since < self.s.shards_down_timeout:
            return
        names = ", ".join(f"shard {i} ({t.link.address})" for i, t in enumerate(self.shards)) or "none"
        self.shards_dead = DependencyDown(
            f"no kv_attention shard serving for {now - self.shards_down_since:.0f}s ({names}); "
            "retry once one is back"
        )
        log.error("%s: failing %d requests", self.shards_dead.message, len(self.streams))
        self._fail_all(self.shards_dead)

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
        if track.suspended_at is not None:
            await self._probe_suspended(index, track)
            return
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
                # A restarted process's R is unknown (its counters start again): neutral until it is
                # measured anew, not the speed it had when it was lost (placement would shun it).
                track.r = None
                self.core.set_speed(index, 1.0)
                self.core.shard_recovered(index)
                log.info("shard %d (%s) is back", index, track.link.address)
                self.wake.set()

    async def _probe_suspended(self, index: int, track: ShardTrack) -> None:
        """A lost shard whose pool outlives its process: once it serves again, it re-attaches and its
        sequences resume where it holds them; past shard_restart_grace they are re-prefilled."""
        assert self.core is not None and track.suspended_at is not None
        waited = time.monotonic() - track.suspended_at
        if await track.link.healthy(self.s.probe_timeout):
            try:
                keep = self.core.seqs_on(index)
                r = await track.link.reattach(
                    self.info.geometry, self.info.model, keep, self.s.control_timeout
                )
            except ServiceError as e:
                if self._throttle(("reattach", index)) is not None:
                    log.warning("shard %d answers health but not Reattach (%s)", index, e.status.name)
            else:
                resumed, again = self.core.membership.shard_resumed(index, r.positions)
                track.suspended_at, track.healthy, track.r = None, True, None
                self.core.set_speed(index, 1.0)  # a new process: measured anew
                self.metrics.shard_reattached(len(resumed), again, r.torn_positions)
                log.info(
                    "shard %d (%s) re-attached its KV pool after %.1fs: %d sequences resume there "
                    "(%d positions torn, %d re-prefilled), %d of %d lost it, %d freed%s",
                    index,
                    track.link.address,
                    waited,
                    len(resumed),
                    r.torn_positions,
                    again,
                    len(keep) - len(resumed),
                    len(keep),
                    r.released,
                    f"; pool discarded: {r.discarded}" if r.discarded else "",
                )
                self.wake.set()
                return
        if waited > self.s.shard_restart_grace:
            track.suspended_at = None
            moved = self._reprefill_elsewhere(index)
            log.warning(
                "shard %d (%s) did not come back within %.0fs: re-prefilling its %d sequences elsewhere",
                index,
                track.link.address,
                self.s.shard_restart_grace,
                moved,
            )
            self.wake.set()

    def _reprefill_elsewhere(self, shard: int) -> int:
        """The shard's sequences lose it, to be re-prefilled from their history (counted in the
        metrics with the tokens that costs); returns how many."""
        assert self.core is not None
        before = self.core.membership.recovered_tokens
        moved = self.core.shard_lost(shard)
        self.metrics.shard_lost(len(moved), self.core.membership.recovered_tokens - before)
        return len(moved)

    async def _measure(self, index: int, track: ShardTrack) -> None:
        """Track each shard's measured R; speed = mean R / own R, so a slower shard gets fewer sequences."""
        assert self.core is not None
        try:
            st = await track.link.stats(self.s.probe_timeout)
        except ServiceError:
            return
        track.persistent = st.persistent
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
