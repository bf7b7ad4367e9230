"""Speculative verification in the dense step: the rows of a step that carry drafts (`PlannedSeq.drafts`).

A row with d drafts fed its last token and d drafted tokens at d + 1 positions, so the S-part and the
shards computed the target's distribution at each of them in the one pass: after the last token, and
after each draft. Here the LM head scores those d + 1 positions, the logit processors act on each as
on a plain row sampling its (sample_index + j)-th token, and fastdecode.spec.rejection keeps the
drafts the target agrees with, then adds the target's own token: greedy rows get exactly greedy
decoding's tokens, sampled rows tokens distributed exactly as without drafts (a seeded row draws
from its own generator, so its tokens do not depend on the batch, though they differ from the
tokens the same seed gives without drafts).

A row with a grammar is masked at each position by what the grammar allows there (after the drafts
before it: GrammarBank.draft_masks), so a draft the grammar refuses is never kept. Rows with
penalties over their history are not verified here: the runner refuses drafts on them (their
processors would need each draft in their state).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from fastdecode.contract import PlannedSeq
from fastdecode.dense.emulated import Emitted, EmulatedModel
from fastdecode.dense.layer_loop import Meter
from fastdecode.dense.outcome import Outcome
from fastdecode.dense.sampling import chosen_logprobs, distributions, penalize, row_generator, top_logprobs
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import InvalidInput
from fastdecode.spec.rejection import accept_greedy, accept_sampled


def check_drafts(s: PlannedSeq) -> None:
    """What a row with drafts must be (the rest of its checks are a plain row's)."""
    if s.drafts < 0 or s.drafts >= len(s.token_ids):
        raise InvalidInput(f"drafts must be fewer than the row's {len(s.token_ids)} tokens")
    if not s.drafts:
        return
    if not s.sample or s.steps != 1 or s.next_token is not None or s.use_last_sample:
        raise InvalidInput("a row with drafts samples, in one step, planned with its own tokens")
    sp = s.sampling
    if sp.reads_history or sp.prompt_logprobs:
        raise InvalidInput("drafts are verified only on rows without penalties or prompt logprobs")


def verify(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: Sequence[PlannedSeq],
    eos_ids: Sequence[int],
    allowed: Mapping[str, torch.Tensor] | None = None,
) -> list[Emitted]:
    """hidden: each row's d + 1 last positions, row after row; allowed: a grammar row's [d + 1, V]
    masks by sequence. Per row, its emitted tokens."""
    n_rows = [s.drafts + 1 for s in seqs]
    logits = logits_of(hidden).float()
    params = [s.sampling for s, n in zip(seqs, n_rows, strict=True) for _ in range(n)]
    index = [s.sample_index + j for s, n in zip(seqs, n_rows, strict=True) for j in range(n)]
    processed = penalize(logits, params, index, [None] * len(params), eos_ids)
    masks = [allowed.get(s.seq_id) if allowed else None for s in seqs]
    if any(m is not None for m in masks):
        processed = processed.clone() if processed is logits else processed
        first = 0
        for m, n in zip(masks, n_rows, strict=True):
            if m is not None:
                processed[first : first + n].masked_fill_(~m.to(processed.device), float("-inf"))
            first += n
    drafts = torch.tensor([t for s in seqs for t in s.token_ids[-s.drafts :]], dtype=torch.int64)
    counts = [s.drafts for s in seqs]
    if all(s.sampling.greedy for s in seqs):
        results = accept_greedy(processed.argmax(dim=-1), drafts, counts)
    else:
        gens = [
            None if s.sampling.seed is None else row_generator(s.sampling.seed, s.sample_index, logits.device)
            for s in seqs
        ]
        results = accept_sampled(distributions(processed, params), drafts, counts, gens)
    # each emitted token's logprob (and top alternatives) at the position that chose it
    at, first = [], 0
    for toks, n in zip(results, n_rows, strict=True):
        at += range(first, first + len(toks))
        first += n
    rows = torch.tensor(at, dtype=torch.int64)
    flat = torch.tensor([t for toks in results for t in toks], dtype=torch.int64)
    lps = chosen_logprobs(logits.index_select(0, rows), flat).tolist()
    k = max((s.sampling.top_logprobs for s in seqs), default=0)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(at)
    if k:
        tops = top_logprobs(torch.log_softmax(logits.index_select(0, rows), dim=-1), k)
    out: list[Emitted] = []
    j = 0
    for s, toks in zip(seqs, results, strict=True):
        want = s.sampling.top_logprobs
        out.append([(t, lps[j + i], tops[j + i][:want] if want else ()) for i, t in enumerate(toks)])
        j += len(toks)
    return out


def verify_rows(
    model: DenseModel | EmulatedModel,
    hidden: torch.Tensor,
    ordered: list[PlannedSeq],
    rows: list[int],
    outcomes: dict[str, Outcome],
    meter: Meter,
    allowed: Mapping[str, torch.Tensor] | None = None,
) -> tuple[list[int], list[int]]:
    """The step's sampling `rows` (indices into `ordered`) that carry drafts, verified into their
    outcomes (hidden: each row of `ordered` as its drafts + 1 last positions; allowed: grammar rows'
    masks); returns the other sampling rows and their positions in `hidden`."""
    at, pos = [], 0
    for s in ordered:
        at.append(pos)
        pos += 1 + s.drafts
    spec = [i for i in rows if ordered[i].drafts]
    if spec:
        t0, c0 = time.perf_counter(), time.thread_time()
        idx = torch.tensor(
            [at[i] + j for i in spec for j in range(1 + ordered[i].drafts)], device=hidden.device
        )
        seqs = [ordered[i] for i in spec]
        masked = allowed is not None and any(s.seq_id in allowed for s in seqs)
        if isinstance(model, EmulatedModel) and not masked:  # synthetic: kept at the emulated rates
            emitted = model.verify(seqs)
        else:  # (an emulated step with a grammar row verifies on its synthetic logits, masked)
            eos = model.config.eos_token_ids
            emitted = verify(model.logits, hidden.index_select(0, idx), seqs, eos, allowed)
        for i, toks in zip(spec, emitted, strict=True):
            (tok, lp, top), *rest = toks
            after = [Outcome(t, p, top=tp) for t, p, tp in rest]
            outcomes[ordered[i].seq_id] = Outcome(tok, lp, top=top, after=after)
        meter.busy += time.perf_counter() - t0
        meter.busy_cpu += time.thread_time() - c0
    plain = [i for i in rows if not ordered[i].drafts]
    return plain, [at[i] for i in plain]
