"""`bench split --speculative ngram|suffix`: the split fleet with speculative decoding, fixed k and
the planner's k, against the same fleet without drafts, in the same run.

The hosts are `bench split`'s (pinned CPU sets, a network namespace per shard host where
permitted). No LocalEngine runs: the comparison is the fleet with drafts against the fleet without.
On an emulated GPU (`--device emulated:NAME`) gpu_dense's S-part costs the profile's roofline and
its tokens are synthetic, while the shards hold and attend real KV; on `--device cpu` (or cuda)
gpu_dense runs the real model.

This process plays the scheduler, in three modes whose steps alternate (each mode's turn rotating
first, so that all see the same machine noise): "off" (every row one token), "spec" (every row its
last token and up to k drafts) and "auto" (up to the k of a `KController`, the scheduler's
--speculative-k auto: fastdecode/spec/controller.py, fed after every auto step, warm-up included,
the step's StepCost from gpu_dense's timings and the auto drafter's counts per draft position; its
first decision after FIRST_DECISION steps, then every DECIDE_EVERY). Each mode drafts with its own
drafter (the real n-gram or suffix proposer, `fastdecode.spec.proposer_for`) over its own tokens,
each step starting where the sequence's kept tokens end, so that the positions a step wrote past its
kept drafts are written over (rolled back) by the next one.

ACCEPTANCE IS EMULATED on an emulated GPU: the modes share the sequences (an emulated device's q, k,
v do not depend on the tokens), each sequence's drafter history starts as its first token repeated
(so it drafts from the first step), and gpu_dense's emulated verification charges each row's d + 1
positions in the roofline, keeps drafts at the given per-position rates (seeded) and answers 1 to
d + 1 tokens that repeat, so the drafter keeps drafting. The figures hold for the stated rates.

ACCEPTANCE IS REAL on a CPU (or cuda) dense host: gpu_dense runs the model and verifies greedily, so
each mode decodes its own copy of the sequences (the KV must hold that mode's tokens): the same
synthetic context and first token, hence the same greedy text in every mode; the drafters start
from the first token alone and draft only what the model's own text repeats. No roofline.

Per mode, medians over the timed steps: decode tokens/s (tokens the step yielded / its wall time),
the step's wall time, the slowest shard's attention busy time, gpu_dense's process CPU, the
emulated GPU's roofline time of the step (emulated only), and round trips per generated token; for
the drafting modes tau (tokens per verified row), drafts per row, the share of drafts kept and the
drafter's time per step (draft_ms: the scheduler's work, outside the step's wall time here); for
auto, the k it settled on (the last, and per timed step).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
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
from fastdecode.spec.controller import Counts, KController, StepCost, at_least
from fastdecode.tools.fleet import ServiceProcess, stop_processes
from fastdecode.v1 import dense_pb2_grpc
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire import dense as dense_wire
from fastdecode.wire.kv_control import geometry_to_proto

METHODS = ("ngram", "suffix")
MODES = ("off", "spec", "auto")
HISTORY = 8  # an emulated sequence's synthetic history: its first token this many times
# Auto steps before the controller's first decision: a run of tens of steps sees it decide (the
# scheduler's own waits DECIDE_EVERY); its priors weigh the acceptance until rows outweigh them.
POINT_KEYS = (
    "context",
    "off_tokens_per_s",
    "spec_tokens_per_s",
    "auto_tokens_per_s",
    "spec_speedup",
    "auto_speedup",
    "auto_k",
    "tau",
    "auto_tau",
    "off_step_ms",
    "spec_step_ms",
    "auto_step_ms",
    "off_shard_busy_ms",
    "spec_shard_busy_ms",
    "off_round_trips_per_token",
    "spec_round_trips_per_token",
)


def _log(msg: str) -> None:
    print(f"[bench split] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Speculation:
    """What the drafting modes draft with, and what an emulated device keeps (None: the real model
    verifies, on a cpu or cuda dense host)."""

    method: str
    k: int
    acceptance: EmulatedAcceptance | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidInput(f"speculative must be one of {METHODS}")
        if not 1 <= self.k <= 16:
            raise InvalidInput("num_speculative_tokens must be in [1, 16]")

    @property
    def emulated(self) -> bool:
        return self.acceptance is not None

    @property
    def dense_args(self) -> list[str]:
        if self.acceptance is None:
            return []
        rates = ",".join(f"{r:g}" for r in self.acceptance.rates)
        return ["--dtype", "bfloat16", "--emulated-acceptance", rates]

    @property
    def kv_sets(self) -> int:
        """Copies of the batch's sequences the shards hold: one the modes share on an emulated
        device; one a mode with the real model, whose KV must hold that mode's own tokens."""
        return 1 if self.emulated else len(MODES)


@dataclass
class _Mode:
    """One mode: its timed steps (wall seconds, tokens yielded, rows, drafts carried, slowest
    shard's busy seconds, gpu_dense CPU seconds, round trips, the roofline's device seconds), and
    its drafter's counts over every step, warm-up included (what the auto mode's controller reads)."""

    k: int  # the most drafts a row may carry in this mode (0: off)
    wall: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    dense_cpu: list[float] = field(default_factory=list)
    trips: list[int] = field(default_factory=list)
    device: list[float] = field(default_factory=list)  # emulated only
    s_part: list[float] = field(default_factory=list)
    shard_wait: list[float] = field(default_factory=list)
    piped: list[bool] = field(default_factory=list)
    draft: list[float] = field(default_factory=list)  # the drafter's time (not in wall)
    ks: list[int] = field(default_factory=list)  # auto: the controller's k at each timed step
    probes: int = 0  # auto: timed steps of a probe (offered K at k = 0)
    # rows asked for drafts by the most offered, and by how many were found (histograms over 0..K,
    # as the scheduler's Drafting keeps them); per draft position j, rows that offered a (j + 1)-th
    # draft and those that kept it
    asked: list[int] = field(init=False)
    found: list[int] = field(init=False)
    offered_at: list[int] = field(init=False)
    kept_at: list[int] = field(init=False)
    timed_at: list[tuple[int, int]] = field(init=False)  # (offered, kept) per position, timed steps

    def __post_init__(self) -> None:
        self.asked, self.found = [0] * (self.k + 1), [0] * (self.k + 1)
        self.offered_at, self.kept_at = [0] * self.k, [0] * self.k
        self.timed_at = [(0, 0)] * self.k

    def counts(self) -> Counts:
        return Counts(at_least(self.asked), at_least(self.found), self.offered_at[:], self.kept_at[:])

    def summary(self, prefix: str) -> dict[str, float]:
        rates = [t / w for t, w in zip(self.tokens, self.wall, strict=True)]
        tokens = sum(self.tokens)
        out = {
            f"{prefix}_tokens_per_s": median(rates),
            f"{prefix}_tokens_per_s_mean": tokens / sum(self.wall),
            f"{prefix}_step_ms": median(self.wall) * 1e3,
            f"{prefix}_tokens_per_step": tokens / len(self.tokens),
            f"{prefix}_shard_busy_ms": median(self.busy) * 1e3,
            f"{prefix}_dense_cpu_ms": median(self.dense_cpu) * 1e3,
            f"{prefix}_s_part_ms": median(self.s_part) * 1e3,
            f"{prefix}_shard_wait_ms": median(self.shard_wait) * 1e3,
            f"{prefix}_round_trips_per_token": sum(self.trips) / tokens,
            f"{prefix}_pipelined_share": sum(self.piped) / len(self.piped),
            f"{prefix}_draft_ms": median(self.draft) * 1e3,
        }
        if self.device:  # a mean: with --pipeline auto a mode's steps may run piped and plain
            out[f"{prefix}_gpu_step_ms"] = sum(self.device) / len(self.device) * 1e3
        return out

    def drafting(self, prefix: str) -> dict[str, Any]:
        """Over the timed steps: tau (tokens a verified row yielded), drafts a row carried, the share
        kept, and per draft position j the share of rows offering a (j + 1)-th draft that kept it."""
        rows, drafts, tokens = sum(self.rows), sum(self.drafts), sum(self.tokens)
        return {
            f"{prefix}tau": tokens / rows,
            f"{prefix}drafts_per_row": drafts / rows,
            f"{prefix}drafts_kept": (tokens - rows) / drafts if drafts else 0.0,
            f"{prefix}kept_at": [k / o if o else 0.0 for o, k in self.timed_at],
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


def _seq_ids(context: int, mode: str, batch: int) -> list[str]:
    """A mode's sequences ("": the ones the modes share, named as before the auto mode)."""
    return [f"spec-{context}-{mode}-{i}" if mode else f"spec-{context}-{i}" for i in range(batch)]


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
    """One context: fill the shards, start gpu_dense, alternate the off, spec and auto modes' steps
    (warm-up, then `timed_steps` of each), and summarise the three."""
    cfg, batch = s.cfg, s.batch
    owner = owners(batch, len(shards), 0)
    # one set of sequences the modes share (emulated), or one a mode (the real model)
    ids = {m: _seq_ids(context, m if spec.kv_sets > 1 else "", batch) for m in MODES}
    every = sorted({x for m in MODES for x in ids[m]})
    owner_of = {x: owner[i] for m in MODES for i, x in enumerate(ids[m])}
    channels = [aio_channel(p.address) for p in shards]
    stubs = [kv_grpc.KVAttentionStub(ch) for ch in channels]
    geometry = geometry_to_proto(KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim))
    roof = load_emulated(s.model, s.device, torch.bfloat16).roofline if spec.emulated else None
    control = KController(spec.k)
    dense: ServiceProcess | None = None
    dense_ch = None
    try:
        t0 = time.perf_counter()
        await fill_owned(stubs, every, [owner_of[x] for x in every], geometry, max_tokens, context, s.seed)
        _log(f"context {context}: KV written in {time.perf_counter() - t0:.1f} s")
        dense = await asyncio.to_thread(start_dense, s, shards, None, 0, spec.dense_args)
        dense_ch = aio_channel(dense.address)
        call = dense_pb2_grpc.DenseStub(dense_ch).Run(timeout=7200)
        gen = torch.Generator().manual_seed(s.seed + context)
        first = torch.randint(3, cfg.vocab_size, (batch,), generator=gen).tolist()
        shared = [context] * batch
        pos = {m: shared if spec.kv_sets == 1 else [context] * batch for m in MODES}
        # each mode feeds its own tokens and drafts from them (an emulated device's q, k, v do not
        # depend on them; the real model's KV, one copy a mode, holds them)
        last = {m: list(first) for m in MODES}
        history = HISTORY if spec.emulated else 1
        states: dict[str, list[DraftState]] = {}
        for m in ("spec", "auto"):
            proposer = proposer_for(spec.method, spec.k)
            assert proposer is not None
            states[m] = [proposer.start([t] * history) for t in first]
        piped_plan = s.pipeline != "off"
        modes = {m: _Mode(0 if m == "off" else spec.k) for m in MODES}
        step_no = 0

        async def step(mode: str, timed: bool) -> None:
            nonlocal step_no
            m, at, sids = modes[mode], pos[mode], ids[mode]
            cap = control.cap if mode == "auto" else m.k
            rooms = [max_tokens - p - 2 for p in at]  # drafts never pass the reserved positions
            asks = [max(0, min(cap, room)) for room in rooms]
            drafts: list[list[int]] = [[] for _ in sids]
            t_draft = time.perf_counter()
            if m.k:  # the drafter's work is the scheduler's: on this process, timed apart
                drafts = [st.propose(k) if k else [] for st, k in zip(states[mode], asks, strict=True)]
            t_draft = time.perf_counter() - t_draft
            for k, d in zip(asks, drafts, strict=True):
                if m.k and k:
                    m.asked[k] += 1
                    m.found[len(d)] += 1
            seqs = [
                PlannedSeq(
                    sid,
                    owner[i],
                    i % 2 if piped_plan else 0,
                    [last[mode][i], *drafts[i]],
                    at[i],
                    sample_index=step_no,
                    drafts=len(drafts[i]),
                )
                for i, sid in enumerate(sids)
            ]
            plan = dense_wire.plan_to_proto(step_no, seqs, piped_plan)
            busy0 = await busy_each(stubs) if timed else []
            c0 = process_cpu_seconds(dense.pid)
            t = time.perf_counter()
            await call.write(plan)
            res = await call.read()
            dt = time.perf_counter() - t
            cpu = process_cpu_seconds(dense.pid) - c0
            out = row_tokens(res, sids, f"context {context}, step {step_no}")
            step_no += 1
            for i, toks in enumerate(out):
                if not 1 <= len(toks) <= len(drafts[i]) + 1:
                    raise RuntimeError(f"{sids[i]}: {len(toks)} tokens for {len(drafts[i])} drafts")
                at[i] += len(toks)  # the kept drafts stay in its KV; the rest is written over next
                last[mode][i] = toks[-1]
                if m.k:
                    states[mode][i].append(toks)
                    for j in range(len(drafts[i])):
                        kept = j < len(toks) - 1  # a row keeps its j-th draft with every one before
                        m.offered_at[j] += 1
                        m.kept_at[j] += kept
                        if timed:
                            m.timed_at[j] = (m.timed_at[j][0] + 1, m.timed_at[j][1] + kept)
            n_drafts = sum(len(d) for d in drafts)
            if mode == "auto":  # the step as the scheduler would weigh it (its wall: the dense run)
                if timed:
                    m.ks.append(control.k)
                    m.probes += cap != control.k
                rows = sum(room > 0 for room in rooms)
                cost = StepCost.of(batch + n_drafts, rows, n_drafts, res.timings, dt)
                control.observe(cost, m.counts())
            if not timed:
                return
            busy1 = await busy_each(stubs)
            m.wall.append(dt)
            m.tokens.append(sum(len(x) for x in out))
            m.rows.append(batch)
            m.drafts.append(n_drafts)
            m.busy.append(max(b - a for a, b in zip(busy0, busy1, strict=True)))
            m.dense_cpu.append(cpu)
            piped = res.timings.pipelined
            m.piped.append(piped)
            m.trips.append(cfg.num_hidden_layers * len(shards) * (2 if piped else 1))
            if roof is not None:
                m.device.append(device_seconds(roof, [len(d) + 1 for d in drafts], piped))
            m.s_part.append(res.timings.s_part_seconds)
            m.shard_wait.append(res.timings.shard_wait_seconds)
            m.draft.append(t_draft)

        for _ in range(warmup):
            for mode in MODES:
                await step(mode, False)
        for k in range(timed_steps):  # rotate which goes first: all see the same noise
            for mode in MODES[k % 3 :] + MODES[: k % 3]:
                await step(mode, True)
        await call.done_writing()
    finally:
        if dense_ch is not None:
            await dense_ch.close()
        for ch in channels:
            await ch.close()
        if dense is not None:
            await asyncio.to_thread(stop_processes, [dense], 10.0)
    return _summarise(spec, context, modes, control)


def _summarise(
    spec: Speculation, context: int, modes: dict[str, _Mode], control: KController
) -> dict[str, Any]:
    sp, auto = modes["spec"], modes["auto"]
    point: dict[str, Any] = {"context": context}
    for name, m in modes.items():
        point.update(m.summary(name))
    point.update(sp.drafting(""))  # the fixed k's, unprefixed as before the auto mode
    point.update(auto.drafting("auto_"))
    for name, p in (("spec", ""), ("auto", "auto_")):
        point[f"{name}_speedup"] = point[f"{name}_tokens_per_s"] / point["off_tokens_per_s"]
        point[f"{p}speedup_mean"] = point[f"{name}_tokens_per_s_mean"] / point["off_tokens_per_s_mean"]
        point[f"{p}round_trips_per_token_ratio"] = (
            point[f"{name}_round_trips_per_token"] / point["off_round_trips_per_token"]
        )
        point[f"{p}step_ratio"] = point[f"{name}_step_ms"] / point["off_step_ms"]
        point[f"{p}shard_busy_ratio"] = point[f"{name}_shard_busy_ms"] / point["off_shard_busy_ms"]
    point["speedup"] = point["spec_speedup"]  # the name before the auto mode
    if spec.acceptance is not None:
        point["expected_tau"] = spec.acceptance.expected_tau(spec.k)
    point.update(
        auto_k=control.k,  # the k it settled on: its last decision
        auto_k_steps={str(k): n for k, n in sorted(Counter(auto.ks).items())},  # k per timed step
        auto_decisions=control.decisions,
        auto_probe_steps=auto.probes,
        auto_slope_ms_per_position=control.cost.slope() * 1e3,
    )
    return point


async def run_spec_points(
    s: Setup, spec: Speculation, contexts: list[int], shards: list[ServiceProcess], extra: int, warmup: int
) -> list[dict[str, Any]]:
    points = []
    how = "emulated" if spec.emulated else "REAL"
    for context in contexts:
        p = await spec_point(s, spec, context, shards, context + extra, s.steps, warmup)
        _log(
            f"context {context}: off {p['off_tokens_per_s']:.1f} tok/s, {spec.method} k={spec.k} "
            f"{p['spec_tokens_per_s']:.1f} tok/s ({p['spec_speedup']:.2f}x, tau {p['tau']:.2f}), auto "
            f"{p['auto_tokens_per_s']:.1f} tok/s ({p['auto_speedup']:.2f}x, tau {p['auto_tau']:.2f}, "
            f"k {p['auto_k']}: {p['auto_k_steps']}), acceptance {how}"
        )
        points.append(p)
    return points


def extra_positions(steps: int, warmup: int, k: int, shared: bool = True) -> int:
    """Positions past the context a sequence may reach: every round of the three modes at most
    1 + 2 (k + 1) where they share the sequences, k + 1 where each mode has its own copy."""
    return (steps + warmup) * (2 * k + 3 if shared else k + 1) + k + 4
