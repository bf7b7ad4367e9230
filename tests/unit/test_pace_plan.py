"""`plan --gpu --pace`: unit costs from a `bench pace` result, the GPU-alone baseline, the split's step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastdecode.dense.emulated import PROFILES, Roofline
from fastdecode.planning.pace_plan import UnitCosts, gpu_alone, plan_pace
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import GEOMETRIES


def _point(batch: int, trips: float, mb: float, dense: float, workers: float, sched: float) -> dict:
    return {
        "batch": batch,
        "round_trips_per_step": trips,
        "payload_mb_per_step": mb,
        "cpu_ms_per_step": {"dense_main": dense, "exchange_workers": workers, "scheduler": sched},
    }


def test_unit_costs_fit_per_mb_and_per_round_trip() -> None:
    # made from 0.5 ms/MB and 100 us per round trip exactly
    pts = [_point(16, 128, 10.0, 10.0, 7.8, 1.6), _point(256, 256, 168.0, 60.0, 49.6, 12.8)]
    c = UnitCosts.from_pace({"points": pts})
    assert c.ms_per_mb == pytest.approx(0.5) and c.us_per_round_trip == pytest.approx(100.0)
    assert c.scheduler_us_per_seq == pytest.approx(100.0)
    one = UnitCosts.from_pace({"points": pts[1:]})  # one point: all of it per MB
    assert one.ms_per_mb == pytest.approx(109.6 / 168.0) and one.us_per_round_trip == 0
    with pytest.raises(InvalidInput, match="no `points`"):
        UnitCosts.from_pace({"rows": []})


def test_split_beats_the_gpu_alone_only_where_the_kv_does_not_fit() -> None:
    roof = Roofline(PROFILES["h100"], GEOMETRIES["llama-3-8b"], 2)
    b_short, _ = gpu_alone(roof, 512)
    b_long, _ = gpu_alone(roof, 8192)
    assert b_short > 8 * b_long > 0  # the KV the GPU's memory holds bounds its batch
    costs = UnitCosts(0.5, 50.0, 5.0)
    pts = plan_pace(
        PROFILES["h100"], GEOMETRIES["llama-3-8b"], costs, [1024], [512, 8192], [4, 32], 150.0, 16
    )
    by = {(p.context, p.shards): p for p in pts}
    # few shard hosts: their memory bandwidth sets the step; many: the split's aggregate bandwidth wins
    assert by[512, 4].limit == "shards" and by[512, 4].speedup < 1 < by[8192, 32].speedup
    gpu_ms = roof.step_seconds(1024)["gpu_step_s"] * 1e3
    host = 0.5 * 32 * GEOMETRIES["llama-3-8b"].payload_bytes(1024, 2) / 1e6 + 50.0 * 32 * 2 * 32 / 1e3
    assert by[512, 32].split_step_ms == pytest.approx(max(gpu_ms, host / 16), rel=1e-6)


def test_a_70b_model_is_planned_over_tensor_parallel_gpus_only() -> None:
    g, costs = GEOMETRIES["llama-3-70b"], UnitCosts(0.5, 50.0, 5.0)
    with pytest.raises(InvalidInput, match="h100 has 80 GiB"):
        plan_pace(PROFILES["h100"], g, costs, [256], [4096], [8], 150.0, 16)
    two, four = (
        plan_pace(PROFILES["h100"], g, costs, [256], [4096], [8], 150.0, 16, 2, tensor_parallel=n)[0]
        for n in (2, 4)
    )
    # four GPUs leave more memory for the GPU-alone baseline's KV, and each holds 1/4 of the heads
    assert four.gpu_alone_batch > two.gpu_alone_batch > 0
    assert four.split_step_ms <= two.split_step_ms


def test_plan_command_takes_tensor_parallel_ranks(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fastdecode.cli import main

    pace = tmp_path / "pace.json"
    pace.write_text(json.dumps({"points": [_point(256, 256, 168.0, 60.0, 49.6, 12.8)]}) + "\n")
    args = ["plan", "--gpu", "h100", "--geometry", "llama-3-70b", "--pace", str(pace), "--json"]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code != 0 and "h100 has 80 GiB" in refused.output  # one line, no traceback
    assert "Traceback" not in refused.output
    more = ["--tensor-parallel", "4", "--contexts", "4096", "--batches", "256"]
    res = CliRunner().invoke(main, [*args, *more])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["points"] and all(p["context"] == 4096 and p["batch"] == 256 for p in out["points"])
