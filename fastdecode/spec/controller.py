"""How many drafts a decode row is offered (the scheduler's --speculative-k auto): the k in 0..K that
yields the most tokens per second, from the step costs gpu_dense reports and the running acceptance.

A draft costs the S-part one more position of its row (gpu_dense runs k + 1 positions per row) and
its shard a little more attention (one read of the row's KV serves all k + 1 queries); it pays only
when kept. Per decode row offered up to k drafts, with f_j the share of rows the drafter finds a
(j + 1)-th draft for and r_j the share of rows offering one that keep it (bench spec's "kept at draft
position"; a row keeps its j-th draft only with every one before it, so r is non-increasing):

    positions(k) = 1 + sum_{j<k} f_j          tau(k) = 1 + sum_{j<k} f_j * r_j

(with f = 1 this is 1 + sum_{j<k} prod_{i<=j} a_i for the conditional rates a_i = r_i / r_{i-1}).
The step at k, from the steps measured (`StepModel`): the S-part at the step's positions with every
draftable row at positions(k), S(n) = a + b * n fitted over recent steps (b between 0, a GPU's
memory-bound GEMMs, and S / n, a CPU's compute that grows with every token); the shards' part
R(k) = R0 * (1 + ATTEND_PER_POSITION * (positions(k) - 1)); T = S + R - o * min(S, R) + c, o the share
of the shorter side the two-mini-batch pipeline hid, c the rest of the scheduler's wall step. k
maximizes tau(k) / T(k), decided every DECIDE_EVERY steps (the first after `first_decision`) with
hysteresis; at k = 0 a probe offers K drafts for a few steps now and then, so the acceptance stays
measured. `StepCost.of` builds a step's cost from gpu_dense's timings. Pure Python, no gRPC; the
planner's `plan --acceptance` scores k with the same `expected_tau` and `best_k`
(fastdecode/planning/spec_plan.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("fastdecode.scheduler")

# A shard's attention for each more query position of a row, as a share of one position's: one read
# of the KV serves them all (4 positions cost 1.28x one at SmolLM2's 64-dim heads, ~1.0x on a
# Llama-3-8B layer: docs/speculative.md).
ATTEND_PER_POSITION = 0.1
# Until rows are seen: what bench spec measured with ngram (emulated.RECORDED_ACCEPTANCE), every
# row finding its drafts, weighed as PRIOR_ROWS rows.
PRIOR_RATES = (0.6528, 0.5972, 0.5, 0.5)
PRIOR_ROWS = 16.0
DECIDE_EVERY = 16  # steps between decisions: a workload that changes is followed within a few
# steps before the first: it starts at K, which a CPU dense host pays for every step until then
FIRST_DECISION = 8
HYSTERESIS = 0.05  # a new k must beat the current one's tokens/s by this share
PROBE_EVERY = 8  # decisions at k = 0 between probes
PROBE_STEPS = 4  # steps a probe offers K drafts (or, checking a close call at k > 0, none)
# At k > 0, a k that beats none by less than this share is checked: PROBE_STEPS steps without
# drafts, so the steps' positions vary and the step's own cost of a position is measured, not
# modelled (a CPU dense host's step grew more with drafts than its parts said)
VERIFY_MARGIN = 0.25
ACCEPTANCE_MEMORY = 0.5  # share of the acceptance counts kept at each decision: recent rows weigh more
COST_MEMORY = 64.0  # steps the step model remembers (exponentially)
SPREAD_PRIOR = 0.05  # positions varying by this share of their mean weigh as much as the prior slope


def floors(rates: Sequence[float], k: int) -> list[float]:
    """P(a row offering k drafts keeps at least j + 1), j < k: the running minimum of the per-position
    rates (positions past the list keep the last)."""
    out, low = [], 1.0
    for j in range(k):
        low = min(low, rates[min(j, len(rates) - 1)]) if rates else 0.0
        out.append(low)
    return out


def expected_tau(rates: Sequence[float], k: int) -> float:
    """Tokens a row offered k drafts yields on average (every row carrying all k)."""
    return 1.0 + sum(floors(rates, k))


def best_k(
    score: Callable[[int], float], max_k: int, current: int | None = None, hysteresis: float = 0.0
) -> int:
    """The k in 0..max_k with the highest score (ties: fewer drafts); `current` stays unless the best
    beats it by `hysteresis` (so noise does not flip k every decision)."""
    scores = [score(k) for k in range(max_k + 1)]
    best = max(range(max_k + 1), key=lambda k: (scores[k], -k))
    if current is not None and 0 <= current <= max_k and scores[best] <= scores[current] * (1 + hysteresis):
        return current
    return best


class Timed(Protocol):
    """gpu_dense's timings of a step, as the scheduler keeps them (scheduling.ports.StepTimes) or as
    they come on the wire (dense.proto StepTimings): seconds."""

    @property
    def s_part_seconds(self) -> float: ...
    @property
    def attend_seconds(self) -> float: ...
    @property
    def step_seconds(self) -> float: ...


@dataclass(frozen=True)
class StepCost:
    """One step as measured: its positions and rows, and its times (seconds)."""

    positions: int  # positions the S-part ran: every row's, drafts included
    rows: int  # decode rows that drafting was asked for (a draftable request with room)
    drafts: int  # drafts those rows carried
    s_part_s: float  # gpu_dense's S-part (and sampling) compute
    attend_s: float  # gpu_dense's wait on the shards, summed over mini-batches
    dense_step_s: float  # gpu_dense's step
    wall_s: float  # the scheduler's step: reservations, the plan, the dense run and applying it

    @classmethod
    def of(cls, positions: int, rows: int, drafts: int, times: Timed, wall_s: float) -> StepCost:
        """A step from gpu_dense's timings: its S-part, its wait on the shards summed over
        mini-batches (attend, not the uncovered shard_wait: the model splits the overlap itself)
        and its whole step. One construction for the scheduler and the benchmarks that play it."""
        return cls(
            positions, rows, drafts, times.s_part_seconds, times.attend_seconds, times.step_seconds, wall_s
        )


class StepModel:
    """The step time at a number of positions per draftable row, from recent steps (weighted by
    COST_MEMORY): S(n) = a + b * n, b fitted by least squares pulled toward S / n (all of S per
    position: the costlier guess until the positions have varied), within [0, S / n]; the step from
    S, R, the overlap and the rest (`modelled`). Where the steps' positions vary (drafts found for
    more rows or fewer), the step's own cost per position is fitted too, pulled toward the modelled
    one: on a CPU dense host the pipeline hid less of a longer S-part, and the shards' attention grew
    more per position, than the model says (bench split at 4096: the step 1.16x with 0.54 drafts a
    row, modelled ~1.05x), and what is measured wins."""

    def __init__(self, memory: float = COST_MEMORY) -> None:
        self._keep = 1.0 - 1.0 / memory
        self._w = 0.0
        # weighted sums: n, n^2, S, n*S, rows, other positions, R per one position, overlap, rest,
        # the step (wall), n*step
        self._sums = [0.0] * 11

    @property
    def ready(self) -> bool:
        return self._w > 0

    def observe(self, c: StepCost) -> None:
        if c.rows <= 0 or c.dense_step_s <= 0:  # nothing to draft for, or no timings (an old gpu_dense)
            return
        s, a = c.s_part_s, c.attend_s
        shorter = min(s, a)
        hidden = min(1.0, max(0.0, (s + a - c.dense_step_s) / shorter)) if shorter > 0 else 0.0
        rest = max(0.0, c.wall_s - (s + a - hidden * shorter))
        r0 = a / (1 + ATTEND_PER_POSITION * c.drafts / c.rows)
        n = float(c.positions)
        other = n - c.rows - c.drafts
        step = max(c.wall_s, c.dense_step_s)  # the scheduler's step holds gpu_dense's
        new = (n, n * n, s, n * s, float(c.rows), other, r0, hidden, rest, step, n * step)
        self._w = self._w * self._keep + 1.0
        self._sums = [x * self._keep + v for x, v in zip(self._sums, new, strict=True)]

    def slope(self) -> float:
        """Seconds of S-part per position, b."""
        n, nn, s, ns = (x / self._w for x in self._sums[:4])
        if n <= 0:
            return 0.0
        prior = s / n
        lam = (SPREAD_PRIOR * n) ** 2
        b = (ns - n * s + lam * prior) / (nn - n * n + lam)
        return min(prior, max(0.0, b))

    def modelled(self, per_row: float) -> float:
        """The step with every draftable row at `per_row` positions (1 + its drafts), from its parts."""
        n, _, s, _, rows, other, r0, hidden, rest = (x / self._w for x in self._sums[:9])
        s_part = max(0.0, s + self.slope() * (other + rows * per_row - n))
        r = r0 * (1 + ATTEND_PER_POSITION * (per_row - 1))
        return s_part + r - hidden * min(s_part, r) + rest

    def step_s(self, per_row: float) -> float:
        """Predicted step with every draftable row at `per_row` positions: the steps' mean moved by
        the cost of a position, fitted on the steps where positions varied, else the modelled one."""
        n, nn, rows, other, wall, nw = (self._sums[i] / self._w for i in (0, 1, 4, 5, 9, 10))
        if rows <= 0:
            return self.modelled(per_row)
        now = (n - other) / rows  # the positions a draftable row ran, on average
        model_b = (self.modelled(now + 0.5) - self.modelled(now - 0.5)) / rows
        lam = (SPREAD_PRIOR * n) ** 2
        b = max(0.0, (nw - n * wall + lam * model_b) / (nn - n * n + lam))
        return max(0.0, wall + b * rows * (per_row - now))


def at_least(hist: list[int]) -> list[int]:
    """Per j >= 0, the count at j + 1 or more of a histogram over 0..K (Counts' asked and found, from
    how many drafts each row was asked for or found)."""
    out, total = [0] * (len(hist) - 1), 0
    for j in range(len(hist) - 1, 0, -1):
        total += hist[j]
        out[j - 1] = total
    return out


@dataclass(frozen=True)
class Counts:
    """Drafting's counts so far, per draft position j: rows asked for a (j + 1)-th draft, rows the
    drafter found one for, verified rows that offered one, and of them those that kept it."""

    asked_at: Sequence[int]
    found_at: Sequence[int]
    offered_at: Sequence[int]
    kept_at: Sequence[int]


class KController:
    """The k drafts are offered at: K pinned (`adaptive=False`), or decided from the steps it is shown.
    Starts at K: the first steps measure what drafts cost and keep. The first decision comes after
    `first_decision` steps, early: the priors carry the acceptance until the rows' counts outweigh
    them, and a host where drafts do not pay stops paying for them soon."""

    def __init__(
        self,
        max_k: int,
        adaptive: bool = True,
        *,
        prior: Sequence[float] = PRIOR_RATES,
        decide_every: int = DECIDE_EVERY,
        probe_every: int = PROBE_EVERY,
        probe_steps: int = PROBE_STEPS,
        first_decision: int = FIRST_DECISION,
    ) -> None:
        self.max_k, self.adaptive, self.k = max_k, adaptive, max_k
        self.cost = StepModel()
        self._prior = floors(prior, max_k)
        self._decide_every, self._probe_every, self._probe_steps = decide_every, probe_every, probe_steps
        self._first = max(1, first_decision)
        self._window = [[0.0] * max_k for _ in range(4)]  # decayed counts (Counts' order)
        self._seen = [[0] * max_k for _ in range(4)]  # the cumulative counts at the last decision
        self._steps = 0
        self._idle = 0  # decisions at k = 0 since the last probe
        self._probing = 0  # steps of the probe left
        self._probe_cap = max_k  # what the probe offers: K at k = 0, none to check a close k > 0
        self.decisions = 0

    @property
    def cap(self) -> int:
        """The most drafts a row is offered now (during a probe: K, or none)."""
        return self._probe_cap if self._probing else self.k

    def observe(self, cost: StepCost, counts: Counts) -> None:
        """A step ran: learn its cost, and decide k when due."""
        if not self.adaptive:
            return
        self.cost.observe(cost)
        self._steps += 1
        if self._probing:
            self._probing -= 1
            if self._probing:
                return
            self.decide(counts, probe_done=True)
        elif self._steps >= (self._decide_every if self.decisions else self._first):
            self.decide(counts)

    def decide(self, counts: Counts, probe_done: bool = False) -> int:
        self._steps = 0
        self.decisions += 1
        now = [counts.asked_at, counts.found_at, counts.offered_at, counts.kept_at]
        # a position asked for since the last decision forgets part of the past; one not asked for
        # (k below it) keeps what was last measured there until a probe asks again
        fresh = [j < len(now[0]) and now[0][j] > self._seen[0][j] for j in range(self.max_k)]
        for win, seen, cur in zip(self._window, self._seen, now, strict=True):
            for j in range(self.max_k):
                c = cur[j] if j < len(cur) else 0
                win[j] = win[j] * (ACCEPTANCE_MEMORY if fresh[j] else 1.0) + (c - seen[j])
                seen[j] = c
        if self.cost.ready:
            # after a close call was checked without drafts, none has been measured, not modelled:
            # no hysteresis holds drafts the check found to cost more than they yield
            checked = probe_done and self._probe_cap == 0
            k = best_k(self.tokens_per_s, self.max_k, self.k, 0.0 if checked else HYSTERESIS)
            if k != self.k or log.isEnabledFor(logging.DEBUG):  # an operator's why: each k's tokens/s
                scores = ", ".join(f"{j}: {self.tokens_per_s(j):.4g}" for j in range(self.max_k + 1))
                level = logging.INFO if k != self.k else logging.DEBUG
                log.log(level, "speculative drafts: k %d -> %d (tokens/s a row by k: %s)", self.k, k, scores)
            self.k = k
        if self.k == 0:
            self._idle += 1
            if self._idle >= self._probe_every:
                self._idle, self._probing, self._probe_cap = 0, self._probe_steps, self.max_k
        else:
            self._idle = 0
            # one check a decision, never a loop
            if not probe_done and self.cost.ready and self._close():
                self._probing, self._probe_cap = self._probe_steps, 0
        return self.k

    def _close(self) -> bool:
        return self.tokens_per_s(self.k) < (1 + VERIFY_MARGIN) * self.tokens_per_s(0)

    def per_row(self, k: int) -> tuple[float, float]:
        """(positions, tokens) a draftable row is expected to run and yield when offered k drafts."""
        asked, found, offered, kept = self._window
        positions, tau, low, prior_before = 1.0, 1.0, 1.0, 1.0
        for j in range(min(k, self.max_k)):
            f = (found[j] + PRIOR_ROWS) / (asked[j] + PRIOR_ROWS)
            # a later position's prior follows what the one before it measured (the prior's own
            # falloff applied to it): few rows reach a third draft, and an unmoved prior there held
            # tau at 1.07 where the rows kept 1.02 (bench split at 4096)
            prior = self._prior[j] * low / prior_before if prior_before > 0 else 0.0
            low = min(low, (kept[j] + PRIOR_ROWS * prior) / (offered[j] + PRIOR_ROWS))
            prior_before = self._prior[j]
            positions += f
            tau += f * low
        return positions, tau

    def tokens_per_s(self, k: int) -> float:
        """Tokens per second per draftable row at k (the score k is chosen by)."""
        positions, tau = self.per_row(k)
        step = self.cost.step_s(positions)
        return tau / step if step > 0 else 0.0
