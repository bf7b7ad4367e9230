"""Speculative drafts in the scheduler (SchedulerCore(proposer=...)): decode rows carry drafts, the
fake fleet verifies them as gpu_dense does and rolls the rejected positions back, and the tokens must
equal a run without any scheduling, wherever drafts are right, wrong or cut by a stop or max_tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from fastdecode.contract import SamplingParams
from fastdecode.runtime.errors import InvalidInput
from fastdecode.scheduling import Request, SchedulerCore
from fastdecode.scheduling.ports import StepTimes
from fastdecode.scheduling.types import Step
from fastdecode.spec import NgramConfig, NgramProposer
from fastdecode.spec.controller import DECIDE_EVERY
from tests.support.core_fleet import EOS, Fleet, core_with, reference

PROMPTS = {"a": [5, 6, 7], "b": [1, 2], "c": [9, 8, 7, 6, 5, 4, 3, 2, 1], "d": [4]}
MAX = {"a": 9, "b": 1, "c": 17, "d": 12}


class Oracle:
    """Drafts that know the model's continuation; every `wrong_every`-th proposal has its second
    draft wrong (so a row keeps one draft and rolls the others back)."""

    num_speculative_tokens = 3

    def __init__(self, wrong_every: int = 0, wrong_from: int = 1) -> None:
        self.wrong_every, self.wrong_from = wrong_every, wrong_from  # the draft made wrong
        self.calls = 0
        self.closed: list[int] = []

    def start(self, prompt: Sequence[int], *, tenant: str = "") -> _OracleState:
        return _OracleState(self, list(prompt))


class _OracleState:
    def __init__(self, oracle: Oracle, tokens: list[int]) -> None:
        self.oracle, self.tokens = oracle, tokens
        self.prompt = next(p for p in PROMPTS.values() if tokens[: len(p)] == p and len(p) < len(tokens))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def append(self, tokens: Sequence[int]) -> None:
        self.tokens += tokens

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def propose(self, k: int) -> list[int]:
        o = self.oracle
        o.calls += 1
        done = len(self.tokens) - len(self.prompt)
        out = reference(self.prompt, done + k)[done:]
        assert self.tokens[len(self.prompt) :] == reference(self.prompt, done)  # fed what was kept
        w = o.wrong_from
        if o.wrong_every and o.calls % o.wrong_every == 0 and len(out) > w:
            out[w] = (out[w] % 97) + 1 if out[w] != 97 else 1
        return out

    def close(self) -> None:
        self.oracle.closed.append(len(self.tokens))


@pytest.mark.parametrize("wrong_every", [0, 1, 3])
def test_tokens_equal_a_run_without_scheduling_whatever_the_drafts(wrong_every: int) -> None:
    oracle = Oracle(wrong_every)
    core = core_with(2, prefill_token_budget=4, proposer=oracle)
    fleet = Fleet(core, 2, eos_at={"d": 5})  # d samples EOS as its 5th token, inside a row's tokens
    for sid, prompt in PROMPTS.items():
        core.submit(Request(sid, prompt, MAX[sid]))
    fleet.run()
    for sid, prompt in PROMPTS.items():
        want = reference(prompt, 4) + [EOS] if sid == "d" else reference(prompt, MAX[sid])
        assert fleet.out[sid] == want, sid  # nothing after the stop, nothing past max_tokens
    assert fleet.reserved == [{}, {}] and fleet.refusals == 0
    rows = [p for st in fleet.plans for p in st.seqs if p.drafts]
    assert rows and all(p.sample_index + p.drafts < MAX[p.seq_id] for p in rows)  # within max_tokens
    assert all(p.token_ids[0] == fleet.out[p.seq_id][p.sample_index - 1] for p in rows)
    rows_, drafts, kept, emitted = core.stats().spec
    assert rows_ == len(rows) and drafts == sum(p.drafts for p in rows) and emitted == rows_ + kept
    if wrong_every:
        assert kept < drafts  # rejected drafts rolled back, and the tokens still right
    else:
        assert kept > 0
    assert len(oracle.closed) == len({p.seq_id for p in rows})  # each drafted sequence's state closed
    single = core_with(2, prefill_token_budget=4)
    plain = Fleet(single, 2, eos_at={"d": 5})
    for sid, prompt in PROMPTS.items():
        single.submit(Request(sid, prompt, MAX[sid]))
    plain.run()
    assert plain.out == fleet.out and len(fleet.plans) < len(plain.plans)


def test_requests_whose_processors_need_history_or_a_seed_get_no_drafts() -> None:
    core = core_with(1, proposer=Oracle())
    fleet = Fleet(core, 1)
    kinds = {
        "pen": SamplingParams(presence_penalty=0.5),
        "seed": SamplingParams(temperature=1.0, seed=3),
        "plp": SamplingParams(prompt_logprobs=1),
    }
    for sid, sp in kinds.items():
        core.submit(Request(sid, [5, 6, 7], 8, sampling=sp))
    core.submit(Request("a", [5, 6, 7], 8))
    for _ in range(200):
        if fleet.step() is None:
            break
    drafted = {p.seq_id for st in fleet.plans for p in st.seqs if p.drafts}
    assert drafted == {"a"}


def test_drafts_from_the_requests_own_tokens_and_refused_combinations() -> None:
    prompt = [3, 9, 4, 1, 3, 9, 4, 1, 3, 9]
    core = core_with(1, proposer=NgramProposer(NgramConfig(3, 1, 4)))
    core.submit(Request("r", prompt, 4, ignore_eos=True))
    st = core.next_step()
    assert st is not None and not st.seqs[0].drafts  # the prefill
    core.apply(st, {"r": (4, -0.1)})  # the model goes on with the pattern
    st = core.next_step()
    assert st is not None
    row = st.seqs[0]
    assert row.token_ids == [4, 1, 3] and row.drafts == 2  # max_tokens leaves room for two
    assert row.start_pos == len(prompt) and row.sample_index == 1
    events = core.apply(st, {"r": ([1, 3], [-0.1, -0.2])})  # one draft kept, then the model's own
    assert events[0].token_ids == [1, 3] and events[0].finish_reason is None
    st = core.next_step()
    assert st is not None and st.seqs[0].start_pos == len(prompt) + 2  # past the kept draft only
    with pytest.raises(InvalidInput):
        core_with(1, proposer=Oracle(), plan_ahead=True)
    with pytest.raises(InvalidInput):
        core_with(1, proposer=Oracle(), decode_steps=2)


def _run_with_costs(core: SchedulerCore, fleet: Fleet, times: Callable[[Step], StepTimes | None]) -> None:
    """The driver's loop: each step run and applied, then its costs shown to drafting."""
    assert core.drafting is not None
    for _ in range(10_000):
        st = fleet.step()
        if st is None:
            return
        core.drafting.stepped(st, times(st), 0.0)
    raise AssertionError("did not finish")


def _cpu_times(st: Step) -> StepTimes:
    """A CPU S-part: 1 ms a position, the shards a tenth of the step, nothing overlapped."""
    s = 0.001 * sum(len(p.token_ids) for p in st.seqs)
    return StepTimes(s, 0.1 * s, 1.1 * s)


@pytest.mark.parametrize("speculative_k", ["auto", "fixed"])
def test_costly_drafts_are_turned_off_unless_k_is_fixed(speculative_k: str) -> None:
    # every row's first draft is wrong (tau 1), and on this S-part 4 positions cost 4 times one
    prompts = {"a": PROMPTS["a"], "c": PROMPTS["c"]}
    core = core_with(2, proposer=Oracle(wrong_every=1, wrong_from=0), speculative_k=speculative_k)
    fleet = Fleet(core, 2)
    for sid, prompt in prompts.items():
        core.submit(Request(sid, prompt, 300, ignore_eos=True))
    _run_with_costs(core, fleet, _cpu_times)
    for sid, prompt in prompts.items():
        assert fleet.out[sid] == reference(prompt, 300), sid  # whatever k, the same tokens
    assert core.drafting is not None
    late = [p.drafts for st in fleet.plans[2 * DECIDE_EVERY :] for p in st.seqs]
    stats = core.stats()
    if speculative_k == "fixed":
        assert stats.spec_k == 3 and all(d == 3 for d in late[:20])
        assert core.drafting.control.decisions == 0
    else:
        assert stats.spec_k == 0 and core.drafting.control.decisions > 1
        assert sum(d > 0 for d in late) < len(late) / 4  # off, but for a probe now and then
        assert any(d == 3 for d in late)  # the probes
    asked, found = core.drafting.asked_at, core.drafting.found_at
    assert asked[0] >= asked[1] >= asked[2] > 0 and found == asked  # the oracle always finds them
    assert core.drafting.offered_at[0] <= found[0]


def test_drafts_stay_without_timings_and_cheap_drafts_stay_on() -> None:
    for times in (lambda st: None, lambda st: StepTimes(0.01, 0.05, 0.05)):  # none, or flat and shard-bound
        core = core_with(1, proposer=Oracle())
        fleet = Fleet(core, 1)
        core.submit(Request("c", PROMPTS["c"], 300, ignore_eos=True))
        _run_with_costs(core, fleet, times)
        assert fleet.out["c"] == reference(PROMPTS["c"], 300)
        assert core.stats().spec_k == 3
        assert all(p.drafts == 3 for st in fleet.plans[1:-2] for p in st.seqs)
    assert core_with(1).stats().spec_k is None  # no speculation, no k
