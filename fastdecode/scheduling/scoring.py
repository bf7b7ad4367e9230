"""Prompt logprobs (`prompt_logprobs`): which chunk scores which prompt positions, and which of the
positions a chunk scored go out (each once, a re-prefill after preemption or recovery scores nothing
twice). Pure Python, no gRPC: two functions the core's planning and apply call.
"""

from __future__ import annotations

from dataclasses import replace

from fastdecode.contract import TokenLogprob
from fastdecode.scheduling.tables import SeqEntry
from fastdecode.scheduling.types import Sampling


def chunk_scoring(seq: SeqEntry, n: int) -> tuple[Sampling, int | None]:
    """The sampling settings of a chunk of n tokens from seq.kv, and the prompt token after it:
    prompt logprobs are asked only of chunks that hold prompt positions not yet sent out (a
    re-prefill after preemption or recovery scores nothing twice, nor the generated history)."""
    sp = seq.req.sampling
    if not sp.prompt_logprobs:
        return sp, None
    n_prompt = len(seq.req.prompt)
    end = seq.kv + n  # the chunk scores positions seq.kv+1 .. end (end when next_token is sent)
    if seq.scored >= n_prompt or end < seq.scored:
        return replace(sp, prompt_logprobs=False), None
    return sp, (seq.tokens[end] if end < n_prompt else None)


def take_prompt_logprobs(seq: SeqEntry, start_pos: int, got: list[TokenLogprob] | None) -> list[TokenLogprob]:
    """The positions of a chunk's prompt logprobs not yet sent out (each goes out once)."""
    if not got:
        return []
    n_prompt = len(seq.req.prompt)
    first = seq.scored - (start_pos + 1)  # got[i] scores position start_pos + 1 + i
    out = got[max(0, first) : n_prompt - (start_pos + 1)] if first < len(got) else []
    seq.scored = max(seq.scored, start_pos + 1 + max(0, first) + len(out))
    return out
