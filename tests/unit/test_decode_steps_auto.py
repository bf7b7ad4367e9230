"""`--decode-steps auto`: up to AUTO_DECODE_STEPS decode steps a plan while no request waits to be
admitted or prefilled, one while one does; the setting and flags that take it. The fake fleet
(tests/support/core_fleet.py) checks every position and block: tokens must equal a run without
scheduling (what one step a plan gives)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from fastdecode.cli.common import main
from fastdecode.contract import SamplingParams
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.settings import SchedulerSettings, parse_decode_steps
from fastdecode.scheduling import Request, Step
from fastdecode.scheduling.runs import AUTO_DECODE_STEPS, DecodeRuns
from fastdecode.spec import NgramConfig, NgramProposer
from tests.support.core_fleet import Fleet, core_with, planned, reference


def _runs(decode_steps: int | str, waiting: list[bool]) -> DecodeRuns:
    load = core_with(1).load  # (only a stop reads it)
    return DecodeRuns(decode_steps, frozenset({0}), load, lambda: waiting[0])  # type: ignore[arg-type]


def test_auto_runs_the_cap_while_none_waits_and_one_while_one_does() -> None:
    waiting = [False]
    runs = _runs("auto", waiting)
    req = Request("a", [1, 2, 3], 100)
    assert AUTO_DECODE_STEPS == 8 and runs.plan_steps() == 8
    assert runs.steps(req, 1, runs.plan_steps()) == 8
    assert runs.steps(req, 97, runs.plan_steps()) == 3  # max_tokens still bounds a row
    waiting[0] = True
    assert runs.plan_steps() == 1 and runs.steps(req, 1, runs.plan_steps()) == 1
    fixed = _runs(4, waiting)  # a fixed k never asks
    assert fixed.plan_steps() == 4 and fixed.steps(req, 1) == 4
    scored = Request("p", [1, 2], 100, sampling=SamplingParams(prompt_logprobs=True))
    waiting[0] = False
    assert runs.steps(scored, 1, runs.plan_steps()) == 1  # still one step for a chunk scoring its prompt


@pytest.mark.parametrize("bad", [0, 17, "Auto", "4", True, None])
def test_the_core_refuses_what_is_not_a_count_or_auto(bad: object) -> None:
    with pytest.raises(InvalidInput, match="decode_steps must be auto or in"):
        core_with(1, decode_steps=bad)


def _steps_of(st: Step) -> dict[str, int]:
    return {p.seq_id: p.steps for p in st.seqs if p.sample}


def test_a_newcomer_makes_every_plan_one_step_until_its_first_token() -> None:
    core = core_with(1, prefill_token_budget=4, decode_steps="auto")
    fleet = Fleet(core, 1)
    core.submit(Request("a", [3, 1, 4], 40))
    first = fleet.step()  # a's prompt: it waits for its first token
    assert first is not None and _steps_of(first) == {"a": 1}
    st = fleet.step()
    assert st is not None and _steps_of(st) == {"a": 8}  # nobody waits: the cap
    core.submit(Request("b", [9] * 9, 12))  # three prefill chunks at a budget of 4: 4, 4, then 1
    for _ in range(3):
        st = fleet.step()
        assert st is not None and planned(st, "b") is not None
        assert _steps_of(st)["a"] == 1  # b is prefilling: one step for a too
    assert planned(st, "b").steps == 1  # its last chunk, a single token, samples at once
    assert fleet.out["b"] == reference([9] * 9, 1)  # its first token came with its last chunk
    st = fleet.step()
    assert st is not None and _steps_of(st) == {"a": 8, "b": 8}
    fleet.run()
    assert fleet.out["a"] == reference([3, 1, 4], 40) and fleet.out["b"] == reference([9] * 9, 12)
    assert fleet.reserved == [{}] and fleet.refusals == 0


def test_a_request_queued_behind_a_full_batch_keeps_plans_at_one_step() -> None:
    core = core_with(1, max_running=1, decode_steps="auto")
    fleet = Fleet(core, 1)
    core.submit(Request("a", [3, 1, 4], 20))
    fleet.step()
    core.submit(Request("b", [2, 7], 5))  # not admitted until a leaves: its finish is seen at once
    while "b" not in fleet.out:
        st = fleet.step()
        assert st is not None and all(p.steps == 1 for p in st.seqs)
    fleet.run()
    assert fleet.out["a"] == reference([3, 1, 4], 20) and fleet.out["b"] == reference([2, 7], 5)
    assert max(p.steps for st in fleet.plans for p in st.seqs) == 4  # b alone: the last 4 in one plan
    assert fleet.reserved == [{}] and fleet.refusals == 0


def test_plan_ahead_counts_a_last_chunk_in_flight_as_served() -> None:
    """With plan-ahead the plan after a newcomer's last prefill chunk is made while that chunk runs:
    its first token is on the way, so that plan may run the cap; a non-last chunk in flight keeps
    plans at one step (its next chunk would wait behind them)."""
    core = core_with(1, prefill_token_budget=4, plan_ahead=True, decode_steps="auto")
    fleet = Fleet(core, 1)
    core.submit(Request("a", [3, 1, 4], 60))
    while len(fleet.out.get("a", [])) < 2:
        fleet.step()
    core.submit(Request("b", [7] * 6, 20))  # two chunks: 4, then 2 with its first token
    s0 = core.next_step()
    assert s0 is not None and planned(s0, "b") is not None and not planned(s0, "b").sample
    fleet.send(s0)
    s1 = core.next_step()  # planned ahead while s0 runs: b's first chunk is in flight, not its last
    assert s1 is not None and _steps_of(s1) == {"a": 1}
    fleet.complete(s0)
    fleet.send(s1)
    s2 = core.next_step()
    assert s2 is not None and _steps_of(s2) == {"a": 1, "b": 1}  # b's last chunk samples
    fleet.complete(s1)
    fleet.send(s2)
    s3 = core.next_step()  # b's first token is in s2, out: nobody waits behind s3
    assert s3 is not None and _steps_of(s3) == {"a": 8, "b": 8}  # both planned ahead, at the cap
    fleet.complete(s2)
    assert fleet.out["b"] == reference([7] * 6, 1)
    fleet.send(s3)
    fleet.complete(s3)
    fleet.run_ahead()
    assert fleet.out["a"] == reference([3, 1, 4], 60) and fleet.out["b"] == reference([7] * 6, 20)
    assert fleet.reserved == [{}] and fleet.refusals == 0


def _arriving(k: int | str, ahead: bool) -> Fleet:
    """Six requests, one joining every fifth turn of the driver's loop, run to the end."""
    core = core_with(2, prefill_token_budget=5, plan_ahead=ahead, decode_steps=k)
    fleet = Fleet(core, 2, eos_at={"s3": 7})
    arrivals = [(f"s{i}", [i + 2] * (2 + 3 * i)) for i in range(6)]
    turn = 0

    def arrive() -> None:
        nonlocal turn
        turn += 1
        if turn % 5 == 1 and arrivals:
            sid, p = arrivals.pop(0)
            core.submit(Request(sid, p, 19 + len(p)))

    idle = False
    while arrivals or not idle:  # (the step after the last token sends its releases)
        if ahead:
            fleet.run_ahead(each=arrive)  # to the first idle turn
            idle = True
        else:
            arrive()
            idle = fleet.step() is None
    assert fleet.reserved == [{}, {}] and fleet.refusals == 0
    return fleet


@pytest.mark.parametrize("ahead", [False, True])
def test_auto_tokens_equal_one_step_a_plan_with_requests_arriving_mid_run(ahead: bool) -> None:
    one, auto = _arriving(1, ahead), _arriving("auto", ahead)
    assert len(auto.out) == 6 and auto.out == one.out and auto.finish == one.finish
    assert one.finish["s3"] == "stop"
    rows = [p for st in auto.plans for p in st.seqs]
    assert max(p.steps for p in rows) == AUTO_DECODE_STEPS  # the cap between arrivals
    for st in auto.plans:  # a plan that prefills or samples a first token runs one step
        if any(not p.sample or p.sample_index == 0 for p in st.seqs):
            assert all(p.steps == 1 for p in st.seqs), st.step
    assert len(auto.plans) < len(one.plans)


def test_with_speculation_auto_plans_one_step_a_row() -> None:
    core = core_with(1, decode_steps="auto", proposer=NgramProposer(NgramConfig(3, 1, 4)))
    fleet = Fleet(core, 1)
    core.submit(Request("a", [3, 1, 4], 20))
    fleet.run()
    assert fleet.out["a"] == reference([3, 1, 4], 20)
    assert {p.steps for st in fleet.plans for p in st.seqs} == {1}
    with pytest.raises(InvalidInput, match="decode_steps 1 or auto"):
        core_with(1, decode_steps=2, proposer=NgramProposer(NgramConfig(3, 1, 4)))


def _settings(**kw: object) -> SchedulerSettings:
    return SchedulerSettings(dense="fake:1", shards="fake:2", **kw)  # type: ignore[arg-type]


def test_the_setting_takes_auto_and_counts_and_refuses_the_rest_in_one_line() -> None:
    assert _settings().decode_steps == 1  # the default stays one step a plan
    assert _settings(decode_steps="auto").decode_steps == "auto"
    assert _settings(decode_steps="8").decode_steps == 8 and _settings(decode_steps=16).decode_steps == 16
    assert _settings(decode_steps="auto", speculative="ngram").decode_steps == "auto"
    for bad in ("0", "17", "x", "AUTO", "", 2.5, True):
        with pytest.raises(ValidationError) as e:
            _settings(decode_steps=bad)
        assert e.value.error_count() == 1
        assert "--decode-steps must be auto or a whole number in [1, 16]" in str(e.value)
    with pytest.raises(ValidationError, match="--speculative needs --decode-steps 1 or auto"):
        _settings(decode_steps=4, speculative="ngram")
    assert parse_decode_steps(" auto ") == "auto" and parse_decode_steps("12") == 12


def test_the_environment_gives_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTDECODE_DECODE_STEPS", "auto")
    assert _settings().decode_steps == "auto"
    monkeypatch.setenv("FASTDECODE_DECODE_STEPS", "3")
    assert _settings().decode_steps == 3


@pytest.mark.parametrize(
    "args",
    [
        ["up", "--decode-steps", "0"],
        ["up", "--decode-steps", "eight"],
        ["serve", "scheduler", "--dense", "fake:1", "--shards", "fake:2", "--decode-steps", "17"],
    ],
)
def test_the_flags_refuse_a_bad_value_before_anything_starts(args: list[str]) -> None:
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "decode-steps" in res.output and (
        "auto or a whole number" in res.output or "1 or auto" in res.output
    )


def test_up_takes_auto_at_its_flag() -> None:
    from fastdecode.cli.up import up

    opt = next(p for p in up.params if p.name == "decode_steps")
    assert opt.default == 1
    assert opt.type.convert("auto", opt, None) == "auto" and opt.type.convert("8", opt, None) == 8
