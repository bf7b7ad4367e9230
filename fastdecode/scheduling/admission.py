"""Admission policies: how many waiting sequences may start this step.

`StabilizedAdmission` is the paper's sequence-level load-stabilizing schedule (Algorithm 1, see
ARCHITECTURE.md, "The FastDecode idea"). Units: the step index t counts scheduler steps; a sequence
started at step r holds base + (t - r + 1) KV tokens during step t, where base = prompt length - 1
(its prompt at its prefill step, one more token per decode step). A micro-batch of m sequences
expected to generate S tokens lives during steps r .. r+S-1, so its end step is E = r + S, and
during its last step each of its sequences holds base + S tokens. W[i] is the load expected during
micro-batch i's last step (just before E[i]), where the load peaks between two ends.

W[i] is kept in the paper's units (generated tokens, base = 0), exactly as Algorithm 1 updates it: a
batch started at t adds (E[i] - t) * m to W[i], and a new batch appends W = m * S. Prompts enter
separately, as base x the number of sequences counted in W[i] (MicroBatch.counted), with one base for
all: so a better estimate of the mean prompt moves every W[i] and the derived W_lim together, instead of
leaving old batches counted with an old base (that mismatch alone delays starts by a few steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from fastdecode.runtime.errors import InvalidInput


@dataclass(frozen=True)
class Candidate:
    """A waiting sequence as admission sees it."""

    seq_id: str
    prompt_len: int
    expected_gen: float  # tokens it is expected to generate (max_tokens corrected by the observed ratio)


@dataclass
class MicroBatch:
    """A live micro-batch of Algorithm 1: size M, end step E, load W (generated tokens) expected just
    before E, and how many sequences W counts (for the prompt term)."""

    size: int
    end: int
    load: float
    start: int = 0
    counted: int = 0  # sequences counted in load (itself and later batches alive at its end)
    members: set[str] = field(default_factory=set)

    def total(self, base: float) -> float:
        """W[i] with prompts: load + base x sequences counted."""
        return self.load + base * self.counted


@runtime_checkable
class AdmissionPolicy(Protocol):
    """What SchedulerCore asks of an admission policy."""

    name: str

    def admissible(self, step: int, waiting: Sequence[Candidate], running: int, max_running: int) -> int:
        """How many of `waiting` (a FIFO prefix) may start at `step`."""
        ...

    def started(self, step: int, seqs: Sequence[Candidate]) -> None:
        """These sequences (a subset of what admissible allowed, in order) did start at `step`."""
        ...

    def finished(self, step: int, seq_id: str) -> None:
        """A started sequence left: finished, cancelled, failed, or sent back to waiting."""
        ...

    def w_limit(self, step: int) -> float | None:
        """The load limit in force at `step` (None when the policy has none)."""
        ...

    def set_kv_capacity(self, tokens: int | None) -> None:
        """KV tokens the healthy shards hold together (None: unknown); a load limit stays within it."""
        ...


class NaiveAdmission:
    """Admit whenever there is room in the running batch."""

    name = "naive"

    def admissible(self, step: int, waiting: Sequence[Candidate], running: int, max_running: int) -> int:
        return max(0, min(len(waiting), max_running - running))

    def started(self, step: int, seqs: Sequence[Candidate]) -> None:
        pass

    def finished(self, step: int, seq_id: str) -> None:
        pass

    def w_limit(self, step: int) -> float | None:
        return None

    def set_kv_capacity(self, tokens: int | None) -> None:
        pass


def earliest_start(
    t: int, m: int, S: float, live: Sequence[MicroBatch], w_limit: float, base: float = 0.0
) -> int:
    """Algorithm 1: the earliest step r >= t at which a micro-batch of m sequences may start.

    r = max(t, max_i(E[i] - floor((W_lim - W[i]) / m) + 1)) over micro-batches still live at t (E[i] > t).
    Read as a constraint: W[i] + m * (E[i] - r + 1) <= W_lim, i.e. the new batch's load at E[i] plus one
    more step of growth (m tokens) must fit, so admitted load stays <= W_lim - m. With base > 0 (prompt
    tokens beyond the paper's model) W[i] is load + base * counted and the new batch brings m * base.
    S does not move r (only the live batches constrain it); it is taken for symmetry with
    start_micro_batch.
    """
    if m < 1:
        raise InvalidInput("micro-batch size must be >= 1")
    del S
    r = t
    for b in live:
        if b.end <= t:
            continue
        r = max(r, b.end - math.floor((w_limit - b.total(base) - m * base) / m) + 1)
    return r


def start_micro_batch(
    t: int,
    m: int,
    S: float,
    live: list[MicroBatch],
    members: Sequence[str] = (),
) -> MicroBatch:
    """Algorithm 1's update: start m sequences at t; appends and returns the new micro-batch.

    Adds (E[i] - t) * m to every live W[i] the new batch outlives and appends W = m * S. With one S for
    all batches that is every live one, as in the paper. With mixed S, a batch ending before E[i] adds
    nothing to W[i], and older batches still live at the new end count in the new W, so W stays the
    load expected at each end.
    """
    length = max(1, round(S))
    end = t + length
    for b in live:
        if b.end > t and end >= b.end:
            b.load += m * (b.end - t)
            b.counted += m
    load, counted = float(m * length), m
    for b in live:
        if b.end >= end:
            load += b.size * (end - b.start)
            counted += b.size
    new = MicroBatch(size=m, end=end, load=load, start=t, counted=counted, members=set(members))
    live.append(new)
    return new


class StabilizedAdmission:
    """The paper's load-stabilizing admission (Algorithm 1) with a cold-start ramp.

    w_limit: the load limit W_lim in KV tokens; None derives it from the running batch B (max_running),
      the expected generation length S and the micro-batch m:
        W_lim = B * (base + (S + F) / 2) + m + slack,   F = m * S / B the steps between starts.
      B * (S + F) / 2 is the paper's steady load of starts spaced F apart; + m is Algorithm 1's one
      step of headroom (see earliest_start), so that steady state is admissible at all.
    micro_batch: m; None uses ceil(B / 16), about 16 live micro-batches (steady load ~53% of the naive
      peak).
    ramp_steps: at cold start (nothing live) W_lim climbs along the load of starts spaced F apart,
      reaching the full limit after S - F steps; without it the earliest-start rule packs the first
      micro-batches into consecutive steps and keeps that clumped rhythm (fewer than B running).
      None: that natural ramp; 0: no ramp; N: the same levels stretched over N steps.
    slack: tokens added to the derived limit and ramp levels. None: m * F / 2, half a start interval
      of growth: it absorbs drift of the estimates below, yet stays under the m * (F + base) that would
      let two micro-batches start together (clumps that end together and leave gaps).

    Prompt lengths enter as one running mean (base = mean prompt - 1), not per micro-batch: per-batch
    prompt noise is as large as the headroom, and a start it delays leaves a gap that the cap on
    running sequences never refills. S is per micro-batch (the mean expected generation of its
    members); its running mean sets F and the derived limit.
    """

    name = "stabilized"

    def __init__(
        self,
        w_limit: float | None = None,
        micro_batch: int | None = None,
        ramp_steps: int | None = None,
        *,
        slack: float | None = None,
        window: int = 256,
    ) -> None:
        if w_limit is not None and w_limit <= 0:
            raise InvalidInput("w_limit must be > 0")
        if micro_batch is not None and micro_batch < 1:
            raise InvalidInput("micro_batch must be >= 1")
        if ramp_steps is not None and ramp_steps < 0:
            raise InvalidInput("ramp_steps must be >= 0")
        if slack is not None and slack < 0:
            raise InvalidInput("slack must be >= 0")
        self._w_limit = w_limit
        self._m = micro_batch
        self._ramp_steps = ramp_steps
        self._slack = slack
        self._window = max(1, window)
        self._live: list[MicroBatch] = []
        self._member: dict[str, MicroBatch] = {}
        self._t0 = 0  # step of the last cold start (ramp origin)
        self._S: float | None = None  # running mean of expected generation length
        self._base = 0.0  # running mean of prompt length - 1
        self._seen = 0
        self._B = 1  # last max_running seen
        self._kv_capacity: int | None = None

    # -- the numbers -------------------------------------------------------------------------
    def micro_batch(self, max_running: int | None = None) -> int:
        B = max_running if max_running is not None else self._B
        return self._m if self._m is not None else max(1, math.ceil(B / 16))

    def spacing(self) -> float:
        """F: steps between micro-batch starts at steady state."""
        S = self._S if self._S is not None else 1.0
        return max(1.0, self.micro_batch() * S / max(1, self._B))

    def slack(self) -> float:
        """Tokens of W_lim above the exact steady load (derived limit and ramp levels only)."""
        if self._slack is not None:
            return self._slack
        return self.micro_batch() * self.spacing() / 2

    def set_kv_capacity(self, tokens: int | None) -> None:
        self._kv_capacity = tokens

    def full_limit(self) -> float | None:
        """W_lim, never above the KV the shards hold: W counts tokens held (what blocks on demand
        allocate), so a load within capacity is one that needs no preemption if the estimates hold."""
        if self._w_limit is not None:
            limit = self._w_limit
        elif self._S is None:
            return None
        else:
            B, m, F = self._B, self.micro_batch(), self.spacing()
            limit = B * (self._base + (self._S + F) / 2) + m + self.slack()
        if self._kv_capacity is not None:
            limit = min(limit, float(self._kv_capacity))
        return limit

    def w_limit(self, step: int) -> float | None:
        full = self.full_limit()
        if full is None or self._ramp_steps == 0 or self._S is None:
            return full
        m, F, S = self.micro_batch(), self.spacing(), self._S
        levels = max(1, math.floor(self._B / m))  # micro-batches live at steady state
        if levels <= 1:
            return full
        every = F if self._ramp_steps is None else self._ramp_steps / (levels - 1)
        k = math.floor((step - self._t0) / every) if every > 0 else levels
        if k >= levels - 1:
            return full
        # load just before the first batch ends if k + 1 batches had started F apart, + headroom m
        ramp = m * (k + 1) * (self._base + S - k * F / 2) + m + self.slack()
        return min(full, ramp)

    # -- the protocol ------------------------------------------------------------------------
    def _prune(self, step: int) -> None:
        keep = []
        for b in self._live:
            if b.end > step and b.members:
                keep.append(b)
            else:
                for s in b.members:
                    self._member.pop(s, None)
        self._live = keep

    def _groups(self, seqs: Sequence[Candidate], room: int) -> list[Sequence[Candidate]]:
        m = self.micro_batch()
        out, i = [], 0
        while i < len(seqs) and room > 0:
            g = seqs[i : i + min(m, room)]
            out.append(g)
            i += len(g)
            room -= len(g)
        return out

    def _observe(self, seqs: Sequence[Candidate]) -> None:
        for c in seqs:
            self._seen = min(self._seen + 1, self._window)
            S = self._S if self._S is not None else c.expected_gen
            self._S = S + (c.expected_gen - S) / self._seen
            self._base += (max(0, c.prompt_len - 1) - self._base) / self._seen

    def admissible(self, step: int, waiting: Sequence[Candidate], running: int, max_running: int) -> int:
        self._B = max(1, max_running)
        self._prune(step)
        if not waiting:
            return 0
        if not self._live:
            self._t0 = step
        if self._S is None:
            self._observe(waiting[: self.micro_batch()])
            self._seen = 0  # a first guess only: the started sequences count from scratch
        w = self.w_limit(step)
        assert w is not None
        trial = [MicroBatch(b.size, b.end, b.load, b.start, b.counted) for b in self._live]
        n = 0
        for g in self._groups(waiting, max_running - running):
            S = sum(c.expected_gen for c in g) / len(g)
            r = earliest_start(step, len(g), S, trial, w, self._base)
            # an idle system always takes its first micro-batch, whatever the limit
            if r > step and not (running == 0 and n == 0):
                break
            start_micro_batch(step, len(g), S, trial)
            n += len(g)
        return n

    def started(self, step: int, seqs: Sequence[Candidate]) -> None:
        if not seqs:
            return
        self._prune(step)
        if not self._live:
            self._t0 = step
        for g in self._groups(seqs, len(seqs)):
            S = sum(c.expected_gen for c in g) / len(g)
            b = start_micro_batch(step, len(g), S, self._live, [c.seq_id for c in g])
            for c in g:
                self._member[c.seq_id] = b
        self._observe(seqs)

    def finished(self, step: int, seq_id: str) -> None:
        b = self._member.pop(seq_id, None)
        if b is None or b not in self._live:
            return
        # This member no longer holds load at any end it was counted in (its own end and those of
        # live batches ending no later than it).
        for other in self._live:
            if other.end <= b.end and other.end > step:
                other.load -= other.end - b.start
                other.counted -= 1
        b.members.discard(seq_id)
        b.size -= 1
        if not b.members:
            self._live.remove(b)

    # -- introspection -----------------------------------------------------------------------
    def live(self) -> list[MicroBatch]:
        return list(self._live)

    def info(self, step: int) -> dict[str, float | int | None]:
        return {
            "micro_batch": self.micro_batch(),
            "spacing_steps": self.spacing(),
            "expected_len": self._S,
            "base": self._base,
            "w_limit": self.w_limit(step),
            "live_micro_batches": len(self._live),
        }
