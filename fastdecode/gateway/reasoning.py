"""Reasoning parsers: a chat answer's text split into `reasoning_content` (the model's thinking, between
`<think>` and `</think>`) and `content`, whole or as streamed deltas, as vLLM's `--reasoning-parser`
does. Pure text: imports no web framework; fastdecode.gateway.responses and .anthropic use it.

- `qwen3`: reasoning only when the answer starts with `<think>` (with `enable_thinking: false` Qwen3's
  template closes an empty think block in the prompt, and the answer is all content).
- `deepseek_r1`: the template opens `<think>` in the prompt, so everything before `</think>` is
  reasoning (a leading `<think>`, which older checkpoints still emit, is dropped).

`auto` picks by the model family, except that a template whose generation prompt leaves `<think>`
open (Qwen3's Thinking-2507 models; the models then never write `<think>` themselves) gets
`deepseek_r1`, as vLLM advises for those models.

An answer cut off inside its thinking (max_tokens) is all reasoning, whole and streamed alike. The
whitespace the models write after `</think>` is not content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastdecode.gateway.chat import ChatTemplate
from fastdecode.runtime.errors import InvalidInput, ModelLoadError

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")
_DEEPSEEK_MARK = "<｜Assistant｜>"  # DeepSeek-R1's templates (and the R1 distills') name the turn so

# states of one answer
_OPENING, _THINKING, _AFTER, _CONTENT = range(4)


def choose_reasoning_parser(setting: str, model_type: str, template_source: str) -> str:
    """The parser for `--reasoning-parser` ("none": no split); auto picks by the model family."""
    if setting != "auto":
        if setting not in (*PARSERS, "none"):
            raise ValueError(f"reasoning_parser {setting!r}: one of auto, none, {', '.join(PARSERS)}")
        return setting
    if opens_thinking(template_source):
        return "deepseek_r1"
    if model_type.startswith("qwen3"):
        return "qwen3"
    if _DEEPSEEK_MARK in template_source and START in template_source:
        return "deepseek_r1"
    return "none"


def opens_thinking(template_source: str) -> bool:
    """Whether the template's generation prompt ends inside an open `<think>` block (rendered for
    one user message, no chat_template_kwargs): the model's answer then starts with its thinking."""
    if START not in template_source:
        return False
    try:
        prompt = ChatTemplate(template_source).render([{"role": "user", "content": "Hi."}])
    except (InvalidInput, ModelLoadError):  # a template that wants more (a system turn, tools...)
        return False
    return prompt.rstrip().endswith(START)


def thinking_disabled(template_kwargs: Mapping[str, Any] | None) -> bool:
    """The request turned thinking off through its chat_template_kwargs (Qwen3's enable_thinking,
    DeepSeek's thinking)."""
    kw = template_kwargs or {}
    return kw.get("enable_thinking") is False or kw.get("thinking") is False


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could begin `tag` (held back until it can tell)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One answer's split, fed its text in pieces (any split, tags included); `feed` and `finish`
    return (reasoning, content) deltas, whose concatenations equal `split` of the whole text."""

    def __init__(self, kind: str) -> None:
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser {kind!r}: one of {', '.join(PARSERS)}")
        self.kind = kind
        self.state = _OPENING
        self.buf = ""
        self.reasoned = False  # whether the answer had a reasoning part at all

    @classmethod
    def of(cls, kind: str, template_kwargs: Mapping[str, Any] | None = None) -> ReasoningStream | None:
        """The request's stream, or None: no parser, or the request turned thinking off."""
        if kind == "none" or thinking_disabled(template_kwargs):
            return None
        return cls(kind)

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            if self.state == _OPENING:
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf, self.state, self.reasoned = head[len(START) :], _THINKING, True
                elif START.startswith(head):  # whitespace, or part of the tag: not yet decided
                    break
                elif self.kind == "deepseek_r1":
                    self.state, self.reasoned = _THINKING, True
                else:
                    self.state = _CONTENT
            elif self.state == _THINKING:
                at = self.buf.find(END)
                if at >= 0:
                    reasoning.append(self.buf[:at])
                    self.buf, self.state = self.buf[at + len(END) :], _AFTER
                    continue
                keep = _partial_suffix(self.buf, END)
                reasoning.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            elif self.state == _AFTER:
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = _CONTENT
            else:
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The answer ended: what was held back, as what it turned out to be."""
        rest, self.buf = self.buf, ""
        if self.state == _OPENING:
            if self.kind == "deepseek_r1" and rest.strip():
                self.reasoned = True
                return rest, ""
            return "", rest
        if self.state == _THINKING:
            return rest, ""  # cut off while thinking (a partial "</think>" is thinking too)
        return "", "" if self.state == _AFTER else rest

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer: (reasoning, or None when it had none; content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2 if self.reasoned else None), c1 + c2
