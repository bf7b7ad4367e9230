"""Multi-step decode (--decode-steps k): one plan runs a sampling sequence for up to k decode steps
in a row at gpu_dense, each step fed the token the one before sampled, and its k tokens come back in
the one result. The scheduler's work per plan (the plan, the messages, the events) is then spread
over k tokens, as vLLM's multi-step scheduling did; the price is that the stop rules see a plan's
tokens only after it (a stopped sequence wastes up to k-1 rows) and that new requests join at plan
boundaries. Pure Python, no gRPC: a collaborator of the core's (fastdecode/scheduling/core.py).
"""

from __future__ import annotations

from fastdecode.contract import TokenLogprob
from fastdecode.runtime.errors import InternalError
from fastdecode.scheduling.load import LoadModel
from fastdecode.scheduling.tables import SeqEntry
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


class DecodeRuns:
    """Several decode steps a plan: how many a row runs (at most `decode_steps`), and a run's
    tokens applied through the stop rules (the EOS ids `eos`; a stop moves the load model's ratio)."""

    def __init__(self, decode_steps: int, eos: frozenset[int], load: LoadModel) -> None:
        self.decode_steps = decode_steps  # decode steps a plan runs a sampling sequence for, at most
        self._eos = eos
        self._load = load

    def steps(self, req: Request, generated: int) -> int:
        """Decode steps to plan for a sampling sequence with `generated` tokens so far (in flight
        included): never past its max_tokens. One where the tokens after a stop would not follow on:
        a chunk scoring its prompt, and a grammar told to ignore EOS (gpu_dense stops a grammar's row
        at EOS, so the KV of a sequence that goes on would lag the plan)."""
        sp = req.sampling
        if sp.prompt_logprobs or (sp.grammar and req.ignore_eos):
            return 1
        return max(1, min(self.decode_steps, req.max_tokens - generated))

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
