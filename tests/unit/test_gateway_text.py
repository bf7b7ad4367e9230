"""Gateway core without servers: request validation, stop strings with hold-back, output text."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.gateway.text import GenerateParams, Limits, OutputText, StopMatcher, check_params, resolve
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.tokenizer import Tokenizer

LIMITS = Limits(vocab_size=100, max_context=64, max_prompt_chars=50, max_stop=3, max_stop_chars=8)


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "message"),
    [
        (GenerateParams(), "no input"),
        (GenerateParams(prompt=""), "prompt is empty"),
        (GenerateParams(prompt="x" * 51), "limit is 50"),
        (GenerateParams(token_ids=[]), "token_ids is empty"),
        (GenerateParams(token_ids=[1, 100]), "outside the vocabulary"),
        (GenerateParams(token_ids=[-1]), "outside the vocabulary"),
        (GenerateParams(prompt="a", max_tokens=0), "max_tokens"),
        (GenerateParams(prompt="a", max_tokens=-3), "max_tokens"),
        (GenerateParams(prompt="a", temperature=-0.1), "temperature"),
        (GenerateParams(prompt="a", temperature=100.5), "temperature"),
        (GenerateParams(prompt="a", temperature=math.nan), "temperature"),
        (GenerateParams(prompt="a", top_p=0.0), "top_p"),
        (GenerateParams(prompt="a", top_p=1.01), "top_p"),
        (GenerateParams(prompt="a", top_p=math.nan), "top_p"),
        (GenerateParams(prompt="a", top_k=-1), "top_k"),
        (GenerateParams(prompt="a", top_k=101), "top_k"),
        (GenerateParams(prompt="a", stop=["a", "b", "c", "d"]), "4 stop strings"),
        (GenerateParams(prompt="a", stop=["123456789"]), "9 characters"),
        (GenerateParams(prompt="a", stop=[""]), "stop string is empty"),
        (GenerateParams(prompt="a", stop_token_ids=[100]), "stop_token_ids"),
    ],
)
def test_check_params_rejects(params: GenerateParams, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        check_params(params, LIMITS)


@pytest.mark.parametrize(
    "params",
    [
        GenerateParams(prompt="a"),
        GenerateParams(token_ids=[0, 99]),
        GenerateParams(prompt="a", temperature=0.0, top_p=1.0, top_k=100, max_tokens=1),
        GenerateParams(prompt="a", temperature=100.0, top_p=1e-6, stop=["abcdefgh", "x", "y"]),
        GenerateParams(prompt="a", seed=2**64 - 1, stop_token_ids=[0, 99]),
    ],
)
def test_check_params_accepts(params: GenerateParams) -> None:
    check_params(params, LIMITS)


def test_resolve_fills_defaults() -> None:
    v = resolve(GenerateParams(prompt="a", stop=["x", "x"]), [1, 2, 3], LIMITS)
    assert (v.max_tokens, v.temperature, v.top_p, v.top_k, v.seed) == (16, 0.0, 1.0, 0, None)
    assert v.prompt_ids == [1, 2, 3]
    assert v.stop == ("x",)


def test_resolve_context() -> None:
    # explicit max_tokens must fit the context with the prompt
    resolve(GenerateParams(prompt="a", max_tokens=60), [1] * 4, LIMITS)
    with pytest.raises(InvalidInput, match="exceeds the model's context of 64"):
        resolve(GenerateParams(prompt="a", max_tokens=61), [1] * 4, LIMITS)
    # the default shrinks to what the context leaves
    assert resolve(GenerateParams(prompt="a"), [1] * 60, LIMITS).max_tokens == 4
    with pytest.raises(InvalidInput, match="context is 64"):
        resolve(GenerateParams(prompt="a"), [1] * 64, LIMITS)
    with pytest.raises(InvalidInput, match="no tokens"):
        resolve(GenerateParams(prompt="a"), [], LIMITS)
    with pytest.raises(InvalidInput, match="vocabulary"):
        resolve(GenerateParams(prompt="a"), [100], LIMITS)


# ---- stop strings ---------------------------------------------------------------------------------
def feed_all(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


def test_no_stops_passes_through() -> None:
    assert feed_all([], ["ab", "c"]) == (["ab", "c", ""], False)


def test_stop_within_one_piece() -> None:
    assert feed_all(["lo"], ["hello world"]) == (["hel"], True)


def test_hold_back_across_pieces() -> None:
    m = StopMatcher(["world"])
    assert m.feed("hello wo") == "hello "  # "wo" could start "world": held back
    assert m.pending == "wo"
    assert m.feed("rld!") == ""
    assert m.stopped and m.matched == "world"
    assert m.feed("more") == "" and m.flush() == ""


def test_held_text_released_when_it_cannot_match() -> None:
    m = StopMatcher(["world"])
    assert m.feed("a wor") == "a "
    assert m.feed("m") == "worm"
    assert not m.stopped


def test_held_text_released_at_the_end() -> None:
    m = StopMatcher(["###"])
    assert m.feed("x ##") == "x "
    assert m.flush() == "##"


def test_overlapping_prefixes() -> None:
    # "aab" in "aaab": the held suffix must restart at the right place
    assert "".join(feed_all(["aab"], ["a", "a", "a", "b", "c"])[0]) == "a"


def test_earliest_of_several_stops() -> None:
    assert feed_all(["cd", "b"], ["abcd"]) == (["a"], True)
    assert feed_all(["xyz", "\n"], ["one\ntwo"]) == (["one"], True)


def test_stop_at_the_start() -> None:
    assert feed_all(["he"], ["h", "ello"]) == (["", ""], True)


def test_unicode_stop() -> None:
    assert "".join(feed_all(["日本"], ["こんにちは日", "本語"])[0]) == "こんにちは"


def expected_output(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """The oracle: stop at the first piece after which some stop string occurs, cut at the earliest."""
    text = ""
    for p in pieces:
        text += p
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    pieces=st.lists(st.text(alphabet="abcd", max_size=4), max_size=12),
)
def test_stop_matcher_matches_oracle(stops: list[str], pieces: list[str]) -> None:
    m = StopMatcher(stops)
    shown = ""
    for p in pieces:
        shown += m.feed(p)
        # never a stop string, nor any text the oracle would not show
        assert not any(s in shown for s in stops)
        if m.stopped:
            break
    if not m.stopped:
        shown += m.flush()
    assert (shown, m.stopped) == expected_output(stops, pieces)


# ---- output text over the real tokenizer -------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(llama_dir)


def test_output_text_is_utf8_safe(tok: Tokenizer) -> None:
    text = "héllo wörld 日本語 ✓ done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # byte-level tokens split characters
    out = OutputText(tok)
    deltas = [out.push([t]) for t in ids]
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + out.finish().text == text
    assert out.num_tokens == len(ids)


def test_output_text_after_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("The answer is")
    gen = tok.encode(" forty two", add_special_tokens=False)
    out = OutputText(tok, prompt_ids=prompt)
    text = "".join(out.push([t]).text for t in gen) + out.finish().text
    assert text == tok.decode(gen) == " forty two"


def test_output_text_stop_string_across_tokens(tok: Tokenizer) -> None:
    gen = tok.encode("one two three four", add_special_tokens=False)
    out = OutputText(tok, stop=["three"])
    shown, ids = "", []
    for t in gen:
        d = out.push([t])
        shown += d.text
        ids += d.token_ids
        assert "thr" not in shown  # no part of the stop string is ever shown
        if d.stopped:
            break
    assert out.stopped
    assert shown == "one two "
    # ids up to and including the one that completed the stop string
    assert "three" in tok.decode(ids) and "three" not in tok.decode(ids[:-1])
    assert out.num_tokens == len(ids)


def test_output_text_multi_token_event_stops_mid_event(tok: Tokenizer) -> None:
    gen = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    out = OutputText(tok, stop=["beta"])
    d = out.push(gen)
    assert d.stopped and d.text == "alpha "
    assert len(d.token_ids) < len(gen)
    assert "beta" in tok.decode(d.token_ids) and "beta" not in tok.decode(d.token_ids[:-1])
    assert out.push([5]).token_ids == []


def test_output_text_hides_stop_token_text(tok: Tokenizer) -> None:
    gen = tok.encode("hi there", add_special_tokens=False)
    out = OutputText(tok, hidden_ids={gen[-1]})
    d = out.push(gen)
    assert d.token_ids == gen
    assert d.text + out.finish().text == tok.decode(gen[:-1])


def test_output_text_releases_held_text_at_finish(tok: Tokenizer) -> None:
    gen = tok.encode("wait for it", add_special_tokens=False)
    out = OutputText(tok, stop=["it!"])
    shown = out.push(gen).text
    assert shown == "wait for "
    end = out.finish()
    assert not end.stopped and shown + end.text == "wait for it"


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("ok \ud800", "prompt (character 3)"),
        (["fine", "\udfff"], "prompt[1] (character 0)"),
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "prompt.messages[0].content (character 1)"),
        ({"\ud800": "x"}, "a key of prompt"),
    ],
)
def test_lone_surrogates_are_found_and_never_echoed(value: object, where: str) -> None:
    from fastdecode.gateway.text import check_text

    with pytest.raises(InvalidInput) as info:
        check_text("prompt", value)
    assert info.value.message.startswith(where)
    info.value.message.encode("utf-8")  # the message itself is always text
