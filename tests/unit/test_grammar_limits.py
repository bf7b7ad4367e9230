"""The grammar limits (fastdecode/runtime/grammar.py): the inputs that crashed llguidance are refused
before it sees them, on the gateway's spec and on the compiled grammar gpu_dense builds a matcher
from; real schemas (recursive ones included) and grammars within the limits still compile; and the
compile runs on a big stack, so even past the limits llguidance does not overflow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import fastdecode.runtime.grammar as grammar
from fastdecode.dense.grammar import GrammarBank
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.grammar import (
    MAX_LARK_RULES,
    MAX_SCHEMA_DEPTH,
    Structured,
    check_grammar,
    compile_grammar,
    schema_depth,
)


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a"' for i in range(n)), f'r{n}: "b"'])


TREE = {  # recursive: a node's children are nodes
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        }
    },
    "$ref": "#/$defs/node",
}


def test_schema_depth_counts_nesting_and_ref_hops() -> None:
    assert schema_depth({"type": "string"}) == (1, 1)
    d, _ = schema_depth(ref_chain(10))
    assert 30 <= d <= 34  # three levels a hop: the definition, its properties, the $ref holder
    d, nodes = schema_depth(TREE)
    assert d < 12 and nodes < 12  # a cycle counts once


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (Structured("json_schema", json.dumps(ref_chain(1000))), f"the limit is {MAX_SCHEMA_DEPTH}"),
        (Structured("grammar", lark_chain(3000)), f"the limit is {MAX_LARK_RULES}"),
        (Structured("grammar", "start: %json " + json.dumps(ref_chain(1000))), "a %json schema"),
        (Structured("regex", "(" * 300 + "a" + ")" * 300), "parentheses"),
        (Structured("json_schema", "[" * 100_000), "nests too deeply"),
        (
            Structured("json_schema", json.dumps({"anyOf": [{}] * 30_000}, separators=(",", ":"))),
            "objects and lists",
        ),
    ],
)
def test_the_crashers_are_refused_before_llguidance(spec: Structured, says: str) -> None:
    with pytest.raises(InvalidInput, match="limit|deep") as e:
        compile_grammar(spec)
    assert says in e.value.message


@pytest.mark.parametrize(
    "spec",
    [
        Structured("json_schema", json.dumps(ref_chain(40))),
        Structured("json_schema", json.dumps(TREE)),
        Structured("grammar", lark_chain(500)),
        Structured("regex", "(" * 50 + "a" + ")" * 50),
    ],
)
def test_within_the_limits_compiles_and_passes_the_dense_check(spec: Structured) -> None:
    check_grammar(compile_grammar(spec))


def test_the_dense_side_checks_a_compiled_grammar_before_building_a_matcher(tmp_path: Path) -> None:
    """A grammar from a Submit that skipped the gateway: refused per sequence, never built (the
    tokenizer is not even read)."""
    deep = json.dumps({"grammars": [{"json_schema": ref_chain(1000)}]})
    with pytest.raises(InvalidInput, match="levels deep"):
        check_grammar(deep)
    with pytest.raises(InvalidInput, match="rules"):
        check_grammar(lark_chain(3000))
    bank = GrammarBank(tmp_path / "absent-tokenizer.json", vocab_size=64, eos_ids=[0])
    (err,) = bank.masks([("seq", deep, [])])
    assert isinstance(err, InvalidInput) and "levels deep" in err.message


def test_the_big_stack_holds_past_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,600 `$ref` hops crash llguidance on an 8 MiB stack; the compile thread's holds 3,000."""
    monkeypatch.setattr(grammar, "MAX_SCHEMA_DEPTH", 10**6)
    monkeypatch.setattr(grammar, "MAX_SCHEMA_NODES", 10**6)
    monkeypatch.setattr(grammar, "MAX_LARK_RULES", 10**6)
    assert compile_grammar(Structured("json_schema", json.dumps(ref_chain(3000))))
    assert compile_grammar(Structured("grammar", lark_chain(6000)))


def _chain(n: int, ref: Any, node: Any) -> dict[str, Any]:
    """n definitions, each an object whose property refers to the next by `ref(i + 1)`."""
    defs = {
        f"d{i}": {**node(i), "type": "object", "properties": {"next": {"$ref": ref(i + 1)}}} for i in range(n)
    }
    defs[f"d{n}"] = {**node(n), "type": "string"}
    return {"$defs": defs, "$ref": ref(0)}


FORMS = {  # each way a `$ref` can name its target
    "percent-encoded": (lambda i: f"#/%24defs/d{i}", lambda i: {}),
    "anchor": (lambda i: f"#a{i}", lambda i: {"$anchor": f"a{i}"}),
    "id": (lambda i: f"https://x.test/d{i}", lambda i: {"$id": f"https://x.test/d{i}"}),
    "relative-id": (lambda i: f"d{i}.json", lambda i: {"$id": f"https://x.test/s/d{i}.json"}),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_reference_form_counts_toward_the_depth(form: str) -> None:
    with pytest.raises(InvalidInput, match="nests more than"):
        grammar.check_spec(Structured("json_schema", json.dumps(_chain(1000, *FORMS[form]))))
    depth, _ = schema_depth(_chain(10, *FORMS[form]))
    assert depth > 30  # ten hops, each followed (an object, its properties, the property, the hop)


def test_errors_are_short_and_carry_no_parser_dump() -> None:
    long_regex = "(" + "a" * 5000 + "|"
    with pytest.raises(InvalidInput) as e:
        compile_grammar(Structured("regex", long_regex))
    assert len(e.value.message) < grammar.MAX_ERROR_CHARS + 100
