"""The S-part over two ranks (`up --tensor-parallel 2`: gpu_dense and one rank process over gloo on
loopback) serves, through a 2-shard fleet, the greedy tokens of the whole S-part in one process,
for a tiny Llama and a GQA family; a rank killed mid-decode takes gpu_dense down as one service,
`up` restarts it, and every request completes with the same greedy tokens."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fastdecode.client import Client
from fastdecode.dense.engine import LocalEngine
from fastdecode.tools.fleet import UpProcess
from tests.support import FleetFactory, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPTS = [[0, 5, 9, 13, 21], [0, 7, 7, 3], [0, 100, 200, 300, 400, 500, 600]]


def ask(fleet: UpProcess, prompt: list[int], max_tokens: int) -> list[int]:
    with Client(fleet.target, timeout=300, max_retries=0) as client:
        return client.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True).token_ids


def greedy(fleet: UpProcess, max_tokens: int = 24) -> list[list[int]]:
    """Every prompt's greedy tokens, the prompts sent at once (one batch: a third of the steps)."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: ask(fleet, p, max_tokens), PROMPTS))


def rank_pids(dense_pid: int) -> list[int]:
    """gpu_dense's tensor-parallel rank processes (its children running services.gpu_dense.ranks)."""
    children = Path(f"/proc/{dense_pid}/task/{dense_pid}/children").read_text().split()
    return [
        int(c)
        for c in children
        if "services.gpu_dense.ranks" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_give_the_tokens_of_one(
    family: str, model_factory: Callable, family_factory: Callable, fleet_factory: FleetFactory
) -> None:
    # the tiny Llama: 8 heads, 8 KV heads; qwen2: 4 heads over 2 KV heads (GQA), q/k/v biases
    model = model_factory("llama") if family == "llama" else family_factory("qwen2")
    # one rank's tokens: the S-part whole, in process (the fleet's fp32 tokens equal these and
    # transformers', tests/e2e/test_fleet.py)
    engine = LocalEngine.from_pretrained(model)
    expected = [g.token_ids for g in engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)]
    two = fleet_factory(model, "--shards", "2", "--tensor-parallel", "2", private=True)
    try:
        assert len(rank_pids(two.state["gpu_dense"]["pid"])) == 1
        assert greedy(two) == expected
    finally:
        two.stop()


def test_a_killed_rank_restarts_gpu_dense_and_every_request_completes(
    model_factory: Callable, fleet_factory: FleetFactory
) -> None:
    # The scheduler pauses requests while gpu_dense restarts: on a loaded 2-core host a restart with
    # its rank outlasted the 20 s default once (the requests failed UNAVAILABLE). This checks that
    # they complete; `up`'s own bound (two measured starts) is unit-tested in test_supervisor.
    fleet = fleet_factory(
        model_factory("llama"),
        "--shards",
        "2",
        "--tensor-parallel",
        "2",
        env={"FASTDECODE_DENSE_DOWN_TIMEOUT": "180"},
        private=True,
    )
    try:
        expected = greedy(fleet, max_tokens=200)
        dense = fleet.state["gpu_dense"]["pid"]
        (rank,) = rank_pids(dense)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            running = [pool.submit(ask, fleet, p, 200) for p in PROMPTS]
            time.sleep(1.0)  # decoding
            assert not any(r.done() for r in running)  # killed mid-decode
            os.kill(rank, signal.SIGKILL)
            got = [r.result(timeout=300) for r in running]
        assert got == expected  # re-prefilled on the restarted gpu_dense: the same greedy tokens
        deadline = time.monotonic() + 5
        while pid_alive(dense) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(dense)  # the rank's loss took its gpu_dense down
        after = fleet.reload()["gpu_dense"]
        assert after["pid"] != dense and after["restarts"] == 1
        assert len(rank_pids(after["pid"])) == 1  # with a new rank
        assert "tensor-parallel rank 1 exited" in fleet.log.read_text() + _dense_log(fleet)
    finally:
        fleet.stop()


def _dense_log(fleet: UpProcess) -> str:
    path = fleet.state_file.parent / "gpu_dense.log" if fleet.state_file else None
    return path.read_text(errors="replace") if path and path.is_file() else ""
