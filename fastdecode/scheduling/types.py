"""Plain data the scheduler core takes and gives. No gRPC: the service adapter converts these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fastdecode.contract import PlannedSeq, TokenLogprob
from fastdecode.contract import SamplingParams as Sampling  # one definition of sampling settings
from fastdecode.runtime.errors import ServiceError

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ERROR = "error"


@dataclass
class Request:
    """One sequence to generate. `seq_id` is the caller's handle (unique while it lives)."""

    seq_id: str
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # Tokens generated before this submission (a resubmission): the first sample index.
    sample_offset: int = 0
    # Prefix-cache namespace: blocks are shared only among requests with the same salt (tenants).
    cache_salt: str = ""

    @property
    def kv_tokens(self) -> int:
        """KV tokens the sequence holds at most (prompt + max_tokens); it must fit on one shard."""
        return len(self.prompt) + self.max_tokens


@dataclass
class Reservation:
    """Admit seq_id on shard with the KV blocks for `max_tokens` tokens: the tokens it holds now (its
    prompt, or its history when it is recomputed). The shard grows it a block at a time after that."""

    seq_id: str
    shard: int
    max_tokens: int
    # Its first tokens, with prefix sharing: the shard answers how many of them it holds cached.
    token_ids: list[int] = field(default_factory=list)
    cache_salt: str = ""  # its prefix-cache namespace (Request.cache_salt)


@dataclass
class Step:
    """One scheduler step.

    The driver applies `release` first, then `reserve` (the core already counts released room as free),
    then runs `seqs` (two mini-batches). A Step may carry releases only (empty `seqs`): send them, skip
    the dense run. When a reservation fails, call `SchedulerCore.reservation_failed` and run
    `step.without(...)` instead. `preempted` names the sequences the core preempted while planning
    (their KV is in `release`, they wait at the head of the queue): for the driver's log and metrics.
    """

    step: int
    seqs: list[PlannedSeq]
    reserve: list[Reservation]
    release: list[tuple[str, int]]
    preempted: list[str] = field(default_factory=list)
    # Sequences that left for good (finished, failed, cancelled): gpu_dense drops what it keeps for
    # them. Not `release`: a live migration and a preemption release KV of sequences that go on.
    ended: list[str] = field(default_factory=list)

    def without(self, seq_ids: Iterable[str]) -> Step:
        """This step minus some sequences (and their reservations), e.g. after a failed reservation."""
        drop = set(seq_ids)
        return Step(
            step=self.step,
            seqs=[s for s in self.seqs if s.seq_id not in drop],
            reserve=[r for r in self.reserve if r.seq_id not in drop],
            release=list(self.release),
            preempted=list(self.preempted),
            ended=list(self.ended),
        )

    def mini_batches(self) -> tuple[list[PlannedSeq], list[PlannedSeq]]:
        """The two mini-batches of this step (either may be empty)."""
        return (
            [s for s in self.seqs if s.mini_batch == 0],
            [s for s in self.seqs if s.mini_batch == 1],
        )


@dataclass(slots=True)  # one per running sequence per step: a slotted init is the cheaper one
class TokenEvent:
    """What one sequence produced in one step; a finished sequence's last event has finish_reason set.

    A stop or EOS token that ends a sequence is included in token_ids (HF `generate` keeps it too).
    """

    seq_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    step: int
    shard: int
    error: ServiceError | None = None  # typed (status, message); set when finish_reason is FINISH_ERROR
    cached_tokens: int = 0  # prompt tokens a shard held cached (shared prefix): not prefilled
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per token, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the prompt's next positions


@dataclass(slots=True)  # not frozen: one per sampled sequence every step (frozen is ~3x the cost)
class Sampled:
    """One sequence's sampled token of a step, with what it reported beside it."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class SampledRun:
    """One sequence's tokens of a step that ran it for several decode steps (--decode-steps), in
    order, each with its logprob and, when asked, its alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


# What gpu_dense answered for one sampled sequence of a step, as SchedulerCore.apply takes it: a
# decode step's (token, logprob) as it came, or the tokens and logprobs of several decode steps, or,
# with alternatives, a Sampled or SampledRun.
DenseAnswer = tuple[int, float] | tuple[list[int], list[float]] | Sampled | SampledRun


@dataclass
class ShardSpec:
    """A KV shard: how many tokens it holds, its measured relative attention speed (> 0), and the
    tokens per KV block it allocates (a sequence holds whole blocks; the scheduler service passes the
    shard's own, 1 counts exact tokens)."""

    capacity_tokens: int
    speed: float = 1.0
    block_size: int = 1


@dataclass
class ShardStats:
    """One shard's load as the scheduler core counts it."""

    shard: int
    healthy: bool
    sequences: int
    tokens: int  # KV tokens held (planned chunks included)
    expected_tokens: int | None  # tokens its sequences are expected to reach (None: not computed)
    reserved_tokens: int  # KV blocks allocated on the shard, in tokens (whole blocks)
    # what admission counts against it: blocks plus running sequences' headroom (None: not computed)
    committed_tokens: int | None
    capacity_tokens: int
    block_size: int
    speed: float
    state: str = ""  # "" serving, "draining" or "removed"


@dataclass
class SchedulerStats:
    """The scheduler core's counts and per-shard load (`SchedulerCore.stats`)."""

    running: int
    waiting: int
    steps: int
    finished: int
    recoveries: int
    preemptions: int
    admission: str  # the policy's name
    w_limit: float | None  # the stabilized policy's load limit this step (None: no limit)
    kv_load_tokens: float
    expected_ratio: float  # expected share of max_tokens a sequence generates
    shards: list[ShardStats]
    migrations: int = 0  # sequences moved live (KV copied to another shard)
    # speculative decoding: rows with drafts, drafts carried, drafts kept, tokens those rows yielded
    spec: tuple[int, int, int, int] = (0, 0, 0, 0)
    # per draft position: rows that offered a draft there, and those that kept it
    spec_at: tuple[list[int], list[int]] = ([], [])
    spec_k: int | None = None  # the most drafts a row is offered now (None: no speculation)


@dataclass(frozen=True)
class RemoveResult:
    """What draining one shard took."""

    shard: int
    migrated: int  # sequences moved with their KV
    reprefilled: int  # sequences that left by recompute instead (the shard lost, preempted)
    seconds: float
    bytes: int
