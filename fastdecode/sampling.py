"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds.

A seeded row draws its noise from a generator seeded by (seed, sample_index), so the
token it gets does not depend on what else is in the batch or on which step it runs.
Imports no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdecode.errors import InvalidInput

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) pairs over the seed space


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def validate(self) -> None:
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise InvalidInput(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidInput(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _row_seed(seed: int, index: int) -> int:
    return ((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], sample_index: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] fp32 -> (token ids [N] int64, logprobs [N] fp32 under the model's distribution)."""
    n, vocab = logits.shape
    if len(params) != n or len(sample_index) != n:
        raise InvalidInput("one SamplingParams and sample_index per row required")
    logits = logits.float()
    logprobs_all = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, idx)
        temp = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        sub = sub / temp[:, None]
        top_k = torch.tensor([params[i].top_k or vocab for i in rows], device=logits.device).clamp(max=vocab)
        top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            p = params[i]
            if p.seed is None:
                noise[j].exponential_()
            else:
                gen = torch.Generator(device=logits.device).manual_seed(_row_seed(p.seed, sample_index[i]))
                noise[j].exponential_(generator=gen)
        choice = (probs / noise).argmax(dim=-1)
        tokens[idx] = order.gather(1, choice[:, None]).squeeze(1)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)
