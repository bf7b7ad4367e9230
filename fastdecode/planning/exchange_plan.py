"""Plan a GPU host's exchange: how many shards and exchange workers a batch needs, and what limits
the step. Pure arithmetic over measured inputs (docs/exchange.md has a worked example):

- from `bench exchange` (any geometry: the costs are per MB of payload):
  `inproc_ms_per_mb`  the dense process's CPU per MB with the Attend streams in process (K=0),
  `dense_ms_per_mb`   the dense process's CPU per MB with exchange workers (the shared-memory copies),
  `worker_ms_per_mb`  the workers' CPU per MB (gRPC, protobuf, the codec): spread over K workers,
  `worker_gbps`       payload GB/s one worker's streams sustained (rt minus the shards' attention);
- `dense_step_ms[B]`, the GPU's S-part for a whole step at batch B (all layers: measured, or a vendor
  figure), and the model's geometry (payload per layer and layer count).

Per layer, with P = payload MB, T = dense_step_ms / layers, K workers (each owns >= 1 shard):
  in process:   the dense process also runs the exchange: layer >= T + P * inproc (it cannot overlap
                its own CPU; a GPU S-part launched async overlaps, so take max(T, P * inproc) as the
                floor and T + P * inproc as the ceiling, reported as the in-process step);
  with workers: dense CPU P * dense (overlaps the GPU), workers P * worker / K and P / (K * gbps)
                each, all in parallel with the GPU under the two-mini-batch pipeline:
                layer = max(T, P * dense, P * worker / K, P / (K * gbps) * 1e3).
  K needed = the least K with P * worker / K <= T and P / (K * gbps) <= T, capped by the cores
  left to workers (cores - 1 for the dense loop) and at least the shards the attention needs.
The attention itself (the shards' R-part) is planned by `planner.plan`; `shards` here is the floor the
exchange needs (one per worker) unless more are given.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import Geometry


@dataclass(frozen=True)
class ExchangeCosts:
    inproc_ms_per_mb: float
    dense_ms_per_mb: float
    worker_ms_per_mb: float
    worker_gbps: float
    source: str = "given"

    @classmethod
    def from_bench(cls, result: Mapping[str, Any], source: str = "bench exchange") -> ExchangeCosts:
        """Medians over a `bench exchange --json` result's rows (K=0 rows, and K>=1 rows)."""
        rows = result.get("rows") if isinstance(result, Mapping) else None
        if not rows:
            raise InvalidInput("the bench exchange result has no rows")
        try:
            off = [r for r in rows if r["workers"] == 0]
            on = [r for r in rows if r["workers"] >= 1]
            one = [r for r in on if r["workers"] == 1] or on
            if not off or not on:
                raise InvalidInput("the bench exchange result needs rows with 0 workers and with >= 1")
            return cls(
                inproc_ms_per_mb=statistics.median(r["dense_cpu_ms_per_mb"] for r in off),
                dense_ms_per_mb=statistics.median(r["dense_cpu_ms_per_mb"] for r in on),
                worker_ms_per_mb=statistics.median(r["worker_cpu_ms_per_mb"] for r in on),
                worker_gbps=statistics.median(r["gbps"] for r in one),
                source=source,
            )
        except (KeyError, TypeError) as e:
            raise InvalidInput(f"not a bench exchange result: missing {e}") from None


@dataclass(frozen=True)
class HostPlan:
    geometry: str
    batch: int
    dtype_bytes: int
    payload_mb_per_layer: float
    layers: int
    dense_step_ms: float
    gpu_layer_ms: float
    inproc_exchange_ms_per_layer: float
    inproc_step_ms: float
    exchange_workers: int
    shards: int
    cores: int
    dense_copy_ms_per_layer: float
    worker_ms_per_layer: float
    wire_ms_per_layer: float
    predicted_step_ms: float
    predicted_tokens_per_s: float
    limiting_factor: str
    costs_from: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_step_ms(spec: str) -> dict[int, float]:
    """`256=10,1024=31` -> {256: 10.0, 1024: 31.0}."""
    out: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        b, sep, ms = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(b)] = float(ms)
        except ValueError:
            raise InvalidInput(f"--dense-step-ms wants BATCH=MS[,BATCH=MS...], got {part!r}") from None
    if not out or min(out) < 1 or min(out.values()) <= 0:
        raise InvalidInput("--dense-step-ms needs at least one BATCH=MS with BATCH >= 1 and MS > 0")
    return out


def plan_host(
    g: Geometry,
    batch: int,
    dense_step_ms: float,
    costs: ExchangeCosts,
    cores: int,
    dtype_bytes: int = 2,
    min_shards: int = 1,
) -> HostPlan:
    if batch < 1 or dense_step_ms <= 0 or cores < 2 or dtype_bytes < 1 or min_shards < 1:
        raise InvalidInput("batch >= 1, dense step > 0 ms, cores >= 2, dtype bytes >= 1, shards >= 1")
    if (
        min(costs.dense_ms_per_mb, costs.worker_ms_per_mb, costs.inproc_ms_per_mb) < 0
        or costs.worker_gbps <= 0
    ):
        raise InvalidInput("exchange costs must be >= 0 and the worker's GB/s > 0")
    layers = g.num_layers
    p = g.payload_bytes(batch, dtype_bytes) / 1e6
    t = dense_step_ms / layers
    inproc = p * costs.inproc_ms_per_mb
    worker_total = p * costs.worker_ms_per_mb
    wire_one = p / costs.worker_gbps  # ms: MB / (GB/s) = ms
    need = max(1, math.ceil(max(worker_total, wire_one) / t))
    k = min(need, cores - 1)
    shards = max(k, min_shards)
    dense_copy = p * costs.dense_ms_per_mb
    parts = {
        "gpu (dense S-part)": t,
        "dense process copies": dense_copy,
        "exchange workers' CPU": worker_total / k,
        "wire (per-worker GB/s)": wire_one / k,
    }
    limit = max(parts, key=parts.__getitem__)
    if limit in ("exchange workers' CPU", "wire (per-worker GB/s)") and need > k:
        limit += f" (needs {need} workers, the host has {cores - 1} cores for them)"
    step = layers * max(parts.values())
    return HostPlan(
        geometry=g.name,
        batch=batch,
        dtype_bytes=dtype_bytes,
        payload_mb_per_layer=p,
        layers=layers,
        dense_step_ms=dense_step_ms,
        gpu_layer_ms=t,
        inproc_exchange_ms_per_layer=inproc,
        inproc_step_ms=layers * (t + inproc),
        exchange_workers=k,
        shards=shards,
        cores=cores,
        dense_copy_ms_per_layer=dense_copy,
        worker_ms_per_layer=worker_total / k,
        wire_ms_per_layer=wire_one / k,
        predicted_step_ms=step,
        predicted_tokens_per_s=batch / step * 1e3,
        limiting_factor=limit,
        costs_from=costs.source,
    )


def plan_hosts(
    g: Geometry,
    step_ms: Mapping[int, float],
    costs: ExchangeCosts,
    cores: int,
    dtype_bytes: int = 2,
    batches: Sequence[int] | None = None,
    min_shards: int = 1,
) -> list[HostPlan]:
    chosen = list(batches) if batches else sorted(step_ms)
    missing = [b for b in chosen if b not in step_ms]
    if missing:
        raise InvalidInput(f"no --dense-step-ms given for batch {missing}")
    return [plan_host(g, b, step_ms[b], costs, cores, dtype_bytes, min_shards) for b in chosen]
