"""A shard's KV metrics exist from the first scrape, before it holds any sequence (issue: idle shards
were blank on every dashboard until their first reservation)."""

from __future__ import annotations

from pathlib import Path

from fastdecode.tools.fleet import start_service, stop_processes
from tests.support import metric_total, scrape


def test_an_idle_shard_exports_its_capacity_and_zero_usage(tmp_path: Path) -> None:
    capacity = 64 << 20
    shard = start_service(
        "kv_attention-0",
        ["kv-attention", "--shard-id", "3", "--kv-capacity", str(capacity), "--threads", "1"],
        tmp_path,
        metrics=True,
        timeout=120,
    )
    try:
        assert shard.metrics
        samples = scrape(shard.metrics)
        assert metric_total(samples, "fastdecode_kv_bytes_capacity", shard="3") == capacity
        for name in ("fastdecode_kv_usage_ratio", "fastdecode_kv_tokens_held", "fastdecode_kv_sequences"):
            assert (name, (("shard", "3"),)) in samples, name
            assert samples[(name, (("shard", "3"),))] == 0
    finally:
        stop_processes([shard], grace=10)
