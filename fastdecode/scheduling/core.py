"""The scheduler's core: sequence state, admission, placement, step planning, stop rules.

Pure Python, no gRPC. A driver (the scheduler service, or the simulator) loops:
    step = core.next_step(); send step.release, step.reserve to the shards; run step.seqs on the dense
    side; events = core.apply(step, results); stream events.
One step is outstanding at a time in practice; sequences of an un-applied step are skipped by
next_step, so a second outstanding step is allowed but never plans the same sequence twice. Every step
with sequences must be applied (with typed errors when the dense side failed), or its sequences stay
in flight.

Placement: a new sequence goes to the healthy shard with room for what it commits, whose load over
the sequence's expected life is least, weighted by speed and capacity (placement.choose_shard). The
expected life is max_tokens scaled by a running generated/max_tokens ratio, since sequences stop early.

KV on demand: shards allocate a sequence's KV a block at a time as it grows, and the core mirrors
every shard's blocks exactly (blocks = ceil(tokens sent / block_size) per sequence). A sequence
commits the blocks it holds plus its headroom: the tokens it is expected to add over the next
`kv_lookahead` steps (capped by its expected remaining length, from the same generated/max_tokens
ratio). Admission and placement need the new sequence's commitment to fit beside the shard's; a
full-context max_tokens no longer pins a full context of KV. When a planned step would need more
blocks than a shard has, the core preempts the youngest sequences there (least work to redo, and the
oldest always progress): it releases their KV and puts them back at the head of the waiting queue;
re-admitted, they re-prefill their token history (prompt + generated) as a lost shard's sequences do,
so greedy tokens are those of a run that never filled. A shard that still answers "no free block"
(our count was off) gets the same treatment through `kv_exhausted`.

Shared prefixes (prefix_sharing): a reservation carries the sequence's tokens; the shard answers how
many leading tokens it holds cached (whole blocks), and `prefix_cached` moves the sequence's planned
prefill to start there. The core remembers which prefix blocks each shard holds or is computing
(names of full blocks, as the shards name them but seeded locally); placement prefers the shard with
the longest such prefix while the balance allows (`prefix_affinity`), and a request whose prefix is
being computed right now waits for it instead of computing it again. Blocks read from a shard's
prefix cache are not counted against the shard per sequence (`_Seq.shared`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from fastdecode.dense.sampling import TokenLogprob
from fastdecode.kv.prefix import chain_hashes
from fastdecode.runtime.errors import (
    FailedPrecondition,
    InternalError,
    InvalidInput,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    ServiceError,
)
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.admission import AdmissionPolicy, Candidate, NaiveAdmission
from fastdecode.scheduling.placement import ShardLoad, attention_cost, choose_shard, split_mini_batches
from fastdecode.scheduling.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    PlannedSeq,
    Request,
    Reservation,
    Sampled,
    Sampling,
    SchedulerStats,
    ShardSpec,
    ShardStats,
    Step,
    TokenEvent,
)

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
_NAME_SEED = b"fastdecode-scheduler"  # the core's own names for prefix blocks (never compared to a shard's)


@dataclass
class _Seq:
    req: Request
    tokens: list[int]  # prompt + generated so far
    shard: int | None = None
    kv: int = 0  # tokens sent to the shard's KV (planned chunks count at planning time)
    reserved_on: int | None = None  # shard holding a reservation we must release
    epoch: int = 0  # bumped when the seq loses its shard: results of older steps are ignored
    inflight: int | None = None  # step it is planned in, until applied
    blocks: int = 0  # KV blocks its shard holds for it (mirrors the shard's allocation)
    started: int = -1  # order of first admission: the highest is the youngest (preempted first)
    cached: int = 0  # prompt tokens its shard found cached at its latest reservation
    shared: int = 0  # of its blocks, those read from the shard's prefix cache (not counted per sequence)
    names: tuple[int, int, list[bytes]] | None = None  # (block size, tokens, names of full blocks)
    moving: int | None = None  # shard its KV is being copied to (live migration); not planned meanwhile
    incoming: int = 0  # blocks counted on `moving` for the copy
    moved_step: int = -(1 << 30)  # step its last move ended (rebalancing leaves it alone a while)
    scored: int = 1  # next prompt position whose logprob goes out (prompt_logprobs; 0 has none)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt)


@dataclass
class _Shard:
    spec: ShardSpec
    healthy: bool = True
    blocks: int = 0  # KV blocks its sequences hold (sum of _Seq.blocks)
    seqs: set[str] = field(default_factory=set)
    blocked_until: int = 0
    state: str = SHARD_SERVING  # draining: no new placements, its sequences migrate away; removed
    left_by_recompute: int = 0  # sequences that left it to be re-prefilled (lost, preempted) while draining
    # prefix blocks it holds (None) or one of its sequences is computing (that id), least recent first
    prefixes: OrderedDict[bytes, str | None] = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class Move:
    """A live migration the core has started: copy seq_id's KV from `source` to `target`, then
    `end_move` with the outcome. `tokens` is what the copy carries (the KV the shard holds)."""

    seq_id: str
    source: int
    target: int
    tokens: int
    epoch: int


@dataclass(frozen=True)
class _Inflight:
    epoch: int
    sample: bool
    start_pos: int  # where the planned chunk starts: a step the shard refused is retried from here
    blocks: int  # blocks held before the chunk grew the sequence


class SchedulerCore:
    """Owns every sequence: admits, places on shards, plans steps, applies sampled tokens."""

    def __init__(
        self,
        shards: list[ShardSpec],
        eos_token_ids: Sequence[int],
        *,
        max_running: int = 256,
        max_waiting: int = 1024,
        prefill_token_budget: int = 512,
        admission: AdmissionPolicy | None = None,
        max_context: int | None = None,
        vocab_size: int | None = None,
        kv_lookahead: int = DEFAULT_KV_LOOKAHEAD,
        prefix_sharing: bool = False,
        prefix_affinity: float = 0.5,
        kv_geometry: KVGeometry | None = None,
    ) -> None:
        if max_running < 1 or max_waiting < 0 or prefill_token_budget < 1:
            raise InvalidInput("max_running and prefill_token_budget must be >= 1, max_waiting >= 0")
        if max_context is not None and max_context < 2:
            raise InvalidInput("max_context must be >= 2")
        self._vocab_size = vocab_size
        if kv_lookahead < 0:
            raise InvalidInput("kv_lookahead must be >= 0")
        self._lookahead = kv_lookahead
        if prefix_affinity < 0:
            raise InvalidInput("prefix_affinity must be >= 0")
        # windowed layers (the model's geometry): a sequence holds, and attends over, less than its
        # length; without windows every count below is the sequence's length
        self._geometry = kv_geometry if kv_geometry is not None and kv_geometry.windowed else None
        self._sharing = prefix_sharing
        self._affinity = prefix_affinity
        self.prefix_hits = 0  # reservations that found cached prefix tokens
        self.cached_tokens = 0  # ... and how many, in all
        self._admission: AdmissionPolicy = admission if admission is not None else NaiveAdmission()
        self._shards: list[_Shard] = []
        for spec in shards:
            self.add_shard(spec)
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._budget = prefill_token_budget
        self._max_context = max_context
        self._waiting: OrderedDict[str, _Seq] = OrderedDict()
        self._running: OrderedDict[str, _Seq] = OrderedDict()  # admission order
        self._releases: list[tuple[str, int]] = []
        self._ended: list[str] = []  # left for good since the last step (Step.ended)
        self._inflight: dict[int, dict[str, _Inflight]] = {}
        self._step = 0
        self._ratio = 1.0  # running estimate of generated / max_tokens
        self._finished = 0
        self._recoveries = 0
        self._started = 0  # admissions so far (orders sequences by age)
        self.preemptions = 0
        self._preempted: list[str] = []  # preempted since the last step was planned
        self.migrations = 0  # sequences moved live to another shard (KV copied, not recomputed)
        self._capacity_changed()
        # Cumulative admission outcomes: sequences admitted or rejected (queue full), and steps in
        # which waiting sequences were held back by the admission policy or by shard capacity.
        self.decisions: dict[str, int] = dict.fromkeys(ADMISSION_DECISIONS, 0)

    # ---------------------------------------------------------------- requests in
    def submit(self, req: Request) -> None:
        """Queue a request. InvalidInput for a bad one, ResourceExhausted when the queue is full."""
        self._validate(req)
        if len(self._waiting) >= self._max_waiting:
            self.decisions["rejected"] += 1
            raise ResourceExhausted(f"waiting queue full ({self._max_waiting})")
        self._waiting[req.seq_id] = _Seq(req=req, tokens=[int(t) for t in req.prompt])

    def _validate(self, req: Request) -> None:
        if not isinstance(req.seq_id, str) or not req.seq_id:
            raise InvalidInput("seq_id must be a non-empty string")
        if req.seq_id in self._waiting or req.seq_id in self._running:
            raise InvalidInput(f"duplicate seq_id {req.seq_id!r}")
        if not req.prompt:
            raise InvalidInput("empty prompt")
        if any(int(t) < 0 for t in req.prompt):
            raise InvalidInput("token ids must be >= 0")
        if self._vocab_size is not None and any(int(t) >= self._vocab_size for t in req.prompt):
            raise InvalidInput(f"prompt token id outside the vocabulary [0, {self._vocab_size})")
        if req.max_tokens < 1:
            raise InvalidInput("max_tokens must be >= 1")
        if req.sample_offset < 0:
            raise InvalidInput(f"sample_index_offset must be >= 0, got {req.sample_offset}")
        req.sampling.validate()  # the one set of sampling rules (NaN and upper bounds included)
        if self._max_context is not None and req.kv_tokens > self._max_context:
            raise OutOfRange(
                f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) exceeds the context"
                f" ({self._max_context})"
            )
        if self._shards and not any(
            -(-req.kv_tokens // s.spec.block_size) <= s.spec.capacity_tokens // s.spec.block_size
            for s in self._shards
        ):
            raise OutOfRange(f"needs {req.kv_tokens} KV tokens, more than any shard holds")

    def cancel(self, seq_id: str) -> None:
        """Drop a waiting or running sequence; a held reservation is released in the next step."""
        if self._waiting.pop(seq_id, None) is not None:
            return
        seq = self._running.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown sequence {seq_id!r}")
        self._leave(seq, finished=False)

    # ---------------------------------------------------------------- shards
    def add_shard(self, spec: ShardSpec) -> int:
        """Add a shard; it takes its share of new sequences from now on."""
        if spec.capacity_tokens < 1 or not spec.speed > 0 or spec.block_size < 1:
            raise InvalidInput("a shard needs capacity_tokens >= 1, speed > 0 and block_size >= 1")
        self._shards.append(_Shard(spec=spec))
        if hasattr(self, "_admission"):  # not while __init__ adds the first shards
            self._capacity_changed()
        return len(self._shards) - 1

    def _capacity_changed(self) -> None:
        """Tell the admission policy how many KV tokens the healthy shards hold: the stabilizing
        schedule keeps its load limit within them (the paper's memory bound B*S/2 <= C*P)."""
        self._admission.set_kv_capacity(
            sum(sh.spec.capacity_tokens for sh in self._shards if self._serving(sh)) or None
        )

    @staticmethod
    def _serving(sh: _Shard) -> bool:
        return sh.healthy and sh.state == SHARD_SERVING

    def _shard(self, shard: int) -> _Shard:
        if not 0 <= shard < len(self._shards):
            raise NotFound(f"unknown shard {shard}")
        return self._shards[shard]

    def shard_lost(self, shard: int) -> list[str]:
        """Mark a shard unhealthy; its sequences will be re-placed and re-prefilled from their history.

        Call it before apply() of a step that failed because of this shard: results of the moved
        sequences are then ignored and their generated tokens kept, so the request only loses time.
        """
        sh = self._shard(shard)
        if not sh.healthy:
            return []
        sh.healthy = False
        for s in self._running.values():
            if s.moving == shard:  # its copy died with the target: it stays where it is
                s.moving, s.incoming = None, 0
        moved = [sid for sid, s in self._running.items() if s.shard == shard]
        for sid in moved:
            self._unplace(self._running[sid])
        sh.blocks, sh.seqs = 0, set()
        sh.prefixes.clear()
        self._releases = [(sid, i) for sid, i in self._releases if i != shard]
        self._recoveries += len(moved)
        self._capacity_changed()
        return moved

    def set_speed(self, shard: int, speed: float) -> None:
        """Update a shard's measured relative attention speed (> 0); placement weighs by it."""
        if not speed > 0:
            raise InvalidInput("speed must be > 0")
        self._shard(shard).spec.speed = speed

    def shard_recovered(self, shard: int) -> None:
        """The shard is healthy again, and empty: it takes new sequences."""
        sh = self._shard(shard)
        if sh.state == SHARD_REMOVED:
            return
        sh.healthy, sh.blocks, sh.seqs, sh.blocked_until = True, 0, set(), 0
        sh.prefixes.clear()
        self._capacity_changed()

    def reservation_failed(self, seq_id: str) -> None:
        """The shard refused the reservation: un-place the sequence and put it back at the head.

        A sequence with no generated token goes back to the waiting queue (admission sees it again);
        one being recovered stays admitted and is re-placed first. Drop it from the step you are about
        to run (`step.without([seq_id])`); a result for it would be ignored anyway.
        """
        seq = self._running.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown running sequence {seq_id!r}")
        if seq.shard is not None:
            self._shards[seq.shard].blocked_until = self._step + RESERVATION_BACKOFF_STEPS
        seq.reserved_on = None  # nothing to release: the shard holds nothing for it
        self._unplace(seq)
        if seq.generated == 0:
            del self._running[seq_id]
            self._admission.finished(self._step, seq_id)
            self._waiting[seq_id] = seq
            self._waiting.move_to_end(seq_id, last=False)

    def _unplace(self, seq: _Seq) -> None:
        self._cancel_move(seq)
        if seq.shard is not None:
            sh = self._shards[seq.shard]
            sh.seqs.discard(seq.req.seq_id)
            sh.blocks -= seq.blocks - seq.shared
            self._forget_pending(seq, sh)
            sh.left_by_recompute += sh.state == SHARD_DRAINING
        seq.shard, seq.reserved_on, seq.kv, seq.inflight, seq.blocks = None, None, 0, None, 0
        seq.shared = 0
        seq.epoch += 1

    # ---------------------------------------------------------------- live migration
    def begin_move(self, seq_id: str, target: int) -> Move:
        """Start moving a running sequence's KV to `target` at this step boundary: it is not planned
        until `end_move`, and its blocks count on the target as well meanwhile. FailedPrecondition
        when it cannot move now (in a step, unplaced, already moving, nothing held yet)."""
        seq = self._running.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown running sequence {seq_id!r}")
        sh = self._shard(target)
        if seq.shard is None or seq.inflight is not None or seq.moving is not None or seq.kv < 1:
            raise FailedPrecondition(f"sequence {seq_id!r} cannot move now (not at a step boundary)")
        if seq.shard == target or not self._serving(sh):
            raise FailedPrecondition(f"shard {target} cannot take sequence {seq_id!r}")
        seq.moving = target
        seq.incoming = self._held_blocks(seq.kv, seq.kv, sh.spec.block_size)  # a window: only its blocks
        sh.blocks += seq.incoming
        return Move(seq_id, seq.shard, target, seq.kv, seq.epoch)

    def end_move(self, move: Move, ok: bool) -> bool:
        """The copy of `move` finished (ok) or failed. True: the sequence now lives on the target
        (its source copy is released with the next step). False: it stays on its source, whole; a
        copy the target may hold is the caller's to release (also when it was cancelled or lost
        meanwhile, which already undid the move)."""
        seq = self._running.get(move.seq_id)
        if seq is None or seq.epoch != move.epoch or seq.moving != move.target:
            return False
        target = self._shards[move.target]
        if not ok or not target.healthy:
            self._cancel_move(seq)
            return False
        source = self._shards[move.source]
        source.seqs.discard(move.seq_id)
        source.blocks -= seq.blocks - seq.shared  # blocks it read from the source's prefix cache aside
        self._forget_pending(seq, source)
        source.blocked_until = 0  # it has room again
        if seq.reserved_on is not None and source.healthy:
            self._releases.append((move.seq_id, seq.reserved_on))
        seq.shard = seq.reserved_on = move.target
        seq.blocks, seq.moving, seq.incoming, seq.shared = seq.incoming, None, 0, 0  # all its own there
        seq.moved_step = self._step
        target.seqs.add(move.seq_id)
        self.migrations += 1
        return True

    def _cancel_move(self, seq: _Seq) -> None:
        if seq.moving is not None:
            self._shards[seq.moving].blocks -= seq.incoming
            seq.moving, seq.incoming = None, 0

    def drain_shard(self, shard: int) -> None:
        """Stop placing on the shard; `drain_moves` then moves its sequences away as room allows."""
        sh = self._shard(shard)
        if sh.state == SHARD_REMOVED:
            raise FailedPrecondition(f"shard {shard} is already removed")
        if sh.state != SHARD_DRAINING:
            if not any(self._serving(o) for o in self._shards if o is not sh):
                raise FailedPrecondition(f"shard {shard} is the last serving shard: nowhere to move to")
            sh.state, sh.left_by_recompute = SHARD_DRAINING, 0
            self._capacity_changed()

    def drained(self, shard: int) -> bool:
        """No sequence on it and none in a step or a copy there: it can be taken out."""
        sh = self._shard(shard)
        return not sh.seqs and not any(s.moving == shard for s in self._running.values())

    def remove_shard(self, shard: int) -> None:
        """Take a drained (or lost) shard out for good: never placed on, probed or recovered again."""
        sh = self._shard(shard)
        if sh.seqs and sh.healthy:
            raise FailedPrecondition(f"shard {shard} still holds {len(sh.seqs)} sequences")
        sh.state, sh.healthy, sh.blocks, sh.seqs = SHARD_REMOVED, False, 0, set()
        sh.prefixes.clear()
        self._releases = [(sid, i) for sid, i in self._releases if i != shard]
        self._capacity_changed()

    def shard_rejoined(self, shard: int) -> None:
        """A removed shard is back (empty, a restarted process on its address): it serves again."""
        sh = self._shard(shard)
        sh.state, sh.healthy, sh.blocks, sh.seqs, sh.blocked_until = SHARD_SERVING, True, 0, set(), 0
        sh.prefixes.clear()
        self._capacity_changed()

    def shard_state(self, shard: int) -> str:
        return self._shard(shard).state

    def seqs_on(self, shard: int) -> list[str]:
        return sorted(self._shard(shard).seqs)

    def left_by_recompute(self, shard: int) -> int:
        """Sequences that left the shard since its drain began by recompute (lost, preempted)."""
        return self._shard(shard).left_by_recompute

    def _target_for(self, seq: _Seq, step_no: int, exclude: int) -> int | None:
        """Where placement would put this sequence now (its source left out), or None: no room."""
        horizon = max(1.0, len(seq.req.prompt) + self._expected_gen(seq) - len(seq.tokens))
        loads = self._loads(step_no, horizon)
        loads[exclude] = ShardLoad(1, 1.0, 1, 0.0, available=False)
        need = self._commitment(seq, max(sh.spec.block_size for sh in self._shards))
        return choose_shard(need, self._future_load(seq, horizon), loads)

    def drain_moves(self, limit: int) -> tuple[list[Move], dict[int, int]]:
        """Start up to `limit` moves off draining shards (oldest first). Returns them and, per
        draining shard, how many sequences wait there for room (they keep decoding where they are
        until it frees up)."""
        moves: list[Move] = []
        waiting: dict[int, int] = {}
        for i, sh in enumerate(self._shards):
            if sh.state != SHARD_DRAINING or not sh.healthy:
                continue
            for seq in sorted((self._running[sid] for sid in sh.seqs), key=lambda s: s.started):
                if seq.moving is not None:
                    continue
                if seq.inflight is not None or seq.kv < 1:
                    continue  # in a step now, or nothing to copy yet: next boundary
                target = self._target_for(seq, self._step, i) if len(moves) < limit else None
                if target is None:
                    waiting[i] = waiting.get(i, 0) + (len(moves) < limit)
                    continue
                moves.append(self.begin_move(seq.req.seq_id, target))
        return moves, waiting

    def rebalance_move(self, factor: float) -> Move | None:
        """One move from the busiest shard to the least busy when the busiest holds more than
        `factor` x the mean KV, each shard's KV taken relative to its capacity (the shard's own
        report, as placement's memory share counts it; not the measured speed, which on shared
        hosts moves with the neighbours' load and would send sequences back and forth): of the
        sequences whose move lowers the larger of the two shards' loads, the one with the fewest
        tokens that brings the busiest within the factor, else the one that lowers it most. A
        sequence moved in the last REBALANCE_COOLDOWN_STEPS steps stays."""
        live = [i for i, sh in enumerate(self._shards) if self._serving(sh)]
        if len(live) < 2 or any(s.moving is not None for s in self._running.values()):
            return None
        kv = self.kv_tokens_per_shard()
        weight = {i: float(self._shards[i].spec.capacity_tokens) for i in live}
        mean = sum(kv[i] for i in live) / sum(weight.values())
        if mean <= 0:
            return None
        hot = max(live, key=lambda i: kv[i] / weight[i])
        cool = min(live, key=lambda i: kv[i] / weight[i])
        if kv[hot] / weight[hot] <= factor * mean:
            return None
        cands = []
        for sid in self._shards[hot].seqs:
            seq = self._running[sid]
            if (
                seq.inflight is not None
                or seq.kv < 1
                or self._step - seq.moved_step < REBALANCE_COOLDOWN_STEPS
            ):
                continue
            after = max((kv[hot] - seq.kv) / weight[hot], (kv[cool] + seq.kv) / weight[cool])
            if after < kv[hot] / weight[hot]:
                within = (kv[hot] - seq.kv) / weight[hot] <= factor * mean
                cands.append((not within, seq.kv if within else after, sid))
        need = self._commitment  # the target must have room for it as placement counts room
        for _, _, sid in sorted(cands):
            seq = self._running[sid]
            load = self._loads(self._step, 1.0)[cool]
            if load.reserved + need(seq, self._shards[cool].spec.block_size) <= load.capacity:
                return self.begin_move(sid, cool)
        return None

    # ---------------------------------------------------------------- preemption
    def _preempt(self, seq: _Seq, reserve: list[Reservation] | None = None) -> None:
        """Free a running sequence's KV and queue it at the head of the waiting queue; re-admitted, it
        re-prefills its token history (its generated tokens are kept)."""
        sid = seq.req.seq_id
        pending = [r for r in reserve or [] if r.seq_id == sid]
        if pending:  # admitted in the step being planned: drop the reservation, nothing to release
            reserve.remove(pending[0])  # type: ignore[union-attr]
        elif seq.reserved_on is not None and self._shards[seq.reserved_on].healthy:
            self._releases.append((sid, seq.reserved_on))
        seq.reserved_on = None
        self._unplace(seq)
        del self._running[sid]
        self._admission.finished(self._step, sid)
        self._waiting[sid] = seq
        self._waiting.move_to_end(sid, last=False)
        self.preemptions += 1
        self._preempted.append(sid)

    def _youngest_on(self, shard: int) -> _Seq | None:
        on = [self._running[sid] for sid in self._shards[shard].seqs]
        return max(on, key=lambda s: s.started, default=None)

    def kv_exhausted(self, step: Step, seq_ids: Sequence[str]) -> list[str]:
        """A shard had no free block for these sequences of `step` (its Attend answered
        RESOURCE_EXHAUSTED): nothing of their chunk was kept, so they retry it next step, and the
        youngest sequence on each such shard is preempted to make room. Call before apply(); their
        results in this step are ignored. Returns the preempted sequence ids."""
        marks = self._inflight.get(step.step, {})
        shards: set[int] = set()
        for sid in seq_ids:
            seq, mark = self._running.get(sid), marks.get(sid)
            if seq is None or mark is None or seq.epoch != mark.epoch or seq.shard is None:
                continue
            sh = self._shards[seq.shard]
            sh.blocks -= seq.blocks - mark.blocks
            seq.blocks, seq.kv, seq.inflight = mark.blocks, mark.start_pos, None
            seq.epoch += 1  # apply() skips it; the chunk is planned again
            shards.add(seq.shard)
        before = len(self._preempted)
        for shard in sorted(shards):
            victim = self._youngest_on(shard)
            if victim is not None:
                self._shards[shard].blocked_until = self._step + RESERVATION_BACKOFF_STEPS
                self._preempt(victim)
        return self._preempted[before:]

    def _fit_growth(
        self, planned: list[PlannedSeq], marks: dict[str, _Inflight], reserve: list[Reservation]
    ) -> None:
        """Grow the blocks of this step's sequences; where a shard lacks blocks, preempt its youngest
        sequences (those planned in this step are taken out of it) until the growth fits."""
        bs = {i: sh.spec.block_size for i, sh in enumerate(self._shards)}
        grow: dict[str, int] = {}
        need = [0] * len(self._shards)
        for p in planned:
            seq = self._running[p.seq_id]
            # the shard keeps the blocks it reserved for the prompt (history) until a window passes them
            end = max(p.start_pos + len(p.token_ids), len(seq.tokens))
            after = self._held_blocks(end, p.start_pos, bs[p.shard])
            # (a windowed model's sequence can hold fewer blocks after the chunk than before it)
            if after > seq.blocks or (after < seq.blocks and self._geometry is not None):
                grow[p.seq_id] = after - seq.blocks
                need[p.shard] += after - seq.blocks
        for i, sh in enumerate(self._shards):
            cap = sh.spec.capacity_tokens // sh.spec.block_size
            while sh.blocks + need[i] > cap:
                victim = self._youngest_on(i)
                if victim is None:
                    break
                need[i] -= grow.pop(victim.req.seq_id, 0)
                marks.pop(victim.req.seq_id, None)
                self._preempt(victim, reserve)
        planned[:] = [p for p in planned if p.seq_id in marks]
        for p in planned:
            seq = self._running[p.seq_id]
            g = grow.get(p.seq_id, 0)
            seq.blocks += g
            self._shards[p.shard].blocks += g

    # ---------------------------------------------------------------- planning
    def next_step(self) -> Step | None:
        """Admit, place, and plan the next step; None when there is nothing to run or send."""
        step_no = self._step
        reserve: list[Reservation] = []
        self._place_unplaced(step_no, reserve)
        self._admit(step_no, reserve)
        idle = not reserve and not any(s.shard is not None for s in self._running.values())
        if idle and any(sh.blocked_until > step_no for sh in self._shards):
            # Nothing runs, so steps (and the back-off) would never advance: retry the shards now.
            for sh in self._shards:
                sh.blocked_until = 0
            self._place_unplaced(step_no, reserve)
            self._admit(step_no, reserve)
        planned: list[PlannedSeq] = []
        marks: dict[str, _Inflight] = {}
        budget = self._budget
        for sid, seq in self._running.items():
            if seq.shard is None or seq.inflight is not None or seq.moving is not None:
                continue
            pending = len(seq.tokens) - seq.kv
            if pending <= 0:
                continue
            if seq.generated > 0 and pending == 1:
                n = 1  # decode: always goes
            else:
                if budget <= 0:
                    continue
                n = min(pending, budget)
                budget -= n
            sample = seq.kv + n == len(seq.tokens)
            sampling, next_token = self._prompt_scoring(seq, n)
            planned.append(
                PlannedSeq(
                    seq_id=sid,
                    shard=seq.shard,
                    mini_batch=0,
                    token_ids=seq.tokens[seq.kv : seq.kv + n],
                    start_pos=seq.kv,
                    sampling=sampling,
                    sample=sample,
                    sample_index=seq.req.sample_offset + seq.generated,
                    next_token=next_token,
                )
            )
            marks[sid] = _Inflight(seq.epoch, sample, seq.kv, seq.blocks)
            seq.kv += n
            seq.inflight = step_no
        self._fit_growth(planned, marks, reserve)
        if not planned and not reserve and not self._releases and not self._ended:
            return None
        costs = [(p.shard, attention_cost(len(p.token_ids), p.start_pos)) for p in planned]
        split = split_mini_batches(costs)
        for p, mb in zip(planned, split, strict=True):
            p.mini_batch = mb
        release, self._releases = self._releases, []
        ended, self._ended = self._ended, []
        if marks:
            self._inflight[step_no] = marks
        self._step += 1
        preempted, self._preempted = self._preempted, []
        return Step(
            step=step_no, seqs=planned, reserve=reserve, release=release, preempted=preempted, ended=ended
        )

    @staticmethod
    def _prompt_scoring(seq: _Seq, n: int) -> tuple[Sampling, int | None]:
        """The sampling settings of a chunk of n tokens from seq.kv, and the prompt token after it:
        prompt logprobs are asked only of chunks that hold prompt positions not yet sent out (a
        re-prefill after preemption or recovery scores nothing twice, nor the generated history)."""
        sp = seq.req.sampling
        if not sp.prompt_logprobs:
            return sp, None
        n_prompt = len(seq.req.prompt)
        end = seq.kv + n  # the chunk scores positions seq.kv+1 .. end (end when next_token is sent)
        if seq.scored >= n_prompt or end < seq.scored:
            return replace(sp, prompt_logprobs=False), None
        return sp, (seq.tokens[end] if end < n_prompt else None)

    def _held_blocks(self, end: int, start: int, block_size: int) -> int:
        """Blocks a sequence holds while computing positions start..end-1 (as its shard allocates)."""
        if self._geometry is None:
            return -(-end // block_size)
        return self._geometry.held_blocks(end, start, block_size)

    def _held(self, tokens: float) -> float:
        """KV tokens a sequence of `tokens` holds (and attends over): fewer with windowed layers."""
        return tokens if self._geometry is None else self._geometry.held_tokens(int(tokens))

    def _expected_gen(self, seq: _Seq) -> float:
        mt = seq.req.max_tokens
        return float(min(mt, max(seq.generated + 1, self._ratio * mt)))

    def _future_load(self, seq: _Seq, horizon: float) -> float:
        """Mean KV tokens the sequence holds over the next `horizon` steps (it grows by one a step and
        is gone after its expected end)."""
        now = len(seq.tokens)
        h = min(max(0.0, len(seq.req.prompt) + self._expected_gen(seq) - now), horizon)
        return h * self._held(now + h / 2) / horizon

    def _headroom(self, seq: _Seq) -> int:
        """Tokens the sequence is expected to add over the next kv_lookahead steps: one a step, until
        its expected end (max_tokens scaled by the running generated/max_tokens ratio)."""
        left = len(seq.req.prompt) + self._expected_gen(seq) - len(seq.tokens)
        return int(min(self._lookahead, max(0, math.ceil(left))))

    def _commitment(self, seq: _Seq, block_size: int) -> int:
        """KV tokens a sequence counts against its shard: its blocks, or its history plus headroom
        rounded up to whole blocks when that is more (blocks it reads from the prefix cache aside)."""
        end = len(seq.tokens) + self._headroom(seq)  # a windowed layer holds the most at the end
        grown = self._held_blocks(end, end - 1, block_size) * block_size
        return max(seq.blocks * block_size, grown) - seq.shared * block_size

    def _loads(self, step_no: int, horizon: float) -> list[ShardLoad]:
        load = [0.0] * len(self._shards)
        committed = [0] * len(self._shards)
        for seq in self._running.values():
            if seq.shard is not None:
                load[seq.shard] += self._future_load(seq, horizon)
                committed[seq.shard] += self._commitment(seq, self._shards[seq.shard].spec.block_size)
            if seq.moving is not None:  # a copy under way holds its room on the target too
                committed[seq.moving] += seq.incoming * self._shards[seq.moving].spec.block_size
        return [
            ShardLoad(
                capacity=sh.spec.capacity_tokens,
                speed=sh.spec.speed,
                reserved=committed[i],
                load=load[i],
                available=self._serving(sh) and sh.blocked_until <= step_no,
            )
            for i, sh in enumerate(self._shards)
        ]

    def _place(
        self, seq: _Seq, step_no: int, reserve: list[Reservation], may_wait: bool = False
    ) -> bool | None | Literal["wait"]:
        """Place on the shard with the least load over the new sequence's expected life (what it will
        share the shard with), weighted by speed and capacity, or the one holding its longest cached
        prefix when the balance allows. False: no room now; None: no healthy shard could ever hold
        it; "wait" (only with may_wait): its prefix is being computed on the shard it would go to."""
        horizon = max(1.0, len(seq.req.prompt) + self._expected_gen(seq) - len(seq.tokens))
        loads = self._loads(step_no, horizon)
        need = self._commitment(seq, max(sh.spec.block_size for sh in self._shards))
        matches = [self._prefix_match(seq, j) for j in range(len(self._shards))]
        cached = [r * sh.spec.block_size for (r, _), sh in zip(matches, self._shards, strict=True)]
        i = self._whole_prefix_shard(seq, need, loads, matches)
        if i is None:
            i = choose_shard(need, self._future_load(seq, horizon), loads, cached, self._affinity)
        if i is None:
            return False if any(s.available and need <= s.capacity for s in loads) else None
        if may_wait and matches[i][1] > matches[i][0]:
            return "wait"
        sh = self._shards[i]
        held = len(seq.tokens)  # the prompt, or the history a preempted / moved sequence recomputes
        seq.blocks = -(-held // sh.spec.block_size)
        sh.blocks += seq.blocks
        sh.seqs.add(seq.req.seq_id)
        seq.shard, seq.reserved_on, seq.kv = i, i, 0
        ids = list(seq.tokens) if self._shares(seq) else []
        reserve.append(Reservation(seq_id=seq.req.seq_id, shard=i, max_tokens=held, token_ids=ids))
        if self._shares(seq):
            names = self._names(seq, sh.spec.block_size)
            for h in names:  # it will hold them once its prefill is in (those it finds cached, at once)
                if h in sh.prefixes:
                    sh.prefixes.move_to_end(h)
                else:
                    sh.prefixes[h] = seq.req.seq_id
            while len(sh.prefixes) > sh.spec.capacity_tokens // sh.spec.block_size:
                sh.prefixes.popitem(last=False)
        return True

    # ---------------------------------------------------------------- shared prefixes
    def _names(self, seq: _Seq, block_size: int) -> list[bytes]:
        """Names of the full blocks of the sequence's tokens (as a shard names them, locally seeded)."""
        if seq.names is None or seq.names[:2] != (block_size, len(seq.tokens)):
            seq.names = (block_size, len(seq.tokens), chain_hashes(_NAME_SEED, seq.tokens, block_size))
        return seq.names[2]

    def _shares(self, seq: _Seq) -> bool:
        """Whether the sequence takes part in prefix sharing. Not when gpu_dense must see its whole
        prompt: prompt logprobs score every prompt position at prefill, and penalties and grammars
        keep the token history on the dense side (as vLLM skips its prefix cache for prompt logprobs)."""
        sp = seq.req.sampling
        return self._sharing and not (sp.prompt_logprobs or sp.needs_history)

    def _prefix_match(self, seq: _Seq, shard: int) -> tuple[int, int]:
        """(blocks ready, blocks ready or being computed) of the sequence's prefix on a shard, of
        those a shard would share (the block of its last token is always its own)."""
        sh = self._shards[shard]
        if not self._shares(seq) or not sh.healthy or not sh.prefixes:
            return 0, 0
        bs = sh.spec.block_size
        ready = known = 0
        for h in self._names(seq, bs)[: (len(seq.tokens) - 1) // bs]:
            owner = sh.prefixes.get(h, False)
            if owner is False or owner == seq.req.seq_id:
                break
            known += 1
            ready += owner is None and ready == known - 1
        return ready, known

    def _whole_prefix_shard(
        self, seq: _Seq, need: int, loads: list[ShardLoad], matches: list[tuple[int, int]]
    ) -> int | None:
        """The shard holding ready every block the sequence could share (all of its prompt but the
        last token's block), when it has room: a copy of a prompt (the n choices of one OpenAI
        request) goes where its KV is, as a fork would, instead of computing it again on an emptier
        shard. Requests that share only a system prompt differ in later blocks: balance places them."""
        if not self._shares(seq) or self._affinity <= 0:
            return None
        for j, ((ready, _), sh) in enumerate(zip(matches, self._shards, strict=True)):
            s = loads[j]
            whole = (len(seq.tokens) - 1) // sh.spec.block_size
            if ready and ready == whole and s.available and s.reserved + need <= s.capacity:
                return j
        return None

    def _awaits_prefix(self, seq: _Seq) -> bool:
        """Its prefix is being computed on a shard right now and no shard holds as much of it ready:
        waiting the few steps of that prefill beats computing and storing it a second time."""
        if not self._shares(seq):
            return False
        matches = [self._prefix_match(seq, j) for j in range(len(self._shards))]
        return max(k for _, k in matches) > max(r for r, _ in matches)

    def _prefix_ready(self, seq: _Seq) -> None:
        """The blocks the sequence was computing that its shard now holds (every layer written)."""
        if not self._sharing or seq.shard is None:
            return
        sh = self._shards[seq.shard]
        sid = seq.req.seq_id
        for h in self._names(seq, sh.spec.block_size)[: seq.kv // sh.spec.block_size]:
            if sh.prefixes.get(h) == sid:
                sh.prefixes[h] = None

    def _forget_pending(self, seq: _Seq, sh: _Shard) -> None:
        """The sequence leaves the shard: what it had not finished computing will not be there."""
        if not self._sharing:
            return
        sid = seq.req.seq_id
        for h in self._names(seq, sh.spec.block_size):
            if sh.prefixes.get(h) == sid:
                del sh.prefixes[h]

    def prefix_cached(self, step: Step, cached: dict[str, int]) -> Step:
        """The shards found the first `cached[seq_id]` tokens of these newly reserved sequences in
        their prefix caches: their prefill starts there (a chunk wholly cached leaves the step), and
        the blocks they read from the cache no longer count against the shard per sequence. Call
        after the reservations of `step` succeeded; run the step it returns."""
        marks = self._inflight.get(step.step, {})
        planned = {p.seq_id: p for p in step.seqs}
        drop: list[str] = []
        for sid, c in cached.items():
            seq = self._running.get(sid)
            if c <= 0 or seq is None or seq.shard is None:
                continue
            sh = self._shards[seq.shard]
            c = min(c, len(seq.tokens) - 1)  # a shard shares no more (its last token is computed)
            seq.cached = c
            # (a windowed model's sequence lets go of cached blocks as its window passes them: it
            # keeps counting them, an over-count of at most its prefix)
            seq.shared = c // sh.spec.block_size if self._geometry is None else 0
            sh.blocks -= seq.shared
            self.prefix_hits += 1
            self.cached_tokens += c
            p, mark = planned.get(sid), marks.get(sid)
            if p is None or mark is None or mark.epoch != seq.epoch or p.start_pos != 0:
                seq.kv = max(seq.kv, c)  # placed, not planned yet: its first chunk starts there
                continue
            if c >= len(p.token_ids):  # the whole chunk is cached: nothing of it to run
                drop.append(sid)
                del marks[sid]
                seq.kv, seq.inflight = c, None
                continue
            p.token_ids, p.start_pos = p.token_ids[c:], c
            marks[sid] = replace(mark, start_pos=c)
        if not drop:
            return step
        return Step(
            step=step.step,
            seqs=[p for p in step.seqs if p.seq_id not in drop],
            reserve=step.reserve,
            release=step.release,
            preempted=step.preempted,
            ended=step.ended,
        )

    def _place_unplaced(self, step_no: int, reserve: list[Reservation]) -> None:
        for seq in [s for s in self._running.values() if s.shard is None]:  # the oldest recover first
            if self._place(seq, step_no, reserve) is False:
                break

    def _admit(self, step_no: int, reserve: list[Reservation]) -> None:
        room = self._max_running - len(self._running)
        if room <= 0 or not self._waiting:
            return
        heads = [s for _, s in zip(range(room), self._waiting.values(), strict=False)]
        # A preempted sequence starts again from its history: that is its prompt now.
        cands = [
            Candidate(s.req.seq_id, len(s.tokens), max(1.0, self._expected_gen(s) - s.generated))
            for s in heads
        ]
        n = self._admission.admissible(step_no, cands, len(self._running), self._max_running)
        if n < len(heads):
            self.decisions["deferred_policy"] += 1
        if n <= 0:
            return
        started: list[Candidate] = []
        for seq, cand in zip(heads[:n], cands[:n], strict=True):
            placed = "wait" if self._awaits_prefix(seq) else self._place(seq, step_no, reserve, True)
            if placed == "wait":
                self.decisions["deferred_prefix"] += 1
                continue  # its prefix lands in a few steps; others may pass meanwhile
            if placed is False:
                self.decisions["deferred_capacity"] += 1
                break  # FIFO: it fits once something is released; don't let others pass
            if placed is None:
                continue  # no healthy shard can hold it now: let the rest go
            del self._waiting[seq.req.seq_id]
            self._running[seq.req.seq_id] = seq
            if seq.started < 0:  # a preempted sequence keeps its age
                seq.started, self._started = self._started, self._started + 1
            started.append(cand)
        self.decisions["admitted"] += len(started)
        self._admission.started(step_no, started)

    # ---------------------------------------------------------------- results in
    def abort(self, step: Step) -> None:
        """The step never ran to the end (gpu_dense went away mid-step): nothing of it is applied, and
        its sequences are planned again from the same positions. Shards write KV at the position they
        are given, so the re-run overwrites whatever layers the lost run had already appended."""
        marks = self._inflight.pop(step.step, None)
        if marks is None:
            return
        for p in step.seqs:
            seq = self._running.get(p.seq_id)
            mark = marks.get(p.seq_id)
            if seq is None or mark is None or seq.epoch != mark.epoch:
                continue  # cancelled, or already moved off a lost shard
            seq.kv = min(seq.kv, p.start_pos)
            seq.inflight = None

    def apply(
        self,
        step: Step,
        results: Mapping[str, tuple[int, float] | Sampled | ServiceError],
        prompt_logprobs: Mapping[str, list[TokenLogprob]] | None = None,
    ) -> list[TokenEvent]:
        """Apply one step's sampled tokens (or per-sequence typed errors); returns the token events.
        `prompt_logprobs`: the positions start_pos+1.. each chunk scored, for the requests that asked."""
        marks = self._inflight.pop(step.step, None)
        if marks is None:
            if not step.seqs:
                return []
            raise InvalidInput(f"step {step.step} is not outstanding")
        events: list[TokenEvent] = []
        for sid, mark in marks.items():
            seq = self._running.get(sid)
            if seq is None or seq.epoch != mark.epoch:
                continue  # cancelled, or moved off a lost shard: its history is re-prefilled instead
            seq.inflight = None
            self._prefix_ready(seq)
            res = results.get(sid)
            if isinstance(res, ServiceError):
                events.append(self._event(seq, [], [], FINISH_ERROR, step.step, error=res))
                self._leave(seq)
                continue
            scored = self._take_prompt_logprobs(seq, mark.start_pos, (prompt_logprobs or {}).get(sid))
            if not mark.sample:
                if scored:  # a prefill chunk that is not the last: only its prompt logprobs go out
                    events.append(self._event(seq, [], [], None, step.step, prompt_logprobs=scored))
                continue  # its KV is in, nothing to sample
            if res is None:
                err = InternalError("no result for a sampled sequence")
                events.append(self._event(seq, [], [], FINISH_ERROR, step.step, error=err))
                self._leave(seq)
                continue
            if not isinstance(res, Sampled):
                res = Sampled(int(res[0]), float(res[1]))
            tok = int(res.token_id)
            seq.tokens.append(tok)
            reason = self._stop_reason(seq, tok)
            top = [res.top] if seq.req.sampling.top_logprobs else []
            events.append(
                self._event(seq, [tok], [res.logprob], reason, step.step, top=top, prompt_logprobs=scored)
            )
            if reason is not None:
                self._ratio += RATIO_SMOOTHING * (seq.generated / seq.req.max_tokens - self._ratio)
                self._leave(seq)
        return events

    @staticmethod
    def _take_prompt_logprobs(
        seq: _Seq, start_pos: int, got: list[TokenLogprob] | None
    ) -> list[TokenLogprob]:
        """The positions of a chunk's prompt logprobs not yet sent out (each goes out once)."""
        if not got:
            return []
        n_prompt = len(seq.req.prompt)
        first = seq.scored - (start_pos + 1)  # got[i] scores position start_pos + 1 + i
        out = got[max(0, first) : n_prompt - (start_pos + 1)] if first < len(got) else []
        seq.scored = max(seq.scored, start_pos + 1 + max(0, first) + len(out))
        return out

    def _stop_reason(self, seq: _Seq, tok: int) -> str | None:
        if (tok in self._eos and not seq.req.ignore_eos) or tok in seq.req.stop_token_ids:
            return FINISH_STOP
        if seq.generated >= seq.req.max_tokens:
            return FINISH_LENGTH
        return None

    def _event(
        self,
        seq: _Seq,
        toks: list[int],
        lps: list[float],
        reason: str | None,
        step_no: int,
        error: ServiceError | None = None,
        top: list[tuple[tuple[int, float], ...]] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> TokenEvent:
        return TokenEvent(
            seq_id=seq.req.seq_id,
            token_ids=toks,
            logprobs=lps,
            finish_reason=reason,
            prompt_tokens=len(seq.req.prompt),
            completion_tokens=seq.generated,
            step=step_no,
            shard=seq.shard if seq.shard is not None else -1,
            error=error,
            cached_tokens=seq.cached,
            top=top or [],
            prompt_logprobs=prompt_logprobs or [],
        )

    def _leave(self, seq: _Seq, *, finished: bool = True) -> None:
        """A running sequence is done (finished, failed, cancelled): free its shard room."""
        sid = seq.req.seq_id
        del self._running[sid]
        self._ended.append(sid)
        self._cancel_move(seq)
        if seq.shard is not None:
            sh = self._shards[seq.shard]
            sh.seqs.discard(sid)
            sh.blocks -= seq.blocks - seq.shared
            sh.blocked_until = 0  # it has room again
            self._forget_pending(seq, sh)
        if seq.reserved_on is not None and self._shards[seq.reserved_on].healthy:
            self._releases.append((sid, seq.reserved_on))
        seq.shard, seq.reserved_on, seq.blocks, seq.shared = None, None, 0, 0
        self._finished += finished
        self._admission.finished(self._step, sid)

    # ---------------------------------------------------------------- introspection
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def steps(self) -> int:
        return self._step

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def admission(self) -> AdmissionPolicy:
        return self._admission

    def shard_of(self, seq_id: str) -> int | None:
        """The shard a running sequence is placed on (None while unplaced)."""
        seq = self._running.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown running sequence {seq_id!r}")
        return seq.shard

    def kv_tokens_per_shard(self) -> list[int]:
        """KV tokens each shard holds now (planned chunks included)."""
        out = [0] * len(self._shards)
        for seq in self._running.values():
            if seq.shard is not None:
                out[seq.shard] += seq.kv if self._geometry is None else round(self._held(seq.kv))
        return out

    def stats(self) -> SchedulerStats:
        """Counts and per-shard load (the scheduler's GetStats and its metrics)."""
        tokens = self.kv_tokens_per_shard()
        expected = [0.0] * len(self._shards)
        committed = [0] * len(self._shards)
        for seq in self._running.values():
            if seq.shard is not None:
                expected[seq.shard] += len(seq.req.prompt) + self._expected_gen(seq)
                committed[seq.shard] += self._commitment(seq, self._shards[seq.shard].spec.block_size)
        return SchedulerStats(
            running=self.running,
            waiting=self.waiting,
            steps=self._step,
            finished=self._finished,
            recoveries=self._recoveries,
            preemptions=self.preemptions,
            admission=getattr(self._admission, "name", type(self._admission).__name__),
            w_limit=self._admission.w_limit(self._step),
            kv_load_tokens=float(sum(tokens)),
            expected_ratio=self._ratio,
            shards=[
                ShardStats(
                    shard=i,
                    healthy=sh.healthy,
                    sequences=len(sh.seqs),
                    tokens=tokens[i],
                    expected_tokens=int(round(expected[i])),
                    reserved_tokens=sh.blocks * sh.spec.block_size,
                    committed_tokens=committed[i],
                    capacity_tokens=sh.spec.capacity_tokens,
                    block_size=sh.spec.block_size,
                    speed=sh.spec.speed,
                    state=sh.state,
                )
                for i, sh in enumerate(self._shards)
            ],
            migrations=self.migrations,
        )
