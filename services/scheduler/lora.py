"""The scheduler's LoraAdapters service (dense.proto): each call passed on to gpu_dense, which holds
the adapters, on the scheduler's own channel to it; gpu_dense's answer or status comes back as it was."""

from __future__ import annotations

import grpc

from fastdecode.runtime.rpc import handles_errors, maps_rpc_errors
from fastdecode.v1 import dense_pb2 as pb
from fastdecode.v1 import dense_pb2_grpc as pb_grpc


class LoraForward(pb_grpc.LoraAdaptersServicer):
    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self.stub = pb_grpc.LoraAdaptersStub(channel)
        self.timeout = timeout  # without the caller's deadline (the gateway sends one)

    @handles_errors
    async def Load(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterList:
        return await self._call(self.stub.Load, request, context.time_remaining())

    @handles_errors
    async def Unload(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterList:
        return await self._call(self.stub.Unload, request, context.time_remaining())

    @handles_errors
    async def List(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterList:
        return await self._call(self.stub.List, request, context.time_remaining())

    @maps_rpc_errors
    async def _call(
        self, method: grpc.aio.UnaryUnaryMultiCallable, request: object, remaining: float | None
    ) -> pb.LoraAdapterList:
        return await method(request, timeout=self.timeout if remaining is None else remaining)
