"""The scheduler driver's links over gRPC: gpu_dense (one persistent Run stream, reopened after a
failure) and each kv_attention shard. Every failure leaves as a domain error (fastdecode.runtime.errors)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.runtime.errors import ServiceError, Unavailable
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import aio_channel, maps_rpc_errors, request_metadata
from fastdecode.runtime.settings import TLSFiles
from fastdecode.scheduling import Reservation, Step
from fastdecode.scheduling.ports import DenseInfo, MigrationResult, ReattachResult, ShardState, StepOutcome
from fastdecode.v1 import dense_pb2, dense_pb2_grpc, kv_attention_pb2, kv_attention_pb2_grpc
from fastdecode.wire import dense as dense_wire
from fastdecode.wire import kv_control as kv_wire


class GrpcDenseLink:
    def __init__(self, address: str, tls: TLSFiles | None, step_timeout: float) -> None:
        self.address = address
        self.channel = aio_channel(address, tls)
        self.stub = dense_pb2_grpc.DenseStub(self.channel)
        self.step_timeout = step_timeout
        self.model_info: dense_pb2.ModelInfo | None = None  # as gpu_dense said it (GetModelInfo relays it)
        self._queue: asyncio.Queue[dense_pb2.StepPlan | None] | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._stream = 0  # which stream the plans go on: a reset starts the next
        self._reading = asyncio.Lock()  # results come in plan order: one reader at a time, FIFO

    @maps_rpc_errors(prefix=lambda self, *_: f"gpu_dense at {self.address}: ")
    async def info(self, timeout: float) -> DenseInfo:
        i = await self.stub.Info(dense_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)
        self.model_info = i
        return dense_wire.dense_info_from_proto(i)

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        """One plan over the persistent Run stream (reopened after a failure). Calls may overlap (a
        step planned ahead): plans go out in call order and each call reads its own result in turn;
        a call whose stream failed under an earlier one fails too."""
        if self._queue is None:
            queue: asyncio.Queue[dense_pb2.StepPlan | None] = asyncio.Queue()

            async def plans() -> AsyncIterator[dense_pb2.StepPlan]:
                while (p := await queue.get()) is not None:
                    yield p

            self._call = self.stub.Run(plans())
            self._queue = queue
        self._queue.put_nowait(dense_wire.step_plan(step, pipeline))
        stream = self._stream
        async with self._reading:
            if stream != self._stream:
                raise Unavailable(f"gpu_dense at {self.address} unavailable: the step stream failed")
            try:
                result = await self._read()
            except (ServiceError, TimeoutError) as e:
                self._reset()
                detail = e.message if isinstance(e, ServiceError) else "step timed out"
                raise Unavailable(f"gpu_dense at {self.address} unavailable: {detail}") from None
            if result is grpc.aio.EOF:
                self._reset()
                raise Unavailable(f"gpu_dense at {self.address} closed the step stream")
        return dense_wire.step_outcome_from_proto(result)

    @maps_rpc_errors
    async def _read(self) -> Any:
        assert self._call is not None
        return await asyncio.wait_for(self._call.read(), self.step_timeout)

    def _reset(self) -> None:
        if self._queue is not None:
            # End the plans() generator first: cancelling the call while gRPC's reader task awaits it
            # left "Task was destroyed" / "aclose(): already running" errors after repeated losses.
            self._queue.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        self._call, self._queue = None, None
        self._stream += 1

    async def close(self) -> None:
        self._reset()
        await self.channel.close()

    @maps_rpc_errors
    async def add_shard(self, address: str, timeout: float) -> int:
        resp = await self.stub.AddShard(dense_pb2.AddShardRequest(address=address), timeout=timeout)
        return int(resp.shard)

    @maps_rpc_errors(prefix=lambda self, *_: f"gpu_dense at {self.address}: ")
    async def remove_shard(self, index: int, timeout: float) -> None:
        await self.stub.RemoveShard(dense_pb2.DenseRemoveShardRequest(shard=index), timeout=timeout)


class GrpcShardLink:
    def __init__(self, address: str, tls: TLSFiles | None) -> None:
        self.address = address
        self.channel = aio_channel(address, tls)
        self.stub = kv_attention_pb2_grpc.KVAttentionStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def healthy(self, timeout: float) -> bool:
        try:
            return await self._serving(timeout)
        except ServiceError:  # not answering counts as not serving
            return False

    @maps_rpc_errors
    async def _serving(self, timeout: float) -> bool:
        resp = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    @maps_rpc_errors(prefix=lambda self, *_: f"shard {self.address}: ")
    async def stats(self, timeout: float) -> ShardState:
        st = await self.stub.Stats(kv_attention_pb2.StatsRequest(), timeout=timeout, wait_for_ready=True)
        return kv_wire.shard_state_from_proto(st)

    @maps_rpc_errors
    async def reserve(
        self, geometry: KVGeometry, seqs: list[Reservation], timeout: float, model: str = ""
    ) -> list[int]:
        req = kv_wire.reserve_request(geometry, seqs, model)
        resp = await self.stub.Reserve(
            req, timeout=timeout, metadata=request_metadata(*(s.seq_id for s in seqs))
        )
        # a shard without prefix sharing (or older) answers none: nothing cached
        return list(resp.cached_tokens) or [0] * len(seqs)

    @maps_rpc_errors
    async def release(self, seq_ids: list[str] | None, timeout: float) -> None:
        req = (
            kv_attention_pb2.ReleaseRequest(all=True)
            if seq_ids is None
            else kv_attention_pb2.ReleaseRequest(seq_ids=seq_ids)
        )
        await self.stub.Release(
            req,
            timeout=timeout,
            wait_for_ready=seq_ids is None,  # at start-up the shard may still be coming up
            metadata=request_metadata(*(seq_ids or ())),
        )

    @maps_rpc_errors(prefix=lambda self, *_: f"shard {self.address}: ")
    async def migrate_out(self, seq_id: str, target: str, tokens: int, timeout: float) -> MigrationResult:
        req = kv_attention_pb2.MigrateOutRequest(seq_id=seq_id, target=target, tokens=tokens)
        r = await self.stub.MigrateOut(req, timeout=timeout, metadata=request_metadata(seq_id))
        return MigrationResult(int(r.tokens), int(r.bytes), float(r.seconds))

    @maps_rpc_errors(prefix=lambda self, *_: f"shard {self.address}: ")
    async def reattach(
        self, geometry: KVGeometry, model: str, keep: list[str], timeout: float
    ) -> ReattachResult:
        req = kv_wire.reattach_request(geometry, model, keep)
        return kv_wire.reattach_from_proto(await self.stub.Reattach(req, timeout=timeout))

    @maps_rpc_errors(prefix=lambda self, *_: f"shard {self.address}: ")
    async def retire(self, timeout: float) -> None:
        await self.stub.Retire(kv_attention_pb2.RetireRequest(), timeout=timeout)
