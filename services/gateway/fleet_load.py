"""The fleet's load for the router probes and the Model Server Protocol gauges: the scheduler's
GetStats (running, waiting, each shard's reserved and capacity tokens), polled by `FleetWatch`
(started by the gateway's serve(), refreshed once before it is ready, so the first scrape is already
right) and refreshed on a probe when older than `FRESH_SECONDS`. No FastAPI here: the gRPC-only
gateway imports this too."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

from fastdecode.gateway.core import GatewayCore
from fastdecode.runtime.errors import ServiceError
from services.gateway.metrics import export_fleet_load

log = logging.getLogger("fastdecode.gateway.load")

FRESH_SECONDS = 0.25  # a probe answers from a GetStats at most this old (routers poll every ~50 ms-10 s)
POLL_SECONDS = 1.0  # between the watch's own GetStats (the gauges between scrapes)
STATS_TIMEOUT = 2.0


@dataclass(frozen=True)
class FleetLoad:
    """The fleet's load as the scheduler counts it."""

    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0  # KV tokens the shards hold for sequences (whole blocks)
    kv_capacity: int = 0  # KV tokens the serving shards can hold

    @property
    def kv_usage(self) -> float:
        """Share of the fleet's KV capacity in use, 0..1 (0 with no capacity known)."""
        return min(1.0, self.kv_tokens / self.kv_capacity) if self.kv_capacity > 0 else 0.0

    @classmethod
    def from_stats(cls, st: Any) -> FleetLoad:
        """From a scheduler_pb2.SchedulerStats: shards removed or unhealthy hold nothing we can use."""
        live = [sh for sh in st.shards if sh.healthy and sh.state != "removed"]
        return cls(
            running=st.running,
            waiting=st.waiting,
            kv_tokens=sum(sh.block_tokens for sh in live),
            kv_capacity=sum(sh.capacity_tokens for sh in live),
        )


class FleetWatch:
    """The latest FleetLoad of one gateway's scheduler, and the gauges it sets."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.load = FleetLoad()
        self.at = 0.0  # monotonic time of the last answer (0: none yet)
        self._refreshing: asyncio.Task | None = None

    async def refresh(self) -> FleetLoad:
        """Ask the scheduler now (calls at once share one GetStats); keep the last load on failure."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._refreshing)

    async def _ask(self) -> FleetLoad:
        stats = getattr(self.core.scheduler, "stats", None)  # a test's fake link may have none
        if stats is not None:
            try:
                self.load = FleetLoad.from_stats(await stats(STATS_TIMEOUT))
                self.at = time.monotonic()
            except ServiceError as e:  # readiness says why; the gauges keep their last values
                log.debug("fleet load unknown: %s", e.message)
        export_fleet_load(self.load.running, self.load.waiting, self.load.kv_usage)
        return self.load

    async def fresh(self) -> FleetLoad:
        if time.monotonic() - self.at > FRESH_SECONDS:
            return await self.refresh()
        return self.load

    async def run(self, interval: float = POLL_SECONDS) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a bug here must not end the polling: the gauges would freeze
                log.exception("fleet load poll failed")
            await asyncio.sleep(interval)


_WATCHES: weakref.WeakKeyDictionary[GatewayCore, FleetWatch] = weakref.WeakKeyDictionary()


def fleet_watch(core: GatewayCore) -> FleetWatch:
    """The one FleetWatch of a gateway core (its HTTP routes and serve() share it)."""
    watch = _WATCHES.get(core)
    if watch is None:
        watch = _WATCHES[core] = FleetWatch(core)
    return watch
