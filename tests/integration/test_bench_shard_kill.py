"""`bench shard-kill` in small: kill -9 of a shard mid-decode, today's re-prefill against a pool
that outlives the process; both keep the tokens of a run without the kill, and only the pool's run
resumes its sequences with nothing re-prefilled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastdecode.benchmarks.shard_kill import run_shard_kill


def test_bench_shard_kill_tiny(model_factory: Callable, tmp_path: Path) -> None:
    r = run_shard_kill(
        model_factory("llama"), sequences=4, context=48, tokens=24, kv_dtypes=("float32",), kv_dir=tmp_path
    )
    assert r["float32_today_same_tokens"] and r["float32_kv-dir_same_tokens"]
    assert r["float32_today_recovered_sequences"] >= 1 and r["float32_today_recovered_tokens"] >= 48
    assert r["float32_kv-dir_recovered_sequences"] == 0 and r["float32_kv-dir_reprefilled_positions"] == 0
    assert r["float32_kv-dir_resumed_sequences"] >= 1
    assert r["float32_stall_ratio"] > 0
