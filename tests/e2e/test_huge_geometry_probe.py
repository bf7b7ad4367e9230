"""bench chaos's huge_geometry probe against a real `up` fleet: Reserves of the geometry (2^31-1)^3
with the fleet secret, sent to every shard while requests decode, are each RESOURCE_EXHAUSTED within
a second with the shard's RSS flat, and every request ends with the fault-free tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastdecode.benchmarks.chaos_attacks import huge_geometry_probe
from fastdecode.tools.fleet import launch_up
from tests.support.load import stream_load

PROMPTS = [[0, 17, 300, 45], [0, 99, 5, 1200, 77], [0, 600], [0, 7, 250, 1800]]
GEN_LEN = 200  # the load lasts seconds: the Reserves land mid-decode


_load = stream_load(PROMPTS, GEN_LEN)


def test_huge_geometry_reserves_under_load_are_refused_at_once(
    model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    up = launch_up(model_factory("llama"), tmp_path, shards=2, kv_capacity=64 << 20)
    try:
        reference = _load(up)
        assert all(o.error is None and len(o.tokens) == GEN_LEN for o in reference.values())
        report = huge_geometry_probe(up, _load, reference, GEN_LEN, sends=2)
    finally:
        up.stop()
    assert report["huge_reserves"] == 4 and report["huge_refused_resource_exhausted"] == 4, report
    assert report["huge_answered_under_load"] == 4, report
    assert report["huge_answer_max_s"] < 1.0, report
    assert report["shard_rss_growth_per_call_max_mib"] < 50, report
    assert report["crashed"] == 0 and report["completed"] == len(PROMPTS), report
    assert report["tokens_equal_fault_free"] == len(PROMPTS), report
