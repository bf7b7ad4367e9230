"""Several decode steps per plan (SchedulerCore(decode_steps=k), gpu_dense's run_steps): a row runs
up to k decode steps in one plan, each fed the token the one before sampled. The fake fleet
(tests/support/core_fleet.py) checks every position and block like a shard, and its 'model' changes
every later token if one position is wrong: the tokens must equal a run without any scheduling."""

from __future__ import annotations

import pytest

from fastdecode.contract import LAST_SAMPLE, PlannedSeq, SamplingParams
from fastdecode.runtime.errors import InvalidInput
from fastdecode.scheduling import Request, SampledRun, SchedulerCore, ShardSpec
from fastdecode.wire import dense as wire
from tests.support.core_fleet import EOS, Fleet, core_with, reference

PROMPTS = {"a": [5, 6, 7], "b": [1, 2], "c": [9, 8, 7, 6, 5, 4, 3, 2, 1], "d": [4]}
MAX = {"a": 9, "b": 1, "c": 6, "d": 12}


def run(fleet: Fleet, ahead: bool) -> None:
    fleet.run_ahead() if ahead else fleet.run()


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("k", [2, 4, 16])
def test_tokens_equal_a_run_without_scheduling_and_stop_where_they_should(ahead: bool, k: int) -> None:
    core = core_with(2, prefill_token_budget=4, plan_ahead=ahead, decode_steps=k)
    fleet = Fleet(core, 2, eos_at={"d": 5})  # d samples EOS as its 5th token, mid-run
    for sid, prompt in PROMPTS.items():
        core.submit(Request(sid, prompt, MAX[sid]))
    run(fleet, ahead)
    for sid, prompt in PROMPTS.items():
        want = reference(prompt, 4) + [EOS] if sid == "d" else reference(prompt, MAX[sid])
        assert fleet.out[sid] == want, sid  # nothing after the stop, nothing past max_tokens
    assert fleet.finish == {"a": "length", "b": "length", "c": "length", "d": "stop"}
    assert fleet.reserved == [{}, {}]  # every reservation released
    assert fleet.refusals == 0  # the core's count of every shard's blocks covered every step
    rows = [p for st in fleet.plans for p in st.seqs]
    assert max(p.steps for p in rows) == min(k, 12)
    for p in rows:  # never past max_tokens
        assert p.steps == 1 or p.sample
        assert p.sample_index + p.steps <= MAX[p.seq_id]
    single = core_with(2, prefill_token_budget=4, plan_ahead=ahead)
    one = Fleet(single, 2, eos_at={"d": 5})
    for sid, prompt in PROMPTS.items():
        single.submit(Request(sid, prompt, MAX[sid]))
    run(one, ahead)
    assert one.out == fleet.out
    assert len(fleet.plans) < len(one.plans)  # fewer plans for the same tokens


def test_a_stop_token_mid_run_drops_the_tokens_after_it() -> None:
    core = core_with(1, decode_steps=8)
    fleet = Fleet(core, 1)
    want = reference([3, 1, 4], 20)
    stop = want[5]
    core.submit(Request("a", [3, 1, 4], 20, stop_token_ids=frozenset({stop})))
    fleet.run()
    assert fleet.out["a"] == want[: want.index(stop) + 1] and fleet.finish["a"] == "stop"
    assert fleet.reserved == [{}]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_full_shard_preempts_and_tokens_stay_exact(ahead: bool) -> None:
    core = SchedulerCore(
        [ShardSpec(32, block_size=4)], [EOS], kv_lookahead=0, plan_ahead=ahead, decode_steps=4
    )
    fleet = Fleet(core, 1)
    for sid in ("old", "mid", "young"):
        core.submit(Request(sid, [1, 2, 3, 4], 20))
    core.submit(Request("later", [9] * 4, 4))
    run(fleet, ahead)
    assert core.preemptions > 0
    for sid in ("old", "mid", "young"):
        assert fleet.out[sid] == reference([1, 2, 3, 4], 20)
    assert fleet.out["later"] == reference([9] * 4, 4)
    assert fleet.reserved == [{}]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_shard_refusing_a_block_mid_run_retries_and_tokens_stay_exact(ahead: bool) -> None:
    # The core believes in 10 blocks of 4; the shard really has 7: a later decode step of a row finds
    # no block, the row fails whole and is retried from where its plan started.
    core = SchedulerCore(
        [ShardSpec(40, block_size=4)], [EOS], kv_lookahead=0, plan_ahead=ahead, decode_steps=4
    )
    fleet = Fleet(core, 1, real_blocks={0: 7})
    fleet.overwrite = True  # a shard writes at start_pos: the retry goes over what the run wrote
    prompts = {"a": [3, 1, 4], "b": [1, 5, 9], "c": [2, 6, 5]}
    for sid, p in prompts.items():
        core.submit(Request(sid, p, 9))
    run(fleet, ahead)
    assert fleet.refusals > 0
    for sid, p in prompts.items():
        assert fleet.out[sid] == reference(p, 9) and fleet.finish[sid] == "length"


def test_rows_that_score_their_prompt_or_ignore_eos_under_a_grammar_run_one_step() -> None:
    core = core_with(1, decode_steps=4)
    core.submit(Request("p", [1, 2, 3], 8, sampling=SamplingParams(prompt_logprobs=True)))
    core.submit(Request("g", [1, 2, 3], 8, sampling=SamplingParams(grammar="x"), ignore_eos=True))
    core.submit(Request("n", [1, 2, 3], 8))
    st = core.next_step()
    assert st is not None
    assert {p.seq_id: p.steps for p in st.seqs} == {"p": 1, "g": 1, "n": 4}


def test_fewer_tokens_than_planned_without_a_stop_fails_the_sequence() -> None:
    core = core_with(1, decode_steps=4)
    core.submit(Request("a", [1, 2, 3], 8))
    st = core.next_step()
    assert st is not None
    (ev,) = core.apply(st, {"a": ([7, 8], [-0.1, -0.2])})
    assert ev.finish_reason == "error" and ev.error is not None and "2 of the 4" in ev.error.message
    assert core.running == 0


def test_decode_steps_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidInput):
        core_with(1, decode_steps=0)
    with pytest.raises(InvalidInput):
        core_with(1, decode_steps=17)


def test_the_wire_carries_steps_and_every_token_of_a_run() -> None:
    seqs = [
        PlannedSeq("a", 0, 0, [5], 3, SamplingParams(), True, 1, None, False, 4),
        PlannedSeq("b", 1, 1, [LAST_SAMPLE], 7, SamplingParams(top_logprobs=2), True, 2, None, True, 3),
    ]
    back = wire.planned_seqs_from_proto(wire.plan_to_proto(9, seqs, True))
    assert [(p.seq_id, p.steps, p.use_last_sample) for p in back] == [("a", 4, False), ("b", 3, True)]
    assert not wire.plan_to_proto(9, [seqs[0]], True).steps or seqs[0].steps > 1
    one = PlannedSeq("c", 0, 0, [5], 3)
    assert list(wire.plan_to_proto(9, [one], True).steps) == []  # one step each: the column stays empty
    bad = wire.plan_to_proto(9, seqs, True)
    bad.steps[0] = 17
    with pytest.raises(InvalidInput):
        wire.planned_seqs_from_proto(bad)

    from fastdecode.dense import Outcome

    top = ((4, -0.1), (6, -2.0))
    b = Outcome(11, -0.5, top=top, after=[Outcome(12, -0.6, top=top), Outcome(13, -0.7, top=top)])
    outcomes = {"a": Outcome(21, -0.1, after=[Outcome(22, -0.2)]), "b": b, "c": Outcome(31, -0.3)}
    got = wire.step_outcome_from_proto(wire.step_result(9, outcomes, None))
    assert got.error is None
    rows = {r.seq_id: r for r in got.items}
    assert rows["a"].run == SampledRun([21, 22], [pytest.approx(-0.1), pytest.approx(-0.2)], [(), ()])
    assert rows["b"].run is not None and rows["b"].run.token_ids == [11, 12, 13]
    assert [len(t) for t in rows["b"].run.top] == [2, 2, 2]
    assert rows["c"].run is None and rows["c"].token_id == 31
    plain = wire.step_outcome_from_proto(
        wire.step_result(9, {"a": outcomes["a"], "c": Outcome(31, -0.3)}, None)
    )
    assert plain.sampled is not None
    assert plain.sampled["a"][0] == [21, 22] and plain.sampled["c"][0] == 31
    broken = wire.step_result(9, outcomes, None)
    broken.token_counts[0] = 5
    assert wire.step_outcome_from_proto(broken).error is not None


def test_a_lost_shard_mid_run_re_prefills_and_tokens_stay_exact() -> None:
    prompts = {f"s{i}": [i + 1] * (3 + i) for i in range(6)}
    core = core_with(2, decode_steps=4)
    fleet = Fleet(core, 2)
    for sid, p in prompts.items():
        core.submit(Request(sid, p, 22))
    for _ in range(3):
        fleet.step()
    st = core.next_step()
    assert st is not None and max(p.steps for p in st.seqs) == 4
    results = fleet.execute(st, skip_shard=0)  # shard 0 dies during the plan
    moved = fleet.lose(0)
    assert moved
    fleet.record(core.apply(st, results))
    fleet.run()
    for sid, p in prompts.items():
        assert fleet.out[sid] == reference(p, 22), sid  # nothing lost, nothing duplicated
    assert core.stats().recoveries == len(moved)


def test_plans_aborted_newest_first_run_again_from_the_same_positions() -> None:
    core = core_with(plan_ahead=True, decode_steps=4)
    fleet = Fleet(core, 1)
    fleet.overwrite = True  # the lost plans' KV stays at the shard; a re-run overwrites it
    core.submit(Request("a", [1, 2, 3], 30))
    for _ in range(2):
        fleet.step()
    s0 = core.next_step()
    fleet.send(s0)
    s1 = core.next_step()
    fleet.send(s1)
    assert s0 is not None and s1 is not None and s1.seqs[0].use_last_sample and s1.seqs[0].steps == 4
    fleet.attend(s0)  # gpu_dense ran s0 and died in s1: neither result reaches the scheduler
    core.abort(s1)
    core.abort(s0)
    again = core.next_step()
    assert again is not None and again.seqs[0].start_pos == s0.seqs[0].start_pos
    fleet.plans.append(again)
    fleet.send(again)
    fleet.complete(again)
    fleet.run_ahead()
    assert fleet.out["a"] == reference([1, 2, 3], 30)
