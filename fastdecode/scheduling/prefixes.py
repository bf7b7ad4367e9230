"""Prefix placement: the core's names for a sequence's full prompt blocks, which prefix blocks each
shard holds or is computing, the shard with the longest match, and a request that waits for a prefix
being computed right now instead of computing it again (see fastdecode/scheduling/core.py). Pure
Python, no gRPC."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from fastdecode.contract import chain_hashes
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.scheduling.placement import ShardLoad
from fastdecode.scheduling.tables import NAME_SEED, CoreTables, SeqEntry, ShardEntry
from fastdecode.scheduling.types import Step


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """Full blocks of one sequence that a shard now holds: `names[i]` for i in `blocks` (ascending),
    block i holding `tokens[i * block_size:(i + 1) * block_size]`. `tokens` and `names` are the
    sequence's own lists: read them in the callback, do not keep them."""

    shard: int
    tokens: Sequence[int]
    names: Sequence[bytes]  # the names of every full block of the sequence, from its first
    blocks: list[int]
    block_size: int
    salt: str  # the request's cache salt ("" without one)


class PrefixListener(Protocol):
    """Told of the prefix registry's changes (the KV events adapter publishes them): blocks a shard
    holds ready, and blocks it no longer holds (evicted from the registry, or the shard lost,
    recovered empty or removed). Called synchronously from the step loop: be quick."""

    def stored(self, blocks: StoredBlocks) -> None: ...

    def removed(self, shard: int, names: list[bytes]) -> None: ...


class PrefixPlacement:
    """SchedulerCore's prefix placement over the core's tables: which prefix blocks each shard holds
    or is computing (`ShardEntry.prefixes`, `SeqEntry.names`/`claimed`), and the reservations that
    found cached tokens (`prefix_hits`, `cached_tokens`)."""

    def __init__(
        self, tables: CoreTables, *, sharing: bool, affinity: float, geometry: KVGeometry | None
    ) -> None:
        self._tables = tables
        self.sharing = sharing
        self.affinity = affinity  # how much longer a prefix placement weighs against balance
        self._geometry = geometry  # a windowed model's geometry (None: every layer full)
        self.prefix_hits = 0  # reservations that found cached prefix tokens
        self.cached_tokens = 0  # ... and how many, in all
        self.listener: PrefixListener | None = None  # told of stores and removals (--kv-events)

    def names(self, seq: SeqEntry, block_size: int) -> list[bytes]:
        """Names of the full blocks of the sequence's tokens (as a shard names them, locally seeded).
        Tokens are only ever appended, so a name once computed stays right: only blocks filled since
        are hashed (one a block, not the whole history every step)."""
        n = len(seq.tokens)
        if seq.names is not None and seq.names[0] == block_size and seq.names[1] <= n:
            _, covered, names = seq.names
            if n // block_size == covered // block_size:
                if covered != n:
                    seq.names = (block_size, n, names)
                return names
            if names:  # the chain goes on from the last name
                more = chain_hashes(names[-1], seq.tokens[len(names) * block_size :], block_size)
                seq.names = (block_size, n, names + more)
                return seq.names[2]
        seed = NAME_SEED + seq.req.cache_salt.encode()  # another salt's blocks never match
        seq.names = (block_size, n, chain_hashes(seed, seq.tokens, block_size))
        return seq.names[2]

    def shares(self, seq: SeqEntry) -> bool:
        """Whether the sequence takes part in prefix sharing. Not when gpu_dense must see its whole
        prompt: prompt logprobs score every prompt position at prefill, and penalties and grammars
        keep the token history on the dense side (as vLLM skips its prefix cache for prompt logprobs)."""
        sp = seq.req.sampling
        return self.sharing and not (sp.prompt_logprobs or sp.needs_history)

    def match(self, seq: SeqEntry, shard: int) -> tuple[int, int]:
        """(blocks ready, blocks ready or being computed) of the sequence's prefix on a shard, of
        those a shard would share (the block of its last token is always its own)."""
        sh = self._tables.shards[shard]
        if not self.shares(seq) or not sh.healthy or not sh.prefixes:
            return 0, 0
        bs = sh.spec.block_size
        ready = known = 0
        for h in self.names(seq, bs)[: (len(seq.tokens) - 1) // bs]:
            owner = sh.prefixes.get(h, False)
            if owner is False or owner == seq.req.seq_id:
                break
            known += 1
            ready += owner is None and ready == known - 1
        return ready, known

    def whole_prefix_shard(
        self, seq: SeqEntry, need: int, loads: list[ShardLoad], matches: list[tuple[int, int]]
    ) -> int | None:
        """The shard holding ready every block the sequence could share (all of its prompt but the
        last token's block), when it has room: a copy of a prompt (the n choices of one OpenAI
        request) goes where its KV is, as a fork would, instead of computing it again on an emptier
        shard. Requests that share only a system prompt differ in later blocks: balance places them."""
        if not self.shares(seq) or self.affinity <= 0:
            return None
        for j, ((ready, _), sh) in enumerate(zip(matches, self._tables.shards, strict=True)):
            s = loads[j]
            whole = (len(seq.tokens) - 1) // sh.spec.block_size
            if ready and ready == whole and s.available and s.reserved + need <= s.capacity:
                return j
        return None

    def awaits(self, seq: SeqEntry) -> bool:
        """Its prefix is being computed on a shard right now and no shard holds as much of it ready:
        waiting the few steps of that prefill beats computing and storing it a second time."""
        if not self.shares(seq):
            return False
        matches = [self.match(seq, j) for j in range(len(self._tables.shards))]
        return max(k for _, k in matches) > max(r for r, _ in matches)

    def claim(self, seq: SeqEntry, sh: ShardEntry) -> None:
        """The sequence was just placed on `sh`: it will hold its prefix blocks once its prefill is
        in (those it finds cached, at once), and is computing those no one else is (it claims them)."""
        names = self.names(seq, sh.spec.block_size)
        seq.claimed = len(names)  # only these can name it as their owner (ready)
        for h in names:
            if h in sh.prefixes:
                sh.prefixes.move_to_end(h)
            else:
                sh.prefixes[h] = seq.req.seq_id
        gone: list[bytes] = []
        while len(sh.prefixes) > sh.spec.capacity_tokens // sh.spec.block_size:
            h, owner = sh.prefixes.popitem(last=False)
            if owner is None:  # a block being computed was never announced as held
                gone.append(h)
        if gone and self.listener is not None:
            self.listener.removed(self._index(sh), gone)

    def ready(self, seq: SeqEntry) -> None:
        """The blocks the sequence was computing that its shard now holds (every layer written)."""
        if not self.sharing or seq.shard is None or not seq.claimed:
            return  # it claimed no block at its placement, or every claimed one is in
        sh = self._tables.shards[seq.shard]
        sid = seq.req.seq_id
        done = seq.kv // sh.spec.block_size
        names = self.names(seq, sh.spec.block_size)
        stored: list[int] = []
        for i, h in enumerate(names[: min(done, seq.claimed)]):
            if sh.prefixes.get(h) == sid:
                sh.prefixes[h] = None
                stored.append(i)
        if stored and self.listener is not None:
            bs, salt = sh.spec.block_size, seq.req.cache_salt
            self.listener.stored(StoredBlocks(seq.shard, seq.tokens, names, stored, bs, salt))
        if done >= seq.claimed:
            seq.claimed = 0

    def _index(self, sh: ShardEntry) -> int:
        return next(i for i, o in enumerate(self._tables.shards) if o is sh)  # rows compare by value

    def clear(self, sh: ShardEntry) -> None:
        """The shard holds no prefix block any more (lost, recovered empty, removed or rejoined)."""
        held = [h for h, owner in sh.prefixes.items() if owner is None]
        sh.prefixes.clear()
        if held and self.listener is not None:
            self.listener.removed(self._index(sh), held)

    def forget_pending(self, seq: SeqEntry, sh: ShardEntry) -> None:
        """The sequence leaves the shard: what it had not finished computing will not be there."""
        if not self.sharing:
            return
        sid = seq.req.seq_id
        for h in self.names(seq, sh.spec.block_size):
            if sh.prefixes.get(h) == sid:
                del sh.prefixes[h]
        seq.claimed = 0

    def prefix_cached(self, step: Step, cached: dict[str, int]) -> Step:
        """The shards found the first `cached[seq_id]` tokens of these newly reserved sequences in
        their prefix caches: their prefill starts there (a chunk wholly cached leaves the step), and
        the blocks they read from the cache no longer count against the shard per sequence. Call
        after the reservations of `step` succeeded; run the step it returns."""
        marks = self._tables.inflight.get(step.step, {})
        planned = {p.seq_id: p for p in step.seqs}
        drop: list[str] = []
        for sid, c in cached.items():
            seq = self._tables.running.get(sid)
            if c <= 0 or seq is None or seq.shard is None:
                continue
            sh = self._tables.shards[seq.shard]
            c = min(c, len(seq.tokens) - 1)  # a shard shares no more (its last token is computed)
            seq.cached = c
            # (a windowed model's sequence lets go of cached blocks as its window passes them: it
            # keeps counting them, an over-count of at most its prefix)
            seq.shared = c // sh.spec.block_size if self._geometry is None else 0
            sh.blocks -= seq.shared
            self.prefix_hits += 1
            self.cached_tokens += c
            p, mark = planned.get(sid), marks.get(sid)
            if p is None or mark is None or mark.epoch != seq.epoch or p.start_pos != 0:
                seq.kv = max(seq.kv, c)  # placed, not planned yet: its first chunk starts there
                continue
            if c >= len(p.token_ids):  # the whole chunk is cached: nothing of it to run
                drop.append(sid)
                del marks[sid]
                seq.kv, seq.inflight = c, None
                continue
            p.token_ids, p.start_pos = p.token_ids[c:], c
            marks[sid] = replace(mark, start_pos=c)
        if not drop:
            return step
        return Step(
            step=step.step,
            seqs=[p for p in step.seqs if p.seq_id not in drop],
            reserve=step.reserve,
            release=step.release,
            preempted=step.preempted,
            ended=step.ended,
        )
