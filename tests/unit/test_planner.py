"""Planner equations on a synthetic profile, profile I/O, the plot, and the two CLI commands."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from fastdecode.cli.policy import plan_cmd, simulate_cmd
from fastdecode.planning import planner
from fastdecode.planning.planner import Profile, plan
from fastdecode.runtime.errors import InvalidInput

# T(B) = max(0.2 ms, 1.6 us * B) per layer: latency-bound (flat) up to B = 125, compute-bound after,
# so E(B) = B / T(B) doubles with B up to 128 and then stays flat.
T = {b: max(2e-4, 1.6e-6 * b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)}
R = 1e-8  # s per new token per cached token, one shard, one layer
N, S = 32, 1024


@pytest.fixture
def prof() -> Profile:
    return Profile(
        t_dense=T, r_attn=R, num_layers=N, kv_bytes_per_token=2 * N * 8 * 128 * 2, device="synthetic"
    )


def test_knee_ignores_one_noisy_sample() -> None:
    # T(2) measured slow on a busy machine: E dips at 2, then keeps climbing until 64.
    t = {1: 2.0, 2: 4.3, 4: 3.5, 8: 3.6, 16: 4.7, 32: 6.8, 64: 11.0, 128: 21.5}
    noisy = Profile(
        t_dense={b: v * 1e-3 for b, v in t.items()}, r_attn=1e-7, num_layers=12, kv_bytes_per_token=1
    )
    assert planner.knee(noisy) == 64


def test_knee_is_where_efficiency_gain_drops_below_5_percent(prof: Profile) -> None:
    eff = {b: b / t for b, t in T.items()}
    assert eff[128] / eff[64] > 1.05 > eff[256] / eff[128]  # +95%, then +0%
    assert planner.knee(prof) == 128


def test_plan_without_bounds_balances_shards(prof: Profile) -> None:
    p = plan(prof, S)
    assert p.batch_size == 128 and p.limiting_factor == "gpu-efficiency"
    t = T[128]  # 0.2048 ms
    assert p.p_balance == pytest.approx(128 * S * R / (2 * t))  # = 3.2
    assert p.shards == 4 and p.shards_set_by == "balance"
    step = N * max(t, 128 * S * R / (2 * 4))  # the GPU side: 6.5536 ms
    assert p.predicted_step_ms == pytest.approx(step * 1e3) == pytest.approx(6.5536)
    assert p.predicted_tokens_per_s == pytest.approx(128 / step)
    assert p.paper_latency_s == pytest.approx(2 * N * S * t)


def test_latency_budget_takes_the_largest_batch_that_fits(prof: Profile) -> None:
    # 2*N*S*T(B) <= L: 13.107 s at B <= 64, 13.42 s at B = 128
    p = plan(prof, S, latency_budget_s=13.3)
    assert p.batch_size == 64 and p.limiting_factor == "latency"
    assert plan(prof, S, latency_budget_s=1000).batch_size == 1024  # loose: the largest measured
    with pytest.raises(InvalidInput):
        plan(prof, S, latency_budget_s=1.0)


def test_memory_sets_shards_when_it_needs_more_than_balance(prof: Profile) -> None:
    # C tokens per shard from bytes; memory: B*S/2 <= C*P -> P >= 128*1024/2 / 10000 = 6.55
    c = 10_000
    p = plan(prof, S, shard_memory_bytes=c * prof.kv_bytes_per_token)
    assert p.kv_tokens_per_shard == c
    assert p.p_memory == pytest.approx(128 * S / (2 * c))
    assert p.shards == 7 and p.shards_set_by == "memory"


def test_fixed_shards_memory_then_balance_limit(prof: Profile) -> None:
    c = 10_000
    p = plan(prof, S, shard_memory_bytes=c * prof.kv_bytes_per_token, shards=2)
    # 2 shards hold 20000 tokens: B*1024/2 <= 20000 -> B <= 39 -> 32
    assert p.batch_size == 32 and p.limiting_factor == "memory"
    p = plan(prof, S, shards=1)
    # R-part 128*1024*1e-8/2 = 0.655 ms > T(128) = 0.205 ms: CPU-bound
    assert p.limiting_factor == "balance"
    assert p.predicted_step_ms == pytest.approx(N * 128 * S * R / 2 * 1e3)


def test_t_at_interpolates_and_extrapolates(prof: Profile) -> None:
    assert prof.t_at(384) == pytest.approx(1.6e-6 * 384)
    assert prof.t_at(2048) == pytest.approx(1.6e-6 * 2048)
    assert prof.t_at(1) == T[1] and prof.t_at(0) == T[1]


def test_profile_roundtrip_and_validation(tmp_path: Path, prof: Profile) -> None:
    f = tmp_path / "p.json"
    prof.save(f)
    assert Profile.load(f) == prof
    assert json.loads(f.read_text())["t_dense"]["64"] == T[64]
    f.write_text("{}")
    with pytest.raises(InvalidInput):
        Profile.load(f)
    with pytest.raises(InvalidInput):
        Profile(t_dense={}, r_attn=1, num_layers=1, kv_bytes_per_token=1)


def test_plot(tmp_path: Path, prof: Profile) -> None:
    out = tmp_path / "plan.png"
    planner.plot_plan(prof, plan(prof, S), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ CLI


def cli() -> click.Group:
    g = click.Group()
    g.add_command(simulate_cmd)
    g.add_command(plan_cmd)
    return g


def test_plan_cli_json(tmp_path: Path, prof: Profile) -> None:
    f = tmp_path / "p.json"
    prof.save(f)
    png = tmp_path / "x.png"
    res = CliRunner().invoke(
        cli(), ["plan", "--profile", str(f), "--seq-len", "1024", "--json", "--plot", str(png)]
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    for key in ("batch_size", "shards", "predicted_step_ms", "predicted_tokens_per_s", "limiting_factor"):
        assert key in d
    assert (d["batch_size"], d["shards"]) == (128, 4) and png.exists()
    res = CliRunner().invoke(cli(), ["plan", "--profile", str(f)])
    assert res.exit_code == 0 and "limiting factor" in res.output


def test_simulate_cli_json_and_compare() -> None:
    args = ["simulate", "--batch", "8", "--gen-len", "16", "--shards", "2", "--requests", "24"]
    res = CliRunner().invoke(cli(), [*args, "--json", "--admission", "naive"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    for key in (
        "tokens_per_s",
        "latency_p50_s",
        "latency_p99_s",
        "peak_kv_load",
        "mean_kv_load",
        "imbalance_max_over_mean",
    ):
        assert key in d
    assert d["tokens"] == 24 * 16
    res = CliRunner().invoke(cli(), [*args, "--compare"])
    assert res.exit_code == 0 and "stabilized/naive" in res.output


def test_simulate_cli_bad_workload(tmp_path: Path) -> None:
    f = tmp_path / "w.json"
    f.write_text('[{"arrival_s": 0}]')
    res = CliRunner().invoke(cli(), ["simulate", "--workload", str(f)])
    assert res.exit_code != 0 and "workload row 0" in res.output


def test_measure_on_a_tiny_model(tmp_path: Path) -> None:
    from fastdecode.tools.checkpoint import make_model  # first-party: a broken import fails, never skips

    d = make_model("llama", "tiny", tmp_path / "m", seed=1)
    t = planner.measure_dense(d, [1, 4], "cpu", repeats=2, warmup=1)
    assert set(t) == {1, 4} and all(v > 0 for v in t.values())
    for kv_dtype in (torch.float32, torch.bfloat16, torch.int8):
        r = planner.measure_attention(
            2, 4, 16, context=32, batch=2, repeats=2, warmup=1, kv_dtype=kv_dtype, flush_bytes=1 << 20
        )
        assert 0 < r < 1e-3


def test_step_head_is_added_once_per_step_and_survives_json(tmp_path: Path) -> None:
    p = Profile(t_dense={8: 1e-3, 16: 2e-3}, r_attn=1e-9, num_layers=4, kv_bytes_per_token=64)
    without = planner.predicted_step_s(p, 16, 1, 100, overlap=False)
    p.t_head = {8: 4e-3, 16: 6e-3}
    assert p.head_at(12) == pytest.approx(5e-3)
    assert planner.predicted_step_s(p, 16, 1, 100, overlap=False) == pytest.approx(without + 6e-3)
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").t_head == p.t_head


def test_dense_times_walk_the_layers() -> None:
    """T(B) is timed over different layers, as a step walks them, not one layer's cached weights."""
    from types import SimpleNamespace

    seen: list[int] = []

    class Recorder:
        config = SimpleNamespace(num_attention_heads=2, head_dim=4, vocab_size=8, num_hidden_layers=3)

        def embed(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(len(ids), 8)

        def pre_attention(self, layer: int, h: torch.Tensor, pos: torch.Tensor) -> None:
            seen.append(layer)

        def post_attention(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> None:
            pass

    t = planner._dense_times(Recorder(), [1, 2], "cpu", repeats=2, warmup=1)
    assert set(t) == {1, 2} and all(v > 0 for v in t.values())
    assert seen == [0, 1, 2, 0, 1, 2]


def test_plan_knows_windowed_layers(tmp_path: Path) -> None:
    """Gemma 3's shape (18 layers, window 512, five windowed to one global) at S = 4096: a sequence
    ends holding <= 0.3x of full attention, so one shard memory holds more sequences and fewer
    shards balance the same batch."""
    kv_token = 2 * 18 * 1 * 256 * 2
    full = Profile(t_dense=T, r_attn=R, num_layers=18, kv_bytes_per_token=kv_token)
    with pytest.raises(InvalidInput, match="layer windows for 18 layers"):
        Profile(t_dense=T, r_attn=R, num_layers=18, kv_bytes_per_token=1, layer_windows=[512] * 5 + [0])
    gemma = Profile(
        t_dense=T, r_attn=R, num_layers=18, kv_bytes_per_token=kv_token, layer_windows=([512] * 5 + [0]) * 3
    )
    a, b = (
        plan(full, 4096, shard_memory_bytes=64 * 4096 * kv_token),
        plan(gemma, 4096, shard_memory_bytes=64 * 4096 * kv_token),
    )
    assert a.kv_held_ratio == 1.0 and b.kv_held_ratio <= 0.3
    assert b.kv_held_ratio == pytest.approx((1 + 5 * 512 / 4096) / 6)
    assert a.mean_held_tokens == 2048 and b.mean_held_tokens < 0.4 * 2048
    assert b.p_memory == pytest.approx(a.p_memory * b.mean_held_tokens / 2048)
    assert b.p_balance < a.p_balance
    f = tmp_path / "p.json"
    full.save(f)
    res = CliRunner().invoke(
        cli(),
        ["plan", "--profile", str(f), "-S", "4096", "--layer-windows", "512,512,512,512,512,0", "--json"],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["kv_held_ratio"] == pytest.approx(b.kv_held_ratio)
    res = CliRunner().invoke(
        cli(), ["plan", "--profile", str(f), "-S", "4096", "--layer-windows", "512,0,0,0,0"]
    )
    assert res.exit_code != 0 and "divides" in res.output
    res = CliRunner().invoke(
        cli(), ["plan", "--profile", str(f), "-S", "4096", "--layer-windows", "512,512,512,512,512,0"]
    )
    assert res.exit_code == 0 and "KV held / seq    0.271 of full attention" in res.output, res.output
