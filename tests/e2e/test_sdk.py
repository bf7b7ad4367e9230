"""Client and AsyncClient behave the same: one table of scenarios, each run through both clients
against the shared fleet, must give identical results, or the same error class, code and message."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from fastdecode.client import (
    AsyncClient,
    AuthenticationError,
    Client,
    Completion,
    DeadlineExceededError,
    FastDecodeError,
    InvalidRequestError,
    ModelInfo,
    Tokens,
)
from fastdecode.tools.fleet import UpProcess, free_port
from tests.support import TOKEN


@dataclass(frozen=True)
class Scenario:
    name: str
    op: str  # generate | stream | stream_cancel | tokenize | model_info | health
    args: dict[str, Any]
    raises: type[FastDecodeError] | None = None  # what both clients must raise; None: both succeed
    token: str | None = TOKEN
    unreachable: bool = False  # talk to a port nobody listens on instead of the fleet
    client: dict[str, Any] = field(default_factory=dict)  # extra Client/AsyncClient arguments


SCENARIOS = [
    Scenario("generate greedy from text", "generate", {"prompt": "The fleet", "max_tokens": 6}),
    Scenario(
        "generate from token ids with stop ids",
        "generate",
        {"token_ids": [0, 17, 300, 45], "max_tokens": 6, "stop_token_ids": [5], "ignore_eos": True},
    ),
    Scenario("stream greedy", "stream", {"prompt": "Batching many sequences", "max_tokens": 6}),
    Scenario(
        "stream seeded sampling",
        "stream",
        {"prompt": "Once", "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7},
    ),
    Scenario(
        "stream cancelled after its first chunk",
        "stream_cancel",
        {"token_ids": [0, 5, 6], "max_tokens": 200, "ignore_eos": True},
    ),
    Scenario("tokenize", "tokenize", {"text": "hello world"}),
    Scenario("model_info", "model_info", {}),
    Scenario("health needs no token", "health", {}, token=None),
    Scenario("max_tokens=0", "generate", {"prompt": "x", "max_tokens": 0}, InvalidRequestError),
    Scenario("temperature=-1", "stream", {"prompt": "x", "temperature": -1.0}, InvalidRequestError),
    Scenario("token id outside the vocab", "generate", {"token_ids": [1 << 30]}, InvalidRequestError),
    Scenario("missing token", "generate", {"prompt": "x"}, AuthenticationError, token=None),
    Scenario("wrong token", "tokenize", {"text": "x"}, AuthenticationError, token="wrong"),
    Scenario(
        "tiny deadline", "generate", {"prompt": "x", "max_tokens": 8, "timeout": 0.001}, DeadlineExceededError
    ),
    # Calls wait for a gateway to come up (wait_for_ready), so an unreachable one ends at the deadline.
    Scenario(
        "unreachable gateway, unary", "model_info", {"timeout": 0.5}, DeadlineExceededError, unreachable=True
    ),
    Scenario(
        "unreachable gateway, generate",
        "generate",
        {"prompt": "x"},
        DeadlineExceededError,
        unreachable=True,
        client={"timeout": 0.5},
    ),
]


def outcome_of(error: FastDecodeError) -> tuple[Any, ...]:
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        # Who notices a passed deadline first (this client, or the gateway relaying the scheduler's)
        # is a race, so only the class and code are compared.
        return ("error", type(error), error.code)
    # A status the gateway answered carries its message; transport errors' wording is grpc's own.
    return ("error", type(error), error.code, error.from_gateway, error.details if error.from_gateway else "")


def run_sync(target: str, s: Scenario) -> tuple[Any, ...]:
    with Client(target, s.token, **s.client) as c:
        try:
            if s.op == "stream":
                return ("ok", list(c.stream(**s.args)))
            if s.op == "stream_cancel":
                stream = c.stream(**s.args)
                first = next(stream)
                stream.cancel()
                return ("ok", first, list(stream))
            return ("ok", getattr(c, s.op)(**s.args))
        except FastDecodeError as e:
            return outcome_of(e)


async def run_async(target: str, s: Scenario) -> tuple[Any, ...]:
    async with AsyncClient(target, s.token, **s.client) as c:
        try:
            if s.op == "stream":
                return ("ok", [chunk async for chunk in c.stream(**s.args)])
            if s.op == "stream_cancel":
                stream = c.stream(**s.args)
                first = await anext(stream)
                stream.cancel()
                return ("ok", first, [chunk async for chunk in stream])
            return ("ok", await getattr(c, s.op)(**s.args))
        except FastDecodeError as e:
            return outcome_of(e)


def check_result(s: Scenario, result: tuple[Any, ...]) -> None:
    """What each successful operation must look like, beyond the two clients agreeing."""
    value = result[1]
    if s.op == "generate":
        assert isinstance(value, Completion) and value.token_ids and value.finish_reason in ("length", "stop")
        assert value.usage.completion_tokens == len(value.token_ids) <= s.args["max_tokens"]
    elif s.op == "stream":
        assert value[-1].finish_reason in ("length", "stop") and all(
            c.finish_reason is None for c in value[:-1]
        )
        assert value[-1].usage.completion_tokens == sum(len(c.token_ids) for c in value)
    elif s.op == "stream_cancel":
        assert value.token_ids and value.finish_reason is None and result[2] == []  # nothing after cancel
    elif s.op == "tokenize":
        assert isinstance(value, Tokens) and len(value.token_ids) == len(value.tokens) > 0
    elif s.op == "model_info":
        assert isinstance(value, ModelInfo) and value.vocab_size > 0 and value.num_shards == 2
    elif s.op == "health":
        assert value is True


@pytest.fixture(scope="module")
def unreachable() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_sync_and_async_clients_agree(fleet: UpProcess, unreachable: str, scenario: Scenario) -> None:
    target = unreachable if scenario.unreachable else fleet.target
    sync = run_sync(target, scenario)
    in_asyncio = asyncio.run(run_async(target, scenario))
    assert sync == in_asyncio
    if scenario.raises is None:
        assert sync[0] == "ok", sync
        check_result(scenario, sync)
    else:
        assert sync[:2] == ("error", scenario.raises), sync
