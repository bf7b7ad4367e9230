"""Prompt-lookup drafting (vLLM's `ngram` method): find the last n tokens of a request earlier in its
own tokens (prompt + output) and propose the tokens that followed them.

The meaning is vLLM's (`vllm/v1/spec_decode/ngram_proposer.py`): n runs from `prompt_lookup_max`
down to `prompt_lookup_min` and the longest n that occurs earlier wins; of its occurrences the
earliest is used; the occurrence that is the suffix itself does not count (overlapping ones do);
up to k tokens that followed it are proposed, fewer where the tokens end first.

vLLM rescans the whole context every step (KMP, in numba). Here a request keeps an index of every
n-gram (min <= n <= max) to its earliest start, updated as tokens arrive: a proposal costs
max - min + 1 lookups whatever the context's length. An n-gram's earliest occurrence is gone after a
truncation only if it started in the removed tail, so truncating undoes exactly the entries the
removed positions made. Torch-free, imports no gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastdecode.runtime.errors import InvalidInput
from fastdecode.spec.base import check_k, check_length


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's settings of the method: the most drafts a step asks for, the n-gram lengths tried."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise InvalidInput("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidInput(
                f"want 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )


def propose_ngram(tokens: Sequence[int], k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> list[int]:
    """The stateless form (a scan of all of `tokens`, O(len x max_n^2)): the reference that
    `NgramState` must equal after any appends and truncations."""
    n_tok = len(tokens)
    if k <= 0:
        return []
    toks = list(tokens)
    for n in range(min(prompt_lookup_max, n_tok - 1), prompt_lookup_min - 1, -1):
        suffix = toks[n_tok - n :]
        for start in range(n_tok - n):  # starts before the suffix's own: an earlier occurrence
            if toks[start : start + n] == suffix:
                return toks[start + n : start + n + k]
    return []


class NgramState:
    """One request's tokens and its n-gram index: n-gram (a tuple) -> earliest start."""

    __slots__ = ("_index", "_max", "_min", "_tokens")

    def __init__(self, config: NgramConfig, prompt: Sequence[int] = ()) -> None:
        self._min = config.prompt_lookup_min
        self._max = config.prompt_lookup_max
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.append(prompt)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def append(self, tokens: Sequence[int]) -> None:
        toks, index = self._tokens, self._index
        for t in tokens:
            toks.append(int(t))
            end = len(toks)
            for n in range(self._min, min(self._max, end) + 1):
                # setdefault keeps the earliest start: the occurrence vLLM's scan picks
                index.setdefault(tuple(toks[end - n : end]), end - n)

    def truncate(self, length: int) -> None:
        toks, index = self._tokens, self._index
        check_length(length, len(toks))
        for end in range(len(toks), length, -1):  # the removed positions, as n-gram ends
            for n in range(self._min, min(self._max, end) + 1):
                key = tuple(toks[end - n : end])
                if index.get(key) == end - n:
                    del index[key]
        del toks[length:]

    def propose(self, k: int) -> list[int]:
        check_k(k)
        toks = self._tokens
        n_tok = len(toks)
        if k == 0:
            return []
        for n in range(min(self._max, n_tok - 1), self._min - 1, -1):
            start = self._index.get(tuple(toks[n_tok - n :]))
            # the earliest start is the suffix's own when the n-gram occurs nowhere before it
            if start is not None and start < n_tok - n:
                return toks[start + n : start + n + k]
        return []

    def close(self) -> None:
        self._index.clear()


class NgramProposer:
    """The method with its settings; `start` makes each request's `NgramState`. Holds nothing shared,
    so the tenant plays no part."""

    def __init__(self, config: NgramConfig) -> None:
        self.config = config

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def start(self, prompt: Sequence[int], *, tenant: str = "") -> NgramState:
        return NgramState(self.config, prompt)
