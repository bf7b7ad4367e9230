"""KV releases in the core: a sequence that leaves its shard (finished, failed, cancelled, preempted,
moved) has its reservation released with the next step, or, while a step planned ahead still carries
it, once that step is applied: a shard fails a whole item that names a sequence it no longer holds.

Until its release is sent, the shard still holds a leaving sequence's blocks: gpu_dense may start
the step planned ahead before the scheduler has applied the step before it, so those blocks are
counted against the shard (`KVReleases.releasing`) and the sequence is not reserved anywhere
meanwhile. Pure Python, no gRPC."""

from __future__ import annotations

from fastdecode.scheduling.tables import CoreTables, SeqEntry


class KVReleases:
    """The reservations to release on the shards: those that go with the next step (`queued`) and
    those held until a step still carrying the sequence is applied (`held`; a shard fails a whole
    item naming a sequence it no longer holds)."""

    def __init__(self, tables: CoreTables) -> None:
        self._tables = tables
        self.queued: list[tuple[str, int]] = []  # (seq_id, shard): released with the next step
        # by the step they wait for: (seq_id, shard, blocks it holds there)
        self.held: dict[int, list[tuple[str, int, int]]] = {}

    def take(self) -> list[tuple[str, int]]:
        """The releases that go with the step being planned (none are left queued)."""
        queued, self.queued = self.queued, []
        return queued

    def send(self, seq_id: str, shard: int) -> None:
        """Release seq_id's reservation on `shard` with the next step."""
        self.queued.append((seq_id, shard))

    def releasing(self) -> list[int]:
        """Blocks each shard still holds for sequences whose release waits for a step out."""
        held = [0] * len(self._tables.shards)
        for waiting in self.held.values():
            for _, shard, blocks in waiting:
                held[shard] += blocks
        return held

    def pending(self, sid: str) -> bool:
        """The sequence's last reservation is not released yet: it may not be reserved again."""
        return any(r[0] == sid for waiting in self.held.values() for r in waiting)

    def release(self, seq: SeqEntry) -> None:
        """Free the sequence's reservation with the next step, or, while a step carrying it is still
        out (planned ahead), once that step is applied."""
        shards = self._tables.shards
        if seq.reserved_on is None or not shards[seq.reserved_on].healthy:
            return
        sid, shard = seq.req.seq_id, seq.reserved_on
        # the latest step out that carries it (at most two are out: planned ahead)
        inflight = self._tables.inflight
        carrying = max((n for n, marks in inflight.items() if sid in marks), default=None)
        if carrying is None:
            self.queued.append((sid, shard))
        else:
            blocks = seq.blocks - seq.shared if seq.shard == shard else 0
            self.held.setdefault(carrying, []).append((sid, shard, blocks))

    def unhold(self, step_no: int) -> None:
        """Step `step_no` is done with: the releases that waited for it go with the next step."""
        shards = self._tables.shards
        for sid, shard, _ in self.held.pop(step_no, ()):
            if shards[shard].healthy:  # (a lost or removed shard has nothing left to free)
                self.queued.append((sid, shard))

    def drop_on(self, shard: int) -> None:
        """A lost or removed shard has nothing left to free."""
        self.queued = [(sid, i) for sid, i in self.queued if i != shard]
        for step_no, waiting in self.held.items():
            self.held[step_no] = [r for r in waiting if r[1] != shard]
