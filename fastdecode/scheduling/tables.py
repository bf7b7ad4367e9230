"""The rows of SchedulerCore's tables, one per sequence and one per shard, the constants they
follow, and `CoreTables`, the tables themselves: SchedulerCore makes one and hands it to each of its
collaborators (membership, migration, the load model, prefixes, preemption and releases), which
work on the shared rows and keep their own state beside them. Pure Python, no gRPC."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fastdecode.runtime.errors import NotFound
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
    # Lost, but its KV pool outlives its process (--kv-dir): its sequences stay placed, unplanned,
    # until it re-attaches (they resume where it held them) or the wait ends (they are re-prefilled).
    suspended: bool = False
    left_by_recompute: int = 0  # sequences that left it to be re-prefilled (lost, preempted) while draining
    # prefix blocks it holds (None) or one of its sequences is computing (that id), least recent first
    prefixes: OrderedDict[bytes, str | None] = field(default_factory=OrderedDict)

    @property
    def serving(self) -> bool:
        """Healthy and neither draining nor removed: it takes new sequences."""
        return self.healthy and self.state == SHARD_SERVING


@dataclass(slots=True)  # not frozen: one is made per planned sequence every step (frozen is ~3x the cost)
class Inflight:
    epoch: int
    sample: bool
    start_pos: int  # where the planned chunk starts: a step the shard refused is retried from here
    blocks: int  # blocks held before the chunk grew the sequence
    steps: int = 1  # decode steps planned for it in this step (--decode-steps): tokens it samples
    drafts: int = 0  # speculative drafts its row carries (--speculative): it yields 1 to drafts + 1 tokens


class CoreTables:
    """The tables every part of the core works on: the shards, the waiting and running sequences,
    each step out's marks, and the step clock. The containers are made once and never replaced, so
    every collaborator may keep a reference to them."""

    def __init__(self) -> None:
        self.shards: list[ShardEntry] = []  # by index; a removed shard keeps its place
        self.waiting: OrderedDict[str, SeqEntry] = OrderedDict()
        self.running: OrderedDict[str, SeqEntry] = OrderedDict()  # admission order
        self.inflight: dict[int, dict[str, Inflight]] = {}  # per planned step: its sequences' marks
        self.parked: set[str] = set()  # in a step, wanted at a step boundary (a move): not planned ahead
        self.step = 0  # the next step to plan

    def shard(self, index: int) -> ShardEntry:
        """The shard at `index`; NotFound for one the core never had."""
        if not 0 <= index < len(self.shards):
            raise NotFound(f"unknown shard {index}")
        return self.shards[index]

    def running_seq(self, seq_id: str) -> SeqEntry:
        """A running sequence; NotFound for one that is not running."""
        seq = self.running.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown running sequence {seq_id!r}")
        return seq
