"""Algorithm 1 (load-stabilizing admission) on hand-worked cases, and the paper's Figure 7.

Units used throughout (see fastdecode/scheduling/admission.py): a sequence started at step r holds
t - r + 1 tokens during step t (one prompt token at its prefill step, then one more per decode step;
base = prompt - 1 = 0, the paper's model). A sequence "of length S = 6" lives during steps r .. r+5,
holds 6 tokens in its last step, and its micro-batch ends at E = r + 6. W[i] is the total load during
micro-batch i's last step.

Figure 7 reading: B = 6 sequences of length S = 6. Naive: all six start together and hold 6 x 6 = 36
tokens in their last step. Stabilized: micro-batches of m = 2 started F = m*S/B = 2 steps apart, three
live at a time, whose last-step loads are 2 x (6 + 4 + 2) = 24 = B*(S+F)/2. Algorithm 1's "+1" keeps
one step of growth (m tokens) in hand, so the W_lim that admits exactly that schedule is 24 + m = 26.
"""

from __future__ import annotations

import pytest

from fastdecode.runtime.errors import InvalidInput
from fastdecode.scheduling.admission import (
    Candidate,
    MicroBatch,
    NaiveAdmission,
    StabilizedAdmission,
    earliest_start,
    start_micro_batch,
)


def mb(size: int, end: int, load: float) -> MicroBatch:
    return MicroBatch(size=size, end=end, load=load, start=end - 6, counted=size)


# ------------------------------------------------------------------ earliest_start, by hand


def test_no_live_batch_starts_now() -> None:
    assert earliest_start(5, 2, 6, [], 26) == 5


def test_paper_formula_by_hand() -> None:
    # E - floor((W_lim - W) / m) + 1 = 6 - floor((26 - 20) / 2) + 1 = 4
    assert earliest_start(2, 2, 6, [mb(2, 6, 20)], 26) == 4
    # already allowed in the past: r = t
    assert earliest_start(5, 2, 6, [mb(2, 6, 12)], 26) == 5
    # floor of an odd remainder: 6 - floor(5 / 2) + 1 = 5
    assert earliest_start(2, 2, 6, [mb(2, 6, 20)], 25) == 5
    # exactly full: must wait until past its end, 6 - 0 + 1 = 7
    assert earliest_start(5, 2, 6, [mb(2, 6, 26)], 26) == 7
    # over the limit (W > W_lim): floor(-1/2) = -1 -> 6 + 1 + 1 = 8
    assert earliest_start(3, 2, 6, [mb(2, 6, 27)], 26) == 8


def test_the_tightest_live_batch_wins_and_ended_batches_are_ignored() -> None:
    live = [mb(2, 6, 20), mb(2, 8, 12), mb(2, 3, 1000)]  # the last ended at 3 <= t
    # batch 1: 6 - 3 + 1 = 4; batch 2: 8 - 7 + 1 = 2 -> 4
    assert earliest_start(3, 2, 6, live, 26) == 4


def test_micro_batch_size_scales_the_step() -> None:
    # m = 1: 6 - floor(6 / 1) + 1 = 1 -> t; m = 3: 6 - 2 + 1 = 5
    assert earliest_start(2, 1, 6, [mb(2, 6, 20)], 26) == 2
    assert earliest_start(2, 3, 6, [mb(2, 6, 20)], 26) == 5
    with pytest.raises(InvalidInput):
        earliest_start(2, 0, 6, [], 26)


def test_prompt_base_counts_per_sequence() -> None:
    # W with prompts = 20 + 3 * 2 counted = 26; new batch brings 2 * 3: 6 - floor((40 - 26 - 6)/2) + 1 = 3
    assert earliest_start(2, 2, 6, [mb(2, 6, 20)], 40, base=3) == 3


def test_start_update_is_the_papers() -> None:
    live = [MicroBatch(size=2, end=6, load=12, start=0, counted=2)]
    new = start_micro_batch(2, 2, 6, live, ["a", "b"])
    # adds (E - t) * m = (6 - 2) * 2 to the live one; appends W = m * S
    assert live[0].load == 12 + 8 and live[0].counted == 4
    assert (new.size, new.end, new.load, new.start, new.counted) == (2, 8, 12, 2, 2)
    assert new.members == {"a", "b"} and live[-1] is new


# ------------------------------------------------------------------ Figure 7, driven end to end


def drive(policy: object, B: int = 6, S: int = 6, steps: int = 40) -> tuple[list[int], list[int], list[int]]:
    """Run the policy against an endless queue of identical sequences; returns per-step load,
    running count and start steps."""
    running: dict[str, int] = {}
    loads, counts, starts = [], [], []
    n = 0
    for t in range(steps):
        for sid, r in list(running.items()):
            if t >= r + S:  # its last step was t - 1
                del running[sid]
                policy.finished(t - 1, sid)
        cands = [Candidate(f"s{n + i}", 1, S) for i in range(B)]
        k = policy.admissible(t, cands, len(running), B)
        policy.started(t, cands[:k])
        for c in cands[:k]:
            running[c.seq_id] = t
        if k:
            starts.append(t)
        n += k
        loads.append(sum(t - r + 1 for r in running.values()))
        counts.append(len(running))
    return loads, counts, starts


def test_figure7_naive_peaks_at_36() -> None:
    loads, counts, _ = drive(NaiveAdmission())
    assert max(loads) == 36
    assert min(counts) == 6


@pytest.mark.parametrize("w_limit", [26.0, None])  # explicit B*(S+F)/2 + m, and derived
def test_figure7_stabilized_peaks_at_24_with_six_running(w_limit: float | None) -> None:
    policy = StabilizedAdmission(w_limit=w_limit, micro_batch=2)
    loads, counts, starts = drive(policy)
    assert max(loads) == 24
    # steady state: a micro-batch every F = 2 steps, the GPU still sees B = 6 sequences
    assert starts[:8] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert counts[4:] == [6] * (len(counts) - 4)
    assert loads[6:12] == [18, 24, 18, 24, 18, 24]


def test_figure7_without_ramp_clumps() -> None:
    # Cold start without the ramp: the earliest-start rule packs the first batches together and the
    # clumped rhythm keeps fewer sequences running. This is why W_lim ramps up.
    loads, counts, starts = drive(StabilizedAdmission(w_limit=26, micro_batch=2, ramp_steps=0))
    assert counts[0] == 4  # two micro-batches at step 0 (6 - floor((26 - 12) / 2) + 1 = 0)
    assert max(loads) <= 24
    assert sum(counts[10:]) / len(counts[10:]) < 6


def test_idle_system_always_admits_its_first_micro_batch() -> None:
    policy = StabilizedAdmission(w_limit=1, micro_batch=2)
    cands = [Candidate("a", 10, 100), Candidate("b", 10, 100), Candidate("c", 10, 100)]
    assert policy.admissible(0, cands, 0, 8) == 2
    policy.started(0, cands[:2])
    assert policy.admissible(1, cands[2:], 2, 8) == 0


def test_early_finish_frees_its_load() -> None:
    policy = StabilizedAdmission(w_limit=26, micro_batch=2, ramp_steps=0)
    cands = [Candidate(f"s{i}", 1, 6) for i in range(4)]
    policy.started(0, cands[:2])
    policy.started(1, cands[2:])
    first = policy.live()[0]
    assert (first.load, first.counted) == (22, 4)
    policy.finished(3, "s2")  # one of the later batch stopped early: no load at the first's end
    assert (first.load, first.counted) == (22 - 5, 3)
    policy.finished(3, "s0")
    policy.finished(3, "s1")
    assert first not in policy.live()


def test_naive_admits_up_to_room() -> None:
    cands = [Candidate(f"s{i}", 1, 6) for i in range(5)]
    assert NaiveAdmission().admissible(0, cands, 3, 6) == 3
    assert NaiveAdmission().admissible(0, cands, 6, 6) == 0
    assert NaiveAdmission().w_limit(0) is None


def test_w_limit_stays_within_the_kv_the_shards_hold() -> None:
    from fastdecode.scheduling import Request, SchedulerCore, ShardSpec

    policy = StabilizedAdmission(w_limit=10_000)
    core = SchedulerCore([ShardSpec(1000), ShardSpec(600)], [0], admission=policy)
    assert policy.w_limit(0) == 1600  # W counts tokens held, and the shards hold 1600
    core.shard_lost(1)
    assert policy.w_limit(0) == 1000
    core.shard_recovered(1)
    core.add_shard(ShardSpec(400))
    assert policy.w_limit(0) == 2000
    core.submit(Request("a", [1] * 4, 8))
    assert core.next_step() is not None
