"""`bench attention --positions N` (a speculative verification step: N new positions per sequence)
at toy sizes: its same-run ratio against one position, and its refusals; never timing thresholds."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fastdecode.benchmarks.attention import run_attention_bench
from fastdecode.cli import main
from fastdecode.runtime.errors import InvalidInput

TOY = {
    "batch": 3,
    "context": 24,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 32,
    "repeats": 3,
    "memory_bytes": 1 << 20,
}


@pytest.mark.parametrize(
    "backend, kv_dtype", [("native", "bfloat16"), ("native", "int8"), ("torch", "float32")]
)
def test_positions_are_timed_beside_one(backend: str, kv_dtype: str) -> None:
    r = run_attention_bench(**TOY, positions=4, backend=backend, kv_dtype=kv_dtype, lengths="uniform")
    assert r["positions"] == 4
    assert r["vs_one_position"] == pytest.approx(r["attend_ms_per_layer"] / r["one_position_ms_per_layer"])
    # both read the same keys: each sequence holds `context` tokens, the last 4 (or 1) of them new
    assert (
        r["kv_bytes_per_layer"]
        == 3 * 24 * 2 * 2 * 32 * {"bfloat16": 2, "int8": 1 + 4 / 32, "float32": 4}[kv_dtype]
    )
    one = run_attention_bench(**TOY, backend=backend, kv_dtype=kv_dtype)
    assert one["positions"] == 1 and "vs_one_position" not in one


def test_positions_with_a_baseline_level_and_a_level_against_itself() -> None:
    """--baseline-isa times the same positions on a second level; a level may be its own baseline
    (the noise floor of a same-run ratio)."""
    r = run_attention_bench(**TOY, positions=2, isa="scalar", baseline_isa="scalar", threads=1)
    assert r["baseline_isa"] == "scalar" and r["vs_baseline"] > 0
    assert r["vs_baseline"] == pytest.approx(r["attend_ms_per_layer"] / r["baseline_ms_per_layer"])
    assert r["vs_one_position"] > 0


def test_positions_refused_past_the_shortest_sequence() -> None:
    with pytest.raises(InvalidInput, match="positions"):
        run_attention_bench(**TOY, positions=25, lengths="uniform")
    with pytest.raises(InvalidInput, match="positions"):
        run_attention_bench(**TOY, positions=0)


def test_cli_positions_json() -> None:
    args = ["bench", "attention", "--json", "-B", "2", "-L", "16", "--heads", "4", "--kv-heads", "1"]
    args += ["--head-dim", "32", "--repeats", "2", "--memory-mib", "1", "--kv-dtype", "bfloat16"]
    args += ["--lengths", "uniform", "--positions", "5"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["positions"] == 5 and out["vs_one_position"] > 0
