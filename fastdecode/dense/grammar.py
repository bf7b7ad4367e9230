"""Structured outputs: a JSON schema, JSON object, regex or choice list compiled into an llguidance
grammar (fastdecode/runtime/grammar.py, with its limits; the gateway compiles in worker processes and
answers a 400 for one that does not compile), and a matcher per sequence that masks the logits
before sampling (gpu_dense).

Why llguidance (not xgrammar): it has no Python dependencies (xgrammar's wheel requires torch, triton
and transformers, which would pull or move the pinned torch), compiles a schema lazily in well under a
millisecond (xgrammar precompiles per schema and caches), and computes a mask in tens of microseconds
(`fastdecode bench structured` measures it at B=32). vLLM ships both.

Building a matcher (the lexer over the tokenizer) can take seconds for a small spec, and no
llguidance limit bounds it, so it never happens inside a step: a grammar's build starts on its own
thread when a plan first names it (`prepare`, while its prompt is still prefilling), and a step
waits for it at most `wait_s` in all; a sequence whose matcher is not ready by then fails alone
with INVALID_ARGUMENT, and the batch goes on. The gateway refuses any grammar whose build took
longer than its build limit, so through it this is a backstop.

A matcher follows the sequence's generated tokens: the dense runner feeds it the tokens sampled since
it last looked, and a sequence prefilled again (recovery, preemption) or a step run twice replays or
rolls it back from the token history, so the mask always matches the tokens so far. Imports no gRPC;
llguidance is imported on first use.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdecode.runtime.errors import FailedPrecondition, InvalidInput
from fastdecode.runtime.grammar import (
    KINDS,
    MAX_SPEC_CHARS,
    Structured,
    big_stack_future,
    build_matcher,
    check_grammar,
    compile_grammar,
    load_llguidance,
    load_tokenizer,
)

__all__ = ["KINDS", "MAX_SPEC_CHARS", "GrammarBank", "Structured", "compile_grammar", "unpack_bitmask"]
MAX_MATCHERS = 4096  # matchers kept for sequences not seen lately go first past this many
MAX_FRESH = 64  # built grammars kept, each copied for every new sequence of it
MAX_BUILDING = 8  # builds at once: past it a new grammar fails its sequence (memory stays bounded)


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

    def __init__(
        self, tokenizer_json: Path, vocab_size: int, eos_ids: Sequence[int], wait_s: float = 1.0
    ) -> None:
        self.path = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.wait_s = wait_s
        self._tokenizer: Any = None
        self._matchers: OrderedDict[str, _Matched] = OrderedDict()
        # a fresh matcher per grammar, copied for each new sequence (building one parses the grammar)
        self._fresh: OrderedDict[str, Any] = OrderedDict()
        self._building: dict[str, concurrent.futures.Future[Any]] = {}
        self._executor: Any = None
        self._lock = threading.Lock()  # masks are computed on a worker thread
        self._build_lock = threading.Lock()  # prepare (the event loop) beside masks (its thread)
        self.build_seconds = 0.0  # matcher builds finished so far, summed (their own threads)

    def _tok(self) -> Any:
        if self._tokenizer is None:
            if not self.path.is_file():
                raise FailedPrecondition(f"structured outputs need the model's tokenizer ({self.path})")
            self._tokenizer = load_tokenizer(str(self.path), self.vocab_size, self.eos_ids)
        return self._tokenizer

    def prepare(self, grammars: Iterable[str]) -> None:
        """Start building the matchers of grammars not built yet, each on its own thread; errors
        surface when a step asks for their masks."""
        with self._build_lock:
            for g in grammars:
                if g and g not in self._fresh and g not in self._building:
                    try:
                        self._start_build(g)
                    except (InvalidInput, FailedPrecondition):
                        pass  # its step's mask says so, for its sequence alone

    def _start_build(self, grammar: str) -> concurrent.futures.Future[Any]:
        if len(self._building) >= MAX_BUILDING:
            raise InvalidInput(f"{MAX_BUILDING} grammars are being built already; try again in a moment")
        check_grammar(grammar)  # the gateway's limits again (a Submit may come from elsewhere)
        tok = self._tok()

        def build() -> Any:
            t0 = time.perf_counter()
            try:
                return build_matcher(tok, grammar)
            finally:
                self.build_seconds += time.perf_counter() - t0

        future = big_stack_future(build)
        self._building[grammar] = future
        return future

    def _ready(self, grammars: Iterable[str], deadline: float) -> dict[str, Exception]:
        """Wait until `deadline` at most for these grammars' builds; what each that is not
        usable met (a build error, or not ready in time)."""
        failed: dict[str, Exception] = {}
        names = set(grammars)
        with self._build_lock:
            wanted: dict[str, concurrent.futures.Future[Any]] = {}
            for g in names:
                if g in self._fresh:
                    self._fresh.move_to_end(g)
                    continue
                try:
                    wanted[g] = self._building.get(g) or self._start_build(g)
                except (InvalidInput, FailedPrecondition) as e:
                    failed[g] = e
        concurrent.futures.wait(wanted.values(), timeout=max(0.0, deadline - time.perf_counter()))
        with self._build_lock:
            for g, future in wanted.items():
                if not future.done():  # it builds on; a later sequence of it may find it ready
                    failed[g] = InvalidInput(
                        f"the grammar's matcher was not built within {self.wait_s:g} s; simplify "
                        "the structured output (a large multipleOf, many patterns or alternatives "
                        "cost the most)"
                    )
                    continue
                del self._building[g]
                try:
                    self._fresh[g] = future.result()
                except (InvalidInput, FailedPrecondition) as e:
                    failed[g] = e
                except MemoryError:
                    failed[g] = InvalidInput("the grammar's matcher needs more memory than there is")
            while len(self._fresh) > max(MAX_FRESH, len(names)):  # never this step's
                self._fresh.popitem(last=False)
        return failed

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
        return self._fresh[grammar].deep_copy()  # `_ready` put it there

    def masks(
        self, rows: Sequence[tuple[str, str, Sequence[int]]], deadline: float | None = None
    ) -> list[torch.Tensor | Exception]:
        """For each (seq_id, grammar, generated tokens): the [V] bool mask of the tokens the grammar
        allows next, or the error that sequence met. Builds not ready by `deadline` (perf_counter;
        default `wait_s` from now) fail their rows."""
        out = self.draft_masks([(sid, g, gen, ()) for sid, g, gen in rows], deadline)
        return [o if isinstance(o, Exception) else o[0] for o in out]

    def draft_masks(
        self, rows: Sequence[tuple[str, str, Sequence[int], Sequence[int]]], deadline: float | None = None
    ) -> list[torch.Tensor | Exception]:
        """For each (seq_id, grammar, generated tokens, drafts): the [d + 1, V] bool masks of the tokens
        the grammar allows after the generated tokens and after each draft (speculative verification),
        or the error that sequence met. llguidance advances the matcher through the drafts and rolls it
        back, so it stays at the generated tokens. Past a draft the grammar refuses, or once it has
        ended, a position allows only EOS: verification never keeps a draft there (the draft before
        was refused), and a finished grammar allows nothing else."""
        if deadline is None:
            deadline = time.perf_counter() + self.wait_s
        unbuilt = self._ready((r[1] for r in rows), deadline)
        out: list[torch.Tensor | Exception] = []
        first = [0]  # each row's first mask in the bitmask
        for r in rows:
            first.append(first[-1] + 1 + len(r[3]))
        with self._lock:
            words = (self.vocab_size + 31) // 32
            bitmask = torch.zeros(first[-1], words, dtype=torch.int32)
            live: list[tuple[Any, int, list[int]]] = []
            for i, (sid, grammar, generated, drafts) in enumerate(rows):
                if grammar in unbuilt:
                    out.append(unbuilt[grammar])
                    continue
                try:
                    live.append((self._advance(sid, grammar, generated), first[i], list(drafts)))
                    out.append(torch.empty(0))
                except (InvalidInput, FailedPrecondition) as e:
                    out.append(e)
            if live:  # all rows at once, on llguidance's own threads
                if self._executor is None:
                    self._executor = load_llguidance().LLExecutor()
                ptr, size, n = bitmask.data_ptr(), words * 4, first[-1]
                drafted = [r for r in live if r[2]]  # llguidance takes rows with drafts apart
                plain = [(m, at) for m, at, d in live if not d]
                if drafted:
                    self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, size, n)
                if plain:
                    self._executor.unsafe_compute_mask_ptr(plain, ptr, size, n)
            allowed = unpack_bitmask(bitmask, self.vocab_size) if rows else None
        eos = [t for t in self.eos_ids if 0 <= t < self.vocab_size]
        for i, o in enumerate(out):
            if isinstance(o, Exception):
                continue
            m = allowed[first[i] : first[i + 1]]  # type: ignore[index]
            past = (~m[1:].any(dim=1)).nonzero().flatten() + 1  # draft positions left empty
            if len(past) and eos:
                m[past.unsqueeze(1), torch.tensor(eos)] = True
            out[i] = m
        return out
