"""SchedulerCore's preemption: when a step's growth does not fit a shard, or a shard refuses a block,
the youngest sequences there give their KV back and queue again at the head; re-admitted, they
re-prefill their token history. Their reservations are released as every leaving sequence's are
(fastdecode/scheduling/releases.py). A step planned ahead whose growth does not fit a shard is not
planned: the step out is applied first, and at that boundary preemption frees blocks in time for the
step it plans. Pure Python, no gRPC."""

from __future__ import annotations

from collections.abc import Sequence

from fastdecode.scheduling.membership import Membership
from fastdecode.scheduling.releases import KVReleases
from fastdecode.scheduling.rows import Rows
from fastdecode.scheduling.tables import RESERVATION_BACKOFF_STEPS, CoreTables, SeqEntry
from fastdecode.scheduling.types import Reservation, Step


class Preemption:
    """SchedulerCore's preemption over the core's tables: the sequences preempted (`preemptions`
    in all, and those since the last step was planned)."""

    def __init__(self, tables: CoreTables, membership: Membership, releases: KVReleases) -> None:
        self._tables = tables
        self._membership = membership
        self._releases = releases
        self.preemptions = 0
        self._preempted: list[str] = []  # preempted since the last step was planned

    def take_preempted(self) -> list[str]:
        """The sequences preempted since the last step was planned (Step.preempted)."""
        preempted, self._preempted = self._preempted, []
        return preempted

    def preempt(self, seq: SeqEntry, reserve: list[Reservation] | None = None) -> None:
        """Free a running sequence's KV and queue it at the head of the waiting queue; re-admitted, it
        re-prefills its token history (its generated tokens are kept)."""
        sid = seq.req.seq_id
        pending = [r for r in reserve or [] if r.seq_id == sid]
        if pending:  # admitted in the step being planned: drop the reservation, nothing to release
            reserve.remove(pending[0])  # type: ignore[union-attr]
        else:
            self._releases.release(seq)
        seq.reserved_on = None
        self._membership.unplace(seq)
        self._membership.requeue(seq)
        self.preemptions += 1
        self._preempted.append(sid)

    def _youngest_on(self, shard: int) -> SeqEntry | None:
        running = self._tables.running
        on = [running[sid] for sid in self._tables.shards[shard].seqs]
        return max(on, key=lambda s: s.started, default=None)

    def kv_exhausted(self, step: Step, seq_ids: Sequence[str]) -> list[str]:
        """A shard had no free block for these sequences of `step` (its Attend answered
        RESOURCE_EXHAUSTED): nothing of their chunk was kept, so they retry it next step, and the
        youngest sequence on each such shard is preempted to make room. Call before apply(); their
        results in this step are ignored. Returns the preempted sequence ids."""
        tables = self._tables
        marks = tables.inflight.get(step.step, {})
        shards: set[int] = set()
        for sid in seq_ids:
            seq, mark = tables.running.get(sid), marks.get(sid)
            if seq is None or mark is None or seq.epoch != mark.epoch or seq.shard is None:
                continue
            if mark.steps == 1:  # (a row run several decode steps may hold what its first steps grew)
                tables.shards[seq.shard].blocks -= seq.blocks - mark.blocks
                seq.blocks = mark.blocks
            seq.kv, seq.inflight = mark.start_pos, None
            seq.epoch += 1  # apply() skips it; the chunk is planned again
            shards.add(seq.shard)
        before = len(self._preempted)
        for shard in sorted(shards):
            victim = self._youngest_on(shard)
            if victim is not None:
                tables.shards[shard].blocked_until = tables.step + RESERVATION_BACKOFF_STEPS
                self.preempt(victim)
        return self._preempted[before:]

    def fit_growth(self, rows: Rows, reserve: list[Reservation]) -> bool:
        """Grow the blocks of this step's sequences (`rows.grow` per sequence, `rows.need` per
        shard: what planning worked out); where a shard lacks blocks, preempt its youngest sequences
        (those planned in this step are taken out of the rows) until the growth fits. False, with
        nothing changed, when a step is still out and the growth does not fit: a victim that step
        carries would free its blocks only after it is applied, too late for this step."""
        planned, marks, grow, need = rows.planned, rows.marks, rows.grow, rows.need
        shards = self._tables.shards
        used = [sh.blocks + r for sh, r in zip(shards, self._releases.releasing(), strict=True)]
        caps = [sh.spec.capacity_tokens // sh.spec.block_size for sh in shards]
        if self._tables.inflight and any(u + n > c for u, n, c in zip(used, need, caps, strict=True)):
            return False
        for i in range(len(shards)):
            while used[i] + need[i] > caps[i]:
                victim = self._youngest_on(i)
                if victim is None:
                    break
                need[i] -= grow.pop(victim.req.seq_id, 0)
                used[i] -= victim.blocks - victim.shared
                marks.pop(victim.req.seq_id, None)
                self.preempt(victim, reserve)
        if len(planned) != len(marks):
            planned[:] = [p for p in planned if p.seq_id in marks]
        running = self._tables.running
        for sid, g in grow.items():  # (only sequences still planned: a preempted one left `grow`)
            running[sid].blocks += g
        for i, g in enumerate(need):
            shards[i].blocks += g
        return True
