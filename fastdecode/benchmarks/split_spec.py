"""`bench split --device emulated:NAME`: the split fleet at a GPU's pace, with speculative decoding
(`--speculative ngram|suffix`) against the same fleet without it, in the same run.

The hosts are `bench split`'s (pinned CPU sets, a network namespace per shard host where
permitted); gpu_dense runs on the emulated GPU (fastdecode/dense/emulated.py), so its S-part costs
the profile's roofline and its tokens are synthetic, while the shards hold and attend real KV. No
LocalEngine runs: an emulated GPU has no local twin on this host; the comparison is the fleet with
drafts against the fleet without.

This process plays the scheduler. Each sequence keeps its tokens and a drafter's state (the real
n-gram or suffix proposer, `fastdecode.spec.proposer_for`, over the sequence's synthetic tokens:
its history starts as its first token repeated, so that it drafts from the first step; it is fed
the speculative steps' tokens, and the emulated device's tokens repeat, so it keeps drafting k).
Steps alternate: a plain step (every row one token) and a speculative step (every row its last
token and the drafter's drafts, up to k), each starting where the sequence's kept tokens end, so
that the positions a speculative step wrote past its kept drafts are written over (rolled back) by
the next step. gpu_dense's emulated verification charges each row's d + 1 positions in the roofline,
keeps drafts at the given per-position rates (seeded: the same rows keep the same drafts every run)
and answers 1 to d + 1 tokens. ACCEPTANCE IS EMULATED: the figures hold for the stated rates.

Per mode, medians over the timed steps: decode tokens/s (tokens the step yielded / its wall time),
the step's wall time, the slowest shard's attention busy time, gpu_dense's process CPU, the
emulated GPU's roofline time of the step, and round trips per generated token; for the
speculative mode tau (tokens per verified row), drafts per row and the drafter's time per step
(spec_draft_ms: the scheduler's work, outside the step's wall time here).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdecode.benchmarks.common import median
from fastdecode.benchmarks.split_fleet import Setup, busy_each, fill_owned, owners, start_dense
from fastdecode.benchmarks.transport import process_cpu_seconds
from fastdecode.contract import PlannedSeq
from fastdecode.dense.emulated import EmulatedAcceptance, load_emulated
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import aio_channel
from fastdecode.spec import DraftState, proposer_for
from fastdecode.tools.fleet import ServiceProcess, stop_processes
from fastdecode.v1 import dense_pb2_grpc
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire import dense as dense_wire
from fastdecode.wire.kv import geometry_to_proto

METHODS = ("ngram", "suffix")
HISTORY = 8  # a sequence's synthetic history: its first token this many times
POINT_KEYS = (
    "context",
    "off_tokens_per_s",
    "spec_tokens_per_s",
    "speedup",
    "tau",
    "off_step_ms",
    "spec_step_ms",
    "off_shard_busy_ms",
    "spec_shard_busy_ms",
    "off_round_trips_per_token",
    "spec_round_trips_per_token",
)


def _log(msg: str) -> None:
    print(f"[bench split] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Speculation:
    """What the speculative mode drafts with and what the emulated device keeps."""

    method: str
    k: int
    acceptance: EmulatedAcceptance

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidInput(f"speculative must be one of {METHODS}")
        if not 1 <= self.k <= 16:
            raise InvalidInput("num_speculative_tokens must be in [1, 16]")

    @property
    def dense_args(self) -> list[str]:
        rates = ",".join(f"{r:g}" for r in self.acceptance.rates)
        return ["--dtype", "bfloat16", "--emulated-acceptance", rates]


@dataclass
class _Mode:
    """One mode's timed steps: wall seconds, tokens yielded, rows, drafts carried, slowest shard's
    busy seconds, gpu_dense CPU seconds, round trips, the roofline's device seconds."""

    wall: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    dense_cpu: list[float] = field(default_factory=list)
    trips: list[int] = field(default_factory=list)
    device: list[float] = field(default_factory=list)
    s_part: list[float] = field(default_factory=list)
    shard_wait: list[float] = field(default_factory=list)
    piped: list[bool] = field(default_factory=list)
    draft: list[float] = field(default_factory=list)  # the drafter's time (not in wall)

    def summary(self, prefix: str) -> dict[str, float]:
        rates = [t / w for t, w in zip(self.tokens, self.wall, strict=True)]
        tokens = sum(self.tokens)
        return {
            f"{prefix}_tokens_per_s": median(rates),
            f"{prefix}_tokens_per_s_mean": tokens / sum(self.wall),
            f"{prefix}_step_ms": median(self.wall) * 1e3,
            f"{prefix}_tokens_per_step": tokens / len(self.tokens),
            f"{prefix}_shard_busy_ms": median(self.busy) * 1e3,
            f"{prefix}_dense_cpu_ms": median(self.dense_cpu) * 1e3,
            # a mean: with --pipeline auto a mode's steps may run piped and plain (two roofline values)
            f"{prefix}_gpu_step_ms": sum(self.device) / len(self.device) * 1e3,
            f"{prefix}_s_part_ms": median(self.s_part) * 1e3,
            f"{prefix}_shard_wait_ms": median(self.shard_wait) * 1e3,
            f"{prefix}_round_trips_per_token": sum(self.trips) / tokens,
            f"{prefix}_pipelined_share": sum(self.piped) / len(self.piped),
            f"{prefix}_draft_ms": median(self.draft) * 1e3,
        }


def row_tokens(result: Any, ids: list[str], what: str) -> list[list[int]]:
    """Each of `ids`' tokens in a StepResult (1 to d + 1 per row); a failed step raises."""
    dense_wire.step_tokens(result, ids, what)  # raises a failed step's or row's error
    counts = list(result.token_counts) or [1] * len(result.seq_ids)
    flat, at, by_id = list(result.token_ids), 0, {}
    for sid, c in zip(result.seq_ids, counts, strict=True):
        by_id[sid] = flat[at : at + c]
        at += c
    return [by_id[s] for s in ids]


def device_seconds(roof: Any, rows: list[int], piped: bool) -> float:
    """The roofline's time of a step whose sequences feed `rows` positions each (two mini-batches
    when piped: rows alternate between them, as planned)."""
    halves = [sum(rows[0::2]), sum(rows[1::2])] if piped else [sum(rows)]
    layers = roof.geometry.num_layers
    return sum(layers * roof.layer_seconds(t) for t in halves if t) + roof.head_seconds(sum(rows))


async def spec_point(
    s: Setup,
    spec: Speculation,
    context: int,
    shards: list[ServiceProcess],
    max_tokens: int,
    timed_steps: int,
    warmup: int,
) -> dict[str, Any]:
    """One context: fill the shards, start gpu_dense on the emulated device, alternate plain and
    speculative steps (warm-up, then `timed_steps` of each), and summarise both modes."""
    cfg, batch = s.cfg, s.batch
    ids = [f"spec-{context}-{i}" for i in range(batch)]
    owner = owners(batch, len(shards), 0)
    channels = [aio_channel(p.address) for p in shards]
    stubs = [kv_grpc.KVAttentionStub(ch) for ch in channels]
    geometry = geometry_to_proto(KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim))
    roof = load_emulated(s.model, s.device, torch.bfloat16).roofline
    proposer = proposer_for(spec.method, spec.k)
    assert proposer is not None
    dense: ServiceProcess | None = None
    dense_ch = None
    try:
        t0 = time.perf_counter()
        await fill_owned(stubs, ids, owner, geometry, max_tokens, context, s.seed)
        _log(f"context {context}: KV written in {time.perf_counter() - t0:.1f} s")
        dense = await asyncio.to_thread(start_dense, s, shards, None, 0, spec.dense_args)
        dense_ch = aio_channel(dense.address)
        call = dense_pb2_grpc.DenseStub(dense_ch).Run(timeout=7200)
        gen = torch.Generator().manual_seed(s.seed + context)
        first = torch.randint(3, cfg.vocab_size, (batch,), generator=gen).tolist()
        pos = [context] * batch
        # each mode feeds its own synthetic tokens (an emulated device's q, k, v do not depend on
        # them); the drafter sees the speculative steps' tokens only
        last = {"off": list(first), "spec": list(first)}
        states: list[DraftState] = [proposer.start([t] * HISTORY) for t in first]
        piped_plan = s.pipeline != "off"
        modes = {"off": _Mode(), "spec": _Mode()}
        step_no = 0

        async def step(mode: str, timed: bool) -> None:
            nonlocal step_no
            drafts = [[] for _ in ids]
            t_draft = time.perf_counter()
            if mode == "spec":  # the drafter's work is the scheduler's: on this process, timed apart
                drafts = [
                    st.propose(max(0, min(spec.k, max_tokens - p - 2)))
                    for st, p in zip(states, pos, strict=True)
                ]
            t_draft = time.perf_counter() - t_draft
            seqs = [
                PlannedSeq(
                    sid,
                    owner[i],
                    i % 2 if piped_plan else 0,
                    [last[mode][i], *drafts[i]],
                    pos[i],
                    sample_index=step_no,
                    drafts=len(drafts[i]),
                )
                for i, sid in enumerate(ids)
            ]
            plan = dense_wire.plan_to_proto(step_no, seqs, piped_plan)
            busy0 = await busy_each(stubs) if timed else []
            c0 = process_cpu_seconds(dense.pid)
            t = time.perf_counter()
            await call.write(plan)
            res = await call.read()
            dt = time.perf_counter() - t
            cpu = process_cpu_seconds(dense.pid) - c0
            out = row_tokens(res, ids, f"context {context}, step {step_no}")
            step_no += 1
            for i, toks in enumerate(out):
                if not 1 <= len(toks) <= len(drafts[i]) + 1:
                    raise RuntimeError(f"{ids[i]}: {len(toks)} tokens for {len(drafts[i])} drafts")
                pos[i] += len(toks)  # the kept drafts stay in its KV; the rest is written over next
                last[mode][i] = toks[-1]
                if mode == "spec":
                    states[i].append(toks)
            if not timed:
                return
            busy1 = await busy_each(stubs)
            m = modes[mode]
            m.wall.append(dt)
            m.tokens.append(sum(len(x) for x in out))
            m.rows.append(batch)
            m.drafts.append(sum(len(d) for d in drafts))
            m.busy.append(max(b - a for a, b in zip(busy0, busy1, strict=True)))
            m.dense_cpu.append(cpu)
            piped = res.timings.pipelined
            m.piped.append(piped)
            m.trips.append(cfg.num_hidden_layers * len(shards) * (2 if piped else 1))
            m.device.append(device_seconds(roof, [len(d) + 1 for d in drafts], piped))
            m.s_part.append(res.timings.s_part_seconds)
            m.shard_wait.append(res.timings.shard_wait_seconds)
            m.draft.append(t_draft)

        for _ in range(warmup):
            await step("off", False)
            await step("spec", False)
        for k in range(timed_steps):  # alternate which goes first: both see the same noise
            for mode in ("off", "spec") if k % 2 == 0 else ("spec", "off"):
                await step(mode, True)
        await call.done_writing()
    finally:
        if dense_ch is not None:
            await dense_ch.close()
        for ch in channels:
            await ch.close()
        if dense is not None:
            await asyncio.to_thread(stop_processes, [dense], 10.0)
    off, sp = modes["off"], modes["spec"]
    point: dict[str, Any] = {"context": context, **off.summary("off"), **sp.summary("spec")}
    rows, drafts = sum(sp.rows), sum(sp.drafts)
    point.update(
        speedup=point["spec_tokens_per_s"] / point["off_tokens_per_s"],
        speedup_mean=point["spec_tokens_per_s_mean"] / point["off_tokens_per_s_mean"],
        tau=sum(sp.tokens) / rows,
        drafts_per_row=drafts / rows,
        drafts_kept=(sum(sp.tokens) - rows) / drafts if drafts else 0.0,
        expected_tau=spec.acceptance.expected_tau(spec.k),
        round_trips_per_token_ratio=point["spec_round_trips_per_token"] / point["off_round_trips_per_token"],
        step_ratio=point["spec_step_ms"] / point["off_step_ms"],
        shard_busy_ratio=point["spec_shard_busy_ms"] / point["off_shard_busy_ms"],
    )
    return point


async def run_spec_points(
    s: Setup, spec: Speculation, contexts: list[int], shards: list[ServiceProcess], extra: int, warmup: int
) -> list[dict[str, Any]]:
    points = []
    for context in contexts:
        p = await spec_point(s, spec, context, shards, context + extra, s.steps, warmup)
        _log(
            f"context {context}: off {p['off_tokens_per_s']:.0f} tok/s, {spec.method} "
            f"{p['spec_tokens_per_s']:.0f} tok/s, {p['speedup']:.2f}x (tau {p['tau']:.2f}, "
            f"acceptance emulated)"
        )
        points.append(p)
    return points


def extra_positions(steps: int, warmup: int, k: int) -> int:
    """Positions past the context a sequence may reach: every step of both modes at most k + 1."""
    return (steps + warmup) * (k + 2) + k + 4
