"""Every `fastdecode bench` subcommand at a tiny size, through the command line, checking the fields of
its --json object (not only that it exits 0). attention: tests/unit/test_bench.py; fleet, transport:
test_bench_fleets.py; split: test_bench_split.py; exchange, gpu: test_exchange_workers.py. A bench
that fails prints one line, never a traceback."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from fastdecode.cli import main


def _bench(*args: str, timeout: float = 600) -> dict[str, Any]:
    """`fastdecode bench ARGS --json` in its own process (the fleet benches start and kill fleets)."""
    cmd = [sys.executable, "-m", "fastdecode.cli", "bench", *args, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _finite(result: dict[str, Any], keys: set[str]) -> None:
    assert keys <= result.keys(), keys - result.keys()
    for k in keys:
        assert isinstance(result[k], int | float) and math.isfinite(result[k]), (k, result[k])


def test_bench_structured_tiny(smollm2: Path) -> None:
    r = _bench("structured", "--model", str(smollm2), "-B", "2", "-n", "2")
    _finite(r, {"plain_step_ms", "structured_step_ms", "mask_ms", "mask_share_of_step", "answers_finished"})
    assert r["batch"] == 2 and r["steps"] == 2 and r["plain_step_ms"] > 0 and r["mask_ms"] >= 0


def test_bench_load_tiny(model_factory: Callable[..., Path]) -> None:
    args = ["--model", str(model_factory("llama")), "--clients", "3", "--prompt-len", "4", "--gen-len", "4"]
    r = _bench("load", *args, "--shards", "1", "--bound-s", "120")
    _finite(r, {"tokens_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "itl_p99_ms"})
    assert (r["requests"], r["completed"], r["lost_or_hung"], r["errors"]) == (3, 3, 0, {})
    assert r["clients"] == 3 and r["shards"] == 1 and r["tokens_per_s"] > 0


def test_bench_chaos_tiny(model_factory: Callable[..., Path]) -> None:
    args = ["--model", str(model_factory("llama")), "--clients", "2", "--requests-per-client", "1"]
    args += ["--prompt-len", "4", "--gen-len", "12", "--shards", "2", "--kills", "1", "--interval-s", "0.5"]
    r = _bench("chaos", *args, "--no-probes", "--bound-s", "120")
    # the clients go on sending until the kill is over: at least one round, every one completed
    assert r["requests_sent"] == r["completed"] == r["tokens_equal_fault_free"] >= 2
    assert r["failed"] == 0 and len(r["kills"]) == 1
    # --no-probes leaves the kill itself as the one probe
    assert [p["name"] for p in r["probes"]] == ["repeated_kills"]
    assert {"requests", "completed", "failed_clear", "hung", "lost", "max_answer_s"} <= r["probes"][0].keys()
    assert r["probes"][0]["hung"] == r["probes"][0]["lost"] == 0
    assert {"service", "at_s", "back_after_s"} <= r["kills"][0].keys()
    _finite(r, {"load_s"})
    assert sum(r["restarts"].values()) >= 1  # `up` brought the killed service back


def test_bench_migrate_tiny(model_factory: Callable[..., Path]) -> None:
    """The drain and the skewed load, each on fleets of 3 shards: the scheduler's stats (which need the
    fleet credential) give the copy and rebalancing figures."""
    args = ["--model", str(model_factory("llama")), "--streams", "3", "--prompt-len", "8", "--gen-len", "24"]
    r = _bench("migrate", *args, "--skew-clients", "2", "--skew-requests", "3")
    assert r["requests"] == r["completed"] == r["equal_to_reference"] == 3
    assert r["drain_error"] == "" and r["drained_shard_exited"] is True
    assert r["migrated_sequences"] + r["reprefilled_sequences"] <= 3
    _finite(r, {"drain_s", "migrated_bytes", "migrate_mb_per_s", "skew_tokens_per_s_ratio"})
    assert r["skew_completed"] == r["skew_completed_off"] == r["skew_requests"] == 3
    assert r["rebalance_factor"] == 1.1 and r["rebalance_migrations"] >= 0


def test_bench_spec_tiny(model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """Two fleets (off, ngram) on the tiny model over a JSONL of conversations: the same greedy tokens,
    fewer steps and KV bytes a token where drafts were kept, acceptance per draft position, a plot;
    a bad --modes or prompts file is one line."""
    convs = tmp_path / "convs.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "Repeat: a b c a b c a b c"}]},
        [{"role": "user", "content": "Hi"}],
    ]
    convs.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = ["--model", str(model_factory("llama")), "-B", "2", "--max-tokens", "24", "--modes", "off,ngram"]
    r = _bench("spec", *args, "--prompts", str(convs), "--plot", str(tmp_path / "spec.png"))
    assert (tmp_path / "spec.png").stat().st_size > 0
    assert r["ngram_same_tokens"] is True and r["off_tokens"] == r["ngram_tokens"] == 48
    assert 1.0 <= r["ngram_tau"] <= 4.0 and 0.0 <= r["ngram_drafts_kept"] <= 1.0
    kept = r["ngram_kept_at_position"]
    assert len(kept) == 3 and all(k is None or 0.0 <= k <= 1.0 for k in kept)
    if r["ngram_drafts_kept"] > 0:  # a random model's output repeats: lookups find it
        assert r["ngram_steps_per_token"] < r["off_steps_per_token"]
        assert r["ngram_kv_bytes_per_token_ratio"] < 1.0
    _finite(r, {"off_tokens_per_s", "ngram_tokens_per_s", "ngram_speedup"})
    res = CliRunner().invoke(main, ["bench", "spec", "--modes", "off,eagle"])
    assert res.exit_code == 2 and "--modes" in res.output and "Traceback" not in res.output
    convs.write_text('{"messages": "not a list"}\n')
    res = CliRunner().invoke(main, ["bench", "spec", *args, "--prompts", str(convs)])
    assert res.exit_code == 1 and "convs.jsonl:1" in res.output and "Traceback" not in res.output


def test_a_failing_bench_prints_one_line(tmp_path: Path) -> None:
    """Whatever ends a benchmark (here: no checkpoint where --model points) is one line, exit 1."""
    res = CliRunner().invoke(main, ["bench", "load", "--model", str(tmp_path / "nothing"), "--json"])
    assert res.exit_code == 1 and res.exception is None or isinstance(res.exception, SystemExit)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in res.output
