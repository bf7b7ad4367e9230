"""Grammar limits and compilation, torch-free: shared by the gateway (which compiles and validates a
request's structured output in a worker process, fastdecode/gateway/grammar.py) and gpu_dense (which
builds a matcher per grammar, fastdecode/dense/structured.py).

Why limits before llguidance sees a spec: llguidance compiles schemas and grammars recursively, and
a deep enough input (1,000 chained `$ref`s with properties, 3,000 chained Lark rules; both far
under MAX_SPEC_CHARS) overflows an 8 MiB stack, which kills the whole process with SIGSEGV. The
checks below are iterative and answer a 400 naming the limit; the compilation then runs on a
thread with a large stack (`on_big_stack`), so what passes the limits has a wide margin, and on the
gateway inside a worker process besides, where anything that still goes wrong costs that request.

Run as `python -m fastdecode.runtime.grammar`, this module is that worker: one JSON request a line
on stdin ({"kind", "spec"}), one JSON answer a line on stdout ({"grammar"} or {"error"}).
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastdecode.runtime.errors import FailedPrecondition, InvalidInput

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024
# Nesting of a JSON schema: object and list levels plus `$ref` hops, along the deepest path. Real
# schemas stay under 40; a 1,000-long `$ref` chain with properties is 3,000 and crashed at 8 MiB.
MAX_SCHEMA_DEPTH = 200
MAX_SCHEMA_NODES = 20_000  # objects and lists in one schema
MAX_LARK_RULES = 1000  # rule and terminal definitions; 3,000 chained rules crashed at 8 MiB
MAX_NESTING = 200  # parentheses and brackets in a regex or a Lark grammar
# The compiling thread's stack: 1,600 `$ref` hops fit in 8 MiB, so this holds 30x the limits
BIG_STACK_BYTES = 256 << 20
# llguidance's own bounds on what a grammar may make it build (its defaults, stated here)
MAX_GRAMMAR_SIZE = 500_000
INITIAL_LEXER_FUEL = 1_000_000


@dataclass(frozen=True)
class Structured:
    """What the output must match: kind is one of KINDS; spec the schema (JSON text), regex, the
    choices (a JSON list of strings) or a Lark grammar; empty for json_object."""

    kind: str
    spec: str = ""


def load_llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pinned in pyproject.toml; a stripped install may lack it
        raise FailedPrecondition("structured outputs need the llguidance package") from e
    return llguidance


def parser_limits() -> Any:
    return load_llguidance().LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SIZE, initial_lexer_fuel=INITIAL_LEXER_FUEL
    )


# ---- limits ----------------------------------------------------------------------------------------
def _pointer(root: Any, ref: str) -> Any:
    """The target of a local `$ref` ("#/a/b"), or None."""
    if ref != "#" and not ref.startswith("#/"):
        return None  # an anchor or a remote schema: llguidance resolves neither through a chain here
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any) -> tuple[int, int]:
    """(depth, nodes) of a parsed JSON schema: the deepest path of nested objects and lists, a local
    `$ref` counting as one more level into its target (a cycle counts once), and how many objects and
    lists it has. Iterative: an input deep enough to matter must not recurse here either."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    keep: list[Any] = []  # the targets seen, alive while ids are compared

    def children(node: Any) -> list[Any]:
        out = list(node.values()) if isinstance(node, dict) else list(node)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = _pointer(schema, node["$ref"])
            if isinstance(target, dict | list):
                keep.append(target)
                out.append(target)
        return [c for c in out if isinstance(c, dict | list)]

    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            depth[key] = 1 + max((depth.get(id(c), 0) for c in children(node)), default=0)
            if depth[key] > MAX_SCHEMA_DEPTH:
                break
            continue
        if key in depth or key in on_path:
            continue
        if len(depth) + len(on_path) >= MAX_SCHEMA_NODES:
            return MAX_SCHEMA_NODES, MAX_SCHEMA_NODES
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in depth and id(c) not in on_path)
        if len(on_path) > MAX_SCHEMA_DEPTH:  # the path itself is already too deep
            return len(on_path), len(depth) + len(on_path)
    return max(depth.values(), default=0) if isinstance(schema, dict | list) else 0, len(depth)


def check_schema(schema: Any, what: str = "the JSON schema") -> None:
    d, nodes = schema_depth(schema)
    if nodes >= MAX_SCHEMA_NODES:
        raise InvalidInput(f"{what} has {MAX_SCHEMA_NODES} or more objects and lists; that is the limit")
    if d > MAX_SCHEMA_DEPTH:
        raise InvalidInput(
            f"{what} nests more than {MAX_SCHEMA_DEPTH} levels deep (objects, lists and $ref hops); "
            f"the limit is {MAX_SCHEMA_DEPTH}"
        )


def _nesting(text: str) -> int:
    deepest = level = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in "([{":
            level += 1
            deepest = max(deepest, level)
        elif ch in ")]}":
            level = max(level - 1, 0)
    return deepest


def _check_nesting(text: str, what: str) -> None:
    if (n := _nesting(text)) > MAX_NESTING:
        raise InvalidInput(f"{what} nests {n} parentheses or brackets deep; the limit is {MAX_NESTING}")


_LARK_DEFINITION = re.compile(
    r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?\d+)?[ \t]*(\{[^}\n]*\})?[ \t]*:", re.M
)


def check_lark(text: str, what: str = "the grammar") -> None:
    rules = len(_LARK_DEFINITION.findall(text))
    if rules > MAX_LARK_RULES:
        raise InvalidInput(f"{what} defines {rules} rules and terminals; the limit is {MAX_LARK_RULES}")
    # llguidance's Lark embeds JSON schemas (`%json {...}`): they get the schema limits
    decoder = json.JSONDecoder()
    for m in re.finditer(r"%json\s*", text):
        try:
            schema, end = decoder.raw_decode(text, m.end())
        except (ValueError, RecursionError):
            continue  # llguidance reports the syntax error
        check_schema(schema, f"a %json schema in {what}")
        text = text[: m.start()] + " " * (end - m.start()) + text[end:]  # its braces are not Lark's
    _check_nesting(text, what)


def check_spec(s: Structured) -> None:
    """The limits on a request's structured output, before anything compiles it (InvalidInput)."""
    if s.kind not in KINDS:
        raise InvalidInput(f"unknown structured output kind {s.kind!r}; one of {', '.join(KINDS)}")
    if len(s.spec) > MAX_SPEC_CHARS:
        raise InvalidInput(f"the {s.kind} has {len(s.spec)} characters; the limit is {MAX_SPEC_CHARS}")
    if s.kind == "json_schema":
        check_schema(_json(s))
    elif s.kind == "regex":
        _check_nesting(s.spec, "the regex")
    elif s.kind == "grammar":
        check_lark(s.spec)


def check_grammar(grammar: str) -> None:
    """The same limits on a compiled grammar (what gpu_dense receives): llguidance's JSON form with
    its embedded schemas and Lark texts, or a Lark text."""
    if len(grammar) > 2 * MAX_SPEC_CHARS:  # a compiled grammar quotes its spec once more
        raise InvalidInput(f"the grammar has {len(grammar)} characters; the limit is {2 * MAX_SPEC_CHARS}")
    if not grammar.lstrip().startswith("{"):
        check_lark(grammar)
        return
    try:
        top = json.loads(grammar)
    except (ValueError, RecursionError):
        raise InvalidInput("the grammar is not valid JSON, nor nested too deeply to read") from None
    for g in top.get("grammars", []) if isinstance(top, dict) else []:
        if not isinstance(g, dict):
            continue
        if g.get("json_schema") is not None:
            check_schema(g["json_schema"])
        if isinstance(g.get("lark_grammar"), str):
            check_lark(g["lark_grammar"])


def _json(s: Structured) -> Any:
    try:
        return json.loads(s.spec)
    except RecursionError:
        raise InvalidInput(f"the {s.kind} nests too deeply to read") from None
    except ValueError as e:
        raise InvalidInput(f"the {s.kind} is not valid: {e}") from None


# ---- compiling -------------------------------------------------------------------------------------
T = TypeVar("T")
_stack_lock = threading.Lock()


def on_big_stack(fn: Callable[[], T]) -> T:
    """fn() on a fresh thread with a BIG_STACK_BYTES stack (llguidance recurses on the caller's
    stack; the main thread's is 8 MiB). The memory is reserved, not touched, until used."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:  # handed to the caller's thread
            result.append((False, e))

    with _stack_lock:  # stack_size applies to the threads started after it, process-wide
        previous = threading.stack_size(BIG_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="grammar-compile", daemon=True)
            t.start()
        finally:
            threading.stack_size(previous)
    t.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def compile_grammar(s: Structured) -> str:
    """The llguidance grammar of `s` within the limits; InvalidInput (a 400) when it does not
    compile. Runs llguidance in this process (on a big stack): the gateway calls it in a worker."""
    check_spec(s)
    lg = load_llguidance()

    def build() -> str:
        try:
            if s.kind == "json_object":
                grammar = lg.LLMatcher.grammar_from_json_schema({"type": "object"})
            elif s.kind == "json_schema":
                schema = _json(s)
                if not isinstance(schema, dict | bool):
                    raise InvalidInput("the JSON schema must be an object")
                grammar = lg.LLMatcher.grammar_from_json_schema(schema)
            elif s.kind == "regex":
                grammar = lg.LLMatcher.grammar_from_regex(s.spec)
            elif s.kind == "choice":
                choices = _json(s)
                if (
                    not isinstance(choices, list)
                    or not choices
                    or not all(isinstance(c, str) and c for c in choices)
                ):
                    raise InvalidInput("choice needs a non-empty list of non-empty strings")
                # Lark string literals take JSON's escapes
                grammar = lg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in choices)
                )
            else:
                grammar = lg.LLMatcher.grammar_from_lark(s.spec)
        except (ValueError, TypeError) as e:
            raise InvalidInput(f"the {s.kind} is not valid: {e}") from None
        error = lg.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
        if error:
            raise InvalidInput(f"the {s.kind} cannot be compiled: {error.strip()}")
        return str(grammar)

    return on_big_stack(build)


def _worker(memory_bytes: int) -> None:
    """The gateway's compile worker: a request a line in, an answer a line out, until stdin closes."""
    if memory_bytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    load_llguidance()  # loaded before the first request, so that one is not slower
    out = sys.stdout
    for line in sys.stdin:
        try:
            req = json.loads(line)
            answer = {"grammar": compile_grammar(Structured(str(req["kind"]), str(req["spec"])))}
        except InvalidInput as e:
            answer = {"error": e.message}
        except MemoryError:
            answer = {"error": "compiling it needs more memory than the limit"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    _worker(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
