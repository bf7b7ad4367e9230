"""Data-plane links from gpu_dense to the kv_attention shards: one persistent bidi
Attend stream per shard, responses matched to requests by id."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from fastdecode.errors import Unavailable
from fastdecode.rpc import TLSFiles, aio_channel
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc

log = logging.getLogger("fastdecode.gpu_dense.shards")

_ids = itertools.count(1)


class ShardLink:
    """A shard's Attend stream. A broken stream fails its pending items and reopens lazily."""

    def __init__(self, index: int, address: str, tls: TLSFiles | None = None, timeout: float = 60.0) -> None:
        self.index = index
        self.address = address
        self.timeout = timeout
        self.channel = aio_channel(address, tls)
        self.stub = kv_grpc.KVAttentionStub(self.channel)
        self._queue: asyncio.Queue[kv_pb.AttendRequest | None] | None = None
        self._pending: dict[int, asyncio.Future[kv_pb.AttendResponse]] = {}
        self._reader: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"shard {self.index} ({self.address})"

    async def _requests(
        self, queue: asyncio.Queue[kv_pb.AttendRequest | None]
    ) -> AsyncIterator[kv_pb.AttendRequest]:
        while (item := await queue.get()) is not None:
            yield item

    def _open(self) -> asyncio.Queue[kv_pb.AttendRequest | None]:
        queue: asyncio.Queue[kv_pb.AttendRequest | None] = asyncio.Queue()
        call = self.stub.Attend(self._requests(queue))
        self._queue = queue
        self._reader = asyncio.create_task(self._read(call, queue))
        return queue

    async def _read(self, call: grpc.aio.StreamStreamCall, queue: asyncio.Queue) -> None:
        reason = "stream ended"
        try:
            async for resp in call:
                fut = self._pending.pop(resp.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            reason = "closed"
        if self._queue is queue:
            self._queue = None  # the next attend reopens the stream
        err = Unavailable(f"{self.name} unavailable: {reason}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        if reason != "closed":
            log.warning("%s stream lost: %s", self.name, reason)

    async def attend(self, req: kv_pb.AttendRequest) -> kv_pb.AttendResponse:
        queue = self._queue or self._open()
        req.request_id = next(_ids)
        fut: asyncio.Future[kv_pb.AttendResponse] = asyncio.get_running_loop().create_future()
        self._pending[req.request_id] = fut
        queue.put_nowait(req)
        try:
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            self._pending.pop(req.request_id, None)
            raise Unavailable(f"{self.name} did not answer within {self.timeout:.0f}s") from None

    async def close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
        await self.channel.close()
