"""`bench split`'s fleet: its settings, the shards and gpu_dense it starts (pinned per the host
layout), the plans it sends and the KV it fills them with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.hosts import HostLayout, Isolation, pin_command, thread_env
from fastdecode.contract import PlannedSeq
from fastdecode.model import ModelConfig
from fastdecode.tools.fleet import ServiceProcess, spawn_service, start_service, wait_ready
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire import dense as dense_wire


@dataclass
class Setup:
    model: Path
    cfg: ModelConfig
    batch: int
    kv_dtype: str
    layout: HostLayout
    iso: Isolation
    pipeline: str
    steps: int
    warmup: int
    workdir: Path
    seed: int
    nice: int = 0
    device: str = "cpu"
    host_share: float | None = None  # None: auto (planner.best_host_share); 0: no hosted shard


@dataclass
class Carry:
    """The exchange's CPU per round trip (dense side, shard side) measured at the last context: the
    next context's auto host share is planned with it (the first one with none)."""

    exchange_rt_s: tuple[float, float] = (0.0, 0.0)


def shard_rows(batch: int, shards: int) -> list[range]:
    return [range(i * batch // shards, (i + 1) * batch // shards) for i in range(shards)]


def step_plan(
    step: int, ids: list[str], owner: list[int], tokens: list[int], pos: int, pipeline: bool
) -> Any:
    seqs = [
        PlannedSeq(sid, owner[i], i % 2 if pipeline else 0, [tok], pos, sample_index=step)
        for i, (sid, tok) in enumerate(zip(ids, tokens, strict=True))
    ]
    return dense_wire.plan_to_proto(step, seqs, pipeline)


def start_shards(s: Setup, capacity: int) -> list[ServiceProcess]:
    pending = []
    for i, cpus in enumerate(s.layout.shards):
        args = ["kv-attention", "--shard-id", str(i), "--kv-capacity", str(capacity)]
        args += ["--kv-dtype", s.kv_dtype, "--threads", str(len(cpus))]
        pending.append(
            spawn_service(
                f"kv_attention-{i}",
                args,
                s.workdir,
                host=s.iso.shard_hosts[i],
                env=thread_env(cpus),
                prefix=s.iso.shard_prefix[i] + pin_command(cpus, s.nice),
            )
        )
    return [wait_ready(p, 180.0) for p in pending]


def start_dense(
    s: Setup, shards: list[ServiceProcess], hosted: str | None, capacity: int, extra: list[str] | None = None
) -> ServiceProcess:
    # On a GPU (or an emulated one) the S-part needs one thread (launches): the dense host's other
    # CPUs are left to the exchange workers, which gpu_dense's auto count then takes
    # (services/gpu_dense/exchange.py).
    threads = s.layout.dense_threads if s.device == "cpu" else 1
    addresses = [p.address for p in shards] + ([hosted] if hosted else [])
    args = ["gpu-dense", "--model", str(s.model), "--device", s.device]
    args += ["--shards", ",".join(addresses), "--threads", str(threads), *(extra or ())]
    if hosted:  # the dense host's share of the attention, in gpu_dense's process
        args += ["--host-shard", str(len(shards)), "--host-shard-kv-capacity", str(capacity)]
        args += ["--host-shard-kv-dtype", s.kv_dtype]
    if s.pipeline == "auto":
        args += ["--pipeline-mode", "auto"]
    return start_service(
        "gpu_dense",
        args,
        s.workdir,
        host=s.iso.dense_host,
        env=thread_env(s.layout.dense),
        timeout=180.0,
        prefix=pin_command(s.layout.dense, s.nice),
    )


async def busy_each(stubs: list[kv_grpc.KVAttentionStub]) -> list[float]:
    stats = await asyncio.gather(*(st.Stats(kv_pb.StatsRequest(), timeout=30) for st in stubs))
    return [x.attention_busy_seconds for x in stats]


def owners(batch: int, remote: int, hosted: int) -> list[int]:
    """Each row's shard: the first batch - hosted rows spread evenly over the remote shards, the
    last `hosted` on the hosted shard (index `remote`)."""
    owner = [remote] * batch
    for i, r in enumerate(shard_rows(batch - hosted, remote)):
        for j in r:
            owner[j] = i
    return owner


async def fill_owned(
    stubs: list[kv_grpc.KVAttentionStub],
    ids: list[str],
    owner: list[int],
    geometry: Any,
    max_tokens: int,
    context: int,
    seed: int,
) -> None:
    """Each shard's sequences (owner[i]: the shard of ids[i]) reserved and filled, all at once."""
    per_shard = [[x for x, o in zip(ids, owner, strict=True) if o == i] for i in range(len(stubs))]
    pairs = zip(stubs, per_shard, strict=True)
    await asyncio.gather(*(fill(st, mine, geometry, max_tokens, context, seed) for st, mine in pairs))


async def fill(
    stub: kv_grpc.KVAttentionStub, ids: list[str], geometry: Any, max_tokens: int, context: int, seed: int
) -> None:
    await stub.Release(kv_pb.ReleaseRequest(all=True), timeout=60)
    seqs = [kv_pb.SequenceReservation(seq_id=x, max_tokens=max_tokens) for x in ids]
    await stub.Reserve(kv_pb.ReserveRequest(geometry=geometry, sequences=seqs), timeout=60)
    await stub.Fill(kv_pb.FillRequest(seq_ids=ids, tokens=context, seed=seed), timeout=900)
