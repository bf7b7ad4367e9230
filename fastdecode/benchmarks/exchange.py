"""`bench exchange`: the Attend data plane at a model's shapes, no weights needed.

gpu_dense's own shard plane (the registered `grpc` shard plane: its links in process, or with
`workers` its exchange worker processes) sends synthetic q, k, v of one layer of a named geometry to real
kv_attention processes that hold `context` tokens of synthetic KV per sequence, and takes o back.
Per row (geometry, batch, shards, workers): the layer's round trip (`rt_ms`), the shards' attention
inside it (`shard_attend_ms`, the slowest shard), payload MB (q, k, v out + o back), payload GB/s
over the transport time (rt - attention), and the dense process's CPU per MB moved. Yardsticks in
the same run on the same bytes between two processes: a raw TCP echo and a bare gRPC echo
(fastdecode/benchmarks/echo.py), as GB/s of the same payload.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastdecode.benchmarks.common import bench_workdir, median, run_async
from fastdecode.benchmarks.echo import grpc_echo_s, tcp_echo_s
from fastdecode.benchmarks.transport import DEFAULT_SERVICE_ENV, process_cpu_seconds
from fastdecode.dense import AttendItem
from fastdecode.dense.handoff import worker_kind
from fastdecode.kv import AttendBatch
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput, ServiceError
from fastdecode.runtime.geometry import Geometry, KVGeometry
from fastdecode.runtime.rpc import sync_channel
from fastdecode.runtime.serving import SHARD_PLANES, registered
from fastdecode.tools.fleet import ServiceProcess, spawn_service, stop_processes, wait_ready
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire.kv import attend_request
from fastdecode.wire.kv_control import geometry_to_proto

MB = 1e6


def _start_shards(
    n: int, capacity: int, kv_dtype: str, workdir: Path, env: dict[str, str], threads: int
) -> list[ServiceProcess]:
    args = ["kv-attention", "--kv-capacity", str(capacity), "--kv-dtype", kv_dtype, "--threads", str(threads)]
    pending = [
        spawn_service(f"kv_attention-{i}", [*args, "--shard-id", str(i)], workdir, env=env) for i in range(n)
    ]
    return [wait_ready(p, 180.0) for p in pending]


def _stub_call(address: str, fn: Any) -> Any:
    ch = sync_channel(address)
    try:
        return fn(kv_grpc.KVAttentionStub(ch))
    finally:
        ch.close()


def _busy(shards: Sequence[ServiceProcess]) -> list[float]:
    return [
        _stub_call(s.address, lambda st: st.Stats(kv_pb.StatsRequest(), timeout=30).attention_busy_seconds)
        for s in shards
    ]


def _fill(
    shards: Sequence[ServiceProcess],
    ids: list[list[str]],
    g: Geometry,
    dtype: torch.dtype,
    context: int,
    max_tokens: int,
    gen: torch.Generator,
) -> None:
    """Reserve every sequence for one layer and put `context` random tokens in its cache."""
    kv_geo = geometry_to_proto(KVGeometry(1, g.kv_heads, g.head_dim))
    per_token = (g.heads + 2 * g.kv_heads) * g.head_dim * dtype.itemsize
    group = max(1, (32 << 20) // max(1, context * per_token))  # ~32 MB per fill message
    for svc, part in zip(shards, ids, strict=False):

        def reserve(st: kv_grpc.KVAttentionStub, part: list[str] = part) -> None:
            st.Release(kv_pb.ReleaseRequest(all=True), timeout=30)
            st.Reserve(
                kv_pb.ReserveRequest(
                    geometry=kv_geo,
                    sequences=[kv_pb.SequenceReservation(seq_id=s, max_tokens=max_tokens) for s in part],
                ),
                timeout=60,
            )
            reqs = []
            for i in range(0, len(part), group):
                chunk = part[i : i + group]
                t = len(chunk) * context
                req = kv_pb.AttendRequest(
                    request_id=len(reqs), layer=0, seq_ids=chunk, num_tokens=[context] * len(chunk)
                )
                req.start_pos[:] = [0] * len(chunk)
                codec.encode(torch.randn(t, g.heads, g.head_dim, generator=gen).to(dtype), req.q)
                codec.encode(torch.randn(t, g.kv_heads, g.head_dim, generator=gen).to(dtype), req.k)
                codec.encode(torch.randn(t, g.kv_heads, g.head_dim, generator=gen).to(dtype), req.v)
                reqs.append(req)
            for resp in st.Attend(iter(reqs), timeout=1800):
                if resp.error.code:
                    raise ServiceError(f"filling the shard failed: {resp.error.message}")

        _stub_call(svc.address, reserve)


def _plane(addresses: list[str], workers: int, kind: str = "auto") -> Any:
    """gpu_dense's registered shard plane: its own links in process, or K exchange workers (native
    or python)."""
    connect = registered(SHARD_PLANES, "grpc")
    return connect(addresses, workers=workers, worker_kind=kind) if workers else connect(addresses)


def _round_trips(
    plane_workers: int,
    kind: str,
    shards: Sequence[ServiceProcess],
    ids: list[list[str]],
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first_pos: int,
    repeats: int,
) -> dict[str, float]:
    n = len(shards)
    q, k, v = tensors
    bounds = [0]
    for part in ids:
        bounds.append(bounds[-1] + len(part))
    warm = max(2, repeats // 5)

    async def run() -> tuple[list[float], float, float, list[float]]:
        plane = _plane([s.address for s in shards], plane_workers, kind)
        if hasattr(plane, "start"):  # exchange workers: started before the timing
            await plane.start()
        pids = [w.proc.pid for w in getattr(plane, "workers", []) if w.proc is not None]
        wall: list[float] = []
        cpu = wcpu = 0.0
        busy0: list[float] = []
        try:
            for step in range(warm + repeats):
                if step == warm:
                    busy0 = _busy(shards)  # blocking, outside the timed part
                pos = first_pos + step
                items = [
                    AttendItem(
                        i,
                        AttendBatch(
                            ids[i],
                            [1] * len(ids[i]),
                            [pos] * len(ids[i]),
                            q[bounds[i] : bounds[i + 1]],
                            k[bounds[i] : bounds[i + 1]],
                            v[bounds[i] : bounds[i + 1]],
                        ),
                    )
                    for i in range(n)
                ]
                w0 = sum(process_cpu_seconds(p) for p in pids)
                c0 = time.process_time()
                t0 = time.perf_counter()
                outs = await plane.attend_layer(0, 0, items)
                dt = time.perf_counter() - t0
                c1 = time.process_time()
                w1 = sum(process_cpu_seconds(p) for p in pids)
                for o in outs:
                    if isinstance(o, BaseException):
                        raise o
                if step >= warm:
                    wall.append(dt)
                    cpu += c1 - c0
                    wcpu += w1 - w0
            return wall, cpu / len(wall), wcpu / len(wall), busy0
        finally:
            await plane.close()

    wall, cpu, wcpu, busy0 = run_async(run())
    spent = [a - b for a, b in zip(_busy(shards), busy0, strict=True)]
    return {
        "rt_s": median(wall),
        "dense_cpu_s": cpu,
        "worker_cpu_s": wcpu,
        "attend_s": max(spent) / len(wall),
    }


def _wire_sizes(
    g: Geometry, ids: list[list[str]], tensors: tuple[torch.Tensor, ...], pos: int
) -> tuple[int, int]:
    """Request and response wire bytes of one layer, all shards together (the echoes move these)."""
    q, k, v = tensors
    out = back = 0
    lo = 0
    for part in ids:
        hi = lo + len(part)
        batch = AttendBatch(part, [1] * len(part), [pos] * len(part), q[lo:hi], k[lo:hi], v[lo:hi])
        out += len(attend_request(0, batch, 1 << 40))
        o = torch.empty(len(part), g.heads * g.head_dim, dtype=q.dtype)
        back += len(codec.serialize_with(kv_pb.AttendResponse(request_id=1 << 40, attend_seconds=1.0), o=o))
        lo = hi
    return out, back


def run_exchange_bench(
    geometry_: Geometry,
    dtype: str = "bfloat16",
    batches: Sequence[int] = (256,),
    shard_counts: Sequence[int] = (2,),
    worker_counts: Sequence[int] = (0, 1),
    context: int = 128,
    repeats: int = 50,
    shard_threads: int = 1,
    service_env: dict[str, str] | None = None,
    seed: int = 0,
    device: str = "cpu",
    worker_kinds: Sequence[str] = ("auto",),
) -> dict[str, Any]:
    if dtype not in codec.DTYPE_NAMES:
        raise InvalidInput(f"dtype must be one of {sorted(codec.DTYPE_NAMES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidInput(f"--device {device}: no CUDA device here")
    if not batches or not shard_counts or not worker_counts:
        raise InvalidInput("give at least one batch, shard count and worker count")
    if min(batches) < 1 or min(shard_counts) < 1 or min(worker_counts) < 0 or context < 1 or repeats < 5:
        raise InvalidInput("batch, shards, context >= 1, workers >= 0, repeats >= 5")
    if max(shard_counts) > max(batches) or any(s > b for s in shard_counts for b in batches):
        raise InvalidInput("every shard needs at least one sequence: shards <= batch")
    # each K>0 row once per worker kind (native, python: auto resolved, an unbuilt native refused here)
    kinds = [worker_kind(x) for x in worker_kinds or ("auto",)]
    plans = [(w, kind) for w in worker_counts for kind in (kinds if w else ["none"])]
    g = geometry_
    tdtype = codec.DTYPE_NAMES[dtype]
    itemsize = tdtype.itemsize
    env = DEFAULT_SERVICE_ENV if service_env is None else service_env
    warm = max(2, repeats // 5)
    max_tokens = context + len(plans) * (warm + repeats) + 8
    kv_per_token = 2 * g.kv_heads * g.head_dim * itemsize  # one layer
    # every shard process may hold the whole batch (the 1-shard rows); pages commit as tokens land
    capacity = int(max(batches) * max_tokens * kv_per_token * 1.1) + (16 << 20)
    gen = torch.Generator().manual_seed(seed)
    with bench_workdir("exchange") as workdir:
        rows: list[dict[str, Any]] = []
        procs = _start_shards(max(shard_counts), capacity, dtype, workdir, env, shard_threads)
        try:
            for batch in batches:
                # on a GPU host q, k, v come off the device: the in-process path copies them to the host
                # before encoding, the exchange workers' plane copies them straight into shared memory
                q = torch.randn(batch, g.heads, g.head_dim, generator=gen).to(device=device, dtype=tdtype)
                k = torch.randn(batch, g.kv_heads, g.head_dim, generator=gen).to(device=device, dtype=tdtype)
                v = torch.randn(batch, g.kv_heads, g.head_dim, generator=gen).to(device=device, dtype=tdtype)
                payload = g.payload_bytes(batch, itemsize)
                for n in shard_counts:
                    shards = procs[:n]
                    ids = [[f"s{j}" for j in range(i * batch // n, (i + 1) * batch // n)] for i in range(n)]
                    _fill(shards, ids, g, tdtype, context, max_tokens, gen)
                    out_b, back_b = _wire_sizes(g, ids, (q, k, v), context)
                    echo_s = median(grpc_echo_s(out_b, back_b, repeats + warm))
                    tcp_s = median(tcp_echo_s(out_b, back_b, repeats + warm))
                    pos = context
                    base_cpu: float | None = None
                    for workers, kind in plans:
                        r = _round_trips(workers, kind, shards, ids, (q, k, v), pos, repeats)
                        pos += warm + repeats
                        transport_s = max(r["rt_s"] - r["attend_s"], 1e-9)
                        mb = payload / MB
                        row = {
                            "geometry": g.name,
                            "dtype": dtype,
                            "batch": batch,
                            "shards": n,
                            "workers": workers,
                            "exchange_worker": kind,
                            "context": context,
                            "payload_mb": mb,
                            "rt_ms": r["rt_s"] * 1e3,
                            "shard_attend_ms": r["attend_s"] * 1e3,
                            "transport_ms": transport_s * 1e3,
                            "dense_cpu_ms": r["dense_cpu_s"] * 1e3,
                            "dense_cpu_ms_per_mb": r["dense_cpu_s"] * 1e3 / mb,
                            "worker_cpu_ms_per_mb": r["worker_cpu_s"] * 1e3 / mb,
                            "gbps": payload / transport_s / 1e9,
                            "grpc_echo_rt_ms": echo_s * 1e3,
                            "tcp_rt_ms": tcp_s * 1e3,
                            "grpc_echo_gbps": payload / echo_s / 1e9,
                            "tcp_gbps": payload / tcp_s / 1e9,
                        }
                        row["vs_grpc_echo"] = row["gbps"] / row["grpc_echo_gbps"]
                        row["vs_tcp"] = row["gbps"] / row["tcp_gbps"]
                        if workers == 0:
                            base_cpu = row["dense_cpu_ms_per_mb"]
                        row["dense_cpu_vs_0_workers"] = (
                            row["dense_cpu_ms_per_mb"] / base_cpu if base_cpu else math.nan
                        )
                        rows.append(row)
        finally:
            stop_processes(procs, 10.0)
    return {
        "geometry": g.name,
        "hidden": g.hidden,
        "heads": g.heads,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "dtype": dtype,
        "device": device,
        "context": context,
        "repeats": repeats,
        "rows": rows,
    }


COLUMNS = [
    "batch",
    "shards",
    "workers",
    "exchange_worker",
    "payload_mb",
    "rt_ms",
    "shard_attend_ms",
    "dense_cpu_ms_per_mb",
    "worker_cpu_ms_per_mb",
    "gbps",
    "grpc_echo_gbps",
    "tcp_gbps",
    "vs_grpc_echo",
    "vs_tcp",
    "dense_cpu_vs_0_workers",
]
