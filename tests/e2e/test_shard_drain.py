"""A real fleet (`fastdecode up`, 3 shards, fp32 KV) drains a shard mid-decode through
`fastdecode shards drain`: every stream completes with the tokens of a run without the drain, no
sequence is re-prefilled, the shard leaves the tables and its process exits by itself. Then kill -9
of a migration's source or target during a drain: every stream still completes, token for token."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fastdecode.client import Client
from fastdecode.tools.fleet import UpProcess, launch_up
from tests.support import pid_alive

STREAMS, TOKENS = 12, 320


def _prompts() -> list[list[int]]:
    return [[0, 11 + i, 40 + 3 * i, 7, 90 - i] for i in range(STREAMS)]


def _stream_all(target: str, started: concurrent.futures.Future[None] | None = None) -> list[list[int]]:
    """Every prompt as a concurrent greedy stream; `started` is set once each has its first tokens."""
    count = 0

    def one(prompt: list[int]) -> list[int]:
        nonlocal count
        out: list[int] = []
        with Client(target, timeout=300) as client:
            for chunk in client.stream(token_ids=prompt, max_tokens=TOKENS, ignore_eos=True):
                if not out and started is not None:
                    count += 1
                    if count == STREAMS and not started.done():
                        started.set_result(None)
                out += chunk.token_ids
        return out

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        return list(pool.map(one, _prompts()))


def _shards_cli(up: UpProcess, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fastdecode.cli", "shards", *args, "--state-file", str(up.state_file)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _listed(up: UpProcess) -> list[dict]:
    done = _shards_cli(up, "list", timeout=30)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _wait_exit(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"shard process {pid} did not exit"
        time.sleep(0.1)


def _start(model: Path, workdir: Path) -> UpProcess:
    # rebalancing off: the drain alone moves sequences, so migrated_sequences counts only its moves
    return launch_up(model, workdir, shards=3, env={"FASTDECODE_REBALANCE_FACTOR": "0"})


def test_drain_mid_decode_moves_every_sequence_and_the_shard_exits(
    model_factory: Callable, tmp_path: Path
) -> None:
    up = _start(model_factory("llama"), tmp_path)
    try:
        expected = _stream_all(up.target)  # the run without a drain, same fleet
        assert all(len(t) == TOKENS for t in expected)
        pid = int(up.state["kv_attention"][1]["pid"])
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        with concurrent.futures.ThreadPoolExecutor(1) as runner:
            run = runner.submit(_stream_all, up.target, started)
            started.result(timeout=120)
            assert _listed(up)[1]["sequences"] > 0  # it holds sequences mid-decode
            done = _shards_cli(up, "drain", "--shard", "1")
            got = run.result(timeout=300)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.splitlines()[-1])
        assert got == expected  # 12/12 completed, token for token
        assert result["shard"] == 1 and result["reprefilled_sequences"] == 0
        assert result["migrated_sequences"] > 0 and result["migrated_bytes"] > 0
        _wait_exit(pid)  # it exited by itself (Retire), and `up` leaves a clean exit down
        assert [s["state"] for s in _listed(up)] == ["serving", "removed", "serving"]
        assert _stream_all(up.target) == expected  # the fleet serves on the two left
        log = up.log.read_text()
        assert "kv_attention-1 exited with code 0" in log and "restarted kv_attention-1" not in log
    finally:
        up.stop()


@pytest.mark.parametrize("victim", ["source", "target"])
def test_kill_9_during_a_drain_costs_time_not_requests(
    model_factory: Callable, tmp_path: Path, victim: str
) -> None:
    up = _start(model_factory("llama"), tmp_path)
    try:
        expected = _stream_all(up.target)
        kill = 1 if victim == "source" else 2  # draining shard 1 moves its sequences to 0 and 2
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        with concurrent.futures.ThreadPoolExecutor(2) as runner:
            run = runner.submit(_stream_all, up.target, started)
            started.result(timeout=120)
            drain = runner.submit(_shards_cli, up, "drain", "--shard", "1")
            source_log = Path(up.state["kv_attention"][1]["log"])
            deadline = time.monotonic() + 60
            while "migrated" not in source_log.read_text() and time.monotonic() < deadline:
                time.sleep(0.005)  # the first copy is done: the next ones are under way
            os.kill(int(up.state["kv_attention"][kill]["pid"]), signal.SIGKILL)
            got = run.result(timeout=300)
            done = drain.result(timeout=300)
        assert got == expected  # every stream completed, token for token
        assert done.returncode == 0, done.stderr  # the drain still finished
    finally:
        up.stop()
