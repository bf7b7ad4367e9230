"""`fastdecode plan --acceptance / --acceptance-length` (fastdecode/planning/spec_plan.py): the
operating point with speculative drafts and without, from the planner's model, on synthetic profiles
of a GPU (T flat in the positions) and of a CPU (T growing with every position)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fastdecode.cli.policy import plan_cmd
from fastdecode.planning.planner import Profile, plan
from fastdecode.planning.spec_plan import drafted_profile, parse_rates, plan_speculative
from fastdecode.runtime.errors import InvalidInput
from fastdecode.spec.controller import ATTEND_PER_POSITION

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
N, S = 32, 8192
NGRAM = [0.6528, 0.5972, 0.5, 0.5]  # bench spec's ngram rates: tau 2.75 at k = 3


@pytest.fixture
def gpu() -> Profile:
    """T(B) flat to B = 125 positions, then 1.6 us a position; long attention."""
    t = {b: max(2e-4, 1.6e-6 * b) for b in SIZES}
    return Profile(t_dense=t, r_attn=1e-8, num_layers=N, kv_bytes_per_token=2 * N * 8 * 128 * 2)


@pytest.fixture
def cpu() -> Profile:
    """T(B) = 10 us a position from the first: every draft costs as much as a row."""
    return Profile(
        t_dense={b: 1e-5 * b for b in SIZES[:8]}, r_attn=1e-9, num_layers=N, kv_bytes_per_token=4096
    )


def test_a_drafted_profile_costs_k_plus_one_positions_a_row(gpu: Profile) -> None:
    d = drafted_profile(gpu, 3)
    assert d.t_at(32) == pytest.approx(gpu.t_at(128)) and d.t_at(256) == pytest.approx(gpu.t_at(1024))
    assert d.r_attn == pytest.approx(gpu.r_attn * (1 + 3 * ATTEND_PER_POSITION))
    assert drafted_profile(gpu, 0) is gpu


def test_shard_bound_drafts_pay_and_the_planner_takes_all_of_them(gpu: Profile) -> None:
    sp = plan_speculative(gpu, S, 3, rates=NGRAM, shards=1)
    assert sp.plain.tokens_per_s == pytest.approx(plan(gpu, S, shards=1).predicted_tokens_per_s)
    assert sp.chosen.k == 3 and sp.chosen.tau == pytest.approx(2.75)
    assert sp.ratio == pytest.approx(sp.chosen.tokens_per_s / sp.plain.tokens_per_s) and sp.ratio > 1.8
    assert [p.k for p in sp.points] == [0, 1, 2, 3]
    tps = [p.tokens_per_s for p in sp.points]
    assert tps == sorted(tps)  # each draft pays more than it costs


def test_a_cpu_s_part_pays_for_every_draft_and_none_is_chosen(cpu: Profile) -> None:
    for shards in (None, 1):
        sp = plan_speculative(cpu, 1024, 3, rates=NGRAM, shards=shards)
        assert sp.chosen.k == 0 and sp.ratio == 1.0
        assert all(p.tokens_per_s < sp.plain.tokens_per_s for p in sp.points[1:])


def test_falling_acceptance_lowers_k(gpu: Profile) -> None:
    ks = [plan_speculative(gpu, S, 3, rates=r, shards=1).chosen.k for r in ([0.9], [0.5, 0.1], [0.05])]
    assert ks == [3, 1, 0]


def test_with_shards_free_drafts_save_shards(gpu: Profile) -> None:
    sp = plan_speculative(gpu, S, 3, rates=NGRAM)
    at3 = sp.points[3]
    assert at3.shards < sp.plain.shards and at3.tokens_per_s_per_shard > sp.plain.tokens_per_s_per_shard


def test_an_acceptance_length_scores_k_against_none(gpu: Profile) -> None:
    sp = plan_speculative(gpu, S, 4, tau=3.0, shards=1)
    assert [p.k for p in sp.points] == [0, 4] and sp.chosen.k == 4 and sp.chosen.tau == 3.0
    with pytest.raises(InvalidInput, match=r"in \[1, 5\]"):
        plan_speculative(gpu, S, 4, tau=5.5)
    with pytest.raises(InvalidInput, match="one of them"):
        plan_speculative(gpu, S, 4, tau=2.0, rates=[0.5])
    with pytest.raises(InvalidInput, match="rates in"):
        parse_rates("0.5,1.2")


def test_a_latency_budget_counts_s_over_tau_steps(gpu: Profile) -> None:
    budget = 106.0  # 2 * N * S * T(B) seconds: B = 64 fits (104.9), B = 128 does not (107.4)
    assert plan(gpu, S, shards=1).batch_size == 128  # without the budget
    sp = plan_speculative(gpu, S, 3, rates=NGRAM, shards=1, latency_budget_s=budget)
    assert sp.plain.batch_size == 64 and sp.chosen.k == 3
    # S / tau steps of T(B * 4) each: B = 64 fits at 2.75 times the budget where B = 128 does not
    assert sp.chosen.batch_size == 64 and sp.chosen.latency_s < sp.plain.latency_s


def _cli() -> click.Group:
    group = click.Group()
    group.add_command(plan_cmd)
    return group


def test_plan_cli_reports_both_points_and_the_ratio(tmp_path: Path, gpu: Profile) -> None:
    f = tmp_path / "p.json"
    gpu.save(f)
    args = ["plan", "--profile", str(f), "-S", str(S), "-P", "1"]
    res = CliRunner().invoke(_cli(), [*args, "--acceptance", "0.6528,0.5972,0.5", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    spec = d["speculation"]
    assert spec["chosen"]["k"] == 3 and spec["chosen"]["tau"] == pytest.approx(2.75)
    assert spec["plain"]["tokens_per_s"] == pytest.approx(d["predicted_tokens_per_s"])
    assert spec["ratio"] == pytest.approx(spec["chosen"]["tokens_per_s"] / spec["plain"]["tokens_per_s"])
    assert {"batch_size", "shards", "tokens_per_s"} <= set(spec["chosen"])
    res = CliRunner().invoke(_cli(), [*args, "--acceptance-length", "2.5", "-k", "4"])
    assert res.exit_code == 0, res.output
    assert "without drafts    B 128, P 1," in res.output
    assert "with drafts       k 4 of 4 pays most: tau 2.500, B 32, P 1," in res.output
    ratio = plan_speculative(gpu, S, 4, tau=2.5, shards=1).ratio
    assert f"{ratio:.2f}x" in res.output
    res = CliRunner().invoke(_cli(), ["plan", "--profile", str(f)])
    assert res.exit_code == 0 and "with drafts" not in res.output  # only when asked


def test_plan_cli_says_when_no_draft_pays_and_refuses_bad_combinations(tmp_path: Path, cpu: Profile) -> None:
    f = tmp_path / "p.json"
    cpu.save(f)
    res = CliRunner().invoke(_cli(), ["plan", "--profile", str(f), "--acceptance", "0.9,0.8"])
    assert res.exit_code == 0, res.output
    assert "no k of 1..3 pays" in res.output and "1.00x" in res.output
    both = ["--acceptance", "0.5", "--acceptance-length", "2"]
    res = CliRunner().invoke(_cli(), ["plan", "--profile", str(f), *both])
    assert res.exit_code != 0 and "not both" in res.output
    res = CliRunner().invoke(_cli(), ["plan", "--profile", str(f), "--acceptance-length", "9"])
    assert res.exit_code != 0 and "in [1, 4]" in res.output
    res = CliRunner().invoke(_cli(), ["plan", "--profile", str(f), "--acceptance", "x"])
    assert res.exit_code != 0 and "rates in [0, 1]" in res.output
    res = CliRunner().invoke(_cli(), ["plan", "--gpu", "h100", "--acceptance", "0.5"])
    assert res.exit_code != 0 and "plan from a profile" in res.output
