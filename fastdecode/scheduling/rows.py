"""A step's rows, as the core plans them: each placed sequence's `PlannedSeq` in admission order (a
plan-ahead row for one whose chunk in flight samples its last token, a planned row for one holding
tokens its shard has not seen), the blocks each row grows its sequence by, and, once that growth
fits (preemption.py), the rows split into the two mini-batches and sealed into a `Step`. Pure
Python, no gRPC: a collaborator of the core's (fastdecode/scheduling/core.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastdecode.scheduling.drafts import Drafting
from fastdecode.scheduling.load import LoadModel
from fastdecode.scheduling.placement import row_costs, split_mini_batches
from fastdecode.scheduling.runs import DecodeRuns
from fastdecode.scheduling.scoring import chunk_scoring
from fastdecode.scheduling.tables import CoreTables, Inflight, SeqEntry
from fastdecode.scheduling.types import PlannedSeq, Request, Reservation, Sampling, Step


@dataclass(slots=True)
class Rows:
    """A step's rows as planning works them out, before their growth is fitted: the rows in
    admission order, each one's mark, and the blocks each chunk grows its sequence by, per sequence
    (`grow`) and per shard (`need`)."""

    planned: list[PlannedSeq]
    marks: dict[str, Inflight]
    grow: dict[str, int]
    need: list[int]


# PlannedSeq's builders, bound once: a classmethod binds anew each time it is looked up (per row here).
_AHEAD_ROW, _CHUNK_ROW = PlannedSeq.ahead, PlannedSeq.chunk


@dataclass(slots=True)
class _Pass:
    """One step's pass over the running sequences, as the row builders read it: the planner's
    settings, read once per step (the builders run for every running sequence), and the prefill
    tokens the step has left (`budget`, spent by the prefill chunks in admission order)."""

    ahead: bool  # plan_ahead
    parked: set[str]  # sequences wanted at a step boundary: not planned ahead
    budget: int
    most: int  # decode steps a sampling row runs this plan, at most (runs.py plan_steps)
    run_steps: Callable[[Request, int, int], int]
    draft: Callable[[str, list[int], Sampling, int, str], list[int]] | None  # None: no drafts

    def ahead_row(self, sid: str, seq: SeqEntry, shard: int, ntok: int) -> PlannedSeq | None:
        """A plan-ahead row, or None while it waits for its results. Its chunk in flight samples its
        last token (then kv counts the positions of all but the last token it samples), after which
        it is not at max_tokens, and nothing wants it at a step boundary: it goes on with that
        token, which only gpu_dense knows yet."""
        kv, req, flying = seq.kv, seq.req, seq.flying
        generated = ntok - len(req.prompt) + flying  # with the tokens in flight
        if not self.ahead or kv != ntok + flying - 1 or generated >= req.max_tokens:
            return None
        if req.sampling.prompt_logprobs or sid in self.parked:
            return None
        steps = self.run_steps(req, generated, self.most) if self.most > 1 else 1
        return _AHEAD_ROW(
            sid, shard, kv, req.sampling, sample_index=req.sample_offset + generated, steps=steps
        )

    def chunk_row(self, sid: str, seq: SeqEntry, shard: int, ntok: int) -> PlannedSeq | None:
        """A planned row: the next tokens its shard has not seen (a prompt chunk, a recomputed
        history, the token it sampled last: a decode, which always goes and takes no share of the
        prefill budget), or None when it has none or the budget is spent."""
        tokens, kv, req = seq.tokens, seq.kv, seq.req
        n = ntok - kv
        if n <= 0:
            return None
        generated = ntok - len(req.prompt)
        if generated <= 0 or n > 1:  # a prefill chunk: within the step's budget
            if self.budget <= 0:
                return None
            n = min(n, self.budget)
            self.budget -= n
        sample = kv + n == ntok
        steps = self.run_steps(req, generated, self.most) if sample and self.most > 1 else 1
        if req.sampling.prompt_logprobs:
            sampling, next_token = chunk_scoring(seq, n)
        else:
            sampling, next_token = req.sampling, None
        chunk, drafts = tokens[kv : kv + n], 0
        # a decode row: the last token, then what drafting expects to follow it
        if self.draft is not None and n == 1 and generated > 0:
            drafted = self.draft(sid, tokens, req.sampling, req.max_tokens - generated - 1, req.cache_salt)
            if drafted:
                chunk, drafts = chunk + drafted, len(drafted)
        return _CHUNK_ROW(
            sid,
            shard,
            chunk,
            kv,
            sampling,
            sample=sample,
            sample_index=req.sample_offset + generated,
            next_token=next_token,
            steps=steps,
            drafts=drafts,
        )


class RowPlanner:
    """Plans the rows of each step over the core's tables: whether sequences are planned one step
    ahead (`plan_ahead`) and the prefill tokens a step takes (`prefill_budget`)."""

    def __init__(
        self,
        tables: CoreTables,
        load: LoadModel,
        runs: DecodeRuns,
        *,
        plan_ahead: bool,
        prefill_budget: int,
        drafting: Drafting | None = None,
    ) -> None:
        self._tables = tables
        self._load = load
        self._runs = runs
        self._drafting = drafting  # None: no speculative drafts
        self.plan_ahead = plan_ahead
        self.prefill_budget = prefill_budget

    def rows(self, step_no: int) -> Rows:
        """Each placed sequence's row of the step, in admission order: a plan-ahead row for one whose
        chunk in flight samples its last token, a planned row for one holding tokens its shard has
        not seen; and each row's growth, the blocks it grows its sequence by."""
        # This loop runs every step over every running sequence: what it reads is read once into
        # locals (what the row builders read, into a `_Pass`), and each row's mark and growth are read
        # back off its PlannedSeq (no tuple per row).
        shards = self._tables.shards
        rows = Rows([], {}, {}, [0] * len(shards))
        planned, marks, grow, need = rows.planned, rows.marks, rows.grow, rows.need
        bs = [sh.spec.block_size for sh in shards]
        windowed, held_blocks = self._load.geometry is not None, self._load.held_blocks
        row_pass = _Pass(
            self.plan_ahead,
            self._tables.parked,
            self.prefill_budget,
            self._runs.plan_steps(),  # with --decode-steps auto: 1 while a newcomer waits
            self._runs.steps,
            self._drafting.drafts if self._drafting is not None else None,
        )
        ahead_row, chunk_row = row_pass.ahead_row, row_pass.chunk_row
        for sid, seq in self._tables.running.items():
            shard = seq.shard
            if shard is None or seq.moving is not None or shards[shard].suspended:
                continue
            kv, ntok = seq.kv, len(seq.tokens)
            p = (
                ahead_row(sid, seq, shard, ntok)
                if seq.inflight is not None
                else chunk_row(sid, seq, shard, ntok)
            )
            if p is None:
                continue  # nothing of it goes this step
            planned.append(p)
            blocks, steps = seq.blocks, p.steps
            marks[sid] = Inflight(seq.epoch, p.sample, kv, blocks, steps, p.drafts)
            # Its growth. The KV positions written once the step ran: all but its last sampled
            # token's (its row's tokens count its drafts). The shard keeps the blocks it reserved for
            # the prompt (history) until a window passes them: a windowed model's sequence can hold
            # fewer blocks after the chunk.
            seq.kv = written = kv + len(p.token_ids) + steps - 1
            seq.inflight, seq.flying = step_no, steps
            end = written if written > ntok else ntok
            after = held_blocks(end, kv, bs[shard]) if windowed else -(-end // bs[shard])
            if after > blocks or (windowed and after < blocks):
                grow[sid] = after - blocks
                need[shard] += after - blocks
        return rows

    def unplan(self, rows: Rows) -> None:
        """The rows worked out are not sent: each sequence is back where it was (the step out
        carries every sequence planned ahead)."""
        inflight = self._tables.inflight
        out = max(inflight)
        for p in rows.planned:
            seq = self._tables.running[p.seq_id]
            seq.kv, seq.inflight = rows.marks[p.seq_id].start_pos, out if p.use_last_sample else None
            seq.flying = inflight[out][p.seq_id].steps if p.use_last_sample else 1

    def seal(
        self,
        step_no: int,
        rows: Rows,
        reserve: list[Reservation],
        release: list[tuple[str, int]],
        preempted: list[str],
        ended: list[str],
    ) -> Step:
        """The step: its rows split into the two mini-batches, with the reservations, releases,
        preemptions and ends since the last one; the rows' marks are kept until it is applied."""
        planned = rows.planned
        split = split_mini_batches(row_costs(planned))
        for p, mb in zip(planned, split, strict=True):
            p.mini_batch = mb
        if rows.marks:
            self._tables.inflight[step_no] = rows.marks
        self._tables.step += 1
        return Step(
            step=step_no, seqs=planned, reserve=reserve, release=release, preempted=preempted, ended=ended
        )
