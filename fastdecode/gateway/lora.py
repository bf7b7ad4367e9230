"""The gateway's view of the LoRA adapters gpu_dense holds: a request's OpenAI `model` resolved to an
adapter name ("" for the base model), the adapters /v1/models lists (parent: the base model), and
vLLM's load and unload calls passed on through the scheduler (the `LoraAdmin` port). No gRPC here.

The names are cached; a name not in the cache is looked up again once before the request is refused
(NOT_FOUND, OpenAI's model_not_found), so an adapter loaded at gpu_dense's start (--lora-modules) or
through another gateway is found. Each adapter has its own prefix-cache namespace (`adapter_salt`):
KV computed under one adapter is never reused under another or the base."""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Protocol

from fastdecode.contract import LoraInfo
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, ServiceError, Status

log = logging.getLogger("fastdecode.gateway.lora")


class LoraAdmin(Protocol):
    """The scheduler's LoraAdapters calls; each answers the adapters loaded after it."""

    async def load(self, name: str, path: str) -> list[LoraInfo]: ...

    async def unload(self, name: str) -> list[LoraInfo]: ...

    async def list(self) -> list[LoraInfo]: ...


def adapter_salt(salt: str, lora: str) -> str:
    """The prefix-cache namespace of a request under adapter `lora` (its own, whatever the salt)."""
    if not lora:
        return salt
    return hashlib.blake2b(f"{salt}\0lora\0{lora}".encode(), digest_size=16).hexdigest()


class UnknownModel(ServiceError):
    """A `model` that is neither the served model nor a loaded adapter (OpenAI's model_not_found)."""

    error_code = "model_not_found"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"the model {model!r} does not exist; this gateway serves {served!r} and its loaded LoRA "
            "adapters (GET /v1/models)",
            Status.NOT_FOUND,
            param="model",
        )


class LoraRegistry:
    def __init__(self, admin: LoraAdmin | None, base: str) -> None:
        self.admin = admin  # None: no adapters (loads are refused)
        self.base = base
        self.loaded: dict[str, LoraInfo] = {}

    def _take(self, adapters: list[LoraInfo]) -> None:
        self.loaded = {a.name: a for a in adapters}

    async def refresh(self) -> None:
        """The adapters as gpu_dense has them now (the cache stays as it was when it cannot answer)."""
        if self.admin is None:
            return
        try:
            self._take(await self.admin.list())
        except ServiceError as e:
            log.warning("LoRA adapters not listed: %s", e.message)

    async def resolve(self, model: str | None) -> str:
        """The adapter a request's `model` names: "" for the served model (or none given)."""
        if model is None or model == self.base:
            return ""
        if model not in self.loaded:
            await self.refresh()
        if model not in self.loaded:
            raise UnknownModel(model, self.base)
        return model

    def _name(self, name: object) -> str:
        if not isinstance(name, str) or not name:
            raise InvalidInput("lora_name is required", param="lora_name")
        return name

    def _admin(self) -> LoraAdmin:
        if self.admin is None:
            raise FailedPrecondition("this gateway cannot load LoRA adapters")
        return self.admin

    async def load(self, name: object, path: object) -> None:
        name = self._name(name)
        if name == self.base:
            raise InvalidInput(f"lora_name {name!r} is the served model's own name", param="lora_name")
        if not isinstance(path, str) or not path:
            raise InvalidInput("lora_path is required", param="lora_path")
        self._take(await self._admin().load(name, path))

    async def unload(self, name: object) -> None:
        self._take(await self._admin().unload(self._name(name)))

    def card(self, name: str) -> dict[str, Any] | None:
        """The /v1/models entry of adapter `name` (None: not an adapter's)."""
        return next((c for c in self.cards() if c["id"] == name), None)

    def cards(self) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters, as vLLM lists them (root: the adapter's path)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": 0,
                "owned_by": "fastdecode",
                "root": a.path,
                "parent": self.base,
            }
            for a in self.loaded.values()
        ]
