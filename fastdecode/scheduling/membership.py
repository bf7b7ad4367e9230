"""Shard membership in the core: shards added, lost, recovered, refusing reservations, and the
admission policy told the KV capacity of those that serve. Pure Python, no gRPC."""

from __future__ import annotations

from fastdecode.runtime.errors import InvalidInput, NotFound
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


class Membership(CoreTables):
    """SchedulerCore's shard membership (a mixin over the core's tables)."""

    def add_shard(self, spec: ShardSpec) -> int:
        """Add a shard; it takes its share of new sequences from now on."""
        if spec.capacity_tokens < 1 or not spec.speed > 0 or spec.block_size < 1:
            raise InvalidInput("a shard needs capacity_tokens >= 1, speed > 0 and block_size >= 1")
        self._shards.append(ShardEntry(spec=spec))
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
    def _serving(sh: ShardEntry) -> bool:
        return sh.healthy and sh.state == SHARD_SERVING

    def _shard(self, shard: int) -> ShardEntry:
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
        self._drop_releases_on(shard)
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

    def _unplace(self, seq: SeqEntry) -> None:
        self._cancel_move(seq)
        self._parked.discard(seq.req.seq_id)
        if seq.shard is not None:
            sh = self._shards[seq.shard]
            sh.seqs.discard(seq.req.seq_id)
            sh.blocks -= seq.blocks - seq.shared
            self._forget_pending(seq, sh)
            sh.left_by_recompute += sh.state == SHARD_DRAINING
        seq.shard, seq.reserved_on, seq.kv, seq.inflight, seq.blocks = None, None, 0, None, 0
        seq.shared = 0
        seq.epoch += 1
