"""Tokenizer (tokenizer.json through the `tokenizers` library) and UTF-8-safe streaming detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from fastdecode.runtime.errors import InvalidInput, ModelLoadError


class Tokenizer:
    def __init__(self, tok: _HFTokenizer) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # the strings the tokenizer turns into special (control) tokens wherever they appear
        self.special_strings = tuple(
            t.content for t in tok.get_added_tokens_decoder().values() if t.special and t.content
        )
        self._as_text: _HFTokenizer | None = None  # a copy that reads special-token strings as text

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {path}")
        return cls(_HFTokenizer.from_file(str(file)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode(self._tok, text, add_special_tokens)

    def encode_spans(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Like encode(text, add_special_tokens=False), except that inside `spans` (character ranges
        of untrusted text, e.g. chat message content) special-token strings are plain text: a user
        who types "<|im_start|>system" gets those characters' tokens, not a control token. Text whose
        spans hold no such string is encoded whole, exactly as encode() does."""
        if not any(s in text[a:b] for a, b in spans for s in self.special_strings):
            return self.encode(text, add_special_tokens=False)
        if self._as_text is None:
            copy = _HFTokenizer.from_str(self._tok.to_str())
            copy.encode_special_tokens = True
            self._as_text = copy
        ids: list[int] = []
        at = 0
        for a, b in sorted(spans):
            if a > at:
                ids += _encode(self._tok, text[at:a], False)
            if b > a:
                ids += _encode(self._as_text, text[a:b], False)
            at = max(at, b)
        if at < len(text):
            ids += _encode(self._tok, text[at:], False)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. An id the tokenizer does not know decodes to nothing, as in transformers: a
        model's vocab_size may exceed its tokenizer's (Qwen2 pads its embedding to a multiple of 128),
        and a model can emit those ids."""
        if ids and min(ids) < 0:
            raise InvalidInput(f"negative token id {min(ids)}")
        if ids and max(ids) >= self.vocab_size:
            ids = [i for i in ids if i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def stream(self) -> DetokenizeStream:
        return DetokenizeStream(self)


class DetokenizeStream:
    """Incremental text: emits a delta only once it no longer ends in a partial UTF-8 sequence.

    Decodes a short window (prefix_offset..) rather than everything, as vLLM and TGI do, so
    byte-level tokens that split a character and merges that change spacing come out right.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


def _encode(tok: _HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """tokenizers' encode holds the GIL for the whole call (a 1 MiB prompt stalled the gateway's
    event loop 0.82 s from a worker thread); encode_batch releases it (3.5 ms), same ids."""
    return list(tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
