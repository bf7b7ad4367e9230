"""Speculative decoding in LocalEngine (`fastdecode run --speculative`), without a draft model.

Each decode row is [last token] + up to k drafts from the request's `DraftState` (fastdecode.spec),
never more than its max_tokens leaves room for. One forward runs every position; the rows that carry
drafts are verified by fastdecode.dense.verify (the fleet's gpu_dense code, so greedy tokens equal
those without drafts and sampled ones keep the target's distribution), the rest sample as plain
rows. A verified row yields 1 to d + 1 tokens; the KV of its rejected drafts is rolled back by the
next write at the first of them (KVStore holds a sequence up to the end of its last write;
WindowedAttention keeps keys before the write's start only), so nothing ever attends it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastdecode.contract import PlannedSeq, SamplingParams
from fastdecode.dense.sampling import sample
from fastdecode.dense.verify import verify
from fastdecode.model.dense import DenseModel
from fastdecode.spec import DraftState, Proposer


class SeqChunk(Protocol):
    """What verification reads of engine.SeqChunk (declared here: engine imports this module)."""

    seq_id: str
    token_ids: list[int]
    start_pos: int


Tokens = list[tuple[int, float]]  # (token, logprob) a row yields in one step


@dataclass
class SpecStats:
    """What verification did over a run: tau = emitted / rows (before stop rules cut a row)."""

    rows: int = 0  # rows that carried drafts
    drafts: int = 0  # drafts they carried
    accepted: int = 0  # drafts the target kept
    emitted: int = 0  # tokens those rows yielded (kept drafts + the target's own)

    @property
    def tau(self) -> float:
        return self.emitted / self.rows if self.rows else 0.0

    @property
    def kept(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "verified_rows": self.rows,
            "drafts": self.drafts,
            "drafts_kept": self.accepted,
            "drafts_kept_share": round(self.kept, 4),
            "tau": round(self.tau, 4) if self.rows else None,  # no row carried drafts
        }


def draftable(p: SamplingParams) -> bool:
    """Rows whose verification draws from what LocalEngine samples a plain row from. LocalEngine's
    plain rows apply no logit processors, and verify would (so rows needing any get no drafts); a
    seeded row's tokens would depend on its drafts (the fleet's rule, scheduling/drafts.py)."""
    return p.seed is None and not (
        p.needs_history or p.processed or p.min_tokens or p.prompt_logprobs or p.grammar
    )


class Drafter:
    """Each request's DraftState, fed every token it emits (never unverified drafts)."""

    def __init__(
        self,
        proposer: Proposer,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        max_tokens: int,
    ) -> None:
        self.k = proposer.num_speculative_tokens
        self.max_tokens = max_tokens
        self.states: list[DraftState | None] = [
            proposer.start(list(p)) if draftable(sp) else None for p, sp in zip(prompts, params, strict=True)
        ]

    def propose(self, i: int, generated: int) -> list[int]:
        """Request i's drafts for its next row: every token the row may yield stays within max_tokens
        (so within its KV reservation and the model's context)."""
        state = self.states[i]
        k = min(self.k, self.max_tokens - generated - 1)
        return state.propose(k)[:k] if state is not None and k > 0 else []

    def append(self, i: int, tokens: Sequence[int]) -> None:
        state = self.states[i]
        if state is not None and tokens:
            state.append(tokens)

    def close(self) -> None:
        for state in self.states:
            if state is not None:
                state.close()


def verify_step(
    model: DenseModel,
    hidden: torch.Tensor,
    chunks: Sequence[SeqChunk],
    rows: Sequence[int],
    drafts: Sequence[int],
    params: Sequence[SamplingParams],
    sample_index: Sequence[int],
    stats: SpecStats | None = None,
) -> list[Tokens]:
    """The tokens each sampling row (`rows`, indices into chunks) yields. hidden: every position of
    the step [T, hidden]; chunk j's last drafts[j] tokens are drafts. params, sample_index: per
    chunk."""
    ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
    out: dict[int, Tokens] = {}
    plain = [j for j in rows if not drafts[j]]
    if plain:
        idx = torch.tensor([ends[j] - 1 for j in plain], device=hidden.device)
        toks, lps = sample(
            model.logits(hidden.index_select(0, idx)),
            [params[j] for j in plain],
            [sample_index[j] for j in plain],
        )
        for j, tok, lp in zip(plain, toks.tolist(), lps.tolist(), strict=True):
            out[j] = [(tok, lp)]
    spec = [j for j in rows if drafts[j]]
    if spec:
        # the last token's position and each draft's: the target's distribution after each
        idx = torch.tensor(
            [p for j in spec for p in range(ends[j] - 1 - drafts[j], ends[j])], device=hidden.device
        )
        seqs = [
            PlannedSeq.chunk(
                chunks[j].seq_id,
                0,
                chunks[j].token_ids,
                chunks[j].start_pos,
                params[j],
                sample=True,
                sample_index=sample_index[j],
                drafts=drafts[j],
            )
            for j in spec
        ]
        emitted = verify(model.logits, hidden.index_select(0, idx), seqs, model.config.eos_token_ids)
        for j, toks in zip(spec, emitted, strict=True):
            out[j] = [(t, lp) for t, lp, _ in toks]
            if stats is not None:
                stats.rows += 1
                stats.drafts += drafts[j]
                stats.accepted += len(toks) - 1
                stats.emitted += len(toks)
    return [out[j] for j in rows]
