"""SchedulerCore's preemption and KV releases (a mixin over the core's tables): when a step's growth
does not fit a shard, or a shard refuses a block, the youngest sequences there give their KV back
and queue again at the head; a sequence that leaves has its reservation released with the next
step, or, while a step planned ahead still carries it, once that step is applied.

Until its release is sent, the shard still holds a leaving sequence's blocks: gpu_dense may start
the step planned ahead before the scheduler has applied the step before it, so those blocks are
counted against the shard (`_releasing`) and the sequence is not reserved anywhere meanwhile. A
step planned ahead whose growth does not fit a shard is not planned: the step out is applied first,
and at that boundary preemption frees blocks in time for the step it plans."""

from __future__ import annotations

from collections.abc import Sequence

from fastdecode.scheduling.tables import RESERVATION_BACKOFF_STEPS, CoreTables, Inflight, SeqEntry
from fastdecode.scheduling.types import PlannedSeq, Reservation, Step


class Preemption(CoreTables):
    def _preempt(self, seq: SeqEntry, reserve: list[Reservation] | None = None) -> None:
        """Free a running sequence's KV and queue it at the head of the waiting queue; re-admitted, it
        re-prefills its token history (its generated tokens are kept)."""
        sid = seq.req.seq_id
        pending = [r for r in reserve or [] if r.seq_id == sid]
        if pending:  # admitted in the step being planned: drop the reservation, nothing to release
            reserve.remove(pending[0])  # type: ignore[union-attr]
        else:
            self._release(seq)
        seq.reserved_on = None
        self._unplace(seq)
        del self._running[sid]
        self._admission.finished(self._step, sid)
        self._waiting[sid] = seq
        self._waiting.move_to_end(sid, last=False)
        self.preemptions += 1
        self._preempted.append(sid)

    def _youngest_on(self, shard: int) -> SeqEntry | None:
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
            if mark.steps == 1:  # (a row run several decode steps may hold what its first steps grew)
                self._shards[seq.shard].blocks -= seq.blocks - mark.blocks
                seq.blocks = mark.blocks
            seq.kv, seq.inflight = mark.start_pos, None
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
        self,
        planned: list[PlannedSeq],
        marks: dict[str, Inflight],
        reserve: list[Reservation],
        grow: dict[str, int],
        need: list[int],
    ) -> bool:
        """Grow the blocks of this step's sequences (`grow` per sequence, `need` per shard: what the
        planning loop worked out); where a shard lacks blocks, preempt its youngest sequences (those
        planned in this step are taken out of it) until the growth fits. False, with nothing
        changed, when a step is still out and the growth does not fit: a victim that step carries
        would free its blocks only after it is applied, too late for this step."""
        used = [sh.blocks + r for sh, r in zip(self._shards, self._releasing(), strict=True)]
        caps = [sh.spec.capacity_tokens // sh.spec.block_size for sh in self._shards]
        if self._inflight and any(u + n > c for u, n, c in zip(used, need, caps, strict=True)):
            return False
        for i in range(len(self._shards)):
            while used[i] + need[i] > caps[i]:
                victim = self._youngest_on(i)
                if victim is None:
                    break
                need[i] -= grow.pop(victim.req.seq_id, 0)
                used[i] -= victim.blocks - victim.shared
                marks.pop(victim.req.seq_id, None)
                self._preempt(victim, reserve)
        if len(planned) != len(marks):
            planned[:] = [p for p in planned if p.seq_id in marks]
        for sid, g in grow.items():  # (only sequences still planned: a preempted one left `grow`)
            self._running[sid].blocks += g
        for i, g in enumerate(need):
            self._shards[i].blocks += g
        return True

    def _releasing(self) -> list[int]:
        """Blocks each shard still holds for sequences whose release waits for a step out."""
        held = [0] * len(self._shards)
        for waiting in self._held_releases.values():
            for _, shard, blocks in waiting:
                held[shard] += blocks
        return held

    def _release_pending(self, sid: str) -> bool:
        """The sequence's last reservation is not released yet: it may not be reserved again."""
        return any(r[0] == sid for waiting in self._held_releases.values() for r in waiting)

    def _release(self, seq: SeqEntry) -> None:
        """Free the sequence's reservation with the next step, or, while a step carrying it is still
        out (planned ahead), once that step is applied."""
        if seq.reserved_on is None or not self._shards[seq.reserved_on].healthy:
            return
        sid, shard = seq.req.seq_id, seq.reserved_on
        # the latest step out that carries it (at most two are out: planned ahead)
        carrying = max((n for n, marks in self._inflight.items() if sid in marks), default=None)
        if carrying is None:
            self._releases.append((sid, shard))
        else:
            blocks = seq.blocks - seq.shared if seq.shard == shard else 0
            self._held_releases.setdefault(carrying, []).append((sid, shard, blocks))

    def _unhold(self, step_no: int) -> None:
        """Step `step_no` is done with: the releases that waited for it go with the next step."""
        for sid, shard, _ in self._held_releases.pop(step_no, ()):
            if self._shards[shard].healthy:  # (a lost or removed shard has nothing left to free)
                self._releases.append((sid, shard))

    def _drop_releases_on(self, shard: int) -> None:
        """A lost or removed shard has nothing left to free."""
        self._releases = [(sid, i) for sid, i in self._releases if i != shard]
        for step_no, waiting in self._held_releases.items():
            self._held_releases[step_no] = [r for r in waiting if r[1] != shard]
