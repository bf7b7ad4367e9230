"""One-step-ahead planning (SchedulerCore(plan_ahead=True) and the driver's loop): step n+1 is
planned and its releases and reservations sent while step n still runs. The fake fleet
(tests/support/core_fleet.py) runs each step only after the next one was sent, feeds a sequence
planned ahead the token it sampled for it in the step before (as gpu_dense does) and fails a step
naming a sequence it was told to release: the tokens must equal a run without any scheduling."""

from __future__ import annotations

import asyncio

from fastdecode.contract import LAST_SAMPLE
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling import Request, SchedulerCore, ShardSpec, Step
from fastdecode.scheduling.driver import SchedulerDriver
from tests.support.core_fleet import EOS, Fleet, core_with, planned, reference
from tests.support.fakes import FakeDense, FakeShard

PROMPTS = {"a": [5, 6, 7], "b": [1, 2], "c": [9, 8, 7, 6, 5, 4, 3, 2, 1], "d": [4]}
MAX = {"a": 9, "b": 1, "c": 6, "d": 12}


def ahead_steps(fleet: Fleet) -> int:
    return sum(any(p.use_last_sample for p in st.seqs) for st in fleet.plans)


def test_sequences_planned_ahead_get_the_tokens_of_a_run_without_scheduling() -> None:
    core = core_with(2, prefill_token_budget=4, plan_ahead=True)
    fleet = Fleet(core, 2, eos_at={"d": 5})  # d stops at its 5th token: its step-ahead row is wasted
    for sid, prompt in PROMPTS.items():
        core.submit(Request(sid, prompt, MAX[sid]))
    fleet.run_ahead()
    for sid, prompt in PROMPTS.items():
        want = reference(prompt, 4) + [EOS] if sid == "d" else reference(prompt, MAX[sid])
        assert fleet.out[sid] == want, sid
    assert fleet.finish == {"a": "length", "b": "length", "c": "length", "d": "stop"}
    assert ahead_steps(fleet) >= 8
    assert fleet.reserved == [{}, {}]  # every reservation released, each after its last step ran
    for st in fleet.plans:
        for p in st.seqs:
            if p.use_last_sample:  # one token, sampled: never past max_tokens
                assert p.token_ids == [LAST_SAMPLE] and p.sample
                assert p.sample_index < MAX[p.seq_id]


def test_planned_ahead_only_after_a_chunk_that_samples() -> None:
    core = core_with(prefill_token_budget=4, plan_ahead=True)
    fleet = Fleet(core, 1)
    core.submit(Request("c", PROMPTS["c"], 3))
    s0 = core.next_step()
    assert s0 is not None and planned(s0, "c").token_ids == PROMPTS["c"][:4]  # a chunk, no sample
    fleet.send(s0)
    assert core.next_step() is None  # the next chunk needs nothing from gpu_dense, but waits
    fleet.complete(s0)
    s1 = core.next_step()
    assert s1 is not None and not planned(s1, "c").sample
    fleet.send(s1)
    fleet.complete(s1)
    s2 = core.next_step()  # the last chunk samples
    assert s2 is not None and planned(s2, "c").sample
    fleet.send(s2)
    s3 = core.next_step()  # while it runs: the sequence goes on with its sample
    assert s3 is not None
    p = planned(s3, "c")
    assert p.use_last_sample and p.start_pos == len(PROMPTS["c"]) and p.sample_index == 1


def test_a_sequence_cancelled_in_two_steps_is_released_after_the_later_one_ran() -> None:
    core = core_with(plan_ahead=True)
    fleet = Fleet(core, 1)
    core.submit(Request("a", [1, 2, 3], 20))
    core.submit(Request("b", [4, 5], 20))
    s0 = core.next_step()
    fleet.send(s0)
    s1 = core.next_step()
    fleet.send(s1)
    assert planned(s1, "a").use_last_sample
    core.cancel("a")  # the client went away: a is in s0 and s1, both still at the shard
    fleet.complete(s0)
    s2 = core.next_step()
    assert s2 is not None and s2.release == [] and planned(s2, "a") is None
    fleet.send(s2)
    fleet.complete(s1)  # would fail (KeyError) had a been released with s2
    s3 = core.next_step()
    assert s3 is not None and s3.release == [("a", 0)]
    fleet.send(s3)
    fleet.complete(s2)
    fleet.complete(s3)
    fleet.run_ahead()
    assert fleet.out["b"] == reference([4, 5], 20)
    assert "a" not in fleet.reserved[0]


def test_aborted_steps_newest_first_plan_everything_again_from_the_same_positions() -> None:
    core = core_with(plan_ahead=True)
    fleet = Fleet(core, 1)
    fleet.overwrite = True  # the lost steps' KV stays at the shard; a re-run overwrites it
    core.submit(Request("a", [1, 2, 3], 8))
    for _ in range(3):
        fleet.step()
    s0 = core.next_step()
    fleet.send(s0)
    s1 = core.next_step()
    fleet.send(s1)
    fleet.attend(s0)  # gpu_dense ran s0 and died in s1: neither result reaches the scheduler
    core.abort(s1)
    core.abort(s0)
    again = core.next_step()
    assert again is not None
    p = planned(again, "a")
    assert not p.use_last_sample and p.start_pos == planned(s0, "a").start_pos
    fleet.plans.append(again)
    fleet.send(again)
    fleet.complete(again)
    fleet.run_ahead()
    assert fleet.out["a"] == reference([1, 2, 3], 8)


def test_preemption_of_sequences_in_flight_holds_their_release_and_tokens_stay_exact() -> None:
    core = SchedulerCore([ShardSpec(32, block_size=4)], [EOS], kv_lookahead=0, plan_ahead=True)
    fleet = Fleet(core, 1)
    for sid in ("old", "mid", "young"):
        core.submit(Request(sid, [1, 2, 3, 4], 20))
    core.submit(Request("later", [9] * 4, 4))
    fleet.run_ahead()
    assert core.preemptions > 0
    assert fleet.refusals == 0  # the core's count of every shard's blocks stayed exact
    for sid in ("old", "mid", "young"):
        assert fleet.out[sid] == reference([1, 2, 3, 4], 20)
    assert fleet.out["later"] == reference([9] * 4, 4)
    assert fleet.reserved == [{}]


def test_a_shard_refusing_a_block_under_plan_ahead_retries_and_tokens_stay_exact() -> None:
    core = SchedulerCore([ShardSpec(40, block_size=4)], [EOS], kv_lookahead=0, plan_ahead=True)
    fleet = Fleet(core, 1, real_blocks={0: 7})
    fleet.overwrite = True  # a refused chunk's step-ahead row wrote past the gap: re-run over it
    prompts = {"a": [3, 1, 4], "b": [1, 5, 9], "c": [2, 6, 5]}
    for sid, p in prompts.items():
        core.submit(Request(sid, p, 9))
    fleet.run_ahead()
    for sid, p in prompts.items():
        assert fleet.out[sid] == reference(p, 9)


def test_a_drain_moves_sequences_that_are_planned_ahead_step_after_step() -> None:
    core = core_with(2, plan_ahead=True)
    fleet = Fleet(core, 2)
    for i in range(4):
        core.submit(Request(f"s{i}", [i + 1, 2, 3], 30))
    moved: list[str] = []

    def each() -> None:
        if len(fleet.plans) == 4:
            core.drain_shard(0)
        if len(fleet.plans) >= 4:
            moves, _ = core.drain_moves(4)
            for m in moves:  # the copy: the target gets the source's KV
                fleet.kv[m.target][m.seq_id] = list(fleet.kv[m.source][m.seq_id])
                fleet.reserved[m.target][m.seq_id] = fleet.reserved[m.source][m.seq_id]
                assert core.end_move(m, True)
                moved.append(m.seq_id)

    fleet.run_ahead(each=each)
    assert moved and core.drained(0)
    for i in range(4):
        assert fleet.out[f"s{i}"] == reference([i + 1, 2, 3], 30)


def test_the_driver_keeps_two_steps_at_gpu_dense_and_the_tokens_of_one_at_a_time() -> None:
    async def run(plan_ahead: str) -> tuple[list[list[int]], FakeDense]:
        dense = FakeDense()
        settings = SchedulerSettings(
            dense="fake:1", shards="fake:2,fake:3", health_interval=0.01, plan_ahead=plan_ahead
        )
        driver = SchedulerDriver(settings, dense, [FakeShard("fake:2"), FakeShard("fake:3")])
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())

        async def collect(req: Request) -> list[int]:
            return [t async for ev in driver.generate(req) for t in ev.token_ids]

        try:
            outs = await asyncio.gather(*(collect(Request(f"r{i}", [3, 4 + i], 5 + i)) for i in range(4)))
        finally:
            loop.cancel()
        return outs, dense

    ahead, dense = asyncio.run(run("on"))
    plain, dense_plain = asyncio.run(run("off"))
    assert ahead == plain == [[1 + j for j in range(5 + i)] for i in range(4)]
    assert any(p.use_last_sample for st in dense.steps for p in st.seqs)
    assert not any(p.use_last_sample for st in dense_plain.steps for p in st.seqs)


def _two_planned_ahead(core: SchedulerCore, fleet: Fleet) -> Step:
    """a and b prefilled in s0 and planned ahead in s1 (sent); s0 applied. Returns s1."""
    core.submit(Request("a", [1, 2, 3], 9))
    core.submit(Request("b", [4, 5, 6], 9))
    s0 = core.next_step()
    assert s0 is not None
    fleet.send(s0)
    s1 = core.next_step()  # their 4th tokens, planned ahead: still one block each
    assert s1 is not None and planned(s1, "a").use_last_sample and planned(s1, "b").use_last_sample
    fleet.send(s1)
    fleet.complete(s0)
    return s1


def test_a_step_ahead_that_does_not_fit_waits_for_the_boundary_and_preempts_there() -> None:
    # one shard of 3 blocks of 4 tokens: a and b hold a block each until their 5th token
    core = SchedulerCore([ShardSpec(12, block_size=4)], [EOS], kv_lookahead=0, plan_ahead=True)
    fleet = Fleet(core, 1)
    s1 = _two_planned_ahead(core, fleet)
    # The 5th tokens need a block each (4 > 3). Preempting b now would free its blocks only once s1
    # (which carries it) is applied, after gpu_dense may already run this step: nothing is planned.
    assert core.next_step() is None
    assert core.preemptions == 0
    fleet.complete(s1)
    s2 = core.next_step()  # the boundary: b gives its KV back with this very step
    assert s2 is not None and s2.preempted == ["b"] and s2.release == [("b", 0)]
    assert planned(s2, "b") is None and not planned(s2, "a").use_last_sample
    fleet.send(s2)
    fleet.complete(s2)
    fleet.run_ahead()
    assert fleet.refusals == 0
    for sid, prompt in {"a": [1, 2, 3], "b": [4, 5, 6]}.items():
        assert fleet.out[sid] == reference(prompt, 9), sid
    assert fleet.reserved == [{}]


def test_the_blocks_of_a_sequence_that_ended_count_until_its_release_is_sent() -> None:
    core = SchedulerCore([ShardSpec(12, block_size=4)], [EOS], kv_lookahead=0, plan_ahead=True)
    fleet = Fleet(core, 1, eos_at={"b": 1})  # b stops at its first token: its row in s1 is wasted
    s1 = _two_planned_ahead(core, fleet)
    assert fleet.finish["b"] == "stop"
    core.submit(Request("c", [7], 9))  # placed beside a and b's block, which s1 still carries
    # a's 5th token needs a block, and b's is not released before s1 is applied: nothing is planned,
    # and c's reservation waits for the next step
    assert core.next_step() is None
    fleet.complete(s1)
    s2 = core.next_step()
    assert s2 is not None and s2.release == [("b", 0)] and s2.preempted == []
    assert [r.seq_id for r in s2.reserve] == ["c"] and planned(s2, "c") is not None
    fleet.send(s2)
    fleet.complete(s2)
    fleet.run_ahead()
    assert fleet.refusals == 0
    assert fleet.out["a"] == reference([1, 2, 3], 9) and fleet.out["c"] == reference([7], 9)
    assert fleet.reserved == [{}]
