"""The reasoning parsers (fastdecode.gateway.reasoning): a whole answer's split, and the same split
from streamed pieces cut anywhere, tags included."""

from __future__ import annotations

import itertools

import pytest

from fastdecode.gateway.reasoning import (
    ReasoningStream,
    choose_reasoning_parser,
    opens_thinking,
    thinking_disabled,
)

CASES = [
    # (parser, answer, reasoning (None: no reasoning part), content)
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("qwen3", "<think></think>Paris.", "", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "Paris <think>x</think> y", None, "Paris <think>x</think> y"),  # not at the start
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    ("qwen3", "<think>half a tag </thi", "half a tag </thi", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "", None, ""),
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "Let me see.</think>\n\nParis.", "Let me see.", "Paris."),
    ("deepseek_r1", "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "</think>Paris.", "", "Paris."),
    ("deepseek_r1", "", None, ""),
]


@pytest.mark.parametrize(("kind", "text", "reasoning", "content"), CASES)
def test_whole_answers(kind: str, text: str, reasoning: str | None, content: str) -> None:
    assert ReasoningStream(kind).split(text) == (reasoning, content)


def _streamed(kind: str, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(kind)
    r, c = [], []
    for p in pieces:
        dr, dc = stream.feed(p)
        r.append(dr)
        c.append(dc)
    dr, dc = stream.finish()
    return "".join(r) + dr, "".join(c) + dc


@pytest.mark.parametrize(("kind", "text", "reasoning", "content"), CASES)
def test_streamed_answers_split_anywhere_equal_the_whole(
    kind: str, text: str, reasoning: str | None, content: str
) -> None:
    want = (reasoning or "", content)
    assert _streamed(kind, list(text)) == want  # a character at a time: every tag split
    for i, j in itertools.combinations(range(len(text) + 1), 2):  # every three-piece cut
        assert _streamed(kind, [text[:i], text[i:j], text[j:]]) == want, (i, j)


def test_reasoning_is_released_as_it_comes_not_held_to_the_end() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi") == ("", "")  # cannot tell yet
    assert stream.feed("nk>step one, ") == ("step one, ", "")
    assert stream.feed("step two</th") == ("step two", "")  # "</th" held back: maybe the end tag
    assert stream.feed("ink>\n\n") == ("", "")
    assert stream.feed("Answer") == ("", "Answer")
    assert stream.finish() == ("", "")
    plain = ReasoningStream("qwen3")
    assert plain.feed("Hello") == ("", "Hello")  # no think block: content at once


def test_parser_choice_and_thinking_off() -> None:
    assert choose_reasoning_parser("auto", "qwen3", "") == "qwen3"
    assert choose_reasoning_parser("auto", "qwen3_moe", "") == "qwen3"
    assert choose_reasoning_parser("auto", "llama", "chatml") == "none"
    r1_template = "{{ '<｜Assistant｜><think>\\n' }}"
    assert choose_reasoning_parser("auto", "qwen2", r1_template) == "deepseek_r1"
    assert choose_reasoning_parser("deepseek_r1", "llama", "") == "deepseek_r1"
    assert choose_reasoning_parser("none", "qwen3", "") == "none"
    with pytest.raises(ValueError, match="reasoning_parser"):
        choose_reasoning_parser("granite", "llama", "")
    assert ReasoningStream.of("none") is None
    assert ReasoningStream.of("qwen3", {"enable_thinking": False}) is None
    assert ReasoningStream.of("deepseek_r1", {"thinking": False}) is None
    assert isinstance(ReasoningStream.of("qwen3", {"enable_thinking": True}), ReasoningStream)
    assert thinking_disabled(None) is False


def test_auto_picks_deepseek_r1_where_the_template_opens_the_think_block() -> None:
    """Qwen3's Thinking-2507 models: their template ends the prompt with "<think>\\n" and the model
    writes no "<think>" of its own; the qwen3 parser would leave the whole answer, "</think>" and
    all, in the content."""
    from tests.support.qwen3_scripted import QWEN3_CHAT_TEMPLATE, QWEN3_THINKING_TEMPLATE

    assert opens_thinking(QWEN3_THINKING_TEMPLATE)
    assert choose_reasoning_parser("auto", "qwen3", QWEN3_THINKING_TEMPLATE) == "deepseek_r1"
    assert choose_reasoning_parser("auto", "qwen3_moe", QWEN3_THINKING_TEMPLATE) == "deepseek_r1"
    assert ReasoningStream("deepseek_r1").split("I think\n</think>\n\nAnswer") == ("I think\n", "Answer")
    # the hybrid Qwen3 template opens nothing by default (enable_thinking false closes an empty block)
    assert not opens_thinking(QWEN3_CHAT_TEMPLATE)
    assert choose_reasoning_parser("auto", "qwen3", QWEN3_CHAT_TEMPLATE) == "qwen3"
    # a template that opens it unless thinking is off, in any family
    switched = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
        "{% else %}<think>\n{% endif %}"
    )
    assert choose_reasoning_parser("auto", "llama", switched) == "deepseek_r1"
    assert choose_reasoning_parser("qwen3", "qwen3", switched) == "qwen3"  # as set, not picked
    # a template that cannot be rendered for a plain user turn, or never writes <think>: by family
    assert not opens_thinking("{{ raise_exception('a system message first') }}<think>")
    assert not opens_thinking("{% if %}<think>")  # does not compile
    assert choose_reasoning_parser("auto", "qwen3", "{{ raise_exception('no') }}<think>") == "qwen3"
    assert opens_thinking("{{ '<think>' }}\n ") and not opens_thinking("<thinking>")
