"""The scheduler driver's ports: what it sees of gpu_dense (`DenseLink`) and of each shard
(`ShardLink`), the plain data they answer, and the metrics it reports. Imports no gRPC: the gRPC
links are in services/scheduler/links.py, fastdecode.wire converts their messages, and unit tests
use in-process fakes (tests/support/fakes.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from fastdecode.contract import TokenLogprob
from fastdecode.runtime.errors import ServiceError
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.types import Reservation, SampledRun, SchedulerStats, Step

# Tokens per KV block of a shard that does not report its own (ShardStats.block_size 0).
DEFAULT_BLOCK_SIZE = 16


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


@dataclass(slots=True)  # not frozen: B are built a step, and a frozen init costs ~0.5 us more each
class ItemResult:
    """One sequence's outcome of a step: a sampled token, nothing (a prefill chunk), or an error."""

    seq_id: str
    token_id: int = -1
    logprob: float = 0.0
    error: ServiceError | None = None
    top: tuple[tuple[int, float], ...] = ()  # the sampled position's alternatives, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the chunk's, when asked
    run: SampledRun | None = None  # a row run several decode steps: every token (token_id: its first)


@dataclass(frozen=True)
class StepTimes:
    """What gpu_dense measured of a step (dense.proto StepTimings, seconds): its S-part compute, its
    wait on the shards summed over mini-batches, and the whole step."""

    s_part_seconds: float
    attend_seconds: float
    step_seconds: float


@dataclass(frozen=True)
class StepOutcome:
    items: list[ItemResult]
    error: ServiceError | None = None  # the whole step failed (a bad plan)
    # A step with no error, alternatives or prompt logprobs (a decode step, most often), as it came:
    # seq_id -> (token, logprob), token -1 where nothing was sampled; `items` is empty then. What
    # SchedulerCore.apply takes, without an object per sequence on the way.
    # A row run several decode steps (--decode-steps) comes as (tokens, logprobs).
    sampled: dict[str, tuple[int, float] | tuple[list[int], list[float]]] | None = None
    timings: StepTimes | None = None  # None: gpu_dense sent none

    def rows(self) -> list[ItemResult]:
        """Every sequence's result as an ItemResult, whichever form the step came in (for readers
        off the step loop's path: benchmarks and tests driving gpu_dense themselves)."""
        if self.sampled is None:
            return self.items
        return [
            ItemResult(sid, tok, lp)
            if isinstance(tok, int)
            else ItemResult(sid, tok[0], lp[0], run=SampledRun(tok, lp))  # type: ignore[index]
            for sid, (tok, lp) in self.sampled.items()
        ]


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
    persistent: bool = False  # its KV pool outlives its process (--kv-dir): wait for it to re-attach


@dataclass(frozen=True)
class ReattachResult:
    """A restarted shard's answer to Reattach: where each kept sequence resumes, how many it freed,
    the positions it found torn (computed again), and why its pool was discarded ('' if kept)."""

    positions: dict[str, int]
    released: int = 0
    torn_positions: int = 0
    discarded: str = ""


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

    async def migrate_out(self, seq_id: str, target: str, tokens: int, timeout: float) -> MigrationResult:
        """The shard copies the sequence's first `tokens` KV positions (what the scheduler counts; past
        them it rolls back rejected drafts) to the shard at `target` and keeps its own copy."""

    async def retire(self, timeout: float) -> None:
        """The shard was removed: it stops serving and exits."""

    async def reattach(
        self, geometry: KVGeometry, model: str, keep: list[str], timeout: float
    ) -> ReattachResult:
        """A shard whose pool outlived its process: keep `keep`, free the rest, say where each resumes."""


@dataclass(frozen=True)
class MigrationResult:
    tokens: int
    bytes: int
    seconds: float


class SchedulerMetrics:
    """What the driver reports; the no-op base is for tests, services/scheduler/metrics.py exports it."""

    def shard_lost(self, recovered_sequences: int, recovered_tokens: int = 0) -> None: ...
    def shard_reattached(self, resumed: int, reprefilled_tokens: int, torn_positions: int) -> None: ...
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
