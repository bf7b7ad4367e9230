"""Verification of drafts (fastdecode/spec/rejection.py): greedy acceptance gives the tokens of greedy
decoding; rejection sampling leaves every emitted token distributed as the target's p (chi-square
tests with a deliberately bad deterministic drafter and with a random drafter q); seeded sequences
reproduce whatever batch they are in."""

from __future__ import annotations

import random

import pytest
import torch

from fastdecode.runtime.errors import InvalidInput
from fastdecode.spec import NgramConfig, NgramProposer
from fastdecode.spec.rejection import accept_greedy, accept_sampled

# -- greedy ------------------------------------------------------------------------------------


class Bigram:
    """A toy target model: logits from the last token and the position (so greedy text repeats
    itself only in part, and n-gram drafts are sometimes right, sometimes wrong)."""

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g)
        self.pos = torch.randn(5, vocab, generator=g) * 0.5

    def logits(self, context: list[int]) -> torch.Tensor:
        return self.table[context[-1]] + self.pos[len(context) % 5]


def _greedy(model: Bigram, prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(model.logits(ctx).argmax()))
    return ctx[len(prompt) :]


def test_greedy_acceptance_equals_greedy_decoding() -> None:
    """Sequences with n-gram drafts, random drafts and none, verified together in one flat batch per
    step: each one's tokens are exactly those of plain greedy decoding."""
    model, n_new = Bigram(vocab=12, seed=0), 60
    rng = random.Random(1)
    prompts = [[rng.randrange(12) for _ in range(rng.randint(1, 8))] for _ in range(6)]
    want = [_greedy(model, p, n_new) for p in prompts]
    ngram = NgramProposer(NgramConfig(4, 1, 3))
    states = [ngram.start(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    accepted = 0
    while any(len(o) < n_new for o in out):
        drafts, rows = [], []
        for i, state in enumerate(states):
            ctx = list(state.tokens)  # type: ignore[attr-defined]
            if i % 3 == 0:
                d = state.propose(rng.randint(0, 4))
            elif i % 3 == 1:
                d = [rng.randrange(12) for _ in range(rng.randint(0, 3))]
            else:
                d = []
            drafts.append(d)
            rows += [model.logits(ctx + d[:j]) for j in range(len(d) + 1)]
        target = torch.stack(rows).argmax(dim=1)
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
        result = accept_greedy(target, flat, [len(d) for d in drafts])
        for i, (state, got) in enumerate(zip(states, result, strict=True)):
            assert 1 <= len(got) <= len(drafts[i]) + 1 and got[:-1] == drafts[i][: len(got) - 1]
            accepted += len(got) - 1
            state.append(got)
            out[i] += got
    assert [o[:n_new] for o in out] == want
    assert accepted > 20  # drafts were accepted, not only bonus tokens


def test_greedy_acceptance_on_random_rows() -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        ks = torch.randint(0, 5, (7,), generator=g).tolist()
        target = torch.randint(0, 3, (sum(ks) + len(ks),), generator=g)
        drafts = torch.randint(0, 3, (sum(ks),), generator=g)
        got = accept_greedy(target, drafts, ks)
        t, d = target.tolist(), drafts.tolist()
        for k, res in zip(ks, got, strict=True):
            n = 0
            while n < k and d[n] == t[n]:
                n += 1
            assert res == t[: n + 1]
            t, d = t[k + 1 :], d[k:]


def test_the_layout_is_checked() -> None:
    with pytest.raises(InvalidInput):
        accept_greedy(torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), [1, 1, 1])
    with pytest.raises(InvalidInput):
        accept_sampled(torch.full((2, 3), 1 / 3), torch.zeros(1, dtype=torch.int64), [1], [])
    with pytest.raises(InvalidInput):
        accept_greedy(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), [-1, 1])
    assert accept_greedy(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), []) == []


# -- sampling ----------------------------------------------------------------------------------

V, N = 6, 4000
CRITICAL_001 = {5: 15.086, 7: 18.475, 35: 57.342}  # chi-square quantiles at 0.99 (from the tables)


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square statistic of observed counts against probabilities, and its p-value
    (the chi-square survival function: the regularized upper incomplete gamma Q(df/2, x/2))."""
    expected = probs.double() * counts.sum()
    assert float(expected.min()) >= 5  # where the chi-square approximation holds
    stat = float(((counts.double() - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, p


def test_the_p_value_matches_the_tables() -> None:
    for df, x in CRITICAL_001.items():
        p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2))
        assert float(p) == pytest.approx(0.01, abs=2e-4)


def _dist(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random distributions, every entry >= 0.03 (so 4000 draws expect >= 5 of each cell pair)."""
    w = torch.rand(*shape, V, generator=g, dtype=torch.float64) + 0.2
    return (w / w.sum(-1, keepdim=True)).float()


class Drafter:
    """Either a deliberately bad deterministic drafter (the target's least likely token: q one-hot)
    or a random one that draws from its own q (q1 for the first token, Q2[first] for the second)."""

    def __init__(self, kind: str, g: torch.Generator, p1: torch.Tensor, p2: torch.Tensor) -> None:
        self.kind, self.p1, self.p2 = kind, p1, p2
        self.q1, self.q2 = _dist(g), _dist(g, V)
        self.g = g

    def draft(self, dist_p: torch.Tensor, dist_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts for rows of target distributions dist_p [n, V] with drafter distributions dist_q."""
        if self.kind == "bad":
            return dist_p.argmin(dim=1), None
        return torch.multinomial(dist_q, 1, generator=self.g).squeeze(1), dist_q


def _run_two_tokens(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """N sequences of a target with p(t1) = p1 and p(t2 | t1) = p2[t1]: two drafts each, verified in
    one batch; sequences left with one token run a second step (one draft). Returns p1, p2 and
    each sequence's first two tokens."""
    g = torch.Generator().manual_seed(seed)
    p1, p2 = _dist(g), _dist(g, V)
    drafter = Drafter(kind, g, p1, p2)
    d1, q1 = drafter.draft(p1.expand(N, V), drafter.q1.expand(N, V))
    d2, q2 = drafter.draft(p2[d1], drafter.q2[d1])
    uniform = torch.full((N, V), 1 / V)
    target = torch.stack([p1.expand(N, V), p2[d1], uniform], dim=1).reshape(3 * N, V)
    drafts = torch.stack([d1, d2], dim=1).reshape(-1)
    draft_probs = None if q1 is None else torch.stack([q1, q2], dim=1).reshape(2 * N, V)  # type: ignore[list-item]
    gens = [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(N)]
    out = accept_sampled(target, drafts, [2] * N, gens, draft_probs)
    first = torch.tensor([o[0] for o in out])
    short = [i for i, o in enumerate(out) if len(o) == 1]
    rest = first[short]
    d, q = drafter.draft(p2[rest], drafter.q2[rest])
    target2 = torch.stack([p2[rest], uniform[: len(short)]], dim=1).reshape(2 * len(short), V)
    out2 = accept_sampled(target2, d, [1] * len(short), [gens[i] for i in short], q)
    second = torch.tensor([o[1] if len(o) > 1 else -1 for o in out])
    second[short] = torch.tensor([o[0] for o in out2])
    return p1, p2, first, second


@pytest.mark.parametrize("kind", ["bad", "random"])
def test_rejection_sampling_keeps_the_target_distribution(kind: str) -> None:
    """The first token, the second and the pair follow the target's p: chi-square p-values > 0.01
    (fixed seeds), with a drafter whose drafts are the target's least likely tokens and with one
    that draws from an unrelated q."""
    p1, p2, first, second = _run_two_tokens(kind, seed=7 if kind == "bad" else 8)
    stat, p = _p_value(torch.bincount(first, minlength=V), p1)
    assert p > 0.01 and stat < CRITICAL_001[V - 1], (stat, p)
    marginal = p1 @ p2  # p(t2) = sum over t1 of p1(t1) p2(t2 | t1)
    stat, p = _p_value(torch.bincount(second, minlength=V), marginal)
    assert p > 0.01 and stat < CRITICAL_001[V - 1], (stat, p)
    joint = (p1[:, None] * p2).reshape(-1)
    stat, p = _p_value(torch.bincount(first * V + second, minlength=V * V), joint)
    assert p > 0.01 and stat < CRITICAL_001[V * V - 1], (stat, p)


def test_the_bonus_follows_the_row_after_the_drafts() -> None:
    """Drafts the target is sure of (p one-hot at them) are all accepted; the bonus then follows the
    row after them, whatever k."""
    g = torch.Generator().manual_seed(10)
    bonus = _dist(g)
    ks = torch.randint(1, 4, (N,), generator=g).tolist()
    drafts = torch.randint(0, V, (sum(ks),), generator=g)
    rows, at = [], 0
    for k in ks:
        rows += [torch.nn.functional.one_hot(drafts[at + j], V).float() for j in range(k)] + [bonus]
        at += k
    gens = [torch.Generator().manual_seed(i) for i in range(N)]
    out = accept_sampled(torch.stack(rows), drafts, ks, gens)
    assert [len(o) for o in out] == [k + 1 for k in ks]
    stat, p = _p_value(torch.bincount(torch.tensor([o[-1] for o in out]), minlength=V), bonus)
    assert p > 0.01 and stat < CRITICAL_001[V - 1], (stat, p)


@pytest.mark.parametrize("drafter", ["one-hot", "q"])
def test_a_large_vocabulary_draws_across_blocks(drafter: str) -> None:
    """A vocabulary of several 1024-token blocks and a partial last one, the mass spread over block
    edges: the first token still follows p (the draw goes block, then token)."""
    vocab, support = 2500, torch.tensor([0, 5, 1023, 1024, 2047, 2048, 2400, 2499])
    g = torch.Generator().manual_seed(12)
    p = torch.zeros(vocab)
    p[support] = _dist(g)[torch.arange(len(support)) % V] + 0.05
    p /= p.sum()
    target = torch.stack([p.expand(N, vocab), torch.full((N, vocab), 1 / vocab)], dim=1).reshape(2 * N, vocab)
    q = None
    if drafter == "one-hot":
        drafts = torch.full((N,), 1024)
    else:
        q = torch.zeros(vocab)
        q[support[::2]] = 1.0 / len(support[::2])
        drafts = torch.multinomial(q, N, replacement=True, generator=g)
        q = q.expand(N, vocab)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(N)]
    first = torch.tensor([o[0] for o in accept_sampled(target, drafts, [1] * N, gens, q)])
    counts = torch.bincount(first, minlength=vocab)
    assert int(counts.sum()) == int(counts[support].sum())  # nothing outside p's support
    stat, pv = _p_value(counts[support], p[support])
    assert pv > 0.01 and stat < CRITICAL_001[len(support) - 1], (stat, pv)


def test_the_chi_square_check_catches_a_wrong_sampler() -> None:
    """The same check on what a wrong verifier emits fails: taking the drafts unverified, or on a
    rejection drawing from p instead of the residual max(0, p - q)."""
    g = torch.Generator().manual_seed(9)
    p, q = _dist(g), _dist(g)
    drafts = torch.multinomial(q.expand(N, V), 1, generator=g).squeeze(1)
    _, pv = _p_value(torch.bincount(drafts, minlength=V), p)
    assert pv < 0.01
    accept = torch.rand(N, generator=g) < (p[drafts] / q[drafts]).clamp(max=1)
    redraw = torch.multinomial(p.expand(N, V), 1, generator=g).squeeze(1)
    _, pv = _p_value(torch.bincount(torch.where(accept, drafts, redraw), minlength=V), p)
    assert pv < 0.01
    # and ours, on the same p and q
    gens = [torch.Generator().manual_seed(i) for i in range(N)]
    target = torch.stack([p.expand(N, V), torch.full((N, V), 1 / V)], dim=1).reshape(2 * N, V)
    out = accept_sampled(target, drafts, [1] * N, gens, q.expand(N, V))
    _, pv = _p_value(torch.bincount(torch.tensor([o[0] for o in out]), minlength=V), p)
    assert pv > 0.01


def test_one_hot_targets_make_sampling_greedy() -> None:
    g = torch.Generator().manual_seed(2)
    ks = [3, 0, 2, 4]
    logits = torch.randn(sum(ks) + len(ks), 9, generator=g)
    target = logits.argmax(dim=1)
    rows = [r for i, k in enumerate(ks) for r in range(sum(ks[:i]) + i, sum(ks[:i]) + i + k)]
    noise = torch.randint(0, 9, (sum(ks),), generator=g)
    drafts = torch.where(torch.rand(sum(ks), generator=g) < 0.7, target[rows], noise)  # mostly right
    one_hot = torch.nn.functional.one_hot(target, 9).float()
    gens = [torch.Generator().manual_seed(i) for i in range(len(ks))]
    assert accept_sampled(one_hot, drafts, ks, gens) == accept_greedy(target, drafts, ks)


def test_a_seeded_sequence_reproduces_in_any_batch() -> None:
    g = torch.Generator().manual_seed(4)
    ks = [3, 1, 0, 4, 2]
    probs = _dist(g, sum(ks) + len(ks))
    drafts = torch.randint(0, V, (sum(ks),), generator=g)

    def run(order: list[int], seeds: list[int]) -> list[list[int]]:
        t_off = [sum(ks[:i]) + i for i in range(len(ks))]
        d_off = [sum(ks[:i]) for i in range(len(ks))]
        rows = torch.cat([probs[t_off[i] : t_off[i] + ks[i] + 1] for i in order])
        dr = torch.cat([drafts[d_off[i] : d_off[i] + ks[i]] for i in order])
        gens = [torch.Generator().manual_seed(seeds[i]) for i in order]
        return accept_sampled(rows, dr, [ks[i] for i in order], gens)

    seeds = [11, 12, 13, 14, 15]
    whole = run([0, 1, 2, 3, 4], seeds)
    assert run([0, 1, 2, 3, 4], seeds) == whole
    alone = run([3], seeds)
    shuffled = run([4, 3, 1], seeds)
    assert alone[0] == whole[3] and shuffled[1] == whole[3] and shuffled[0] == whole[4]
    other = run([0, 1, 2, 3, 4], [s + 100 for s in seeds])
    assert other != whole  # the seed matters (5 sequences, 15 draws: equal by chance ~never)
