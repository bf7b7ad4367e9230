"""`bench split` and `bench pace` with --speculative on the emulated H100, at a tiny size: real shards
attend each row's d + 1 positions, the emulated device keeps drafts at the given rates, and both
report tokens/s with and without drafts from the same run, tau and round trips per token; bench
split also with the controller's k (auto), and on the CPU dense host with the real model verifying."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.dense.emulated import RECORDED_ACCEPTANCE
from tests.integration.test_bench_split import _namespaces


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one per emulated host")
def test_cli_bench_split_emulated_speculative(model_factory: Callable) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    args = ["bench", "split", "--json", "--model", str(model_factory("llama")), "--contexts", "48", "-B", "4"]
    # four warm-up rounds: the auto mode's controller decides once before the timed steps
    args += ["--steps", "4", "--warmup", "4", "--pipeline", "on", "--device", "emulated:h100"]
    args += ["--speculative", "ngram", "-k", "3", "--acceptance", "0.9,0.7,0.5"]
    args += ["--dense-cpus", str(cpus[0]), "--shard-cpus", str(cpus[1])]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert (result["speculative"], result["num_speculative_tokens"]) == ("ngram", 3)
    assert result["acceptance"] == "emulated" and result["acceptance_rates"] == [0.9, 0.7, 0.5]
    assert result["device"] == "emulated:h100" and result["crossover_context"] is None
    (p,) = result["points"]
    assert p["context"] == 48
    for k in ("off_tokens_per_s", "spec_tokens_per_s", "off_step_ms", "spec_step_ms", "off_shard_busy_ms"):
        assert math.isfinite(p[k]) and p[k] > 0, k
    assert p["speedup"] == pytest.approx(p["spec_tokens_per_s"] / p["off_tokens_per_s"])
    assert p["off_tokens_per_step"] == 4  # one token a row without drafts
    # every row drafted from its (repeating) synthetic history, and kept some at the emulated rates
    assert 2 <= p["drafts_per_row"] <= 3
    assert 1 < p["tau"] <= 4 and p["expected_tau"] == pytest.approx(1 + 0.9 + 0.7 + 0.5)
    assert p["spec_tokens_per_step"] == pytest.approx(4 * p["tau"])
    # a round trip per layer, shard and mini-batch, over more tokens with drafts
    assert p["off_round_trips_per_token"] == pytest.approx(2 * 4 / 4)  # tiny: 4 layers, 2 halves, 1 shard
    assert p["spec_round_trips_per_token"] == pytest.approx(p["off_round_trips_per_token"] / p["tau"])
    # the roofline charged each row's d + 1 positions
    assert p["spec_gpu_step_ms"] > p["off_gpu_step_ms"]
    _check_auto(result, p, steps=4)
    assert p["auto_decisions"] >= 1 and 0 < p["auto_gpu_step_ms"]
    assert _namespaces() == []


def _check_auto(result: dict, p: dict, steps: int) -> None:
    """The auto mode's keys: its tokens/s against off, the k its controller settled on and held over
    the timed steps, and its drafts' figures."""
    assert result["auto_first_decision"] >= 1 and result["auto_decide_every"] >= 1
    assert p["auto_speedup"] == pytest.approx(p["auto_tokens_per_s"] / p["off_tokens_per_s"])
    assert p["spec_speedup"] == p["speedup"]
    for k in ("auto_tokens_per_s", "auto_step_ms", "auto_shard_busy_ms", "auto_round_trips_per_token"):
        assert math.isfinite(p[k]) and p[k] > 0, k
    assert 0 <= p["auto_k"] <= 3 and sum(p["auto_k_steps"].values()) == steps
    assert all(0 <= int(k) <= 3 for k in p["auto_k_steps"])
    assert 1 <= p["auto_tau"] <= 4 and 0 <= p["auto_drafts_per_row"] <= 3
    assert p["auto_tokens_per_step"] == pytest.approx(4 * p["auto_tau"])
    assert len(p["kept_at"]) == len(p["auto_kept_at"]) == 3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one per emulated host")
def test_cli_bench_split_speculative_on_the_cpu_dense_host(model_factory: Callable) -> None:
    # the real model verifies: no emulated rates, no roofline, a copy of the sequences a mode
    cpus = sorted(os.sched_getaffinity(0))
    args = ["bench", "split", "--json", "--model", str(model_factory("llama")), "--contexts", "32", "-B", "4"]
    args += ["--steps", "3", "--warmup", "1", "--pipeline", "on", "--speculative", "ngram", "-k", "3"]
    args += ["--dense-cpus", str(cpus[0]), "--shard-cpus", str(cpus[1])]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert (result["acceptance"], result["acceptance_rates"], result["device"]) == ("real", None, "cpu")
    (p,) = result["points"]
    assert p["off_tokens_per_step"] == 4 and "expected_tau" not in p and "spec_gpu_step_ms" not in p
    assert 1 <= p["tau"] <= 4 and 0 <= p["drafts_kept"] <= 1
    assert p["spec_tokens_per_step"] == pytest.approx(4 * p["tau"])
    _check_auto(result, p, steps=3)
    res = CliRunner().invoke(main, [*args, "--acceptance", "0.5"])
    assert res.exit_code == 1 and "--acceptance is an emulated device's" in res.output


def test_cli_bench_split_emulated_needs_speculative(model_factory: Callable, tmp_path: Path) -> None:
    args = ["bench", "split", "--model", str(model_factory("llama")), "--contexts", "16"]
    res = CliRunner().invoke(main, [*args, "--speculative", "ngram", "--plot", str(tmp_path / "x.png")])
    assert res.exit_code == 2 and "no plot for the speculative comparison" in res.output
    res = CliRunner().invoke(main, [*args, "--device", "emulated:h100"])
    assert res.exit_code == 1 and "compares --speculative" in res.output
    res = CliRunner().invoke(main, [*args, "--device", "emulated:z9", "--speculative", "ngram"])
    assert res.exit_code == 1 and "unknown GPU profile 'z9'" in res.output
    res = CliRunner().invoke(main, [*args, "--speculative", "ngram", "--acceptance", "0.5,2"])
    assert res.exit_code == 2 and "rates in [0, 1]" in res.output


def test_cli_bench_pace_speculative(model_factory: Callable) -> None:
    args = ["bench", "pace", "--json", "--model", str(model_factory("llama")), "-B", "4", "-P", "1"]
    args += [
        "-K",
        "1",
        "--geometry",
        "checkpoint",
        "--prompt-len",
        "4",
        "--gen-len",
        "96",  # the client's marks trail the fleet: a longer run keeps steps inside the window
        "--echo-repeats",
        "5",
    ]
    args += ["--idle-seconds", "0.2", "--speculative", "ngram", "-k", "3"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["acceptance"] == "emulated"
    off, spec = result["points"]
    assert (off["speculative"], spec["speculative"]) == ("off", "ngram")
    assert spec["acceptance_rates"] == list(RECORDED_ACCEPTANCE) and spec["num_speculative_tokens"] == 3
    assert off["tau"] == 1.0 and off["drafts_per_row"] == 0.0
    for p in (off, spec):
        assert math.isfinite(p["decode_tokens_per_s"]) and p["decode_tokens_per_s"] > 0
        assert p["round_trips_per_token"] > 0
    # the scheduler's n-gram drafter found drafts on the emulated device's repeating tokens
    assert spec["rows_with_drafts_per_step"] > 0 and 1 < spec["drafts_per_row"] <= 3, result
    assert 1 < spec["tau"] <= 4
    assert spec["speedup"] == pytest.approx(spec["decode_tokens_per_s"] / off["decode_tokens_per_s"])
    assert spec["round_trips_per_token"] < off["round_trips_per_token"]
    assert spec["round_trips_per_token_ratio"] == pytest.approx(
        spec["round_trips_per_token"] / off["round_trips_per_token"]
    )
