"""LocalEngine: the S-part and R-part composed in one process.

It is the reference the fleet must equal token for token, and the baseline the fleet
is measured against. Imports no gRPC.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastdecode.contract import SamplingParams
from fastdecode.dense.engine_spec import Drafter, SpecStats, verify_step
from fastdecode.dense.sampling import sample
from fastdecode.kv import AttendBatch, KVStore
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import KVGeometry, host_available_bytes
from fastdecode.spec import Proposer

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SeqChunk:
    """New tokens of one sequence in a step, at positions start_pos..start_pos+len-1."""

    seq_id: str
    token_ids: list[int]
    start_pos: int


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def pack(chunks: Sequence[SeqChunk], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [T], positions [T], index of each chunk's last token [N]) for a packed batch."""
    ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
    pos = torch.tensor(
        [p for c in chunks for p in range(c.start_pos, c.start_pos + len(c.token_ids))], dtype=torch.int64
    )
    last = torch.tensor(list(itertools.accumulate(len(c.token_ids) for c in chunks)), dtype=torch.int64) - 1
    return ids.to(device), pos.to(device), last.to(device)


class WindowedAttention:
    """Attention with per-layer sliding windows and a logit soft-cap, in torch, for LocalEngine.

    The shards' store attends every cached token without a cap; until it applies a model's
    `layer_windows` and `attn_logit_softcap` itself, LocalEngine (`fastdecode run`, the reference)
    attends here for models that have either, so its tokens equal transformers'. It keeps each
    sequence's K/V per layer in fp32, in the order of transformers' eager attention: scores
    (q . k) * head_dim**-0.5, soft-cap, window and causal mask, fp32 softmax. A write at `start`
    keeps only the keys before it: positions past it (rejected drafts) are rolled back.
    """

    def __init__(self, windows: Sequence[int], softcap: float, num_layers: int) -> None:
        self.windows = list(windows) or [0] * num_layers
        self.softcap = softcap
        self.num_layers = num_layers
        self.seqs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def release(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)

    def attend(
        self,
        layer: int,
        seq_ids: Sequence[str],
        counts: Sequence[int],
        starts: Sequence[int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        total, heads, dim = q.shape
        group = heads // k.shape[1]
        window = self.windows[layer]
        out = torch.empty(total, heads * dim, dtype=q.dtype)
        row = 0
        for sid, n, start in zip(seq_ids, counts, starts, strict=True):
            layers = self.seqs.setdefault(sid, [(torch.empty(0), torch.empty(0))] * self.num_layers)
            old_k, old_v = layers[layer]
            keys = torch.cat((old_k[:start], k[row : row + n].float())) if start else k[row : row + n].float()
            values = (
                torch.cat((old_v[:start], v[row : row + n].float())) if start else v[row : row + n].float()
            )
            layers[layer] = (keys, values)
            qs = q[row : row + n].float().transpose(0, 1)  # [H, n, D]
            kh = keys.transpose(0, 1).repeat_interleave(group, 0)  # [H, end, D]
            vh = values.transpose(0, 1).repeat_interleave(group, 0)
            scores = qs @ kh.transpose(1, 2) * dim**-0.5
            if self.softcap:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            qpos = torch.arange(start, start + n)[:, None]
            kpos = torch.arange(start + n)[None, :]
            allowed = kpos <= qpos
            if window:
                allowed &= kpos > qpos - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ vh  # [H, n, D]
            out[row : row + n] = o.transpose(0, 1).reshape(n, heads * dim).to(q.dtype)
            row += n
        return out


def run_layers(
    model: DenseModel, hidden: torch.Tensor, positions: torch.Tensor, attend: AttendFn
) -> torch.Tensor:
    """All decoder layers on a packed batch, with the R-part behind `attend(layer, q, k, v)`."""
    for layer in range(model.config.num_hidden_layers):
        q, k, v = model.pre_attention(layer, hidden, positions)
        hidden = model.post_attention(layer, hidden, attend(layer, q, k, v))
    return hidden


class LocalEngine:
    def __init__(
        self, model: DenseModel, kv_capacity_bytes: int | None = None, kv_dtype: torch.dtype = torch.float32
    ) -> None:
        self.model = model
        c = model.config
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        if kv_capacity_bytes is None:  # room for 64 full-context sequences, within half the host's memory
            kv_capacity_bytes = min(
                64 * c.max_position_embeddings * c.kv_bytes_per_token(itemsize), host_available_bytes() // 2
            )
        # The store, of full layers, still reserves and accounts; a model with windows or a soft-cap
        # attends here.
        full = KVGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        self.kv = KVStore(full, kv_capacity_bytes, kv_dtype)
        self.windowed = (
            WindowedAttention(c.layer_windows, c.attn_logit_softcap, c.num_hidden_layers)
            if any(c.layer_windows) or c.attn_logit_softcap
            else None
        )
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_capacity_bytes: int | None = None,
        kv_dtype: torch.dtype = torch.float32,
    ) -> LocalEngine:
        return cls(DenseModel.from_pretrained(path, device, dtype), kv_capacity_bytes, kv_dtype)

    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """One step over a packed batch; fp32 logits of each chunk's last token [N, vocab]."""
        return self.model.logits(self.hidden(chunks))

    def hidden(self, chunks: Sequence[SeqChunk], every: bool = False) -> torch.Tensor:
        """Every layer of one step over a packed batch: each chunk's last token's hidden state [N, H],
        or every token's [T, H] with `every` (verifying drafts needs each position's)."""
        ids, pos, last = pack(chunks, self.model.device)
        seq_ids = [c.seq_id for c in chunks]
        counts = [len(c.token_ids) for c in chunks]
        starts = [c.start_pos for c in chunks]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.windowed is not None:
                o = self.windowed.attend(layer, seq_ids, counts, starts, q.cpu(), k.cpu(), v.cpu())
                return o.to(self.model.device)
            o = self.kv.attend(layer, AttendBatch(seq_ids, counts, starts, q.cpu(), k.cpu(), v.cpu()))
            return o.to(self.model.device)

        hidden = run_layers(self.model, self.model.embed(ids), pos, attend)
        return hidden if every else hidden.index_select(0, last)

    def _validate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        c = self.model.config
        if max_tokens < 1:
            raise InvalidInput("max_tokens must be >= 1")
        for p in prompts:
            if not p:
                raise InvalidInput("empty prompt")
            if len(p) + max_tokens > c.max_position_embeddings:
                raise InvalidInput(
                    f"prompt ({len(p)}) + max_tokens ({max_tokens}) exceeds the context "
                    f"{c.max_position_embeddings}"
                )
            if min(p) < 0 or max(p) >= c.vocab_size:
                raise InvalidInput(f"token id outside the vocabulary [0, {c.vocab_size})")

    def generate_stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 16,
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        prefill_chunk: int | None = None,
        proposer: Proposer | None = None,
        stats: SpecStats | None = None,
    ) -> Iterator[list[tuple[int, int, float, str | None]]]:
        """Continuous decode of a batch; yields per step [(prompt index, token, logprob, finish)].

        With a `proposer` (fastdecode.spec.proposer_for) decode rows carry drafts, verified in the
        same step (engine_spec.py): a step may yield several tokens of a sequence, in order, and
        greedy tokens equal those without it. `stats` counts the verification."""
        self._validate(prompts, max_tokens)
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        for p in plist:
            p.validate()
        stops = set(stop_token_ids) | (set() if ignore_eos else set(self.model.config.eos_token_ids))
        sids = [f"local-{next(self._ids)}" for _ in prompts]
        for sid, p in zip(sids, prompts, strict=True):
            self.kv.reserve(sid, len(p) + max_tokens)
        drafter = Drafter(proposer, prompts, plist, max_tokens) if proposer is not None else None
        # prefill in chunks of prefill_chunk tokens per sequence when asked
        run = _Decode(prompts, sids, prefill_chunk or max(len(p) for p in prompts), drafter)
        try:
            while True:
                chunks, owners, sampled, drafts = run.plan()
                if not chunks:
                    return
                rows = [j for j, s in enumerate(sampled) if s]
                if not rows:
                    self.hidden(chunks)
                    continue
                row_params = [plist[i] for i in owners]
                row_index = [len(run.gen[i]) for i in owners]
                if any(drafts):
                    hidden = self.hidden(chunks, every=True)
                    out = verify_step(self.model, hidden, chunks, rows, drafts, row_params, row_index, stats)
                else:
                    logits = self.forward(chunks)[rows]
                    toks, lps = sample(logits, [row_params[j] for j in rows], [row_index[j] for j in rows])
                    out = [[(t, lp)] for t, lp in zip(toks.tolist(), lps.tolist(), strict=True)]
                yield run.apply([owners[j] for j in rows], out, stops, max_tokens, self.release)
        finally:
            for sid in sids:
                self.release(sid)
            if drafter is not None:
                drafter.close()

    def release(self, seq_id: str) -> None:
        self.kv.release(seq_id)
        if self.windowed is not None:
            self.windowed.release(seq_id)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 16,
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        prefill_chunk: int | None = None,
        proposer: Proposer | None = None,
        stats: SpecStats | None = None,
    ) -> list[Generation]:
        out = [Generation() for _ in prompts]
        for events in self.generate_stream(
            prompts, max_tokens, params, stop_token_ids, ignore_eos, prefill_chunk, proposer, stats
        ):
            for i, tok, lp, finish in events:
                out[i].token_ids.append(tok)
                out[i].logprobs.append(lp)
                out[i].finish_reason = finish
        return out


class _Decode:
    """generate_stream's sequences between steps: prompt positions prefilled, tokens generated, the
    ones still running."""

    def __init__(
        self, prompts: Sequence[Sequence[int]], sids: list[str], chunk: int, drafter: Drafter | None
    ) -> None:
        self.prompts, self.sids, self.chunk, self.drafter = prompts, sids, chunk, drafter
        self.gen: list[list[int]] = [[] for _ in prompts]
        self.prefilled = [0] * len(prompts)
        self.live = list(range(len(prompts)))

    def plan(self) -> tuple[list[SeqChunk], list[int], list[bool], list[int]]:
        """The step's chunks: a prompt's next chunk, or a decode row (its last token and its drafts);
        with each one's prompt index, whether it samples, and its drafts."""
        chunks, owners, sampled, drafts = [], [], [], []
        for i in self.live:
            p, done = self.prompts[i], self.prefilled[i]
            owners.append(i)
            if done < len(p):
                n = min(self.chunk, len(p) - done)
                chunks.append(SeqChunk(self.sids[i], list(p[done : done + n]), done))
                self.prefilled[i] += n
                sampled.append(self.prefilled[i] == len(p))
                drafts.append(0)
            else:
                d = self.drafter.propose(i, len(self.gen[i])) if self.drafter is not None else []
                chunks.append(SeqChunk(self.sids[i], [self.gen[i][-1], *d], len(p) + len(self.gen[i]) - 1))
                sampled.append(True)
                drafts.append(len(d))
        return chunks, owners, sampled, drafts

    def apply(
        self,
        owners: list[int],
        out: list[list[tuple[int, float]]],
        stops: set[int],
        max_tokens: int,
        release: Callable[[str], None],
    ) -> list[tuple[int, int, float, str | None]]:
        """Each sampled row's tokens, in order, up to a stop token or max_tokens (a finished
        sequence leaves and its KV goes); the step's events."""
        events: list[tuple[int, int, float, str | None]] = []
        for i, emitted in zip(owners, out, strict=True):
            kept = []
            for tok, lp in emitted:
                self.gen[i].append(tok)
                kept.append(tok)
                finish = "stop" if tok in stops else "length" if len(self.gen[i]) >= max_tokens else None
                events.append((i, tok, lp, finish))
                if finish:
                    self.live.remove(i)
                    release(self.sids[i])
                    break
            if self.drafter is not None:
                self.drafter.append(i, kept)
        return events
