"""Shard membership in the core: shards added, lost, recovered, refusing reservations, drained and
removed, and the admission policy told the KV capacity of those that serve. Pure Python, no gRPC."""

from __future__ import annotations

from fastdecode.runtime.errors import FailedPrecondition, InvalidInput
from fastdecode.scheduling.admission import AdmissionPolicy
from fastdecode.scheduling.migration import MigrationPlanning
from fastdecode.scheduling.prefixes import PrefixPlacement
from fastdecode.scheduling.releases import KVReleases
from fastdecode.scheduling.tables import (
    RESERVATION_BACKOFF_STEPS,
    SHARD_DRAINING,
    SHARD_REMOVED,
    SHARD_SERVING,
    CoreTables,
    SeqEntry,
    ShardEntry,
)
from fastdecode.scheduling.types import ShardSpec


class Membership:
    """SchedulerCore's shard membership over the core's tables: each shard's health and state
    (serving, draining, removed) and the sequences that lost their shard (`recoveries`)."""

    def __init__(
        self,
        tables: CoreTables,
        admission: AdmissionPolicy,
        migration: MigrationPlanning,
        prefixes: PrefixPlacement,
        releases: KVReleases,
    ) -> None:
        self._tables = tables
        self._admission = admission
        self._migration = migration
        self._prefixes = prefixes
        self._releases = releases
        self.recoveries = 0  # sequences moved off a lost shard to be re-prefilled
        self.recovered_tokens = 0  # ... and the tokens of history they re-prefill

    def add_shard(self, spec: ShardSpec) -> int:
        """Add a shard; it takes its share of new sequences from now on."""
        if spec.capacity_tokens < 1 or not spec.speed > 0 or spec.block_size < 1:
            raise InvalidInput("a shard needs capacity_tokens >= 1, speed > 0 and block_size >= 1")
        self._tables.shards.append(ShardEntry(spec=spec))
        self.capacity_changed()
        return len(self._tables.shards) - 1

    def capacity_changed(self) -> None:
        """Tell the admission policy how many KV tokens the healthy shards hold: the stabilizing
        schedule keeps its load limit within them (the paper's memory bound B*S/2 <= C*P)."""
        self._admission.set_kv_capacity(
            sum(sh.spec.capacity_tokens for sh in self._tables.shards if sh.serving) or None
        )

    def shard_lost(self, shard: int) -> list[str]:
        """Mark a shard unhealthy; its sequences will be re-placed and re-prefilled from their history.

        Call it before apply() of a step that failed because of this shard: results of the moved
        sequences are then ignored and their generated tokens kept, so the request only loses time.
        """
        sh = self._tables.shard(shard)
        if not sh.healthy and not sh.suspended:
            return []
        sh.healthy, sh.suspended = False, False
        running = self._tables.running
        for s in running.values():
            if s.moving == shard:  # its copy died with the target: it stays where it is
                s.moving, s.incoming = None, 0
        moved = [sid for sid, s in running.items() if s.shard == shard]
        self.recovered_tokens += sum(len(running[sid].tokens) for sid in moved)
        for sid in moved:
            self.unplace(running[sid])
        sh.blocks, sh.seqs = 0, set()
        self._prefixes.clear(sh)
        self._releases.drop_on(shard)
        self.recoveries += len(moved)
        self.capacity_changed()
        return moved

    def shard_suspended(self, shard: int) -> list[str]:
        """The shard is lost but its KV pool outlives its process: its sequences stay placed and are
        not planned until shard_resumed (or shard_lost, when the wait ends). Each rolls back to the
        first position a step in flight was writing, and that step's results are ignored (epoch)."""
        sh = self._tables.shard(shard)
        if not sh.healthy:
            return []
        sh.healthy, sh.suspended = False, True
        running, inflight = self._tables.running, self._tables.inflight.values()
        for s in running.values():
            if s.moving == shard:  # its copy died with the target: it stays where it is
                s.moving, s.incoming = None, 0
        held = [sid for sid, s in running.items() if s.shard == shard]
        for sid in held:
            s = running[sid]
            self._migration.cancel_move(s)
            self._tables.parked.discard(sid)
            starts = [m[sid].start_pos for m in inflight if sid in m and m[sid].epoch == s.epoch]
            s.kv = min([s.kv, *starts])
            s.inflight, s.epoch = None, s.epoch + 1
        self._releases.drop_on(shard)
        self.capacity_changed()
        return held

    def shard_resumed(self, shard: int, positions: dict[str, int]) -> tuple[list[str], int]:
        """A suspended shard re-attached its pool: each of its sequences it still holds resumes at
        min(what it holds, what we sent); the others lose it and are re-prefilled. Returns the
        resumed ids and the positions below our own count that must be computed again (a
        sequence it lost: its whole history)."""
        sh = self._tables.shard(shard)
        if not sh.suspended:
            return [], 0
        sh.suspended, sh.healthy, sh.blocked_until = False, True, 0
        running, resumed, again = self._tables.running, [], 0
        for sid in sorted(sh.seqs):
            s = running.get(sid)
            if s is None:
                continue
            held = positions.get(sid, 0)
            if held <= 0:  # not held (or nothing of it): recomputed from its history, anywhere
                self.recovered_tokens += len(s.tokens)
                again += len(s.tokens)
                self.unplace(s)
                self.recoveries += 1
                continue
            again += max(0, s.kv - held)
            s.kv = min(s.kv, held)
            resumed.append(sid)
        self.capacity_changed()
        return resumed, again

    def set_speed(self, shard: int, speed: float) -> None:
        """Update a shard's measured relative attention speed (> 0); placement weighs by it."""
        if not speed > 0:
            raise InvalidInput("speed must be > 0")
        self._tables.shard(shard).spec.speed = speed

    def shard_recovered(self, shard: int) -> None:
        """The shard is healthy again, and empty: it takes new sequences."""
        sh = self._tables.shard(shard)
        if sh.state == SHARD_REMOVED:
            return
        sh.healthy, sh.blocks, sh.seqs, sh.blocked_until = True, 0, set(), 0
        self._prefixes.clear(sh)
        self.capacity_changed()

    def drain_shard(self, shard: int) -> None:
        """Stop placing on the shard; `MigrationPlanning.drain_moves` then moves its sequences away
        as room allows."""
        sh = self._tables.shard(shard)
        if sh.state == SHARD_REMOVED:
            raise FailedPrecondition(f"shard {shard} is already removed")
        if sh.state != SHARD_DRAINING:
            if not any(o.serving for o in self._tables.shards if o is not sh):
                raise FailedPrecondition(f"shard {shard} is the last serving shard: nowhere to move to")
            sh.state, sh.left_by_recompute = SHARD_DRAINING, 0
            self.capacity_changed()

    def drained(self, shard: int) -> bool:
        """No sequence on it and none in a step or a copy there: it can be taken out."""
        sh = self._tables.shard(shard)
        return not sh.seqs and not any(s.moving == shard for s in self._tables.running.values())

    def remove_shard(self, shard: int) -> None:
        """Take a drained (or lost) shard out for good: never placed on, probed or recovered again."""
        sh = self._tables.shard(shard)
        if sh.seqs and sh.healthy:
            raise FailedPrecondition(f"shard {shard} still holds {len(sh.seqs)} sequences")
        sh.state, sh.healthy, sh.blocks, sh.seqs = SHARD_REMOVED, False, 0, set()
        self._prefixes.clear(sh)
        self._releases.drop_on(shard)
        self.capacity_changed()

    def shard_rejoined(self, shard: int) -> None:
        """A removed shard is back (empty, a restarted process on its address): it serves again."""
        sh = self._tables.shard(shard)
        sh.state, sh.healthy, sh.blocks, sh.seqs, sh.blocked_until = SHARD_SERVING, True, 0, set(), 0
        self._prefixes.clear(sh)
        self.capacity_changed()

    def shard_state(self, shard: int) -> str:
        return self._tables.shard(shard).state

    def seqs_on(self, shard: int) -> list[str]:
        return sorted(self._tables.shard(shard).seqs)

    def left_by_recompute(self, shard: int) -> int:
        """Sequences that left the shard since its drain began by recompute (lost, preempted)."""
        return self._tables.shard(shard).left_by_recompute

    def reservation_failed(self, seq_id: str) -> None:
        """The shard refused the reservation: un-place the sequence and put it back at the head.

        A sequence with no generated token goes back to the waiting queue (admission sees it again);
        one being recovered stays admitted and is re-placed first. Drop it from the step you are about
        to run (`step.without([seq_id])`); a result for it would be ignored anyway.
        """
        tables = self._tables
        seq = tables.running_seq(seq_id)
        if seq.shard is not None:
            tables.shards[seq.shard].blocked_until = tables.step + RESERVATION_BACKOFF_STEPS
        seq.reserved_on = None  # nothing to release: the shard holds nothing for it
        self.unplace(seq)
        if seq.generated == 0:
            self.requeue(seq)

    def requeue(self, seq: SeqEntry) -> None:
        """An unplaced running sequence goes back to the head of the waiting queue."""
        sid, tables = seq.req.seq_id, self._tables
        del tables.running[sid]
        self._admission.finished(tables.step, sid)
        tables.waiting[sid] = seq
        tables.waiting.move_to_end(sid, last=False)

    def unplace(self, seq: SeqEntry) -> None:
        """The sequence loses its shard (lost, refused, preempted): nothing of its KV is counted."""
        self._migration.cancel_move(seq)
        self._tables.parked.discard(seq.req.seq_id)
        if seq.shard is not None:
            sh = self._tables.shards[seq.shard]
            sh.seqs.discard(seq.req.seq_id)
            sh.blocks -= seq.blocks - seq.shared
            self._prefixes.forget_pending(seq, sh)
            sh.left_by_recompute += sh.state == SHARD_DRAINING
        seq.shard, seq.reserved_on, seq.kv, seq.inflight, seq.blocks = None, None, 0, None, 0
        seq.shared = 0
        seq.epoch += 1
