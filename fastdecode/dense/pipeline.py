"""`--pipeline auto`, decided by measurement: does the two-mini-batch pipeline pay on this host?

It pays when one mini-batch's network wait and the shards' attention hide behind the other's
S-part; it costs a second round trip per layer and shard and two half-size matmuls. Which wins
depends on the hardware, the round-trip cost and whether dense and shards share cores, so
the chooser measures it on live decode steps (the runner leaves steps with prefill chunks out:
they cost far more per sequence): it alternates piped and unpiped steps for a few probes each,
keeps the faster (median seconds per sequence), and probes again every `every` steps since batch
sizes and contexts drift. Eight probes a mode: a shared host's steps vary by 10-20% from one to
the next, and the probes cost at most 8 worse steps in 512. Pipelined and plain steps give the
same tokens.
"""

from __future__ import annotations

import statistics


class PipelineChooser:
    def __init__(self, probes: int = 8, every: int = 512) -> None:
        if probes < 1 or every < 1:
            raise ValueError("probes and every must be >= 1")
        self.probes = probes
        self.every = every
        self._samples: dict[bool, list[float]] = {True: [], False: []}
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
            self._samples = {True: [], False: []}
        return self._next

    def record(self, piped: bool, seconds_per_seq: float) -> None:
        if self._choice is not None:
            return
        self._samples[piped].append(seconds_per_seq)
        self._next = not piped
        if all(len(v) >= self.probes for v in self._samples.values()):
            on, off = (statistics.median(self._samples[p]) for p in (True, False))
            self.medians = (on, off)
            self._choice = on < off
            self._since = 0
