"""`fastdecode plan --gpu NAME --geometry G --pace FILE`: where the split beats the GPU alone.

Two ways to serve a model on one GPU, per context length S:

- the GPU alone holds its own KV: a step at batch B costs the roofline of one batch
  (emulated.Roofline, one pass over the weights) plus reading B*S tokens of KV from HBM; B is
  bounded by the GPU memory the weights leave.
- the split (FastDecode): the GPU runs the S-part in two mini-batches (each layer's weights read
  twice) while P shard hosts hold the KV and attend; a step lasts the longest of the GPU step,
  one shard's attention (B*S/P tokens of KV at `shard_gbps`) and the dense host's CPU work spread
  over its cores, and the scheduler's plan (unless it is planned a step ahead).

The dense host's CPU per step comes from units measured by `bench pace` (its last JSON line):
CPU per MB moved, per Attend round trip, and the scheduler's CPU per sequence. With two or more
points of different round-trip sizes the two dense units are fitted; with one, all of it is
charged per MB (the payload dominates at the batch sizes where the split pays).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fastdecode.dense.emulated import GIB, GPUProfile, Roofline, check_fits
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import Geometry


@dataclass(frozen=True)
class UnitCosts:
    ms_per_mb: float  # dense host CPU (main process + exchange workers) per MB of q, k, v, o
    us_per_round_trip: float  # dense host CPU per Attend round trip beyond its bytes
    scheduler_us_per_seq: float  # scheduler CPU per running sequence per step
    source: str = ""

    @classmethod
    def from_pace(cls, result: dict, source: str = "") -> UnitCosts:
        points = result.get("points") if isinstance(result, dict) else None
        if not points:
            raise InvalidInput(f"{source or 'pace result'}: no `points` (a `bench pace --json` last line)")
        rows = []
        sched = []
        for p in points:
            try:
                steps_cpu = p["cpu_ms_per_step"]["dense_main"] + p["cpu_ms_per_step"]["exchange_workers"]
                rows.append((p["round_trips_per_step"], p["payload_mb_per_step"], steps_cpu))
                sched.append(p["cpu_ms_per_step"]["scheduler"] * 1e3 / p["batch"])
            except (KeyError, TypeError, ZeroDivisionError) as e:
                raise InvalidInput(f"{source or 'pace result'}: a point lacks {e}") from None
        per_mb, per_rt = _fit(rows)
        return cls(per_mb, per_rt, max(sched), source)


def _fit(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """cpu = a * MB + b * trips, least squares over the points (b >= 0, a >= 0)."""
    mb_per_trip = {round(mb / max(t, 1e-9), 6) for t, mb, _ in rows}
    if len(rows) < 2 or len(mb_per_trip) < 2:
        return sum(c for *_, c in rows) / sum(mb for _, mb, _ in rows), 0.0
    stt = sum(t * t for t, _, _ in rows)
    smm = sum(m * m for _, m, _ in rows)
    stm = sum(t * m for t, m, _ in rows)
    sct = sum(c * t for t, _, c in rows)
    scm = sum(c * m for _, m, c in rows)
    det = smm * stt - stm * stm
    a = (scm * stt - sct * stm) / det
    b = (smm * sct - stm * scm) / det
    if a < 0 or b < 0:  # noise: fall back to all per MB
        return sum(c for *_, c in rows) / sum(mb for _, mb, _ in rows), 0.0
    return a, b * 1e3


@dataclass
class Point:
    batch: int
    context: int
    shards: int
    split_step_ms: float
    split_tokens_per_s: float
    gpu_alone_batch: int  # the largest batch the GPU's memory holds at this context (0: none)
    gpu_alone_tokens_per_s: float
    speedup: float
    dense_host_cores_needed: float
    limit: str  # what sets the split's step: gpu, shards or host

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_alone(roof: Roofline, context: int, kv_itemsize: int = 2) -> tuple[int, float]:
    """(batch, tokens/s) of the GPU holding its own KV at this context: the best batch its memory allows.
    With tensor parallelism, each of the N GPUs holds and reads its 1/N of the KV heads."""
    g = roof.geometry
    kv_token = 2 * g.num_layers * g.kv_heads * g.head_dim * kv_itemsize / roof.tensor_parallel
    room = roof.profile.memory_gib * GIB * 0.9 - roof.weight_bytes()
    best = (0, 0.0)
    most = int(room // (context * kv_token)) if room > 0 else 0
    for b in sorted({*(1 << i for i in range(most.bit_length())), most} - {0}):
        attn = b * context * kv_token / (roof.profile.hbm_gbps * 1e9) / roof.profile.efficiency
        step = roof.step_seconds(b, pipelined=False)["gpu_step_s"] + attn
        if b / step > best[1]:
            best = (b, b / step)
    return best


def plan_pace(
    profile: GPUProfile,
    geometry: Geometry,
    costs: UnitCosts,
    batches: list[int],
    contexts: list[int],
    shard_counts: list[int],
    shard_gbps: float = 150.0,
    cores: int = 16,
    itemsize: int = 2,
    tensor_parallel: int = 1,
) -> list[Point]:
    """`tensor_parallel`: the S-part over that many GPUs (and the GPU-alone baseline on as many)."""
    roof = Roofline(profile, geometry, itemsize, tensor_parallel)
    check_fits(roof)  # weights past the GPUs' memory: one line, not a plan
    g = geometry
    kv_token = 2 * g.num_layers * g.kv_heads * g.head_dim * itemsize
    out = []
    for s in contexts:
        alone_b, alone_tps = gpu_alone(roof, s, itemsize)
        for b in batches:
            gpu = roof.step_seconds(b)["gpu_step_s"] * 1e3
            mb = g.num_layers * g.payload_bytes(b, itemsize) / 1e6
            for p in shard_counts:
                trips = g.num_layers * 2 * p
                host_cpu = costs.ms_per_mb * mb + costs.us_per_round_trip * trips / 1e3
                attn = b * s * kv_token / p / (shard_gbps * 1e9) * 1e3
                host = host_cpu / cores
                step = max(gpu, attn, host)
                limit = "gpu" if step == gpu else "shards" if step == attn else "host"
                tps = b / step * 1e3
                speedup = tps / alone_tps if alone_tps else float("inf")
                # cores for the host work not to set the step (the GPU's or the shards' pace)
                needed = host_cpu / max(gpu, attn)
                out.append(Point(b, s, p, step, tps, alone_b, alone_tps, speedup, needed, limit))
    return out
