"""gpu_dense's shard links against an in-process gRPC shard: answers come back per item and slot, a
shard that keeps an item past the timeout fails only that item (the watchdog cancels its stream),
an in-band error stays in-band, and the next layer reopens the stream. Each behaviour holds in
process and through exchange worker processes (services/gpu_dense/exchange/plane.py, K=1 and K=2)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from fastdecode.dense import AttendItem
from fastdecode.kv import AttendBatch
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput, Unavailable
from fastdecode.v1 import kv_attention_pb2 as pb
from fastdecode.v1 import kv_attention_pb2_grpc as pb_grpc
from fastdecode.wire.errors import item_error
from fastdecode.wire.kv import attend_request
from services.gpu_dense.exchange.links import AttendLink, ShardLinks
from services.gpu_dense.exchange.plane import ExchangePlane
from tests.support.native_exchange import require_native_worker

HANG_LAYER = 7
BAD_LAYER = 9
SLOW_LAYER = 11


class EchoShard(pb_grpc.KVAttentionServicer):
    """o = q * 2 flattened; BAD_LAYER gets an in-band error; a `hangs` shard never answers HANG_LAYER."""

    def __init__(self, hangs: bool = False) -> None:
        self.streams = 0
        self.hangs = hangs

    async def Attend(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        self.streams += 1
        while (req := await context.read()) is not grpc.aio.EOF:
            if req.layer == HANG_LAYER and self.hangs:
                await asyncio.sleep(3600)
            if req.layer == SLOW_LAYER:
                await asyncio.sleep(0.3)
            resp = pb.AttendResponse(request_id=req.request_id)
            if req.layer == BAD_LAYER:
                resp.error.CopyFrom(item_error(InvalidInput("bad item")))
            else:
                q = codec.decode(req.q)
                codec.encode((q * 2).reshape(q.shape[0], -1), resp.o)
            await context.write(resp)


def _item(shard: int, value: float) -> AttendItem:
    q = torch.full((2, 3, 4), value)
    kv = torch.zeros(2, 1, 4)
    return AttendItem(shard, AttendBatch(["a", "b"], [1, 1], [0, 0], q, kv, kv))


PLANES = ["in-order", "concurrent", "workers-1", "workers-2", "native-1", "native-2"]


async def _plane(kind: str, addresses: list[str], timeout: float) -> ShardLinks | ExchangePlane:
    """in-order/concurrent: links in process; workers-K: K Python exchange workers; native-K: K native
    ones (services/gpu_dense/exchange/native, required where FASTDECODE_REQUIRE_NATIVE_EXCHANGE=1, as in
    CI)."""
    if kind.startswith(("workers-", "native-")):
        worker, k = kind.split("-")
        if worker == "native":
            require_native_worker()
        plane = ExchangePlane(
            addresses, int(k), timeout=timeout, kind="python" if worker == "workers" else "native"
        )
        await plane.start()
        return plane
    links = [AttendLink(i, a, timeout=timeout) for i, a in enumerate(addresses)]
    return ShardLinks(links, concurrent=kind == "concurrent")


@pytest.mark.parametrize("kind", PLANES)
def test_links_answer_time_out_and_recover(kind: str) -> None:
    async def run() -> None:
        shards = [EchoShard(), EchoShard(hangs=True)]
        servers, addresses = [], []
        for s in shards:
            server = grpc.aio.server()
            pb_grpc.add_KVAttentionServicer_to_server(s, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        # 2 s: a loaded CI host once took over 0.5 s for a new worker's first answer (a fresh stream)
        plane = await _plane(kind, addresses, timeout=2.0)
        try:
            outs = await asyncio.gather(
                plane.attend_layer(0, 0, [_item(0, 1.0), _item(1, 2.0)]),
                plane.attend_layer(1, 0, [_item(0, 3.0), _item(1, 4.0)]),
            )
            for out, (x, y) in zip(outs, ((1.0, 2.0), (3.0, 4.0)), strict=True):
                assert torch.equal(out[0], torch.full((2, 12), 2 * x))
                assert torch.equal(out[1], torch.full((2, 12), 2 * y))
            assert [s.streams for s in shards] == [2, 2]  # one stream per slot, reused

            bad = await plane.attend_layer(0, BAD_LAYER, [_item(0, 1.0)])
            assert isinstance(bad[0], InvalidInput) and "shard 0" in str(bad[0])
            assert shards[0].streams == 2  # an in-band error keeps the stream

            hung = _item(1, 1.0)
            out = await asyncio.wait_for(plane.attend_layer(0, HANG_LAYER, [_item(0, 5.0), hung]), 10)
            assert torch.equal(out[0], torch.full((2, 12), 10.0))
            assert isinstance(out[1], Unavailable) and "did not answer within" in str(out[1])

            out = await plane.attend_layer(0, 1, [_item(1, 6.0)])  # a new stream for the next layer
            assert torch.equal(out[0], torch.full((2, 12), 12.0))
            assert shards[1].streams == 3

            await servers[0].stop(None)  # a lost shard fails its item as UNAVAILABLE, not the layer
            out = await plane.attend_layer(1, 2, [_item(0, 1.0), _item(1, 1.0)])
            assert isinstance(out[0], Unavailable) and "shard 0" in str(out[0])
            assert torch.equal(out[1], torch.full((2, 12), 2.0))
        finally:
            await plane.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 120))


@pytest.mark.parametrize("layer", [0])
def test_request_carries_the_item(layer: int) -> None:
    req = pb.AttendRequest.FromString(attend_request(layer, _item(0, 1.5).batch, 9))
    assert req.request_id == 9
    assert list(req.seq_ids) == ["a", "b"] and list(req.num_tokens) == [1, 1] and req.layer == layer
    assert torch.equal(codec.decode(req.q), torch.full((2, 3, 4), 1.5))


@pytest.mark.parametrize("kind", ["in-order", "workers-1", "native-1"])
def test_a_step_cancelled_mid_layer_leaves_no_stale_answer(kind: str) -> None:
    """A step cancelled after its items went out (its scheduler died) leaves their answers unread;
    the next layer on the same slot must get its own answers, not be failed by the stale ones."""

    async def run() -> None:
        shard = EchoShard()
        server = grpc.aio.server()
        pb_grpc.add_KVAttentionServicer_to_server(shard, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        plane = await _plane(kind, [f"127.0.0.1:{port}"], timeout=5.0)
        try:
            step = asyncio.ensure_future(plane.attend_layer(0, SLOW_LAYER, [_item(0, 1.0)]))
            await asyncio.sleep(0.1)  # the item is out, its answer 0.2 s away
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            out = await plane.attend_layer(0, 0, [_item(0, 7.0)])
            assert torch.equal(out[0], torch.full((2, 12), 14.0))
            assert shard.streams == 2  # the cancelled step's stream was replaced
        finally:
            await plane.close()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 90))
