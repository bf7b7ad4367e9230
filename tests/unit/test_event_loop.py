"""The services' event loop choice (fastdecode/runtime/loop.py)."""

from __future__ import annotations

import asyncio

import pytest

from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.loop import loop_kind, run_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default_and_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTDECODE_EVENT_LOOP", raising=False)
    assert loop_kind() == "uvloop"  # pinned in the server extra: gpu_dense and its workers
    assert run_loop(_loop_module()).startswith("uvloop")
    assert loop_kind(fast=False) == "asyncio"  # the other services
    monkeypatch.setenv("FASTDECODE_EVENT_LOOP", "uvloop")
    assert run_loop(_loop_module(), fast=False).startswith("uvloop")
    monkeypatch.setenv("FASTDECODE_EVENT_LOOP", "asyncio")
    assert run_loop(_loop_module()).startswith("asyncio")


def test_an_unknown_loop_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTDECODE_EVENT_LOOP", "tokio")
    with pytest.raises(InvalidInput, match="expected one of auto, uvloop, asyncio"):
        run_loop(_loop_module())
