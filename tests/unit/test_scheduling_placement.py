"""Placement never exceeds a shard's capacity; the mini-batch split stays balanced (property tests)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.scheduling import (
    Request,
    SchedulerCore,
    ShardLoad,
    ShardSpec,
    StabilizedAdmission,
    choose_shard,
    split_mini_batches,
)

EOS = 0

shard_strategy = st.lists(
    st.tuples(st.integers(8, 400), st.sampled_from([0.5, 1.0, 2.0])), min_size=1, max_size=5
)
request_strategy = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None)
@given(
    shards=shard_strategy,
    reqs=request_strategy,
    stabilized=st.booleans(),
    lose=st.one_of(st.none(), st.integers(0, 4)),
)
def test_reservations_never_exceed_capacity(
    shards: list[tuple[int, float]],
    reqs: list[tuple[int, int, int]],
    stabilized: bool,
    lose: int | None,
) -> None:
    caps = [c for c, _ in shards]
    core = SchedulerCore(
        [ShardSpec(c, s) for c, s in shards],
        [EOS],
        max_running=16,
        prefill_token_budget=64,
        admission=StabilizedAdmission() if stabilized else None,
    )
    stop_at: dict[str, int] = {}
    accepted = 0
    for i, (prompt, max_tokens, stop) in enumerate(reqs):
        try:
            core.submit(Request(f"r{i}", [1] * prompt, max_tokens))
        except Exception:
            assert prompt + max_tokens > max(caps)  # only the ones no shard can ever hold
            continue
        stop_at[f"r{i}"] = stop
        accepted += 1
    held: list[dict[str, int]] = [{} for _ in shards]
    kv: list[dict[str, int]] = [{} for _ in shards]
    healthy = [True] * len(shards)
    finished = 0
    for n in range(3000):
        if lose is not None and n == 5 and lose < len(shards) and len(shards) > 1:
            core.shard_lost(lose)
            healthy[lose], held[lose], kv[lose] = False, {}, {}
        step = core.next_step()
        if step is None:
            break
        for sid, sh in step.release:
            del held[sh][sid]
            kv[sh].pop(sid, None)
        for r in step.reserve:
            assert healthy[r.shard]
            held[r.shard][r.seq_id] = r.max_tokens
            kv[r.shard][r.seq_id] = 0
        results: dict[str, tuple[int, float] | str] = {}
        for p in step.seqs:
            assert p.seq_id in held[p.shard]
            assert p.start_pos == kv[p.shard][p.seq_id]
            kv[p.shard][p.seq_id] += len(p.token_ids)
            # KV on demand: the shard grows the sequence to what it is sent
            held[p.shard][p.seq_id] = max(held[p.shard][p.seq_id], kv[p.shard][p.seq_id])
        for j, cap in enumerate(caps):
            assert sum(held[j].values()) <= cap, f"shard {j} over capacity"
            if p.sample:
                results[p.seq_id] = (EOS if p.sample_index + 1 >= stop_at[p.seq_id] else 5, 0.0)
        finished += sum(1 for e in core.apply(step, results) if e.finish_reason)
        for s in core.stats().shards:
            assert s.reserved_tokens <= s.capacity_tokens
    if lose is None:
        assert finished == accepted  # everything placeable ran to the end


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(
        st.tuples(
            st.integers(1, 500), st.floats(0.1, 4), st.integers(0, 500), st.floats(0, 1e4), st.booleans()
        ),
        min_size=1,
        max_size=6,
    ),
    need=st.integers(1, 300),
)
def test_choose_shard_only_picks_a_shard_with_room(
    loads: list[tuple[int, float, int, float, bool]], need: int
) -> None:
    shards = [ShardLoad(c, s, min(r, c), lo, a) for c, s, r, lo, a in loads]
    i = choose_shard(need, need / 2, shards)
    room = [j for j, s in enumerate(shards) if s.available and s.reserved + need <= s.capacity]
    if i is None:
        assert room == []
    else:
        assert i in room


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.tuples(st.integers(0, 3), st.floats(1, 1000)), max_size=60))
def test_split_balances_count_and_per_shard_cost(items: list[tuple[int, float]]) -> None:
    out = split_mini_batches(items)
    assert set(out) <= {0, 1}
    assert abs(out.count(0) - out.count(1)) <= 1
    for shard in {s for s, _ in items}:
        costs = [c for (s, c) in items if s == shard]
        a = sum(c for (s, c), mb in zip(items, out, strict=True) if s == shard and mb == 0)
        b = sum(c for (s, c), mb in zip(items, out, strict=True) if s == shard and mb == 1)
        assert abs(a - b) <= 2 * max(costs) + 1e-6
