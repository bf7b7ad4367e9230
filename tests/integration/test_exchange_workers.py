"""Exchange workers (services/gpu_dense/exchange/plane.py) as processes: a worker that dies fails its items
as UNAVAILABLE and the next layer starts a new one; workers die with a killed parent (no orphans);
a shard added at run time joins a live worker; `bench exchange` runs real shard processes with
workers off and on and prints one JSON object with every field of its rows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fastdecode.dense.handoff import Arena, Slice
from fastdecode.runtime.errors import Status, Unavailable
from fastdecode.runtime.fleet_secret import FleetSecret
from fastdecode.runtime.internal_auth import FleetAuthInterceptor
from fastdecode.runtime.settings import TLSFiles
from fastdecode.v1 import kv_attention_pb2_grpc as pb_grpc
from services.gpu_dense.exchange.messages import Attend, Err, ItemSlices, Ok
from services.gpu_dense.exchange.plane import ExchangePlane
from services.gpu_dense.exchange.process import WorkerProcess, worker_command
from tests.integration.test_shard_links import EchoShard, _item
from tests.support import make_tls
from tests.support.native_exchange import require_native_worker


async def _echo_servers(n: int) -> tuple[list[grpc.aio.Server], list[str]]:
    servers, addresses = [], []
    for _ in range(n):
        server = grpc.aio.server()
        pb_grpc.add_KVAttentionServicer_to_server(EchoShard(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    return servers, addresses


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


KINDS = ["python", "native"]
# the plane's two paths: attend_layer on the event loop, attend_layer_blocking from a slot's thread
PATHS = ["loop", "blocking"]


async def _attend(plane: ExchangePlane, path: str, slot: int, layer: int, items: list) -> list:  # type: ignore[type-arg]
    if path == "loop":
        return await plane.attend_layer(slot, layer, items)
    loop = asyncio.get_running_loop()
    return (await asyncio.to_thread(plane.attend_layer_blocking, loop, slot, layer, items)).outs


def _kind(kind: str) -> str:
    if kind == "native":
        require_native_worker()
    return kind


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_worker_fails_its_items_and_is_replaced(kind: str, path: str) -> None:
    async def run() -> None:
        servers, addresses = await _echo_servers(2)
        plane = ExchangePlane(addresses, 2, timeout=5.0, kind=_kind(kind))
        await plane.start()
        try:
            out = await _attend(plane, path, 0, 0, [_item(0, 1.0), _item(1, 2.0)])
            assert torch.equal(out[1], torch.full((2, 12), 4.0))
            victim = plane.workers[1].proc
            assert victim is not None
            victim.kill()
            victim.wait(10)
            await asyncio.sleep(0.2)  # the control socket's end reaches the plane
            out = await _attend(plane, path, 0, 1, [_item(0, 1.0), _item(1, 2.0)])
            # the other worker's shard answers; the dead one's item fails or is served by a new worker
            assert torch.equal(out[0], torch.full((2, 12), 2.0))
            assert isinstance(out[1], Unavailable) or torch.equal(out[1], torch.full((2, 12), 4.0))
            out = await _attend(plane, path, 0, 2, [_item(1, 3.0)])
            assert torch.equal(out[0], torch.full((2, 12), 6.0))
            assert plane.workers[1].proc is not None and plane.workers[1].proc.pid != victim.pid

            index = await plane.add_shard(addresses[0])  # a shard added at run time joins a live worker
            out = await _attend(plane, path, 1, 3, [_item(index, 5.0)])
            assert index == 2 and torch.equal(out[0], torch.full((2, 12), 10.0))
        finally:
            pids = [w.proc.pid for w in plane.workers if w.proc is not None]
            await plane.close()
            for server in servers:
                await server.stop(None)
        assert not any(_alive(p) for p in pids)  # close() leaves no worker behind

    asyncio.run(asyncio.wait_for(run(), 120))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_stalled_worker_fails_its_items_and_is_replaced(
    monkeypatch: pytest.MonkeyPatch, kind: str, path: str
) -> None:
    """A worker that stops answering (SIGSTOP: alive, its socket open) is caught by the plane's
    watchdog after the shard timeout plus the grace: its items fail UNAVAILABLE, and the next layer
    runs on a new worker."""
    monkeypatch.setattr("services.gpu_dense.exchange.plane.WORKER_GRACE_S", 0.3)

    async def run() -> None:
        servers, addresses = await _echo_servers(1)
        # 1.5 s: the replacement worker's first answer opens a fresh stream (over 0.5 s on a loaded host)
        plane = ExchangePlane(addresses, 1, timeout=1.5, kind=_kind(kind))
        await plane.start()
        victim = plane.workers[0].proc
        assert victim is not None
        try:
            out = await _attend(plane, path, 0, 0, [_item(0, 1.0)])
            assert torch.equal(out[0], torch.full((2, 12), 2.0))
            os.kill(victim.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            out = await _attend(plane, path, 0, 1, [_item(0, 1.0)])
            assert isinstance(out[0], Unavailable) and "did not answer" in str(out[0])
            assert time.monotonic() - t0 < 5.0
            out = await _attend(plane, path, 0, 2, [_item(0, 3.0)])
            assert torch.equal(out[0], torch.full((2, 12), 6.0))
            assert plane.workers[0].proc is not None and plane.workers[0].proc.pid != victim.pid
        finally:
            await plane.close()
            for server in servers:
                await server.stop(None)
        assert victim.poll() is not None  # the stalled worker was killed, not left behind

    asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("kind", KINDS)
def test_workers_carry_tls_and_the_fleet_secret(kind: str, tmp_path: Path) -> None:
    """A shard with mutual TLS that refuses calls without the fleet secret: a worker given the
    certificates and the secret is served; one given a wrong secret gets its items failed as
    UNAVAILABLE, naming the shard and the refusal."""
    pki = make_tls(tmp_path / "pki")
    secret = FleetSecret.parse("s" * 32, "test")
    right = TLSFiles(pki["cert"], pki["key"], pki["ca"], secret)
    wrong = TLSFiles(pki["cert"], pki["key"], pki["ca"], FleetSecret.parse("w" * 32, "test"))

    async def run() -> None:
        server = grpc.aio.server(interceptors=[FleetAuthInterceptor(secret)])
        pb_grpc.add_KVAttentionServicer_to_server(EchoShard(), server)
        port = server.add_secure_port("127.0.0.1:0", right.server_credentials())
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            plane = ExchangePlane([address], 1, right, timeout=5.0, kind=_kind(kind))
            try:
                out = await plane.attend_layer(0, 0, [_item(0, 1.5)])
                assert torch.equal(out[0], torch.full((2, 12), 3.0))
            finally:
                await plane.close()
            plane = ExchangePlane([address], 1, wrong, timeout=5.0, kind=kind)
            try:
                # grpc.aio loses the refusal's status when the item's write races the shard's close
                # (it reports INTERNAL "Internal error from Core"; 3 of 300 streams in a bare
                # repro): each item fails, and one of three names the refusal
                failed = [(await plane.attend_layer(0, 0, [_item(0, 1.5)]))[0] for _ in range(3)]
                assert all(isinstance(f, Unavailable) and "shard 0" in str(f) for f in failed), failed
                assert any("UNAUTHENTICATED" in str(f) for f in failed), failed
            finally:
                await plane.close()
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 60))


@contextlib.asynccontextmanager
async def _worker_on_one_shard(kind: str) -> AsyncIterator[tuple[Arena, ItemSlices, Callable[..., Any]]]:
    """A worker of `kind` on one echo shard, an arena holding a good item's q, k and v, and
    `layer(rid, item=good, not_before_ns=0)`: one Attend sent and its results awaited."""
    servers, addresses = await _echo_servers(1)
    worker = WorkerProcess(0, 5.0, None, worker_command(_kind(kind)))
    worker.shards[0] = addresses[0]
    arena = Arena(4096)
    q = arena.put(0, torch.full((2, 3, 4), 1.5))
    kv = arena.put(256, torch.zeros(2, 1, 4))
    good = ItemSlices(0, ["a", "b"], [1, 1], [0, 0], q.astuple(), kv.astuple(), kv.astuple(), 1024, 1024)

    async def layer(rid: int, item: ItemSlices = good, not_before_ns: int = 0) -> list[Ok | Err]:
        fut: asyncio.Future[list[Ok | Err]] = asyncio.get_running_loop().create_future()
        worker.pending[rid] = (fut, time.monotonic())
        worker.send(Attend(rid, 0, 0, arena.name, [item], not_before_ns))
        return await asyncio.wait_for(fut, 10)

    try:
        await worker.start()
        yield arena, good, layer
    finally:
        await worker.stop()
        arena.close()
        for server in servers:
            await server.stop(None)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_descriptor_fails_in_band_and_the_worker_lives_on(kind: str) -> None:
    """Slices outside the arena (q, k, v, or o's room) fail their layer as INVALID_ARGUMENT, never
    read or write past the segment; the worker then serves a good layer."""

    async def run() -> None:
        async with _worker_on_one_shard(kind) as (arena, good, layer):
            beyond = (8192, (2, 3, 4), "float32")
            for rid, bad in enumerate([good._replace(q=beyond), good._replace(o_offset=4090)], start=1):
                (r,) = await layer(rid, bad)
                assert isinstance(r, Err) and r.status == Status.INVALID_ARGUMENT.value, r
            (r,) = await layer(9)
            assert isinstance(r, Ok), r
            assert torch.equal(arena.view(Slice(*r.o)), torch.full((2, 12), 3.0))

    asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_goes_out_no_sooner_than_its_not_before_time(kind: str) -> None:
    """An emulated device's q, k, v are ready at `not_before_ns`: the worker holds the layer's bytes
    until then (the dense loop hands the layer over right after queuing the device work)."""

    async def run() -> None:
        async with _worker_on_one_shard(kind) as (arena, good, layer):
            await layer(1)  # the stream is open: what follows times the wait, not the connect
            for rid, delay_ms in ((2, 400), (3, 150)):
                sent = time.monotonic_ns()
                (r,) = await layer(rid, good, sent + delay_ms * 1_000_000)
                waited_ms = (time.monotonic_ns() - sent) / 1e6
                assert isinstance(r, Ok), r
                assert torch.equal(arena.view(Slice(*r.o)), torch.full((2, 12), 3.0))
                assert waited_ms >= delay_ms, waited_ms

    asyncio.run(asyncio.wait_for(run(), 60))


_PARENT = """
import asyncio, sys
from services.gpu_dense.exchange.messages import Attend, Err, ItemSlices, Ok
from services.gpu_dense.exchange.plane import ExchangePlane
from services.gpu_dense.exchange.process import WorkerProcess, worker_command

async def main():
    plane = ExchangePlane(["127.0.0.1:1", "127.0.0.1:2"], 2, timeout=5.0, kind=sys.argv[1])
    await plane.start()
    print(" ".join(str(w.proc.pid) for w in plane.workers), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("kind", KINDS)
def test_workers_die_with_a_killed_parent(kind: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _kind(kind)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "exchange workers outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_bench_exchange_prints_every_field_with_workers_off_and_on() -> None:
    cmd = [
        sys.executable,
        "-m",
        "fastdecode.cli",
        "bench",
        "exchange",
        "--geometry",
        "small",
        "-B",
        "8",
        "-P",
        "1,2",
        "-K",
        "0,1",
        "-n",
        "8",
        "--context",
        "8",
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    assert [(r["shards"], r["workers"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    fields = (
        "geometry",
        "batch",
        "shards",
        "workers",
        "payload_mb",
        "rt_ms",
        "dense_cpu_ms_per_mb",
        "gbps",
        "tcp_gbps",
        "grpc_echo_gbps",
        "shard_attend_ms",
    )
    for r in rows:
        assert all(f in r for f in fields), r
        assert r["geometry"] == "small" and r["batch"] == 8
        # q, k, v out and o back: 8 sequences x (2*12 + 2*12) heads x 64 x 2 bytes
        assert abs(r["payload_mb"] - 8 * 48 * 64 * 2 / 1e6) < 1e-9
        assert r["rt_ms"] > 0 and r["gbps"] > 0 and r["tcp_gbps"] > 0 and r["grpc_echo_gbps"] > 0
    # no worker, no worker CPU (with one, /proc's 10 ms ticks may still read 0 over 8 tiny layers)
    assert rows[0]["worker_cpu_ms_per_mb"] == 0 and rows[1]["worker_cpu_ms_per_mb"] >= 0


def test_bench_exchange_runs_both_workers_in_one_run() -> None:
    """--exchange-worker native,python: each K>0 row once per worker, the kind named in the row."""
    require_native_worker()
    cmd = [sys.executable, "-m", "fastdecode.cli", "bench", "exchange", "--geometry", "small", "-B", "8"]
    cmd += [
        "-P",
        "1",
        "-K",
        "0,1",
        "-n",
        "5",
        "--context",
        "8",
        "--exchange-worker",
        "native,python",
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["workers"], r["exchange_worker"]) for r in rows] == [(0, "none"), (1, "native"), (1, "python")]
    assert all(r["rt_ms"] > 0 for r in rows)


def test_bench_exchange_rejects_bad_input_in_one_line() -> None:
    cmd = [sys.executable, "-m", "fastdecode.cli", "bench", "exchange", "-B", "2", "-P", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "shards <= batch" in done.stderr
    done = subprocess.run(
        [*cmd[:-4], "--exchange-worker", "rust"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "unknown exchange worker 'rust'" in done.stderr


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_0() -> None:
    if torch.cuda.is_available():  # the GPU path is `make gpu-check` on a GPU host
        return
    done = subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", "bench", "gpu"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == [
        "gpu-check: no GPU found (torch.cuda.is_available() is False): nothing to check, exiting 0"
    ]
