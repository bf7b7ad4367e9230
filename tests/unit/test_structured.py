"""Structured outputs without servers: grammars compile or are a clear InvalidInput, and a
GrammarBank's masks follow the generated tokens (replayed and rolled back) on the real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastdecode.dense.grammar import GrammarBank, unpack_bitmask
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.grammar import Structured, compile_grammar
from fastdecode.runtime.tokenizer import Tokenizer


@pytest.mark.parametrize(
    "bad",
    [
        Structured("json_schema", "{not json"),
        Structured("json_schema", json.dumps({"type": "wat"})),
        Structured("json_schema", json.dumps({"properties": {"a": {"$ref": "#/nope"}}})),
        Structured("regex", "(a"),
        Structured("choice", "[]"),
        Structured("choice", '["a", 3]'),
        Structured("grammar", "start: ("),
        Structured("yaml", ""),
    ],
)
def test_what_does_not_compile_is_invalid_input(bad: Structured) -> None:
    with pytest.raises(InvalidInput):
        compile_grammar(bad)


def test_unpack_bitmask() -> None:
    bm = torch.tensor([[0b101, -1]], dtype=torch.int32)
    got = unpack_bitmask(bm, 40)
    assert got[0, :3].tolist() == [True, False, True]
    assert not got[0, 3:32].any() and got[0, 32:].all() and got.shape == (1, 40)


def _allowed_text(tok: Tokenizer, mask: torch.Tensor) -> set[str]:
    return {tok.decode([i]) for i in mask.nonzero().flatten().tolist()}


def test_masks_follow_the_tokens(smollm2: Path) -> None:
    tok = Tokenizer.from_pretrained(smollm2)
    bank = GrammarBank(smollm2 / "tokenizer.json", 49152, [2])
    grammar = compile_grammar(Structured("choice", json.dumps(["Paris", "London"])))
    (m,) = bank.masks([("s", grammar, [])])
    assert isinstance(m, torch.Tensor) and m.shape == (49152,)
    first = _allowed_text(tok, m)
    assert "Paris" in first and "London" in first and " Paris" not in first and not m[2]
    paris = tok.encode("Paris", add_special_tokens=False)
    (m,) = bank.masks([("s", grammar, paris)])
    assert m.nonzero().flatten().tolist() == [2]  # the choice is complete: only EOS
    (m,) = bank.masks([("s", grammar, [])])  # a step run again: rolled back to no tokens
    assert _allowed_text(tok, m) == first
    bank.forget(["s"])
    (m,) = bank.masks([("s", grammar, paris)])  # a fresh matcher replays the tokens so far
    assert m.nonzero().flatten().tolist() == [2]
    (err,) = bank.masks([("s", grammar, paris + paris)])
    assert isinstance(err, InvalidInput)


def test_a_slow_build_fails_its_row_alone_and_is_found_later(llama_dir: Path) -> None:
    """A matcher that takes longer to build than the step may wait fails only its own row; the
    build runs on its thread, and a later step finds it built."""
    bank = GrammarBank(llama_dir / "tokenizer.json", 2048, [2], wait_s=0.05)
    fast = compile_grammar(Structured("choice", json.dumps(["yes", "no"])))
    slow = compile_grammar(Structured("json_schema", json.dumps({"type": "integer", "multipleOf": 123456})))
    bank.prepare([fast])
    ok, late = bank.masks([("a", fast, []), ("b", slow, [])])
    assert isinstance(ok, torch.Tensor) and ok.any()
    assert isinstance(late, InvalidInput) and "not built within 0.05 s" in late.message
    bank.wait_s = 60.0  # the build goes on meanwhile; this step waits for it
    (m,) = bank.masks([("c", slow, [])])
    assert isinstance(m, torch.Tensor) and m.any() and bank.build_seconds > 0


def test_a_grammar_that_does_not_build_fails_its_row(llama_dir: Path) -> None:
    bank = GrammarBank(llama_dir / "tokenizer.json", 2048, [2])
    fast = compile_grammar(Structured("regex", "[0-9]+"))
    ok, bad = bank.masks([("a", fast, []), ("b", "start: (", [])])
    assert isinstance(ok, torch.Tensor) and isinstance(bad, InvalidInput)


def test_draft_masks_are_each_positions_and_leave_the_matcher_at_the_tokens(smollm2: Path) -> None:
    """Speculative verification: one mask after the generated tokens and one after each draft, each
    what the grammar allows there; past a draft it refuses (or once it ended) only EOS; the matcher
    stays at the generated tokens."""
    tok = Tokenizer.from_pretrained(smollm2)
    bank = GrammarBank(smollm2 / "tokenizer.json", 49152, [2])
    grammar = compile_grammar(Structured("json_schema", json.dumps({"type": "integer"})))
    digits = tok.encode("1234", add_special_tokens=False)
    assert len(digits) >= 2
    stepwise = [bank.masks([("ref", grammar, digits[:j])])[0] for j in range(len(digits) + 1)]
    (m,) = bank.draft_masks([("s", grammar, digits[:1], digits[1:])])
    assert isinstance(m, torch.Tensor) and m.shape == (len(digits), 49152)
    for j in range(len(digits)):
        assert torch.equal(m[j], stepwise[j + 1]), j
    # a refused draft (a letter in an integer): the positions after it allow only EOS
    letter = tok.encode("x", add_special_tokens=False)
    (m,) = bank.draft_masks([("s", grammar, digits[:1], letter + digits[1:2])])
    assert torch.equal(m[0], stepwise[1]) and not m[0][letter[0]]
    assert m[1:].nonzero()[:, 1].unique().tolist() == [2]
    # the matcher did not move: the next step's tokens replay from the generated ones
    (again,) = bank.masks([("s", grammar, digits[:2])])
    assert torch.equal(again, stepwise[2])
    # rows without drafts beside rows with them, in one call
    plain, drafted = bank.draft_masks([("p", grammar, [], ()), ("q", grammar, [], digits[:1])])
    assert plain.shape == (1, 49152) and torch.equal(plain[0], stepwise[0])
    assert torch.equal(drafted[1], stepwise[1])
