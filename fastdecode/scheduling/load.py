"""The core's load model: how long a sequence is expected to run (max_tokens scaled by the running
generated/max_tokens ratio), the KV it commits (its blocks plus the headroom for `kv_lookahead`
steps), each shard's load over a horizon, where a new sequence goes (placement.choose_shard), and
the counts and per-shard load the core reports (stats). Pure Python, no gRPC."""

from __future__ import annotations

import math
from typing import Literal

from fastdecode.scheduling.placement import ShardLoad, choose_shard
from fastdecode.scheduling.tables import CoreTables, SeqEntry
from fastdecode.scheduling.types import Reservation, SchedulerStats, ShardStats


class LoadModel(CoreTables):
    """SchedulerCore's load model (a mixin over the core's tables)."""

    def _held_blocks(self, end: int, start: int, block_size: int) -> int:
        """Blocks a sequence holds while computing positions start..end-1 (as its shard allocates:
        a windowed layer gives back what the query at `start` no longer sees)."""
        if self._geometry is None:
            return -(-end // block_size)
        return self._geometry.held_blocks(end, start, block_size)

    def _held(self, tokens: float) -> float:
        """KV tokens a sequence of `tokens` holds (and attends over): fewer with windowed layers."""
        return tokens if self._geometry is None else self._geometry.held_tokens(int(tokens))

    def _expected_gen(self, seq: SeqEntry) -> float:
        mt = seq.req.max_tokens
        return float(min(mt, max(seq.generated + 1, self._ratio * mt)))

    def _future_load(self, seq: SeqEntry, horizon: float) -> float:
        """Mean KV tokens the sequence holds over the next `horizon` steps (it grows by one a step and
        is gone after its expected end)."""
        now = len(seq.tokens)
        h = min(max(0.0, len(seq.req.prompt) + self._expected_gen(seq) - now), horizon)
        return h * self._held(now + h / 2) / horizon

    def _headroom(self, seq: SeqEntry) -> int:
        """Tokens the sequence is expected to add over the next kv_lookahead steps: one a step, until
        its expected end (max_tokens scaled by the running generated/max_tokens ratio)."""
        left = len(seq.req.prompt) + self._expected_gen(seq) - len(seq.tokens)
        return int(min(self._lookahead, max(0, math.ceil(left))))

    def _commitment(self, seq: SeqEntry, block_size: int) -> int:
        """KV tokens a sequence counts against its shard: its blocks, or its history plus headroom
        rounded up to whole blocks when that is more (blocks it reads from the prefix cache aside)."""
        end = len(seq.tokens) + self._headroom(seq)  # a windowed layer holds the most at the end
        grown = self._held_blocks(end, end - 1, block_size) * block_size
        return max(seq.blocks * block_size, grown) - seq.shared * block_size

    def _loads(self, step_no: int, horizon: float) -> list[ShardLoad]:
        load = [0.0] * len(self._shards)
        # blocks a shard holds for sequences whose release waits for a step out count as taken
        committed = [r * sh.spec.block_size for r, sh in zip(self._releasing(), self._shards, strict=True)]
        for seq in self._running.values():
            if seq.shard is not None:
                load[seq.shard] += self._future_load(seq, horizon)
                committed[seq.shard] += self._commitment(seq, self._shards[seq.shard].spec.block_size)
            if seq.moving is not None:  # a copy under way holds its room on the target too
                committed[seq.moving] += seq.incoming * self._shards[seq.moving].spec.block_size
        return [
            ShardLoad(
                capacity=sh.spec.capacity_tokens,
                speed=sh.spec.speed,
                reserved=committed[i],
                load=load[i],
                available=self._serving(sh) and sh.blocked_until <= step_no,
            )
            for i, sh in enumerate(self._shards)
        ]

    def _place(
        self, seq: SeqEntry, step_no: int, reserve: list[Reservation], may_wait: bool = False
    ) -> bool | None | Literal["wait"]:
        """Place on the shard with the least load over the new sequence's expected life (what it will
        share the shard with), weighted by speed and capacity, or the one holding its longest cached
        prefix when the balance allows. False: no room now; None: no healthy shard could ever hold
        it; "wait" (only with may_wait): its prefix is being computed on the shard it would go to."""
        horizon = max(1.0, len(seq.req.prompt) + self._expected_gen(seq) - len(seq.tokens))
        loads = self._loads(step_no, horizon)
        need = self._commitment(seq, max(sh.spec.block_size for sh in self._shards))
        matches = [self._prefix_match(seq, j) for j in range(len(self._shards))]
        cached = [r * sh.spec.block_size for (r, _), sh in zip(matches, self._shards, strict=True)]
        i = self._whole_prefix_shard(seq, need, loads, matches)
        if i is None:
            i = choose_shard(need, self._future_load(seq, horizon), loads, cached, self._affinity)
        if i is None:
            return False if any(s.available and need <= s.capacity for s in loads) else None
        if may_wait and matches[i][1] > matches[i][0]:
            return "wait"
        sh = self._shards[i]
        held = len(seq.tokens)  # the prompt, or the history a preempted / moved sequence recomputes
        seq.blocks = -(-held // sh.spec.block_size)
        sh.blocks += seq.blocks
        sh.seqs.add(seq.req.seq_id)
        seq.shard, seq.reserved_on, seq.kv = i, i, 0
        ids = list(seq.tokens) if self._shares(seq) else []
        reserve.append(
            Reservation(
                seq_id=seq.req.seq_id, shard=i, max_tokens=held, token_ids=ids, cache_salt=seq.req.cache_salt
            )
        )
        if self._shares(seq):
            names = self._names(seq, sh.spec.block_size)
            seq.claimed = len(names)  # only these can name it as their owner (_prefix_ready)
            for h in names:  # it will hold them once its prefill is in (those it finds cached, at once)
                if h in sh.prefixes:
                    sh.prefixes.move_to_end(h)
                else:
                    sh.prefixes[h] = seq.req.seq_id
            while len(sh.prefixes) > sh.spec.capacity_tokens // sh.spec.block_size:
                sh.prefixes.popitem(last=False)
        return True

    def kv_tokens_per_shard(self) -> list[int]:
        """KV tokens each shard holds now (planned chunks included)."""
        out = [0] * len(self._shards)
        if self._geometry is None:
            for seq in self._running.values():
                if seq.shard is not None:
                    out[seq.shard] += seq.kv
            return out
        for seq in self._running.values():
            if seq.shard is not None:
                out[seq.shard] += round(self._held(seq.kv))
        return out

    def stats(self, loads: bool = True) -> SchedulerStats:
        """Counts and per-shard load (the scheduler's GetStats and its metrics). `loads=False` leaves
        out the per-sequence load model (each shard's expected and committed tokens are None): the
        metrics, reported every step, do not show it, and it is most of the cost over many sequences."""
        tokens = self.kv_tokens_per_shard()
        expected: list[float | None] = [None] * len(self._shards)
        committed: list[int | None] = [None] * len(self._shards)
        if loads:
            expected, committed = [0.0] * len(self._shards), [0] * len(self._shards)
            block = [sh.spec.block_size for sh in self._shards]
            expected_gen, commitment = self._expected_gen, self._commitment
            for seq in self._running.values():
                i = seq.shard
                if i is not None:
                    expected[i] += len(seq.req.prompt) + expected_gen(seq)  # type: ignore[operator]
                    committed[i] += commitment(seq, block[i])  # type: ignore[operator]
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            steps=self._step,
            finished=self._finished,
            recoveries=self._recoveries,
            preemptions=self.preemptions,
            admission=getattr(self._admission, "name", type(self._admission).__name__),
            w_limit=self._admission.w_limit(self._step),
            kv_load_tokens=float(sum(tokens)),
            expected_ratio=self._ratio,
            shards=[
                ShardStats(
                    shard=i,
                    healthy=sh.healthy,
                    sequences=len(sh.seqs),
                    tokens=tokens[i],
                    expected_tokens=None if (e := expected[i]) is None else int(round(e)),
                    reserved_tokens=sh.blocks * sh.spec.block_size,
                    committed_tokens=committed[i],
                    capacity_tokens=sh.spec.capacity_tokens,
                    block_size=sh.spec.block_size,
                    speed=sh.spec.speed,
                    state=sh.state,
                )
                for i, sh in enumerate(self._shards)
            ],
            migrations=self.migrations,
        )
