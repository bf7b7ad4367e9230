"""Every accepted request ends in exactly one way: shard loss, restarts, deadlines, overload, drain."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.client import Client, FastDecodeError
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import Fleet, start_service
from fastdecode.v1 import (
    dense_pb2,
    kv_attention_pb2,
    kv_attention_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

PROMPTS = [
    [0, 17, 300, 45],
    [0, 99, 5, 1200, 77, 640, 8],
    [0, 600],
    [0, 7, 250, 1800, 42, 3, 999],
    [0, 33, 44],
    [0, 2, 3, 4, 5, 6],
]


@pytest.fixture(scope="module")
def fleet(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(
        model=model_factory("llama"),
        shards=2,
        device="cpu",
        kv_capacity=128 << 20,
        workdir=tmp_path_factory.mktemp("reliability"),
        scheduler_args=["--health-interval", "0.3"],
        env={"FASTDECODE_GRACE_SECONDS": "15"},
    )
    f.start()
    yield f
    f.stop()


def shard_stats(f: Fleet) -> list[kv_attention_pb2.ShardStats]:
    return [
        kv_attention_pb2_grpc.KVAttentionStub(sync_channel(k.address, f.peer_credentials)).Stats(
            kv_attention_pb2.StatsRequest(), timeout=5
        )
        for k in f.kv
    ]


def sched_stats(f: Fleet) -> scheduler_pb2.SchedulerStats:
    assert f.scheduler
    stub = scheduler_pb2_grpc.SchedulerStub(sync_channel(f.scheduler.address, f.peer_credentials))
    return stub.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)


def wait_kv_empty(f: Fleet, timeout: float = 10) -> list[tuple[int, int]]:
    deadline = time.monotonic() + timeout
    while True:
        got = [(s.sequences, s.tokens_reserved) for s in shard_stats(f)]
        if all(g == (0, 0) for g in got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_shard_loss_costs_time_not_requests(fleet: Fleet, hf_greedy: Callable) -> None:
    assert fleet.gateway
    before = sched_stats(fleet).recoveries
    with Client(fleet.gateway.address) as client, concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(client.generate, token_ids=p, max_tokens=48) for p in PROMPTS]
        deadline = time.monotonic() + 60
        while shard_stats(fleet)[1].tokens_held < 20 and time.monotonic() < deadline:
            time.sleep(0.02)  # decoding is under way on shard 1
        victim = fleet.kv[1]
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        outs = [f.result(timeout=120) for f in futures]
        recovered_in = time.monotonic() - killed_at
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(fleet.model, tuple(p), 48)
    stats = sched_stats(fleet)
    assert stats.recoveries > before
    assert not stats.shards[1].healthy
    assert fleet.scheduler and fleet.scheduler.metrics
    metrics = urllib.request.urlopen(f"http://{fleet.scheduler.metrics}/metrics", timeout=5).read().decode()
    assert re.search(r"^fastdecode_shard_recoveries_total [1-9]", metrics, re.M)
    print(f"\nshard-loss: all {len(PROMPTS)} requests done {recovered_in:.2f}s after kill -9")

    # The shard comes back at the same address, rejoins, and takes new sequences. They run long
    # enough to overlap (placement balances the load held: requests that each end before the next
    # arrives find both shards empty, and any of them may go to shard 0), with prompts of their own
    # (no prefix held on shard 0 draws them there).
    fleet.restart(victim)
    deadline = time.monotonic() + 20
    while not sched_stats(fleet).shards[1].healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sched_stats(fleet).shards[1].healthy
    fresh = [[0, 31 + i, 700 + i, 9] for i in range(6)]
    with Client(fleet.gateway.address) as client, concurrent.futures.ThreadPoolExecutor(len(fresh)) as pool:
        list(pool.map(lambda p: client.generate(token_ids=p, max_tokens=32), fresh))
    assert shard_stats(fleet)[1].attend_items > 0


def test_shard_added_at_runtime_takes_new_sequences(fleet: Fleet) -> None:
    assert fleet.gateway and fleet.scheduler and fleet.workdir
    extra = start_service("kv_attention-extra", fleet._kv_args(len(fleet.kv)), fleet.workdir)
    fleet.kv.append(extra)  # stopped with the fleet
    stub = scheduler_pb2_grpc.SchedulerStub(sync_channel(fleet.scheduler.address, fleet.peer_credentials))
    index = stub.AddShard(dense_pb2.AddShardRequest(address=extra.address), timeout=30).shard
    assert index == len(fleet.kv) - 1
    with Client(fleet.gateway.address) as client, concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: client.generate(token_ids=p, max_tokens=6), PROMPTS))
    assert shard_stats(fleet)[index].attend_items > 0
    assert len(sched_stats(fleet).shards) == len(fleet.kv)


def test_client_deadline_is_deadline_exceeded_and_frees_kv(fleet: Fleet) -> None:
    assert fleet.gateway
    with Client(fleet.gateway.address) as client:
        t0 = time.monotonic()
        with pytest.raises(FastDecodeError) as info:
            client.generate(token_ids=[0, 1, 2], max_tokens=1000, timeout=1.0)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 5
    assert set(wait_kv_empty(fleet)) == {(0, 0)}


def test_disconnected_client_is_cancelled(fleet: Fleet, tmp_path: Path) -> None:
    assert fleet.gateway
    script = (
        "import sys\nfrom fastdecode.client import Client\n"
        f"c = Client({fleet.gateway.address!r})\n"
        "for chunk in c.stream(token_ids=[0, 5, 6], max_tokens=1000):\n"
        "    print('tok', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # it is streaming
    assert sum(s.sequences for s in shard_stats(fleet)) == 1
    proc.kill()
    proc.wait()
    assert set(wait_kv_empty(fleet, timeout=5)) == {(0, 0)}


def _health(address: str, service: str = "") -> int:
    try:
        return (
            health_pb2_grpc.HealthStub(sync_channel(address))
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            .status
        )
    except grpc.RpcError:
        return -1


def _wait_health(address: str, status: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _health(address) != status:
        assert time.monotonic() < deadline, f"{address} never reached health {status}"
        time.sleep(0.1)


@pytest.mark.parametrize("victim", ["dense", "scheduler"])
def test_a_killed_gpu_dense_or_scheduler_costs_time_not_the_request(fleet: Fleet, victim: str) -> None:
    """kill -9 mid-stream, then the service comes back on its address: the stream pauses and ends
    with the tokens of a fault-free run; the gateway's readiness says why meanwhile."""
    assert fleet.gateway
    prompt, n = [0, 9, 8], 40
    with Client(fleet.gateway.address, timeout=120) as client:
        expected = client.generate(token_ids=prompt, max_tokens=n, ignore_eos=True).token_ids
        stream = client.stream(token_ids=prompt, max_tokens=n, ignore_eos=True)
        got = list(next(stream).token_ids)
        os.kill(getattr(fleet, victim).pid, signal.SIGKILL)
        _wait_health(fleet.gateway.address, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _health(fleet.gateway.address, "liveness") == health_pb2.HealthCheckResponse.SERVING
        fleet.restart(getattr(fleet, victim))
        for chunk in stream:
            got += chunk.token_ids
        assert got == expected
        _wait_health(fleet.gateway.address, health_pb2.HealthCheckResponse.SERVING)
    assert set(wait_kv_empty(fleet)) == {(0, 0)}


@pytest.mark.parametrize("service", ["gateway", "scheduler"])
def test_sigterm_drains_running_requests_then_exits_zero(fleet: Fleet, service: str) -> None:
    assert fleet.gateway
    svc = getattr(fleet, service)
    health = health_pb2_grpc.HealthStub(sync_channel(svc.address))
    with Client(fleet.gateway.address) as client:
        stream = client.stream(token_ids=[0, 4, 5], max_tokens=60)
        first = next(stream)
        svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        status = None
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                break
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(FastDecodeError) as info:  # no new admissions while draining (no retry)
            Client(fleet.gateway.address, timeout=5, max_retries=0).generate(token_ids=[0, 1], max_tokens=2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)  # the running one finishes
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 60
        assert rest[-1].finish_reason == "length"
    assert svc.proc.wait(timeout=30) == 0
    fleet.restart(svc)
    with Client(fleet.gateway.address) as client:
        assert client.generate(token_ids=[0, 1, 2], max_tokens=3, timeout=60).token_ids


def test_overload_is_resource_exhausted_at_once(model_factory: Callable, tmp_path: Path) -> None:
    with Fleet(
        model=model_factory("llama"),
        shards=1,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path,
        scheduler_args=["--max-running", "2", "--max-waiting", "2"],
    ) as f:
        assert f.gateway
        with Client(f.gateway.address) as client, concurrent.futures.ThreadPoolExecutor(12) as pool:

            def one(i: int) -> str:
                t0 = time.monotonic()
                try:
                    client.generate(token_ids=[0, i + 3], max_tokens=40)
                    return "ok"
                except FastDecodeError as e:
                    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() - t0 < 2.0  # answered at once, not after queuing
                    return "full"

            results = list(pool.map(one, range(12)))
        assert results.count("ok") >= 2 and results.count("full") >= 1  # at least the queue's worth runs
        assert results.count("ok") + results.count("full") == 12


def test_drain_ends_what_outlives_the_grace_with_unavailable_in_time(
    model_factory: Callable, tmp_path: Path
) -> None:
    """SIGTERM with a stream longer than the grace period: the stream ends with UNAVAILABLE (draining,
    retry) when the grace runs out, and the gateway exits by grace + 1 s (not 2x grace as before)."""
    grace = 1.0  # short, so the 1000-token stream (several seconds here) outlives it
    with Fleet(
        model=model_factory("llama"),
        shards=1,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path,
        env={"FASTDECODE_GRACE_SECONDS": str(grace)},
    ) as f:
        assert f.gateway
        with Client(f.gateway.address, max_retries=0) as client:
            stream = client.stream(token_ids=[0, 7, 8], max_tokens=1000, ignore_eos=True, timeout=120)
            next(stream)
            t0 = time.monotonic()
            f.gateway.proc.send_signal(signal.SIGTERM)
            with pytest.raises(FastDecodeError) as info:
                for _ in stream:
                    pass
            ended = time.monotonic() - t0
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details
            assert f.gateway.proc.wait(timeout=30) == 0
            exited = time.monotonic() - t0
        assert grace - 0.5 <= ended and exited <= grace + 1.5, (ended, exited)
