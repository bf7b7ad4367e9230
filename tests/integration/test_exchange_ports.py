"""The exchange plane's blocking path (attend_layer_blocking: a slot's own socket to each worker,
used by the step runner's layer threads) against real worker processes, both kinds: answers as the
event-loop path gives them, both slots at once and the event-loop path beside them; a cancelled
wait ends promptly and the slot's next layer skips the cancelled layer's late answer; the runner's
layer threads on an emulated device; bench/dense_loop.py. (A dead or stalled worker on this path:
test_exchange_workers.py, which runs those for both paths.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from fastdecode.dense import StepCancelled, StepRunner
from fastdecode.dense.emulated import load_emulated
from fastdecode.runtime.errors import InvalidInput, Unavailable
from fastdecode.scheduling import PlannedSeq
from fastdecode.v1 import kv_attention_pb2_grpc as pb_grpc
from services.gpu_dense.exchange.plane import ExchangePlane
from tests.integration.test_exchange_workers import KINDS, _echo_servers, _kind
from tests.integration.test_shard_links import BAD_LAYER, HANG_LAYER, EchoShard, _item


async def _blocking(
    plane: ExchangePlane, slot: int, layer: int, items: list, cancelled: threading.Event | None = None
):  # type: ignore[no-untyped-def, type-arg]
    loop = asyncio.get_running_loop()
    args = (loop, slot, layer, items, 0.0, cancelled)
    return (await asyncio.to_thread(plane.attend_layer_blocking, *args)).outs


@pytest.mark.parametrize("kind", KINDS)
def test_blocking_answers_both_slots_at_once_beside_the_event_loop_path(kind: str) -> None:
    async def run() -> None:
        servers, addresses = await _echo_servers(2)
        plane = ExchangePlane(addresses, 2, timeout=5.0, kind=_kind(kind))
        await plane.start()
        try:
            items = [_item(0, 1.0), _item(1, 2.0)]
            for layer in range(3):  # the same items: later layers send none, answers the same
                out = await _blocking(plane, 0, layer, items)
                assert torch.equal(out[0], torch.full((2, 12), 2.0))
                assert torch.equal(out[1], torch.full((2, 12), 4.0))
            bad = await _blocking(plane, 1, BAD_LAYER, [_item(0, 1.0)])
            assert isinstance(bad[0], InvalidInput) and "bad item" in str(bad[0])
            both = await asyncio.gather(  # both slots at once, and the event-loop path beside them
                _blocking(plane, 0, 3, items), _blocking(plane, 1, 3, [_item(1, 5.0)])
            )
            assert torch.equal(both[0][1], torch.full((2, 12), 4.0))
            assert torch.equal(both[1][0], torch.full((2, 12), 10.0))
            loop_out = await plane.attend_layer(0, 4, [_item(0, 7.0)])
            assert torch.equal(loop_out[0], torch.full((2, 12), 14.0))
        finally:
            await plane.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 120))


@pytest.mark.parametrize("kind", KINDS)
def test_blocking_cancelled_wait_ends_and_the_next_layer_skips_its_late_answer(kind: str) -> None:
    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_KVAttentionServicer_to_server(EchoShard(hangs=True), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        plane = ExchangePlane([f"127.0.0.1:{port}"], 1, timeout=30.0, kind=_kind(kind))
        await plane.start()
        try:
            cancelled = threading.Event()
            hung = asyncio.ensure_future(_blocking(plane, 0, HANG_LAYER, [_item(0, 1.0)], cancelled))
            await asyncio.sleep(0.5)
            assert not hung.done()
            t0 = time.monotonic()
            cancelled.set()
            with pytest.raises(StepCancelled):
                await hung
            assert time.monotonic() - t0 < 2.0  # within a poll of the port, not the shard timeout
            out = await _blocking(plane, 0, 8, [_item(0, 4.0)])  # the same slot goes on
            assert torch.equal(out[0], torch.full((2, 12), 8.0))
        finally:
            await plane.close()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("kind", KINDS)
def test_the_runner_runs_an_emulated_devices_layers_on_threads_and_a_cancelled_step_stops(
    llama_dir: Path, kind: str
) -> None:
    """The step runner on an emulated device with exchange workers: each mini-batch's layers on a
    thread of its own, every sequence sampled; a step cancelled while a worker is stopped ends
    within a poll, and the next step runs on the same sockets (the late answers skipped)."""

    async def run() -> None:
        model = load_emulated(llama_dir, "emulated:h100", torch.float32)
        servers, addresses = await _echo_servers(2)
        plane = ExchangePlane(addresses, 1, timeout=30.0, kind=_kind(kind))
        await plane.start()
        runner = StepRunner(model, plane)
        layers = model.config.num_hidden_layers

        def seqs() -> list[PlannedSeq]:
            return [PlannedSeq(f"s{i}", i % 2, i % 2, [1 + i], 0) for i in range(4)]

        try:
            outcomes, timings = await runner.run(seqs())
            assert runner._threads is not None  # the layer loops ran on threads
            assert all(o.error is None and o.token_id >= 0 for o in outcomes.values())
            assert timings.pipelined and timings.round_trips == 2 * layers
            victim = plane.workers[0].proc
            assert victim is not None
            os.kill(victim.pid, signal.SIGSTOP)
            step = asyncio.ensure_future(runner.run(seqs()))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            assert time.monotonic() - t0 < 2.0
            os.kill(victim.pid, signal.SIGCONT)
            outcomes, _ = await runner.run(seqs())
            if not all(o.error is None for o in outcomes.values()):
                # A stream the cancel cut may be lost (the Python worker's in-process links, and the
                # native worker's when the cut lands mid-item): that step's items on it fail
                # UNAVAILABLE, nothing else, and the next step runs clean.
                assert all(o.error is None or isinstance(o.error, Unavailable) for o in outcomes.values())
                outcomes, _ = await runner.run(seqs())
            assert all(o.error is None and o.token_id >= 0 for o in outcomes.values())
        finally:
            await plane.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(asyncio.wait_for(run(), 60))


def test_bench_dense_loop_runs_both_loops_and_prints_its_points(llama_dir: Path) -> None:
    """bench/dense_loop.py at a tiny size: the real runner and plane against its stand-in worker,
    both layer loops, one JSON line with every field."""
    out = subprocess.run(
        [sys.executable, "bench/dense_loop.py", "--batch", "16", "--steps", "2", "--repeats", "1"]
        + ["--answer-after", "0", "--model", str(llama_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    (point,) = json.loads(out.stdout.strip().splitlines()[-1])["points"]
    assert point["round_trips_per_step"] == 2 * 4 * 32  # 2 mini-batches x 4 shards x 32 layers
    for mode in ("thread", "loop"):
        assert point[f"{mode}_cpu_ms_per_step"] > 0 and point[f"{mode}_wall_step_ms"] > 0
    assert point["thread_vs_loop_cpu"] == pytest.approx(
        point["thread_cpu_ms_per_step"] / point["loop_cpu_ms_per_step"]
    )
