"""`fastdecode up` stops every process it started on SIGTERM, and names a service that fails to start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastdecode.client import Client
from fastdecode.tools.fleet import UpProcess, free_port
from tests.support import pid_alive, start_up


def test_sigterm_leaves_no_fleet_process(model_factory: Callable, tmp_path: Path) -> None:
    fleet = start_up(model_factory("llama"), tmp_path)
    pids = fleet.pids()
    assert len(pids) == 5 and all(pid_alive(p) for p in pids)
    with Client(fleet.target) as client:
        assert client.generate(prompt="hello", max_tokens=3).token_ids
    assert fleet.stop() == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)]
    assert not (tmp_path / "fleet.json").exists()


def test_failed_start_exits_nonzero_naming_the_service(tmp_path: Path, model_factory) -> None:
    def up(model: Path, device: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fastdecode.cli", "up", "--model", str(model), "--shards", "1"]
            + ["--device", device, "--port", str(free_port()), "--kv-dtype", "bfloat16"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    # A service that fails to start (gpu_dense asked for CUDA on a host without it) is named.
    if not torch.cuda.is_available():
        res = up(model_factory("llama"), "cuda")
        assert res.returncode != 0
        assert "gpu_dense" in res.stderr and "CUDA" in res.stderr
    # A broken checkpoint is caught before any service starts: one line.
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    res = up(missing, "cpu")
    assert res.returncode != 0
    assert res.stderr.strip() == f"Error: no config.json in {missing}"


def _wait_for_restart(fleet: UpProcess, key: str, old_pid: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = fleet.reload()
        svc = state[key] if key != "kv_attention" else state[key][0]
        if svc["pid"] != old_pid and svc["restarts"] >= 1 and pid_alive(svc["pid"]):
            return svc
        time.sleep(0.2)
    raise AssertionError(f"{key} was not restarted:\n{fleet.log.read_text()[-3000:]}")


def test_up_restarts_a_killed_service_on_its_address(model_factory: Callable, tmp_path: Path) -> None:
    """kill -9 of gpu_dense, then of a shard: `up` starts each again on the same address (a new pid in the
    state file, its restart counted, the restart printed) and the fleet generates again."""
    fleet = start_up(model_factory("llama"), tmp_path)
    try:
        with Client(fleet.target, timeout=60) as client:
            expected = client.generate(prompt="hello", max_tokens=4).token_ids
            for key in ("gpu_dense", "kv_attention"):
                before = fleet.state[key] if key != "kv_attention" else fleet.state[key][0]
                assert before["restarts"] == 0
                os.kill(before["pid"], signal.SIGKILL)
                after = _wait_for_restart(fleet, key, before["pid"])
                assert after["address"] == before["address"]
                # The same greedy tokens once the fleet is whole again.
                assert client.generate(prompt="hello", max_tokens=4).token_ids == expected
        log = fleet.log.read_text()
        assert "restarted gpu_dense" in log and "restarted kv_attention-0" in log
    finally:
        fleet.stop()
