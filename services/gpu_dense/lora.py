"""gpu_dense's LoRA adapters over gRPC (the LoraAdapters service of dense.proto): a thin adapter
around the runner's LoraBank (fastdecode.dense.loras). An adapter is read and checked on a worker
thread, so steps go on meanwhile; it is added between two of them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from fastdecode.dense.loras import OFF, LoraBank, parse_modules
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, Unavailable
from fastdecode.runtime.rpc import handles_errors
from fastdecode.runtime.settings import DenseSettings
from fastdecode.v1 import dense_pb2 as pb
from fastdecode.v1 import dense_pb2_grpc as pb_grpc
from fastdecode.wire import dense as wire

log = logging.getLogger("fastdecode.gpu_dense.lora")


def check_settings(settings: DenseSettings, emulated: bool) -> None:
    """Refuse LoRA settings that cannot work, in one line, before any port opens."""
    if settings.lora_modules and not settings.enable_lora:
        raise InvalidInput("--lora-modules needs --enable-lora")
    if settings.enable_lora and emulated:
        raise InvalidInput("--enable-lora needs real weights: an emulated device has none")
    if settings.enable_lora and settings.tensor_parallel > 1:  # adapters are not split over ranks
        raise InvalidInput("--enable-lora is not served with --tensor-parallel")
    parse_modules(settings.lora_modules)


async def start_bank(settings: DenseSettings, model: DenseModel) -> LoraBank | None:
    """The bank with --lora-modules loaded (a bad one stops the start, in one line), or None when off."""
    if not settings.enable_lora:
        return None
    bank = LoraBank(model, settings.max_loras, settings.max_lora_rank)
    for name, path in parse_modules(settings.lora_modules):
        bank.add(await asyncio.to_thread(bank.read, name, path))
        log.info("LoRA adapter %r loaded from %s", name, path)
    return bank


class LoraService(pb_grpc.LoraAdaptersServicer):
    def __init__(self, settings: DenseSettings, bank: Callable[[], LoraBank | None]) -> None:
        self.settings = settings
        self._bank = bank  # the runner's, once the weights are loaded

    def _on(self) -> LoraBank:
        bank = self._bank()
        if bank is None:
            if self.settings.enable_lora:
                raise Unavailable("gpu_dense is still loading its weights")
            raise FailedPrecondition(OFF)
        return bank

    def _list(self) -> pb.LoraAdapterList:
        bank = self._bank()
        return wire.loras_to_proto(bank.infos() if bank is not None else [], self.settings.enable_lora)

    @handles_errors
    async def Load(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterList:
        bank = self._on()
        if not request.lora_path:
            raise InvalidInput("lora_path is required")
        adapter = await asyncio.to_thread(bank.read, request.lora_name, request.lora_path)
        bank.add(adapter)
        log.info("LoRA adapter %r loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)
        return self._list()

    @handles_errors
    async def Unload(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterList:
        self._on().unload(request.lora_name)
        log.info("LoRA adapter %r unloaded", request.lora_name)
        return self._list()

    @handles_errors
    async def List(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterList:
        return self._list()
