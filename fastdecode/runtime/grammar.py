"""Grammar limits and compilation, torch-free: shared by the gateway (which compiles and validates a
request's structured output in a worker process, fastdecode/gateway/grammar.py) and gpu_dense (which
builds a matcher per grammar, fastdecode/dense/grammar.py).

Why limits before llguidance sees a spec: llguidance compiles schemas and grammars recursively, and
a deep enough input (1,000 chained `$ref`s with properties, 3,000 chained Lark rules; both far
under MAX_SPEC_CHARS) overflows an 8 MiB stack, which kills the whole process with SIGSEGV. The
checks below are iterative and answer a 400 naming the limit; the compilation then runs on a
thread with a large stack (`on_big_stack`), so what passes the limits has a wide margin, and on the
gateway inside a worker process besides, where anything that still goes wrong costs that request.

Building a matcher (the grammar with the model's tokenizer: llguidance builds the lexer then) is
where some small specs cost without bound: `{"type": "integer", "multipleOf": N}` is 44 bytes and
takes time growing with N (0.6 s at 123,456, 11 s at 1,234,567 for SmolLM2's tokenizer), and no
llguidance limit stops it. So the gateway's worker builds the matcher and its first mask too, under
`build_limit_s` (what gpu_dense, which builds it again, waits for it at most: `GrammarBank`).

Run as `python -m fastdecode.runtime.grammar`, this module is that worker: one JSON request a line
on stdin ({"kind", "spec", "build_limit_s"}), one JSON answer a line on stdout ({"grammar",
"build_s"} or {"error"}, with "retire" when a build still runs and the worker must be replaced).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
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
# A mask step's work per sequence: ~14 ms of lexer fuel and ~2.5 ms of Earley items at most (their
# documented speeds), so one request's grammar cannot hold a step much longer than that
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_ERROR_CHARS = 600  # llguidance's messages can quote the whole input; a 400 names the start


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
        max_grammar_size=MAX_GRAMMAR_SIZE,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS,
        verbose_errors=False,  # its verbose form dumps parser state and the grammar into the 400
    )


def short(message: str) -> str:
    """An llguidance message cut to what a 400 should carry."""
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " [...]"


def load_tokenizer(path: str, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of the model's tokenizer.json (the gateway's worker and gpu_dense alike)."""
    return load_llguidance().LLTokenizer(path, n_vocab=vocab_size, eos_token=list(eos_ids))


def build_matcher(tokenizer: Any, grammar: str) -> Any:
    """A matcher of `grammar` for `tokenizer` with its first mask computed (the lexer is built
    lazily; the first mask is where the rest of the cost lies); InvalidInput when it does not
    compile. Recursive in llguidance: call it on a big stack."""
    m = load_llguidance().LLMatcher(tokenizer, grammar, limits=parser_limits())
    if m.is_error():
        raise InvalidInput(f"the grammar does not compile: {short(m.get_error())}")
    m.compute_bitmask()
    return m


# ---- limits ----------------------------------------------------------------------------------------
def _walk(node: Any, pointer: str) -> Any:
    """The target of a JSON pointer ("/a/b", percent-encoded or not) inside `node`, or None."""
    for part in pointer.split("/")[1:] if pointer else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Refs:
    """Resolves a schema's `$ref`s in every form llguidance follows: "#/..." pointers (percent-
    encoded too), "#name" `$anchor`s, and "base#..." through a `$id` (matched by its full text or
    its last path segment), so no chain of hops escapes the depth count."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.anchors: dict[str, Any] = {}
        self.ids: dict[str, Any] = {}
        stack, seen = [root], 0
        while stack and seen < MAX_SCHEMA_NODES:
            node = stack.pop()
            seen += 1
            if isinstance(node, dict):
                for key, index in (("$anchor", self.anchors), ("$dynamicAnchor", self.anchors)):
                    if isinstance(node.get(key), str):
                        index.setdefault(node[key], node)
                if isinstance(node.get("$id"), str):
                    sid = node["$id"]
                    base = sid.partition("#")[0]
                    for k in {sid, base, base.rstrip("/").rsplit("/", 1)[-1]}:
                        self.ids.setdefault(k, node)
                    if sid.startswith("#"):  # draft-06 style anchor
                        self.anchors.setdefault(sid[1:], node)
                stack.extend(v for v in node.values() if isinstance(v, dict | list))
            elif isinstance(node, list):
                stack.extend(v for v in node if isinstance(v, dict | list))

    def target(self, ref: str) -> Any:
        base, _, frag = ref.partition("#")
        node = self.root
        if base:
            node = self.ids.get(base, self.ids.get(base.rstrip("/").rsplit("/", 1)[-1]))
            if node is None:
                return None  # a remote schema: llguidance does not fetch it
        frag = urllib.parse.unquote(frag)
        if frag and not frag.startswith("/"):
            return self.anchors.get(frag)
        return _walk(node, frag)


def schema_depth(schema: Any) -> tuple[int, int]:
    """(depth, nodes) of a parsed JSON schema: the deepest path of nested objects and lists, a local
    `$ref` counting as one more level into its target (a cycle counts once), and how many objects and
    lists it has. Every reference form counts (`_Refs`). Iterative: an input deep enough to matter
    must not recurse here either."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    keep: list[Any] = []  # the targets seen, alive while ids are compared
    refs = _Refs(schema)

    def children(node: Any) -> list[Any]:
        out = list(node.values()) if isinstance(node, dict) else list(node)
        for key in ("$ref", "$dynamicRef", "$recursiveRef"):
            if not (isinstance(node, dict) and isinstance(node.get(key), str)):
                continue
            target = refs.target(node[key])
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


def big_stack_future(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """fn() on a fresh daemon thread with a BIG_STACK_BYTES stack (llguidance recurses on the
    caller's stack; the main thread's is 8 MiB); the memory is reserved, not touched, until used.
    A future: the caller may stop waiting (a Rust call cannot be interrupted; its thread runs on)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the caller's thread
            future.set_exception(e)

    with _stack_lock:  # stack_size applies to the threads started after it, process-wide
        previous = threading.stack_size(BIG_STACK_BYTES)
        try:
            threading.Thread(target=run, name="grammar-build", daemon=True).start()
        finally:
            threading.stack_size(previous)
    return future


def on_big_stack(fn: Callable[[], T]) -> T:
    """fn() on a big stack (`big_stack_future`), waited for."""
    return big_stack_future(fn).result()


def _grammar(s: Structured) -> str:
    """The llguidance grammar of `s`, validated without a tokenizer (on a big stack)."""
    check_spec(s)
    lg = load_llguidance()
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
            grammar = lg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        else:
            grammar = lg.LLMatcher.grammar_from_lark(s.spec)
    except (ValueError, TypeError) as e:
        raise InvalidInput(f"the {s.kind} is not valid: {short(str(e))}") from None
    error = lg.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise InvalidInput(f"the {s.kind} cannot be compiled: {short(error)}")
    return str(grammar)


def compile_grammar(s: Structured) -> str:
    """The llguidance grammar of `s` within the limits; InvalidInput (a 400) when it does not
    compile. Runs llguidance in this process (on a big stack): the gateway calls it in a worker."""
    return on_big_stack(lambda: _grammar(s))


class BuildTooSlow(InvalidInput):
    """A grammar past its build limit (a 400); the thread building it still runs."""


def compile_and_build(s: Structured, tokenizer: Any, build_limit_s: float) -> tuple[str, float]:
    """(grammar, seconds) of `s` compiled and, with a tokenizer, its matcher built with its first
    mask, all within `build_limit_s` (0: no limit). Past it, BuildTooSlow: the build's thread
    runs on, so the caller (a worker process) must be replaced."""

    def work() -> tuple[str, float]:
        t0 = time.perf_counter()
        grammar = _grammar(s)
        if tokenizer is not None:
            build_matcher(tokenizer, grammar)
        return grammar, time.perf_counter() - t0

    try:
        return big_stack_future(work).result(build_limit_s or None)
    except concurrent.futures.TimeoutError:
        raise BuildTooSlow(
            f"the {s.kind} takes longer than {build_limit_s:g} s to compile and build its matcher "
            "for this model's tokenizer; simplify it (a large multipleOf, many patterns or "
            "alternatives cost the most)"
        ) from None


def _worker(memory_bytes: int, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
    """The gateway's compile worker: a request a line in, an answer a line out, until stdin closes."""
    if memory_bytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    load_llguidance()  # loaded before the first request, so that one is not slower
    tokenizer = load_tokenizer(tokenizer_json, vocab_size, eos_ids) if tokenizer_json else None
    out = sys.stdout
    for line in sys.stdin:
        retire = False
        try:
            req = json.loads(line)
            s = Structured(str(req["kind"]), str(req["spec"]))
            grammar, took = compile_and_build(s, tokenizer, float(req.get("build_limit_s") or 0))
            answer: dict[str, Any] = {"grammar": grammar, "build_s": took}
        except BuildTooSlow as e:
            answer, retire = {"error": e.message, "retire": True}, True
        except InvalidInput as e:
            answer = {"error": e.message}
        except MemoryError:
            answer = {"error": "compiling it needs more memory than the limit"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
        if retire:  # a build still runs on its thread: this process goes, with it
            os._exit(0)


if __name__ == "__main__":
    _args = sys.argv[1:] + ["0", "", "0", "[]"][len(sys.argv) - 1 :]
    _worker(int(_args[0]), _args[1], int(_args[2]), [int(i) for i in json.loads(_args[3])])
