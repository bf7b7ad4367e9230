"""The core's load model: how long a sequence is expected to run (max_tokens scaled by the running
generated/max_tokens ratio), the KV it commits (its blocks plus the headroom for `kv_lookahead`
steps), each shard's load over a horizon, where a new sequence goes (placement.choose_shard), and
the per-shard load the core reports (SchedulerCore.stats). Pure Python, no gRPC."""

from __future__ import annotations

import math
from typing import Literal

from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.placement import ShardLoad, choose_shard
from fastdecode.scheduling.prefixes import PrefixPlacement
from fastdecode.scheduling.releases import KVReleases
from fastdecode.scheduling.tables import RATIO_SMOOTHING, CoreTables, SeqEntry
from fastdecode.scheduling.types import Reservation, ShardStats


class LoadModel:
    """SchedulerCore's load model over the core's tables: the running generated/max_tokens ratio
    (`ratio`), the headroom horizon (`lookahead`), a windowed model's geometry; placement."""

    def __init__(
        self,
        tables: CoreTables,
        releases: KVReleases,
        prefixes: PrefixPlacement,
        *,
        geometry: KVGeometry | None,
        lookahead: int,
    ) -> None:
        self._tables = tables
        self._releases = releases
        self._prefixes = prefixes
        # windowed layers (the model's geometry): a sequence holds, and attends over, less than its
        # length; without windows (None) every count below is the sequence's length
        self.geometry = geometry
        self.lookahead = lookahead  # steps of growth a sequence's commitment has room for
        self.ratio = 1.0  # running estimate of generated / max_tokens

    def finished(self, generated: int, max_tokens: int) -> None:
        """A sequence stopped after `generated` of its max_tokens: the running ratio follows it."""
        self.ratio += RATIO_SMOOTHING * (generated / max_tokens - self.ratio)

    def held_blocks(self, end: int, start: int, block_size: int) -> int:
        """Blocks a sequence holds while computing positions start..end-1 (as its shard allocates:
        a windowed layer gives back what the query at `start` no longer sees)."""
        if self.geometry is None:
            return -(-end // block_size)
        return self.geometry.held_blocks(end, start, block_size)

    def held(self, tokens: float) -> float:
        """KV tokens a sequence of `tokens` holds (and attends over): fewer with windowed layers."""
        return tokens if self.geometry is None else self.geometry.held_tokens(int(tokens))

    def expected_gen(self, seq: SeqEntry) -> float:
        mt = seq.req.max_tokens
        return float(min(mt, max(seq.generated + 1, self.ratio * mt)))

    def future_load(self, seq: SeqEntry, horizon: float) -> float:
        """Mean KV tokens the sequence holds over the next `horizon` steps (it grows by one a step and
        is gone after its expected end)."""
        now = len(seq.tokens)
        h = min(max(0.0, len(seq.req.prompt) + self.expected_gen(seq) - now), horizon)
        return h * self.held(now + h / 2) / horizon

    def headroom(self, seq: SeqEntry) -> int:
        """Tokens the sequence is expected to add over the next kv_lookahead steps: one a step, until
        its expected end (max_tokens scaled by the running generated/max_tokens ratio)."""
        left = len(seq.req.prompt) + self.expected_gen(seq) - len(seq.tokens)
        return int(min(self.lookahead, max(0, math.ceil(left))))

    def commitment(self, seq: SeqEntry, block_size: int) -> int:
        """KV tokens a sequence counts against its shard: its blocks, or its history plus headroom
        rounded up to whole blocks when that is more (blocks it reads from the prefix cache aside)."""
        end = len(seq.tokens) + self.headroom(seq)  # a windowed layer holds the most at the end
        grown = self.held_blocks(end, end - 1, block_size) * block_size
        return max(seq.blocks * block_size, grown) - seq.shared * block_size

    def loads(self, step_no: int, horizon: float) -> list[ShardLoad]:
        """Each shard as placement sees it: its capacity and speed, the KV its sequences commit and
        their mean load over the next `horizon` steps, and whether it takes a sequence now."""
        shards = self._tables.shards
        load = [0.0] * len(shards)
        # blocks a shard holds for sequences whose release waits for a step out count as taken
        releasing = self._releases.releasing()
        committed = [r * sh.spec.block_size for r, sh in zip(releasing, shards, strict=True)]
        for seq in self._tables.running.values():
            if seq.shard is not None:
                load[seq.shard] += self.future_load(seq, horizon)
                committed[seq.shard] += self.commitment(seq, shards[seq.shard].spec.block_size)
            if seq.moving is not None:  # a copy under way holds its room on the target too
                committed[seq.moving] += seq.incoming * shards[seq.moving].spec.block_size
        return [
            ShardLoad(
                capacity=sh.spec.capacity_tokens,
                speed=sh.spec.speed,
                reserved=committed[i],
                load=load[i],
                available=sh.serving and sh.blocked_until <= step_no,
            )
            for i, sh in enumerate(shards)
        ]

    def place(
        self, seq: SeqEntry, step_no: int, reserve: list[Reservation], may_wait: bool = False
    ) -> bool | None | Literal["wait"]:
        """Place on the shard with the least load over the new sequence's expected life (what it will
        share the shard with), weighted by speed and capacity, or the one holding its longest cached
        prefix when the balance allows. False: no room now; None: no healthy shard could ever hold
        it; "wait" (only with may_wait): its prefix is being computed on the shard it would go to."""
        shards, prefixes = self._tables.shards, self._prefixes
        horizon = max(1.0, len(seq.req.prompt) + self.expected_gen(seq) - len(seq.tokens))
        loads = self.loads(step_no, horizon)
        need = self.commitment(seq, max(sh.spec.block_size for sh in shards))
        matches = [prefixes.match(seq, j) for j in range(len(shards))]
        cached = [r * sh.spec.block_size for (r, _), sh in zip(matches, shards, strict=True)]
        i = prefixes.whole_prefix_shard(seq, need, loads, matches)
        if i is None:
            i = choose_shard(need, self.future_load(seq, horizon), loads, cached, prefixes.affinity)
        if i is None:
            return False if any(s.available and need <= s.capacity for s in loads) else None
        if may_wait and matches[i][1] > matches[i][0]:
            return "wait"
        sh = shards[i]
        held = len(seq.tokens)  # the prompt, or the history a preempted / moved sequence recomputes
        seq.blocks = -(-held // sh.spec.block_size)
        sh.blocks += seq.blocks
        sh.seqs.add(seq.req.seq_id)
        seq.shard, seq.reserved_on, seq.kv = i, i, 0
        shares = prefixes.shares(seq)
        ids = list(seq.tokens) if shares else []
        reserve.append(
            Reservation(
                seq_id=seq.req.seq_id, shard=i, max_tokens=held, token_ids=ids, cache_salt=seq.req.cache_salt
            )
        )
        if shares:
            prefixes.claim(seq, sh)
        return True

    def kv_tokens_per_shard(self) -> list[int]:
        """KV tokens each shard holds now (planned chunks included)."""
        out = [0] * len(self._tables.shards)
        if self.geometry is None:
            for seq in self._tables.running.values():
                if seq.shard is not None:
                    out[seq.shard] += seq.kv
            return out
        for seq in self._tables.running.values():
            if seq.shard is not None:
                out[seq.shard] += round(self.held(seq.kv))
        return out

    def shard_stats(self, loads: bool = True) -> list[ShardStats]:
        """Each shard's load (SchedulerCore.stats). `loads=False` leaves out the per-sequence load
        model (each shard's expected and committed tokens are None): the metrics, reported every
        step, do not show it, and it is most of the cost over many sequences."""
        shards = self._tables.shards
        tokens = self.kv_tokens_per_shard()
        expected: list[float | None] = [None] * len(shards)
        committed: list[int | None] = [None] * len(shards)
        if loads:
            expected, committed = [0.0] * len(shards), [0] * len(shards)
            block = [sh.spec.block_size for sh in shards]
            expected_gen, commitment = self.expected_gen, self.commitment
            for seq in self._tables.running.values():
                i = seq.shard
                if i is not None:
                    expected[i] += len(seq.req.prompt) + expected_gen(seq)  # type: ignore[operator]
                    committed[i] += commitment(seq, block[i])  # type: ignore[operator]
        return [
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
            for i, sh in enumerate(shards)
        ]
