"""Gateway core: request validation, stop strings with hold-back, incremental output text.

Pure logic (no gRPC): the server converts protobuf messages to `GenerateParams` and feeds
the scheduler's token ids through `OutputText`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from fastdecode.contract import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from fastdecode.gateway.lora import adapter_salt
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.grammar import Structured
from fastdecode.runtime.tokenizer import Tokenizer

# Prompt tokens that seed the detokenizer, so the first generated token decodes with the
# spacing it has after the prompt (SentencePiece drops a leading space otherwise), as vLLM does.
PROMPT_CONTEXT_TOKENS = 5


# Every per-request list is bounded in count and in size, far above what a real request sends (vLLM
# users send a handful of stop strings and bad words), so that checking and tokenizing one stays
# cheap: 256 bad words of 15 KB each took 2.6 s to tokenize on the event loop, stalling every stream.
# Over a limit is a 400 naming it. allowed_token_ids is bounded by the vocabulary's size, the prompt's
# token_ids by the context; the HTTP API's own lists (messages, tools, n) are in openai.py and tools.py.
MAX_STOP = 16  # stop strings (--max-stop)
MAX_STOP_CHARS = 256  # characters of one stop string (--max-stop-chars)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI allows 300; vLLM leaves it open
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 256  # characters of one bad word (a word or a short phrase), as a stop string


@dataclass(frozen=True)
class Limits:
    """What the gateway accepts. vocab_size and max_context come from the model's config.json."""

    vocab_size: int
    max_context: int
    max_prompt_chars: int = 1 << 20
    max_stop: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    default_max_tokens: int = 16
    max_temperature: float = 100.0
    max_logit_bias: int = MAX_LOGIT_BIAS_ENTRIES
    max_bad_words: int = MAX_BAD_WORDS
    max_bad_word_chars: int = MAX_BAD_WORD_CHARS


@dataclass
class GenerateParams:
    """A Generate request as the client sent it; None means the field was not set."""

    prompt: str | None = None
    token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # A rendered chat template already holds the BOS token: encoding must not add another one.
    add_special_tokens: bool = True
    # max_tokens when unset (None: Limits.default_max_tokens); chat asks for the rest of the context.
    default_max_tokens: int | None = None
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and k alternatives
    prompt_logprobs: bool = False  # score the prompt too (OpenAI's echo with logprobs)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    structured: Structured | None = None  # the output must match it (compiled by the gateway's workers)
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    min_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    cache_salt: str | None = None  # OpenAI's: only requests of the same salt share prefix-cache blocks
    lora: str = ""  # the LoRA adapter the `model` field named ("" the base; fastdecode.gateway.lora)
    # Character spans of the prompt that are untrusted text (chat message content): special-token
    # strings there are tokenized as text unless the gateway allows them (--chat-special-tokens).
    text_spans: list[tuple[int, int]] | None = None
    untrusted: list[str] | None = None  # that content itself, for a template whose spans are unknown
    # The rest of the messages' text (names, tool calls) and the tools the template renders: outside
    # the spans, a special-token string would be a control token there, so it is refused instead.
    outside: list[str] | None = None


@dataclass(frozen=True)
class ValidRequest:
    """A validated request with its defaults filled in, ready for the scheduler."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None = None
    prompt_logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    grammar: str = ""  # llguidance's, compiled from GenerateParams.structured
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()  # the words' token sequences (bad_word_ids)
    cache_salt: str = ""  # the prefix-cache namespace (tenant and cache_salt, hashed; "" shared)
    lora: str = ""  # the LoRA adapter it runs with ("" the base model)

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            top_logprobs=self.logprobs or 0,
            prompt_logprobs=self.prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            suppress_ids=self.stop_token_ids if self.min_tokens else (),
            lora=self.lora,
            grammar=self.grammar,
            logit_bias=self.logit_bias,
            min_p=self.min_p,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )


def unencodable(value: object, path: str = "") -> str | None:
    """Where in `value` (str, or lists and dicts of them) a string cannot be UTF-8 encoded (a lone
    surrogate such as "\\ud800", which JSON escapes allow): its path, or None when all is text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{path or 'text'} (character {e.start})"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and unencodable(key) is not None:
            return f"a key of {path or 'the request'}"  # never echo the key: it cannot be encoded
        where = f"{path}.{key}" if path and isinstance(key, str) else f"{path}[{key}]" if path else str(key)
        found = unencodable(item, where)
        if found is not None:
            return found
    return None


def strings_in(value: object) -> list[str]:
    """Every string in `value` (str, or lists and dicts of them, keys included), found iteratively."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v
    return out


def refuse_special_tokens(p: GenerateParams, specials: Sequence[str], spans_known: bool) -> None:
    """A special-token string outside the content spans (`p.outside`), or anywhere in content whose
    spans are unknown (a template that reshapes content), would be tokenized as a control token (a
    forged turn): InvalidInput. Content with known spans is tokenized as text instead."""

    def first(strings: Sequence[str] | None) -> str | None:
        return next((s for t in strings or () for s in specials if s in t), None)

    if not spans_known and (found := first(p.untrusted)) is not None:
        raise InvalidInput(f"message content holds the special token {found!r}, which is not allowed")
    if (found := first(p.outside)) is not None:
        raise InvalidInput(
            f"the special token {found!r} is not allowed outside a message's content "
            "(in a name, a tool call or a tool)"
        )


def check_text(what: str, value: object) -> None:
    where = unencodable(value, what)
    if where is not None:
        raise InvalidInput(f"{where} is not valid Unicode text (a lone surrogate cannot be encoded)")


def check_params(p: GenerateParams, limits: Limits) -> None:
    """Everything that can be checked before tokenizing; raises InvalidInput."""
    if p.prompt is None and p.token_ids is None:
        raise InvalidInput("the request has no input: set prompt or token_ids")
    if p.prompt is not None:
        if not p.prompt:
            raise InvalidInput("prompt is empty")
        check_text("prompt", p.prompt)
        if len(p.prompt) > limits.max_prompt_chars:
            raise InvalidInput(
                f"prompt has {len(p.prompt)} characters; the limit is {limits.max_prompt_chars}"
            )
    if p.token_ids is not None:
        if not p.token_ids:
            raise InvalidInput("token_ids is empty")
        _check_context(len(p.token_ids), limits)  # before looking at each of up to a million ids
        _check_ids("token_ids", p.token_ids, limits.vocab_size)
    if p.max_tokens is not None and p.max_tokens < 1:
        raise InvalidInput(f"max_tokens must be >= 1, got {p.max_tokens}")
    if p.temperature is not None and (
        math.isnan(p.temperature) or not 0.0 <= p.temperature <= limits.max_temperature
    ):
        raise InvalidInput(f"temperature must be in [0, {limits.max_temperature:g}], got {p.temperature}")
    if p.top_p is not None and (math.isnan(p.top_p) or not 0.0 < p.top_p <= 1.0):
        raise InvalidInput(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k is not None and not 0 <= p.top_k <= limits.vocab_size:
        raise InvalidInput(f"top_k must be in [0, {limits.vocab_size}] (0 = off), got {p.top_k}")
    if p.seed is not None and not 0 <= p.seed < 2**64:
        raise InvalidInput(f"seed must be in [0, 2**64), got {p.seed}")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.logprobs}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if v is not None and not -2.0 <= v <= 2.0:  # NaN fails too
            raise InvalidInput(f"{name} must be in [-2, 2], got {v}")
    if p.repetition_penalty is not None and not 0.0 < p.repetition_penalty <= 100.0:
        raise InvalidInput(f"repetition_penalty must be in (0, 100], got {p.repetition_penalty}")
    if p.min_tokens is not None and p.min_tokens < 0:
        raise InvalidInput(f"min_tokens must be >= 0, got {p.min_tokens}")
    if p.cache_salt is not None and not 1 <= len(p.cache_salt) <= 256:
        raise InvalidInput(f"cache_salt must have 1-256 characters, got {len(p.cache_salt)}")
    if p.cache_salt is not None:
        check_text("cache_salt", p.cache_salt)
    if len(p.lora) > 128:  # gpu_dense's names are at most 128 characters (fastdecode.dense.loras)
        raise InvalidInput(f"lora must have at most 128 characters, got {len(p.lora)}", param="lora")
    if len(p.stop) > limits.max_stop:
        raise InvalidInput(f"{len(p.stop)} stop strings; the limit is {limits.max_stop}")
    check_text("stop", list(p.stop))
    for s in p.stop:
        if not s:
            raise InvalidInput("a stop string is empty")
        if len(s) > limits.max_stop_chars:
            raise InvalidInput(f"a stop string has {len(s)} characters; the limit is {limits.max_stop_chars}")
    if len(p.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidInput(
            f"{len(p.stop_token_ids)} stop_token_ids; the limit is {limits.max_stop_token_ids}"
        )
    _check_ids("stop_token_ids", p.stop_token_ids, limits.vocab_size)
    if p.min_p is not None and not 0.0 <= p.min_p <= 1.0:  # NaN fails too
        raise InvalidInput(f"min_p must be in [0, 1], got {p.min_p}")
    if p.logit_bias:
        if len(p.logit_bias) > limits.max_logit_bias:
            raise InvalidInput(
                f"logit_bias has {len(p.logit_bias)} entries; the limit is {limits.max_logit_bias}"
            )
        _check_ids("logit_bias", list(p.logit_bias), limits.vocab_size)
        for t, b in p.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise InvalidInput(f"logit_bias of token {t} must be in [-100, 100], got {b}")
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            raise InvalidInput("allowed_token_ids is empty: nothing could be sampled")
        if len(p.allowed_token_ids) > limits.vocab_size:  # more must repeat ids
            raise InvalidInput(
                f"allowed_token_ids has {len(p.allowed_token_ids)} entries; "
                f"the limit is the vocabulary's size, {limits.vocab_size}"
            )
        _check_ids("allowed_token_ids", p.allowed_token_ids, limits.vocab_size)
    _check_bad_words(p.bad_words, limits)


def _check_bad_words(words: Sequence[str], limits: Limits) -> None:
    """Count and length first: the words are tokenized (twice each) once they pass."""
    if len(words) > limits.max_bad_words:
        raise InvalidInput(f"{len(words)} bad_words; the limit is {limits.max_bad_words}")
    longest = max(words, key=len, default="")
    if len(longest) > limits.max_bad_word_chars:
        raise InvalidInput(
            f"a bad word has {len(longest)} characters; the limit is {limits.max_bad_word_chars}"
        )
    check_text("bad_words", list(words))
    if any(not w.strip() for w in words):
        raise InvalidInput("a bad word is empty")


def bad_word_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Each word's token sequences as vLLM bans them: the word as written and with a leading space
    (how it tokenizes inside a sentence), without duplicates."""
    out: dict[tuple[int, ...], None] = {}
    for w in words:
        for text in (w, " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text, False))
            if ids:
                out[ids] = None
    return list(out)


def tokenize_request(
    p: GenerateParams, tokenizer: Tokenizer, specials_allowed: bool
) -> tuple[list[int], list[tuple[int, ...]]]:
    """A request's prompt ids and its bad words' token sequences (bad_word_ids), once check_params
    bounded them; the gateway runs it on a worker thread. Unless `specials_allowed` (the gateway's
    --chat-special-tokens), chat content is tokenized as text and special-token strings elsewhere in
    the messages are refused (refuse_special_tokens)."""
    guarded = None if specials_allowed else p.text_spans
    if not specials_allowed and (p.untrusted or p.outside):
        refuse_special_tokens(p, tokenizer.special_strings, guarded is not None)
    if p.prompt is None:
        ids = list(p.token_ids or [])
    elif guarded is not None:
        ids = tokenizer.encode_spans(p.prompt, guarded)
    else:
        ids = tokenizer.encode(p.prompt, p.add_special_tokens)
    return ids, bad_word_ids(tokenizer, p.bad_words) if p.bad_words else []


def _check_context(n: int, limits: Limits) -> None:
    if n >= limits.max_context:
        raise InvalidInput(
            f"the prompt has {n} tokens; the model's context is {limits.max_context} "
            "and at least one token must be generated"
        )


def _check_ids(what: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidInput(f"{what} holds {bad}, outside the vocabulary [0, {vocab_size})")


def resolve(
    p: GenerateParams,
    prompt_ids: list[int],
    limits: Limits,
    grammar: str = "",
    bad_words: Sequence[tuple[int, ...]] = (),
    cache_salt: str = "",
) -> ValidRequest:
    """Apply defaults and the context-length check to a request that passed check_params; `grammar`
    is p.structured compiled (fastdecode/gateway/grammar.py), `bad_words` p.bad_words tokenized
    (bad_word_ids)."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidInput("the prompt tokenizes to no tokens")
    _check_ids("the prompt", prompt_ids, limits.vocab_size)  # a tokenizer larger than the model's vocab
    _check_context(n, limits)
    if p.max_tokens is None:
        # The default never makes a valid prompt fail: it shrinks to what the context leaves.
        default = limits.default_max_tokens if p.default_max_tokens is None else p.default_max_tokens
        max_tokens = min(default, limits.max_context - n)
    else:
        max_tokens = p.max_tokens
        if n + max_tokens > limits.max_context:
            raise InvalidInput(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                f"of {limits.max_context} tokens"
            )
    return ValidRequest(
        prompt_ids=list(prompt_ids),
        max_tokens=max_tokens,
        temperature=0.0 if p.temperature is None else float(p.temperature),
        top_p=1.0 if p.top_p is None else float(p.top_p),
        top_k=p.top_k or 0,
        seed=p.seed,
        stop=tuple(dict.fromkeys(p.stop)),
        stop_token_ids=tuple(dict.fromkeys(p.stop_token_ids)),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        presence_penalty=p.presence_penalty or 0.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        repetition_penalty=1.0 if p.repetition_penalty is None else float(p.repetition_penalty),
        min_tokens=min(p.min_tokens or 0, max_tokens),
        grammar=grammar,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in (p.logit_bias or {}).items())),
        min_p=float(p.min_p or 0.0),
        allowed_token_ids=tuple(dict.fromkeys(p.allowed_token_ids or ())),
        bad_words=tuple(bad_words),
        cache_salt=adapter_salt(cache_salt, p.lora),  # no KV shared across adapters
        lora=p.lora,
    )


class StopMatcher:
    """Finds stop strings in streamed text and holds back what could still become one.

    `feed` returns the text that is safe to show: it never contains a stop string nor any
    part of one. A suffix that is a proper prefix of some stop string waits in `pending`
    until the next text decides it. On a match the output ends right before the earliest
    stop string and `stopped` becomes True.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise InvalidInput("a stop string is empty")
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        # Text already released can hold no part of a match (it was never a possible prefix),
        # so searching the pending window is enough.
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda h: h[0])
            self.stopped = True
            self.pending = ""
            return buf[:cut]
        hold = self._partial(buf)
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        if not buf:
            return 0
        last = buf[-1]
        best = 0
        for s in self.stops:
            n = min(len(s) - 1, len(buf))
            while n > best:
                j = s.rfind(last, 0, n)  # candidate prefixes must end with buf's last character
                if j < 0 or j + 1 <= best:
                    break
                if buf.endswith(s[: j + 1]):
                    best = j + 1
                    break
                n = j
        return best

    def flush(self) -> str:
        """The text ended without a match: release what was held back."""
        out, self.pending = self.pending, ""
        return "" if self.stopped else out


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    stopped: bool = False  # a stop string matched: the output ends here


class OutputText:
    """Generated token ids -> UTF-8-safe text deltas with stop strings applied.

    `hidden_ids` are tokens whose text is never shown (the stop token ids and, unless
    ignore_eos, EOS: the scheduler ends the sequence on them), as vLLM does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        hidden_ids: Collection[int] = (),
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.tok = tokenizer
        self.detok = tokenizer.stream()
        context = [t for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:] if 0 <= t < tokenizer.vocab_size]
        self.detok.ids = list(context)
        self.detok.prefix_offset = 0
        self.detok.read_offset = len(context)
        self.matcher = StopMatcher(stop)
        self.hidden = frozenset(hidden_ids)
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, token_ids: Sequence[int]) -> Delta:
        """Token ids after a stop string matched are not taken (nor counted)."""
        parts: list[str] = []
        taken: list[int] = []
        for t in token_ids:
            if self.matcher.stopped:
                break
            taken.append(t)
            self.num_tokens += 1
            if t in self.hidden or not 0 <= t < self.tok.vocab_size:
                continue
            parts.append(self.matcher.feed(self.detok.push(t)))
        return Delta("".join(parts), taken, self.matcher.stopped)

    def finish(self) -> Delta:
        """The generation ended: release an incomplete character at the end and held-back text."""
        if self.matcher.stopped:
            return Delta("", [], True)
        text = self.matcher.feed(self.detok.flush())
        if self.matcher.stopped:
            return Delta(text, [], True)
        return Delta(text + self.matcher.flush(), [], False)
