"""bench/gateway_behind.py at a tiny size: a real fleet whose gateway is held to a share of a core by a
cgroup (root, a cgroup cpu controller), with and without the quota."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cgroup_cpu() -> bool:
    if os.geteuid() != 0:
        return False
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    return Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists() or (
        v2.exists() and "cpu" in v2.read_text().split()
    )


@pytest.mark.skipif(not _cgroup_cpu(), reason="needs root and a cgroup cpu controller")
def test_bench_gateway_behind_runs_its_points() -> None:
    out = subprocess.run(
        [sys.executable, "bench/gateway_behind.py", "--batch", "8", "--gen-len", "12"]
        + ["--quota-cores", "0.5", "--stream-interval", "2", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    points = json.loads(out.stdout.strip().splitlines()[-1])["points"]
    assert [(p["stream_interval"], p["gateway_cores"]) for p in points] == [(2, None), (2, 0.5)]
    for p in points:
        assert p["tokens"] == 8 * 12  # every token reached its client
        assert 1.0 <= p["tokens_per_message"] <= 12
        assert p["delivery_wall_s"] > 0 and p["dense_in_steps_s"] > 0 and p["delivery_over_decode"] > 0
        assert 0 < p["ttft_p50_s"] <= p["ttft_max_s"] and p["gateway_cpu_us_per_token"] > 0
    left = [p.name for p in Path("/sys/fs/cgroup/cpu").glob("fastdecode-gateway-*")]
    assert not left, f"cgroups left behind: {left}"


def test_bench_gateway_behind_refuses_a_bad_argument() -> None:
    out = subprocess.run(
        [sys.executable, "bench/gateway_behind.py", "--quota-cores", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: --quota-cores")
    assert "Traceback" not in out.stderr
