"""Several decode steps per plan (the scheduler's --decode-steps): a row planned for n steps samples,
then runs n-1 more steps, each fed the token the one before sampled, one position further on, as
rows planned one step ahead are (`use_last_sample`). Its tokens come back in the one result
(`Outcome.after`), so the scheduler's work and the step messages are spread over them.

A row stops early only at EOS when it follows a grammar: the grammar is done there, and a mask past
its end would fail the row. Any other row runs its n steps; the scheduler's stop rules drop what
follows a stop. A row that fails in a later step fails whole (its earlier tokens are not kept): the
scheduler recovers it from its history as it would a failed single step. Imports no gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from fastdecode.contract import LAST_SAMPLE, PlannedSeq
from fastdecode.dense.outcome import Outcome, Timings
from fastdecode.dense.runner import StepRunner


async def run_steps(
    runner: StepRunner, seqs: Sequence[PlannedSeq], pipeline: bool = True
) -> tuple[dict[str, Outcome], list[Timings]]:
    """Run a plan whose rows may ask for several decode steps: the outcomes, each step's timings."""
    outcomes, first = await runner.run(seqs, pipeline)
    timings = [first]
    rows = [s for s in seqs if s.steps > 1 and outcomes[s.seq_id].error is None]
    if not rows:
        return outcomes, timings
    eos = frozenset(runner.model.config.eos_token_ids)
    last = dict(runner.last_samples)  # each row's latest token, whichever step sampled it
    prev = {s.seq_id: s for s in rows}
    for j in range(1, max(s.steps for s in rows)):
        nxt: list[PlannedSeq] = []
        for s in rows:
            o = outcomes[s.seq_id]
            tail = o.after[-1] if o.after else o
            if s.steps <= j or o.error is not None or (s.sampling.grammar and tail.token_id in eos):
                continue
            p = prev[s.seq_id]
            q = PlannedSeq(
                s.seq_id,
                s.shard,
                s.mini_batch,
                [LAST_SAMPLE],
                p.start_pos + len(p.token_ids),
                s.sampling,
                True,
                p.sample_index + 1,
                None,
                True,
            )
            prev[s.seq_id] = q
            nxt.append(q)
        if not nxt:
            break
        got, t = await runner.run(nxt, pipeline)
        timings.append(t)
        for q in nxt:
            g = got[q.seq_id]
            if g.error is not None:
                outcomes[q.seq_id] = Outcome(error=g.error)
                last.pop(q.seq_id, None)
            else:
                outcomes[q.seq_id].after.append(g)
                last[q.seq_id] = g.token_id
    runner.last_samples = last
    return outcomes, timings


def summed(timings: Sequence[Timings]) -> Timings:
    """A plan's steps as one: their times added; pipelined when any step was."""
    out = Timings(**{f.name: sum(getattr(t, f.name) for t in timings) for f in fields(Timings)})
    out.pipelined = any(t.pipelined for t in timings)
    return out
