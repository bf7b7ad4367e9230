"""What every drafting method offers the scheduler: a proposer (the method and its settings, shared by
all requests) that starts a `DraftState` per request. Torch-free, imports no gRPC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fastdecode.runtime.errors import InvalidInput


class DraftState(Protocol):
    """One request's drafting state over its tokens (prompt + output so far).

    Feed it only tokens the target model produced or accepted (never unverified drafts), so nothing
    needs rolling back after a rejection; `truncate` is for the rarer cases where the request's own
    history shrinks (a recompute from fewer tokens, a stop string cutting the output)."""

    @property
    def num_tokens(self) -> int:
        """How many tokens the state holds (prompt included)."""
        ...

    def append(self, tokens: Sequence[int]) -> None:
        """Add tokens at the end (a step's accepted drafts and its bonus token)."""
        ...

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens and forget the rest (as `file.truncate(size)`)."""
        ...

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens to follow the current tokens; [] when the method has nothing."""
        ...

    def close(self) -> None:
        """The request ended: free what only it used (what it taught a shared index may stay)."""
        ...


class Proposer(Protocol):
    """A drafting method with its settings. `num_speculative_tokens` is the most drafts a step asks
    for (vLLM's meaning); the caller passes a k no larger to `DraftState.propose`, lowered where the
    request's remaining budget (max_tokens, the model's length) is smaller."""

    @property
    def num_speculative_tokens(self) -> int: ...

    def start(self, prompt: Sequence[int], *, tenant: str = "") -> DraftState:
        """A new request's state over its prompt. `tenant` scopes what requests may share (only
        methods with a shared index use it)."""
        ...


def check_k(k: int) -> int:
    if k < 0:
        raise InvalidInput(f"k must be >= 0, got {k}")
    return k


def check_length(length: int, num_tokens: int) -> int:
    if not 0 <= length <= num_tokens:
        raise InvalidInput(f"cannot truncate {num_tokens} tokens to {length}")
    return length
