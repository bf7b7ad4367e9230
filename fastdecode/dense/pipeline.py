"""`--pipeline auto`, decided by measurement: does the two-mini-batch pipeline pay on this host?

It pays when one mini-batch's network wait and the shards' attention hide behind the other's
S-part; it costs a second round trip per layer and shard and two half-size matmuls. Which wins
depends on the hardware, the round-trip cost and whether dense and shards share cores, so
the chooser measures it on live steps: it alternates piped and unpiped steps for a few probes
each, keeps the faster (median seconds per sequence), and probes again every `every` steps since
batch sizes and contexts drift. Decode-only steps and steps that carry prefill chunks are compared
apart: a prefill step costs several decode steps, so mixing them compared admission waves instead
of the two modes. Whichever kind has its probes first decides (decode-only in a batch admitted
at once; under steady arrivals, where most steps carry a chunk, the mixed ones). Eight probes a
mode: a shared host's steps vary by 10-20% from one to the next, and the probes cost at most 8
worse steps in 512. Pipelined and plain steps give the same tokens.
"""

from __future__ import annotations

import statistics


class PipelineChooser:
    def __init__(self, probes: int = 8, every: int = 512) -> None:
        if probes < 1 or every < 1:
            raise ValueError("probes and every must be >= 1")
        self.probes = probes
        self.every = every
        self._samples = self._empty()
        self._choice: bool | None = None  # None while probing
        self.medians: tuple[float, float] | None = None  # (piped, plain) of the last decision
        self._since = 0
        self._next = True

    @property
    def choice(self) -> bool | None:
        """The current decision (None while probing)."""
        return self._choice

    def choose(self) -> bool:
        if self._choice is not None:
            self._since += 1
            if self._since < self.every:
                return self._choice
            self._choice = None  # probe again
            self._samples = self._empty()
        return self._next

    @staticmethod
    def _empty() -> dict[tuple[bool, bool], list[float]]:
        """(decode_only, piped) -> seconds per sequence of the probes so far."""
        return {(d, p): [] for d in (True, False) for p in (True, False)}

    def record(self, piped: bool, seconds_per_seq: float, decode_only: bool = True) -> None:
        if self._choice is not None:
            return
        self._samples[decode_only, piped].append(seconds_per_seq)
        self._next = not piped
        if all(len(self._samples[decode_only, p]) >= self.probes for p in (True, False)):
            on, off = (statistics.median(self._samples[decode_only, p]) for p in (True, False))
            self.medians = (on, off)
            self._choice = on < off
            self._since = 0
