"""Verification of drafts against the target model: which drafts a step keeps, and its bonus token.

Layout (flat, sequence after sequence, as the S-part computes the positions): sequence i has
k_i = num_drafts[i] drafts (k_i may be 0) and k_i + 1 target positions: its rows in `target_*` are
t_off[i] .. t_off[i] + k_i, where t_off[i] = sum_{j<i} (k_j + 1); its drafts are draft_ids[d_off[i]
: d_off[i] + k_i], d_off[i] = sum_{j<i} k_j. Row t_off[i] + j is the target's distribution for the
token after the context and drafts 0..j-1 (so penalties, grammar masks and the like must see those
drafts as history). Each result is a sequence's accepted drafts followed by one token of the
target's (the bonus, or the replacement of the first rejected draft): 1 to k_i + 1 tokens, and the
KV of the positions after the last accepted draft must be rolled back.

- `accept_greedy`: the longest prefix of drafts equal to the target's argmax, then the target's
  token at the first mismatch (or after the last draft): the tokens greedy decoding gives.
- `accept_sampled`: Leviathan et al. 2023 / Chen et al. 2023. Draft d at a position with target
  distribution p and draft distribution q (one-hot at d for a deterministic drafter, i.e.
  `draft_probs=None`) is accepted with probability min(1, p(d)/q(d)); the first rejection draws from
  normalize(max(0, p - q)) and ends the sequence's step; if all are accepted the bonus is drawn from
  p at the last row. Each emitted token is then distributed exactly as p given the tokens before it.
  Greedy rows fit too: p one-hot at the argmax accepts a draft iff it is the argmax.

Randomness: sequence i draws k_i + 1 uniforms (float64) from generators[i] whatever happens (None:
torch's global generator), so a seeded sequence's tokens do not depend on the batch around it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdecode.runtime.errors import InvalidInput

_ROWS = 16  # residual rows made at a time: 16 x 128k fp32 = 8 MB
_BLOCK = 1024  # tokens per block of the two-level inverse-CDF draw


class _Layout:
    """Index tensors of the flat layout (see the module docstring)."""

    def __init__(
        self, num_drafts: Sequence[int], n_targets: int, n_drafts: int, device: torch.device
    ) -> None:
        k = torch.tensor(list(num_drafts), dtype=torch.int64, device=device)
        if k.numel() and int(k.min()) < 0:
            raise InvalidInput("num_drafts must be >= 0")
        self.batch = k.numel()
        self.k = k
        self.d_off = torch.cumsum(k, 0) - k
        self.t_off = torch.cumsum(k + 1, 0) - (k + 1)
        total = int(k.sum()) if self.batch else 0
        if n_drafts != total or n_targets != total + self.batch:
            raise InvalidInput(
                f"{self.batch} sequences with {total} drafts need {total} draft ids and "
                f"{total + self.batch} target rows, got {n_drafts} and {n_targets}"
            )
        self.seq_of_draft = torch.repeat_interleave(torch.arange(self.batch, device=device), k)
        self.j_of_draft = torch.arange(total, device=device) - self.d_off[self.seq_of_draft]
        self.draft_rows = self.t_off[self.seq_of_draft] + self.j_of_draft
        self.width = int(k.max()) if self.batch else 0

    def accepted(self, ok: torch.Tensor) -> torch.Tensor:
        """Per sequence, how many drafts lead before the first not `ok` (ok: [M] bool)."""
        pad = torch.zeros(self.batch, max(self.width, 1), dtype=torch.int32, device=ok.device)
        pad[self.seq_of_draft, self.j_of_draft] = ok.to(torch.int32)
        return pad.cumprod(dim=1).sum(dim=1).to(torch.int64)

    def results(self, drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> list[list[int]]:
        d, a, t, off = drafts.tolist(), accepted.tolist(), last.tolist(), self.d_off.tolist()
        return [d[o : o + n] + [x] for o, n, x in zip(off, a, t, strict=True)]


def accept_greedy(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: Sequence[int]
) -> list[list[int]]:
    """target_ids [N] int: the target's argmax at every row; draft_ids [M] int. Per sequence: its
    drafts up to the first that differs from the target's choice, then the target's choice there."""
    lay = _Layout(num_drafts, target_ids.shape[0], draft_ids.shape[0], target_ids.device)
    target_ids = target_ids.to(torch.int64)
    draft_ids = draft_ids.to(device=target_ids.device, dtype=torch.int64)
    ok = target_ids[lay.draft_rows] == draft_ids
    accepted = lay.accepted(ok)
    return lay.results(draft_ids, accepted, target_ids[lay.t_off + accepted])


def _uniforms(
    generators: Sequence[torch.Generator | None], counts: list[int], device: torch.device
) -> torch.Tensor:
    parts = []
    for g, n in zip(generators, counts, strict=True):
        if g is None:
            parts.append(torch.rand(n, dtype=torch.float64))
        else:
            parts.append(torch.rand(n, generator=g, dtype=torch.float64, device=g.device).cpu())
    return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.float64, device=device)


def accept_sampled(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: Sequence[int],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """target_probs [N, V]: the target's distribution at every row, after temperature, top-k, top-p,
    min-p and any mask; draft_ids [M]; draft_probs [M, V] the drafter's distribution each draft was
    drawn from (None: a deterministic drafter). One generator (or None) per sequence."""
    n_rows, vocab = target_probs.shape
    dev = target_probs.device
    lay = _Layout(num_drafts, n_rows, draft_ids.shape[0], dev)
    if len(generators) != lay.batch:
        raise InvalidInput(f"one generator per sequence: {lay.batch} sequences, {len(generators)} generators")
    if draft_probs is not None and tuple(draft_probs.shape) != (draft_ids.shape[0], vocab):
        raise InvalidInput(f"draft_probs must be [{draft_ids.shape[0]}, {vocab}]")
    draft_ids = draft_ids.to(device=dev, dtype=torch.int64)
    if draft_probs is not None:
        draft_probs = draft_probs.to(dev)
    counts = [k + 1 for k in lay.k.tolist()]
    u = _uniforms(generators, counts, dev)
    # sequence i's k_i + 1 uniforms line up with its target rows: one per draft, then the final draw's
    u_accept = u[lay.draft_rows]
    u_final = u[lay.t_off + lay.k]

    p_d = target_probs[lay.draft_rows, draft_ids].double()
    if draft_probs is None:
        ok = u_accept < p_d  # q(d) = 1
    else:
        q_d = draft_probs[torch.arange(draft_ids.shape[0], device=dev), draft_ids].double()
        ok = u_accept * q_d < p_d  # u < p/q, without dividing by a q(d) of 0
    accepted = lay.accepted(ok)
    rejected = accepted < lay.k
    rows = lay.t_off + accepted  # where each sequence's last token is drawn
    # the rejected draft of each sequence (any index where none was rejected; masked by `rejected`)
    at = (lay.d_off + accepted).clamp(max=max(draft_ids.shape[0] - 1, 0))
    target_probs = target_probs.contiguous()
    if draft_probs is None:
        # residual max(0, p - onehot(d)) = p without d: drawn from p's row, skipping d
        skip = torch.where(rejected, draft_ids[at], -1)
        final = _draw(target_probs, rows, u_final, skip)
    else:
        final = torch.empty(lay.batch, dtype=torch.int64, device=dev)
        keep = (~rejected).nonzero().squeeze(1)
        final[keep] = _draw(target_probs, rows[keep], u_final[keep], torch.full_like(keep, -1))
        rej = rejected.nonzero().squeeze(1)
        for lo in range(0, rej.numel(), _ROWS):
            part = rej[lo : lo + _ROWS]
            p = target_probs[rows[part]]
            resid = (p - draft_probs[at[part]].to(p.dtype)).clamp_(min=0.0)
            # p == q leaves no residual, but then no draft is ever rejected: only rounding gets here
            resid = torch.where((resid.sum(dim=1) > 0)[:, None], resid, p)
            final[part] = _draw(
                resid, torch.arange(part.numel(), device=dev), u_final[part], -torch.ones_like(part)
            )
    return lay.results(draft_ids, accepted, final)


def _draw(src: torch.Tensor, which: torch.Tensor, u: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """One draw from each row src[which[r]] (nonnegative, unnormalized), token skip[r] (>= 0) taken
    as 0, by inverse CDF with the uniform u[r]: first the block of _BLOCK tokens (the blocks' sums
    accumulated in float64), then the token in it (its block's cumsum, float64). It reads each row
    once and copies none: a float64 copy and cumsum of whole rows cost ~20x more at a 128k
    vocabulary (B=256, one CPU thread: ~0.9 s against ~40 ms)."""
    n, vocab = which.numel(), src.shape[1]
    dev = src.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    full = vocab // _BLOCK
    nb = full + (vocab % _BLOCK > 0)
    sums = torch.zeros(n, nb, dtype=torch.float64, device=dev)
    if full:
        span = full * _BLOCK
        # row by row, on views: indexing the rows first would copy them. A block sums in fp32 (10x
        # faster than fp64 here; off by ~1e-7 of the block, like the probabilities themselves)
        sums[:, :full] = torch.stack(
            [src[i, :span].view(full, _BLOCK).sum(dim=-1, dtype=torch.float32) for i in which.tolist()]
        )
    if nb > full:
        sums[:, full] = src[which, full * _BLOCK :].sum(dim=-1, dtype=torch.float64)
    ar = torch.arange(n, device=dev)
    has = skip >= 0
    if bool(has.any()):
        adj = sums.clone()
        idx = skip.clamp(min=0)
        adj[ar, idx // _BLOCK] -= torch.where(has, src[which, idx].double(), 0.0)
        adj.clamp_(min=0.0)
        # nothing left without the skipped token: p was one-hot there, so it is never rejected;
        # only rounding gets here, and then p itself is drawn from
        use = has & (adj.sum(dim=1) > 0)
        sums = torch.where(use[:, None], adj, sums)
        skip = torch.where(use, skip, -1)
    cdf = sums.cumsum(dim=1)
    x = u * cdf[:, -1]
    blk = torch.searchsorted(cdf, x[:, None], right=True).squeeze(1)  # the first block with cdf > x
    # rounding past the end: the last block with mass
    blk = torch.minimum(blk, nb - 1 - (sums > 0).flip(dims=[1]).int().argmax(dim=1))
    x = x - torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    cols = blk[:, None] * _BLOCK + torch.arange(_BLOCK, device=dev)
    seg = src.reshape(-1)[which[:, None] * vocab + cols.clamp(max=vocab - 1)].double()
    seg.masked_fill_((cols >= vocab) | (cols == skip[:, None]), 0.0)
    j = torch.searchsorted(seg.cumsum(dim=1), x[:, None], right=True).squeeze(1)
    # the block's sum and its cumsum round differently: past its end, its last token with mass
    j = torch.minimum(j, _BLOCK - 1 - (seg > 0).flip(dims=[1]).int().argmax(dim=1))
    return blk * _BLOCK + j
