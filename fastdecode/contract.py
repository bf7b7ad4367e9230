"""What crosses between the services, as plain data: the sampling settings (whose `grammar` is a
structured output compiled by fastdecode.runtime.grammar, which holds `Structured` and its limits),
a position's logprobs, the sequences of a step, the names of prefix blocks, and the limits on them.
Every core builds on this module and it builds on none of them: it imports no torch, no gRPC and no
model or KV code, so the gateway, which validates requests against these limits, loads none of
them."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fastdecode.runtime.errors import InvalidInput

MAX_TOP_LOGPROBS = 20  # as vLLM and OpenAI's chat API: the alternatives reported per position
MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties: [-2, 2]
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100] (-100 bans a token in practice, +100 forces it)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token and its logprob, with the `top` alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0  # alternatives reported per sampled token (the sampled one's always is)
    prompt_logprobs: bool = False  # score the prompt's positions at prefill (OpenAI's echo)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # vLLM/HF: divides (>0) or multiplies (<0) logits of seen tokens
    min_tokens: int = 0  # EOS and `suppress_ids` are masked until this many tokens were sampled
    suppress_ids: tuple[int, ...] = ()  # the request's stop token ids (EOS is the runner's to add)
    grammar: str = ""  # an llguidance grammar the output must match (fastdecode.dense.grammar)
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, bias) added to the logits
    min_p: float = 0.0  # vLLM's: tokens below min_p x the top token's probability are dropped
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be sampled (empty: all)
    # vLLM's bad_words as token sequences: a sequence's last token is banned where the generated
    # tokens end with the rest of it (a one-token word always)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # The LoRA adapter the sequence runs with, by name ("" the base model): it travels with the
    # sequence's settings to every row gpu_dense runs for it (fastdecode.dense.loras).
    lora: str = ""

    def validate(self) -> None:
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise InvalidInput(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidInput(f"seed must be in [0, 2**64), got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidInput(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails too
                raise InvalidInput(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidInput(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}],"
                f" got {self.repetition_penalty}"
            )
        if self.min_tokens < 0:
            raise InvalidInput(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            raise InvalidInput(f"min_p must be in [0, 1], got {self.min_p}")
        for t, b in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise InvalidInput(f"logit_bias of token {t} must be in [-100, 100], got {b}")
        if any(not w for w in self.bad_words):
            raise InvalidInput("a bad word has no tokens")

    def token_ids(self) -> list[int]:
        """Every token id the parameters name (checked against the vocabulary by the runner)."""
        return (
            [t for t, _ in self.logit_bias]
            + list(self.allowed_token_ids)
            + [t for w in self.bad_words for t in w]
        )

    @property
    def needs_history(self) -> bool:
        """Whether the dense side must keep the sequence's tokens (penalties, a grammar matcher, bad
        words of more than one token)."""
        return self.reads_history or bool(self.grammar)

    @property
    def reads_history(self) -> bool:
        """Whether a logit processor reads the sequence's tokens (penalties, bad words of more than one
        token): verifying drafts would need each draft in its state. A grammar's matcher is advanced
        through drafts instead (llguidance computes a mask at every draft position)."""
        return self.penalized or any(len(w) > 1 for w in self.bad_words)

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling, beyond the penalties and min_tokens."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the sequence's token history (prompt + generated)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)  # one per planned sequence every step: a slotted init is the cheaper one
class PlannedSeq:
    """One sequence's share of a step: feed `token_ids` at positions start_pos.. on `shard`. The one
    type on both sides of the step boundary: the scheduler core plans it, gpu_dense's StepRunner runs
    it (fastdecode.wire.dense carries it over the wire as a row of dense.proto's StepPlan)."""

    seq_id: str
    shard: int
    mini_batch: int
    token_ids: list[int]
    start_pos: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample: bool = True  # False: a prefill chunk before the prompt's last (nothing to sample yet)
    sample_index: int = 0
    next_token: int | None = None  # the prompt token after a chunk whose prompt logprobs are asked
    # Planned one step ahead (while the step before ran): token_ids is [LAST_SAMPLE], to be replaced
    # by the token gpu_dense sampled for the sequence in the step it ran just before this one.
    use_last_sample: bool = False
    # Decode steps this row runs in a row within the one plan (the scheduler's --decode-steps): each
    # step after the first feeds it the token the one before sampled, one position further on.
    steps: int = 1
    # Speculative drafts (the scheduler's --speculative): token_ids is [the last token] + `drafts`
    # drafted tokens; gpu_dense verifies them in this one step and answers 1 to drafts + 1 tokens.
    drafts: int = 0

    # Named builders for the scheduler's two kinds of row. They take keywords where the meaning is
    # not plain, and call the constructor positionally: a class called with keywords pays for a
    # dict of them, and the scheduler builds one row per running sequence every step.
    @classmethod
    def chunk(
        cls,
        seq_id: str,
        shard: int,
        token_ids: list[int],
        start_pos: int,
        sampling: SamplingParams,
        *,
        sample: bool,
        sample_index: int,
        next_token: int | None = None,
        steps: int = 1,
        drafts: int = 0,
    ) -> PlannedSeq:
        """A row that feeds tokens the scheduler knows (a prefill chunk, a recomputed history, the
        token a decode step sampled, with the drafts that follow it) at positions start_pos..;
        mini-batch 0 until the step is split."""
        return cls(
            seq_id,
            shard,
            0,
            token_ids,
            start_pos,
            sampling,
            sample,
            sample_index,
            next_token,
            False,
            steps,
            drafts,
        )

    @classmethod
    def ahead(
        cls,
        seq_id: str,
        shard: int,
        start_pos: int,
        sampling: SamplingParams,
        *,
        sample_index: int,
        steps: int = 1,
    ) -> PlannedSeq:
        """A row planned one step ahead: it feeds the token gpu_dense sampled for the sequence in the
        step it ran just before (LAST_SAMPLE) at start_pos, and samples; mini-batch 0 until split."""
        return cls(
            seq_id, shard, 0, [LAST_SAMPLE], start_pos, sampling, True, sample_index, None, True, steps
        )


LAST_SAMPLE = -1  # the token of a step planned ahead: not known to the scheduler yet


@dataclass(frozen=True)
class LoraInfo:
    """A LoRA adapter gpu_dense holds: the name requests pick it by, where it was read, its rank."""

    name: str
    path: str
    rank: int


# ---- prefix blocks ---------------------------------------------------------------------------------
# A shard's full KV block is named by a chained hash of its tokens; the scheduler names its own
# the same way to tell which shard holds a prompt's prefix (fastdecode/kv/prefix.py).
_DIGEST = 16  # bytes of blake2b: collisions are out of reach at any pool size


def prefix_seed(model: str, dtype: str, geometry: tuple[int, int, int], block_size: int) -> bytes:
    """The hash chain's start: blocks of another model, KV dtype or block size never match."""
    text = f"{model}|{dtype}|{'x'.join(map(str, geometry))}|{block_size}"
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST).digest()


def chain_hashes(seed: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """One name per full block of token_ids (a partly filled last block has none)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out: list[bytes] = []
    prev = seed
    for i in range(len(ids) // block_size):
        h = hashlib.blake2b(prev, digest_size=_DIGEST)
        h.update(ids[i * block_size : (i + 1) * block_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out
