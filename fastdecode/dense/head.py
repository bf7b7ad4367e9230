"""The LM head of a dense step's sampling rows (those without drafts: verify.py verifies those).

One pass over the rows the step samples: their logits, the logit processors (the penalties over each
row's token history, a grammar's mask of the tokens it allows), the sampled token and its logprob,
and the top logprobs the rows that ask for them. The runner (runner.py) times it as the step's own
compute and waits for the device after it. Imports no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdecode.contract import PlannedSeq
from fastdecode.dense.emulated import EmulatedModel
from fastdecode.dense.sampling import penalize, sample, top_logprobs
from fastdecode.model.dense import DenseModel

# Each row's token, its logprob, and the top logprobs of the rows that ask (by their place in rows).
Sampled = tuple[list[int], list[float], dict[int, tuple[tuple[int, float], ...]]]


@dataclass(slots=True)
class HeadRows:
    """The rows a step samples at the head: `rows` index `ordered` (the step's valid rows in the
    order of its hidden states); each sequence's token history (None: its sampling needs none), and
    the tokens a row with a grammar allows."""

    ordered: list[PlannedSeq]
    rows: list[int]
    history: dict[str, list[int] | None]
    allowed: dict[str, torch.Tensor]


def sample_head(
    model: DenseModel | EmulatedModel, hidden: torch.Tensor, idx: torch.Tensor, head: HeadRows
) -> Sampled:
    """The sampled rows' tokens: `idx` holds each row's place in `hidden`."""
    ordered, rows, allowed = head.ordered, head.rows, head.allowed
    logits = model.logits(hidden.index_select(0, idx))
    params = [ordered[i].sampling for i in rows]
    index = [ordered[i].sample_index for i in rows]
    hist = [head.history[ordered[i].seq_id] for i in rows]
    processed = penalize(logits, params, index, hist, model.config.eos_token_ids)
    masked = [j for j, i in enumerate(rows) if ordered[i].seq_id in allowed]
    if masked:
        if processed is logits:
            processed = logits.clone()
        keep = torch.stack([allowed[ordered[rows[j]].seq_id] for j in masked]).to(logits.device)
        sel = torch.tensor(masked, device=logits.device)
        processed[sel] = processed[sel].masked_fill(~keep, float("-inf"))
    toks, lps = sample(logits, params, index, None if processed is logits else processed)
    tops: dict[int, tuple[tuple[int, float], ...]] = {}
    asking = [j for j, p in enumerate(params) if p.top_logprobs]
    if asking:  # only the rows that ask pay for the top-k
        sub = torch.log_softmax(logits[asking].float(), dim=-1)
        k = max(params[j].top_logprobs for j in asking)
        for j, top in zip(asking, top_logprobs(sub, k), strict=True):
            tops[j] = top[: params[j].top_logprobs]
    return toks.tolist(), lps.tolist(), tops
