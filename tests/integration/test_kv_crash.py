"""`bench kv-crash` in small: kill -9 of a process appending to a persistent KV pool at random
moments; every restart re-attaches it and every committed row is the one written."""

from __future__ import annotations

from fastdecode.benchmarks.kv_crash import run_kv_crash


def test_kills_during_appends_never_leave_a_wrong_row() -> None:
    r = run_kv_crash(kills=30, seed=3)
    assert r["ok"], r
    assert r["wrong_rows"] == 0 and r["pools_discarded"] == 0
    assert r["kills_with_appends_in_flight"] >= 1  # some kills did land inside an Attend item
    assert r["sequences_started"] > 6  # sequences ended and new ones began across the restarts
