"""`fastdecode bench scheduler-step`: the scheduler process's own CPU per decode step, away from the
fleet's noise.

The real SchedulerDriver and SchedulerCore run B sequences on P shards, with the scheduler's wire
code on both ends of a step: the StepPlan is built and serialized as GrpcDenseLink sends it, the
StepResult parsed and converted as it receives it, and the token events converted and serialized
as the gateway's Session writes them (one message per step), then, in the same run, as a Submit
stream per request writes them. Only the peers are in process and answer at once: gpu_dense's side
(parse the plan, answer a token per sampled sequence) is timed apart and left out, and the shards
hold their reservations in a dict. No gRPC transport is counted (`bench pace` measures it with the
whole fleet); what is left is the scheduler's Python per step.

Per step the CPU is split into `plan` (moves, admission, placement, next_step), `exchange` (the plan
out and the result back: the scheduler's codec), `apply` (apply, token events to each request's
mailbox, metrics), and `streams` (the Session's writer converting and serializing the step's
events as one message; with Submit streams, each request's task waking to do so for its event).
With --decode-steps k each plan runs its sequences k decode steps: every figure is per decode step
(a plan's CPU over the steps it ran). Medians over the timed plans, after every sequence is admitted
and decoding. A median hides the cyclic collector's pauses, so they are reported beside it:
`gc_ms_per_step` (its CPU over the timed steps, spread per step), `gc_max_pause_ms`,
`gc_full_collections`, and the mean step with them.
The heap is settled as the service settles it when ready (settle_heap: what start-up made is frozen).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any

from fastdecode.benchmarks.common import median
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.loop import settle_heap
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.ports import DenseInfo, MigrationResult, ShardState, StepOutcome
from fastdecode.scheduling.session import RequestSession
from fastdecode.scheduling.types import Request, Reservation, Step
from fastdecode.v1 import dense_pb2
from fastdecode.wire import dense as dense_wire
from fastdecode.wire import scheduler as scheduler_wire

# Llama-3-8B's KV geometry, vocabulary and context (what `bench pace` runs by default).
GEOMETRY = KVGeometry(32, 8, 128)
VOCAB, CONTEXT = 128256, 8192


class _InstantDense:
    """gpu_dense answering at once: token 1 + sample_index for each sampled sequence. Its own CPU
    (parsing the plan, building the result) is counted in `dense_cpu_s` and left out."""

    def __init__(self, shards: int) -> None:
        self.info_ = DenseInfo(
            "llama", GEOMETRY, VOCAB, CONTEXT, (0,), shards, tuple(f"bench:{i}" for i in range(shards))
        )
        self.dense_cpu_s = 0.0
        self.exchange_cpu_s = 0.0

    async def info(self, timeout: float) -> DenseInfo:
        return self.info_

    async def add_shard(self, address: str, timeout: float) -> int:
        return self.info_.shard_addresses.index(address)

    async def remove_shard(self, index: int, timeout: float) -> None:
        return None

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        t0 = time.process_time()
        sent = dense_wire.step_plan(step, pipeline).SerializeToString()  # as GrpcDenseLink sends it
        t1 = time.process_time()
        plan = dense_pb2.StepPlan.FromString(sent)  # gpu_dense's side from here ...
        result = dense_pb2.StepResult(step=plan.step)
        result.seq_ids.extend(plan.seq_ids)
        if plan.steps:  # rows run several decode steps (--decode-steps): a token per step
            rows = zip(plan.sample_index, plan.sample, plan.steps, strict=True)
            runs = [[1 + i + j for j in range(k)] if s else [-1] for i, s, k in rows]
            result.token_counts.extend([len(r) for r in runs])
            result.token_ids.extend([t for r in runs for t in r])
        else:
            sampled = zip(plan.sample_index, plan.sample, strict=True)
            result.token_ids.extend([1 + i if s else -1 for i, s in sampled])
        result.logprobs.extend([-0.5] * len(result.token_ids))
        answer = result.SerializeToString()  # ... to here
        t2 = time.process_time()
        outcome = dense_wire.step_outcome_from_proto(dense_pb2.StepResult.FromString(answer))
        t3 = time.process_time()
        self.dense_cpu_s += t2 - t1
        self.exchange_cpu_s += (t1 - t0) + (t3 - t2)
        return outcome


class _InstantShard:
    """A kv_attention shard that holds reservations in a dict and copies them on a move."""

    def __init__(self, address: str, peers: dict[str, _InstantShard]) -> None:
        self.address, self.peers, self.held = address, peers, dict[str, int]()

    async def healthy(self, timeout: float) -> bool:
        return True

    async def stats(self, timeout: float) -> ShardState:
        return ShardState(len(self.held), False, 0, 0, 1 << 40, 2, 16, 0.0, 0.0)

    async def reserve(
        self, geometry: KVGeometry, seqs: list[Reservation], timeout: float, model: str = ""
    ) -> list[int]:
        self.held.update({s.seq_id: s.max_tokens for s in seqs})
        return [0] * len(seqs)

    async def release(self, seq_ids: list[str] | None, timeout: float) -> None:
        for sid in list(self.held) if seq_ids is None else seq_ids:
            self.held.pop(sid, None)

    async def migrate_out(self, seq_id: str, target: str, timeout: float) -> MigrationResult:
        self.peers[target].held[seq_id] = self.held[seq_id]
        return MigrationResult(self.held[seq_id], 0, 0.0)

    async def retire(self, timeout: float) -> None:
        return None


async def _run(
    batch: int,
    shards: int,
    steps: int,
    prompt_len: int,
    prefix_sharing: bool,
    transport: str,
    decode_steps: int = 1,
) -> dict[str, Any]:
    settings = SchedulerSettings(
        dense="bench:dense",
        shards=",".join(f"bench:{i}" for i in range(shards)),
        max_running=batch,
        prefix_sharing="on" if prefix_sharing else "off",
        health_interval=3600.0,
        decode_steps=decode_steps,
    )
    peers: dict[str, _InstantShard] = {}
    for i in range(shards):
        peers[f"bench:{i}"] = _InstantShard(f"bench:{i}", peers)
    dense = _InstantDense(shards)
    driver = SchedulerDriver(settings, dense, list(peers.values()))
    await driver.connect()
    settle_heap()  # as the scheduler service does once it is ready (Server.announce)
    core = driver.core
    assert core is not None
    events = 0

    def request(i: int) -> Request:
        # distinct prompts (nothing shared), long enough to decode through the timed steps
        prompt = [(7 * i + j) % (VOCAB - 1) + 1 for j in range(prompt_len)]
        long = (steps + 16) * decode_steps
        return Request(f"bench-{i}", prompt, max_tokens=min(CONTEXT - prompt_len, long))

    async def stream(i: int) -> None:
        nonlocal events
        async for ev in driver.generate(request(i)):
            scheduler_wire.token_event_to_proto(ev).SerializeToString()  # as the Submit stream writes it
            events += 1

    async def session_writer(session: RequestSession) -> None:
        nonlocal events
        while (batch := await session.next_batch()) is not None:  # as the Session call writes a step
            scheduler_wire.session_events_to_proto(batch).SerializeToString()
            events += len(batch)

    if transport == "session":
        session = RequestSession(driver)
        for i in range(batch):
            session.submit(request(i))
        tasks = [asyncio.create_task(session_writer(session))]
    else:
        tasks = [asyncio.create_task(stream(i)) for i in range(batch)]
    await asyncio.sleep(0)

    async def one_step() -> tuple[int, float, float, float, float]:
        ex0 = dense.exchange_cpu_s
        dn0 = dense.dense_cpu_s
        t0 = time.process_time()
        driver._start_moves()
        step = core.next_step()
        t1 = time.process_time()
        if step is not None:
            await driver.run_step(step)
        t2 = time.process_time()
        for _ in range(3):  # every request's task (or the session's writer) takes its events
            await asyncio.sleep(0)
        t3 = time.process_time()
        exchange = dense.exchange_cpu_s - ex0
        apply = (t2 - t1) - exchange - (dense.dense_cpu_s - dn0)
        k = max((p.steps for p in step.seqs), default=1) if step is not None else 1
        return k, t1 - t0, exchange, apply, t3 - t2

    for _ in range(16):  # admission and prefill
        await one_step()
        if (
            core.running == batch
            and core.waiting == 0
            and not any(s.kv < len(s.tokens) - 1 for s in core._running.values())
        ):
            break
    if core.running != batch:
        raise RuntimeError(f"only {core.running} of {batch} sequences running after warm-up")
    parts: dict[str, list[float]] = {"plan": [], "exchange": [], "apply": [], "streams": []}
    pauses: list[float] = []
    full = 0

    def collected(phase: str, info: dict[str, int]) -> None:
        nonlocal full
        if phase == "start":
            pauses.append(time.process_time())
        else:
            pauses[-1] = time.process_time() - pauses[-1]
            full += info["generation"] == 2

    gc.callbacks.append(collected)
    decoded = 0  # decode steps the timed plans ran (each plan runs up to decode_steps)
    try:
        for _ in range(steps):
            k, *cpu = await one_step()
            decoded += k
            for name, v in zip(parts, cpu, strict=True):
                parts[name].append(v * 1e3 / k)  # per decode step
    finally:
        gc.callbacks.remove(collected)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    totals = [sum(v) for v in zip(*parts.values(), strict=True)]
    without = [t - s for t, s in zip(totals, parts["streams"], strict=True)]
    return {
        "batch": batch,
        "shards": shards,
        "steps": steps,
        "prompt_len": prompt_len,
        "prefix_sharing": prefix_sharing,
        "events": transport,
        "scheduler_cpu_ms_per_step": round(median(totals), 3),
        "scheduler_cpu_ms_per_step_mean": round(sum(totals) / len(totals), 3),  # with the gc pauses
        **{f"{k}_ms": round(median(v), 3) for k, v in parts.items()},
        "without_streams_ms": round(median(without), 3),
        "decode_steps": decode_steps,
        "gc_ms_per_step": round(sum(pauses) * 1e3 / decoded, 3),
        "gc_max_pause_ms": round(max(pauses, default=0.0) * 1e3, 2),
        "gc_full_collections": full,
        "load_average": round(os.getloadavg()[0], 2),
    }


def run_scheduler_step_bench(
    batch: int = 256,
    shards: int = 4,
    steps: int = 200,
    prompt_len: int = 32,
    prefix_sharing: bool = True,
    decode_steps: int = 1,
) -> dict[str, Any]:
    """Both ways of delivering the token events, in one run: the gateway's Session (one message
    per step) and a Submit stream per request. The Session's figures lead; `submit` holds the other's
    and `streams_ratio` the Session's streams time over Submit's."""
    threshold = gc.get_threshold()
    try:
        session, submit = (
            asyncio.run(_run(batch, shards, steps, prompt_len, prefix_sharing, transport, decode_steps))
            for transport in ("session", "submit")
        )
    finally:  # (settle_heap froze this process's heap: a caller gets it back as it was)
        gc.unfreeze()
        gc.set_threshold(*threshold)
    ratio = session["streams_ms"] / submit["streams_ms"] if submit["streams_ms"] > 0 else None
    return {**session, "submit": submit, "streams_ratio": round(ratio, 3) if ratio is not None else None}
