"""The benchmark code paths at toy sizes: output keys and sane values, never timing thresholds."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from click.testing import CliRunner

from fastdecode.benchmarks.attention import run_attention_bench, sequence_lengths
from fastdecode.benchmarks.common import bench_workdir, format_pairs, format_table
from fastdecode.cli import main
from fastdecode.runtime.errors import InvalidInput

ATTN_KEYS = {"effective_gbps", "memory_gbps", "ratio", "attend_ms_per_layer", "kv_bytes_per_layer", "layers"}


def _finite_positive(d: dict, keys: set[str]) -> None:
    for k in keys:
        assert isinstance(d[k], int | float) and math.isfinite(d[k]) and d[k] > 0, (k, d[k])


@pytest.mark.parametrize(
    "lengths, kv_heads, backend, kv_dtype",
    [("uniform", 4, "native", "float32"), ("mixed", 2, "native", "int8"), ("mixed", 2, "torch", "bfloat16")],
)
def test_attention_bench_small(lengths: str, kv_heads: int, backend: str, kv_dtype: str) -> None:
    r = run_attention_bench(
        batch=4, context=40, heads=4, kv_heads=kv_heads, head_dim=8, layers=2, repeats=3,
        lengths=lengths, backend=backend, kv_dtype=kv_dtype, memory_bytes=1 << 20,
    )  # fmt: skip
    assert ATTN_KEYS <= r.keys()
    _finite_positive(r, ATTN_KEYS)
    lens = sequence_lengths(lengths, 4, 40, 0)
    assert (len(set(lens)) == 1) == (lengths == "uniform") and all(2 <= n <= 80 for n in lens)
    per_element = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 8}[kv_dtype]
    assert r["kv_bytes_per_layer"] == int(sum(lens) * 2 * kv_heads * 8 * per_element)
    assert r["ratio"] == pytest.approx(r["effective_gbps"] / r["memory_gbps"])
    assert r["memory_probe"] == "native stream_read" and r["backend"] == backend


def test_attention_bench_levels_side_by_side() -> None:
    """--isa and --baseline-isa time two levels interleaved on one store (same-run ratio), report the
    level and path, and put the CPUID pick back; thread clock needs one thread; a level the CPU
    lacks or does not exist is a clear error."""
    from fastdecode.kv import native

    r = run_attention_bench(
        batch=4, context=40, heads=4, kv_heads=2, head_dim=16, repeats=3, kv_dtype="float8_e4m3",
        memory_bytes=1 << 20, isa="scalar", baseline_isa="avx2", threads=1, clock="thread",
    )  # fmt: skip
    assert r["isa"] == "scalar" and r["isa_forced"] and r["path"] == "scalar" and r["clock"] == "thread"
    assert r["baseline_isa"] == "avx2" and r["baseline_path"] == "avx2"
    assert r["vs_baseline"] == pytest.approx(r["attend_ms_per_layer"] / r["baseline_ms_per_layer"])
    assert r["vs_baseline"] > 1  # the scalar path is the slow one on any AVX2 host
    assert native.isa() == native.isas()[-1] and not native.forced()
    with pytest.raises(InvalidInput, match="threads=1"):
        run_attention_bench(batch=2, context=8, heads=2, kv_heads=1, head_dim=8, clock="thread")
    with pytest.raises(InvalidInput, match="must be one of"):
        run_attention_bench(batch=2, context=8, heads=2, kv_heads=1, head_dim=8, isa="avx9", threads=1)
    assert not native.forced()


def test_attention_bench_rejects_bad_geometry() -> None:
    with pytest.raises(InvalidInput):
        run_attention_bench(heads=5, kv_heads=2)


def test_cli_bench_attention_json() -> None:
    args = ["bench", "attention", "--json", "-B", "2", "-L", "24", "--heads", "2", "--kv-heads", "1"]
    args += ["--head-dim", "8", "--repeats", "2", "--memory-mib", "1", "--kv-dtype", "bfloat16"]
    args += ["--lengths", "uniform", "--backend", "torch"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["kv_dtype"] == "bfloat16" and out["kv_bytes_per_layer"] == 2 * 24 * 2 * 8 * 2
    assert ATTN_KEYS <= out.keys()


def test_cli_bench_table_and_errors() -> None:
    res = CliRunner().invoke(main, ["bench", "attention", "-B", "1", "-L", "1"])
    assert res.exit_code != 0 and "context >= 2" in res.output
    res = CliRunner().invoke(main, ["bench", "transport", "--service-env", "NOEQUALS"])
    assert res.exit_code != 0 and "KEY=VALUE" in res.output
    assert format_pairs({"a": 1.23456, "bb": "x", "skip": {}}) == "a   1.235\nbb  x"
    assert format_table([{"a": 1, "b": 2.0}]).splitlines() == ["a  b", "1  2"]


def test_fleet_cpu_per_step_splits_the_window_by_process() -> None:
    from fastdecode.benchmarks.fleet_bench import cpu_per_step

    # 2 shards; 64 tokens at batch 32 = 2 steps in 0.5 s of wall time
    start = (32, 10.0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    end = (96, 10.5, [1.01, 2.02, 3.2, 4.04, 5.06, 6.008])
    r = cpu_per_step(start, end, batch=32, shards=2)
    assert r["fleet_cpu_ms_gateway"] == pytest.approx(5.0)
    assert r["fleet_cpu_ms_scheduler"] == pytest.approx(10.0)
    assert r["fleet_cpu_ms_gpu_dense"] == pytest.approx(100.0)
    assert r["fleet_cpu_ms_shards"] == pytest.approx(50.0)
    assert r["fleet_cpu_ms_client"] == pytest.approx(4.0)
    assert r["fleet_cpu_ms_per_step"] == pytest.approx(169.0)
    assert r["fleet_cores_busy"] == pytest.approx(0.338 / 0.5)


def test_dense_step_gap_is_the_wall_per_step_beyond_gpu_dense_steps() -> None:
    from fastdecode.benchmarks.fleet_bench import dense_step_gap

    # 4 steps in 1 s of wall time, gpu_dense busy in them for 0.9 s (0.6 s S-part): 250 ms a
    # step, 150 of it S-part, 25 idle between
    r = dense_step_gap((10.0, 3.0, 100.0, 2.0), (11.0, 3.9, 104.0, 2.6))
    assert r["fleet_s_part_ms"] == pytest.approx(150.0)
    assert r["fleet_window_step_ms"] == pytest.approx(250.0)
    assert r["fleet_dense_step_ms"] == pytest.approx(225.0)
    assert r["fleet_between_steps_ms"] == pytest.approx(25.0)
    assert dense_step_gap((10.0, 3.0, 100.0, 2.0), (11.0, 3.0, 100.0, 2.0)) == {}


def test_cli_bench_scheduler_step_json() -> None:
    """The scheduler-step bench at a tiny size: every sequence decodes through the timed steps and
    the parts add up to the total."""
    res = CliRunner().invoke(main, ["bench", "scheduler-step", "-B", "8", "-P", "2", "-n", "5", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["batch"] == 8 and out["shards"] == 2 and out["steps"] == 5
    for run in (out, out["submit"]):  # the Session's events (one message a step), then Submit's
        for key in ("plan_ms", "exchange_ms", "apply_ms", "streams_ms", "without_streams_ms"):
            assert run[key] >= 0
        assert run["scheduler_cpu_ms_per_step"] > 0 and run["scheduler_cpu_ms_per_step_mean"] > 0
        assert run["gc_ms_per_step"] >= 0 and run["gc_max_pause_ms"] >= 0 and run["gc_full_collections"] >= 0
    assert (out["events"], out["submit"]["events"]) == ("session", "submit")
    assert out["streams_ratio"] > 0


def test_a_bench_work_directory_goes_when_the_run_succeeds_and_stays_when_it_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with bench_workdir("unit") as ok:
        (ok / "gateway.log").write_text("fine")
    assert not ok.exists()
    with pytest.raises(InvalidInput), bench_workdir("unit") as bad_args:
        raise InvalidInput("batch must be >= 1")  # the caller's arguments: no logs worth keeping
    assert not bad_args.exists()
    with pytest.raises(FileNotFoundError), bench_workdir("unit") as empty:
        raise FileNotFoundError("no config.json")  # failed before any service wrote a line
    assert not empty.exists()
    assert capsys.readouterr().err == ""
    with pytest.raises(RuntimeError), bench_workdir("unit") as failed:
        (failed / "gateway.log").write_text("why it failed")
        raise RuntimeError("the decode window was not reached")
    try:
        assert (failed / "gateway.log").read_text() == "why it failed"
        assert str(failed) in capsys.readouterr().err
    finally:
        shutil.rmtree(failed)
