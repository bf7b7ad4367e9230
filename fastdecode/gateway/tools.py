"""Tool calling as vLLM serves it: the request's `tools` and `tool_choice` checked, the tools rendered
into the prompt (by the chat template, or the fallback prompt below where it has no tool support),
`required` and named choices enforced as a JSON schema through the grammar engine, and the model's
text split into content and OpenAI `tool_calls`, whole or as streamed deltas. Imports no gRPC.

Formats (`--tool-call-parser`, or chosen from the template's own markers and the model family):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3, Hermes, and the
  fallback prompt);
- llama3_json: the answer is `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or not),
  several separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
`required` and named choices do not go through a parser: as vLLM does, `required` constrains the
output to a JSON array `[{"name": ..., "parameters": {...}}, ...]` whose items are the tools' schemas,
and a named choice to that function's arguments object itself.

One scanner serves the stream and the whole answer: the non-streamed message is what the stream's
deltas add up to, so the two give the same calls by construction. `arguments` is the model's own JSON
text of the arguments object (not re-serialized), so each fragment streamed is a slice of it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdecode.runtime.errors import InvalidInput, ServiceError, Status
from fastdecode.runtime.grammar import Structured, check_spec

PARSERS = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # calls in one assistant message of the conversation
# Nesting of a call's arguments (objects and lists), as a schema's (runtime.grammar.MAX_SCHEMA_DEPTH):
# json.loads of 5,000 levels raised RecursionError (a 500), and the template re-serializes them.
MAX_ARGUMENTS_DEPTH = 200
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # fullmatch: `$` would let a trailing newline through

# The fallback prompt: where the chat template does not render `tools`, the tools and this hermes-style
# instruction lead the system message (docs/openai-parameters.md shows it).
FALLBACK_PROMPT = (
    "You may call one or more functions to answer. The functions, with the JSON schema of their "
    "arguments, are:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


class ToolError(ServiceError):
    """A 400 naming the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, Status.INVALID_ARGUMENT, param=param)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn | {"parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools. choice: none | auto | required | named."""

    tools: tuple[Tool, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    def structured(self) -> Structured | None:
        """The schema that enforces `required` or a named choice (None for auto and none). Compact
        JSON: with llguidance's default (any whitespace) a small model drifts into newlines and
        indentation that spend the token budget."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return Structured("json_schema", json.dumps(_compact(tool.parameters)))
        if self.choice != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return Structured("json_schema", json.dumps(_compact(schema)))


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """llguidance's JSON options: no free whitespace, Python's separators."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {**schema, "x-guidance": options}


def tool_request(
    tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolRequest | None:
    """The request's tools and choice, checked (a ToolError names the field); None when no tool is
    in play (no tools, or tool_choice "none": the model then answers in text, as OpenAI's does)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"{len(tools)} tools; the limit is {MAX_TOOLS}", "tools")
    parsed: list[Tool] = []
    for i, t in enumerate(tools):
        parsed.append(_tool(t, f"tools[{i}]"))
        if parsed[-1].name in (p.name for p in parsed[:-1]):
            raise ToolError(f"tools[{i}]: the function name {parsed[-1].name!r} is used twice", f"tools[{i}]")
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError(
                f"tool_choice {choice!r}: one of none, auto, required or a named function", "tool_choice"
            )
        return None if choice == "none" else ToolRequest(tuple(parsed), choice, None, parallel)
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not (isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(name, str)):
        raise ToolError(
            'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if name not in (t.name for t in parsed):
        raise ToolError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return ToolRequest(tuple(parsed), "named", name, parallel)


def _tool(t: Any, where: str) -> Tool:
    if not isinstance(t, Mapping) or t.get("type", "function") != "function":
        raise ToolError(f'{where}: a tool is {{"type": "function", "function": {{...}}}}', f"{where}.type")
    fn = t.get("function")
    if not isinstance(fn, Mapping):
        raise ToolError(f"{where}.function: an object with the function's name", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(
            f"{where}.function.name: 1-64 letters, digits, _ . or -, got {name!r}", f"{where}.function.name"
        )
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ToolError(
            f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters"
        )
    try:  # the limits, in process; llguidance compiles it in a worker (check_tool_schemas)
        check_spec(Structured("json_schema", json.dumps(params)))
    except InvalidInput as e:
        raise ToolError(f"{where}.function.parameters: {e.message}", f"{where}.function.parameters") from None
    return Tool(name, description, params)


_COMPILED: OrderedDict[str, None] = OrderedDict()  # schemas llguidance took lately (agents resend theirs)


async def check_tool_schemas(req: ToolRequest, compile_: Callable[[Structured], Awaitable[str]]) -> None:
    """Each tool's parameters compiled by `compile_` (the gateway's grammar workers: llguidance never
    runs on the event loop); one that does not compile is a 400 naming it."""
    for i, t in enumerate(req.tools):
        spec = json.dumps(t.parameters, sort_keys=True)
        if spec in _COMPILED:
            _COMPILED.move_to_end(spec)
            continue
        try:
            await compile_(Structured("json_schema", spec))
        except InvalidInput as e:
            where = f"tools[{i}].function.parameters"
            raise ToolError(f"{where}: {e.message}", where) from None
        _COMPILED[spec] = None
        while len(_COMPILED) > 256:
            _COMPILED.popitem(last=False)


# ---- prompts -----------------------------------------------------------------------------------
def template_renders_tools(source: str) -> bool:
    """Whether a chat template renders the `tools` variable itself."""
    return re.search(r"\btools\b", source) is not None


def choose_parser(setting: str, template_source: str, model_type: str) -> str:
    """The parser for `--tool-call-parser` (auto: from the template's markers, then the family)."""
    if setting != "auto":
        if setting not in PARSERS:
            raise InvalidInput(f"tool_call_parser {setting!r}: one of auto, {', '.join(PARSERS)}")
        return setting
    if not template_renders_tools(template_source):
        return "hermes"  # the fallback prompt asks for hermes' format
    if "[TOOL_CALLS]" in template_source or model_type == "mistral":
        return "mistral"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3_json"
    return "hermes"


def check_tool_calls(calls: Any, where: str) -> None:
    """A conversation message's `tool_calls`: a list of at most MAX_TOOL_CALLS, each call's arguments
    (an object, or its JSON text) nested at most MAX_ARGUMENTS_DEPTH deep; a ToolError names the field."""
    if not isinstance(calls, list):
        raise ToolError(f"{where} must be a list of tool calls", where)
    if len(calls) > MAX_TOOL_CALLS:
        raise ToolError(f"{where} has {len(calls)} calls; the limit is {MAX_TOOL_CALLS}", where)
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, Mapping) else None
        arguments = fn.get("arguments") if isinstance(fn, Mapping) else None
        deep = False
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except RecursionError:
                deep = True
            except ValueError:
                continue  # not JSON: the template gets the text as it is
        if deep or _depth(arguments) > MAX_ARGUMENTS_DEPTH:
            field = f"{where}[{j}].function.arguments"
            raise ToolError(
                f"{field} nests more than {MAX_ARGUMENTS_DEPTH} objects and lists deep; that is the limit",
                field,
            )


def _depth(value: Any) -> int:
    """How deep objects and lists nest in `value` (iterative; it stops past MAX_ARGUMENTS_DEPTH)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_ARGUMENTS_DEPTH:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _arguments_object(arguments: Any) -> Any:
    """Templates take a call's arguments as an object (OpenAI clients send a JSON string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # check_tool_calls refused what nests too deeply
            return arguments
    return arguments


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as tool-aware templates read them: each call's arguments as an object."""
    out = []
    for m in messages:
        d = dict(m)
        if isinstance(d.get("tool_calls"), list):
            calls = []
            for c in d["tool_calls"]:
                c = dict(c) if isinstance(c, Mapping) else c
                if isinstance(c, dict) and isinstance(c.get("function"), Mapping):
                    fn = dict(c["function"])
                    fn["arguments"] = _arguments_object(fn.get("arguments"))
                    c["function"] = fn
                calls.append(c)
            d["tool_calls"] = calls
        out.append(d)
    return out


def fallback_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """For a template without tool support: the tools and FALLBACK_PROMPT lead the system message,
    an assistant's calls become hermes blocks in its content, a tool's answer a user turn in
    <tool_response> tags (the roles every template knows)."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    instruction = FALLBACK_PROMPT.format(tools=listed) if tools else ""
    out: list[dict[str, Any]] = []
    for m in messages:
        d = dict(m)
        role = d.get("role")
        if role == "assistant" and d.get("tool_calls"):
            blocks = []
            for c in d.pop("tool_calls"):
                fn = c.get("function", {}) if isinstance(c, Mapping) else {}
                call = {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))}
                blocks.append(f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>")
            d["content"] = "\n".join(([d["content"]] if d.get("content") else []) + blocks)
        elif role == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{d.get('content') or ''}\n</tool_response>"}
        out.append(d)
    if instruction:
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{instruction}".strip()}
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out


# ---- parsing the model's text into calls -------------------------------------------------------
_WS = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_IN_STRING = re.compile(r'["\\]')  # what matters inside a JSON string
_IN_VALUE = re.compile(r'["{}\[\]]')  # and outside one


# Where an incomplete string or container scan stopped: (depth, resume at), by the value's start. The
# stream's text only grows, so a later scan of the same value resumes there instead of from its start
# (the arguments of a call writing a file would otherwise be scanned again on every delta).
Memo = dict[int, tuple[int, int]]


def _string_end(text: str, i: int, memo: Memo) -> int | None:
    """The end of the JSON string whose opening quote is text[i], or None while it is incomplete.
    The regex jumps over plain characters."""
    j = memo.get(i, (0, i + 1))[1]
    while (m := _IN_STRING.search(text, j)) is not None:
        if m.group() == '"':
            memo.pop(i, None)
            return m.end()
        j = m.end() + 1  # a backslash escapes the next character
    memo[i] = (0, max(j, len(text)))  # past the end: a trailing backslash escapes what comes next
    return None


def _value_end(text: str, i: int, memo: Memo) -> int | None:
    """The end of the JSON value starting at text[i] (exclusive), or None while it is incomplete."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i, memo)
    if text[i] in "{[":
        depth, j = memo.get(i, (0, i))
        while (m := _IN_VALUE.search(text, j)) is not None:
            ch = m.group()
            if ch == '"':
                end = _string_end(text, m.start(), memo)
                if end is None:
                    memo[i] = (depth, m.start())  # the string resumes from its own memo
                    return None
                j = end
                continue
            depth += 1 if ch in "{[" else -1
            if depth == 0:
                memo.pop(i, None)
                return m.end()
            j = m.end()
        memo[i] = (depth, len(text))
        return None
    j = i  # a literal: number, true, false, null
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


@dataclass
class _Scanned:
    """One call object as far as the text goes."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None: the arguments go on
    end: int | None = None  # the object's end (exclusive); None while incomplete


def _scan_call(text: str, i: int, arg_keys: tuple[str, ...], memo: Memo) -> _Scanned | None:
    """The call object `{"name": ..., "<arguments>": {...}}` at text[i]; None if it is not one."""
    i = _skip_ws(text, i)
    if i >= len(text):
        return _Scanned()
    if text[i] != "{":
        return None
    out = _Scanned()
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return out
        if text[i] == "}":
            out.end = i + 1
            return out
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None
        key_end = _value_end(text, i, memo)
        if key_end is None:
            return out
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return out
        if text[i] != ":":
            return None
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return out
        end = _value_end(text, i, memo)
        if key in arg_keys:
            out.args_start, out.args_end = i, end
        if end is None:
            return out
        if key == "name":
            try:
                name = json.loads(text[i:end])
            except ValueError:
                return None
            out.name = name if isinstance(name, str) else None
        i = end


def _scan_calls(
    text: str, i: int, arg_keys: tuple[str, ...], sep: str, memo: Memo
) -> tuple[list[_Scanned], int]:
    """Call objects one after another from text[i], each followed by `sep` (or whitespace);
    returns them and where the scan stopped."""
    calls: list[_Scanned] = []
    while True:
        start = _skip_ws(text, i)
        if start >= len(text) or text[start] != "{":
            return calls, start
        c = _scan_call(text, start, arg_keys, memo)
        if c is None:
            return calls, start
        calls.append(c)
        if c.end is None:
            return calls, len(text)
        i = _skip_ws(text, c.end)
        if sep and text.startswith(sep, i):
            i += len(sep)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _parse(mode: str, text: str, final: bool, memo: Memo) -> tuple[int, list[_Scanned], bool]:
    """(how much of text is content for sure, the calls found, whether calls started): the content
    is text[:n]; a call that has not started yet holds back what could still begin one."""
    if mode == "named":
        c = _Scanned(name="", args_start=_skip_ws(text, 0))
        c.args_end = _value_end(text, c.args_start, memo) if c.args_start < len(text) else None
        if final and c.args_end is None:  # cut short (length): all of it
            c.args_end = len(text)
        return 0, [c], True
    if mode == "required":
        i = _skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return (len(text), [], False) if final else (0, [], True)
        calls, _ = _scan_calls(text, i + 1, ("parameters", "arguments"), ",", memo)
        if final and not any(c.name for c in calls):  # cut short before a call: the text as content
            return len(text), [], False
        return 0, calls, True
    if mode == "llama3_json":
        i = _skip_ws(text, 0)
        tag = "<|python_tag|>"
        if text.startswith(tag, i):
            i = _skip_ws(text, i + len(tag))
        elif not final and tag.startswith(text[i:]):
            return 0, [], False  # still undecided (nothing but whitespace or part of the tag)
        elif i < len(text) and text[i] != "{":
            return len(text), [], False  # an answer in text: it streams as it comes
        calls, _ = _scan_calls(text, i, ("parameters", "arguments"), ";", memo)
        if final and not any(c.name for c in calls):  # not a call after all: the text is content
            return len(text), [], False
        return 0, calls, bool(calls)
    marker = "[TOOL_CALLS]" if mode == "mistral" else "<tool_call>"
    at = text.find(marker)
    if at < 0:
        return len(text) - (0 if final else _held(text, marker)), [], False
    calls: list[_Scanned] = []
    if mode == "mistral":
        i = _skip_ws(text, at + len(marker))
        if i < len(text) and text[i] == "[":
            calls, _ = _scan_calls(text, i + 1, ("arguments", "parameters"), ",", memo)
        elif i < len(text):
            calls, _ = _scan_calls(text, i, ("arguments", "parameters"), ",", memo)
    else:
        i = at
        while text.startswith(marker, i):
            found, i = _scan_calls(text, i + len(marker), ("arguments", "parameters"), "", memo)
            calls += found[:1]
            if not found or found[0].end is None:
                break
            i = _skip_ws(text, i)
            if text.startswith("</tool_call>", i):
                i = _skip_ws(text, i + len("</tool_call>"))
    if final and not any(c.name for c in calls):  # not a call after all: the text is content
        return len(text), [], False
    return at, calls, True


@dataclass
class ToolCallStream:
    """One choice's text as content and tool calls. `feed` takes each text delta and returns
    (content delta, OpenAI tool-call deltas); `finish` closes it. `message` is the whole answer."""

    mode: str  # a parser's name, "required" or "named"
    named: str | None = None
    parallel: bool = True
    text: str = ""
    content_sent: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)  # id, name, arguments (as sent)
    content: str = ""
    _memo: Memo = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, req: ToolRequest, parser: str) -> ToolCallStream:
        mode = req.choice if req.choice in ("named", "required") else parser
        return cls(mode, req.named, req.parallel)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        n, scanned, _ = _parse(self.mode, self.text, final, self._memo)
        out_text = self.text[self.content_sent : n] if n > self.content_sent else ""
        if out_text:
            self.content_sent = n
            self.content += out_text
        deltas: list[dict[str, Any]] = []
        if not self.parallel:
            scanned = scanned[:1]
        for idx, c in enumerate(scanned):
            name = self.named if self.mode == "named" else c.name
            if idx >= len(self.calls):
                if not name:
                    break  # its name first, as OpenAI's deltas go
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": ""}
                self.calls.append(call)
                deltas.append(
                    {
                        "index": idx,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                )
            if c.args_start is None:
                continue
            end = c.args_end if c.args_end is not None else len(self.text)
            args = self.text[c.args_start : end]
            if self.mode == "named" and c.args_end is None and not final:
                args = args.rstrip(_WS)  # trailing whitespace may be the end of the object's text
            sent = self.calls[idx]["arguments"]
            if len(args) > len(sent) and args.startswith(sent):
                self.calls[idx]["arguments"] = args
                deltas.append({"index": idx, "function": {"arguments": args[len(sent) :]}})
        return out_text, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self.feed("", final=True)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        """The non-streamed message (after finish)."""
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not self.calls else None,
        }
        if self.calls:
            msg["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in self.calls
            ]
        return msg
