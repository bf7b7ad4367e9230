"""The draft proposers (fastdecode/spec): prompt lookup against vLLM's meaning and its own stateless
reference, the suffix trie against counting windows directly, suffix decoding's proposals, tenant
isolation, bounds and truncation."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.runtime.errors import InvalidInput
from fastdecode.spec import (
    DraftState,
    NgramConfig,
    NgramProposer,
    Proposer,
    SuffixConfig,
    SuffixProposer,
    SuffixTrie,
    propose_ngram,
)

# -- prompt lookup ------------------------------------------------------------------------------

# (tokens, min_n, max_n, k, expected): vLLM's own cases (tests/v1/spec_decode/test_ngram.py) and ours
NGRAM_CASES = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),  # the last 2-gram [5, 6] occurs nowhere before
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the earliest occurrence of [3]
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),  # no 4-gram, a 3-gram
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram wins, not [5, 1]
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),  # 3-gram, not the earlier 2-gram's [5, 2]
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),  # the first of three
    # ours
    ([7, 7, 7], 2, 2, 5, [7]),  # an occurrence overlapping the suffix counts; fewer than k follow
    ([7, 7], 2, 2, 5, []),  # the suffix itself is no match
    ([9], 1, 3, 4, []),
    ([], 1, 3, 4, []),
    ([5, 1, 2, 5, 1, 2], 1, 5, 10, [5, 1, 2]),  # n = 3 (n = 4, 5 do not occur); up to the end
    ([1, 2, 3, 1, 2, 3, 9, 1, 2, 3], 1, 2, 1, [1]),  # k caps; n = 2 at its earliest start
    ([4, 5, 6, 4, 5, 6], 1, 3, 0, []),
]


def _states(tokens: list[int], cfg: NgramConfig) -> list[DraftState]:
    """The same tokens reached three ways: one append, token by token, and past a truncation."""
    whole = NgramProposer(cfg).start(tokens)
    single = NgramProposer(cfg).start([])
    for t in tokens:
        single.append([t])
    detour = NgramProposer(cfg).start(tokens[: len(tokens) // 2] + [99, *tokens[:3]])
    detour.truncate(len(tokens) // 2)
    detour.append(tokens[len(tokens) // 2 :])
    return [whole, single, detour]


@pytest.mark.parametrize(("tokens", "lo", "hi", "k", "want"), NGRAM_CASES)
def test_ngram_matches_vllm(tokens: list[int], lo: int, hi: int, k: int, want: list[int]) -> None:
    assert propose_ngram(tokens, k, lo, hi) == want
    cfg = NgramConfig(num_speculative_tokens=max(k, 1), prompt_lookup_min=lo, prompt_lookup_max=hi)
    for state in _states(tokens, cfg):
        assert state.propose(k) == want


def test_ngram_follows_new_tokens_and_forgets_truncated_ones() -> None:
    state = NgramProposer(NgramConfig(4, 2, 3)).start([10, 11, 12, 13])
    assert state.propose(4) == []
    state.append([20, 10, 11])  # [10, 11] now occurs before: what followed it then
    assert state.propose(4) == [12, 13, 20, 10]
    state.truncate(5)  # back to [10, 11, 12, 13, 20]
    assert state.num_tokens == 5 and state.propose(4) == []
    state.append([12, 13])  # [12, 13] at 2 is the earliest: [20, 12, 13] follows it
    assert state.propose(4) == [20, 12, 13]
    with pytest.raises(InvalidInput):
        state.truncate(8)
    with pytest.raises(InvalidInput):
        state.propose(-1)


def test_ngram_config_is_checked() -> None:
    for bad in ((0, 1, 2), (2, 0, 2), (2, 3, 2)):
        with pytest.raises(InvalidInput):
            NgramConfig(*bad)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(st.integers(0, 3), min_size=1, max_size=6)),
        st.tuples(st.just("truncate"), st.integers(0, 40)),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), max_size=20),
    ops=_ops,
    lo=st.integers(1, 3),
    span=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_ngram_state_equals_the_stateless_scan(
    prompt: list[int], ops: list[tuple[str, object]], lo: int, span: int, k: int
) -> None:
    """After any appends and truncations the incremental index proposes what a full scan does."""
    cfg = NgramConfig(num_speculative_tokens=max(k, 1), prompt_lookup_min=lo, prompt_lookup_max=lo + span)
    state = NgramProposer(cfg).start(prompt)
    tokens = list(prompt)
    for op, arg in ops:
        if op == "append":
            state.append(arg)  # type: ignore[arg-type]
            tokens += arg  # type: ignore[operator]
        else:
            length = min(int(arg), len(tokens))  # type: ignore[call-overload]
            state.truncate(length)
            del tokens[length:]
        assert state.tokens == tuple(tokens)
        assert state.propose(k) == propose_ngram(tokens, k, lo, lo + span)


# -- the suffix trie ----------------------------------------------------------------------------


def _windows(seqs: dict[int, tuple[int, list[int]]], depth: int) -> dict[tuple[int, ...], int]:
    """Every string of <= depth tokens with its number of occurrences, counted directly."""
    out: Counter[tuple[int, ...]] = Counter()
    for front, toks in seqs.values():
        for start in range(front, len(toks)):
            for n in range(1, min(depth, len(toks) - start) + 1):
                out[tuple(toks[start : start + n])] += 1
    return dict(out)


@settings(max_examples=150, deadline=None)
@given(depth=st.integers(2, 6), alphabet=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_the_trie_counts_every_window(depth: int, alphabet: int, seed: int) -> None:
    """Random appends, truncations, forgotten fronts, removals and closes over several sequences:
    the trie's counts (explicit and implicit) equal the windows counted directly, and its
    invariants hold (`check`)."""
    rng = random.Random(seed)
    trie = SuffixTrie(depth)
    seqs: dict[int, tuple[int, list[int]]] = {}  # id -> (front, tokens)
    for step in range(40):
        r = rng.random()
        ids = list(seqs)
        if r < 0.15 or not ids:
            toks = [rng.randrange(alphabet) for _ in range(rng.randint(0, 6))]
            trie.add(step, toks)
            seqs[step] = (0, toks)
        elif r < 0.6:
            sid = rng.choice(ids)
            more = [rng.randrange(alphabet) for _ in range(rng.randint(1, 5))]
            trie.extend(sid, more)
            seqs[sid][1].extend(more)
        elif r < 0.75:
            sid = rng.choice(ids)
            front, toks = seqs[sid]
            length = rng.randint(0, len(toks))
            trie.truncate(sid, length)
            seqs[sid] = (min(front, length), toks[:length])
        elif r < 0.85:
            sid = rng.choice(ids)
            front, toks = seqs[sid]
            n = rng.randint(0, 3)
            trie.forget_front(sid, n)
            seqs[sid] = (min(len(toks), front + n), toks)
        elif r < 0.92:
            sid = rng.choice(ids)
            trie.remove(sid)
            del seqs[sid]
        else:
            trie.close(rng.choice(ids))
        assert trie.check() == _windows(seqs, depth)


def test_the_trie_spells_out_only_repeats() -> None:
    """Text seen once costs about a node per token (leaves name their occurrence); depth bounds
    what a repeat costs."""
    rng = random.Random(3)
    trie = SuffixTrie(16)
    trie.add(0, rng.sample(range(100_000), 2000))  # no token repeats
    assert trie.size == 2000
    trie.add(1, list(trie.tokens(0)[:500]))  # a copy: its windows spelled out, up to depth 16
    assert 2000 + 500 <= trie.size <= 2000 + 500 * 16


def test_the_trie_proposes_the_most_frequent_continuation() -> None:
    trie = SuffixTrie(8)
    trie.add(0, [1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 1, 2])
    # [1, 2] occurs 4 times: -> 3 twice, -> 4 once, once at the end
    draft = trie.speculate([1, 2], 3, min_token_prob=0.1)
    assert draft.tokens[0] == 3 and draft.probs[0] == pytest.approx(0.5)
    assert trie.speculate([1, 2], 3, min_token_prob=0.6).tokens == ()  # cut at the threshold
    # the match length bounds the draft (max_spec_factor 1): one token for a one-token match
    assert len(trie.speculate([7, 9], 5, max_spec_factor=1.0, min_token_prob=0.0).tokens) == 1


# -- suffix decoding ----------------------------------------------------------------------------


def _suffix(**kw: object) -> SuffixProposer:
    return SuffixProposer(SuffixConfig(**{"num_speculative_tokens": 4, **kw}))  # type: ignore[arg-type]


def test_suffix_proposes_a_repeated_pattern() -> None:
    prop = _suffix()
    state = prop.start([5, 6, 7, 8, 9] * 3 + [5, 6])
    assert state.propose(3) == [7, 8, 9]
    assert state.propose(1) == [7]
    state.append([7, 8, 9, 5])
    assert state.propose(4) == [6, 7, 8, 9]
    assert state.propose(0) == []
    assert prop.start([1, 2, 3]).propose(4) == []  # nothing repeats


def test_suffix_learns_from_the_tenants_earlier_outputs() -> None:
    prop = _suffix()
    first = prop.start([1, 2, 3], tenant="acme")
    first.append([40, 41, 42, 43, 44, 45])
    first.close()
    later = prop.start([7, 40, 41, 42], tenant="acme")
    assert later.propose(3) == [43, 44, 45]


def test_a_tenant_never_gets_another_tenants_continuation() -> None:
    prop = _suffix()
    a = prop.start([1, 2, 3], tenant="a")
    a.append([40, 41, 42, 43, 44])
    assert prop.start([9, 40, 41], tenant="b").propose(3) == []
    # a two-token match allows two drafts (max_spec_factor 1)
    assert prop.start([9, 40, 41], tenant="a").propose(3) == [42, 43]
    # tenants share common tokens (0..5) and each adds its own (100s, 200s, ...) after them: every
    # token a request is offered was seen by its own tenant's requests
    rng = random.Random(11)
    prop = _suffix(max_tenant_nodes=400)
    seen: dict[int, set[int]] = {i: set() for i in range(4)}

    def text(tenant: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(rng.randrange(6))
            if rng.random() < 0.4:
                out.append(100 * (tenant + 1) + rng.randrange(3))
        return out

    live: list[tuple[int, DraftState]] = []
    offered = 0
    for _ in range(60):
        tenant = rng.randrange(4)
        prompt = text(tenant, rng.randint(2, 8))
        live.append((tenant, prop.start(prompt, tenant=str(tenant))))
        seen[tenant].update(prompt)
        for owner, state in rng.sample(live, min(5, len(live))):
            out = text(owner, rng.randint(1, 4))
            state.append(out)
            seen[owner].update(out)
            draft = state.propose(4)
            assert set(draft) <= seen[owner]
            offered += bool(draft)
        if len(live) > 8:
            live.pop(0)[1].close()
    assert offered > 100  # the check saw drafts, not only empty ones


def test_tenant_tries_are_bounded() -> None:
    prop = _suffix(max_tenant_nodes=300, max_tenants=2)
    for i in range(40):  # each request's output is new text: ~ a node a token
        state = prop.start([1], tenant="a")
        state.append([1000 * (i + 1) + j for j in range(50)])
        assert prop.tenant_nodes("a") <= 300
        state.close()
    # the oldest outputs went first: the last request's continuation is still known, the first's not
    assert prop.start([40001, 40002], tenant="a").propose(2) == [40003, 40004]
    assert prop.start([1001, 1002], tenant="a").propose(2) == []
    prop.start([1], tenant="b")
    prop.start([1], tenant="c")  # a third tenant: "a", the least recently started, goes
    assert prop.tenant_nodes("a") == 0 and prop.start([40001, 40002], tenant="a").propose(2) == []


def test_a_request_trie_is_bounded_when_asked() -> None:
    rng = random.Random(5)
    prop = _suffix(max_request_nodes=500)
    state = prop.start(rng.sample(range(100_000), 3000))
    assert state.own_nodes <= 500
    state.append([7, 8, 9, 10, 11, 12, 7, 8, 9])  # what is recent is still found
    assert state.propose(3) == [10, 11, 12]


def test_suffix_truncation_forgets_the_removed_tail() -> None:
    prop = _suffix(max_spec_factor=2.0)
    state = prop.start([5, 1, 2, 3, 6, 1, 2], tenant="t")
    before = state.propose(4)
    assert before == [3, 6, 1, 2]
    state.append([4, 4, 1, 2, 4, 4, 1, 2])  # [1, 2] -> 4 now the most frequent
    assert state.propose(4)[0] == 4
    state.truncate(7)
    assert state.tokens == (5, 1, 2, 3, 6, 1, 2) and state.propose(4) == before
    # the tenant's trie lost the output too: another request of the tenant is not offered [4, 4]
    assert prop.start([9, 4], tenant="t").propose(2) == []
    with pytest.raises(InvalidInput):
        state.truncate(99)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_suffix_truncation_equals_never_appending(seed: int) -> None:
    """A state truncated back holds the counts a state that never saw the tail holds, in both tries."""
    rng = random.Random(seed)
    prompt = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
    out = [rng.randrange(4) for _ in range(rng.randint(0, 12))]
    keep = rng.randint(0, len(prompt) + len(out))
    cut = _suffix(max_tree_depth=5).start(prompt, tenant="x")
    cut.append(out)
    cut.truncate(keep)
    fresh = _suffix(max_tree_depth=5).start(prompt[:keep], tenant="x")
    fresh.append(out[: max(0, keep - len(prompt))])
    assert cut.tokens == fresh.tokens
    assert cut._own.check() == fresh._own.check()
    assert cut._tenant.check() == fresh._tenant.check()


def test_the_proposers_share_one_interface() -> None:
    proposers: list[Proposer] = [
        NgramProposer(NgramConfig(3, 1, 3)),
        _suffix(num_speculative_tokens=3, max_spec_factor=2.0),
    ]
    for prop in proposers:
        state = prop.start([1, 2, 3, 4, 1, 2], tenant="t")
        assert prop.num_speculative_tokens == 3
        assert state.propose(prop.num_speculative_tokens) == [3, 4, 1]
        state.append([3])
        state.truncate(6)
        assert state.num_tokens == 6
        state.close()


def test_suffix_config_is_checked() -> None:
    for bad in ({"num_speculative_tokens": 0}, {"max_tree_depth": 1}, {"min_token_prob": 2.0}):
        with pytest.raises(InvalidInput):
            SuffixConfig(**{"num_speculative_tokens": 4, **bad})  # type: ignore[arg-type]
