"""A fake fleet for SchedulerCore's unit tests: shards that check every plan like a real shard would,
and a deterministic 'model' whose tokens change if a position is wrong, duplicated or missing."""

from __future__ import annotations

from collections.abc import Callable

from fastdecode.runtime.errors import FailedPrecondition, ResourceExhausted, ServiceError
from fastdecode.scheduling import PlannedSeq, SchedulerCore, ShardSpec, Step, TokenEvent

EOS = 0
# per sequence: (token, logprob), (tokens, logprobs) of several decode steps, or its error
Results = dict[str, tuple[int, float] | tuple[list[int], list[float]] | ServiceError]


def model(kv: list[int], sample_index: int) -> int:
    """A deterministic 'greedy model': the next token depends on every cached token and its position,
    so a wrong position, a duplicated or a missing token changes everything after it."""
    h = sample_index * 31
    for i, t in enumerate(kv):
        h = (h * 1000003 + (i + 1) * (t + 7)) % 2_147_483_647
    return 1 + h % 97  # never EOS


class Fleet:
    """Shards that hold token ids as their 'KV', allocate it in blocks on demand like KVStore (admitted
    with the blocks of the reserved tokens, grown a block at a time), and enforce exact positions.

    `real_blocks` makes a shard smaller than the core believes: a chunk that needs a block it lacks
    is refused whole (RESOURCE_EXHAUSTED), as KVStore.grow does."""

    def __init__(
        self,
        core: SchedulerCore,
        nshards: int,
        eos_at: dict[str, int] | None = None,
        real_blocks: dict[int, int] | None = None,
    ) -> None:
        self.core = core
        self.kv: list[dict[str, list[int]]] = [{} for _ in range(nshards)]
        self.reserved: list[dict[str, int]] = [{} for _ in range(nshards)]  # blocks per sequence
        self.eos_at = eos_at or {}  # seq -> emit EOS as its n-th generated token
        self.out: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.plans: list[Step] = []
        self.overwrite = False
        shards = core.stats().shards
        self.bs = [sh.block_size for sh in shards]
        self.cap = [sh.capacity_tokens // sh.block_size for sh in shards]
        for j, n in (real_blocks or {}).items():
            self.cap[j] = n
        self.peak = [0] * nshards
        self.refused: list[str] = []  # in the step run last
        self.refusals = 0  # chunks refused for want of a block, over the run
        self.last: dict[str, int] = {}  # the tokens sampled in the step run last

    def add_shard(self) -> None:
        self.kv.append({})
        self.reserved.append({})
        new = self.core.stats().shards[-1]
        self.bs.append(new.block_size)
        self.cap.append(new.capacity_tokens // new.block_size)
        self.peak.append(0)

    def lose(self, shard: int) -> list[str]:
        self.kv[shard], self.reserved[shard] = {}, {}
        return self.core.shard_lost(shard)

    def _blocks(self, shard: int) -> int:
        return sum(self.reserved[shard].values())

    def execute(self, step: Step, skip_shard: int | None = None) -> Results:
        self.send(step)
        return self.attend(step, skip_shard)

    def send(self, step: Step) -> None:
        """The step's releases and reservations reach the shards (at once, as the driver sends
        them, even while an earlier step still runs)."""
        for sid, sh in step.release:
            assert sid in self.reserved[sh], f"release of {sid} not reserved on {sh}"
            del self.reserved[sh][sid]
            self.kv[sh].pop(sid, None)
        for r in step.reserve:
            assert r.seq_id not in self.reserved[r.shard], f"double reservation {r}"
            self.reserved[r.shard][r.seq_id] = -(-r.max_tokens // self.bs[r.shard])
            self.kv[r.shard][r.seq_id] = []
            assert self._blocks(r.shard) <= self.cap[r.shard], "reservation over capacity"

    def attend(self, step: Step, skip_shard: int | None = None) -> Results:
        """The step runs: a sequence planned ahead is fed the token this fleet sampled for it in the
        step it ran just before (as gpu_dense does); a released sequence fails (KeyError)."""
        last, self.last = self.last, {}
        results: Results = {}
        self.refused = []
        for p in step.seqs:
            if p.shard == skip_shard:
                results[p.seq_id] = (12345, 0.0)  # garbage from a shard that is going away
                continue
            if p.use_last_sample and p.seq_id not in last:  # its chunk before failed: not sent on
                results[p.seq_id] = FailedPrecondition("planned ahead of a step that sampled nothing")
                continue
            kv = self.kv[p.shard][p.seq_id]  # KeyError = planned without a reservation
            if self.overwrite:  # a real shard writes at start_pos: a re-run step overwrites
                assert p.start_pos <= len(kv), f"{p.seq_id}: start_pos {p.start_pos} leaves a gap"
                del kv[p.start_pos :]
            assert p.start_pos == len(kv), f"{p.seq_id}: start_pos {p.start_pos} but {len(kv)} cached"
            chunk = [last[p.seq_id]] if p.use_last_sample else p.token_ids
            if p.drafts:  # verified as gpu_dense does: kept while they equal the model's choice
                if not self._grow(p.shard, p.seq_id, len(kv) + len(chunk)):
                    self.refused.append(p.seq_id)
                    self.refusals += 1
                    results[p.seq_id] = ResourceExhausted("KV pool full")
                    continue
                kv.extend(chunk)  # every position is written, then the rejected ones rolled back
                toks = self._verify(p, kv)
                del kv[p.start_pos + len(toks) :]
                results[p.seq_id] = (toks, [-0.25] * len(toks)) if len(toks) > 1 else (toks[0], -0.25)
                self.last[p.seq_id] = toks[-1]
                continue
            toks: list[int] = []
            for j in range(p.steps):  # several decode steps: each fed the token the one before sampled
                if not self._grow(p.shard, p.seq_id, len(kv) + len(chunk)):
                    self.refused.append(p.seq_id)  # no free block: the row fails whole
                    self.refusals += 1
                    results[p.seq_id] = ResourceExhausted("KV pool full")
                    break
                kv.extend(chunk)
                if not p.sample:
                    break
                n = p.sample_index + j + 1
                tok = EOS if self.eos_at.get(p.seq_id) == n else model(kv, n - 1)
                toks.append(tok)
                chunk = [tok]
            else:
                if toks:
                    results[p.seq_id] = (toks[0], -0.25) if p.steps == 1 else (toks, [-0.25] * len(toks))
                    self.last[p.seq_id] = toks[-1]
        for j in range(len(self.kv)):
            assert self._blocks(j) <= self.cap[j], f"shard {j} over capacity"
        return results

    def _verify(self, p: PlannedSeq, kv: list[int]) -> list[int]:
        """A row's drafts up to the first the model disagrees with, then the model's own token."""
        toks: list[int] = []
        for j in range(p.drafts + 1):
            n = p.sample_index + j + 1
            tok = EOS if self.eos_at.get(p.seq_id) == n else model(kv[: p.start_pos + 1 + j], n - 1)
            toks.append(tok)
            if j == p.drafts or p.token_ids[1 + j] != tok:
                return toks
        return toks

    def _grow(self, shard: int, sid: str, tokens: int) -> bool:
        """Blocks for `tokens` KV positions of sid, a block at a time (False: the pool is full)."""
        need = -(-tokens // self.bs[shard])
        grow = max(0, need - self.reserved[shard][sid])
        if self._blocks(shard) + grow > self.cap[shard]:
            return False
        self.reserved[shard][sid] += grow
        self.peak[shard] = max(self.peak[shard], self._blocks(shard))
        return True

    def record(self, events: list[TokenEvent]) -> None:
        for e in events:
            assert e.seq_id not in self.finish or self.finish[e.seq_id] is None, "event after finish"
            self.out.setdefault(e.seq_id, []).extend(e.token_ids)
            self.finish[e.seq_id] = e.finish_reason
            assert e.completion_tokens == len(self.out[e.seq_id])

    def step(self) -> Step | None:
        st = self.core.next_step()
        if st is None:
            return None
        self.plans.append(st)
        self.send(st)
        self.complete(st)
        return st

    def complete(self, st: Step) -> None:
        """Run a sent step and apply its results."""
        self._apply(st, self.attend(st), self.refused)

    def _apply(self, st: Step, results: Results, refused: list[str]) -> None:
        if refused:
            self.core.kv_exhausted(st, refused)
        self.record(self.core.apply(st, results))

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("did not finish")

    def run_ahead(self, max_steps: int = 10_000, each: Callable[[], None] | None = None) -> None:
        """The driver's loop with plan_ahead: step n+1 is planned and sent (its releases and
        reservations done) before step n is applied. Each step runs as soon as it is sent, as
        gpu_dense may start it the moment the step before ends: before the scheduler has applied
        that one and sent the releases of the step after. `each`: called once per turn."""
        out: list[tuple[Step, Results, list[str]]] = []
        for _ in range(max_steps):
            if each is not None:
                each()
            st = self.core.next_step()
            if st is None and not out:
                return
            if st is not None:
                self.plans.append(st)
                self.send(st)
                if st.seqs:
                    out.append((st, self.attend(st), self.refused))
                else:
                    self.record(self.core.apply(st, {}))
            if out and (len(out) > 1 or st is None):
                self._apply(*out.pop(0))
        raise AssertionError("did not finish")


def core_with(nshards: int = 1, cap: int = 10_000, **kw: object) -> SchedulerCore:
    return SchedulerCore([ShardSpec(cap) for _ in range(nshards)], [EOS], **kw)


def planned(step: Step, sid: str) -> PlannedSeq | None:
    return next((p for p in step.seqs if p.seq_id == sid), None)


def reference(prompt: list[int], n: int) -> list[int]:
    """What the model generates for a prompt without any scheduling in the way."""
    kv = list(prompt)
    out = []
    for i in range(n):
        t = model(kv, i)
        out.append(t)
        kv.append(t)
    return out
