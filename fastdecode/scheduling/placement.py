"""Pure placement and mini-batch split functions (no state; the core feeds them numbers)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from fastdecode.contract import PlannedSeq


@dataclass(frozen=True)
class ShardLoad:
    """What placement needs to know about one shard right now."""

    capacity: int  # KV tokens the shard holds
    speed: float  # relative attention speed (> 0)
    reserved: int  # KV tokens reserved by sequences placed there (prompt + max_tokens each)
    load: float  # KV the shard's sequences hold on average over the new sequence's expected life
    available: bool = True  # healthy and not backing off after a refused reservation


def choose_shard(
    need: int,
    add_load: float,
    shards: Sequence[ShardLoad],
    cached: Sequence[int] = (),
    affinity: float = 0.0,
) -> int | None:
    """The shard a new sequence goes to, or None when no available shard has `need` tokens free.

    Capacity is a hard limit (counting reservations). Among shards with room, pick the one whose
    share after placing is lowest, where the share is the larger of
      - attention time:  (load + add) / speed, relative to the balanced value sum(load) / sum(speed),
      - memory:          (reserved + need) / capacity, relative to sum(reserved) / sum(capacity).
    Speed weights the R-part time (what sets the pipeline's step), capacity keeps small shards from
    filling up first. Ties go to the lowest index, so placement is deterministic.

    Prefix affinity: `cached[i]` is how many of the sequence's first tokens shard i holds (or is
    computing) in its prefix cache. The shard with the most goes first when its share is within
    (1 + affinity) times the best share: the prefill and the KV it saves against the balance it costs.
    """
    cand = [i for i, s in enumerate(shards) if s.available and s.reserved + need <= s.capacity]
    if not cand:
        return None
    live = [s for s in shards if s.available]
    mean_time = (sum(s.load for s in live) + add_load) / sum(s.speed for s in live)
    mean_mem = (sum(s.reserved for s in live) + need) / sum(s.capacity for s in live)

    def share(i: int) -> tuple[float, float, int]:
        s = shards[i]
        t = (s.load + add_load) / s.speed / mean_time if mean_time > 0 else 0.0
        m = (s.reserved + need) / s.capacity / mean_mem if mean_mem > 0 else 0.0
        return (max(t, m), t, i)

    best = min(cand, key=share)
    if cached and affinity > 0:
        near = max(cand, key=lambda i: (cached[i], -share(i)[0], -i))
        if cached[near] > cached[best] and share(near)[0] <= (1 + affinity) * share(best)[0]:
            return near
    return best


def split_mini_batches(items: Sequence[tuple[int, float]]) -> list[int]:
    """Assign each (shard, attention cost) item to mini-batch 0 or 1.

    Per shard, sort by cost and take items in pairs: the heavier of a pair goes to the mini-batch with
    less cost on that shard, the lighter to the other. Each shard then splits its count evenly (+-1) and
    its cost to within its largest item, since every pair shifts the difference by at most its own
    gap. Odd leftovers go where the global count stays within one. The R-part of a mini-batch takes
    as long as its slowest shard, so balancing per shard is what keeps both halves equal.
    """
    # (runs every step over every planned sequence: plain floats and ints, no tuples compared)
    out = [0] * len(items)
    by_shard: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for i, (shard, c) in enumerate(items):
        by_shard[shard].append((-c, i))  # sorted: heaviest first, then in order
    count0 = count1 = 0  # items in mini-batch 0 and 1
    for shard in sorted(by_shard):
        idx = sorted(by_shard[shard])
        cost0 = cost1 = 0.0  # this shard's cost in mini-batch 0 and 1
        for k in range(0, len(idx) - 1, 2):
            (heavy_c, heavy), (light_c, light) = idx[k], idx[k + 1]
            # the heavier to the mini-batch with less cost here (then fewer items), the lighter to the other
            if cost0 < cost1 or (cost0 == cost1 and count0 <= count1):
                out[light] = 1
                cost0 -= heavy_c
                cost1 -= light_c
            else:
                out[heavy] = 1
                cost1 -= heavy_c
                cost0 -= light_c
            count0 += 1
            count1 += 1
        if len(idx) % 2:
            a = 0 if cost0 <= cost1 else 1
            if (count0 > count1) if a == 0 else (count1 > count0):
                a = 1 - a
            out[idx[-1][1]] = a
            count0 += 1 - a
            count1 += a
    return out


def attention_cost(new_tokens: int, start_pos: int) -> float:
    """Cached tokens attended by a chunk of new tokens starting at start_pos (causal)."""
    return new_tokens * start_pos + new_tokens * (new_tokens + 1) / 2


def row_costs(rows: Sequence[PlannedSeq]) -> list[tuple[int, float]]:
    """Each planned row's (shard, attention_cost), as split_mini_batches takes them. The formula is
    attention_cost's, written out: this runs for every row of every step."""
    return [(p.shard, (n := len(p.token_ids)) * p.start_pos + n * (n + 1) / 2) for p in rows]
