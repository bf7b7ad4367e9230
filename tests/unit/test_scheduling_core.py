"""SchedulerCore behaviour, driven by a fake fleet that checks every plan like a real shard would."""

from __future__ import annotations

import pytest

from fastdecode.contract import TokenLogprob
from fastdecode.runtime.errors import InvalidInput, NotFound, OutOfRange, ResourceExhausted
from fastdecode.scheduling import (
    NaiveAdmission,
    Request,
    Sampling,
    SchedulerCore,
    ShardSpec,
    StabilizedAdmission,
    Step,
    TokenEvent,
    attention_cost,
)
from tests.support.core_fleet import EOS, Fleet, core_with, planned, reference

# ------------------------------------------------------------------ basics


def test_single_sequence_prefill_then_decode_exact_positions() -> None:
    core = core_with()
    fleet = Fleet(core, 1)
    core.submit(Request("a", [5, 6, 7], max_tokens=4))
    s0 = fleet.step()
    assert s0 is not None and s0.reserve[0].max_tokens == 3  # admitted with its prompt
    p = s0.seqs[0]
    assert (p.token_ids, p.start_pos, p.sample, p.sample_index) == ([5, 6, 7], 0, True, 0)
    s1 = fleet.step()
    p = s1.seqs[0]
    assert (p.start_pos, p.sample_index, len(p.token_ids)) == (3, 1, 1)
    assert p.token_ids == fleet.out["a"][:1]  # the token sampled at step 0
    fleet.run()
    assert fleet.out["a"] == reference([5, 6, 7], 4)
    assert fleet.finish["a"] == "length"
    assert fleet.plans[-1].release == [("a", 0)] and not fleet.plans[-1].seqs


def test_continuous_batching_joins_at_next_step() -> None:
    core = core_with()
    fleet = Fleet(core, 1)
    core.submit(Request("a", [1, 2], max_tokens=10))
    fleet.step()
    fleet.step()
    core.submit(Request("b", [3, 4, 5], max_tokens=3))
    st = fleet.step()
    assert {p.seq_id for p in st.seqs} == {"a", "b"}
    assert planned(st, "b").start_pos == 0 and planned(st, "a").start_pos == 3
    fleet.run()
    assert fleet.out["a"] == reference([1, 2], 10) and fleet.out["b"] == reference([3, 4, 5], 3)


def test_chunked_prefill_positions_and_only_last_chunk_samples() -> None:
    core = core_with(prefill_token_budget=4)
    fleet = Fleet(core, 1)
    core.submit(Request("a", [9, 9], max_tokens=20))
    fleet.step()  # a decodes from here on
    prompt = list(range(10, 20))
    core.submit(Request("long", prompt, max_tokens=2))
    chunks = []
    for _ in range(3):
        st = fleet.step()
        assert planned(st, "a") is not None, "decode tokens always go, whatever the prefill budget"
        p = planned(st, "long")
        chunks.append((p.token_ids, p.start_pos, p.sample))
        assert sum(len(q.token_ids) for q in st.seqs if q.seq_id != "a") <= 4
    assert chunks == [(prompt[0:4], 0, False), (prompt[4:8], 4, False), (prompt[8:10], 8, True)]
    assert len(fleet.out["long"]) == 1  # exactly one token sampled, after the last chunk
    nxt = planned(fleet.step(), "long")
    assert (nxt.start_pos, nxt.sample_index) == (10, 1)
    fleet.run()
    assert fleet.out["long"] == reference(prompt, 2)


def test_prefill_budget_is_shared_in_admission_order() -> None:
    core = core_with(prefill_token_budget=5)
    for sid in "abc":
        core.submit(Request(sid, [1, 2, 3], max_tokens=1))
    st = core.next_step()
    got = {p.seq_id: (len(p.token_ids), p.sample) for p in st.seqs}
    assert got == {"a": (3, True), "b": (2, False)}


# ------------------------------------------------------------------ stop rules


@pytest.mark.parametrize(
    ("req", "eos_at", "want_len", "reason"),
    [
        (Request("x", [1], max_tokens=5), None, 5, "length"),
        (Request("x", [1], max_tokens=5), 3, 3, "stop"),
        (Request("x", [1], max_tokens=5, ignore_eos=True), 3, 5, "length"),
    ],
)
def test_stop_rules(req: Request, eos_at: int | None, want_len: int, reason: str) -> None:
    core = core_with()
    fleet = Fleet(core, 1, {"x": eos_at} if eos_at else {})
    core.submit(req)
    fleet.run()
    assert len(fleet.out["x"]) == want_len and fleet.finish["x"] == reason
    if eos_at and reason == "stop":
        assert fleet.out["x"][-1] == EOS  # the EOS that ends it is included, as in HF generate


def test_stop_token_ids() -> None:
    ref = reference([4, 4], 6)
    core = core_with()
    fleet = Fleet(core, 1)
    core.submit(Request("x", [4, 4], max_tokens=6, stop_token_ids=frozenset({ref[2]})))
    fleet.run()
    assert fleet.out["x"] == ref[: ref.index(ref[2]) + 1] and fleet.finish["x"] == "stop"


def test_finished_seq_released_next_step_and_not_planned_again() -> None:
    core = core_with()
    fleet = Fleet(core, 1)
    core.submit(Request("short", [1], max_tokens=1))
    core.submit(Request("long", [1], max_tokens=5))
    s0 = fleet.step()
    assert fleet.finish["short"] == "length"
    s1 = fleet.step()
    assert ("short", 0) in s1.release and planned(s1, "short") is None
    assert all(("short", 0) not in s.release for s in fleet.plans[2:])
    assert s0.step + 1 == s1.step


def test_error_result_finishes_with_error_and_releases() -> None:
    core = core_with()
    core.submit(Request("a", [1, 2], max_tokens=5))
    st = core.next_step()
    (ev,) = core.apply(st, {"a": ResourceExhausted("shard said no")})
    assert (ev.finish_reason, ev.token_ids) == ("error", [])
    assert isinstance(ev.error, ResourceExhausted) and ev.error.message == "shard said no"
    assert core.next_step().release == [("a", 0)]


def test_missing_result_for_sampled_seq_is_an_error() -> None:
    core = core_with()
    core.submit(Request("a", [1], max_tokens=5))
    st = core.next_step()
    (ev,) = core.apply(st, {})
    assert ev.finish_reason == "error"


def test_apply_unknown_step_raises() -> None:
    core = core_with()
    core.submit(Request("a", [1], max_tokens=5))
    st = core.next_step()
    core.apply(st, {"a": (3, 0.0)})
    with pytest.raises(InvalidInput):
        core.apply(st, {"a": (3, 0.0)})


# ------------------------------------------------------------------ cancel, validation, queue


def test_cancel_waiting_running_and_unknown() -> None:
    core = core_with(max_running=1)
    fleet = Fleet(core, 1)
    core.submit(Request("a", [1], max_tokens=50))
    core.submit(Request("b", [1], max_tokens=50))
    fleet.step()
    assert (core.running, core.waiting) == (1, 1)
    core.cancel("b")  # waiting: nothing reserved, nothing to release
    assert core.waiting == 0
    st = core.next_step()
    core.cancel("a")  # running and in flight
    assert core.apply(st, fleet.execute(st)) == []  # its result is ignored
    nxt = core.next_step()
    assert nxt.release == [("a", 0)] and not nxt.seqs
    assert core.next_step() is None
    with pytest.raises(NotFound):
        core.cancel("a")


def test_queue_full_raises_resource_exhausted() -> None:
    core = core_with(max_waiting=2)
    core.submit(Request("a", [1], 1))
    core.submit(Request("b", [1], 1))
    with pytest.raises(ResourceExhausted):
        core.submit(Request("c", [1], 1))


@pytest.mark.parametrize(
    ("req", "exc"),
    [
        (Request("e", [], 1), InvalidInput),
        (Request("e", [1], 0), InvalidInput),
        (Request("", [1], 1), InvalidInput),
        (Request("e", [-1], 1), InvalidInput),
        (Request("e", [1], 1, sampling=Sampling(temperature=-1)), InvalidInput),
        (Request("e", [1], 1, sampling=Sampling(top_p=0)), InvalidInput),
        (Request("e", [1, 2, 3], 8), OutOfRange),  # 11 > max_context 10
        (Request("dup", [1], 1), InvalidInput),
    ],
)
def test_bad_requests(req: Request, exc: type[Exception]) -> None:
    core = core_with(max_context=10)
    core.submit(Request("dup", [1], 1))
    with pytest.raises(exc):
        core.submit(req)
    assert issubclass(OutOfRange, InvalidInput)


def test_request_larger_than_any_shard_is_rejected() -> None:
    core = core_with(cap=10)
    with pytest.raises(InvalidInput):
        core.submit(Request("a", [1] * 5, 6))


def test_max_running_caps_the_batch() -> None:
    core = core_with(max_running=2)
    for i in range(5):
        core.submit(Request(f"s{i}", [1], 3))
    st = core.next_step()
    assert len(st.seqs) == 2 and (core.running, core.waiting) == (2, 3)


# ------------------------------------------------------------------ placement and mini-batches


def test_placement_balances_and_respects_capacity() -> None:
    core = SchedulerCore([ShardSpec(100), ShardSpec(100)], [EOS])
    for i in range(6):
        core.submit(Request(f"s{i}", [1] * 10, 30))  # 40 tokens each (all growth in the lookahead)
    st = core.next_step()
    per = [sum(r.max_tokens for r in st.reserve if r.shard == j) for j in (0, 1)]
    # admitted with their prompts; each commits prompt + 30 expected tokens: 2 fit per shard
    assert per == [20, 20] and core.waiting == 2


def test_placement_weights_shard_speed() -> None:
    core = SchedulerCore([ShardSpec(10_000, speed=1.0), ShardSpec(10_000, speed=3.0)], [EOS])
    for i in range(8):
        core.submit(Request(f"s{i}", [1] * 10, 10))
    st = core.next_step()
    counts = [sum(1 for r in st.reserve if r.shard == j) for j in (0, 1)]
    assert counts == [2, 6]


def test_mini_batches_balance_count_and_kv_length() -> None:
    core = SchedulerCore([ShardSpec(100_000), ShardSpec(100_000)], [EOS], prefill_token_budget=10_000)
    fleet = Fleet(core, 2)
    lengths = [5, 50, 7, 300, 20, 90, 33, 150, 11, 64, 200, 3]
    for i, n in enumerate(lengths):
        core.submit(Request(f"s{i}", [1] * n, 100))
    fleet.step()  # prefill everything
    st = fleet.step()  # all decode
    assert len(st.seqs) == len(lengths)
    a, b = st.mini_batches()
    assert abs(len(a) - len(b)) <= 1
    for shard in (0, 1):
        costs = [attention_cost(1, p.start_pos) for p in st.seqs if p.shard == shard]
        ca = sum(attention_cost(1, p.start_pos) for p in a if p.shard == shard)
        cb = sum(attention_cost(1, p.start_pos) for p in b if p.shard == shard)
        assert abs(ca - cb) <= max(costs), (shard, ca, cb)


def test_add_shard_takes_new_sequences() -> None:
    core = core_with(nshards=2)
    fleet = Fleet(core, 2)
    for i in range(4):
        core.submit(Request(f"s{i}", [1] * 8, 50))
    fleet.step()
    fleet.add_shard()
    assert core.add_shard(ShardSpec(10_000)) == 2
    core.submit(Request("new", [1] * 8, 50))
    st = fleet.step()
    assert [r.shard for r in st.reserve if r.seq_id == "new"] == [2]
    assert core.stats().shards[2].sequences == 1


# ------------------------------------------------------------------ shard loss and reservations


@pytest.mark.parametrize("budget", [512, 4])
def test_shard_lost_reprefills_history_and_output_is_identical(budget: int) -> None:
    prompts = {f"s{i}": [i + 1] * (3 + i) for i in range(6)}
    core = core_with(nshards=2, prefill_token_budget=budget)
    fleet = Fleet(core, 2)
    for sid, p in prompts.items():
        core.submit(Request(sid, p, 12))
    for _ in range(8):
        fleet.step()
    before = {sid: list(toks) for sid, toks in fleet.out.items()}
    moved = fleet.lose(0)
    assert moved and all(core.shard_of(s) is None for s in moved)
    st = fleet.step()
    for sid in moved:
        r = [x for x in st.reserve if x.seq_id == sid]
        # re-admitted with the blocks of its history, which it re-prefills
        assert r and r[0].shard == 1 and r[0].max_tokens == len(prompts[sid]) + len(before[sid])
    first = {p.seq_id: p for p in st.seqs if p.seq_id in moved}
    for sid, p in first.items():
        history = prompts[sid] + before[sid]
        assert p.start_pos == 0 and p.token_ids == history[: len(p.token_ids)]
        assert p.sample == (len(p.token_ids) == len(history))
        assert p.sample_index == len(before[sid])
    fleet.run()
    for sid, p in prompts.items():
        assert fleet.out[sid] == reference(p, 12), sid  # nothing lost, nothing duplicated
        assert fleet.finish[sid] == "length"
    assert core.stats().recoveries == len(moved)
    assert all(s.shard == 1 for st in fleet.plans[8:] for s in st.seqs)


def test_shard_lost_mid_step_ignores_its_results() -> None:
    core = core_with(nshards=2)
    fleet = Fleet(core, 2)
    for i in range(4):
        core.submit(Request(f"s{i}", [7, i], 6))
    fleet.step()
    fleet.step()
    st = core.next_step()
    results = fleet.execute(st, skip_shard=0)  # shard 0 dies during the step
    moved = fleet.lose(0)
    events = core.apply(st, results)
    assert {e.seq_id for e in events}.isdisjoint(moved)
    fleet.record(events)
    fleet.run()
    for i in range(4):
        assert fleet.out[f"s{i}"] == reference([7, i], 6)


@pytest.mark.parametrize("budget", [512, 3])
def test_aborted_step_is_planned_again_and_output_is_identical(budget: int) -> None:
    """gpu_dense dies mid-step: its shards already hold part of the step's KV and no token came back.
    The aborted step is planned again from the same positions, with the same sample indices."""
    prompts = {f"s{i}": [i + 2] * (2 + i) for i in range(4)}
    core = core_with(nshards=2, prefill_token_budget=budget)
    fleet = Fleet(core, 2)
    fleet.overwrite = True
    for sid, p in prompts.items():
        core.submit(Request(sid, p, 8))
    for n in range(3):
        fleet.step()
        st = core.next_step()
        fleet.execute(st)  # the shards appended this step's KV, then the results were lost
        core.abort(st)
        again = core.next_step()
        assert [(p.seq_id, p.start_pos, p.token_ids, p.sample_index) for p in again.seqs] == [
            (p.seq_id, p.start_pos, p.token_ids, p.sample_index) for p in st.seqs
        ], n
        fleet.plans.append(again)
        fleet.record(core.apply(again, fleet.execute(again)))
    core.abort(st)  # a step already given up on, twice: nothing happens
    fleet.run()
    for sid, p in prompts.items():
        assert fleet.out[sid] == reference(p, 8), sid
        assert fleet.finish[sid] == "length"


def test_abort_skips_sequences_cancelled_meanwhile() -> None:
    core = core_with()
    fleet = Fleet(core, 1)
    fleet.overwrite = True
    core.submit(Request("a", [1, 2], 4))
    core.submit(Request("b", [3, 4], 4))
    fleet.step()
    st = core.next_step()
    core.cancel("a")
    core.abort(st)
    again = core.next_step()
    assert [p.seq_id for p in again.seqs] == ["b"]
    fleet.record(core.apply(again, fleet.execute(again)))
    fleet.run()
    assert fleet.out["b"] == reference([3, 4], 4)
    assert fleet.out["a"] == reference([1, 2], 1) and fleet.finish["a"] is None  # nothing after cancel


def test_shard_recovered_takes_new_sequences_again() -> None:
    core = core_with(nshards=2)
    core.shard_lost(1)
    core.submit(Request("a", [1], 3))
    assert core.next_step().reserve[0].shard == 0
    core.shard_recovered(1)
    core.submit(Request("b", [1], 3))
    assert core.next_step().reserve[0].shard == 1
    with pytest.raises(NotFound):
        core.shard_lost(7)


def test_reservation_failed_puts_seq_back_and_tries_another_shard() -> None:
    core = core_with(nshards=2)
    fleet = Fleet(core, 2)
    core.submit(Request("a", [1, 2], 4))
    core.submit(Request("b", [3, 4], 4))
    st = core.next_step()
    shard_a = planned(st, "a").shard
    core.reservation_failed("a")
    assert core.waiting == 1 and core.running == 1
    st = st.without(["a"])
    fleet.record(core.apply(st, fleet.execute(st)))
    st2 = fleet.step()
    ra = [r for r in st2.reserve if r.seq_id == "a"]
    assert ra and ra[0].shard != shard_a  # the refusing shard backs off
    p = planned(st2, "a")
    assert p.start_pos == 0 and p.token_ids == [1, 2]
    fleet.run()
    assert fleet.out["a"] == reference([1, 2], 4)
    with pytest.raises(NotFound):
        core.reservation_failed("zzz")


def test_stats_shape() -> None:
    core = core_with(nshards=2, admission=StabilizedAdmission())
    core.submit(Request("a", [1, 2, 3], 5))
    Fleet(core, 2).step()
    s = core.stats()
    assert s.running == 1 and s.waiting == 0 and s.steps == 1 and s.admission == "stabilized"
    assert s.w_limit is not None and s.kv_load_tokens == 3
    assert [x.shard for x in s.shards] == [0, 1] and all(x.healthy for x in s.shards)
    assert sum(x.tokens for x in s.shards) == 3


def test_expected_length_learns_early_stops() -> None:
    core = core_with(admission=NaiveAdmission())
    eos = {f"s{i}": 2 for i in range(40)}
    fleet = Fleet(core, 1, eos)
    for sid in eos:
        core.submit(Request(sid, [1], 20))
    fleet.run()
    assert core.stats().expected_ratio < 0.3  # stops at 2 of 20: the estimate moved toward 0.1


def test_reservation_failed_on_the_only_shard_does_not_stall() -> None:
    core = core_with(nshards=1)
    core.submit(Request("a", [1, 2], 4))
    core.next_step()
    core.reservation_failed("a")
    st = core.next_step()  # nothing else runs: the back-off must not wait for steps that never come
    assert st is not None and [r.seq_id for r in st.reserve] == ["a"]


def test_measured_speed_update_shifts_new_placements() -> None:
    core = SchedulerCore([ShardSpec(10_000), ShardSpec(10_000)], [EOS])
    core.set_speed(1, 3.0)  # the scheduler measured shard 1 three times faster
    with pytest.raises(InvalidInput):
        core.set_speed(0, 0.0)
    for i in range(8):
        core.submit(Request(f"s{i}", [1] * 10, 10))
    st = core.next_step()
    assert [sum(1 for r in st.reserve if r.shard == j) for j in (0, 1)] == [2, 6]


def test_admission_decisions_are_counted() -> None:
    core = SchedulerCore([ShardSpec(100)], [EOS], max_waiting=3)
    for i in range(3):
        core.submit(Request(f"s{i}", [1] * 10, 30))  # 40 tokens each: two fit
    with pytest.raises(ResourceExhausted):
        core.submit(Request("full", [1], 1))
    core.next_step()
    assert core.decisions == {
        "admitted": 2,
        "rejected": 1,
        "deferred_policy": 0,
        "deferred_capacity": 1,
        "deferred_prefix": 0,
    }
    stab = SchedulerCore([ShardSpec(10_000)], [EOS], admission=StabilizedAdmission(w_limit=50, micro_batch=1))
    fleet = Fleet(stab, 1)
    for i in range(4):
        stab.submit(Request(f"t{i}", [1] * 10, 20))
    fleet.step()
    assert stab.decisions["admitted"] >= 1 and stab.decisions["deferred_policy"] >= 1
    fleet.run()
    assert stab.decisions["admitted"] == 4 and stab.decisions["rejected"] == 0


# ------------------------------------------------------------------ KV on demand and preemption


def test_admission_counts_tokens_held_not_max_tokens() -> None:
    # 4 blocks of 16 per shard; full-context reservations (8 + 56 = 64 tokens) would fit 1 per shard
    core = SchedulerCore([ShardSpec(64, block_size=16)] * 2, [EOS], kv_lookahead=8)
    for i in range(6):
        core.submit(Request(f"s{i}", [1] * 8, 56))
    st = core.next_step()
    assert st is not None
    # each commits its prompt + 8 steps of growth = 1 block, so all 6 start (3 a shard)
    assert [sum(1 for r in st.reserve if r.shard == j) for j in (0, 1)] == [3, 3]
    assert core.running == 6 and core.waiting == 0
    assert all(r.max_tokens == 8 for r in st.reserve)
    assert [s.reserved_tokens for s in core.stats().shards] == [48, 48]  # 3 prompts' blocks each


def test_full_shard_preempts_the_youngest_and_tokens_equal_a_run_that_never_filled() -> None:
    prompts = {f"s{i}": [1 + i, 2, 3 + i, 4, 5] for i in range(6)}

    def run(cap: int) -> tuple[Fleet, SchedulerCore]:
        core = SchedulerCore([ShardSpec(cap, block_size=4)], [EOS], kv_lookahead=4, max_running=6)
        fleet = Fleet(core, 1)
        for sid, p in prompts.items():
            core.submit(Request(sid, p, 35))  # 40 tokens at the end: 10 blocks
        fleet.run()
        return fleet, core

    roomy, roomy_core = run(6 * 40)
    tight, tight_core = run(16 * 4)  # 16 blocks: room for 1.6 full sequences
    assert roomy_core.preemptions == 0
    assert tight_core.preemptions > 0
    assert max(len(st.seqs) for st in tight.plans) > 1  # more than full reservations would allow
    assert tight.out == roomy.out and all(v == "length" for v in tight.finish.values())
    assert tight.peak[0] <= 16  # the fake shard asserts this every step too
    preempted = [sid for st in tight.plans for sid in st.preempted]
    assert len(preempted) == tight_core.preemptions
    assert tight_core.stats().preemptions == tight_core.preemptions


def test_preemption_picks_the_youngest_and_requeues_it_at_the_head() -> None:
    core = SchedulerCore([ShardSpec(32, block_size=4)], [EOS], kv_lookahead=0)
    fleet = Fleet(core, 1)
    for sid in ("old", "mid", "young"):
        core.submit(Request(sid, [1, 2, 3, 4], 20))
    fleet.step()  # all three admitted: 3 of 8 blocks
    core.submit(Request("later", [9] * 4, 4))  # queued behind; 4 more blocks would not be free
    while not any(st.preempted for st in fleet.plans):
        assert fleet.step() is not None
    st = next(st for st in fleet.plans if st.preempted)
    assert st.preempted == ["young"]
    assert ("young", 0) in st.release and all(p.seq_id != "young" for p in st.seqs)
    assert list(core._waiting)[0] == "young"  # at the head, before "later"
    fleet.run()
    for sid in ("old", "mid", "young"):
        assert fleet.out[sid] == reference([1, 2, 3, 4], 20)


def test_shard_refusing_a_block_retries_the_chunk_and_preempts() -> None:
    # The core believes in 10 blocks of 4; the shard really has 7: it refuses a block mid-decode.
    core = SchedulerCore([ShardSpec(40, block_size=4)], [EOS], kv_lookahead=0)
    fleet = Fleet(core, 1, real_blocks={0: 7})
    prompts = {"a": [3, 1, 4], "b": [1, 5, 9], "c": [2, 6, 5]}
    for sid, p in prompts.items():
        core.submit(Request(sid, p, 9))  # 12 tokens at the end: 3 blocks each
    refused = 0
    for _ in range(500):
        if fleet.step() is None:
            break
        refused += len(fleet.refused)
    assert refused > 0 and core.preemptions > 0
    for sid, p in prompts.items():
        assert fleet.out[sid] == reference(p, 9) and fleet.finish[sid] == "length"


def test_preempted_sequence_cancelled_while_waiting_leaves_nothing_behind() -> None:
    core = SchedulerCore([ShardSpec(16, block_size=4)], [EOS], kv_lookahead=0)
    fleet = Fleet(core, 1)
    core.submit(Request("a", [1, 2, 3, 4], 11))
    core.submit(Request("b", [5, 6, 7, 8], 11))
    while core.preemptions == 0:
        assert fleet.step() is not None
    core.cancel("b")  # it waits with no KV anywhere: nothing to release
    fleet.run()
    assert fleet.out["a"] == reference([1, 2, 3, 4], 11)
    assert fleet.reserved == [{}]


def _score(step: Step) -> dict[str, list[TokenLogprob]]:
    """What gpu_dense answers for prompt logprobs: position p scored as -p, for the chunk's positions
    start_pos+1.. (and next_token's)."""
    out = {}
    for p in step.seqs:
        if p.sampling.prompt_logprobs:
            targets = p.token_ids[1:] + ([p.next_token] if p.next_token is not None else [])
            out[p.seq_id] = [TokenLogprob(t, -float(p.start_pos + 1 + i)) for i, t in enumerate(targets)]
    return out


def test_prompt_logprobs_go_out_once_per_position_across_chunks_and_a_lost_shard() -> None:
    core = core_with(nshards=2, prefill_token_budget=4)
    prompt = list(range(10, 20))
    core.submit(Request("a", prompt, max_tokens=3, sampling=Sampling(prompt_logprobs=True, top_logprobs=2)))
    scored: list[TokenLogprob] = []
    events: list[TokenEvent] = []
    plans = []
    lost = False
    while len(events) == 0 or not events[-1].finish_reason:
        st = core.next_step()
        assert st is not None
        plans.append(planned(st, "a"))
        results = {p.seq_id: (1 + p.sample_index, -0.5) for p in st.seqs if p.sample}
        evs = core.apply(st, results, _score(st))
        for ev in evs:
            scored += ev.prompt_logprobs
        events += [e for e in evs if e.token_ids or e.finish_reason]
        if len(events) == 1 and not lost:  # after the first token the shard is lost: re-prefill
            core.shard_lost(core.shard_of("a"))
            lost = True
    # chunks ask for the next prompt token while inside the prompt; the re-prefill asks for nothing
    assert [(p.start_pos, p.next_token) for p in plans[:3]] == [(0, 14), (4, 18), (8, None)]
    assert all(not p.sampling.prompt_logprobs for p in plans[3:])
    assert [(e.token_id, e.logprob) for e in scored] == [(prompt[i], -float(i)) for i in range(1, 10)]
    assert [e.token_ids for e in events] == [[1], [2], [3]]
    assert all(len(e.top) == 1 for e in events)  # one alternatives entry per token (top_logprobs asked)


def test_equal_sampling_settings_share_one_object_and_are_forgotten_with_their_requests() -> None:
    """submit() interns settings: a step's plan finds each row's by identity (plan_to_proto). An
    entry lives only while a request holds its settings."""
    import gc

    core = core_with()
    fleet = Fleet(core, 1)

    def serve() -> None:  # (its own frame: nothing of it outlives the requests)
        a = Request("a", [1, 2], max_tokens=2, sampling=Sampling(temperature=0.5, seed=7))
        b = Request("b", [3, 4], max_tokens=2, sampling=Sampling(temperature=0.5, seed=7))
        c = Request("c", [5], max_tokens=2, sampling=Sampling(temperature=0.5, seed=8))
        for r in (a, b, c):
            core.submit(r)
        assert a.sampling is b.sampling and a.sampling is not c.sampling
        assert b.sampling == Sampling(temperature=0.5, seed=7)  # the same settings, not others
        step = fleet.step()
        assert step is not None and planned(step, "a").sampling is planned(step, "b").sampling
        assert len(core._samplings) == 2  # noqa: SLF001
        fleet.run()

    serve()
    fleet.plans.clear()
    gc.collect()
    assert len(core._samplings) == 0  # noqa: SLF001 - nothing keeps settings no request holds
