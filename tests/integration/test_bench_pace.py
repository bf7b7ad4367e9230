"""`fastdecode bench pace` at a tiny size: a real fleet on the emulated H100, every field of a point
present and consistent; and the emulated device's errors through the CLI (one line, no traceback)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from fastdecode.cli import main
from fastdecode.dense.emulated import PROFILES, Roofline, geometry_of
from fastdecode.dense.handoff import worker_kind
from fastdecode.model.config import ModelConfig
from fastdecode.runtime.geometry import GEOMETRIES

POINT_KEYS = {
    "gpu",
    "geometry",
    "batch",
    "shards",
    "workers",
    "event_loop",
    "plan_ahead",
    "gpu_step_ms",
    "wall_step_ms",
    "cpu_ms_per_step",
    "round_trips_per_step",
    "payload_mb_per_step",
    "dense_host_cpu_ms_per_mb",
    "dense_cpu_us_per_round_trip",
    "echo_cpu_us_per_round_trip",
    "echo_cpu_ms_per_mb",
    "dense_host_cores_needed",
    "exposed_host_ms",
}
PARTS = {"scheduler", "dense_main", "exchange_workers", "shards_outside_attention", "gateway"}


def test_cli_bench_pace_tiny(model_factory: Callable, tmp_path: Path) -> None:
    png = tmp_path / "pace.png"
    args = [
        "bench",
        "pace",
        "--json",
        "--model",
        str(model_factory("llama")),
        "-B",
        "4",
        "-P",
        "1",
        "-K",
        "1",
    ]
    # 96 tokens a row: the client's marks trail the fleet, and at 8 (and once at 24, in a loaded CI
    # run) it had counted every step by the time the first mark's scrape returned (no window left)
    args += ["--prompt-len", "4", "--gen-len", "96", "--echo-repeats", "20", "--idle-seconds", "2"]
    args += ["--plot", str(png)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    (p,) = result["points"]
    assert POINT_KEYS <= p.keys() and set(p["cpu_ms_per_step"]) == PARTS
    # the kernel's part of gpu_dense's CPU (/proc's 10 ms ticks, so checked loosely)
    assert math.isfinite(p["dense_main_kernel_ms"]) and p["dense_main_kernel_ms"] >= 0
    assert (p["gpu"], p["geometry"], p["batch"], p["shards"], p["workers"]) == ("h100", "llama-3-8b", 4, 1, 1)
    assert p["event_loop"] == "uvloop"  # the services' default loop
    assert p["plan_ahead"] == "on"  # the scheduler's default
    assert p["exchange_worker"] == worker_kind("auto")  # native where built (CI), else python
    assert math.isfinite(p["dense_idle_ms"]) and p["dense_idle_ms"] < p["wall_step_ms"]
    roof = Roofline(PROFILES["h100"], GEOMETRIES["llama-3-8b"], 2).step_seconds(4)
    assert p["gpu_step_ms"] == pytest.approx(roof["gpu_step_s"] * 1e3)
    # the device clock charged exactly the roofline for each step it ran
    assert p["emulated_device_ms"] == pytest.approx(p["gpu_step_ms"], rel=0.02)
    assert p["wall_step_ms"] >= p["gpu_step_ms"] * 0.95  # the step waited for the device
    # 32 layers x 2 mini-batches x 1 shard, every step
    assert p["round_trips_per_step"] == pytest.approx(64, rel=0.05)
    assert p["payload_mb_per_step"] == pytest.approx(32 * 4 * (2 * 32 + 2 * 8) * 128 * 2 / 1e6)
    # every token reached the clients, one or more to a message
    assert 1.0 <= p["tokens_per_message"] <= 4
    names = {"gpu", "geometry", "event_loop", "plan_ahead"}
    for k in POINT_KEYS - names - {"cpu_ms_per_step", "exposed_host_ms"}:
        assert isinstance(p[k], int | float) and math.isfinite(p[k]) and p[k] > 0, (k, p[k])
    assert p["dense_host_cores_needed"] == pytest.approx(
        (p["cpu_ms_per_step"]["dense_main"] + p["cpu_ms_per_step"]["exchange_workers"]) / p["gpu_step_ms"]
    )
    # the background is CPU per second of the idle fleet, moved from the wall step to the GPU's
    assert set(p["background_cpu_ms_per_s"]) == set(p["cpu_ms_per_step_at_gpu_pace"]) == PARTS
    # (CPU times are in clock ticks: a short idle window may read 0)
    assert all(math.isfinite(v) and v >= 0 for v in p["background_cpu_ms_per_s"].values())
    before, after = p["background_windows_cpu_ms_per_s"]  # each part's lower reading is the one used
    assert all(p["background_cpu_ms_per_s"][k] == min(before[k], after[k]) for k in PARTS)
    extra_s = (p["wall_step_ms"] - p["gpu_step_ms"]) / 1e3
    for part in PARTS:
        moved = p["background_cpu_ms_per_s"][part] * extra_s
        assert p["cpu_ms_per_step_at_gpu_pace"][part] == pytest.approx(p["cpu_ms_per_step"][part] - moved)
    # the echo again, in processes of its own, once the decode window closed (whether the fleet was
    # still decoding when it ended depends on the timing: at this size it mostly was not)
    assert (
        math.isfinite(p["echo_loaded_cpu_us_per_round_trip"]) and p["echo_loaded_cpu_us_per_round_trip"] > 0
    )
    assert p["echo_loaded_cpu_ms_per_mb"] == pytest.approx(
        p["echo_loaded_cpu_us_per_round_trip"] / p["echo_cpu_us_per_round_trip"] * p["echo_cpu_ms_per_mb"]
    )
    assert isinstance(p["echo_loaded_during_decode"], bool)
    assert imread(png).size > 0


def test_bench_pace_at_the_checkpoints_own_shape(model_factory: Callable) -> None:
    """`--geometry checkpoint`: the fleet at the --model's own shape (no geometry laid over it), so
    its layers, round trips and payload are the checkpoint's; the roofline is that shape's. With
    `--decode-steps 2` each plan runs two decode steps: every figure stays per decode step."""
    model = model_factory("llama")
    cfg = ModelConfig.from_pretrained(model)
    args = ["bench", "pace", "--json", "--model", str(model), "--geometry", "checkpoint"]
    # 96 tokens a row, as in test_cli_bench_pace_tiny
    args += ["-B", "4", "-P", "1", "-K", "0", "--prompt-len", "4", "--gen-len", "96"]
    args += ["--echo-repeats", "10", "--idle-seconds", "0.5", "--decode-steps", "2"]
    args += ["--tensor-parallel", "2"]  # the roofline of 2 GPUs (8 heads, 8 KV heads split in two)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    (p,) = json.loads(res.stdout.strip().splitlines()[-1])["points"]
    assert p["geometry"] == "checkpoint" and set(p["cpu_ms_per_step"]) == PARTS
    assert p["decode_steps"] == 2 and p["tokens_per_message"] > 1, p
    assert p["round_trips_per_step"] == pytest.approx(cfg.num_hidden_layers * 2, rel=0.05)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    payload = cfg.num_hidden_layers * 4 * (2 * heads + 2 * kv) * cfg.head_dim * 2 / 1e6
    assert p["payload_mb_per_step"] == pytest.approx(payload)
    assert p["tensor_parallel"] == 2
    roof = Roofline(PROFILES["h100"], geometry_of(cfg), 2, 2).step_seconds(4)
    assert p["gpu_step_ms"] == pytest.approx(roof["gpu_step_s"] * 1e3)


@pytest.mark.parametrize(
    ("device", "geometry", "message"),
    [
        ("emulated:b200", "llama-3-8b", "unknown GPU profile 'b200'"),
        ("emulated:h100", "llama-3-70b", "llama-3-70b needs"),
        ("emulated:h100", "llama-9", "unknown geometry"),
    ],
)
def test_up_emulated_errors_are_one_line(
    model_factory: Callable, device: str, geometry: str, message: str
) -> None:
    args = ["up", "--model", str(model_factory("llama")), "--device", device, "--geometry", geometry]
    res = CliRunner().invoke(main, args)
    assert res.exit_code in (1, 2) and message in res.output, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_up_on_the_emulated_gpu_serves_synthetic_tokens(model_factory: Callable, tmp_path: Path) -> None:
    """`up --device emulated:h100 --geometry llama-3-8b`: a real fleet (the shards hold llama-3-8b's KV
    shape) answers with synthetic tokens, stop rules included, and says it is emulated at start."""
    from fastdecode.client import Client
    from fastdecode.tools.fleet import launch_up

    model = model_factory("llama")
    up = launch_up(
        model, tmp_path, "--geometry", "llama-3-8b", shards=2, device="emulated:h100", kv_capacity=64 << 20
    )
    try:
        with Client(up.target) as client:
            out = client.generate(token_ids=[1, 5, 9, 3], max_tokens=6, ignore_eos=True)
            assert len(out.token_ids) == 6 and out.finish_reason == "length"
            # greedy draws from the same synthetic rows repeat: a stop token ends the second run
            again = client.generate(token_ids=[1, 5, 9, 3], max_tokens=6, ignore_eos=True)
            assert again.token_ids == out.token_ids
            stopped = client.generate(token_ids=[1, 5, 9, 3], max_tokens=6, stop_token_ids=[out.token_ids[0]])
            assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1
    finally:
        up.stop()
    assert "is EMULATED" in up.log.read_text()
