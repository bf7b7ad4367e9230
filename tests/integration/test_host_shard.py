"""A shard hosted in gpu_dense's process (services/gpu_dense/exchange/host_shard.py) behind every kind of
inner plane (in-order links, concurrent links, exchange workers): its items are attended in process and
equal the same attention on a KVStore of their own, while the other shard's items still cross the
wire; an item it cannot serve fails alone and in-band; RemoveShard fails its items UNAVAILABLE and
AddShard of its address brings it back; its Stats over gRPC show what it attended, and the S-part
seconds gpu_dense reports on its cores. Behind exchange workers it forwards their staging: gpu_dense's
greedy tokens still equal LocalEngine's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.dense import AttendItem
from fastdecode.dense.engine import LocalEngine
from fastdecode.kv import AttendBatch, KVStore
from fastdecode.model import ModelConfig
from fastdecode.runtime.errors import NotFound, Unavailable
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import aio_channel, sync_channel
from fastdecode.runtime.settings import DenseSettings
from fastdecode.tools.fleet import free_port, start_service
from fastdecode.v1 import dense_pb2_grpc
from fastdecode.v1 import kv_attention_pb2 as pb
from fastdecode.v1 import kv_attention_pb2_grpc as pb_grpc
from fastdecode.wire.kv_control import geometry_to_proto
from services.gpu_dense.exchange.host_shard import HostShard, HostShardPlane
from tests.integration.test_data_plane import MAX_NEW, DataPlane
from tests.integration.test_shard_links import EchoShard, _item, _plane
from tests.support import PROMPTS

LAYERS, KV_HEADS, HEADS, DIM = 2, 1, 3, 4
IDS = ["h0", "h1"]


def _hosted_item(index: int, seed: int, seq_ids: list[str] = IDS) -> AttendItem:
    g = torch.Generator().manual_seed(seed)
    n = len(seq_ids)
    return AttendItem(
        index,
        AttendBatch(
            list(seq_ids),
            [1] * n,
            [0] * n,
            torch.randn(n, HEADS, DIM, generator=g),
            torch.randn(n, KV_HEADS, DIM, generator=g),
            torch.randn(n, KV_HEADS, DIM, generator=g),
        ),
    )


@pytest.mark.parametrize("kind", ["in-order", "concurrent", "workers-1"])
def test_hosted_items_attend_in_process_beside_remote_ones(kind: str, tmp_path: Path) -> None:
    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_KVAttentionServicer_to_server(EchoShard(), server)
        remote = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        hosted = f"127.0.0.1:{free_port()}"
        settings = DenseSettings(model=tmp_path, shards=f"{remote},{hosted}", host_shard_kv_capacity=1 << 20)
        host = HostShard(settings, 1, hosted)
        await host.start()
        plane = HostShardPlane(await _plane(kind, [remote, hosted], 5.0), host)
        ch = aio_channel(hosted)
        stub = pb_grpc.KVAttentionStub(ch)
        try:
            # reserved through the hosted shard's own gRPC port, as the scheduler does
            geometry = geometry_to_proto(KVGeometry(LAYERS, KV_HEADS, DIM))
            seqs = [pb.SequenceReservation(seq_id=s, max_tokens=8) for s in IDS]
            await stub.Reserve(pb.ReserveRequest(geometry=geometry, sequences=seqs), timeout=10)
            ref = KVStore(KVGeometry(LAYERS, KV_HEADS, DIM), 1 << 20, torch.float32)
            for s in IDS:
                ref.reserve(s, 8)
            for layer in range(LAYERS):
                item = _hosted_item(1, layer)
                out = await plane.attend_layer(0, layer, [_item(0, 1.0), item])
                assert torch.equal(out[0], torch.full((2, 12), 2.0))  # the remote shard's answer
                want = ref.attend(
                    layer, AttendBatch(IDS, [1, 1], [0, 0], item.batch.q, item.batch.k, item.batch.v)
                )
                assert torch.allclose(out[1], want, atol=1e-6), layer
            # only hosted items: no inner plane involved
            only = await plane.attend_layer(1, 0, [_hosted_item(1, 7)])
            assert only[0].shape == (2, HEADS * DIM)

            # a sequence it does not hold fails alone, in-band
            out = await plane.attend_layer(0, 0, [_item(0, 1.0), _hosted_item(1, 3, ["nope"])])
            assert torch.equal(out[0], torch.full((2, 12), 2.0))
            assert isinstance(out[1], NotFound) and "hosted" in str(out[1])

            await plane.remove(1)  # RemoveShard: its items fail UNAVAILABLE, nothing else changes
            out = await plane.attend_layer(0, 1, [_item(0, 1.0), _hosted_item(1, 4)])
            assert torch.equal(out[0], torch.full((2, 12), 2.0)) and isinstance(out[1], Unavailable)
            # Retire, the end of a drain: the hosted shard stops serving, the process goes on
            assert (await stub.Retire(pb.RetireRequest(), timeout=10)).sequences == 2
            health = health_pb2_grpc.HealthStub(ch)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status != serving
            await stub.Reserve(pb.ReserveRequest(geometry=geometry, sequences=seqs), timeout=10)
            await plane.restore(1)  # AddShard of its address: applied, serving again, when it returns
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == serving
            out = await plane.attend_layer(0, 1, [_hosted_item(1, 5)])
            assert not isinstance(out[0], BaseException)

            stats = await stub.Stats(pb.StatsRequest(), timeout=10)
            assert stats.sequences == 2 and stats.attended_token_pairs > 0
            host.count_dense_busy(0.25)  # what gpu_dense adds after a piped step
            assert (await stub.Stats(pb.StatsRequest(), timeout=10)).host_busy_seconds == 0.25
        finally:
            await ch.close()
            await plane.close()
            await host.stop()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 120))


def test_gpu_dense_refuses_a_hosted_shard_it_cannot_bind(tmp_path: Path) -> None:
    from fastdecode.runtime.errors import InvalidInput
    from services.gpu_dense.server import _host_shard

    for shards, index in (("127.0.0.1:5000", 1), ("127.0.0.1:0", 0), ("127.0.0.1", 0)):
        settings = DenseSettings(model=tmp_path, shards=shards, host_shard=index)
        with pytest.raises(InvalidInput):
            _host_shard(settings, shards.split(","))
    assert _host_shard(DenseSettings(model=tmp_path, shards="127.0.0.1:5000"), ["127.0.0.1:5000"]) is None


class HostedDataPlane(DataPlane):
    """gpu_dense (CPU) with shard 1 hosted in its process and shard 0 behind one exchange worker."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.config = ModelConfig.from_pretrained(model)
        kv = start_service(
            "kv0", ["kv-attention", "--shard-id", "0", "--kv-capacity", str(64 << 20)], workdir
        )
        self.procs = [kv]
        self.shard_addrs = [kv.address, f"127.0.0.1:{free_port()}"]
        args = ["--model", str(model), "--shards", ",".join(self.shard_addrs), "--device", "cpu"]
        args += ["--exchange-workers", "1", "--host-shard", "1", "--host-shard-kv-capacity", str(64 << 20)]
        self.dense_proc = start_service("dense", ["gpu-dense", *args], workdir)
        self.procs.append(self.dense_proc)
        self.dense = dense_pb2_grpc.DenseStub(sync_channel(self.dense_proc.address))
        self.shards = [pb_grpc.KVAttentionStub(sync_channel(a)) for a in self.shard_addrs]
        self._n = 0


def test_steps_over_a_hosted_shard_and_an_exchange_worker_equal_local_engine(
    model_factory: Callable, tmp_path: Path
) -> None:
    """The step runner over a hosted shard beside an exchange worker: the hosted plane forwards the
    worker's staging (q, k, v in shared memory, the hosted share read in place, the worker's o in
    its rows, the two assembled), and gpu_dense's greedy tokens are LocalEngine's."""
    plane = HostedDataPlane(model_factory("llama"), tmp_path)
    try:
        fleet = plane.greedy(PROMPTS)
    finally:
        plane.close()
    local = LocalEngine.from_pretrained(plane.model).generate(PROMPTS, MAX_NEW, ignore_eos=True)
    assert fleet == [g.token_ids for g in local]
