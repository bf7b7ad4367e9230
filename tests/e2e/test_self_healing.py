"""With `fastdecode up`, kill -9 of gpu_dense and, separately, of the scheduler while 6 greedy streams
run: all 6 complete with the tokens of a fault-free run, and `up` brings the killed service back."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fastdecode.client import Client
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import UpProcess, state_credentials
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from tests.support import pid_alive, start_up

STREAMS, TOKENS = 6, 48


def _prompts() -> list[list[int]]:
    return [[0, 11 + i, 40 + 3 * i, 7] for i in range(STREAMS)]


def _stream_all(target: str, first: concurrent.futures.Future[None] | None = None) -> list[list[int]]:
    """Run every prompt as a concurrent greedy stream; `first` is set once each has a first chunk."""
    started = 0

    def one(prompt: list[int]) -> list[int]:
        nonlocal started
        out: list[int] = []
        with Client(target, timeout=300) as client:
            for chunk in client.stream(token_ids=prompt, max_tokens=TOKENS, ignore_eos=True):
                if not out and first is not None:
                    started += 1
                    if started == STREAMS and not first.done():
                        first.set_result(None)
                out += chunk.token_ids
        return out

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        return list(pool.map(one, _prompts()))


def _wait_restarted(up: UpProcess, key: str, old_pid: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        svc = up.reload()[key]
        if svc["pid"] != old_pid and svc["restarts"] >= 1 and pid_alive(svc["pid"]):
            return int(svc["pid"])
        time.sleep(0.2)
    raise AssertionError(f"{key} did not come back:\n{up.log.read_text()[-3000:]}")


def _hosted_stats(up: UpProcess) -> kv_pb.ShardStats:
    with sync_channel(up.state["host_shard"], state_credentials(up.state)) as ch:
        return kv_grpc.KVAttentionStub(ch).Stats(kv_pb.StatsRequest(), timeout=30)


@pytest.mark.parametrize(
    ("victim", "extra"),
    [
        ("gpu_dense", ()),
        ("scheduler", ()),
        # gpu_dense hosting a shard (--host-shard): the kill takes that shard's KV too
        ("gpu_dense", ("--shards", "1", "--host-shard")),
        # killed while rows with drafts are verified: the shards hold rejected drafts' KV past what
        # the scheduler counts, and the re-run writes over them
        ("gpu_dense", ("--speculative", "ngram", "--speculative-k", "fixed")),
    ],
    ids=["gpu_dense", "scheduler", "gpu_dense-hosting-a-shard", "gpu_dense-speculative"],
)
def test_a_killed_service_costs_time_not_requests(
    model_factory: Callable, tmp_path: Path, victim: str, extra: tuple[str, ...]
) -> None:
    up = start_up(model_factory("llama"), tmp_path, *extra)
    try:
        hosted = "--host-shard" in extra
        if hosted:  # the hosted shard holds sequences: the kill takes KV, not only the S-part
            assert up.state["host_shard"] and len(up.state["kv_attention"]) == 1
        expected = _stream_all(up.target)  # the fault-free run, same fleet
        assert all(len(t) == TOKENS for t in expected)
        if hosted:  # the scheduler placed some of them on the hosted shard, which attended them
            assert _hosted_stats(up).attended_token_pairs > 0
        first: concurrent.futures.Future[None] = concurrent.futures.Future()
        with concurrent.futures.ThreadPoolExecutor(1) as runner:
            run = runner.submit(_stream_all, up.target, first)
            first.result(timeout=120)  # every stream is running
            old = int(up.state[victim]["pid"])
            os.kill(old, signal.SIGKILL)
            new = _wait_restarted(up, victim, old)
            got = run.result(timeout=300)
        assert got == expected  # all 6 completed, token for token
        assert new != old and f"restarted {victim}" in up.log.read_text()
    finally:
        up.stop()
