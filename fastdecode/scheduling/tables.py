"""The rows of SchedulerCore's tables, one per sequence and one per shard, the constants they
follow, and `CoreTables`, the tables themselves as every part of the core sees them (the core's
seams, migration, prefixes, load and membership, work on them; SchedulerCore owns and fills them).
Pure Python, no gRPC."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.admission import AdmissionPolicy
from fastdecode.scheduling.types import Request, ShardSpec

# Steps a shard takes no new sequence after refusing a reservation (or until it frees something):
# our count of its free room was wrong, so retrying at once would loop.
RESERVATION_BACKOFF_STEPS = 8
# Steps a rebalanced sequence stays where it was moved: loads shift every step as sequences grow
# and finish, and moving the same sequence back and forth would only pay copies.
REBALANCE_COOLDOWN_STEPS = 64
# Weight of one finished sequence in the running generated/max_tokens ratio.
RATIO_SMOOTHING = 0.05
# Default headroom horizon: steps of growth each running sequence is expected to have room for. At
# 64 steps (4 blocks of 16) a shard admits while its sequences can all grow for 64 more steps, so a
# preemption (redoing one sequence's prefill) is rare next to the steps a full reservation wastes.
DEFAULT_KV_LOOKAHEAD = 64
SHARD_SERVING, SHARD_DRAINING, SHARD_REMOVED = "", "draining", "removed"
ADMISSION_DECISIONS = ("admitted", "rejected", "deferred_policy", "deferred_capacity", "deferred_prefix")
NAME_SEED = b"fastdecode-scheduler"  # the core's own names for prefix blocks (never compared to a shard's)


@dataclass
class SeqEntry:
    req: Request
    tokens: list[int]  # prompt + generated so far
    shard: int | None = None
    kv: int = 0  # tokens sent to the shard's KV (planned chunks count at planning time)
    reserved_on: int | None = None  # shard holding a reservation we must release
    epoch: int = 0  # bumped when the seq loses its shard: results of older steps are ignored
    inflight: int | None = None  # latest step it is planned in, until that step is applied
    flying: int = 1  # tokens that step samples for it (its decode steps)
    blocks: int = 0  # KV blocks its shard holds for it (mirrors the shard's allocation)
    started: int = -1  # order of first admission: the highest is the youngest (preempted first)
    cached: int = 0  # prompt tokens its shard found cached at its latest reservation
    shared: int = 0  # of its blocks, those read from the shard's prefix cache (not counted per sequence)
    names: tuple[int, int, list[bytes]] | None = None  # (block size, tokens, names of full blocks)
    claimed: int = 0  # of its names, the leading ones its placement claimed on its shard (being computed)
    moving: int | None = None  # shard its KV is being copied to (live migration); not planned meanwhile
    incoming: int = 0  # blocks counted on `moving` for the copy
    moved_step: int = -(1 << 30)  # step its last move ended (rebalancing leaves it alone a while)
    scored: int = 1  # next prompt position whose logprob goes out (prompt_logprobs; 0 has none)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt)


@dataclass
class ShardEntry:
    spec: ShardSpec
    healthy: bool = True
    blocks: int = 0  # KV blocks its sequences hold (sum of SeqEntry.blocks)
    seqs: set[str] = field(default_factory=set)
    blocked_until: int = 0
    state: str = SHARD_SERVING  # draining: no new placements, its sequences migrate away; removed
    left_by_recompute: int = 0  # sequences that left it to be re-prefilled (lost, preempted) while draining
    # prefix blocks it holds (None) or one of its sequences is computing (that id), least recent first
    prefixes: OrderedDict[bytes, str | None] = field(default_factory=OrderedDict)


@dataclass(slots=True)  # not frozen: one is made per planned sequence every step (frozen is ~3x the cost)
class Inflight:
    epoch: int
    sample: bool
    start_pos: int  # where the planned chunk starts: a step the shard refused is retried from here
    blocks: int  # blocks held before the chunk grew the sequence
    steps: int = 1  # decode steps planned for it in this step (--decode-steps): tokens it samples


class CoreTables:
    """What SchedulerCore holds (set in its __init__); the core's seams are mixins over it."""

    _shards: list[ShardEntry]  # by index; a removed shard keeps its place
    _waiting: OrderedDict[str, SeqEntry]
    _running: OrderedDict[str, SeqEntry]  # admission order
    _inflight: dict[int, dict[str, Inflight]]  # per planned step
    _decode_steps: int  # decode steps a plan runs a sampling sequence for, at most
    _eos: frozenset[int]
    _releases: list[tuple[str, int]]
    # releases held until a step still carrying the sequence is applied (a shard fails a whole item
    # naming a sequence it no longer holds): by that step, (seq_id, shard, blocks it holds there)
    _held_releases: dict[int, list[tuple[str, int, int]]]
    _parked: set[str]  # in a step, wanted at a step boundary (a move): not planned ahead meanwhile
    _admission: AdmissionPolicy
    _step: int
    _ratio: float  # running estimate of generated / max_tokens
    _lookahead: int
    _sharing: bool
    _affinity: float
    _geometry: KVGeometry | None  # a windowed model's geometry (None: every layer full)
    _recoveries: int
    _finished: int
    preemptions: int
    prefix_hits: int
    cached_tokens: int
    migrations: int
