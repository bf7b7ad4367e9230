"""A kv_attention shard served in process on port 0, with a fleet secret: a Reserve of the geometry
(2^31-1)^3 (one took 23 GB and the OOM killer, twice) is RESOURCE_EXHAUSTED within a second with the
process's RSS flat, on a fresh shard, an idle one and a busy one, and the shard then serves as
before; a geometry of nonsense is INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import os
import time

import grpc

from fastdecode.benchmarks.common import proc_status_bytes
from fastdecode.runtime.rpc import aio_channel
from fastdecode.runtime.settings import ShardSettings
from fastdecode.v1 import kv_attention_pb2 as pb
from fastdecode.v1 import kv_attention_pb2_grpc as pb_grpc
from services.kv_attention.server import build

TOP = (1 << 31) - 1
HUGE = pb.KVGeometry(num_layers=TOP, num_kv_heads=TOP, head_dim=TOP)
REAL = pb.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8)
SECRET = "issue-54-fleet-secret-0123456789"


def rss_bytes() -> int:
    return proc_status_bytes(os.getpid()) or 0


def reserve(geometry: pb.KVGeometry, seq_id: str) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        geometry=geometry, sequences=[pb.SequenceReservation(seq_id=seq_id, max_tokens=16)]
    )


def test_the_int32_geometry_is_refused_within_a_second_rss_flat() -> None:
    async def run() -> None:
        settings = ShardSettings(
            host="127.0.0.1", port=0, kv_capacity=64 << 20, attention_backend="torch", fleet_secret=SECRET
        )
        server, _ = build(settings)
        await server.start()
        channel = aio_channel(f"127.0.0.1:{server.port}", settings.tls)
        stub = pb_grpc.KVAttentionStub(channel)

        async def refused(geometry: pb.KVGeometry) -> tuple[grpc.StatusCode, float, int, str]:
            before, t0 = rss_bytes(), time.perf_counter()
            try:
                await stub.Reserve(reserve(geometry, "intruder"), timeout=30)
            except grpc.aio.AioRpcError as e:
                return e.code(), time.perf_counter() - t0, rss_bytes() - before, e.details() or ""
            raise AssertionError("the Reserve was accepted")

        try:
            for state in ("fresh", "busy", "idle"):
                if state == "busy":
                    await stub.Reserve(reserve(REAL, "a"), timeout=30)
                elif state == "idle":
                    await stub.Release(pb.ReleaseRequest(all=True), timeout=30)
                code, seconds, grew, details = await refused(HUGE)
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (state, code, details)
                assert seconds < 1.0 and grew < 50 << 20, (state, seconds, grew)
                assert "one block" in details, details
            for nonsense in (
                pb.KVGeometry(num_layers=0, num_kv_heads=1, head_dim=8),
                pb.KVGeometry(num_layers=TOP, num_kv_heads=-1, head_dim=8),
                pb.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, attn_logit_softcap=float("nan")),
                pb.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, layer_windows=[1] * 100_000),
            ):
                code, seconds, _, details = await refused(nonsense)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and seconds < 1.0, (code, details)
            # the shard serves as before: its pool of the fleet's geometry takes a sequence
            answer = await stub.Reserve(reserve(REAL, "b"), timeout=30)
            assert answer.free_tokens > 0
            stats = await stub.Stats(pb.StatsRequest(), timeout=30)
            assert stats.sequences == 1 and stats.configured
        finally:
            await channel.close()
            await server.stop()

    asyncio.run(asyncio.wait_for(run(), 120))
