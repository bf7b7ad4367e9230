"""bench/decode_steps_latency.py at a tiny size: a real fleet per point (k = 1, then auto), background
streams decoding while probes measure their first token and the tokens after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_decode_steps_latency_runs_its_points() -> None:
    out = subprocess.run(
        [sys.executable, "bench/decode_steps_latency.py", "--background", "3", "--probes", "2"]
        + ["--decode-steps", "1", "auto", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    points = json.loads(out.stdout.strip().splitlines()[-1])["points"]
    assert [p["decode_steps"] for p in points] == [1, "auto"]
    assert points[0]["ttft_ms_p50_ratio"] == 1.0
    for p in points:
        assert 0 < p["ttft_ms_p50"] <= p["ttft_ms_p90"]
        assert p["ms_per_token_after_first_p50"] > 0 and p["background_tokens_per_s"] > 0


def test_bench_decode_steps_latency_refuses_bad_input() -> None:
    out = subprocess.run(
        [sys.executable, "bench/decode_steps_latency.py", "--decode-steps", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--decode-steps" in out.stderr
