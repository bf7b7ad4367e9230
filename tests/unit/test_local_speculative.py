"""LocalEngine with speculative drafts (fastdecode/dense/engine_spec.py, `fastdecode run --speculative`):
greedy tokens equal those without drafts on the KVStore path (llama) and the windowed path (Gemma 2:
sliding windows and soft-caps), with drafts both kept and rejected (so the rejected positions' KV is
rolled back and written over), and max_tokens and stop tokens cut a verified row exactly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastdecode.contract import SamplingParams
from fastdecode.dense.engine import Generation, LocalEngine
from fastdecode.dense.engine_spec import SpecStats
from fastdecode.spec import DraftState, Proposer, proposer_for

# Prompts that repeat their text, so prompt lookup finds drafts from the first step.
PROMPTS = [[5, 17, 42, 99, 7, 13, 21, 8] * 4, [3, 4, 5, 6] * 6, [*range(30, 50), *range(30, 40)]]
MAX = 32


class _OracleState:
    """Drafts the known greedy continuation, with the second draft wrong at every third length: rows
    keep all their drafts, or one, or none, deterministically."""

    def __init__(self, prompt: Sequence[int], ref: list[int]) -> None:
        self.tokens, self.n_prompt, self.ref = list(prompt), len(prompt), ref

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def append(self, tokens: Sequence[int]) -> None:
        self.tokens += tokens

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def propose(self, k: int) -> list[int]:
        n = len(self.tokens) - self.n_prompt
        drafts = self.ref[n : n + k]
        if n % 3 == 1 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 2048
        if n % 3 == 2 and drafts:
            drafts[0] = (drafts[0] + 7) % 2048
        return drafts

    def close(self) -> None:
        pass


class _Oracle:
    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int = 4) -> None:
        self.refs, self.num_speculative_tokens = refs, k

    def start(self, prompt: Sequence[int], *, tenant: str = "") -> DraftState:
        return _OracleState(prompt, self.refs[tuple(prompt)])


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def engine(
    request: pytest.FixtureRequest,
    model_factory: Callable[[str], Path],
    family_factory: Callable[[str], Path],
) -> LocalEngine:
    path = model_factory("llama") if request.param == "llama" else family_factory(request.param)
    eng = LocalEngine.from_pretrained(path, kv_capacity_bytes=64 << 20)
    assert (eng.windowed is not None) == (request.param == "gemma2")  # both attention paths covered
    return eng


@pytest.fixture(scope="module")
def reference(engine: LocalEngine) -> list[list[int]]:
    return [g.token_ids for g in engine.generate(PROMPTS, MAX, ignore_eos=True)]


def _run(
    engine: LocalEngine,
    proposer: Proposer | None,
    max_tokens: int = MAX,
    params: SamplingParams = SamplingParams(),
) -> tuple[list[Generation], SpecStats]:
    stats = SpecStats()
    out = engine.generate(PROMPTS, max_tokens, params, ignore_eos=True, proposer=proposer, stats=stats)
    return out, stats


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_equal_with_drafts(
    engine: LocalEngine, reference: list[list[int]], method: str
) -> None:
    out, stats = _run(engine, proposer_for(method, 3))
    assert [g.token_ids for g in out] == reference
    assert all(g.finish_reason == "length" for g in out)
    assert stats.drafts > 0 and stats.emitted >= stats.rows


def test_ngram_keeps_drafts_on_repetitive_output(family_factory: Callable[[str], Path]) -> None:
    """The Gemma 2 checkpoint's greedy output repeats itself: prompt lookup's drafts are kept and
    rejected both, and the tokens stay greedy decoding's."""
    eng = LocalEngine.from_pretrained(family_factory("gemma2"), kv_capacity_bytes=64 << 20)
    ref = [g.token_ids for g in eng.generate(PROMPTS, MAX, ignore_eos=True)]
    out, stats = _run(eng, proposer_for("ngram", 3))
    assert [g.token_ids for g in out] == ref
    assert 0 < stats.accepted < stats.drafts
    assert stats.tau > 1.2


def test_kept_and_rejected_drafts_roll_back(engine: LocalEngine, reference: list[list[int]]) -> None:
    out, stats = _run(engine, _Oracle({tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}))
    assert [g.token_ids for g in out] == reference
    assert 0 < stats.accepted < stats.drafts  # kept ones and rejected ones (whose KV is rolled back)
    assert stats.tau > 1.5


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_holds(engine: LocalEngine, reference: list[list[int]], max_tokens: int) -> None:
    oracle = _Oracle({tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)})
    out, _ = _run(engine, oracle, max_tokens)
    assert [g.token_ids for g in out] == [r[:max_tokens] for r in reference]
    assert all(g.finish_reason == "length" for g in out)


def test_stop_token_cuts_a_verified_row(engine: LocalEngine, reference: list[list[int]]) -> None:
    """A stop token inside a verified row's tokens ends the output there: the row's tokens after it
    are never emitted."""
    oracle = _Oracle({tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)})
    rows: list[list[int]] = []  # the tokens each step gave prompt 0
    for events in engine.generate_stream(PROMPTS, MAX, ignore_eos=True, proposer=oracle):
        if any(i == 0 for i, *_ in events):
            rows.append([t for i, t, _, _ in events if i == 0])
    ref, at = reference[0], 0
    stop = None
    for row in rows:  # a token a row yields with more after it, never earlier in the output
        for m, tok in enumerate(row[:-1]):
            if tok not in ref[: at + m]:
                stop, cut = tok, at + m + 1
                break
        if stop is not None:
            break
        at += len(row)
    assert stop is not None, rows
    steps = list(
        engine.generate_stream(PROMPTS, MAX, stop_token_ids=[stop], ignore_eos=True, proposer=oracle)
    )
    got = [t for events in steps for i, t, _, _ in events if i == 0]
    assert got == ref[:cut]
    assert [f for events in steps for i, _, _, f in events if i == 0][-1] == "stop"


def test_sampled_and_seeded_rows(engine: LocalEngine, reference: list[list[int]]) -> None:
    """Sampled rows verify by rejection sampling (fastdecode/spec/rejection.py); a seeded row gets no
    drafts (its tokens would depend on them) and keeps the tokens it gets without speculation."""
    hot = SamplingParams(temperature=0.8)
    oracle = _Oracle({tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)})
    out, stats = _run(engine, oracle, 12, hot)
    assert all(len(g.token_ids) == 12 and g.finish_reason == "length" for g in out)
    assert stats.rows > 0
    seeded = SamplingParams(temperature=0.8, seed=7)
    plain = engine.generate(PROMPTS, 12, seeded, ignore_eos=True)
    out, stats = _run(engine, proposer_for("ngram", 3), 12, seeded)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    assert stats.rows == 0
