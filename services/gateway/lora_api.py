"""vLLM's LoRA endpoints on the gateway's HTTP port, POST /v1/load_lora_adapter {lora_name, lora_path}
and POST /v1/unload_lora_adapter {lora_name}, over fastdecode.gateway.lora's registry; the registry's
port to the scheduler's LoraAdapters service (`GrpcLoraAdmin`), which passes each call on to gpu_dense.
Registered by OpenAIApp (whose error handlers answer them: 400 for an adapter that cannot load, 404
for one not loaded)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from fastdecode.contract import LoraInfo
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.rpc import maps_rpc_errors
from fastdecode.v1 import dense_pb2 as pb
from fastdecode.v1 import dense_pb2_grpc as pb_grpc
from fastdecode.wire.dense import loras_from_proto

if TYPE_CHECKING:
    from services.gateway.front import OpenAIFront


class GrpcLoraAdmin:
    """The scheduler's LoraAdapters calls, on the gateway's channel to it."""

    def __init__(self, channel: grpc.aio.Channel, load_timeout: float, timeout: float) -> None:
        self.stub = pb_grpc.LoraAdaptersStub(channel)
        self.load_timeout = load_timeout  # gpu_dense reads and checks the adapter's weights meanwhile
        self.timeout = timeout

    @maps_rpc_errors
    async def load(self, name: str, path: str) -> list[LoraInfo]:
        req = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return loras_from_proto(await self.stub.Load(req, timeout=self.load_timeout))

    @maps_rpc_errors
    async def unload(self, name: str) -> list[LoraInfo]:
        req = pb.UnloadLoraAdapterRequest(lora_name=name)
        return loras_from_proto(await self.stub.Unload(req, timeout=self.timeout))

    @maps_rpc_errors
    async def list(self) -> list[LoraInfo]:
        return loras_from_proto(await self.stub.List(pb.ListLoraAdaptersRequest(), timeout=self.timeout))


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise InvalidInput("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    return body


class LoraRoutes:
    def __init__(self, api: OpenAIFront) -> None:
        self.registry = api.loras
        api.app.add_api_route("/v1/load_lora_adapter", self.load, methods=["POST"])
        api.app.add_api_route("/v1/unload_lora_adapter", self.unload, methods=["POST"])

    async def load(self, request: Request) -> Response:
        body = await _body(request)
        await self.registry.load(body.get("lora_name"), body.get("lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(self, request: Request) -> Response:
        body = await _body(request)
        await self.registry.unload(body.get("lora_name"))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
