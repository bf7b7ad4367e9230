"""The dense step: S-part layer by layer, attention on the shards, two mini-batches pipelined.

Each mini-batch is a coroutine that loops over layers: post_attention of layer l and
pre_attention of l+1 (one compute call), then one `attend_layer` for all of its shards (one
wake-up when the answers are in). The S-part runs right on the event loop: a hop to a worker
thread and back per layer cost more than it saved (`bench transport --breakdown`), and the
pipeline needs no thread: while mini-batch A waits on the network, the loop runs B's S-part,
and the shards (other processes, other hardware) attend for A. Imports no gRPC: the shards
sit behind the ShardPlane interface (services/gpu_dense/shards.py is the gRPC one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from fastdecode.dense.pipeline import PipelineChooser
from fastdecode.engine import SeqChunk, pack
from fastdecode.errors import InvalidInput
from fastdecode.model import DenseModel
from fastdecode.sampling import sample
from fastdecode.scheduling.types import PlannedSeq

T = TypeVar("T")
log = logging.getLogger("fastdecode.gpu_dense.runner")


@dataclass
class AttendItem:
    """One shard's share of one layer of one mini-batch."""

    shard: int
    seq_ids: list[str]
    num_tokens: list[int]
    start_pos: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class ShardPlane(Protocol):
    """The shards as the dense step sees them. `slot` names the mini-batch: a slot has at most one
    layer in flight, so each (shard, slot) pair can be one ordered stream."""

    num_shards: int

    async def attend_layer(
        self, slot: int, layer: int, items: Sequence[AttendItem]
    ) -> list[torch.Tensor | BaseException]:
        """o for each item, or the error that item met (the others still answer)."""
        ...


@dataclass
class Outcome:
    token_id: int = -1
    logprob: float = 0.0
    error: BaseException | None = None


@dataclass
class Timings:
    s_part_seconds: float = 0.0  # S-part and sampling compute
    shard_wait_seconds: float = 0.0  # step time not covered by S-part work
    step_seconds: float = 0.0
    attend_seconds: float = 0.0  # time mini-batches spent awaiting the shards, summed over them
    pipelined: bool = False  # whether this step ran two mini-batches

    @property
    def overlap_ratio(self) -> float:
        """Share of the shorter half (S-part or attention) hidden behind the other: 0 when they ran one
        after the other (no pipeline), 1 when the step took only as long as the longer half."""
        shorter = min(self.s_part_seconds, self.attend_seconds)
        if shorter <= 0:
            return 0.0
        hidden = self.s_part_seconds + self.attend_seconds - self.step_seconds
        return min(1.0, max(0.0, hidden / shorter))


@dataclass
class _Group:
    """The rows of one shard in a mini-batch; the request fields are built once per step."""

    shard: int
    rows: slice
    seqs: list[PlannedSeq]
    error: BaseException | None = None

    def finish(self) -> None:
        self.seq_ids = [s.seq_id for s in self.seqs]
        self.num_tokens = [len(s.token_ids) for s in self.seqs]
        self.start_pos = [s.start_pos for s in self.seqs]


class StepRunner:
    def __init__(self, model: DenseModel, shards: ShardPlane, chooser: PipelineChooser | None = None) -> None:
        self.model = model
        self.shards = shards
        # None: follow each plan's pipeline flag; else the plan's flag allows, the chooser decides
        self.chooser = chooser
        self._busy = 0.0
        self._attend_wait = 0.0
        self._failures: dict[str, BaseException] = {}
        self._lock = asyncio.Lock()  # one step at a time: timings and failures are per step

    @property
    def num_shards(self) -> int:
        return self.shards.num_shards

    def _compute(self, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self._busy += time.perf_counter() - t0

    def validate(self, s: PlannedSeq) -> None:
        c = self.model.config
        if not s.seq_id:
            raise InvalidInput("empty sequence id")
        if not 0 <= s.shard < self.num_shards:
            raise InvalidInput(f"shard {s.shard} outside [0, {self.num_shards})")
        if s.mini_batch not in (0, 1):
            raise InvalidInput(f"mini_batch must be 0 or 1, got {s.mini_batch}")
        if not s.token_ids:
            raise InvalidInput("no new tokens")
        if min(s.token_ids) < 0 or max(s.token_ids) >= c.vocab_size:
            raise InvalidInput(f"token id outside the vocabulary [0, {c.vocab_size})")
        if s.start_pos < 0 or s.start_pos + len(s.token_ids) > c.max_position_embeddings:
            raise InvalidInput(f"positions outside [0, {c.max_position_embeddings})")
        s.sampling.validate()

    @staticmethod
    def _groups(seqs: list[PlannedSeq]) -> list[_Group]:
        groups: list[_Group] = []
        row = 0
        for s in seqs:
            n = len(s.token_ids)
            if groups and groups[-1].shard == s.shard:
                g = groups[-1]
                g.rows = slice(g.rows.start, row + n)
                g.seqs.append(s)
            else:
                groups.append(_Group(s.shard, slice(row, row + n), [s]))
            row += n
        for g in groups:
            g.finish()
        return groups

    async def _mini_batch(self, slot: int, seqs: list[PlannedSeq]) -> torch.Tensor:
        """All layers for one mini-batch (seqs sorted by shard); returns last-token hidden states."""
        model = self.model
        ids, pos, last = pack([SeqChunk(s.seq_id, s.token_ids, s.start_pos) for s in seqs], model.device)
        groups = self._groups(seqs)
        num_layers = model.config.num_hidden_layers

        def first() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            h = model.embed(ids)
            return (h, *model.pre_attention(0, h, pos))

        hidden, q, k, v = self._compute(first)
        for layer in range(num_layers):
            live = [g for g in groups if g.error is None]
            items = [
                AttendItem(g.shard, g.seq_ids, g.num_tokens, g.start_pos, q[g.rows], k[g.rows], v[g.rows])
                for g in live
            ]
            t_wait = time.perf_counter()
            outs = await self.shards.attend_layer(slot, layer, items) if items else []
            self._attend_wait += time.perf_counter() - t_wait
            parts: list[tuple[slice, torch.Tensor]] = []
            for g, o in zip(live, outs, strict=True):
                if isinstance(o, BaseException):
                    g.error = o
                else:
                    parts.append((g.rows, o))

            def post(
                h: torch.Tensor = hidden, lyr: int = layer, parts: list = parts
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
                if len(parts) == 1 and parts[0][0] == slice(0, h.shape[0]):
                    attn = parts[0][1].to(device=h.device, dtype=h.dtype)  # one shard answered all
                else:
                    attn = torch.zeros(h.shape[0], model.q_size, dtype=h.dtype, device=h.device)
                    for rows, o in parts:
                        attn[rows] = o.to(device=h.device, dtype=h.dtype)
                h = model.post_attention(lyr, h, attn)
                if lyr + 1 == num_layers:
                    return h, None, None, None
                return (h, *model.pre_attention(lyr + 1, h, pos))

            hidden, q, k, v = self._compute(post)  # type: ignore[assignment]
        self._failures.update({s.seq_id: g.error for g in groups if g.error is not None for s in g.seqs})
        return hidden.index_select(0, last)

    async def run(
        self, seqs: Sequence[PlannedSeq], pipeline: bool = True
    ) -> tuple[dict[str, Outcome], Timings]:
        async with self._lock:
            return await self._run(seqs, pipeline)

    async def _run(self, seqs: Sequence[PlannedSeq], pipeline: bool) -> tuple[dict[str, Outcome], Timings]:
        t0 = time.perf_counter()
        self._busy = 0.0
        self._attend_wait = 0.0
        self._failures = {}
        outcomes: dict[str, Outcome] = {}
        valid: list[PlannedSeq] = []
        for s in seqs:
            try:
                if s.seq_id in outcomes:
                    raise InvalidInput(f"sequence {s.seq_id!r} appears twice in one step")
                self.validate(s)
                valid.append(s)
                outcomes[s.seq_id] = Outcome()
            except InvalidInput as e:
                outcomes[s.seq_id] = Outcome(error=e)
        split = [[s for s in valid if s.mini_batch == mb] for mb in (0, 1)]
        piped = pipeline and all(split)  # one empty half: nothing to overlap
        if piped and self.chooser is not None:
            piped = self.chooser.choose()
        batches = split if piped else [valid]
        batches = [sorted(b, key=lambda s: s.shard) for b in batches if b]
        hiddens = await asyncio.gather(*(self._mini_batch(i, b) for i, b in enumerate(batches)))
        ordered = [s for b in batches for s in b]
        rows = [i for i, s in enumerate(ordered) if s.sample and s.seq_id not in self._failures]
        if rows:
            hidden = torch.cat(hiddens) if len(hiddens) > 1 else hiddens[0]
            idx = torch.tensor(rows, device=hidden.device)

            def head() -> tuple[list[int], list[float]]:
                logits = self.model.logits(hidden.index_select(0, idx))
                toks, lps = sample(
                    logits, [ordered[i].sampling for i in rows], [ordered[i].sample_index for i in rows]
                )
                return toks.tolist(), lps.tolist()

            toks, lps = self._compute(head)
            for i, tok, lp in zip(rows, toks, lps, strict=True):
                outcomes[ordered[i].seq_id] = Outcome(tok, lp)
        for sid, err in self._failures.items():
            outcomes[sid] = Outcome(error=err)
        step = time.perf_counter() - t0
        if pipeline and all(split) and self.chooser is not None and valid:
            decided = self.chooser.choice is not None
            # steps with prefill chunks cost far more per sequence: compared apart (pipeline.py)
            self.chooser.record(piped, step / len(valid), all(len(s.token_ids) == 1 for s in valid))
            if not decided and self.chooser.medians is not None and self.chooser.choice is not None:
                on, off = self.chooser.medians
                log.info(
                    "pipeline auto: %s (median ms per sequence: piped %.2f, plain %.2f)",
                    "on" if self.chooser.choice else "off",
                    on * 1e3,
                    off * 1e3,
                )
        return outcomes, Timings(self._busy, max(0.0, step - self._busy), step, self._attend_wait, piped)
