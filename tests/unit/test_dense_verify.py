"""Speculative rows through the dense step against in-process shards: drafts the target agrees with
are kept, the first it does not is replaced by its own token, and the KV of rejected positions is
rolled back, so the tokens equal plain greedy decoding's whatever the drafts were."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastdecode.contract import PlannedSeq, SamplingParams
from fastdecode.dense import StepRunner
from fastdecode.dense.engine import LocalEngine
from fastdecode.dense.grammar import GrammarBank
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.grammar import Structured, compile_grammar
from tests.unit.test_dense_runner import InProcessShards

PROMPTS = [[1, 5, 9, 3], [1, 7, 2], [1, 4, 4, 8, 6]]
NEW = 12


def _speculate(
    path: object,
    want: dict[str, list[int]],
    draft: Callable[[str, int, int], list[int]],
    sp: SamplingParams | None = None,
) -> dict:
    """Greedy decode of PROMPTS with each decode row carrying draft(seq, generated, k) drafts (with
    `sp`'s grammar, a GrammarBank on the checkpoint's tokenizer masks every position)."""
    sp = sp or SamplingParams()
    model = DenseModel.from_pretrained(path, "cpu", torch.float32)
    shards = InProcessShards(model, 2)
    cfg = model.config
    bank = GrammarBank(Path(str(path)) / "tokenizer.json", cfg.vocab_size, cfg.eos_token_ids, wait_s=60)
    runner = StepRunner(model, shards, grammars=bank if sp.grammar else None)
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(PROMPTS))}
    rows_per_step: list[int] = []
    for i in range(len(PROMPTS)):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    seqs = [PlannedSeq(f"s{i}", i % 2, i % 2, p, 0, sp) for i, p in enumerate(PROMPTS)]

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


def test_a_grammar_rows_drafts_are_masked_position_by_position(model_factory: Callable) -> None:
    """A grammar row with drafts: every position masked by what the grammar allows after the drafts
    before it, so the tokens are the grammar's greedy tokens without drafts, whatever the drafts."""
    path = model_factory("llama")
    grammar = compile_grammar(Structured("regex", "(ab ){16}[0-9]{4}"))  # longer than NEW tokens
    sp = SamplingParams(grammar=grammar)
    plain = _speculate(path, {}, lambda sid, n, k: [], sp)["tokens"]
    right = _speculate(path, plain, lambda sid, n, k: plain[sid][n : n + k], sp)
    assert right["tokens"] == plain and max(right["per_row"]) == 4
    vocab = DenseModel.from_pretrained(path, "cpu", torch.float32).config.vocab_size
    wrong = _speculate(path, plain, lambda sid, n, k: [(t + 1) % vocab for t in plain[sid][n : n + k]], sp)
    assert wrong["tokens"] == plain and max(wrong["per_row"]) == 1


@pytest.mark.parametrize(("change", "why"), [({"presence_penalty": 0.5}, "penalties")])
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


def _chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test of homogeneity over the buckets counted in a and b: the p-value."""
    table = torch.stack([a, b]).double()
    keep = table.sum(0) > 0
    table = table[:, keep]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_sampled_tokens_with_drafts_are_distributed_as_without(model_factory: Callable) -> None:
    """Temperature 1: the first token a verified row yields, over 3000 rows whose drafts are right or
    wrong at random, against 3000 plain draws from the same logits: a chi-square test over ten buckets
    of equal probability cannot tell them apart (p > 0.01); a skewed sampler would be told apart."""
    from transformers import AutoModelForCausalLM

    from fastdecode.dense.sampling import sample
    from fastdecode.dense.verify import verify

    path = model_factory("llama")
    hf = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = hf(torch.tensor([[1, 5, 9, 3, 7]])).logits[0, -2:].float()  # two positions' rows
    n, d = 3000, 1
    torch.manual_seed(1234)
    sp = SamplingParams(temperature=1.0)
    probs = torch.softmax(logits[0], -1)
    likely = torch.multinomial(probs, n, replacement=True)  # drafts the model would often take
    noise = torch.randint(0, logits.shape[1], (n,))
    drafts = torch.where(torch.rand(n) < 0.5, likely, noise)
    rows = [
        PlannedSeq.chunk(f"s{i}", 0, [1, int(drafts[i])], 0, sp, sample=True, sample_index=0, drafts=d)
        for i in range(n)
    ]
    hidden = logits.repeat(n, 1)  # each row's two positions: after its last token, after its draft
    first = torch.tensor([toks[0][0] for toks in verify(lambda h: h, hidden, rows, ())])
    plain, _ = sample(logits[:1].repeat(n, 1), [sp] * n, [0] * n)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    bucket_of = torch.empty_like(order)
    bucket_of[order] = torch.clamp((cum * 10).long(), max=9)  # ten buckets of about equal mass
    count = lambda toks: torch.bincount(bucket_of[toks], minlength=10)  # noqa: E731
    assert _chi_square_p(count(first), count(plain)) > 0.01
    skewed = torch.where(torch.rand(n) < 0.3, order[0].expand(n), plain)  # too often the top token
    assert _chi_square_p(count(skewed), count(plain)) < 0.01
