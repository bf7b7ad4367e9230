"""Speculative verification on the emulated device: drafts kept at the given per-position rates
(seeded, deterministic), every row's d + 1 positions charged in the roofline and attended on the
shards, the rejected positions written over by the next step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from fastdecode.contract import PlannedSeq, SamplingParams
from fastdecode.dense import StepRunner
from fastdecode.dense.emulated import RECORDED_ACCEPTANCE, EmulatedAcceptance, load_emulated
from fastdecode.runtime.errors import InvalidInput
from tests.unit.test_dense_runner import InProcessShards


def test_kept_is_deterministic_and_follows_the_rates() -> None:
    acc = EmulatedAcceptance((0.8, 0.6, 0.3), seed=7)
    kept = [acc.kept(f"s{i}", 3, 3) for i in range(20000)]
    assert kept == [acc.kept(f"s{i}", 3, 3) for i in range(20000)]  # the same rows keep the same drafts
    assert kept != [EmulatedAcceptance((0.8, 0.6, 0.3), seed=8).kept(f"s{i}", 3, 3) for i in range(20000)]
    for j, rate in enumerate((0.8, 0.6, 0.3)):  # rates[j]: the share of rows that keep their (j+1)-th
        assert sum(n > j for n in kept) / len(kept) == pytest.approx(rate, abs=0.015)
    assert sum(kept) / len(kept) + 1 == pytest.approx(acc.expected_tau(3), abs=0.03)
    assert acc.expected_tau(3) == pytest.approx(1 + 0.8 + 0.6 + 0.3)
    # the row's next step draws anew
    assert [acc.kept("s0", i, 3) for i in range(64)] != [acc.kept("s0", 0, 3)] * 64


def test_rates_keep_a_running_minimum_and_the_last_rate_past_the_list() -> None:
    acc = EmulatedAcceptance((0.5, 0.9))
    assert acc.floors(4) == [0.5, 0.5, 0.5, 0.5]  # a second draft only with the first
    assert EmulatedAcceptance((1.0,)).kept("a", 0, 5) == 5
    assert EmulatedAcceptance((0.0,)).kept("a", 0, 5) == 0
    assert acc.kept("a", 0, 0) == 0
    # the default is the record's: 1 + the rates, as bench spec measured tau (3.25 at k = 4)
    assert EmulatedAcceptance().rates == RECORDED_ACCEPTANCE
    assert EmulatedAcceptance().expected_tau(4) == pytest.approx(3.25)


def test_parse() -> None:
    assert EmulatedAcceptance.parse(None).rates == RECORDED_ACCEPTANCE
    assert EmulatedAcceptance.parse(" ").rates == RECORDED_ACCEPTANCE
    assert EmulatedAcceptance.parse("0.7,0.5", seed=2) == EmulatedAcceptance((0.7, 0.5), 2)
    for bad in ("x", "0.5,,0.2", "1.5", "-0.1"):
        with pytest.raises(InvalidInput, match="acceptance"):
            EmulatedAcceptance.parse(bad)


def test_verified_rows_charge_every_position_and_keep_drafts_at_the_rates(llama_dir: Path) -> None:
    rates = "0.9,0.6,0.3"
    model = load_emulated(llama_dir, "emulated:h100", torch.bfloat16, None, rates)
    acc = EmulatedAcceptance.parse(rates)
    shards = InProcessShards(model, 2)  # type: ignore[arg-type]
    runner = StepRunner(model, shards)  # type: ignore[arg-type]
    n, context = 8, 12
    for i in range(n):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    greedy = SamplingParams(temperature=0.0)

    def run(seqs: list[PlannedSeq]) -> dict:
        return asyncio.run(runner.run(seqs, True))[0]

    # the prompts: every row's context on its shard
    run([PlannedSeq(f"s{i}", i % 2, i % 2, [1, 2 + i] * (context // 2), 0, greedy) for i in range(n)])
    # a verification step: row i carries i % 4 drafts (d + 1 positions at start_pos context)
    drafts = [i % 4 for i in range(n)]
    seqs = [
        PlannedSeq(
            f"s{i}", i % 2, i % 2, [7] + [40 + j for j in range(d)], context, greedy, sample_index=5, drafts=d
        )
        for i, d in enumerate(drafts)
    ]
    before = model.clock.compute_seconds
    out = run(seqs)
    charged = model.clock.compute_seconds - before
    halves = [sum(d + 1 for d in drafts[0::2]), sum(d + 1 for d in drafts[1::2])]
    layers = model.config.num_hidden_layers
    expected = sum(layers * model.roofline.layer_seconds(t) for t in halves)
    # the head over the verified rows' d + 1 positions, and (as with real weights, a call of its own)
    # over the plain rows
    expected += model.roofline.head_seconds(sum(d + 1 for d in drafts if d))
    expected += model.roofline.head_seconds(drafts.count(0))
    assert charged == pytest.approx(expected, rel=1e-6)  # d + 1 positions in the layers and the head
    # the shards attended (and hold) every row's d + 1 positions
    held = [sum(context + d + 1 for d in drafts[s::2]) for s in (0, 1)]
    assert [st.tokens_held for st in shards.stores] == held
    emitted = {}
    for i, d in enumerate(drafts):
        o = out[f"s{i}"]
        toks = [o.token_id] + [a.token_id for a in o.after]
        kept = acc.kept(f"s{i}", 5, d)
        assert toks[:-1] == [40 + j for j in range(kept)] and len(toks) == kept + 1
        if d:  # the synthetic target's token: the last kept (a plain row's comes from the logits)
            assert toks[-1] == (toks[-2] if kept else 7)
        emitted[i] = len(toks)
    assert len(set(emitted.values())) > 1  # some rows kept more than others
    # the next step starts after the kept tokens: the rejected positions are written over
    nxt = [
        PlannedSeq(f"s{i}", i % 2, i % 2, [9], context + emitted[i], greedy, sample_index=6) for i in range(n)
    ]
    run(nxt)
    held = [sum(context + emitted[i] + 1 for i in range(s, n, 2)) for s in (0, 1)]
    assert [st.tokens_held for st in shards.stores] == held
