"""The GPU host's exchange plan (fastdecode/planning/exchange_plan.py): costs from a bench exchange result,
workers enough to hide the exchange under the GPU's layer, capped by the cores, and the limit named."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fastdecode.planning.exchange_plan import ExchangeCosts, parse_step_ms, plan_host, plan_hosts
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import GEOMETRIES, geometry

BENCH = {
    "rows": [
        {"workers": 0, "dense_cpu_ms_per_mb": 0.7, "worker_cpu_ms_per_mb": 0.0, "gbps": 0.4},
        {"workers": 1, "dense_cpu_ms_per_mb": 0.2, "worker_cpu_ms_per_mb": 1.0, "gbps": 2.0},
        {"workers": 2, "dense_cpu_ms_per_mb": 0.1, "worker_cpu_ms_per_mb": 1.2, "gbps": 3.0},
    ]
}


def test_costs_are_medians_of_the_rows() -> None:
    c = ExchangeCosts.from_bench(BENCH)
    assert c.inproc_ms_per_mb == 0.7 and c.dense_ms_per_mb == pytest.approx(0.15)
    assert c.worker_ms_per_mb == pytest.approx(1.1) and c.worker_gbps == 2.0  # one worker's rows
    with pytest.raises(InvalidInput, match="0 workers"):
        ExchangeCosts.from_bench({"rows": BENCH["rows"][1:]})
    with pytest.raises(InvalidInput, match="missing"):
        ExchangeCosts.from_bench({"rows": [{"workers": 0}, {"workers": 1}]})


def test_workers_hide_the_exchange_under_the_gpu_until_the_cores_run_out() -> None:
    g = GEOMETRIES["llama-3-8b"]
    costs = ExchangeCosts(0.7, 0.05, 1.0, 2.0)
    # B=256 bf16: 5.24 MB per layer; 10 ms per step on 32 layers = 0.3125 ms per layer
    p = plan_host(g, 256, 10.0, costs, cores=64)
    assert p.payload_mb_per_layer == pytest.approx(256 * 80 * 128 * 2 / 1e6)
    assert p.exchange_workers == 17  # ceil(5.24 ms of worker CPU / 0.3125 ms)
    assert p.shards == 17 and p.limiting_factor == "gpu (dense S-part)"
    assert p.predicted_step_ms == pytest.approx(10.0)
    assert p.inproc_step_ms == pytest.approx(10.0 + 32 * 5.24288 * 0.7)
    small = plan_host(g, 256, 10.0, costs, cores=8)
    assert small.exchange_workers == 7
    assert small.limiting_factor.startswith("exchange workers' CPU (needs 17 workers")
    assert small.predicted_step_ms == pytest.approx(32 * 5.24288 * 1.0 / 7)


def test_step_spec_and_bad_input() -> None:
    assert parse_step_ms("256=10, 1024=31.5") == {256: 10.0, 1024: 31.5}
    for bad in ("256", "x=1", "256=0", ""):
        with pytest.raises(InvalidInput):
            parse_step_ms(bad)
    with pytest.raises(InvalidInput, match="no --dense-step-ms"):
        plan_hosts(GEOMETRIES["small"], {256: 1.0}, ExchangeCosts(1, 1, 1, 1), 16, batches=[512])
    with pytest.raises(InvalidInput):
        geometry(None, heads=6, kv_heads=4, head_dim=64)  # heads not a multiple of kv heads
    assert geometry(None, hidden=1024, heads=8).head_dim == 128


def test_plan_cli_gpu_host_mode(tmp_path) -> None:  # noqa: ANN001 - pytest's fixture
    from fastdecode.cli.policy import plan_cmd

    f = tmp_path / "bench.json"
    f.write_text("exchange table...\n" + json.dumps(BENCH) + "\n")
    r = CliRunner().invoke(plan_cmd, ["--dense-step-ms", "256=10", "--exchange", str(f), "--json"])
    assert r.exit_code == 0, r.output
    plans = json.loads(r.output)["plans"]
    assert plans[0]["batch"] == 256 and plans[0]["exchange_workers"] >= 1
    r = CliRunner().invoke(plan_cmd, ["--dense-step-ms", "256=10"])
    assert r.exit_code != 0 and "needs both" in r.output
