"""Live migration, as the core decides it: a draining shard's sequences and rebalancing moves each
copy one sequence's KV to another shard while the others go on; the core picks the target, counts
the copy's blocks on it, and on `end_move` the sequence runs there (or stays, when the copy failed).
The driver runs the copies (fastdecode.scheduling.moves). Pure Python, no gRPC."""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.runtime.errors import FailedPrecondition
from fastdecode.scheduling.load import LoadModel
from fastdecode.scheduling.placement import ShardLoad, choose_shard
from fastdecode.scheduling.prefixes import PrefixPlacement
from fastdecode.scheduling.releases import KVReleases
from fastdecode.scheduling.tables import REBALANCE_COOLDOWN_STEPS, SHARD_DRAINING, CoreTables, SeqEntry


@dataclass(frozen=True)
class Move:
    """A live migration the core has started: copy seq_id's KV from `source` to `target`, then
    `end_move` with the outcome. `tokens` is what the copy carries (the KV the shard holds)."""

    seq_id: str
    source: int
    target: int
    tokens: int
    epoch: int


class MigrationPlanning:
    """SchedulerCore's side of live migration over the core's tables: the copies under way
    (`SeqEntry.moving`/`incoming`, counted on their targets) and the sequences moved (`migrations`)."""

    def __init__(
        self, tables: CoreTables, load: LoadModel, prefixes: PrefixPlacement, releases: KVReleases
    ) -> None:
        self._tables = tables
        self._load = load
        self._prefixes = prefixes
        self._releases = releases
        self.migrations = 0  # sequences moved live to another shard (KV copied, not recomputed)

    def begin_move(self, seq_id: str, target: int) -> Move:
        """Start moving a running sequence's KV to `target` at this step boundary: it is not planned
        until `end_move`, and its blocks count on the target as well meanwhile. FailedPrecondition
        when it cannot move now (in a step, unplaced, already moving, nothing held yet)."""
        seq = self._tables.running_seq(seq_id)
        sh = self._tables.shard(target)
        if seq.shard is None or seq.inflight is not None or seq.moving is not None or seq.kv < 1:
            raise FailedPrecondition(f"sequence {seq_id!r} cannot move now (not at a step boundary)")
        if seq.shard == target or not sh.serving:
            raise FailedPrecondition(f"shard {target} cannot take sequence {seq_id!r}")
        seq.moving = target
        self._tables.parked.discard(seq_id)
        seq.incoming = self._load.held_blocks(seq.kv, seq.kv, sh.spec.block_size)  # a window: only its blocks
        sh.blocks += seq.incoming
        return Move(seq_id, seq.shard, target, seq.kv, seq.epoch)

    def end_move(self, move: Move, ok: bool) -> bool:
        """The copy of `move` finished (ok) or failed. True: the sequence now lives on the target
        (its source copy is released with the next step). False: it stays on its source, whole; a
        copy the target may hold is the caller's to release (also when it was cancelled or lost
        meanwhile, which already undid the move)."""
        seq = self._tables.running.get(move.seq_id)
        if seq is None or seq.epoch != move.epoch or seq.moving != move.target:
            return False
        target = self._tables.shards[move.target]
        if not ok or not target.healthy:
            self.cancel_move(seq)
            return False
        source = self._tables.shards[move.source]
        source.seqs.discard(move.seq_id)
        source.blocks -= seq.blocks - seq.shared  # blocks it read from the source's prefix cache aside
        self._prefixes.forget_pending(seq, source)
        source.blocked_until = 0  # it has room again
        if seq.reserved_on is not None and source.healthy:
            self._releases.send(move.seq_id, seq.reserved_on)
        seq.shard = seq.reserved_on = move.target
        seq.blocks, seq.moving, seq.incoming, seq.shared = seq.incoming, None, 0, 0  # all its own there
        seq.moved_step = self._tables.step
        target.seqs.add(move.seq_id)
        self.migrations += 1
        return True

    def cancel_move(self, seq: SeqEntry) -> None:
        """The sequence's copy under way is dropped (failed, or the sequence left): it stays where it
        is, and the target no longer counts the copy's blocks."""
        if seq.moving is not None:
            self._tables.shards[seq.moving].blocks -= seq.incoming
            seq.moving, seq.incoming = None, 0

    def _target_for(self, seq: SeqEntry, step_no: int, exclude: int) -> int | None:
        """Where placement would put this sequence now (its source left out), or None: no room."""
        horizon = max(1.0, len(seq.req.prompt) + self._load.expected_gen(seq) - len(seq.tokens))
        loads = self._load.loads(step_no, horizon)
        loads[exclude] = ShardLoad(1, 1.0, 1, 0.0, available=False)
        need = self._load.commitment(seq, max(sh.spec.block_size for sh in self._tables.shards))
        return choose_shard(need, self._load.future_load(seq, horizon), loads)

    def drain_moves(self, limit: int) -> tuple[list[Move], dict[int, int]]:
        """Start up to `limit` moves off draining shards (oldest first). Returns them and, per
        draining shard, how many sequences wait there for room (they keep decoding where they are
        until it frees up)."""
        tables = self._tables
        moves: list[Move] = []
        waiting: dict[int, int] = {}
        for i, sh in enumerate(tables.shards):
            if sh.state != SHARD_DRAINING or not sh.healthy:
                continue
            for seq in sorted((tables.running[sid] for sid in sh.seqs), key=lambda s: s.started):
                if seq.moving is not None:
                    continue
                if seq.inflight is not None or seq.kv < 1:
                    self._park(seq)
                    continue  # in a step now, or nothing to copy yet: next boundary
                target = self._target_for(seq, tables.step, i) if len(moves) < limit else None
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
        shards, running, step = self._tables.shards, self._tables.running, self._tables.step
        live = [i for i, sh in enumerate(shards) if sh.serving]
        if len(live) < 2 or any(s.moving is not None for s in running.values()):
            return None
        kv = self._load.kv_tokens_per_shard()
        weight = {i: float(shards[i].spec.capacity_tokens) for i in live}
        mean = sum(kv[i] for i in live) / sum(weight.values())
        if mean <= 0:
            return None
        hot = max(live, key=lambda i: kv[i] / weight[i])
        cool = min(live, key=lambda i: kv[i] / weight[i])
        if kv[hot] / weight[hot] <= factor * mean:
            return None
        cands = []
        for sid in shards[hot].seqs:
            seq = running[sid]
            if seq.kv < 1 or step - seq.moved_step < REBALANCE_COOLDOWN_STEPS:
                continue
            after = max((kv[hot] - seq.kv) / weight[hot], (kv[cool] + seq.kv) / weight[cool])
            if after < kv[hot] / weight[hot]:
                within = (kv[hot] - seq.kv) / weight[hot] <= factor * mean
                cands.append((not within, seq.kv if within else after, sid))
        need = self._load.commitment  # the target must have room for it as placement counts room
        for _, _, sid in sorted(cands):
            seq = running[sid]
            load = self._load.loads(step, 1.0)[cool]
            if load.reserved + need(seq, shards[cool].spec.block_size) <= load.capacity:
                if seq.inflight is not None:  # in a step: it moves at a later step boundary
                    self._park(seq)
                    return None
                return self.begin_move(sid, cool)
        return None

    def _park(self, seq: SeqEntry) -> None:
        """A move wants this sequence at a step boundary: it is not planned ahead until it moves
        (planned ahead step after step, a sequence would never be out of a step)."""
        if seq.inflight is not None:
            self._tables.parked.add(seq.req.seq_id)
