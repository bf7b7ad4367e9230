"""The scheduler driver's links over gRPC: gpu_dense (one persistent Run stream, reopened after a
failure) and each kv_attention shard. Every failure leaves as a domain error (fastdecode.runtime.errors)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.runtime import codec, convert
from fastdecode.runtime.errors import Unavailable
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import aio_channel, error_from_item, error_from_rpc, request_metadata
from fastdecode.runtime.settings import TLSFiles
from fastdecode.scheduling import Reservation, Step
from fastdecode.scheduling.driver import DenseInfo, ItemResult, MigrationResult, ShardState, StepOutcome
from fastdecode.v1 import dense_pb2, dense_pb2_grpc, kv_attention_pb2, kv_attention_pb2_grpc


class GrpcDenseLink:
    def __init__(self, address: str, tls: TLSFiles | None, step_timeout: float) -> None:
        self.address = address
        self.channel = aio_channel(address, tls)
        self.stub = dense_pb2_grpc.DenseStub(self.channel)
        self.step_timeout = step_timeout
        self.model_info: dense_pb2.ModelInfo | None = None  # as gpu_dense said it (GetModelInfo relays it)
        self._queue: asyncio.Queue[dense_pb2.StepPlan | None] | None = None
        self._call: grpc.aio.StreamStreamCall | None = None

    async def info(self, timeout: float) -> DenseInfo:
        try:
            i = await self.stub.Info(dense_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, f"gpu_dense at {self.address}: ") from None
        self.model_info = i
        return DenseInfo(
            model_type=i.model_type,
            geometry=KVGeometry(
                i.num_layers, i.num_kv_heads, i.head_dim, tuple(i.layer_windows), i.attn_logit_softcap
            ),
            vocab_size=int(i.vocab_size),
            max_position_embeddings=int(i.max_position_embeddings),
            eos_token_ids=tuple(i.eos_token_ids),
            num_shards=len(i.shards),
            shard_addresses=tuple(i.shards),
            model=f"{i.model_path}|{i.dtype}",  # what the KV depends on: shards never mix prefixes of two
            removed_shards=tuple(i.removed_shards),
        )

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        """One plan over the persistent Run stream (reopened after a failure)."""
        if self._queue is None:
            queue: asyncio.Queue[dense_pb2.StepPlan | None] = asyncio.Queue()

            async def plans() -> AsyncIterator[dense_pb2.StepPlan]:
                while (p := await queue.get()) is not None:
                    yield p

            self._call = self.stub.Run(plans())
            self._queue = queue
        self._queue.put_nowait(convert.step_plan(step, pipeline))
        assert self._call is not None
        try:
            result = await asyncio.wait_for(self._call.read(), self.step_timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._reset()
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else "step timed out"
            raise Unavailable(f"gpu_dense at {self.address} unavailable: {detail}") from None
        if result is grpc.aio.EOF:
            self._reset()
            raise Unavailable(f"gpu_dense at {self.address} closed the step stream")
        items = [
            ItemResult(
                r.seq_id,
                r.token_id,
                r.logprob,
                error_from_item(r.error) if r.error.code else None,
                convert.top_from_proto(r.top),
                [convert.position_from_proto(p) for p in r.prompt_logprobs],
            )
            for r in result.results
        ]
        return StepOutcome(items, error_from_item(result.error) if result.error.code else None)

    def _reset(self) -> None:
        if self._queue is not None:
            # End the plans() generator first: cancelling the call while gRPC's reader task awaits it
            # left "Task was destroyed" / "aclose(): already running" errors after repeated losses.
            self._queue.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        self._call, self._queue = None, None

    async def add_shard(self, address: str, timeout: float) -> int:
        try:
            resp = await self.stub.AddShard(dense_pb2.AddShardRequest(address=address), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None
        return int(resp.shard)

    async def remove_shard(self, index: int, timeout: float) -> None:
        try:
            await self.stub.RemoveShard(dense_pb2.DenseRemoveShardRequest(shard=index), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, f"gpu_dense at {self.address}: ") from None


class GrpcShardLink:
    def __init__(self, address: str, tls: TLSFiles | None) -> None:
        self.address = address
        channel = aio_channel(address, tls)
        self.stub = kv_attention_pb2_grpc.KVAttentionStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def healthy(self, timeout: float) -> bool:
        try:
            resp = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def stats(self, timeout: float) -> ShardState:
        try:
            st = await self.stub.Stats(kv_attention_pb2.StatsRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, f"shard {self.address}: ") from None
        return ShardState(
            sequences=st.sequences,
            configured=st.configured,
            free_tokens=st.free_tokens,
            tokens_reserved=st.tokens_reserved,
            bytes_capacity=st.bytes_capacity,
            kv_itemsize=codec.torch_dtype(st.kv_dtype).itemsize,
            block_size=st.block_size,
            # a shard hosted by gpu_dense shares its cores with the S-part: both count
            busy_seconds=st.attention_busy_seconds + st.host_busy_seconds,
            attended_pairs=st.attended_token_pairs,
        )

    async def reserve(
        self, geometry: KVGeometry, seqs: list[Reservation], timeout: float, model: str = ""
    ) -> list[int]:
        req = kv_attention_pb2.ReserveRequest(
            model=model,
            geometry=kv_attention_pb2.KVGeometry(
                num_layers=geometry.num_layers,
                num_kv_heads=geometry.num_kv_heads,
                head_dim=geometry.head_dim,
                layer_windows=geometry.layer_windows,
                attn_logit_softcap=geometry.attn_logit_softcap,
            ),
            sequences=[
                kv_attention_pb2.SequenceReservation(
                    seq_id=s.seq_id, max_tokens=s.max_tokens, token_ids=s.token_ids
                )
                for s in seqs
            ],
        )
        try:
            resp = await self.stub.Reserve(
                req, timeout=timeout, metadata=request_metadata(*(s.seq_id for s in seqs))
            )
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None
        # a shard without prefix sharing (or older) answers none: nothing cached
        return list(resp.cached_tokens) or [0] * len(seqs)

    async def release(self, seq_ids: list[str] | None, timeout: float) -> None:
        req = (
            kv_attention_pb2.ReleaseRequest(all=True)
            if seq_ids is None
            else kv_attention_pb2.ReleaseRequest(seq_ids=seq_ids)
        )
        try:
            await self.stub.Release(
                req,
                timeout=timeout,
                wait_for_ready=seq_ids is None,  # at start-up the shard may still be coming up
                metadata=request_metadata(*(seq_ids or ())),
            )
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None

    async def migrate_out(self, seq_id: str, target: str, timeout: float) -> MigrationResult:
        req = kv_attention_pb2.MigrateOutRequest(seq_id=seq_id, target=target)
        try:
            r = await self.stub.MigrateOut(req, timeout=timeout, metadata=request_metadata(seq_id))
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, f"shard {self.address}: ") from None
        return MigrationResult(int(r.tokens), int(r.bytes), float(r.seconds))

    async def retire(self, timeout: float) -> None:
        try:
            await self.stub.Retire(kv_attention_pb2.RetireRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, f"shard {self.address}: ") from None
