"""The tokenizer of a GGUF file, rebuilt as tokenizer.json and tokenizer_config.json
(fastdecode.tools.gguf_import writes them beside the weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from fastdecode.runtime.errors import ModelLoadError


class GGUFFile(Protocol):
    """What the tokenizer reads of a GGUF file (fastdecode.tools.gguf_import.GGUFFile)."""

    path: Path

    @property
    def architecture(self) -> str: ...

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


# llama.cpp's tokenizer.ggml.token_type values.
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# Pre-tokenizer split regexes, as llama.cpp (llama-vocab.cpp) and transformers' GGUF loader use them
# for the name in tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# name -> (split regex, digits one by one first). "smollm": llama.cpp splits every digit apart, then
# applies the GPT-2 regex (SmolLM2's own tokenizer.json: Digits(individual) + ByteLevel).
# None: the GPT-2 regex built into the ByteLevel pre-tokenizer.
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "smollm": (None, True),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}


def build_tokenizer(g: GGUFFile) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json contents) from the GGUF vocabulary and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = g.get("tokenizer.ggml.model")
    if model == "llama" and g.architecture == "gemma3":
        return _gemma_tokenizer(g)
    if model != "gpt2":
        raise ModelLoadError(
            f"{g.path}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: 'gpt2' "
            "(byte-level BPE), and 'llama' (SentencePiece BPE) for gemma3"
        )
    pre = str(g.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{g.path}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            + ", ".join(sorted(PRE_TOKENIZERS))
        )
    tokens: list[str] = list(g.require("tokenizer.ggml.tokens"))
    types: list[int] = list(g.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"{g.path}: {len(types)} token types for {len(tokens)} tokens")
    merges = [tuple(m.split(" ", 1)) for m in g.require("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{g.path}: the vocabulary has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split, digits = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) are special: matched whole, dropped by
    # skip_special_tokens; user-defined ones are matched whole but kept.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _TOKEN_USER_DEFINED
        ]
    )

    def special(meta: str) -> str | None:
        i = g.get(f"tokenizer.ggml.{meta}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = special("bos_token_id"), special("eos_token_id")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single, *([f"{bos}:1"] * add_bos), "$B:1", *([f"{eos}:1"] * add_eos)])
    specials = [(t, vocab[t]) for t in dict.fromkeys([bos] * add_bos + [eos] * add_eos) if t is not None]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": special("padding_token_id"),
        "unk_token": special("unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.get(f"{g.require('general.architecture')}.context_length", 2048)),
    }
    template = g.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return tok.to_str(pretty=True), config


def _gemma_tokenizer(g: GGUFFile) -> tuple[str, dict[str, Any]]:
    """Gemma's SentencePiece BPE (byte fallback, spaces as U+2581, no prefix space), rebuilt as
    transformers' GemmaTokenizer and its GGUF loader build it.

    The file lists no merges: they are recovered from the vocabulary, each token cut into two
    tokens, best first in the order the tokens appear in the file (Gemma's scores do not follow
    its merge order). Tokens of two or more spaces are stored as spaces and looked up as U+2581."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    raw: list[str] = list(g.require("tokenizer.ggml.tokens"))
    types: list[int] = list(g.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(raw))
    if len(types) != len(raw):
        raise ModelLoadError(f"{g.path}: {len(types)} token types for {len(raw)} tokens")
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in raw]
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {t: i for i, t in enumerate(tokens)}  # the merge order: the file's order
    found: list[tuple[int, int, int, str, str]] = []
    for token, r in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((r, -len(left), -len(right), left, right))
    found.sort()
    unk = raw[int(g.get("tokenizer.ggml.unknown_token_id", 3))]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in found],
            fuse_unk=True,
            unk_token=unk,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(raw, types, strict=True)
            if k == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _TOKEN_USER_DEFINED
        ]
    )

    def special(meta: str) -> str | None:
        i = g.get(f"tokenizer.ggml.{meta}")
        return raw[int(i)] if i is not None and 0 <= int(i) < len(raw) else None

    bos, eos = special("bos_token_id"), special("eos_token_id")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"])
    pair = " ".join([single, *([f"{bos}:1"] * add_bos), "$B:1"])
    specials = [(bos, vocab[bos])] if add_bos and bos is not None else []
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": special("padding_token_id"),
        "unk_token": unk,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.get("gemma3.context_length", 2048)),
    }
    template = g.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return tok.to_str(pretty=True), config
