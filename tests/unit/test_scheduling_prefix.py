"""The scheduler core with prefix sharing: reservations carry tokens, a shard's cached tokens move the
prefill's start, placement prefers the shard with the prefix, and a prefix being computed is waited
for rather than computed twice."""

from __future__ import annotations

from fastdecode.scheduling import Request, SchedulerCore, ShardLoad, ShardSpec, choose_shard

BS = 4
PREFIX = list(range(1, 13))  # 3 full blocks


def _core(shards: int = 2, affinity: float = 0.5) -> SchedulerCore:
    return SchedulerCore(
        [ShardSpec(1000, block_size=BS) for _ in range(shards)],
        [0],
        prefix_sharing=True,
        prefix_affinity=affinity,
    )


def _finish_prefill(core: SchedulerCore, step) -> None:  # noqa: ANN001 - a Step
    core.apply(step, {p.seq_id: (50, 0.0) for p in step.seqs if p.sample})


def test_reservations_carry_tokens_and_cached_tokens_move_the_prefill_start() -> None:
    core = _core(shards=1)
    core.submit(Request("a", PREFIX + [20, 21], 4))
    step = core.next_step()
    assert step is not None and step.reserve[0].token_ids == PREFIX + [20, 21]
    step = core.prefix_cached(step, {"a": 8})
    (p,) = step.seqs
    assert p.start_pos == 8 and p.token_ids == PREFIX[8:] + [20, 21] and p.sample
    events = core.apply(step, {"a": (50, 0.0)})
    assert events[0].cached_tokens == 8 and core.cached_tokens == 8
    nxt = core.next_step()
    assert nxt is not None and nxt.seqs[0].start_pos == 14  # decodes on from the whole prompt


def test_a_wholly_cached_chunk_leaves_the_step_and_the_next_chunk_starts_after_it() -> None:
    core = SchedulerCore([ShardSpec(1000, block_size=BS)], [0], prefill_token_budget=4, prefix_sharing=True)
    core.submit(Request("a", PREFIX + [20], 4))
    step = core.next_step()
    assert step is not None and step.seqs[0].token_ids == PREFIX[:4]
    step = core.prefix_cached(step, {"a": 12})
    assert step.seqs == []
    core.apply(step, {})
    nxt = core.next_step()
    assert nxt is not None and nxt.seqs[0].start_pos == 12 and nxt.seqs[0].token_ids == [20]


def test_a_prefix_being_computed_is_waited_for_then_read_on_its_shard() -> None:
    # the prefix's shard holds the only other sequence: twice the balanced share, within 1 + 3
    core = _core(shards=2, affinity=3.0)
    core.submit(Request("first", PREFIX + [20], 4))
    core.submit(Request("second", PREFIX + [30, 31], 4))
    step = core.next_step()
    assert step is not None and [r.seq_id for r in step.reserve] == ["first"]
    assert core.decisions["deferred_prefix"] == 1
    _finish_prefill(core, core.prefix_cached(step, {"first": 0}))
    step = core.next_step()
    assert step is not None
    (r,) = step.reserve
    assert r.seq_id == "second" and r.shard == core.shard_of("first")  # where the prefix is


def test_without_sharing_nothing_waits_and_reservations_carry_no_tokens() -> None:
    core = SchedulerCore([ShardSpec(1000, block_size=BS) for _ in range(2)], [0])
    core.submit(Request("first", PREFIX + [20], 4))
    core.submit(Request("second", PREFIX + [30], 4))
    step = core.next_step()
    assert step is not None and len(step.reserve) == 2
    assert all(r.token_ids == [] for r in step.reserve)
    assert {r.shard for r in step.reserve} == {0, 1}  # balance alone


def test_affinity_yields_to_balance_beyond_its_slack() -> None:
    even = [ShardLoad(capacity=1000, speed=1.0, reserved=100, load=100.0) for _ in range(2)]
    assert choose_shard(10, 10.0, even) == 0
    assert choose_shard(10, 10.0, even, cached=[0, 12], affinity=0.5) == 1
    busy = [ShardLoad(1000, 1.0, 100, 100.0), ShardLoad(1000, 1.0, 600, 600.0)]
    assert choose_shard(10, 10.0, busy, cached=[0, 12], affinity=0.5) == 0  # too far out of balance
    assert choose_shard(10, 10.0, busy, cached=[0, 12], affinity=10.0) == 1
    assert choose_shard(10, 10.0, busy, cached=[0, 12], affinity=0.0) == 0


def test_shared_blocks_do_not_count_against_the_shard_twice() -> None:
    core = _core(shards=1)
    core.submit(Request("a", PREFIX + [20], 4))
    step = core.next_step()
    assert step is not None
    before = core.stats().shards[0].reserved_tokens
    core.prefix_cached(step, {"a": 12})
    assert core.stats().shards[0].reserved_tokens == before - 12


def test_copies_of_a_prompt_go_where_its_kv_is_and_others_balance() -> None:
    # n choices of one prompt: the siblings wait for the first's prefill and read it on its shard,
    # even where the default affinity would yield to balance; a prompt sharing only the system part
    # (its own last full block differs) is balanced onto the emptier shard and computes it there.
    core = _core(shards=2, affinity=0.5)
    for name in ("c0", "c1", "c2"):
        core.submit(Request(name, PREFIX + [20], 4))
    core.submit(Request("other", PREFIX + [40, 41, 42, 43, 44], 4))
    step = core.next_step()
    assert step is not None and [r.seq_id for r in step.reserve] == ["c0"]
    assert core.decisions["deferred_prefix"] == 3
    _finish_prefill(core, core.prefix_cached(step, {"c0": 0}))
    step = core.next_step()
    assert step is not None
    shard = {r.seq_id: r.shard for r in step.reserve}
    home = core.shard_of("c0")
    assert shard["c1"] == shard["c2"] == home
    assert shard["other"] != home


def test_with_affinity_off_copies_are_balanced() -> None:
    core = _core(shards=2, affinity=0.0)
    core.submit(Request("c0", PREFIX + [20], 4))
    core.submit(Request("c1", PREFIX + [20], 4))
    step = core.next_step()
    assert step is not None
    _finish_prefill(core, core.prefix_cached(step, {"c0": 0}))
    step = core.next_step()
    assert step is not None
    (r,) = step.reserve
    assert r.seq_id == "c1" and r.shard != core.shard_of("c0")


def test_sequences_whose_dense_side_needs_the_whole_prompt_neither_read_nor_publish_prefixes() -> None:
    # Prompt logprobs score every prompt position at prefill; penalties and grammars keep the token
    # history on gpu_dense: a prefill starting after a cached prefix would lose both.
    from fastdecode.scheduling import Sampling

    for sampling in (
        Sampling(prompt_logprobs=True),
        Sampling(repetition_penalty=1.3),
        Sampling(frequency_penalty=0.5),
        Sampling(grammar='{"grammars": []}'),
    ):
        core = _core(shards=1)
        core.submit(Request("plain", PREFIX + [20], 4))
        step = core.next_step()
        assert step is not None
        _finish_prefill(core, core.prefix_cached(step, {"plain": 0}))
        core.submit(Request("whole", PREFIX + [30], 4, sampling=sampling))
        step = core.next_step()
        assert step is not None
        (res,) = [r for r in step.reserve if r.seq_id == "whole"]
        assert res.token_ids == []  # the shard neither finds nor names its blocks
        (p,) = [p for p in step.seqs if p.seq_id == "whole"]
        assert p.start_pos == 0 and p.token_ids == PREFIX + [30]
        assert core.decisions.get("deferred_prefix", 0) == 0


def test_block_names_grow_with_the_tokens_as_a_whole_chain_names_them() -> None:
    """Names are extended a block at a time as tokens are appended (not rehashed every step): the
    same names as a chain over the whole history, and a prefix claimed at placement is marked ready
    once its prefill is in, whatever the sequence generated meanwhile."""
    from fastdecode.contract import chain_hashes
    from fastdecode.scheduling.tables import NAME_SEED

    core = _core(shards=1)
    core.submit(Request("a", PREFIX + [20, 21], 40))
    step = core.next_step()
    assert step is not None
    seq = core._running["a"]
    assert seq.claimed == 3  # its 3 full prompt blocks are being computed by it
    for tok in range(100, 113):  # 13 generated tokens: crosses block boundaries
        core.apply(step, {"a": (tok, 0.0)})
        assert core.prefixes.names(seq, BS) == chain_hashes(NAME_SEED, seq.tokens, BS)
        step = core.next_step()
        assert step is not None
    assert seq.claimed == 0  # its prefill is in: nothing it computes is pending any more
    names = core.prefixes.names(seq, BS)
    assert all(core._shards[0].prefixes[h] is None for h in names[:3])
    # another block size: rehashed
    assert core.prefixes.names(seq, 2) == chain_hashes(NAME_SEED, seq.tokens, 2)
