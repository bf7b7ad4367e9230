"""gpu_dense down for good (nobody restarts it): every request ends within the scheduler's bound with
UNAVAILABLE naming gpu_dense, new ones are refused at once, readiness says why, and the scheduler
logs no asyncio task errors after repeated losses."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.client import Client, FastDecodeError
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import Fleet

BOUND = 2.0


def _ask(target: str, prompt: list[int]) -> tuple[str, str, float]:
    t0 = time.monotonic()
    with Client(target, timeout=60, max_retries=0) as client:
        try:
            client.generate(token_ids=prompt, max_tokens=400, ignore_eos=True)
            return "OK", "", time.monotonic() - t0
        except FastDecodeError as e:
            return e.code.name, e.details or "", time.monotonic() - t0


def test_requests_fail_fast_while_gpu_dense_stays_down(model_factory: Callable, tmp_path: Path) -> None:
    with Fleet(
        model=model_factory("llama"),
        shards=1,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path,
        scheduler_args=["--dense-down-timeout", str(BOUND)],
    ) as f:
        assert f.gateway and f.dense
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(_ask, f.gateway.address, [0, 5 + i, 9]) for i in range(3)]
            time.sleep(0.5)  # decoding
            f.dense.proc.kill()
            f.dense.proc.wait(10)
            answers = [r.result(timeout=90) for r in running]
        for code, details, took in answers:
            assert code == "UNAVAILABLE" and "gpu_dense" in details, (code, details)
            assert took < BOUND + 5, took
        code, details, took = _ask(f.gateway.address, [0, 1])  # admission refuses at once
        assert code == "UNAVAILABLE" and "gpu_dense" in details and took < 3, (code, details, took)
        with sync_channel(f.gateway.address) as ch:
            deadline = time.monotonic() + 10
            while True:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                if status.status == health_pb2.HealthCheckResponse.NOT_SERVING or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    log = (tmp_path / "scheduler.log").read_text(errors="replace")
    for bad in ("Task was destroyed", "already running", "Traceback"):
        assert bad not in log, bad


@pytest.mark.parametrize("kills", [3])
def test_repeated_gpu_dense_losses_leave_no_asyncio_errors(
    model_factory: Callable, tmp_path: Path, kills: int
) -> None:
    with Fleet(
        model=model_factory("llama"), shards=1, device="cpu", kv_capacity=64 << 20, workdir=tmp_path
    ) as f:
        assert f.gateway and f.dense
        for _ in range(kills):
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                running = [pool.submit(_ask, f.gateway.address, [0, 3, 4]) for _ in range(2)]
                time.sleep(0.3)
                assert f.dense
                f.dense.proc.kill()
                f.dense.proc.wait(10)
                f.restart(f.dense)
                assert all(r.result(timeout=120)[0] == "OK" for r in running)
    log = (tmp_path / "scheduler.log").read_text(errors="replace")
    for bad in ("Task was destroyed", "already running", "Traceback"):
        assert bad not in log, bad


def test_requests_fail_fast_while_every_shard_stays_down(model_factory: Callable, tmp_path: Path) -> None:
    """Both shards killed, nobody restarts them: streams in flight and new requests end UNAVAILABLE
    naming the shards within --shards-down-timeout (plus a health interval and the probes), not at
    their deadline; admission then refuses at once; a shard back serves again."""
    with Fleet(
        model=model_factory("llama"),
        shards=2,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path,
        scheduler_args=["--shards-down-timeout", str(BOUND), "--health-interval", "0.3"],
    ) as f:
        assert f.gateway
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(_ask, f.gateway.address, [0, 5 + i, 9]) for i in range(3)]
            time.sleep(0.5)  # decoding
            for k in f.kv:
                k.proc.kill()
            for k in f.kv:
                k.proc.wait(10)
            late = pool.submit(_ask, f.gateway.address, [0, 8, 8])  # arrives with no shard serving
            answers = [r.result(timeout=90) for r in [*running, late]]
        for code, details, took in answers:
            assert code == "UNAVAILABLE" and "kv_attention shard" in details, (code, details)
            assert f.kv[0].address in details and f.kv[1].address in details, details
            assert took < BOUND + 8, took
        code, details, took = _ask(f.gateway.address, [0, 1])  # admission refuses at once
        assert code == "UNAVAILABLE" and "kv_attention shard" in details and took < 3, (code, details, took)
        f.restart(f.kv[0])
        deadline = time.monotonic() + 60
        while (answer := _ask(f.gateway.address, [0, 1]))[0] != "OK" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert answer[0] == "OK", answer
    log = (tmp_path / "scheduler.log").read_text(errors="replace")
    assert "Traceback" not in log
