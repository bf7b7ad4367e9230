"""What the fleet's transport costs: gpu_dense + one kv_attention shard (two processes, gRPC on
loopback, driven with StepPlans) against LocalEngine doing the same split in one process.

Both hold B sequences whose KV-cache already holds `context` tokens (filled directly with
random K/V, not timed: the values do not change the cost of a decode step), then decode
steps run interleaved, fleet step then local step at the same positions, so both see the
same machine noise. Headline: overhead = fleet_step / local_step - 1.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from fastdecode.benchmarks.attention import torch_threads
from fastdecode.benchmarks.common import bench_workdir, median, run_async
from fastdecode.contract import PlannedSeq
from fastdecode.dense.engine import LocalEngine, SeqChunk
from fastdecode.kv import AttendBatch
from fastdecode.model import ModelConfig
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput, ServiceError
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import aio_channel
from fastdecode.tools import checkpoint
from fastdecode.tools.checkpoint import default_model_dir
from fastdecode.tools.fleet import ServiceProcess, start_service, stop_processes
from fastdecode.v1 import dense_pb2, dense_pb2_grpc
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire import dense as dense_wire
from fastdecode.wire.kv_control import geometry_to_proto

_SETTLE_S = 0.02
# libgomp's workers spin ~300k iterations after each parallel region before sleeping; two
# services sharing a small machine then steal each other's cores (measured on 2 cores, no
# pipeline, 2 threads each: S-part 154 -> 108 ms per step with a short spin).
DEFAULT_SERVICE_ENV = {"GOMP_SPINCOUNT": "1000"}


def ensure_model(arch: str = "llama", preset: str = "small", root: Path | None = None) -> Path:
    """A random-weight checkpoint cached under root (default: next to the default model)."""
    return checkpoint.ensure_model(arch, preset, (root or default_model_dir().parent) / f"{preset}-{arch}")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used (all its threads, ended ones too); nan once it is gone.

    Read from the process's CPU-time clock, to the nanosecond (Linux: the clock id that
    clock_getcpuclockid gives, MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)); /proc's user + system
    ticks (10 ms) where that clock is refused. At 10 ms a tick, a part that spends ~8 ms a second
    read 40 +- 10 ms over a 5 s window: +-25%."""
    if sys.platform == "linux":
        try:
            return time.clock_gettime(((~pid) << 3) | 2)
        except (OSError, OverflowError):
            pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_kernel_seconds(pid: int) -> float:
    """The system (kernel) share of process_cpu_seconds: /proc's ticks (10 ms); nan once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def _geometry(c: ModelConfig) -> kv_pb.KVGeometry:
    return geometry_to_proto(KVGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim))


async def _fill_shard(
    stub: kv_grpc.KVAttentionStub, c: ModelConfig, ids: list[str], context: int, gen: torch.Generator
) -> None:
    """Put `context` random tokens into every sequence's cache on the shard, all layers."""
    group = max(1, (8 << 20) // (context * c.num_attention_heads * c.head_dim * 4))  # ~8 MB per q
    reqs = []
    for layer in range(c.num_hidden_layers):
        for i in range(0, len(ids), group):
            part = ids[i : i + group]
            t = len(part) * context
            req = kv_pb.AttendRequest(
                request_id=len(reqs), layer=layer, seq_ids=part, num_tokens=[context] * len(part)
            )
            req.start_pos[:] = [0] * len(part)
            codec.encode(torch.randn(t, c.num_attention_heads, c.head_dim, generator=gen), req.q)
            kv = torch.randn(t, c.num_key_value_heads, c.head_dim, generator=gen)
            codec.encode(kv, req.k)
            codec.encode(kv, req.v)
            reqs.append(req)

    async def items():  # noqa: ANN202 - async generator of requests
        for r in reqs:
            yield r

    async for resp in stub.Attend(items(), timeout=600):
        if resp.error.code:
            raise ServiceError(f"filling the shard failed: {resp.error.message}")


def _fill_local(engine: LocalEngine, ids: list[str], context: int, gen: torch.Generator) -> None:
    c = engine.model.config
    for sid in ids:
        q = torch.randn(context, c.num_attention_heads, c.head_dim, generator=gen)
        kv = torch.randn(context, c.num_key_value_heads, c.head_dim, generator=gen)
        for layer in range(c.num_hidden_layers):
            engine.kv.attend(layer, AttendBatch([sid], [context], [0], q, kv, kv))


def _plan(step: int, ids: list[str], tokens: list[int], pos: int, pipeline: bool) -> dense_pb2.StepPlan:
    seqs = [
        PlannedSeq(sid, 0, i % 2 if pipeline else 0, [tok], pos, sample_index=step)
        for i, (sid, tok) in enumerate(zip(ids, tokens, strict=True))
    ]
    return dense_wire.plan_to_proto(step, seqs, pipeline)


async def _run(
    model: Path,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    pipeline: bool,
    dense_threads: int | None,
    shard_threads: int | None,
    kv_dtype: str,
    workdir: Path,
    local: bool,
    seed: int,
    service_env: dict[str, str] | None,
) -> dict[str, object]:
    c = ModelConfig.from_pretrained(model)
    if context + warmup + steps > c.max_position_embeddings:
        raise InvalidInput(f"context + steps exceeds the model's {c.max_position_embeddings} positions")
    itemsize = torch.empty((), dtype=codec.DTYPE_NAMES[kv_dtype]).element_size()
    max_tokens = context + warmup + steps
    capacity = batch * (max_tokens + 16) * c.kv_bytes_per_token(itemsize)
    gen = torch.Generator().manual_seed(seed)
    ids = [f"bench-{i}" for i in range(batch)]
    procs: list[ServiceProcess] = []
    channels = []
    try:
        shard_args = [
            "kv-attention",
            "--shard-id",
            "0",
            "--kv-capacity",
            str(capacity),
            "--kv-dtype",
            kv_dtype,
        ]
        if shard_threads:
            shard_args += ["--threads", str(shard_threads)]
        procs.append(
            await asyncio.to_thread(start_service, "kv_attention-0", shard_args, workdir, env=service_env)
        )
        dense_args = ["gpu-dense", "--model", str(model), "--shards", procs[0].address, "--device", "cpu"]
        if dense_threads:
            dense_args += ["--threads", str(dense_threads)]
        procs.append(
            await asyncio.to_thread(start_service, "gpu_dense", dense_args, workdir, env=service_env)
        )
        shard_ch, dense_ch = aio_channel(procs[0].address), aio_channel(procs[1].address)
        channels = [shard_ch, dense_ch]
        shard = kv_grpc.KVAttentionStub(shard_ch)
        dense = dense_pb2_grpc.DenseStub(dense_ch)
        await shard.Reserve(
            kv_pb.ReserveRequest(
                geometry=_geometry(c),
                sequences=[kv_pb.SequenceReservation(seq_id=s, max_tokens=max_tokens) for s in ids],
            ),
            timeout=30,
        )
        await _fill_shard(shard, c, ids, context, gen)
        engine = None
        if local:
            engine = LocalEngine.from_pretrained(
                model, kv_capacity_bytes=capacity, kv_dtype=codec.DTYPE_NAMES[kv_dtype]
            )
            for sid in ids:
                engine.kv.reserve(sid, max_tokens)
            _fill_local(engine, ids, context, gen)
        tokens = torch.randint(3, c.vocab_size, (batch,), generator=gen).tolist()
        local_tokens = list(tokens)
        fleet_s, local_s, s_part, shard_wait, local_attend, dense_s = [], [], [], [], [], []
        stats0 = await shard.Stats(kv_pb.StatsRequest(), timeout=10)
        fleet_cpu = local_cpu = 0.0
        call = dense.Run(timeout=3600)
        for step in range(warmup + steps):
            pos = context + step
            plan = _plan(step, ids, tokens, pos, pipeline)
            await asyncio.sleep(_SETTLE_S)
            cpu0 = sum(process_cpu_seconds(p.pid) for p in procs)
            t0 = time.perf_counter()
            await call.write(plan)
            res = await call.read()
            dt = time.perf_counter() - t0
            cpu1 = sum(process_cpu_seconds(p.pid) for p in procs)
            tokens = dense_wire.step_tokens(res, ids, f"step {step}")
            if engine is not None:
                # A pause (not timed) between the fleet's and the local step: OpenMP workers spin
                # for a while after a parallel region, and must not steal the other side's cores.
                await asyncio.sleep(_SETTLE_S)
                chunks = [SeqChunk(s, [t], pos) for s, t in zip(ids, local_tokens, strict=True)]
                busy0 = engine.kv.busy_seconds
                lcpu0 = time.process_time()
                t1 = time.perf_counter()
                local_tokens = engine.forward(chunks).argmax(-1).tolist()
                ldt = time.perf_counter() - t1
                lcpu = time.process_time() - lcpu0
            if step >= warmup:
                fleet_cpu += cpu1 - cpu0
                fleet_s.append(dt)
                s_part.append(res.timings.s_part_seconds)
                shard_wait.append(res.timings.shard_wait_seconds)
                dense_s.append(res.timings.step_seconds)
                if engine is not None:
                    local_s.append(ldt)
                    local_cpu += lcpu
                    local_attend.append(engine.kv.busy_seconds - busy0)
            if step == warmup - 1:
                stats0 = await shard.Stats(kv_pb.StatsRequest(), timeout=10)
        await call.done_writing()
        stats1 = await shard.Stats(kv_pb.StatsRequest(), timeout=10)
    finally:
        for ch in channels:
            await ch.close()
        await asyncio.to_thread(stop_processes, procs, 10.0)
    fleet = median(fleet_s)
    out: dict[str, object] = {
        "model": str(model),
        "batch": batch,
        "context": context,
        "steps": steps,
        "pipeline": pipeline,
        "dense_threads": dense_threads,
        "shard_threads": shard_threads,
        "local_threads": torch.get_num_threads(),
        "kv_dtype": kv_dtype,
        "service_env": " ".join(f"{k}={v}" for k, v in (service_env or {}).items()),
        "fleet_step_ms": fleet * 1e3,
        "fleet_step_ms_stdev": statistics.pstdev(fleet_s) * 1e3,
        "fleet_s_part_ms": median(s_part) * 1e3,
        "fleet_shard_wait_ms": median(shard_wait) * 1e3,
        # gpu_dense's own step time, and what the step round trip to its driver adds on top
        "fleet_dense_step_ms": median(dense_s) * 1e3,
        "step_rt_overhead_ms": median([f - d for f, d in zip(fleet_s, dense_s, strict=True)]) * 1e3,
        "shard_attend_ms": (stats1.attention_busy_seconds - stats0.attention_busy_seconds) / steps * 1e3,
        "shard_items_per_step": (stats1.attend_items - stats0.attend_items) / steps,
        "fleet_tokens_per_s": batch / fleet,
        # CPU time of both services per step (all threads): work, robust to a busy machine
        "fleet_cpu_ms": fleet_cpu / steps * 1e3,
    }
    if local_s:
        loc = median(local_s)
        out.update(
            local_step_ms=loc * 1e3,
            local_attend_ms=median(local_attend) * 1e3,
            local_tokens_per_s=batch / loc,
            local_cpu_ms=local_cpu / steps * 1e3,
            cpu_overhead=fleet_cpu / local_cpu - 1.0 if local_cpu > 0 else float("nan"),
            overhead=fleet / loc - 1.0,
            target_overhead=0.15,
        )
    return out


def run_transport_bench(
    model: Path | None = None,
    batch: int = 32,
    context: int = 512,
    steps: int = 10,
    warmup: int = 2,
    pipeline: bool = True,
    dense_threads: int | None = 1,
    shard_threads: int | None = 1,
    local_threads: int | None = None,
    kv_dtype: str = "float32",
    local: bool = True,
    seed: int = 0,
    service_env: dict[str, str] | None = None,
    breakdown: bool = False,
    rt_repeats: int = 200,
) -> dict[str, object]:
    """Median decode-step time of the fleet (dense + one shard over gRPC) and of LocalEngine, then
    one Attend round trip against a bare gRPC echo of the same bytes (fastdecode.benchmarks.breakdown);
    with `breakdown`, every part of the round trip and the dense side's CPU at 1 to 8 shards."""
    if min(batch, context, steps) < 1 or warmup < 0 or rt_repeats < 10:
        raise InvalidInput("batch, context and steps must be >= 1, warmup >= 0, rt_repeats >= 10")
    if kv_dtype not in codec.DTYPE_NAMES:
        raise InvalidInput(f"kv_dtype must be one of {sorted(codec.DTYPE_NAMES)}")
    model = model or ensure_model("llama", "small")
    service_env = DEFAULT_SERVICE_ENV if service_env is None else service_env
    with bench_workdir("transport") as workdir:
        with torch_threads(local_threads):
            out = run_async(
                _run(
                    model,
                    batch,
                    context,
                    steps,
                    warmup,
                    pipeline,
                    dense_threads,
                    shard_threads,
                    kv_dtype,
                    workdir,
                    local,
                    seed,
                    service_env,
                )
            )
        out.update(_round_trip(model, batch, rt_repeats, breakdown, service_env))
        return out


def _round_trip(
    model: Path, batch: int, repeats: int, full: bool, env: dict[str, str] | None
) -> dict[str, object]:
    from fastdecode.benchmarks.breakdown import run_breakdown

    r = run_breakdown(
        ModelConfig.from_pretrained(model), batch, repeats, (1, 2, 4, 8) if full else (1,), env=env
    )
    keys = ("attend_rt_ms", "echo_rt_ms", "tcp_echo_rt_ms", "shard_attention_ms", "attend_rt_vs_echo")
    return r if full else {k: r[k] for k in keys}
