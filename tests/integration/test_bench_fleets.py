"""Benchmarks that start servers or a fleet (the pure benchmark checks are tests/unit/test_bench*.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from fastdecode.benchmarks.plot import fleet_bench_figure
from fastdecode.benchmarks.transport import run_transport_bench
from fastdecode.cli import main

TRANSPORT_KEYS = {
    "fleet_step_ms",
    "local_step_ms",
    "fleet_s_part_ms",
    "shard_attend_ms",
    "fleet_dense_step_ms",
    "attend_rt_ms",
    "echo_rt_ms",
    "tcp_echo_rt_ms",
}


def _finite_positive(d: dict, keys: set[str]) -> None:
    for k in keys:
        assert isinstance(d[k], int | float) and math.isfinite(d[k]) and d[k] > 0, (k, d[k])


def test_transport_bench_tiny(model_factory: Callable) -> None:
    r = run_transport_bench(model_factory("llama"), batch=4, context=8, steps=2, warmup=1, rt_repeats=20)
    assert TRANSPORT_KEYS <= r.keys()
    _finite_positive(r, TRANSPORT_KEYS)
    assert r["overhead"] > -1 and r["overhead"] == pytest.approx(r["fleet_step_ms"] / r["local_step_ms"] - 1)
    assert r["shard_items_per_step"] == 2 * 4  # two mini-batches x tiny's 4 layers, one shard


def test_cli_bench_fleet_plot(model_factory: Callable, tmp_path: Path) -> None:
    # The real bench at toy sizes (~15 s: one fleet, one shard for the RTT probe): its result feeds the plot.
    png = tmp_path / "fleet.png"
    args = ["bench", "fleet", "--json", "--model", str(model_factory("llama")), "-B", "2"]
    # 24 tokens a row: the window's marks follow the client, which trails the fleet; at 6 a loaded
    # host delivered the whole window in one burst, after gpu_dense had counted its last step
    args += ["--prompt-len", "6", "--gen-len", "24", "--plot", str(png)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert {f"{s}_itl_p{q}_ms" for s in ("hf", "local", "fleet") for q in (10, 50, 90, 99)} <= result.keys()
    # per-process CPU over the steady window (clock ticks are 10 ms: toy sizes may read 0)
    cpu = {f"fleet_cpu_ms_{n}" for n in ("gateway", "scheduler", "gpu_dense", "shards", "client", "per_step")}
    assert all(result[k] >= 0 for k in cpu | {"fleet_cores_busy"})
    assert result["fleet_cpu_ms_per_step"] == pytest.approx(
        sum(result[k] for k in cpu - {"fleet_cpu_ms_per_step"})
    )
    # every dense step counted once, by the mode it ran in (what --pipeline auto chose)
    assert result["fleet_piped_steps"] + result["fleet_plain_steps"] >= 6
    assert result["fleet_window_step_ms"] > 0 and result["fleet_dense_step_ms"] > 0
    assert result["fleet_between_steps_ms"] == pytest.approx(
        result["fleet_window_step_ms"] - result["fleet_dense_step_ms"]
    )
    assert f"plot written to {png}" in res.stderr
    assert imread(png).size > 0
    assert len(fleet_bench_figure(result).axes) == 2
