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


def test_the_commands_run_and_refuse_bad_input_in_one_line() -> None:
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "fastdecode.cli", "bench"]
    done = subprocess.run(
        [*cli, "kv-crash", "--kills", "3", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["kills"] == 3 and r["ok"] and r["wrong_rows"] == 0
    bad = subprocess.run(
        [*cli, "shard-kill", "--context", "64", "--shared-prefix", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--shared-prefix must be below --context" in bad.stderr
