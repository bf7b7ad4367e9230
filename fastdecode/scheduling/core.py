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

The core is one class over its tables (fastdecode/scheduling/tables.py), in parts along its seams:
membership (shards in and out), migration (live moves), load (the load model, placement, stats),
prefixes (prefix placement), preemption (preemption and KV releases), runs (several decode steps a
plan, --decode-steps), scoring (prompt logprobs); this module holds admission, planning and apply.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from fastdecode.contract import LAST_SAMPLE, TokenLogprob
from fastdecode.protocol import MAX_DECODE_STEPS
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
from fastdecode.scheduling.load import LoadModel
from fastdecode.scheduling.membership import Membership
from fastdecode.scheduling.migration import MigrationPlanning
from fastdecode.scheduling.placement import attention_cost, split_mini_batches
from fastdecode.scheduling.preemption import Preemption
from fastdecode.scheduling.prefixes import PrefixPlacement
from fastdecode.scheduling.runs import DecodeRuns
from fastdecode.scheduling.scoring import PromptScoring
from fastdecode.scheduling.tables import (
    ADMISSION_DECISIONS,
    DEFAULT_KV_LOOKAHEAD,
    RATIO_SMOOTHING,
    Inflight,
    SeqEntry,
    ShardEntry,
)
from fastdecode.scheduling.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    DenseAnswer,
    PlannedSeq,
    Request,
    Reservation,
    Sampling,
    ShardSpec,
    Step,
    TokenEvent,
)


class SchedulerCore(
    Membership, MigrationPlanning, LoadModel, PrefixPlacement, Preemption, DecodeRuns, PromptScoring
):
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
        decode_steps: int = 1,
    ) -> None:
        if max_running < 1 or max_waiting < 0 or prefill_token_budget < 1:
            raise InvalidInput("max_running and prefill_token_budget must be >= 1, max_waiting >= 0")
        if max_context is not None and max_context < 2:
            raise InvalidInput("max_context must be >= 2")
        self._vocab_size = vocab_size
        if kv_lookahead < 0:
            raise InvalidInput("kv_lookahead must be >= 0")
        self._lookahead = kv_lookahead
        if not 1 <= decode_steps <= MAX_DECODE_STEPS:
            raise InvalidInput(f"decode_steps must be in [1, {MAX_DECODE_STEPS}]")
        self._decode_steps = decode_steps
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
        self._shards: list[ShardEntry] = []
        for spec in shards:
            self.add_shard(spec)
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._budget = prefill_token_budget
        self._max_context = max_context
        self._waiting: OrderedDict[str, SeqEntry] = OrderedDict()
        self._running: OrderedDict[str, SeqEntry] = OrderedDict()  # admission order
        self._releases: list[tuple[str, int]] = []
        self._held_releases: dict[int, list[tuple[str, int, int]]] = {}
        self._reserved_ahead: list[Reservation] = []  # made for a step that was not planned: go next
        self._parked: set[str] = set()
        self._ahead = plan_ahead
        self._ended: list[str] = []  # left for good since the last step (Step.ended)
        self._inflight: dict[int, dict[str, Inflight]] = {}
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
        step_no = self._step
        reserve, self._reserved_ahead = self._reserved_ahead, []
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
        marks: dict[str, Inflight] = {}
        budget = self._budget
        # The blocks each chunk grows its sequence by, per sequence and per shard (_fit_growth).
        bs = [sh.spec.block_size for sh in self._shards]
        grow: dict[str, int] = {}
        need = [0] * len(self._shards)
        windowed, held_blocks = self._geometry is not None, self._held_blocks
        # The per-sequence loop runs every step over every running sequence: attributes are read
        # once into locals, and a decode (one token, nothing to score) skips the general path.
        ahead, parked = self._ahead, self._parked
        for sid, seq in self._running.items():
            shard = seq.shard
            if shard is None or seq.moving is not None:
                continue
            tokens, kv, req = seq.tokens, seq.kv, seq.req
            ntok = len(tokens)
            if seq.inflight is not None:
                # Planned ahead: its chunk in flight samples its last token (then kv counts the
                # positions of all but the last token it samples), after which it is not at
                # max_tokens, and nothing wants it at a step boundary.
                generated = ntok - len(req.prompt) + seq.flying  # with the tokens in flight
                if (
                    not ahead
                    or kv != ntok + seq.flying - 1
                    or generated >= req.max_tokens
                    or req.sampling.prompt_logprobs
                    or sid in parked
                ):
                    continue
                n, sample = 1, True
                steps = 1 if self._decode_steps == 1 else self._run_steps(req, generated)
                planned.append(
                    PlannedSeq(
                        sid,
                        shard,
                        0,
                        [LAST_SAMPLE],
                        kv,
                        req.sampling,
                        True,
                        req.sample_offset + generated,
                        None,
                        True,
                        steps,
                    )
                )
            else:
                pending = ntok - kv
                if pending <= 0:
                    continue
                generated = ntok - len(req.prompt)
                if generated > 0 and pending == 1:
                    n = 1  # decode: always goes
                else:
                    if budget <= 0:
                        continue
                    n = min(pending, budget)
                    budget -= n
                sample = kv + n == ntok
                steps = self._run_steps(req, generated) if sample and self._decode_steps > 1 else 1
                if req.sampling.prompt_logprobs:
                    sampling, next_token = self._prompt_scoring(seq, n)
                else:
                    sampling, next_token = req.sampling, None
                planned.append(
                    PlannedSeq(
                        sid,
                        shard,
                        0,
                        tokens[kv : kv + n],
                        kv,
                        sampling,
                        sample,
                        req.sample_offset + generated,
                        next_token,
                        False,
                        steps,
                    )
                )
            blocks = seq.blocks
            marks[sid] = Inflight(seq.epoch, sample, kv, blocks, steps)
            # the KV positions written once the step ran: all but its last sampled token's
            seq.kv = written = kv + n + steps - 1
            seq.inflight, seq.flying = step_no, steps
            # the shard keeps the blocks it reserved for the prompt (history) until a window passes
            # them; a windowed model's sequence can hold fewer blocks after the chunk than before it
            end = written if written > ntok else ntok
            after = held_blocks(end, kv, bs[shard]) if windowed else -(-end // bs[shard])
            if after > blocks or (windowed and after < blocks):
                grow[sid] = after - blocks
                need[shard] += after - blocks
        if not self._fit_growth(planned, marks, reserve, grow, need):
            # Planned ahead into a shard that lacks blocks: nothing goes out until the step out is
            # applied (the driver awaits it on None); the reservations made go with the next step.
            out = max(self._inflight)  # the step out carries every sequence planned ahead
            for p in planned:
                seq = self._running[p.seq_id]
                seq.kv, seq.inflight = marks[p.seq_id].start_pos, out if p.use_last_sample else None
                seq.flying = self._inflight[out][p.seq_id].steps if p.use_last_sample else 1
            self._reserved_ahead = reserve
            return None
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
        pending = bool(self._held_releases)
        for seq, cand in zip(heads[:n], cands[:n], strict=True):
            if pending and self._release_pending(seq.req.seq_id):
                self.decisions["deferred_capacity"] += 1
                break  # preempted while a step out carried it: its KV is not released yet
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
        self._unhold(step.step)
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
        marks = self._inflight.pop(step.step, None)
        self._unhold(step.step)
        if marks is None:
            if not step.seqs:
                return []
            raise InvalidInput(f"step {step.step} is not outstanding")
        events: list[TokenEvent] = []
        running, scores = self._running, prompt_logprobs or {}
        eos, step_no = self._eos, step.step
        for sid, mark in marks.items():
            seq = running.get(sid)
            if seq is None or seq.epoch != mark.epoch:
                continue  # cancelled, or moved off a lost shard: its history is re-prefilled instead
            if seq.inflight == step.step:  # (not when it is in the step planned ahead of this one)
                seq.inflight = None
            if seq.claimed:
                self._prefix_ready(seq)
            res = results.get(sid)
            if isinstance(res, ServiceError):
                events.append(self._event(seq, [], [], FINISH_ERROR, step.step, error=res))
                self._leave(seq)
                continue
            got = scores.get(sid)
            scored = self._take_prompt_logprobs(seq, mark.start_pos, got) if got else []
            if not mark.sample:
                if scored:  # a prefill chunk that is not the last: only its prompt logprobs go out
                    events.append(self._event(seq, [], [], None, step.step, prompt_logprobs=scored))
                continue  # its KV is in, nothing to sample
            if mark.steps > 1 and res is not None:  # several decode steps ran it (runs.py)
                ev = self._apply_run(seq, mark.steps, res, scored, step_no)
                events.append(ev)
                if ev.finish_reason is not None:
                    self._leave(seq)
                continue
            if isinstance(res, tuple):  # (token, logprob): a decode step's answer as it came
                tok, lp, alts = res[0], res[1], ()
            elif res is not None:
                tok, lp, alts = res.token_id, res.logprob, res.top
            if res is None or tok < 0:
                err = InternalError("no result for a sampled sequence")
                events.append(self._event(seq, [], [], FINISH_ERROR, step.step, error=err))
                self._leave(seq)
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
                self._ratio += RATIO_SMOOTHING * (generated / req.max_tokens - self._ratio)
                self._leave(seq)
        return events

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
        self._cancel_move(seq)
        if seq.shard is not None:
            sh = self._shards[seq.shard]
            sh.seqs.discard(sid)
            sh.blocks -= seq.blocks - seq.shared
            sh.blocked_until = 0  # it has room again
            self._forget_pending(seq, sh)
        self._release(seq)
        self._parked.discard(sid)
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
