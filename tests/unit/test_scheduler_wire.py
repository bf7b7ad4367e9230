"""The scheduler's step messages through the wire and back: a plan's columns whose rows share
sampling settings (converted once a step), a plan or result whose columns disagree refused, the
result's sparse parts (error, top, prompt logprobs) only where set, and a token event's repeated
parts only when present."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastdecode.contract import LAST_SAMPLE, PlannedSeq, SamplingParams, TokenLogprob
from fastdecode.dense.outcome import Outcome, Timings
from fastdecode.gateway.core import UpstreamEvent
from fastdecode.runtime.errors import InternalError, InvalidInput, ResourceExhausted, Status, Unavailable
from fastdecode.scheduling.ports import StepTimes
from fastdecode.scheduling.types import Step, TokenEvent
from fastdecode.v1 import dense_pb2, scheduler_pb2
from fastdecode.wire.dense import planned_seqs_from_proto, step_outcome_from_proto, step_plan, step_result
from fastdecode.wire.gateway import UpstreamFailure, session_events_from_proto
from fastdecode.wire.scheduler import session_events_to_proto, token_event_to_proto


def test_a_plan_comes_back_the_same_with_shared_and_distinct_sampling_settings() -> None:
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.5, top_k=5, suppress_ids=(3,))
    odd = SamplingParams(temperature=0.25, suppress_ids=[1, 2])  # type: ignore[arg-type] - unhashable
    seqs = [
        PlannedSeq("a", 0, 0, [1, 2, 3], 0, hot, False, 0),
        PlannedSeq("b", 1, 1, [4], 9, greedy, True, 2),
        PlannedSeq("c", 1, 0, [5], 7, hot, True, 1, next_token=6),
        PlannedSeq("d", 0, 1, [6], 3, odd, True, 0),
        PlannedSeq("e", 0, 0, [7], 4, greedy, True, 5),
        PlannedSeq("f", 1, 1, [LAST_SAMPLE], 11, greedy, True, 3, use_last_sample=True),
    ]
    wire = dense_pb2.StepPlan.FromString(
        step_plan(Step(4, seqs, [], [], ended=["z"]), True).SerializeToString()
    )
    assert wire.step == 4 and wire.pipeline and list(wire.ended) == ["z"]
    back = planned_seqs_from_proto(wire)
    expect = [
        *seqs[:3],
        PlannedSeq("d", 0, 1, [6], 3, SamplingParams(0.25, suppress_ids=(1, 2)), True, 0),
        *seqs[4:],
    ]
    assert back == expect  # every field, sampling settings and next_token included
    assert len(wire.samplings) == 3  # greedy and hot once each, the unhashable one apart
    assert list(wire.token_counts) == [3, 1, 1, 1, 1, 0]  # a row planned ahead carries no token


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda w: w.shards.pop(), "columns have different lengths"),
        (lambda w: w.token_ids.append(9), "token_counts do not add up"),
        (lambda w: w.sampling_index.__setitem__(0, 7), "sampling_index outside"),
    ],
)
def test_a_plan_whose_columns_disagree_is_invalid_input(spoil: Callable, message: str) -> None:
    seqs = [PlannedSeq("a", 0, 0, [1, 2], 0), PlannedSeq("b", 0, 1, [3], 5)]
    wire = step_plan(Step(1, seqs, [], []), True)
    spoil(wire)
    with pytest.raises(InvalidInput, match=message):
        planned_seqs_from_proto(wire)


def test_a_result_whose_columns_disagree_fails_the_step() -> None:
    result = step_result(2, {"a": Outcome(5, -0.5), "b": Outcome(6, -0.5)}, None)
    result.logprobs.pop()
    outcome = step_outcome_from_proto(result)
    assert outcome.items == [] and isinstance(outcome.error, InternalError)


def test_a_result_brings_the_steps_timings_to_the_scheduler() -> None:
    t = Timings(s_part_seconds=0.004, attend_seconds=0.01, step_seconds=0.012, shard_wait_seconds=0.008)
    for outcomes in ({"a": Outcome(5, -0.5)}, {"a": Outcome(5, -0.5, top=((5, -0.5),))}):
        wire = dense_pb2.StepResult.FromString(step_result(4, outcomes, t).SerializeToString())
        assert step_outcome_from_proto(wire).timings == StepTimes(0.004, 0.01, 0.012)
    assert step_outcome_from_proto(step_result(4, {"a": Outcome(5, -0.5)}, None)).timings is None


def test_a_result_keeps_errors_top_and_prompt_logprobs_and_leaves_them_empty_elsewhere() -> None:
    lp = [TokenLogprob(8, -0.25, ((8, -0.25), (9, -2.0)))]
    outcomes = {
        "plain": Outcome(5, -0.5),
        "top": Outcome(6, -0.5, top=((6, -0.5), (7, -3.0))),
        "scored": Outcome(-1, 0.0, prompt=lp),
        "full": Outcome(-1, 0.0, error=ResourceExhausted("no free block")),
    }
    result = dense_pb2.StepResult.FromString(step_result(3, outcomes, None).SerializeToString())
    items = {r.seq_id: r for r in step_outcome_from_proto(result).items}
    assert (items["plain"].token_id, items["plain"].error, items["plain"].top) == (5, None, ())
    assert items["plain"].prompt_logprobs == []
    assert items["top"].top == ((6, -0.5), (7, -3.0))
    assert [(p.token_id, p.top) for p in items["scored"].prompt_logprobs] == [(8, ((8, -0.25), (9, -2.0)))]
    err = items["full"].error
    assert err is not None and err.status is Status.RESOURCE_EXHAUSTED and "no free block" in err.message


def test_a_decode_steps_result_comes_as_a_dict_and_rows_reads_either_form() -> None:
    outcomes = {"a": Outcome(5, -0.5), "b": Outcome(-1, 0.0), "c": Outcome(7, -0.25)}
    result = dense_pb2.StepResult.FromString(step_result(4, outcomes, None).SerializeToString())
    outcome = step_outcome_from_proto(result)
    # nothing but tokens and logprobs: no object per sequence, -1 where nothing was sampled
    assert outcome.items == [] and outcome.sampled == {"a": (5, -0.5), "b": (-1, 0.0), "c": (7, -0.25)}
    assert [(r.seq_id, r.token_id, r.logprob, r.error) for r in outcome.rows()] == [
        ("a", 5, -0.5, None),
        ("b", -1, 0.0, None),
        ("c", 7, -0.25, None),
    ]
    outcomes["d"] = Outcome(-1, 0.0, error=ResourceExhausted("no free block"))
    result = dense_pb2.StepResult.FromString(step_result(5, outcomes, None).SerializeToString())
    outcome = step_outcome_from_proto(result)
    assert outcome.sampled is None and outcome.rows() is outcome.items and len(outcome.items) == 4


def test_a_token_event_sets_top_and_prompt_logprobs_only_when_present() -> None:
    plain = TokenEvent("s", [5], [-0.5], None, 32, 7, 100, 2)
    p = scheduler_pb2.TokenEvent.FromString(token_event_to_proto(plain).SerializeToString())
    assert (list(p.token_ids), p.finish_reason, p.completion_tokens, p.step, p.shard) == ([5], "", 7, 100, 2)
    assert len(p.top) == 0 and len(p.prompt_logprobs) == 0
    rich = TokenEvent(
        "s", [5], [-0.5], "stop", 32, 7, 100, 2, cached_tokens=16,
        top=[((5, -0.5), (6, -1.0))], prompt_logprobs=[TokenLogprob(3, -0.1, ((3, -0.1),))],
    )  # fmt: skip
    p = scheduler_pb2.TokenEvent.FromString(token_event_to_proto(rich).SerializeToString())
    assert p.finish_reason == "stop" and p.cached_tokens == 16
    assert [list(t.token_ids) for t in p.top] == [[5, 6]]
    assert [(q.token_id, list(q.top.token_ids)) for q in p.prompt_logprobs] == [(3, [3])]


def test_session_events_carry_plain_events_as_columns_and_keep_each_requests_order() -> None:
    def ev(sid: str, tok: int, step: int, **kw: object) -> TokenEvent:
        return TokenEvent(sid, [tok], [-0.5], kw.pop("finish", None), 4, 1, step, 0, **kw)  # type: ignore[arg-type]

    batch = [
        ("a", ev("a", 5, 10, cached_tokens=16)),  # plain: a column row
        ("b", ev("b", 6, 10, top=[((6, -0.5),)])),  # asks for top logprobs: a message
        ("c", ev("c", 7, 10)),  # plain in step 10, finished in step 11 (planned ahead): both messages
        ("a", ev("a", 8, 11, cached_tokens=16)),
        ("c", ev("c", 9, 11, finish="stop")),
        ("d", Unavailable("shard lost")),
    ]
    msg = scheduler_pb2.SessionEvents.FromString(session_events_to_proto(batch).SerializeToString())
    assert list(msg.plain_request_ids) == ["a", "a"] and list(msg.plain_token_ids) == [5, 8]
    assert list(msg.plain_steps) == [10, 11] and list(msg.plain_cached_tokens) == [16, 16]
    assert [e.request_id for e in msg.events] == ["b", "c", "c", "d"]
    got = session_events_from_proto(msg)
    for sid in "abc":  # every request's events arrive in the order they were made
        toks = [t for s, item in got if s == sid and isinstance(item, UpstreamEvent) for t in item.token_ids]
        assert toks == [t for s, e in batch if s == sid and isinstance(e, TokenEvent) for t in e.token_ids]
    (plain,) = [item for s, item in got if s == "a"][:1]
    assert isinstance(plain, UpstreamEvent) and plain.cached_tokens == 16 and plain.logprobs == [-0.5]
    (failure,) = [item for s, item in got if s == "d"]
    assert isinstance(failure, UpstreamFailure) and failure.status is Status.UNAVAILABLE


def test_session_events_whose_plain_columns_disagree_are_refused() -> None:
    msg = session_events_to_proto([("a", TokenEvent("a", [5], [-0.5], None, 4, 1, 3, 0))])
    msg.plain_logprobs.append(0.0)
    with pytest.raises(InternalError, match="plain columns"):
        session_events_from_proto(msg)


def test_session_events_carry_rows_of_several_tokens_as_plain_columns_with_their_counts() -> None:
    """A plan of several decode steps makes events of several tokens: still plain column rows (no
    message per request), their counts saying where each row ends; one token a row sends no counts."""
    batch = [
        ("a", TokenEvent("a", [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], None, 4, 4, 10, 0)),
        ("b", TokenEvent("b", [9], [-0.5], None, 4, 1, 10, 1, cached_tokens=16)),
        ("c", TokenEvent("c", [1, 2], [-0.6, -0.7], "stop", 4, 9, 10, 0)),  # finished: a message
    ]
    msg = scheduler_pb2.SessionEvents.FromString(session_events_to_proto(batch).SerializeToString())
    assert list(msg.plain_request_ids) == ["a", "b"] and list(msg.plain_token_counts) == [4, 1]
    assert list(msg.plain_token_ids) == [5, 6, 7, 8, 9] and [e.request_id for e in msg.events] == ["c"]
    got = dict(session_events_from_proto(msg))
    a, b = got["a"], got["b"]
    assert isinstance(a, UpstreamEvent) and a.token_ids == [5, 6, 7, 8] and len(a.logprobs) == 4
    assert isinstance(b, UpstreamEvent) and b.token_ids == [9] and b.cached_tokens == 16
    one = session_events_to_proto([("b", batch[1][1])])
    assert list(one.plain_token_counts) == []
    msg.plain_token_counts[0] = 3  # counts that do not add up to the tokens
    with pytest.raises(InternalError, match="plain columns"):
        session_events_from_proto(msg)
