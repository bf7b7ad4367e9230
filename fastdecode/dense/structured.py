"""Structured outputs: a JSON schema, JSON object, regex or choice list compiled into an llguidance
grammar (fastdecode/runtime/grammar.py, with its limits; the gateway compiles in worker processes and
answers a 400 for one that does not compile), and a matcher per sequence that masks the logits
before sampling (gpu_dense).

Why llguidance (not xgrammar): it has no Python dependencies (xgrammar's wheel requires torch, triton
and transformers, which would pull or move the pinned torch), compiles a schema lazily in well under a
millisecond (xgrammar precompiles per schema and caches), and computes a mask in tens of microseconds
(`fastdecode bench structured` measures it at B=32). vLLM ships both.

A matcher follows the sequence's generated tokens: the dense runner feeds it the tokens sampled since
it last looked, and a sequence prefilled again (recovery, preemption) or a step run twice replays or
rolls it back from the token history, so the mask always matches the tokens so far. Imports no gRPC;
llguidance is imported on first use.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdecode.runtime.errors import FailedPrecondition, InvalidInput
from fastdecode.runtime.grammar import (
    KINDS,
    MAX_SPEC_CHARS,
    Structured,
    check_grammar,
    compile_grammar,
    load_llguidance,
    on_big_stack,
    parser_limits,
)

__all__ = ["KINDS", "MAX_SPEC_CHARS", "GrammarBank", "Structured", "compile_grammar", "unpack_bitmask"]
MAX_MATCHERS = 4096  # matchers kept for sequences not seen lately go first past this many


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, ceil(V/32)] int32 (bit j of word w allows token 32w+j) -> [N, V] bool. Read as
    little-endian bytes, token t is bit t % 8 of byte t // 8: numpy's unpackbits does it in 0.3 ms at
    N=32, V=49152 (shifting each bit of each word in torch took 14-40 ms on 2 cores)."""
    raw = bitmask.contiguous().numpy().view(np.uint8)
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.view(np.bool_))


class _Matched:
    def __init__(self, grammar: str, matcher: Any) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self.consumed = 0  # generated tokens fed so far


class GrammarBank:
    """One llguidance matcher per sequence with a grammar, on the dense side."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.path = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._tokenizer: Any = None
        self._matchers: OrderedDict[str, _Matched] = OrderedDict()
        # a fresh matcher per grammar, copied for each new sequence (building one parses the grammar)
        self._fresh: OrderedDict[str, Any] = OrderedDict()
        self._executor: Any = None
        self._lock = threading.Lock()  # masks are computed on a worker thread

    def _tok(self) -> Any:
        if self._tokenizer is None:
            if not self.path.is_file():
                raise FailedPrecondition(f"structured outputs need the model's tokenizer ({self.path})")
            self._tokenizer = load_llguidance().LLTokenizer(
                str(self.path), n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        return self._tokenizer

    def forget(self, seq_ids: Sequence[str]) -> None:
        with self._lock:
            for sid in seq_ids:
                self._matchers.pop(sid, None)

    def _advance(self, seq_id: str, grammar: str, generated: Sequence[int]) -> Any:
        """The sequence's matcher, fed exactly `generated` (replayed or rolled back as needed)."""
        m = self._matchers.get(seq_id)
        if m is not None and m.consumed > len(generated):  # a step ran again: back to its tokens
            if m.matcher.rollback(m.consumed - len(generated)):
                m.consumed = len(generated)
            else:
                m = None
        if m is None or m.grammar != grammar or m.matcher.is_error():
            m = _Matched(grammar, self._new_matcher(grammar))
        todo = list(generated[m.consumed :])
        if todo:
            m.matcher.consume_tokens(todo)
            if m.matcher.is_error():
                self._matchers.pop(seq_id, None)
                raise InvalidInput(f"a token broke the grammar: {m.matcher.get_error()}")
            m.consumed = len(generated)
        self._matchers[seq_id] = m
        self._matchers.move_to_end(seq_id)
        while len(self._matchers) > MAX_MATCHERS:
            self._matchers.popitem(last=False)
        return m.matcher

    def _new_matcher(self, grammar: str) -> Any:
        fresh = self._fresh.get(grammar)
        if fresh is None:
            # the gateway's limits again (a Submit may come from elsewhere), then llguidance on a big
            # stack: building a matcher parses the grammar as recursively as compiling it
            check_grammar(grammar)
            tok = self._tok()
            fresh = on_big_stack(lambda: load_llguidance().LLMatcher(tok, grammar, limits=parser_limits()))
            if fresh.is_error():
                raise InvalidInput(f"the grammar does not compile: {fresh.get_error()}")
            self._fresh[grammar] = fresh
            while len(self._fresh) > 64:
                self._fresh.popitem(last=False)
        self._fresh.move_to_end(grammar)
        return fresh.deep_copy()

    def masks(self, rows: Sequence[tuple[str, str, Sequence[int]]]) -> list[torch.Tensor | Exception]:
        """For each (seq_id, grammar, generated tokens): the [V] bool mask of the tokens the grammar
        allows next, or the error that sequence met."""
        out: list[torch.Tensor | Exception] = []
        with self._lock:
            words = (self.vocab_size + 31) // 32
            bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
            live: list[tuple[Any, int]] = []
            for i, (sid, grammar, generated) in enumerate(rows):
                try:
                    live.append((self._advance(sid, grammar, generated), i))
                    out.append(torch.empty(0))
                except (InvalidInput, FailedPrecondition) as e:
                    out.append(e)
            if live:  # all rows at once, on llguidance's own threads
                if self._executor is None:
                    self._executor = load_llguidance().LLExecutor()
                self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), words * 4, len(rows))
            allowed = unpack_bitmask(bitmask, self.vocab_size) if rows else None
        return [o if isinstance(o, Exception) else allowed[i] for i, o in enumerate(out)]  # type: ignore[index]
