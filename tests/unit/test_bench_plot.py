"""`bench fleet --plot`: a valid PNG with a throughput and a latency panel per compared system."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from fastdecode.benchmarks import fleet_bench
from fastdecode.benchmarks.plot import fleet_bench_figure, plot_fleet_bench
from fastdecode.cli import main


def bench_result(systems: tuple[str, ...] = ("hf", "local", "fleet")) -> dict[str, Any]:
    """A result shaped like run_fleet_bench's: its own _summary over synthetic samples."""
    rng = random.Random(0)
    out: dict[str, Any] = {
        "model": "/models/small-llama", "batch": 8, "shards": 2, "prompt_len": 16, "gen_len": 32,
        "device": "cpu", "pipeline": "auto", "predicted_step_ms": 9.0, "measured_step_ms": 10.0,
    }  # fmt: skip
    for i, name in enumerate(systems):
        itl = [rng.lognormvariate(-4 - i * 0.3, 0.4) for _ in range(200)]
        out.update(fleet_bench._summary(name, 8 * 32, 1.5 + i, [0.05], itl))
    return out


def test_figure_has_a_throughput_and_a_latency_panel() -> None:
    result = bench_result()
    fig = fleet_bench_figure(result)
    throughput, latency = fig.axes
    assert [t.get_text() for t in throughput.get_xticklabels()] == ["transformers", "LocalEngine", "fleet"]
    heights = [p.get_height() for p in throughput.patches]
    assert heights == pytest.approx([result[f"{s}_tokens_per_s"] for s in ("hf", "local", "fleet")])
    assert [p.get_height() for p in latency.patches] == pytest.approx(
        [result[f"{s}_itl_p50_ms"] for s in ("hf", "local", "fleet")]
    )
    title = fig.get_suptitle()
    assert "small-llama" in title and "batch 8" in title and "16+32" in title and "2 shards" in title


def test_plot_writes_a_valid_png(tmp_path: Path) -> None:
    out = plot_fleet_bench(bench_result(("local", "fleet")), tmp_path / "bench.png")  # as with --skip-hf
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn


def test_plot_rejects_a_result_without_systems(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no system"):
        plot_fleet_bench({"batch": 1}, tmp_path / "x.png")


def test_cli_bench_fleet_plot_checks_the_directory_first(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["bench", "fleet", "--plot", str(tmp_path / "no" / "dir.png")])
    assert res.exit_code != 0 and "does not exist" in res.output
