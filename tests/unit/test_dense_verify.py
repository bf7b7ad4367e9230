"""Speculative rows through the dense step against in-process shards: drafts the target agrees with
are kept, the first it does not is replaced by its own token, and the KV of rejected positions is
rolled back, so the tokens equal plain greedy decoding's whatever the drafts were."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from fastdecode.contract import PlannedSeq, SamplingParams
from fastdecode.dense import StepRunner
from fastdecode.dense.engine import LocalEngine
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import InvalidInput
from tests.unit.test_dense_runner import InProcessShards

PROMPTS = [[1, 5, 9, 3], [1, 7, 2], [1, 4, 4, 8, 6]]
NEW = 12


def _speculate(path: object, want: dict[str, list[int]], draft: Callable[[str, int, int], list[int]]) -> dict:
    """Greedy decode of PROMPTS with each decode row carrying draft(seq, generated, k) drafts."""
    model = DenseModel.from_pretrained(path, "cpu", torch.float32)
    shards = InProcessShards(model, 2)
    runner = StepRunner(model, shards)
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(PROMPTS))}
    rows_per_step: list[int] = []
    for i in range(len(PROMPTS)):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    seqs = [PlannedSeq(f"s{i}", i % 2, i % 2, p, 0) for i, p in enumerate(PROMPTS)]

    async def run() -> None:
        nonlocal seqs
        while seqs:
            outcomes, _ = await runner.run(seqs)
            nxt = []
            for s in seqs:
                o = outcomes[s.seq_id]
                assert o.error is None, o.error
                toks = [o.token_id] + [a.token_id for a in o.after]
                assert 1 <= len(toks) <= s.drafts + 1
                rows_per_step.append(len(toks))
                out = got[s.seq_id]
                out += toks
                if len(out) >= NEW:
                    continue
                pos = s.start_pos + len(s.token_ids) - s.drafts + len(toks) - 1
                d = draft(s.seq_id, len(out), 3)
                nxt.append(
                    PlannedSeq.chunk(
                        s.seq_id,
                        s.shard,
                        [out[-1], *d],
                        pos,
                        s.sampling,
                        sample=True,
                        sample_index=len(out),
                        drafts=len(d),
                    )
                )
                nxt[-1].mini_batch = s.mini_batch
            seqs = nxt

    asyncio.run(run())
    return {"tokens": {sid: t[:NEW] for sid, t in got.items()}, "per_row": rows_per_step}


def _reference(path: object) -> dict[str, list[int]]:
    ref = LocalEngine.from_pretrained(path).generate(PROMPTS, NEW, ignore_eos=True)
    return {f"s{i}": g.token_ids for i, g in enumerate(ref)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_right_drafts_are_all_kept_and_wrong_ones_cost_nothing_but_the_row(
    model_factory: Callable, arch: str
) -> None:
    path = model_factory(arch)
    want = _reference(path)
    right = _speculate(path, want, lambda sid, n, k: want[sid][n : n + k])
    assert right["tokens"] == want
    assert max(right["per_row"]) == 4  # three drafts kept and the target's own token
    vocab = DenseModel.from_pretrained(path, "cpu", torch.float32).config.vocab_size
    # wrong from the first, or from the second draft on: rejected positions' KV is rolled back
    wrong = _speculate(path, want, lambda sid, n, k: [(t + 1) % vocab for t in want[sid][n : n + k]])
    assert wrong["tokens"] == want and max(wrong["per_row"]) == 1
    half = _speculate(
        path,
        want,
        lambda sid, n, k: want[sid][n : n + 1] + [(t + 1) % vocab for t in want[sid][n + 1 : n + k]],
    )
    assert half["tokens"] == want and 2 in half["per_row"]


def test_sampled_rows_with_drafts_keep_their_distribution_and_seeded_ones_repeat(
    model_factory: Callable,
) -> None:
    path = model_factory("llama")
    model = DenseModel.from_pretrained(path, "cpu", torch.float32)
    sp = SamplingParams(temperature=0.8, seed=7)

    def once() -> list[int]:
        shards = InProcessShards(model, 1)
        shards.stores[0].reserve("s", 64)
        runner = StepRunner(model, shards)
        prefill = PlannedSeq.chunk("s", 0, [1, 5, 9, 3], 0, sp, sample=True, sample_index=0)
        first = asyncio.run(runner.run([prefill]))[0]["s"].token_id
        row = PlannedSeq.chunk("s", 0, [first, 5, 9], 4, sp, sample=True, sample_index=1, drafts=2)
        o = asyncio.run(runner.run([row]))[0]["s"]
        assert o.error is None and -50 < o.logprob <= 0
        return [first, o.token_id] + [a.token_id for a in o.after]

    assert once() == once()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"grammar": '{"type": "integer"}'}, "grammar"),
        ({"presence_penalty": 0.5}, "penalties"),
    ],
)
def test_drafts_on_rows_whose_processors_need_them_are_refused(
    model_factory: Callable, change: dict, why: str
) -> None:
    model = DenseModel.from_pretrained(model_factory("llama"), "cpu", torch.float32)
    shards = InProcessShards(model, 1)
    shards.stores[0].reserve("s", 64)
    runner = StepRunner(model, shards)
    row = PlannedSeq.chunk(
        "s", 0, [1, 5, 9], 0, SamplingParams(**change), sample=True, sample_index=0, drafts=2
    )
    o = asyncio.run(runner.run([row]))[0]["s"]
    assert isinstance(o.error, InvalidInput) and why in str(o.error)
    bad = PlannedSeq.chunk("s", 0, [1, 5], 0, SamplingParams(), sample=True, sample_index=0, drafts=2)
    assert isinstance(asyncio.run(runner.run([bad]))[0]["s"].error, InvalidInput)
