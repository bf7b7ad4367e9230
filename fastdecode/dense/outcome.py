"""What one dense step answers: each sequence's outcome (its token or tokens, or its error) and the
step's timings. Imports no gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdecode.contract import TokenLogprob


@dataclass
class Outcome:
    token_id: int = -1
    logprob: float = 0.0
    error: BaseException | None = None
    top: tuple[tuple[int, float], ...] = ()  # the sampled position's top alternatives, when asked
    prompt: list[TokenLogprob] = field(default_factory=list)  # scored positions start_pos+1..
    after: list[Outcome] = field(default_factory=list)  # the row's later decode steps (multistep.py)


@dataclass
class Timings:
    s_part_seconds: float = 0.0  # S-part and sampling compute
    s_part_cpu_seconds: float = 0.0  # CPU of the step's thread in it: wall less preemption by others
    shard_wait_seconds: float = 0.0  # step time not covered by S-part work
    step_seconds: float = 0.0
    attend_seconds: float = 0.0  # time mini-batches spent awaiting the shards, summed over them
    pipelined: bool = False  # whether this step ran two mini-batches
    # CPU of the LM head and sampling, all of the process's threads while it runs (on an emulated
    # device, the host's stand-in for sampling a GPU does on the device: fastdecode/dense/emulated.py)
    head_cpu_seconds: float = 0.0
    round_trips: int = 0  # Attend items sent: one shard's share of one layer of one mini-batch

    @property
    def overlap_ratio(self) -> float:
        """Share of the shorter half (S-part or attention) hidden behind the other: 0 when they ran one
        after the other (no pipeline), 1 when the step took only as long as the longer half."""
        shorter = min(self.s_part_seconds, self.attend_seconds)
        if shorter <= 0:
            return 0.0
        hidden = self.s_part_seconds + self.attend_seconds - self.step_seconds
        return min(1.0, max(0.0, hidden / shorter))
