"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds,
the OpenAI penalties, logit_bias and min_tokens, vLLM's min_p, allowed_token_ids and bad_words, and
logprobs (the sampled token's and the top-k alternatives).

A seeded row draws its noise from a generator seeded by (seed, sample_index), so the
token it gets does not depend on what else is in the batch or on which step it runs.
Logprobs are always those of the raw logits (log-softmax, temperature-free, before penalties or a
grammar mask), as OpenAI defines them. Imports no gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdecode.contract import SamplingParams
from fastdecode.runtime.errors import InvalidInput

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) pairs over the seed space


def row_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The generator of a seeded row's draw for the token at `index` (its sample_index)."""
    mixed = ((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(mixed)


def penalize(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    sample_index: Sequence[int],
    history: Sequence[Sequence[int] | None],
    eos_ids: Sequence[int] = (),
) -> torch.Tensor:
    """The logits the sampler draws from, the logit processors in vLLM's order: penalties
    (repetition, then frequency and presence) over each row's `history` (prompt + generated; its last
    sample_index tokens are the generated ones), min_tokens, logit_bias, allowed_token_ids, bad_words.
    Rows that need none are untouched; returns `logits` itself when no row does. (min_p acts in
    `sample`, on the probabilities after temperature.)"""
    rows = [
        i
        for i, p in enumerate(params)
        if (p.penalized and history[i]) or (p.min_tokens and sample_index[i] < p.min_tokens) or p.processed
    ]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        p, row = params[i], out[i]
        hist = history[i]
        if p.penalized and hist:
            seen = torch.tensor(list(hist), device=logits.device)
            if p.repetition_penalty != 1.0:
                ids = seen.unique()
                vals = row[ids]
                row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            n_out = min(sample_index[i], len(hist))
            if n_out and (p.frequency_penalty or p.presence_penalty):
                counts = torch.bincount(seen[len(hist) - n_out :], minlength=vocab)[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.min_tokens and sample_index[i] < p.min_tokens:
            banned = [t for t in (*eos_ids, *p.suppress_ids) if 0 <= t < vocab]
            if banned:
                row[torch.tensor(banned, device=logits.device)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            row[ids] += torch.tensor([b for _, b in p.logit_bias], device=logits.device, dtype=row.dtype)
        if p.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            keep[torch.tensor(p.allowed_token_ids, device=logits.device)] = True
            row.masked_fill_(~keep, float("-inf"))
        if p.bad_words:
            generated = list(hist[len(hist) - min(sample_index[i], len(hist)) :]) if hist else []
            banned = [w[-1] for w in p.bad_words if _ends_with(generated, w[:-1])]
            if banned:
                row[torch.tensor(banned, device=logits.device)] = float("-inf")
    return out


def _ends_with(tokens: Sequence[int], tail: Sequence[int]) -> bool:
    return not tail or (len(tokens) >= len(tail) and list(tokens[len(tokens) - len(tail) :]) == list(tail))


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    """The k best (id, logprob) of each row of a [N, V] log-softmax, best first."""
    if k <= 0:
        return [() for _ in range(logprobs.shape[0])]
    vals, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    return [
        tuple(zip(r_ids, r_vals, strict=True))
        for r_ids, r_vals in zip(ids.tolist(), vals.tolist(), strict=True)
    ]


_LSE_ROWS = 16  # rows per chunk of chosen_logprobs: 16 x 128k fp32 = 8 MB of temporary


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    sample_index: list[int],
    processed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] fp32 -> (token ids [N] int64, logprobs [N] fp32 under the model's distribution).

    `processed`: the logits to draw from when they differ from the model's (penalties, a grammar
    mask); the logprobs stay those of `logits`."""
    n = logits.shape[0]
    if len(params) != n or len(sample_index) != n:
        raise InvalidInput("one SamplingParams and sample_index per row required")
    model = logits = logits.float()
    if processed is not None:
        logits = processed.float()
    best, tokens = logits.max(dim=-1)  # first index of the max, as argmax; one pass for both
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        probs, order = _filtered(logits.index_select(0, idx), [params[i] for i in rows])
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            p = params[i]
            if p.seed is None:
                noise[j].exponential_()
            else:
                noise[j].exponential_(generator=row_generator(p.seed, sample_index[i], logits.device))
        choice = (probs / noise).argmax(dim=-1)
        tokens[idx] = order.gather(1, choice[:, None]).squeeze(1)
    return tokens, chosen_logprobs(model, tokens, best if logits is model else None)


def _filtered(sub: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled rows' distributions after temperature, top-k, top-p and min-p, in descending order of
    the logits: (probabilities [N, V], the token of each place [N, V])."""
    dev, vocab = sub.device, sub.shape[1]
    temp = torch.tensor([p.temperature for p in params], device=dev)
    sub = sub / temp[:, None]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=dev).clamp(max=vocab)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    # min_p: below min_p x the most likely token's probability (after temperature, top-k)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    drop |= probs < min_p[:, None] * probs[:, :1]
    return torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1), order


def distributions(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's distribution as `sample` draws from it ([N, V] fp32): one-hot at the argmax for a
    greedy row. What speculative verification weighs drafts against (fastdecode/dense/verify.py)."""
    logits = logits.float()
    out = torch.zeros_like(logits)
    out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        probs, order = _filtered(logits.index_select(0, idx), [params[i] for i in rows])
        out[idx] = torch.zeros_like(probs).scatter_(1, order, probs)
    return out


def chosen_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, row_max: torch.Tensor | None = None
) -> torch.Tensor:
    """log_softmax(logits)[i, tokens[i]] without the [N, V] log_softmax: on a CPU host at B=256 and
    a 128k vocabulary that temporary (131 MB) cost more in page faults and writes than the math.
    Rows go in chunks that stay in cache: exp(x - max), summed (`row_max`: the rows' max, if known)."""
    m = logits.amax(dim=-1) if row_max is None else row_max
    if logits.device.type != "cpu":
        lse = torch.logsumexp(logits, dim=-1)
    else:
        lse = torch.empty_like(m)
        for i in range(0, logits.shape[0], _LSE_ROWS):
            mi = m[i : i + _LSE_ROWS]
            # below e^-80 a term is < 2e-35 of the max's: clamped, so exp never makes a subnormal
            # (each one a microcode assist: masked or -1e4 logits made exp 14x slower)
            shifted = (logits[i : i + _LSE_ROWS] - mi[:, None]).clamp_(min=-80.0)
            lse[i : i + _LSE_ROWS] = shifted.exp_().sum(dim=-1).log_() + mi
    return logits.gather(1, tokens[:, None]).squeeze(1) - lse
