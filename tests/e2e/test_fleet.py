"""The whole fleet through the SDK: tokens equal transformers, batching, cancel, validation, auth."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

import grpc
import pytest

from fastdecode.client import Client, FastDecodeError
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import UpProcess
from fastdecode.v1 import kv_attention_pb2, kv_attention_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support import TOKEN

PROMPTS_8 = [
    [0, 17, 300, 45],
    [0, 99, 5, 1200, 77, 640, 8, 13, 21, 34, 55],
    [0, 600],
    [0, 7, 7, 7, 250, 1800, 42, 3, 999, 1500, 64, 128, 256, 512, 1024, 2000, 11, 12, 13, 14, 15, 16],
    [0, 1500, 1501, 1502],
    [0] + list(range(100, 140)),
    [0, 33, 44],
    [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
]


def shard_stats(fleet: UpProcess) -> list[kv_attention_pb2.ShardStats]:
    return [
        kv_attention_pb2_grpc.KVAttentionStub(sync_channel(k["address"], fleet.peer_credentials)).Stats(
            kv_attention_pb2.StatsRequest(), timeout=5
        )
        for k in fleet.state["kv_attention"]
    ]


def scheduler_steps(fleet: UpProcess) -> int:
    stub = scheduler_pb2_grpc.SchedulerStub(
        sync_channel(fleet.state["scheduler"]["address"], fleet.peer_credentials)
    )
    return stub.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5).steps


def test_concurrent_requests_equal_transformers(fleet: UpProcess, hf_greedy: Callable) -> None:
    with Client(fleet.target, token=TOKEN) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.generate, token_ids=p, max_tokens=24) for p in PROMPTS_8]
        outs = [f.result(timeout=120) for f in futures]
    for prompt, out in zip(PROMPTS_8, outs, strict=True):
        assert out.token_ids == hf_greedy(fleet.model, tuple(prompt), 24)
        assert out.finish_reason in ("length", "stop")
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(out.token_ids)
    stats = shard_stats(fleet)
    assert all(s.attend_items > 0 for s in stats), "sequences must land on both shards"


def test_text_prompt_streams_utf8_deltas_that_join_to_the_completion(fleet: UpProcess) -> None:
    with Client(fleet.target, token=TOKEN) as client:
        chunks = list(client.stream(prompt="Batching many sequences", max_tokens=20))
        whole = client.generate(prompt="Batching many sequences", max_tokens=20)
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].finish_reason == whole.finish_reason


def test_request_joins_the_running_batch(fleet: UpProcess) -> None:
    long_prompt, short_prompt = [0, 5, 6, 7], [0, 8, 9]
    with Client(fleet.target, token=TOKEN) as client:
        s0 = scheduler_steps(fleet)
        client.generate(token_ids=long_prompt, max_tokens=80, stop_token_ids=[])
        s1 = scheduler_steps(fleet)
        client.generate(token_ids=short_prompt, max_tokens=20)
        s2 = scheduler_steps(fleet)
        alone = (s1 - s0) + (s2 - s1)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = client.stream(token_ids=long_prompt, max_tokens=80)
            first = next(stream)  # the long request is decoding
            assert first.token_ids
            short = pool.submit(client.generate, token_ids=short_prompt, max_tokens=20)
            rest = list(stream)
            short.result(timeout=60)
        s3 = scheduler_steps(fleet)
    assert rest  # long was still running while short joined
    together = s3 - s2
    assert together < alone - 10, f"{together} steps together vs {alone} alone: short did not join the batch"


def test_cancel_frees_kv(fleet: UpProcess) -> None:
    with Client(fleet.target, token=TOKEN) as client:
        stream = client.stream(token_ids=[0, 1, 2, 3], max_tokens=500)
        next(stream)
        assert sum(s.sequences for s in shard_stats(fleet)) >= 1
        stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = shard_stats(fleet)
        if sum(s.sequences for s in stats) == 0 and sum(s.tokens_reserved for s in stats) == 0:
            break
        time.sleep(0.1)
    assert [(s.sequences, s.tokens_held, s.tokens_reserved) for s in stats] == [(0, 0, 0), (0, 0, 0)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": ""},
        {"token_ids": []},
        {"prompt": "hi", "max_tokens": 5000},  # beyond the tiny model's 1024-token context
        {"prompt": "hi", "max_tokens": 0},
        {"prompt": "hi", "temperature": -0.5},
        {"prompt": "hi", "top_p": 0.0},
        {"prompt": "hi", "top_p": 1.5},
        {"prompt": "hi", "top_k": -1},
        {"token_ids": [0, 10**6]},
        {"prompt": "hi", "stop": [""]},
    ],
)
def test_bad_requests_are_invalid_argument(fleet: UpProcess, kwargs: dict) -> None:
    with Client(fleet.target, token=TOKEN) as client:
        with pytest.raises(FastDecodeError) as info:
            client.generate(**kwargs)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.generate(prompt="still serving", max_tokens=2).token_ids


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_auth_rejects_missing_or_wrong_token(fleet: UpProcess, token: str | None) -> None:
    with Client(fleet.target, token=token) as client:
        with pytest.raises(FastDecodeError) as info:
            client.generate(prompt="hello", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
