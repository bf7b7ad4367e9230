"""In-process fakes of the interfaces the cores talk through (no process, no port).

A fake follows the interface's contract exactly (what it returns, which ServiceError it raises), so a
core tested against it behaves as it does against the gRPC adapters in services/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastdecode.gateway.core import BackendInfo, UpstreamEvent
from fastdecode.gateway.text import ValidRequest
from fastdecode.runtime.errors import NotFound, ServiceError, Unavailable
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling import Reservation, Step
from fastdecode.scheduling.ports import (
    DenseInfo,
    ItemResult,
    MigrationResult,
    ReattachResult,
    ShardState,
    StepOutcome,
)


@dataclass
class FakeScheduler:
    """The gateway's SchedulerLink: `script(request_id, request)` gives the token events of a request;
    `down` makes every call fail as an unreachable scheduler would. Records what was submitted and
    which streams were closed early (cancelled upstream)."""

    script: Callable[[str, ValidRequest], list[UpstreamEvent | ServiceError]] | None = None
    info: BackendInfo = field(default_factory=lambda: BackendInfo("llama", 0, 2, "cpu"))
    down: bool = False
    submitted: list[tuple[str, ValidRequest]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # sample_offset of each submission

    async def wait_connected(self, timeout: float) -> None:
        if self.down:
            await asyncio.sleep(min(timeout, 0.01))
            raise Unavailable("scheduler fake:0 is not reachable")

    async def submit(
        self, request_id: str, request: ValidRequest, timeout: float | None, sample_offset: int = 0
    ) -> AsyncIterator[UpstreamEvent]:
        self.submitted.append((request_id, request))
        self.offsets.append(sample_offset)
        events = self.script(request_id, request) if self.script else []
        finished = False
        try:
            for ev in events:
                if isinstance(ev, ServiceError):
                    finished = True
                    raise ev
                await asyncio.sleep(0)
                yield ev
                finished = bool(ev.finish_reason)
            finished = True
        finally:
            if not finished:
                self.cancelled.append(request_id)

    async def model_info(self, timeout: float, wait_for_ready: bool = False) -> BackendInfo:
        if self.down:
            raise Unavailable("scheduler fake:0 is not reachable")
        return self.info

    async def not_ready_reason(self, timeout: float) -> str | None:
        return "scheduler fake:0 not reachable" if self.down else None

    async def close(self) -> None:
        pass


@dataclass
class FakeDense:
    """The scheduler driver's DenseLink: samples token `1 + sample_index` for every sampled sequence
    (never EOS, which is 0 here); `fail_items` maps a shard to the error its sequences' items get."""

    info_: DenseInfo = field(
        default_factory=lambda: DenseInfo(
            "llama", KVGeometry(2, 2, 8), 100, 512, (0,), 2, ("fake:2", "fake:3")
        )
    )
    fail_items: dict[int, ServiceError] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    # Steps until gpu_dense goes away (None: never); `down` then stays set until a test clears it.
    dies_after: int | None = None
    down: bool = False
    lost_steps: int = 0

    async def info(self, timeout: float) -> DenseInfo:
        if self.down:
            await asyncio.sleep(min(timeout, 0.01))
            raise Unavailable("gpu_dense fake:1 is unreachable")
        return self.info_

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        if self.dies_after is not None and len(self.steps) >= self.dies_after:
            self.dies_after, self.down = None, True
        if self.down:
            self.lost_steps += 1
            raise Unavailable("gpu_dense fake:1 unavailable: Socket closed")
        self.steps.append(step)
        items = []
        for p in step.seqs:
            if p.shard in self.fail_items:
                items.append(ItemResult(p.seq_id, error=self.fail_items[p.shard]))
            elif p.sample:
                items.append(ItemResult(p.seq_id, 1 + p.sample_index, -0.5))
            else:
                items.append(ItemResult(p.seq_id))
        return StepOutcome(items)

    async def add_shard(self, address: str, timeout: float) -> int:
        if address in self.info_.shard_addresses:  # idempotent per address; a removed one comes back
            index = self.info_.shard_addresses.index(address)
            removed = tuple(i for i in self.info_.removed_shards if i != index)
            self.info_ = DenseInfo(**{**self.info_.__dict__, "removed_shards": removed})
            return index
        self.info_ = DenseInfo(
            **{
                **self.info_.__dict__,
                "num_shards": self.info_.num_shards + 1,
                "shard_addresses": (*self.info_.shard_addresses, address),
            }
        )
        return self.info_.num_shards - 1

    async def remove_shard(self, index: int, timeout: float) -> None:
        removed = (*self.info_.removed_shards, index)
        self.info_ = DenseInfo(**{**self.info_.__dict__, "removed_shards": removed})


@dataclass
class FakeShard:
    """A kv_attention shard as the driver's ShardLink sees it. `serving` is its health answer;
    `stats_error`, when set, is what Stats raises (a shard that answers health but not Stats)."""

    address: str = "fake-shard:0"
    serving: bool = True
    stats_error: ServiceError | None = None
    bytes_capacity: int = 1 << 20
    kv_itemsize: int = 4
    block_size: int = 16
    held: dict[str, int] = field(default_factory=dict)
    stats_calls: int = 0
    peers: dict[str, FakeShard] = field(default_factory=dict)  # migration targets by address
    migrate_error: ServiceError | None = None
    retired: bool = False
    reserve_error: ServiceError | None = None  # what Reserve answers instead (a shard in a wrong state)
    reserve_calls: int = 0
    persistent: bool = False  # its pool outlives its process (--kv-dir): Reattach answers from `held`
    lose_pool: bool = False  # ... except that the restart found nothing (a discarded pool)
    reattach_calls: list[list[str]] = field(default_factory=list)

    async def healthy(self, timeout: float) -> bool:
        return self.serving

    async def stats(self, timeout: float) -> ShardState:
        self.stats_calls += 1
        if self.stats_error is not None:
            raise self.stats_error
        return ShardState(
            sequences=len(self.held),
            configured=False,
            free_tokens=0,
            tokens_reserved=0,
            bytes_capacity=self.bytes_capacity,
            kv_itemsize=self.kv_itemsize,
            block_size=self.block_size,
            busy_seconds=0.0,
            attended_pairs=0.0,
            persistent=self.persistent,
        )

    async def reattach(
        self, geometry: KVGeometry, model: str, keep: list[str], timeout: float
    ) -> ReattachResult:
        if not self.serving:
            raise Unavailable(f"shard {self.address} is down")
        self.reattach_calls.append(list(keep))
        if self.lose_pool:
            self.held.clear()
        gone = [sid for sid in self.held if sid not in keep]
        for sid in gone:
            del self.held[sid]
        # a held sequence resumes where the scheduler left it (a large count: min() takes ours)
        positions = {sid: 1 << 20 for sid in keep if sid in self.held}
        return ReattachResult(positions, len(gone), 0, "pool lost" if self.lose_pool else "")

    async def reserve(
        self, geometry: KVGeometry, seqs: list[Reservation], timeout: float, model: str = ""
    ) -> list[int]:
        self.reserve_calls += 1
        if not self.serving:
            raise Unavailable(f"shard {self.address} is down")
        if self.reserve_error is not None:
            raise self.reserve_error
        self.held.update({s.seq_id: s.max_tokens for s in seqs})
        return [0] * len(seqs)

    async def release(self, seq_ids: list[str] | None, timeout: float) -> None:
        if seq_ids is None:
            self.held.clear()
        for sid in seq_ids or ():
            self.held.pop(sid, None)

    async def migrate_out(self, seq_id: str, target: str, tokens: int, timeout: float) -> MigrationResult:
        if not self.serving:
            raise Unavailable(f"shard {self.address} is down")
        if self.migrate_error is not None:
            raise self.migrate_error
        if seq_id not in self.held:
            raise NotFound(f"sequence {seq_id!r} is not held by this shard")
        peer = self.peers.get(target)
        if peer is None or not peer.serving:
            raise Unavailable(f"migration target {target} unreachable")
        peer.held[seq_id] = self.held[seq_id]
        return MigrationResult(self.held[seq_id], 1000, 0.001)

    async def retire(self, timeout: float) -> None:
        self.retired, self.serving = True, False
