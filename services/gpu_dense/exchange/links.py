"""Data-plane links from gpu_dense to the kv_attention shards: the Attend streams in this process.

One persistent bidi Attend stream per shard and mini-batch slot. A slot has one layer in
flight at a time and a shard answers a stream in order, so the dense side writes each item
straight onto the stream and reads its answer straight back: no request iterator fed by a
queue, no reader task, no future or timer per item. A layer's items go out to all its shards
before the first answer is awaited. Timeouts are one watchdog per plane: a stream that keeps an
item longer than the shard timeout is cancelled, and its item fails as UNAVAILABLE. Requests go
out as wire bytes built by codec.serialize_with (q, k and v copied once, from the tensors into the
bytes); answers are parsed as AttendResponse messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import grpc
import torch

from fastdecode.dense import AttendItem, LayerPlane
from fastdecode.kv import AttendBatch
from fastdecode.protocol import DATA_PLANE_OPTIONS
from fastdecode.runtime.errors import InvalidInput, NotFound, ServiceError, Unavailable
from fastdecode.runtime.rpc import TLSFiles, aio_channel, code_from_int
from fastdecode.runtime.rpc import error_from_status as from_status
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.wire.kv import attend_request, item_fields, parse_response

log = logging.getLogger("fastdecode.gpu_dense.shards")

_ids = itertools.count(1)
ATTEND_METHOD = f"/{kv_pb.DESCRIPTOR.services_by_name['KVAttention'].full_name}/Attend"


# grpc.aio's stand-in status when a write races the server closing the stream (say, refusing a
# wrong fleet secret): the server's own status is overwritten, the next stream sees it again
_STATUS_LOST = "Internal error from Core"


class _Stream:
    """One Attend stream; `since` is when its unanswered item went out (None when idle)."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.since: float | None = None
        self.expired = False


class AttendLink:
    """A shard's Attend streams, one per slot (the data plane's link; the scheduler's control link to
    a shard is its ShardLink). A broken stream fails its item and reopens lazily."""

    def __init__(self, index: int, address: str, tls: TLSFiles | None = None, timeout: float = 60.0) -> None:
        self.index = index
        self.address = address
        self.tls = tls
        self.timeout = timeout
        self.channel = aio_channel(address, tls, DATA_PLANE_OPTIONS)
        # requests are already wire bytes (no serializer); answers come as wire bytes too and parse
        # in place (parse_response): o's data is not copied out of them
        self._attend = self.channel.stream_stream(
            ATTEND_METHOD, request_serializer=None, response_deserializer=None
        )
        self._streams: dict[int, _Stream] = {}
        self._fields: dict[int, tuple[AttendBatch, bytes]] = {}  # per slot: the last item's fields
        self.removed = False  # RemoveShard: an item for it fails UNAVAILABLE, nothing is dialled

    @property
    def name(self) -> str:
        return f"shard {self.index} ({self.address})"

    def _lost(self, slot: int, stream: _Stream, exc: BaseException) -> Unavailable:
        if self._streams.get(slot) is stream:
            del self._streams[slot]  # the next item reopens the stream
        stream.call.cancel()
        if stream.expired:
            reason = f"{self.name} did not answer within {self.timeout:g}s"
        elif isinstance(exc, grpc.aio.AioRpcError):
            reason = f"{self.name} unavailable: {exc.code().name}: {exc.details()}"
            if exc.details() == _STATUS_LOST:
                reason += " (the shard closed the stream during the write; gRPC lost its status)"
        else:
            reason = f"{self.name} unavailable: {exc or type(exc).__name__}"
        log.warning("%s stream lost: %s", self.name, reason)
        return Unavailable(reason)

    async def send(self, slot: int, layer: int, item: AttendItem) -> int:
        """Write one item on the slot's stream; returns its request id."""
        if self.removed:
            raise Unavailable(f"{self.name} was removed")
        stream = self._streams.get(slot)
        if stream is not None and stream.since is not None:
            # The last item's answer was never read: its step was cancelled (a scheduler that
            # died mid-step) between send and receive. Its answer would arrive first and be taken
            # for this item's, so this item goes out on a fresh stream instead.
            stream.call.cancel()
            stream = None
        if stream is None:
            stream = self._streams[slot] = _Stream(self._attend())
        request_id = next(_ids)
        kept, batch = self._fields.get(slot), item.batch
        if kept is None or kept[0] is not batch:  # a step's layers send the same item objects
            kept = self._fields[slot] = (batch, item_fields(batch))
        data = attend_request(layer, batch, request_id, kept[1])
        stream.since = time.monotonic()
        try:
            await stream.call.write(data)
            return request_id
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and not stream.expired:
                raise
            raise self._lost(slot, stream, e) from None

    async def receive(self, slot: int, request_id: int) -> torch.Tensor:
        stream = self._streams.get(slot)
        if stream is None:  # send failed and already reported the loss
            raise Unavailable(f"{self.name} unavailable: stream closed")
        try:
            resp = await stream.call.read()
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and not stream.expired:
                raise
            raise self._lost(slot, stream, e) from None
        if resp is grpc.aio.EOF:
            raise self._lost(slot, stream, Unavailable("stream ended"))
        stream.since = None
        try:
            head, o = parse_response(resp)
        except InvalidInput as e:  # a garbled answer: the stream cannot be trusted any more
            raise self._lost(slot, stream, e) from None
        if head.request_id != request_id:  # a shard answers a stream in order; anything else is a bug
            raise self._lost(slot, stream, Unavailable(f"answer {head.request_id} for item {request_id}"))
        if head.error.code:
            raise from_status(code_from_int(head.error.code), f"{self.name}: {head.error.message}")
        if o is None:
            raise self._lost(slot, stream, Unavailable(f"answer {request_id} carries no o"))
        return o

    def expire(self, now: float) -> None:
        """Cancel every stream whose item is older than the timeout (its reader then fails it)."""
        for stream in self._streams.values():
            if stream.since is not None and now - stream.since > self.timeout and not stream.expired:
                stream.expired = True
                stream.call.cancel()

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.call.cancel()
        self._streams.clear()
        await self.channel.close()


class ShardLinks(LayerPlane[AttendItem]):
    """gpu_dense's shard plane in this process: every shard's link, and the per-layer fan-out over
    them (also what an exchange worker runs). Of LayerPlane's capabilities it has none: the event loop
    that runs the streams awaits each layer, after the runner waited for the device."""

    attend_layer_at = None
    attend_layer_blocking = None
    staging = None

    def __init__(
        self,
        links: list[AttendLink],
        concurrent: bool = False,
        tls: TLSFiles | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.links = links
        self.tls = tls  # for shards added later (add_shard)
        self.timeout = timeout
        # concurrent: with several shards in a layer, run their exchanges side by side (one task
        # each), so every stream's write and read are posted at once and completions can share loop
        # wake-ups; in order (the default, the measured path), each shard adds its poller round
        # trips to the layer. Off until `bench transport --breakdown` shows it pays on a host.
        self.concurrent = concurrent
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def num_shards(self) -> int:
        return len(self.links)

    def add(self, link: AttendLink) -> None:
        self.links.append(link)

    async def add_shard(self, address: str) -> int:
        index = len(self.links)
        self.links.append(AttendLink(index, address, self.tls, self.timeout))
        return index

    async def remove(self, index: int) -> None:
        """Close a removed shard's streams; its index stays taken, so no other shard's moves."""
        if not 0 <= index < len(self.links):
            raise NotFound(f"unknown shard {index}")
        link = self.links[index]
        if not link.removed:
            link.removed = True
            await link.close()
            log.info("removed %s", link.name)

    async def restore(self, index: int) -> None:
        """AddShard of a removed shard's address (a restarted pod): a fresh link at the same index."""
        self.reopen(index)

    def reopen(self, index: int) -> None:
        """restore, for the exchange worker's control messages (applied in order, none awaited)."""
        old = self.links[index]
        if old.removed:
            self.links[index] = AttendLink(index, old.address, old.tls, old.timeout)
            log.info("re-added %s", old.name)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, min((x.timeout for x in self.links), default=1.0) / 4))
            now = time.monotonic()
            for link in self.links:
                link.expire(now)

    async def attend_layer(
        self,
        slot: int,
        layer: int,
        items: Sequence[AttendItem],
        between: Callable[[], None] | None = None,
    ) -> list[torch.Tensor | BaseException]:
        """`between` runs once every request is out and before the first answer is awaited (the
        share of a shard hosted in this process, host_shard.py)."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        if self.concurrent and len(items) > 1:
            tasks = [asyncio.ensure_future(self._exchange(slot, layer, item)) for item in items]
            if between is not None:
                await asyncio.sleep(0)  # each task posts its write
                between()
            return list(await asyncio.gather(*tasks))
        out: list[torch.Tensor | BaseException] = []
        sent: list[int | None] = []
        for item in items:  # all requests out before the first answer is awaited
            try:
                sent.append(await self.links[item.shard].send(slot, layer, item))
            except ServiceError as e:
                sent.append(None)
                out.append(e)
                continue
            out.append(torch.empty(0))  # placeholder, replaced by the answer
        if between is not None:
            between()
        for i, (item, rid) in enumerate(zip(items, sent, strict=True)):
            if rid is None:
                continue
            try:
                out[i] = await self.links[item.shard].receive(slot, rid)
            except ServiceError as e:
                out[i] = e
        return out

    async def _exchange(self, slot: int, layer: int, item: AttendItem) -> torch.Tensor | BaseException:
        link = self.links[item.shard]
        try:
            return await link.receive(slot, await link.send(slot, layer, item))
        except ServiceError as e:
            return e

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        for link in self.links:
            await link.close()
