"""Multi-step decode (--decode-steps k): one plan runs a sampling sequence for up to k decode steps
in a row at gpu_dense, each step fed the token the one before sampled, and its k tokens come back in
the one result. The scheduler's work per plan (the plan, the messages, the events) is then spread
over k tokens, as vLLM's multi-step scheduling did; the price is that the stop rules see a plan's
tokens only after it (a stopped sequence wastes up to k-1 rows) and that new requests join at plan
boundaries. Pure Python, no gRPC: a collaborator of the core's (fastdecode/scheduling/core.py).

`--decode-steps auto` runs up to AUTO_DECODE_STEPS while no request waits to be admitted or
prefilled, and one step a plan while one does, so that its own prefill plan and the plans while it
queues are not held k steps; the plans already out when it arrives (the one running, and with
plan-ahead the one queued behind it) are not recalled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from fastdecode.contract import TokenLogprob
from fastdecode.protocol import MAX_DECODE_STEPS
from fastdecode.runtime.errors import InternalError, InvalidInput
from fastdecode.scheduling.load import LoadModel
from fastdecode.scheduling.tables import CoreTables, SeqEntry
from fastdecode.scheduling.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    DenseAnswer,
    Request,
    Sampled,
    SampledRun,
    TokenEvent,
)

DecodeSteps = int | Literal["auto"]  # --decode-steps: a count, or auto

# auto's most decode steps a plan. The record (docs/benchmarks/2026-12-05-decode-steps.md) puts the
# scheduler at 0.76-0.78 ms of CPU a decode step at k=8, the first k under its 1 ms goal (1.10-1.15
# at k=4); past 8 only the last ~0.2 ms of per-plan work is left to spread, while the plans a
# newcomer finds out grow with k.
AUTO_DECODE_STEPS = 8


def newcomer_waits(tables: CoreTables) -> bool:
    """Whether a request's first token (or a preempted or recovered sequence's next) would wait behind
    the next plan: one is queued, or a running one has prompt or history its shard has not seen. One
    whose last prefill chunk is in flight is not counted: its kv covers its tokens, its token is on
    the way in the plan out."""
    if tables.waiting:
        return True
    for seq in tables.running.values():
        gap = len(seq.tokens) - seq.kv
        if gap > 1 or (gap == 1 and len(seq.tokens) <= len(seq.req.prompt)):
            return True
    return False


class DecodeRuns:
    """Several decode steps a plan: how many a row runs (at most `decode_steps`; with auto, the cap
    or 1 as `waiting` says), and a run's tokens applied through the stop rules (the EOS ids `eos`; a
    stop moves the load model's ratio)."""

    def __init__(
        self,
        decode_steps: DecodeSteps,
        eos: frozenset[int],
        load: LoadModel,
        waiting: Callable[[], bool] | None = None,
    ) -> None:
        auto = decode_steps == "auto"
        if not auto and not (type(decode_steps) is int and 1 <= decode_steps <= MAX_DECODE_STEPS):
            raise InvalidInput(
                f"decode_steps must be auto or in [1, {MAX_DECODE_STEPS}], got {decode_steps!r}"
            )
        # decode steps a plan runs a sampling sequence for, at most
        self.decode_steps: int = AUTO_DECODE_STEPS if auto else int(decode_steps)
        self._waiting = waiting if auto else None  # None: every plan may run decode_steps
        self._eos = eos
        self._load = load

    def plan_steps(self) -> int:
        """The most decode steps the plan being made runs a sampling sequence for: decode_steps, or
        with auto one while a request waits to be admitted or prefilled (asked once a plan)."""
        if self._waiting is not None and self._waiting():
            return 1
        return self.decode_steps

    def steps(self, req: Request, generated: int, most: int | None = None) -> int:
        """Decode steps to plan for a sampling sequence with `generated` tokens so far (in flight
        included): at most `most` (the plan's, default decode_steps), never past its max_tokens. One
        where the tokens after a stop would not follow on: a chunk scoring its prompt, and a grammar
        told to ignore EOS (gpu_dense stops a grammar's row at EOS, so the KV of a sequence that
        goes on would lag the plan)."""
        sp = req.sampling
        if sp.prompt_logprobs or (sp.grammar and req.ignore_eos):
            return 1
        return max(1, min(self.decode_steps if most is None else most, req.max_tokens - generated))

    def apply(
        self,
        seq: SeqEntry,
        steps: int,
        res: DenseAnswer,
        scored: list[TokenLogprob],
        step_no: int,
        *,
        exact: bool = True,
    ) -> TokenEvent:
        """A sequence's tokens of a plan that ran it `steps` decode steps (or verified steps - 1
        drafts: then 1 to `steps` tokens, not `exact`ly steps): the stop rules on each in turn; the
        tokens after the one that stopped it are dropped. The event finishes it (the caller lets it
        leave) when it stopped, reached max_tokens, or its result is not what was planned."""
        toks, lps, tops = tokens_of(res)
        if not toks or toks[0] < 0 or len(toks) > steps or len(lps) != len(toks):
            err = InternalError(f"no result for a sequence planned for {steps} decode steps")
            return _failed(seq, [], [], step_no, err)
        req, tokens = seq.req, seq.tokens
        n_prompt, eos, stops = len(req.prompt), self._eos, req.stop_token_ids
        reason: str | None = None
        for i, tok in enumerate(toks):
            tokens.append(tok)
            if (tok in eos and not req.ignore_eos) or tok in stops:
                reason = FINISH_STOP
            elif len(tokens) - n_prompt >= req.max_tokens:
                reason = FINISH_LENGTH
            if reason is not None:
                toks, lps, tops = toks[: i + 1], lps[: i + 1], tops[: i + 1]
                break
        if reason is None and exact and len(toks) < steps:
            # gpu_dense stops a row early only at a grammar's EOS: the sequence would go on from KV
            # positions its plan ahead did not count on
            err = InternalError(f"gpu_dense ran {len(toks)} of the {steps} decode steps planned")
            return _failed(seq, toks, lps, step_no, err)
        generated = len(tokens) - n_prompt
        if reason is not None:
            self._load.finished(generated, req.max_tokens)
        return TokenEvent(
            req.seq_id,
            toks,
            lps,
            reason,
            n_prompt,
            generated,
            step_no,
            seq.shard if seq.shard is not None else -1,
            None,
            seq.cached,
            list(tops) if req.sampling.top_logprobs else [],
            scored,
        )


def tokens_of(res: DenseAnswer) -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
    """A row's answer in any of its shapes as (tokens, logprobs, top alternatives)."""
    if isinstance(res, SampledRun):
        return res.token_ids, res.logprobs, res.top
    if isinstance(res, Sampled):
        return [res.token_id], [res.logprob], [res.top]
    if isinstance(res[0], int):
        return [res[0]], [res[1]], []
    return res[0], res[1], []  # type: ignore[return-value]


def _failed(seq: SeqEntry, toks: list[int], lps: list[float], step_no: int, err: InternalError) -> TokenEvent:
    req, shard = seq.req, seq.shard if seq.shard is not None else -1
    n_prompt = len(req.prompt)
    return TokenEvent(req.seq_id, toks, lps, FINISH_ERROR, n_prompt, seq.generated, step_no, shard, err)
