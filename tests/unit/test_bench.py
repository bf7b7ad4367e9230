"""The benchmark code paths at toy sizes: output keys and sane values, never timing thresholds."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from fastdecode.benchmarks.attention import run_attention_bench
from fastdecode.benchmarks.common import format_pairs, format_table
from fastdecode.cli import main
from fastdecode.errors import InvalidInput

ATTN_KEYS = {"effective_gbps", "memory_gbps", "ratio", "attend_ms_per_layer", "kv_bytes_per_layer", "layers"}
def _finite_positive(d: dict, keys: set[str]) -> None:
    for k in keys:
        assert isinstance(d[k], int | float) and math.isfinite(d[k]) and d[k] > 0, (k, d[k])


@pytest.mark.parametrize("ragged, kv_heads", [(False, 4), (True, 2)])
def test_attention_bench_small(ragged: bool, kv_heads: int) -> None:
    r = run_attention_bench(
        batch=4, context=40, heads=4, kv_heads=kv_heads, head_dim=8, layers=2, repeats=3,
        ragged=ragged, memory_bytes=1 << 20,
    )  # fmt: skip
    assert ATTN_KEYS <= r.keys()
    _finite_positive(r, ATTN_KEYS)
    lengths = [40 - (i % 16 if ragged else 0) for i in range(4)]
    assert r["kv_bytes_per_layer"] == sum(lengths) * 2 * kv_heads * 8 * 4
    assert r["ratio"] == pytest.approx(r["effective_gbps"] / r["memory_gbps"])


def test_attention_bench_rejects_bad_geometry() -> None:
    with pytest.raises(InvalidInput):
        run_attention_bench(heads=5, kv_heads=2)


def test_cli_bench_attention_json() -> None:
    args = ["bench", "attention", "--json", "-B", "2", "-L", "24", "--heads", "2", "--kv-heads", "1"]
    args += ["--head-dim", "8", "--repeats", "2", "--memory-mib", "1", "--kv-dtype", "bfloat16"]
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
