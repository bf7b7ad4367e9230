"""The scheduler's core: sequence state, admission, placement, step planning, stop rules.

Pure Python, no gRPC. A driver (the scheduler service, or the simulator) loops:
    step = core.next_step(); send step.release, step.reserve to the shards; run step.seqs on the dense
    side; events = core.apply(step, results); stream events.
Every step with sequences must be applied, in order (with typed errors when the dense side failed),
or aborted, newest first, or its sequences stay in flight. With `plan_ahead`, the driver plans step
n+1 while step n runs (at most these two out): a sequence whose chunk in step n samples its last
token goes on in step n+1 with that token, which only gpu_dense knows yet (`use_last_sample`); every
other sequence of step n waits for its results. A sequence at its max_tokens, scoring its prompt or
wanted at a step boundary (a move, `_parked`) is not planned ahead; one that stops at step n wastes
its step n+1 row. Its KV release waits until the latest step carrying it is applied
(`_held_releases`): a shard fails a whole item that names a sequence it no longer holds. Until then
its blocks count against the shard; a step ahead whose growth does not fit is not planned (None):
the step out is applied first, and preemption at that boundary frees blocks in time.

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
prefix cache are not counted against the shard per sequence (`SeqEntry.shared`).

SchedulerCore owns the shared tables (fastdecode/scheduling/tables.py `CoreTables`) and composes
collaborators over them along its seams, each constructed with the tables and the collaborators it
needs, each keeping its own state: `Membership` (shards in and out, membership.py),
`MigrationPlanning` (live moves, migration.py), `LoadModel` (the load model, placement, per-shard
stats, load.py), `PrefixPlacement` (prefixes.py), `Preemption` (preemption.py), `KVReleases`
(releases.py), `DecodeRuns` (several decode steps a plan, --decode-steps, runs.py), `RowPlanner`
(a step's rows, their growth and the mini-batch split, rows.py); scoring.py (prompt logprobs) is two
functions. This module holds admission, the step's phases and apply, and keeps the collaborators'
methods the driver calls as one-line delegations.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from functools import partial

from fastdecode.contract import TokenLogprob
from fastdecode.runtime.errors import (
    InternalError,
    InvalidInput,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    ServiceError,
)
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.admission import AdmissionPolicy, Candidate, NaiveAdmission
from fastdecode.scheduling.drafts import Drafting
from fastdecode.scheduling.load import LoadModel
from fastdecode.scheduling.membership import Membership
from fastdecode.scheduling.migration import MigrationPlanning, Move
from fastdecode.scheduling.preemption import Preemption
from fastdecode.scheduling.prefixes import PrefixPlacement
from fastdecode.scheduling.releases import KVReleases
from fastdecode.scheduling.rows import RowPlanner
from fastdecode.scheduling.runs import DecodeRuns, DecodeSteps, newcomer_waits
from fastdecode.scheduling.scoring import take_prompt_logprobs
from fastdecode.scheduling.tables import (
    ADMISSION_DECISIONS,
    DEFAULT_KV_LOOKAHEAD,
    CoreTables,
    Inflight,
    SeqEntry,
)
from fastdecode.scheduling.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    DenseAnswer,
    Request,
    Reservation,
    Sampling,
    SchedulerStats,
    ShardSpec,
    Step,
    TokenEvent,
)
from fastdecode.spec import Proposer


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
        plan_ahead: bool = False,
        decode_steps: DecodeSteps = 1,  # auto: up to runs.AUTO_DECODE_STEPS while no newcomer waits
        proposer: Proposer | None = None,
        speculative_k: str = "auto",  # auto: drafting's controller picks k in 0..K; fixed: always K
    ) -> None:
        if max_running < 1 or max_waiting < 0 or prefill_token_budget < 1:
            raise InvalidInput("max_running and prefill_token_budget must be >= 1, max_waiting >= 0")
        if max_context is not None and max_context < 2:
            raise InvalidInput("max_context must be >= 2")
        if kv_lookahead < 0:
            raise InvalidInput("kv_lookahead must be >= 0")
        if prefix_affinity < 0:
            raise InvalidInput("prefix_affinity must be >= 0")
        if proposer is not None and (decode_steps not in (1, "auto") or plan_ahead):
            # A row in flight with drafts leaves its next position unknown until verified, so it
            # cannot be planned ahead; several decode steps and drafts both give a row several tokens
            # (auto is then 1: a default of auto keeps speculation working).
            raise InvalidInput("speculative decoding plans one step at a time, with decode_steps 1 or auto")
        self._vocab_size = vocab_size
        # windowed layers (the model's geometry): a sequence holds, and attends over, less than its
        # length; without windows every count is the sequence's length
        geometry = kv_geometry if kv_geometry is not None and kv_geometry.windowed else None
        self._admission: AdmissionPolicy = admission if admission is not None else NaiveAdmission()
        self._eos = frozenset(int(t) for t in eos_token_ids)
        # The shared tables (the step loops read them through these names) and the collaborators
        # that work on them, each with its own state.
        tables = self._tables = CoreTables()
        self._shards, self._waiting, self._running = tables.shards, tables.waiting, tables.running
        self.prefixes = PrefixPlacement(
            tables, sharing=prefix_sharing, affinity=prefix_affinity, geometry=geometry
        )
        self.releases = KVReleases(tables)
        self.load = LoadModel(tables, self.releases, self.prefixes, geometry=geometry, lookahead=kv_lookahead)
        self.migration = MigrationPlanning(tables, self.load, self.prefixes, self.releases)
        self.membership = Membership(tables, self._admission, self.migration, self.prefixes, self.releases)
        self.preemption = Preemption(tables, self.membership, self.releases)
        steps = 1 if proposer is not None else decode_steps  # (range checked there)
        self.runs = DecodeRuns(steps, self._eos, self.load, partial(newcomer_waits, tables))
        self.drafting = Drafting(proposer, speculative_k == "auto") if proposer is not None else None
        self.planner = RowPlanner(
            tables,
            self.load,
            self.runs,
            plan_ahead=plan_ahead,
            prefill_budget=prefill_token_budget,
            drafting=self.drafting,
        )
        for spec in shards:
            self.membership.add_shard(spec)
        self.membership.capacity_changed()  # (also with no shard: the capacity is unknown)
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._max_context = max_context
        self._reserved_ahead: list[Reservation] = []  # made for a step that was not planned: go next
        self._ended: list[str] = []  # left for good since the last step (Step.ended)
        self._finished = 0
        self._started = 0  # admissions so far (orders sequences by age)
        # Cumulative admission outcomes: sequences admitted or rejected (queue full), and steps in
        # which waiting sequences were held back by the admission policy or by shard capacity.
        self.decisions: dict[str, int] = dict.fromkeys(ADMISSION_DECISIONS, 0)
        # one shared object per distinct sampling settings among the live requests (submit); weak
        # both ways, so settings no request holds any more are forgotten
        self._samplings: weakref.WeakKeyDictionary[Sampling, weakref.ref[Sampling]] = (
            weakref.WeakKeyDictionary()
        )

    # ---------------------------------------------------------------- requests in
    def submit(self, req: Request) -> None:
        """Queue a request. InvalidInput for a bad one, ResourceExhausted when the queue is full."""
        self._validate(req)
        if len(self._waiting) >= self._max_waiting:
            self.decisions["rejected"] += 1
            raise ResourceExhausted(f"waiting queue full ({self._max_waiting})")
        # Requests with equal settings share one settings object, so a step's plan finds each row's
        # settings by identity (wire.dense.plan_to_proto) instead of hashing and comparing every
        # row's 17 fields at every step.
        try:
            ref = self._samplings.get(req.sampling)
            shared = ref() if ref is not None else None
            if shared is None:
                self._samplings[req.sampling] = weakref.ref(req.sampling)
            else:
                req.sampling = shared
        except TypeError:  # settings built with a list somewhere (unhashable): kept as they are
            pass
        self._waiting[req.seq_id] = SeqEntry(req=req, tokens=[int(t) for t in req.prompt])

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

    # ---------------------------------------------------------------- planning
    def next_step(self) -> Step | None:
        """Admit, place, and plan the next step; None when there is nothing to run or send."""
        step_no = self._tables.step
        reserve, self._reserved_ahead = self._reserved_ahead, []
        self._admit_and_place(step_no, reserve)
        # the plan-ahead rows and the planned rows, in admission order, with their growth
        rows = self.planner.rows(step_no)
        if not self.preemption.fit_growth(rows, reserve):
            # Planned ahead into a shard that lacks blocks: nothing goes out until the step out is
            # applied (the driver awaits it on None); the reservations made go with the next step.
            self.planner.unplan(rows)
            self._reserved_ahead = reserve
            return None
        if not rows.planned and not reserve and not self.releases.queued and not self._ended:
            return None
        release, preempted = self.releases.take(), self.preemption.take_preempted()
        ended, self._ended = self._ended, []
        return self.planner.seal(step_no, rows, reserve, release, preempted, ended)

    def _admit_and_place(self, step_no: int, reserve: list[Reservation]) -> None:
        """Place the running sequences that lost their shard, then admit waiting ones."""
        self._place_unplaced(step_no, reserve)
        self._admit(step_no, reserve)
        idle = not reserve and not any(s.shard is not None for s in self._running.values())
        if idle and any(sh.blocked_until > step_no for sh in self._shards):
            # Nothing runs, so steps (and the back-off) would never advance: retry the shards now.
            for sh in self._shards:
                sh.blocked_until = 0
            self._place_unplaced(step_no, reserve)
            self._admit(step_no, reserve)

    def _place_unplaced(self, step_no: int, reserve: list[Reservation]) -> None:
        for seq in [s for s in self._running.values() if s.shard is None]:  # the oldest recover first
            if self.load.place(seq, step_no, reserve) is False:
                break

    def _admit(self, step_no: int, reserve: list[Reservation]) -> None:
        room = self._max_running - len(self._running)
        if room <= 0 or not self._waiting:
            return
        heads = [s for _, s in zip(range(room), self._waiting.values(), strict=False)]
        # A preempted sequence starts again from its history: that is its prompt now.
        expected_gen = self.load.expected_gen
        cands = [
            Candidate(s.req.seq_id, len(s.tokens), max(1.0, expected_gen(s) - s.generated)) for s in heads
        ]
        n = self._admission.admissible(step_no, cands, len(self._running), self._max_running)
        if n < len(heads):
            self.decisions["deferred_policy"] += 1
        if n <= 0:
            return
        started: list[Candidate] = []
        pending = bool(self.releases.held)
        for seq, cand in zip(heads[:n], cands[:n], strict=True):
            if pending and self.releases.pending(seq.req.seq_id):
                self.decisions["deferred_capacity"] += 1
                break  # preempted while a step out carried it: its KV is not released yet
            placed = "wait" if self.prefixes.awaits(seq) else self.load.place(seq, step_no, reserve, True)
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
        marks = self._tables.inflight.pop(step.step, None)
        self.releases.unhold(step.step)
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
        results: Mapping[str, DenseAnswer | ServiceError],
        prompt_logprobs: Mapping[str, list[TokenLogprob]] | None = None,
    ) -> list[TokenEvent]:
        """Apply one step's sampled tokens (or per-sequence typed errors); returns the token events.
        A result is a Sampled or a (token, logprob) pair (a token < 0: nothing sampled).
        `prompt_logprobs`: the positions start_pos+1.. each chunk scored, for the requests that asked."""
        marks = self._tables.inflight.pop(step.step, None)
        self.releases.unhold(step.step)
        if marks is None:
            if not step.seqs:
                return []
            raise InvalidInput(f"step {step.step} is not outstanding")
        return self._apply_rows(step.step, marks, results, prompt_logprobs or {})

    def _apply_rows(
        self,
        step_no: int,
        marks: dict[str, Inflight],
        results: Mapping[str, DenseAnswer | ServiceError],
        scores: Mapping[str, list[TokenLogprob]],
    ) -> list[TokenEvent]:
        """Each row of the step in turn: its error, its prompt logprobs, its decode run, or its
        sampled token through the stop rules; a sequence that stops or fails leaves."""
        events: list[TokenEvent] = []
        running, eos, prefix_ready = self._running, self._eos, self.prefixes.ready
        for sid, mark in marks.items():
            seq = running.get(sid)
            if seq is None or seq.epoch != mark.epoch:
                continue  # cancelled, or moved off a lost shard: its history is re-prefilled instead
            if seq.inflight == step_no:  # (not when it is in the step planned ahead of this one)
                seq.inflight = None
            if seq.claimed:
                prefix_ready(seq)
            res = results.get(sid)
            if isinstance(res, ServiceError):
                self._fail(seq, res, step_no, events)
                continue
            got = scores.get(sid)
            scored = take_prompt_logprobs(seq, mark.start_pos, got) if got else []
            if not mark.sample:
                if scored:  # a prefill chunk that is not the last: only its prompt logprobs go out
                    events.append(self._event(seq, [], [], None, step_no, prompt_logprobs=scored))
                continue  # its KV is in, nothing to sample
            if (mark.steps > 1 or mark.drafts) and res is not None:  # several tokens (runs.py, drafts.py)
                if mark.drafts and self.drafting is not None:
                    ev = self.drafting.apply(seq, mark.drafts, res, scored, step_no, self.runs)
                else:
                    ev = self.runs.apply(seq, mark.steps, res, scored, step_no)
                events.append(ev)
                if ev.finish_reason is not None:
                    self._leave(seq)
                continue
            if isinstance(res, tuple):  # (token, logprob): a decode step's answer as it came
                tok, lp, alts = res[0], res[1], ()
            elif res is not None:
                tok, lp, alts = res.token_id, res.logprob, res.top
            if res is None or tok < 0:
                self._fail(seq, InternalError("no result for a sampled sequence"), step_no, events)
                continue
            # the stop rules and _event, inlined: this runs for every sequence every step
            tokens, req = seq.tokens, seq.req
            tokens.append(tok)
            n_prompt = len(req.prompt)
            generated = len(tokens) - n_prompt
            if (tok in eos and not req.ignore_eos) or tok in req.stop_token_ids:
                reason: str | None = FINISH_STOP
            else:
                reason = FINISH_LENGTH if generated >= req.max_tokens else None
            top = [alts] if req.sampling.top_logprobs else []
            shard = seq.shard if seq.shard is not None else -1
            events.append(
                TokenEvent(
                    sid,
                    [tok],
                    [lp],
                    reason,
                    n_prompt,
                    generated,
                    step_no,
                    shard,
                    None,
                    seq.cached,
                    top,
                    scored,
                )
            )
            if reason is not None:
                self.load.finished(generated, req.max_tokens)
                self._leave(seq)
        return events

    def _fail(self, seq: SeqEntry, error: ServiceError, step_no: int, events: list[TokenEvent]) -> None:
        """The sequence's row failed: its last event carries the error, and it leaves."""
        events.append(self._event(seq, [], [], FINISH_ERROR, step_no, error=error))
        self._leave(seq)

    def _event(
        self,
        seq: SeqEntry,
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

    def _leave(self, seq: SeqEntry, *, finished: bool = True) -> None:
        """A running sequence is done (finished, failed, cancelled): free its shard room."""
        sid = seq.req.seq_id
        del self._running[sid]
        self._ended.append(sid)
        self.migration.cancel_move(seq)
        if seq.shard is not None:
            sh = self._shards[seq.shard]
            sh.seqs.discard(sid)
            sh.blocks -= seq.blocks - seq.shared
            sh.blocked_until = 0  # it has room again
            self.prefixes.forget_pending(seq, sh)
        self.releases.release(seq)
        if self.drafting is not None:
            self.drafting.forget(sid)
        self._tables.parked.discard(sid)
        seq.shard, seq.reserved_on, seq.blocks, seq.shared = None, None, 0, 0
        self._finished += finished
        self._admission.finished(self._tables.step, sid)

    # ---------------------------------------------------------------- introspection
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def steps(self) -> int:
        return self._tables.step

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def admission(self) -> AdmissionPolicy:
        return self._admission

    def shard_of(self, seq_id: str) -> int | None:
        """The shard a running sequence is placed on (None while unplaced)."""
        return self._tables.running_seq(seq_id).shard

    def stats(self, loads: bool = True) -> SchedulerStats:
        """Counts and per-shard load (the scheduler's GetStats and its metrics). `loads=False` leaves
        out the per-sequence load model (LoadModel.shard_stats)."""
        shards = self.load.shard_stats(loads)
        step = self._tables.step
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            steps=step,
            finished=self._finished,
            recoveries=self.membership.recoveries,
            preemptions=self.preemption.preemptions,
            admission=self._admission.name,
            w_limit=self._admission.w_limit(step),
            kv_load_tokens=float(sum(s.tokens for s in shards)),
            expected_ratio=self.load.ratio,
            shards=shards,
            migrations=self.migration.migrations,
            **(self.drafting.stats() if self.drafting is not None else {}),
        )

    @property
    def preemptions(self) -> int:
        return self.preemption.preemptions

    @property
    def migrations(self) -> int:
        return self.migration.migrations

    @property
    def prefix_hits(self) -> int:
        return self.prefixes.prefix_hits

    @property
    def cached_tokens(self) -> int:
        return self.prefixes.cached_tokens

    def kv_tokens_per_shard(self) -> list[int]:
        return self.load.kv_tokens_per_shard()

    # ---------------------------------------------------------------- the collaborators' doors
    # What the driver (and the simulator) ask of membership, migration, preemption and prefixes.
    def add_shard(self, spec: ShardSpec) -> int:
        return self.membership.add_shard(spec)

    def shard_lost(self, shard: int) -> list[str]:
        return self.membership.shard_lost(shard)

    def shard_recovered(self, shard: int) -> None:
        self.membership.shard_recovered(shard)

    def shard_rejoined(self, shard: int) -> None:
        self.membership.shard_rejoined(shard)

    def set_speed(self, shard: int, speed: float) -> None:
        self.membership.set_speed(shard, speed)

    def reservation_failed(self, seq_id: str) -> None:
        self.membership.reservation_failed(seq_id)

    def drain_shard(self, shard: int) -> None:
        self.membership.drain_shard(shard)

    def drained(self, shard: int) -> bool:
        return self.membership.drained(shard)

    def remove_shard(self, shard: int) -> None:
        self.membership.remove_shard(shard)

    def shard_state(self, shard: int) -> str:
        return self.membership.shard_state(shard)

    def seqs_on(self, shard: int) -> list[str]:
        return self.membership.seqs_on(shard)

    def left_by_recompute(self, shard: int) -> int:
        return self.membership.left_by_recompute(shard)

    def begin_move(self, seq_id: str, target: int) -> Move:
        return self.migration.begin_move(seq_id, target)

    def end_move(self, move: Move, ok: bool) -> bool:
        return self.migration.end_move(move, ok)

    def drain_moves(self, limit: int) -> tuple[list[Move], dict[int, int]]:
        return self.migration.drain_moves(limit)

    def rebalance_move(self, factor: float) -> Move | None:
        return self.migration.rebalance_move(factor)

    def kv_exhausted(self, step: Step, seq_ids: Sequence[str]) -> list[str]:
        return self.preemption.kv_exhausted(step, seq_ids)

    def prefix_cached(self, step: Step, cached: dict[str, int]) -> Step:
        return self.prefixes.prefix_cached(step, cached)
