"""`fastdecode bench split`: does the split pay? A dense host and shard hosts emulated on one machine.

Each host is a CPU set (fastdecode.benchmarks.hosts): gpu_dense runs pinned to the dense host's
CPUs, each kv_attention shard to its shard host's (in its own network namespace where permitted),
torch and OpenMP threads sized to the set. With `--device cuda` the dense half (gpu_dense's S-part
and LocalEngine's) runs on the GPU, driven from the dense host's CPUs; the shards stay on their
hosts' CPUs. This process plays the scheduler: it sends gpu_dense
the StepPlans the scheduler would (decode steps of B sequences, two mini-batches) from the dense
host's CPUs, where it also runs LocalEngine: the dense host alone, the user's alternative.

At each context the KV-cache is written synthetically, straight into the pools (the shards' Fill
RPC, KVStore.fill_synthetic locally: linear in the context, no causal prefill), then decode steps
run interleaved, a fleet step then a local step at the same positions, so both see the same
machine noise. With `--pipeline auto`, gpu_dense is started fresh at each context and its
chooser's probe steps run (untimed) before the timed ones, so the mode it chose is the one timed.

Measured in the same run, per step (medians): S, the dense half alone (LocalEngine's step less
its attention); R, the attention on the shard host (the slowest shard's busy time); the exchange's
CPU on the dense host (gpu_dense's process CPU less S's CPU) and on the shard host (the shard's CPU
less R). From them: ideal_ratio = (S + R) / max(S, R), efficiency = ratio / ideal_ratio, and the
planner's predicted fleet step (planner.split_step_s) against the measured one.

With `--speculative ngram|suffix` (split_spec.py) no LocalEngine runs: the fleet without drafts,
with up to k (spec) and with the k the scheduler's controller chooses (auto), steps alternating. On
an emulated GPU (`--device emulated:NAME`) the drafts are kept at emulated rates; on cpu or cuda
gpu_dense runs the real model, and the acceptance is what it yields.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdecode.benchmarks.attention import torch_threads
from fastdecode.benchmarks.common import bench_workdir, median, run_async
from fastdecode.benchmarks.hosts import (
    cpu_list,
    host_layout,
    isolated_hosts,
    pinned_process,
)
from fastdecode.benchmarks.split_fleet import (
    Carry,
    Setup,
    busy_each,
    fill,
    fill_owned,
    owners,
    shard_rows,
    start_dense,
    start_shards,
    step_plan,
)
from fastdecode.benchmarks.split_spec import Speculation, extra_positions, run_spec_points
from fastdecode.benchmarks.transport import process_cpu_seconds
from fastdecode.dense.emulated import EmulatedAcceptance, load_profile
from fastdecode.dense.engine import LocalEngine, SeqChunk
from fastdecode.model import ModelConfig
from fastdecode.model.dense import resolve_device
from fastdecode.planning.planner import SplitParts, best_host_share, split_ideal_ratio, split_step_s
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import aio_channel
from fastdecode.runtime.settings import is_emulated
from fastdecode.spec.controller import DECIDE_EVERY, FIRST_DECISION
from fastdecode.tools.fleet import (
    ServiceProcess,
    free_port,
    stop_processes,
)
from fastdecode.v1 import dense_pb2_grpc
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire import dense as dense_wire
from fastdecode.wire.kv_control import geometry_to_proto

DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192)
PIPELINE_MODES = ("auto", "on", "off")
DEVICES = ("cpu", "cuda")
_SETTLE_S = 0.02  # between a fleet and a local step: spin-waiting OpenMP workers go idle
_CHOOSER_PROBES = 8  # fastdecode.dense.pipeline.PipelineChooser's default, per mode
POINT_KEYS = (
    "context",
    "local_tokens_per_s",
    "fleet_tokens_per_s",
    "ratio",
    "s_ms",
    "r_ms",
    "exchange_cpu_ms",
    "ideal_ratio",
    "efficiency",
    "predicted_step_ms",
    "measured_step_ms",
)


def _log(msg: str) -> None:
    print(f"[bench split] {msg}", file=sys.stderr, flush=True)


def _head_s(engine: LocalEngine, batch: int) -> float:
    """The LM head over a batch's last hidden states (median of three after one warm-up): the
    step's serial tail, during which the shard hosts idle."""
    h = torch.randn(batch, engine.model.config.hidden_size, device=engine.model.device)
    times = []
    with torch.inference_mode():
        for k in range(4):
            t0 = time.perf_counter()
            engine.model.logits(h)
            if k:
                times.append(time.perf_counter() - t0)
    return median(times)


def _local_parts(s: Setup, engine: LocalEngine, ids: list[str], context: int) -> tuple[float, float, float]:
    """LocalEngine at this context, untimed by the point (its KV is rewritten before the timed
    steps): the layers' S of one batch and of two half batches as the pipeline runs them, and the
    whole batch's attention on the dense host's cores (medians of two tries after one warm-up).
    The auto host share is planned from them."""
    gen = torch.Generator().manual_seed(s.seed)
    tokens = torch.randint(3, s.cfg.vocab_size, (len(ids),), generator=gen).tolist()
    whole, halves, attention = [], [], []

    def layers(rows: list[int], pos: int) -> tuple[float, float, torch.Tensor]:
        busy0, t0 = engine.kv.busy_seconds, time.perf_counter()
        h = engine.hidden([SeqChunk(ids[i], [tokens[i]], pos) for i in rows])
        return time.perf_counter() - t0, engine.kv.busy_seconds - busy0, h

    with torch.inference_mode():
        for k in range(3):
            pos = context + k
            t_all, a_all, _ = layers(list(range(len(ids))), pos)
            t_a, a_a, _ = layers(list(range(0, len(ids), 2)), pos)
            t_b, a_b, _ = layers(list(range(1, len(ids), 2)), pos)
            if k:
                whole.append(t_all - a_all)
                halves.append(t_a + t_b - a_a - a_b)
                attention.append(a_all)
    return median(whole), median(halves), median(attention)


def _host_rows(
    s: Setup, engine: LocalEngine, ids: list[str], context: int, carry: Carry, head: float
) -> tuple[int, str]:
    """How many sequences the hosted shard holds at this context, and why."""
    if s.host_share is not None:
        return min(len(ids) - len(s.layout.shards), round(s.host_share * len(ids))), "given"
    dense, halves, attention = _local_parts(s, engine, ids, context)
    modes = {"auto": (False, True), "on": (True,), "off": (False,)}[s.pipeline]
    # The shard hosts' attention is planned as the dense host's, spread over the shard hosts.
    share = best_host_share(
        len(ids),
        s.cfg.num_hidden_layers,
        dense,
        halves,
        attention,
        attention / len(s.layout.shards),
        carry.exchange_rt_s,
        modes,
        head,
    )
    _log(
        f"context {context}: host share {share.sequences}/{len(ids)} "
        f"({'piped' if share.pipelined else 'plain'} predicted {share.predicted_step_s * 1e3:.0f} ms; "
        f"layers' S {dense * 1e3:.0f} ms, two halves {halves * 1e3:.0f} ms, head {head * 1e3:.0f} ms, "
        f"attention {attention * 1e3:.0f} ms)"
    )
    return share.sequences, "auto"


async def _point(
    s: Setup,
    context: int,
    shards: list[ServiceProcess],
    engine: LocalEngine,
    max_tokens: int,
    host_capacity: int,
    carry: Carry,
) -> dict[str, Any]:
    cfg, batch = s.cfg, s.batch
    ids = [f"split-{context}-{i}" for i in range(batch)]
    channels = [aio_channel(p.address) for p in shards]
    stubs = [kv_grpc.KVAttentionStub(ch) for ch in channels]
    dense: ServiceProcess | None = None
    dense_ch = None
    geometry = geometry_to_proto(KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim))
    try:
        t0 = time.perf_counter()

        def fill_local() -> None:
            for sid in list(engine.kv.seqs):
                engine.kv.release(sid)
            for sid in ids:
                engine.kv.reserve(sid, max_tokens)
            engine.kv.fill_synthetic(ids, context, s.seed)

        await asyncio.to_thread(fill_local)
        head = await asyncio.to_thread(_head_s, engine, batch)
        hosted, why = await asyncio.to_thread(_host_rows, s, engine, ids, context, carry, head)
        owner = owners(batch, len(shards), hosted)
        await fill_owned(stubs, ids, owner, geometry, max_tokens, context, s.seed)
        if why == "auto":  # _local_parts stepped past the context: the timed steps start from it
            await asyncio.to_thread(fill_local)
        _log(f"context {context}: KV written in {time.perf_counter() - t0:.1f} s")
        # A fresh gpu_dense per context: --pipeline auto decides for this context, not the last one.
        address = f"{s.iso.dense_host}:{free_port(s.iso.dense_host)}" if hosted else None
        dense = await asyncio.to_thread(start_dense, s, shards, address, host_capacity)
        dense_ch = aio_channel(dense.address)
        if address is not None:  # the hosted shard lives in gpu_dense: filled once it serves
            host_ch = aio_channel(address)
            channels.append(host_ch)
            stubs.append(kv_grpc.KVAttentionStub(host_ch))
            await fill(stubs[-1], ids[batch - hosted :], geometry, max_tokens, context, s.seed)
        call = dense_pb2_grpc.DenseStub(dense_ch).Run(timeout=7200)
        gen = torch.Generator().manual_seed(s.seed + context)
        tokens = torch.randint(3, cfg.vocab_size, (batch,), generator=gen).tolist()
        local_tokens = list(tokens)
        piped_plan = s.pipeline != "off"
        fleet_warmup = s.warmup + (2 * _CHOOSER_PROBES if s.pipeline == "auto" else 0)
        fleet_pos = local_pos = context

        async def fleet_step(step: int) -> tuple[float, Any]:
            nonlocal tokens, fleet_pos
            plan = step_plan(step, ids, owner, tokens, fleet_pos, piped_plan)
            t = time.perf_counter()
            await call.write(plan)
            res = await call.read()
            dt = time.perf_counter() - t
            tokens = dense_wire.step_tokens(res, ids, f"context {context}, step {step}")
            fleet_pos += 1
            return dt, res.timings

        def local_step() -> tuple[float, float, float]:
            nonlocal local_tokens, local_pos
            chunks = [SeqChunk(x, [t], local_pos) for x, t in zip(ids, local_tokens, strict=True)]
            busy0, cpu0 = engine.kv.busy_seconds, time.process_time()
            t = time.perf_counter()
            with torch.inference_mode():
                local_tokens = engine.forward(chunks).argmax(-1).tolist()
            dt = time.perf_counter() - t
            local_pos += 1
            return dt, engine.kv.busy_seconds - busy0, time.process_time() - cpu0

        for step in range(fleet_warmup):  # warm-up, and the chooser's probes under auto
            await fleet_step(step)
        for _ in range(min(2, s.warmup) or 1):
            local_step()
        fleet_s, local_s, attn_local, cpu_local, s_part, s_cpu, piped = [], [], [], [], [], [], []
        dense_cpu = 0.0
        shard_cpu = [0.0] * len(shards)
        busy0 = await busy_each(stubs)
        for k in range(s.steps):
            await asyncio.sleep(_SETTLE_S)
            c0 = process_cpu_seconds(dense.pid)
            sc0 = [process_cpu_seconds(p.pid) for p in shards]
            dt, timings = await fleet_step(fleet_warmup + k)
            dense_cpu += process_cpu_seconds(dense.pid) - c0
            for i, p in enumerate(shards):
                shard_cpu[i] += process_cpu_seconds(p.pid) - sc0[i]
            fleet_s.append(dt)
            s_part.append(timings.s_part_seconds)
            s_cpu.append(timings.s_part_cpu_seconds)
            piped.append(timings.pipelined)
            await asyncio.sleep(_SETTLE_S)
            ldt, lattn, lcpu = local_step()
            local_s.append(ldt)
            attn_local.append(lattn)
            cpu_local.append(lcpu)
        busy1 = await busy_each(stubs)
        await call.done_writing()
    finally:
        if dense_ch is not None:
            await dense_ch.close()
        for ch in channels:
            await ch.close()
        if dense is not None:
            await asyncio.to_thread(stop_processes, [dense], 10.0)
    busy = [b1 - b0 for b0, b1 in zip(busy0, busy1, strict=True)]
    point = _summarise(
        s,
        context,
        _Samples(fleet_s, local_s, attn_local, cpu_local, s_part, s_cpu, piped),
        dense_cpu,
        shard_cpu,
        busy[: len(shards)],
        _Hosted(hosted, busy[len(shards)] if hosted else 0.0, why),
        head,
    )
    rts = point["round_trips_per_step"]
    carry.exchange_rt_s = (point["exchange_cpu_ms"] / rts / 1e3, point["shard_exchange_cpu_ms"] / rts / 1e3)
    return point


@dataclass
class _Samples:
    """Per timed step: fleet and local wall seconds, LocalEngine's attention and CPU seconds,
    gpu_dense's S-part wall and CPU seconds, and whether gpu_dense ran the step piped."""

    fleet: list[float]
    local: list[float]
    local_attention: list[float]
    local_cpu: list[float]
    s_part: list[float]
    s_part_cpu: list[float]
    piped: list[bool]


@dataclass
class _Hosted:
    """The dense host's own share: sequences on the shard gpu_dense hosts, that shard's attention
    busy seconds over the timed steps, and how the share was set (auto or given)."""

    sequences: int
    busy: float
    how: str


def _summarise(
    s: Setup,
    context: int,
    x: _Samples,
    dense_cpu: float,
    shard_cpu: list[float],
    shard_busy: list[float],
    hosted: _Hosted,
    head: float,
) -> dict[str, Any]:
    n = s.steps
    fleet, local = median(x.fleet), median(x.local)
    s_dense = median([t - a for t, a in zip(x.local, x.local_attention, strict=True)])  # S: dense alone
    r_remote = max(shard_busy) / n  # the slowest shard host's attention per step
    # R as the issue defines it, the whole batch's attention on the shard hosts: with a hosted share
    # they attended batch - hosted of the batch's equal-length sequences.
    r_shard = r_remote * s.batch / (s.batch - hosted.sequences)
    h_attention = hosted.busy / n
    # The dense half as the fleet runs it (two half batches when piped: on a CPU dense host at
    # small B that reads every weight twice). Its CPU is the stepping thread's (exact with one torch
    # thread; with more, its workers' share is taken as wall x threads). The exchange's CPU on the
    # dense host is gpu_dense's process CPU beyond it and beyond the hosted share's attention:
    # gRPC, codec, event loop. On a GPU the S-part's CPU is the stepping thread's alone (launches
    # and syncs; torch's CPU threads idle).
    threads = s.layout.dense_threads
    s_fleet = median(x.s_part)
    compute_cpu = median(x.s_part_cpu) if threads == 1 or s.device != "cpu" else s_fleet * threads
    exchange_cpu = dense_cpu / n - compute_cpu - h_attention * threads
    slowest = max(range(len(shard_busy)), key=lambda i: shard_busy[i])
    shard_exchange = max(0.0, shard_cpu[slowest] / n / s.layout.shard_threads(slowest) - r_remote)
    pipelined = sum(x.piped) * 2 > len(x.piped)
    round_trips = s.cfg.num_hidden_layers * len(s.layout.shards) * (2 if pipelined else 1)
    # The prediction takes both sides' compute in wall time (the shard's R is too), so that on a
    # host shared with other work it sees the same slowdown as the measured step.
    parts = SplitParts(
        dense_s=max(0.0, s_fleet - head),
        attention_s=r_remote,
        num_layers=s.cfg.num_hidden_layers,
        dense_exchange_s=max(0.0, exchange_cpu),
        shard_exchange_s=shard_exchange,
        host_attention_s=h_attention,
        tail_s=head,
    )
    predicted = split_step_s(parts, pipelined)
    ratio = local / fleet
    ideal = split_ideal_ratio(s_dense, r_shard)
    return {
        "context": context,
        "local_tokens_per_s": s.batch / local,
        "fleet_tokens_per_s": s.batch / fleet,
        "ratio": ratio,
        "s_ms": s_dense * 1e3,
        "r_ms": r_shard * 1e3,
        "exchange_cpu_ms": exchange_cpu * 1e3,
        "ideal_ratio": ideal,
        "efficiency": ratio / ideal,
        "predicted_step_ms": predicted * 1e3,
        "measured_step_ms": fleet * 1e3,
        "predicted_error": predicted / fleet - 1.0,
        "pipelined": pipelined,
        "host_sequences": hosted.sequences,
        "host_share": hosted.sequences / s.batch,
        "host_share_set": hosted.how,
        "host_attention_ms": h_attention * 1e3,
        "head_ms": head * 1e3,
        "r_remote_ms": r_remote * 1e3,
        "local_step_ms": local * 1e3,
        "local_attention_ms": median(x.local_attention) * 1e3,
        "fleet_s_part_ms": s_fleet * 1e3,
        "fleet_s_part_cpu_ms": compute_cpu * 1e3,
        "dense_cpu_ms": dense_cpu / n * 1e3,
        "round_trips_per_step": round_trips,
        "exchange_cpu_ms_per_round_trip": exchange_cpu * 1e3 / round_trips,
        "shard_exchange_cpu_ms": shard_exchange * 1e3,
        "fleet_step_ms_stdev": statistics.pstdev(x.fleet) * 1e3,
        "local_step_ms_stdev": statistics.pstdev(x.local) * 1e3,
    }


async def _run(s: Setup, contexts: list[int], spec: Speculation | None = None) -> list[dict[str, Any]]:
    cfg = s.cfg
    longest = max(contexts)
    extra = _extra(s.steps, s.warmup, spec)
    max_tokens = longest + extra
    itemsize = torch.empty((), dtype=codec.DTYPE_NAMES[s.kv_dtype]).element_size()
    per_seq = (max_tokens + 32) * cfg.kv_bytes_per_token(itemsize)
    rows = shard_rows(s.batch, len(s.layout.shards))
    sets = spec.kv_sets if spec is not None else 1  # with the real model, a copy a speculative mode
    capacity = max(len(r) for r in rows) * sets * per_seq + (16 << 20)
    host_capacity = (s.batch - len(s.layout.shards)) * per_seq + (16 << 20)
    shards: list[ServiceProcess] = []
    carry = Carry()
    try:
        shards = await asyncio.to_thread(start_shards, s, capacity)
        if spec is not None:  # the fleet with drafts (fixed k, the controller's k) against without
            warmup = s.warmup + (_CHOOSER_PROBES if s.pipeline == "auto" else 0)
            return await run_spec_points(s, spec, contexts, shards, extra, warmup)
        engine = await asyncio.to_thread(
            LocalEngine.from_pretrained,
            s.model,
            device=s.device,
            kv_capacity_bytes=s.batch * per_seq + (16 << 20),
            kv_dtype=codec.DTYPE_NAMES[s.kv_dtype],
        )
        points = []
        for context in contexts:
            p = await _point(s, context, shards, engine, context + extra, host_capacity, carry)
            _log(
                f"context {context}: local {p['local_tokens_per_s']:.1f} tok/s, fleet "
                f"{p['fleet_tokens_per_s']:.1f} tok/s, ratio {p['ratio']:.3f} "
                f"(ideal {p['ideal_ratio']:.3f}), "
                f"{'piped' if p['pipelined'] else 'plain'}, host share {p['host_sequences']}/{s.batch}"
            )
            points.append(p)
        return points
    finally:
        await asyncio.to_thread(stop_processes, shards, 10.0)


def _extra(steps: int, warmup: int, spec: Speculation | None) -> int:
    """Positions a sequence may decode past its context: each step one (each pair of steps up to
    k + 2 with drafts), and gpu_dense's chooser's probes under --pipeline auto."""
    if spec is not None:
        return extra_positions(steps, warmup + _CHOOSER_PROBES, spec.k, spec.kv_sets == 1)
    return steps + warmup + 2 * _CHOOSER_PROBES + 4


def crossover(points: list[dict[str, Any]]) -> int | None:
    """The smallest measured context at which the fleet's ratio is >= 1 (None: never)."""
    won = [p["context"] for p in points if p["ratio"] >= 1.0]
    return min(won) if won else None


def run_split_bench(
    model: Path,
    contexts: list[int] | tuple[int, ...] = DEFAULT_CONTEXTS,
    batch: int = 32,
    kv_dtype: str = "bfloat16",
    dense_cpus: str | None = None,
    shard_cpus: str | None = None,
    link_rate: str | None = None,
    pipeline: str = "auto",
    steps: int = 8,
    warmup: int = 3,
    isolation: str = "auto",
    seed: int = 0,
    nice: int = 0,
    device: str = "cpu",
    host_share: float | None = None,
    speculative: str = "off",
    num_speculative_tokens: int = 3,
    acceptance: str | None = None,
) -> dict[str, Any]:
    """Fleet (dense host + shard hosts) against LocalEngine on the dense host, at each context; the
    dense half of both on `device` (cpu, or cuda on a GPU host), attention on the hosts' CPUs. With
    `speculative` (which an emulated GPU, `emulated:NAME`, needs): the fleet with speculative drafts,
    at k and at the controller's k, against the same fleet without (split_spec.py); the acceptance
    emulated at `acceptance` on an emulated GPU, the real model's on cpu or cuda."""
    spec = None
    if is_emulated(device):
        if speculative == "off":
            raise InvalidInput(
                "bench split on an emulated device compares --speculative ngram|suffix with off"
            )
        load_profile(device)  # an unknown profile: one line now
        rates = EmulatedAcceptance.parse(acceptance, seed)
        spec = Speculation(speculative, num_speculative_tokens, rates)
    elif device not in DEVICES:
        raise InvalidInput(f"device must be one of {DEVICES} or emulated:NAME")
    else:
        resolve_device(device)  # cuda without CUDA: InvalidInput now, not a service failing to start
        if acceptance is not None:
            raise InvalidInput("--acceptance is an emulated device's: on cpu or cuda the model verifies")
        if speculative != "off":  # the real model verifies: its own acceptance
            spec = Speculation(speculative, num_speculative_tokens)
    if spec is not None:
        host_share = 0.0  # no LocalEngine to plan a hosted share from
    contexts = sorted(set(contexts))
    if not contexts or min(contexts) < 1 or batch < 2 or steps < 1 or warmup < 0:
        raise InvalidInput("contexts must be >= 1, batch >= 2 (two mini-batches), steps >= 1, warmup >= 0")
    if host_share is not None and not 0 <= host_share < 1:
        raise InvalidInput("host share must be in [0, 1) (the shard hosts keep some sequences), or auto")
    if pipeline not in PIPELINE_MODES:
        raise InvalidInput(f"pipeline must be one of {PIPELINE_MODES}")
    if isolation not in ("auto", "netns", "loopback"):
        raise InvalidInput("isolation must be auto, netns or loopback")
    if kv_dtype not in codec.DTYPE_NAMES:
        raise InvalidInput(f"kv_dtype must be one of {sorted(codec.DTYPE_NAMES)}")
    if not -20 <= nice <= 19 or (nice < 0 and os.geteuid() != 0):
        raise InvalidInput("nice must be in [-20, 19]; below 0 needs root")
    cfg = ModelConfig.from_pretrained(model)
    extra = _extra(steps, warmup, spec)
    room = cfg.max_position_embeddings - extra
    if room < 1:
        raise InvalidInput(
            f"{extra} decode steps do not fit the model's {cfg.max_position_embeddings} positions"
        )
    # A context at the model's limit (SmolLM2: 8192) leaves no room to decode: it is measured at
    # the longest that does, and the point says so (`context_asked`).
    asked = {min(c, room): c for c in contexts}
    contexts = sorted(asked)
    layout = host_layout(dense_cpus, shard_cpus)
    if batch < len(layout.shards):
        raise InvalidInput(f"batch {batch} is smaller than the {len(layout.shards)} shard hosts")
    with bench_workdir("split") as workdir:
        load0 = os.getloadavg()
        with isolated_hosts(len(layout.shards), link_rate, netns=isolation != "loopback") as iso:
            if isolation == "netns" and iso.kind != "netns+veth":
                raise InvalidInput(f"network namespaces were asked for but not available: {iso.description}")
            _log(f"{iso.kind}: {layout.describe()}; dense half on {device}")
            setup = Setup(
                model,
                cfg,
                batch,
                kv_dtype,
                layout,
                iso,
                pipeline,
                steps,
                warmup,
                workdir,
                seed,
                nice,
                device,
                host_share,
            )
            with pinned_process(layout.dense, nice), torch_threads(layout.dense_threads):
                points = run_async(_run(setup, contexts, spec))
    load1 = os.getloadavg()
    for p in points:
        if asked[p["context"]] != p["context"]:
            p["context_asked"] = asked[p["context"]]
    cross = crossover(points) if spec is None else None
    speculation = {}
    if spec is not None:
        speculation = {
            "speculative": spec.method,
            "num_speculative_tokens": spec.k,
            # emulated: kept at the rates; real: what the model verified (greedy)
            "acceptance": "emulated" if spec.acceptance is not None else "real",
            "acceptance_rates": list(spec.acceptance.rates) if spec.acceptance is not None else None,
            "auto_first_decision": FIRST_DECISION,
            "auto_decide_every": DECIDE_EVERY,
        }
    return {
        **speculation,
        "model": str(model),
        "batch": batch,
        "kv_dtype": kv_dtype,
        "device": device,
        "pipeline": pipeline,
        "steps": steps,
        "isolation": iso.kind,
        "isolation_detail": iso.description + (f"; every host's processes at nice {nice}" if nice else ""),
        "dense_cpus": cpu_list(layout.dense),
        "shard_cpus": [cpu_list(c) for c in layout.shards],
        "link_rate": link_rate,
        "nice": nice,
        "host_share": "auto" if host_share is None else host_share,
        "crossover_context": cross,
        "load_avg_1m_before": load0[0],
        "load_avg_1m_after": load1[0],
        "points": points,
    }
