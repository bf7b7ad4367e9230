"""The gateway's side of LoRA adapters, in process (a fake of the scheduler's LoraAdapters calls):
vLLM's load and unload endpoints, /v1/models listing the adapters with their parent, a request's
`model` resolved to its adapter (which rides in its sampling settings to the scheduler, with a
prefix-cache namespace of its own), and 404 for a name that is no adapter, asked again first."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from fastdecode.contract import LoraInfo
from fastdecode.gateway.auth import Tenants
from fastdecode.gateway.core import GatewayCore, UpstreamEvent
from fastdecode.gateway.lora import LoraRegistry, adapter_salt
from fastdecode.model import ModelConfig
from fastdecode.runtime.errors import InvalidInput, NotFound, ServiceError, Status
from fastdecode.runtime.settings import GatewaySettings
from fastdecode.runtime.tokenizer import Tokenizer
from services.gateway.http_server import _Front
from services.gateway.openai_api import OpenAIApp
from tests.support.fakes import FakeScheduler
from tests.unit.test_responses_routes import KEYS, call


class FakeAdmin:
    """gpu_dense's adapters as the scheduler would answer; `elsewhere` were loaded by another gateway."""

    def __init__(self) -> None:
        self.loaded: dict[str, LoraInfo] = {}
        self.lists = 0

    async def load(self, name: str, path: str) -> list[LoraInfo]:
        if path.startswith("/bad"):
            raise InvalidInput(f"LoRA adapter {name!r}: targets fc1 of layer 0, which this llama model lacks")
        self.loaded[name] = LoraInfo(name, path, 8)
        return list(self.loaded.values())

    async def unload(self, name: str) -> list[LoraInfo]:
        if self.loaded.pop(name, None) is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        return list(self.loaded.values())

    async def list(self) -> list[LoraInfo]:
        self.lists += 1
        return list(self.loaded.values())


def _app(llama_dir: Path, tmp_path: Path) -> tuple[Any, GatewayCore, FakeAdmin, FakeScheduler]:
    link = FakeScheduler(script=lambda rid, req: [UpstreamEvent([5], finish_reason="length")])
    core = GatewayCore(
        GatewaySettings(scheduler="fake:1", model=llama_dir, http_port=0),
        Tokenizer.from_pretrained(llama_dir),
        ModelConfig.from_pretrained(llama_dir),
        link,
    )
    core.ready = True
    admin = FakeAdmin()
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    api = OpenAIApp(core, core.settings, LoraRegistry(admin, core.model_id))
    return _Front(api.app, core, Tenants(keys_file=keys), 1 << 20), core, admin, link


def test_load_list_use_and_unload(llama_dir: Path, tmp_path: Path) -> None:
    app, core, admin, link = _app(llama_dir, tmp_path)
    base = core.model_id

    async def main() -> None:
        status, body = await call(
            app, "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"}
        )
        assert status == 200 and body == b"Success: LoRA adapter 'sql' added successfully."
        status, body = await call(app, "GET", "/v1/models")
        cards = {m["id"]: m for m in json.loads(body)["data"]}
        assert (
            set(cards) == {base, "sql"}
            and cards["sql"]["parent"] == base
            and cards["sql"]["root"] == "/a/sql"
        )
        status, body = await call(app, "GET", "/v1/models/sql")
        assert status == 200 and json.loads(body)["id"] == "sql"

        for model in ("sql", base):
            status, body = await call(
                app, "POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}
            )
            assert status == 200, body
            assert json.loads(body)["model"] == model
        (_, sql), (_, plain) = link.submitted[-2:]
        assert sql.sampling().lora == "sql" and plain.sampling().lora == ""
        assert sql.cache_salt != plain.cache_salt  # no prefix-cache block shared across adapters
        status, body = await call(
            app,
            "POST",
            "/v1/chat/completions",
            {"model": "sql", "messages": [{"role": "user", "content": "x"}]},
        )
        assert status == 200 and link.submitted[-1][1].sampling().lora == "sql"
        for path, body in (
            (
                "/v1/messages",
                {"model": "sql", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
            ),
            ("/v1/responses", {"model": "sql", "input": "x", "max_output_tokens": 1}),
        ):
            status, out = await call(app, "POST", path, body)
            assert status == 200, out
            assert link.submitted[-1][1].sampling().lora == "sql", path

        # an adapter loaded elsewhere (gpu_dense's --lora-modules, another gateway) is found on first use
        admin.loaded["poet"] = LoraInfo("poet", "/a/poet", 4)
        status, _ = await call(
            app, "POST", "/v1/completions", {"model": "poet", "prompt": "hi", "max_tokens": 1}
        )
        assert status == 200 and link.submitted[-1][1].sampling().lora == "poet"

        lists = admin.lists
        status, body = await call(
            app, "POST", "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 1}
        )
        err = json.loads(body)["error"]
        assert status == 404 and err["code"] == "model_not_found" and "nope" in err["message"]
        assert admin.lists == lists + 1  # asked again before answering 404

        status, body = await call(
            app, "POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/bad"}
        )
        assert status == 400 and "which this llama model lacks" in json.loads(body)["error"]["message"]
        status, body = await call(app, "POST", "/v1/load_lora_adapter", {"lora_name": "x"})
        assert status == 400 and "lora_path is required" in json.loads(body)["error"]["message"]
        status, body = await call(
            app, "POST", "/v1/load_lora_adapter", {"lora_name": base, "lora_path": "/a"}
        )
        assert status == 400, body

        status, body = await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 200 and body == b"Success: LoRA adapter 'sql' removed successfully."
        status, _ = await call(
            app, "POST", "/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 1}
        )
        assert status == 404
        status, _ = await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 404

    asyncio.run(main())


def test_adapter_salt_is_a_namespace_of_its_own() -> None:
    assert adapter_salt("", "") == "" and adapter_salt("t", "") == "t"
    salts = {adapter_salt(s, a) for s in ("", "t") for a in ("", "x", "y")}
    assert len(salts) == 6


def test_without_an_admin_every_adapter_is_unknown() -> None:
    reg = LoraRegistry(None, "m")

    async def main() -> None:
        assert await reg.resolve(None) == "" and await reg.resolve("m") == ""
        with pytest.raises(ServiceError) as e:
            await reg.resolve("x")
        assert e.value.status is Status.NOT_FOUND and e.value.error_code == "model_not_found"  # type: ignore[attr-defined]
        with pytest.raises(ServiceError) as e:
            await reg.load("x", "/p")
        assert e.value.status is Status.FAILED_PRECONDITION

    asyncio.run(main())


def test_the_grpc_api_and_sdk_name_an_adapter_too(llama_dir: Path, tmp_path: Path) -> None:
    from fastdecode.client import _generate_args as generate_request
    from fastdecode.wire.gateway import params_from_proto

    req, _ = generate_request("hi", lora="sql")
    params = params_from_proto(req)
    assert params.lora == "sql"
    _, core, _, link = _app(llama_dir, tmp_path)

    async def main() -> None:
        async for _ in core.generate(params, "r1", None, "grpc"):
            pass

    asyncio.run(main())
    assert link.submitted[-1][1].sampling().lora == "sql"
    assert params_from_proto(generate_request("hi")[0]).lora == ""
