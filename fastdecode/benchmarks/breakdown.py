"""`bench transport --breakdown`: where one Attend round trip goes, measured part by part.

One decode item of `batch` sequences with the model's head shape (q, k, v out, o back), against
real shard processes on loopback, through gpu_dense's own ShardPlane (services/gpu_dense/exchange/links.py):
- the pieces, each timed alone in this process: the request built as wire bytes (q, k, v encoded
  straight into them: codec.serialize_with), its parse and decode on the shard, the response's
  encode, serialize and parse, a thread hop (executor round trip) and an event-loop wake-up from
  another thread, which is what each hand-off costs;
- the whole: `attend_rt_ms` = one round trip as gpu_dense makes it, the shard's attention time
  excluded; yardsticks measured in the same run: a bare grpc.aio bidi echo of the same byte
  sizes (`echo_rt_ms`) and a raw TCP echo;
- dense-side CPU per round trip as the shard count grows (1, 2, 4, 8 shard processes, the batch
  split between them): process CPU time of this process, which runs the dense side's link code.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fastdecode.benchmarks.common import bench_workdir, median, run_async
from fastdecode.benchmarks.echo import grpc_echo_s, tcp_echo_s
from fastdecode.dense import AttendItem, ShardPlane
from fastdecode.kv import AttendBatch
from fastdecode.model import ModelConfig
from fastdecode.runtime import codec
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import sync_channel
from fastdecode.runtime.serving import SHARD_PLANES, registered
from fastdecode.tools.fleet import ServiceProcess, spawn_service, stop_processes, wait_ready
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire.kv import attend_request
from fastdecode.wire.kv_control import geometry_to_proto

PlaneFactory = Callable[[list[str]], ShardPlane]
WINDOW = 16  # round trips per set of sequences


def _default_plane(addresses: list[str], concurrent: bool = False) -> ShardPlane:
    connect = registered(SHARD_PLANES, "grpc")  # gpu_dense's links (services/gpu_dense/exchange/links.py)
    return connect(addresses, concurrent=concurrent)


def _concurrent_plane(addresses: list[str]) -> ShardPlane:
    return _default_plane(addresses, concurrent=True)


def _timeit(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def _hops(repeats: int) -> tuple[float, float]:
    """ms of an executor round trip (loop -> thread -> loop) and of a wake-up from another thread."""

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1)
        hop, wake = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await loop.run_in_executor(pool, int)
            hop.append(time.perf_counter() - t0)
        for _ in range(repeats):
            fut = loop.create_future()
            t0 = time.perf_counter()
            threading.Thread(target=loop.call_soon_threadsafe, args=(fut.set_result, None)).start()
            await fut
            wake.append(time.perf_counter() - t0)  # includes starting the thread: an upper bound
        pool.shutdown()
        return median(hop) * 1e3, median(wake) * 1e3

    return run_async(run())


def _tensors(cfg: ModelConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, generator=g)
    kv = torch.randn(batch, cfg.num_key_value_heads, cfg.head_dim, generator=g)
    return q, kv, kv.clone()


def pieces(cfg: ModelConfig, batch: int, repeats: int = 200) -> dict[str, float]:
    """The in-process parts of one round trip, each timed alone (ms, medians)."""
    q, k, v = _tensors(cfg, batch)
    ids = [f"s{i}" for i in range(batch)]
    item = AttendBatch(ids, [1] * batch, [512] * batch, q, k, v)
    wire = attend_request(0, item, 1)
    o = torch.randn(batch, cfg.num_attention_heads * cfg.head_dim)
    resp = kv_pb.AttendResponse(request_id=1)
    codec.encode(o, resp.o)
    back = resp.SerializeToString()
    parsed = kv_pb.AttendRequest.FromString(wire)
    hop, wake = _hops(repeats)
    return {
        "request_bytes": len(wire),
        "response_bytes": len(back),
        # q, k, v encoded straight into the request's wire bytes (codec.serialize_with): one step
        "dense_encode_qkv_ms": _timeit(lambda: attend_request(0, item, 1), repeats),
        "shard_parse_ms": _timeit(lambda: kv_pb.AttendRequest.FromString(wire), repeats),
        "shard_decode_qkv_ms": _timeit(
            lambda: (codec.decode(parsed.q), codec.decode(parsed.k), codec.decode(parsed.v)), repeats
        ),
        "shard_encode_o_ms": _timeit(lambda: codec.encode(o, kv_pb.AttendResponse().o), repeats),
        "shard_serialize_ms": _timeit(resp.SerializeToString, repeats),
        "dense_parse_ms": _timeit(lambda: kv_pb.AttendResponse.FromString(back), repeats),
        "dense_decode_o_ms": _timeit(lambda: codec.decode(resp.o), repeats),
        "thread_hop_ms": hop,
        "loop_wakeup_ms": wake,
    }


def start_shards(
    n: int, workdir: Path, env: dict[str, str] | None = None, threads: int = 1
) -> list[ServiceProcess]:
    args = ["kv-attention", "--kv-capacity", str(64 << 20), "--threads", str(threads)]
    pending = [spawn_service(f"kv_attention-{i}", args, workdir, env=env) for i in range(n)]
    return [wait_ready(p, 120.0) for p in pending]


def _reserve(cfg: ModelConfig, shards: list[ServiceProcess], ids: list[list[str]], tokens: int) -> None:
    geometry = geometry_to_proto(KVGeometry(1, cfg.num_key_value_heads, cfg.head_dim))
    for svc, part in zip(shards, ids, strict=True):
        ch = sync_channel(svc.address)
        kv_grpc.KVAttentionStub(ch).Release(kv_pb.ReleaseRequest(all=True), timeout=10)
        kv_grpc.KVAttentionStub(ch).Reserve(
            kv_pb.ReserveRequest(
                geometry=geometry,
                sequences=[kv_pb.SequenceReservation(seq_id=s, max_tokens=tokens) for s in part],
            ),
            timeout=10,
        )
        ch.close()


def round_trips(
    cfg: ModelConfig,
    batch: int,
    shards: list[ServiceProcess],
    repeats: int,
    plane_factory: PlaneFactory = _default_plane,
    busy_s: float = 0.0,
) -> dict[str, float]:
    """One layer's Attend round trips to len(shards) shards through the dense side's ShardPlane.

    `busy_s`: matrix products on this process's torch threads before each round trip, as the dense
    S-part runs between a step's layers: the shards' and pollers' threads have gone idle and wake on
    busy cores (on a 2-core host 0.2-0.5 ms more per layer than back-to-back round trips when this
    process has the services' short OpenMP spin, 0.4-1.1 ms with the default, whose spinning
    threads outlast the products and take a core from the shards).
    Returns wall ms per layer, this process's CPU ms per round trip (per shard item), and the
    slowest shard's attention ms per timed round trip (`attention_ms`: counted over the timed
    round trips only, since the first ones also commit the pool's first pages)."""
    n = len(shards)
    per = [list(range(i * batch // n, (i + 1) * batch // n)) for i in range(n)]
    ids = [[f"s{j}" for j in rows] for rows in per]
    q, k, v = _tensors(cfg, batch)
    x, w = torch.randn(batch, cfg.hidden_size), torch.randn(cfg.hidden_size, cfg.intermediate_size)

    def busy() -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_s:
            torch.mm(x, w)

    async def run() -> tuple[list[float], float, list[float]]:
        plane = plane_factory([s.address for s in shards])
        wall = []
        cpu = 0.0
        busy_before: list[float] = []
        try:
            for step in range(repeats):
                if step == repeats // 5:  # timing starts (a blocking call, outside the timed part)
                    busy_before = _shard_busy_each(shards)
                pos = step % WINDOW
                if pos == 0:
                    # Fresh sequences every WINDOW round trips (not timed): the attention stays short
                    # and the same size all run long, so subtracting its mean leaves the transport.
                    _reserve(cfg, shards, ids, WINDOW)
                items = [
                    AttendItem(
                        i,
                        AttendBatch(
                            ids[i],
                            [1] * len(ids[i]),
                            [pos] * len(ids[i]),
                            q[r[0] : r[-1] + 1],
                            k[r[0] : r[-1] + 1],
                            v[r[0] : r[-1] + 1],
                        ),
                    )
                    for i, r in enumerate(per)
                ]
                busy()
                c0 = time.process_time()
                t0 = time.perf_counter()
                outs = await plane.attend_layer(0, 0, items)
                dt = time.perf_counter() - t0
                c1 = time.process_time()
                for o in outs:
                    if isinstance(o, BaseException):
                        raise o
                if step >= repeats // 5:  # the first round trips open streams and warm up
                    wall.append(dt)
                    cpu += c1 - c0
            return wall, cpu / (len(wall) * n), busy_before
        finally:
            await plane.close()  # type: ignore[attr-defined]

    wall, cpu, busy_before = run_async(run())
    spent = [after - before for after, before in zip(_shard_busy_each(shards), busy_before, strict=True)]
    return {"wall_ms": median(wall) * 1e3, "cpu_ms": cpu * 1e3, "attention_ms": max(spent) / len(wall) * 1e3}


def _shard_busy_each(shards: list[ServiceProcess]) -> list[float]:
    """Each shard's total attention seconds so far."""
    busy = []
    for s in shards:
        ch = sync_channel(s.address)
        busy.append(
            kv_grpc.KVAttentionStub(ch).Stats(kv_pb.StatsRequest(), timeout=10).attention_busy_seconds
        )
        ch.close()
    return busy


def layer_transport_s(
    cfg: ModelConfig,
    batch: int,
    shards: int,
    threads: int,
    repeats: int = 60,
    env: dict[str, str] | None = None,
    busy_s: float = 0.0,
) -> float:
    """Seconds one layer's Attend round trips to `shards` shard processes add beyond the slowest
    shard's attention, through gpu_dense's own ShardPlane: what the planner adds per layer
    (`busy_s`: the dense compute between round trips, see round_trips)."""
    with bench_workdir("rtt") as workdir:
        procs = start_shards(shards, workdir, env, threads)
        try:
            r = round_trips(cfg, batch, procs, repeats, busy_s=busy_s)
        finally:
            stop_processes(procs, 10.0)
    return max(0.0, (r["wall_ms"] - r["attention_ms"]) / 1e3)


def run_breakdown(
    cfg: ModelConfig,
    batch: int = 32,
    repeats: int = 200,
    shard_counts: tuple[int, ...] = (1, 2, 4, 8),
    plane_factory: PlaneFactory = _default_plane,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = dict(pieces(cfg, batch))
    out_bytes, back_bytes = int(out["request_bytes"]), int(out["response_bytes"])
    out["echo_rt_ms"] = median(grpc_echo_s(out_bytes, back_bytes, repeats)) * 1e3
    out["tcp_echo_rt_ms"] = median(tcp_echo_s(out_bytes, back_bytes, repeats)) * 1e3
    with bench_workdir("breakdown") as workdir:
        shards = start_shards(max(shard_counts), workdir, env)
        try:
            for n in shard_counts:
                r = round_trips(cfg, batch, shards[:n], repeats, plane_factory)
                if n == 1:
                    out["attend_rt_ms"] = r["wall_ms"] - r["attention_ms"]
                    out["shard_attention_ms"] = r["attention_ms"]
                out[f"layer_rt_ms_{n}_shards"] = r["wall_ms"]
                out[f"dense_cpu_ms_per_rt_{n}_shards"] = r["cpu_ms"]
                if n > 1 and plane_factory is _default_plane:  # the links' concurrent fan-out, same shards
                    c = round_trips(cfg, batch, shards[:n], repeats, _concurrent_plane)
                    out[f"layer_rt_ms_{n}_shards_concurrent"] = c["wall_ms"]
                    out[f"dense_cpu_ms_per_rt_{n}_shards_concurrent"] = c["cpu_ms"]
        finally:
            stop_processes(shards, 10.0)
    out["attend_rt_vs_echo"] = out["attend_rt_ms"] / out["echo_rt_ms"]
    return out
